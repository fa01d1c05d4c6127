//! No false alarms: a block may return constants (no gradient to lose),
//! whatever way it builds them.

use candle_core::{DType, Device, Result, Tensor, Var};
use remat_runtime::{backward, remat, Plan, Region, RematError};

use crate::common::{rel_diff, var, weighted_loss};

remat! {
    fn exp_and_zeros(x: &Tensor) -> Result<(Tensor, Tensor)> {
        let y = x.exp()?;
        Ok((y, Tensor::zeros(3, x.dtype(), x.device())?))
    }
}

remat! {
    fn only_zeros(x: &Tensor) -> Result<Tensor> {
        let z = Tensor::zeros(x.shape(), x.dtype(), x.device())?;
        Ok(z)
    }
}

#[test]
fn a_block_may_return_constants() {
    for dtype in [DType::F32, DType::F64] {
        for plan in [Plan::recompute_all(), Plan::save_all(), Plan::off()] {
            let x = var(&[4, 5], 1, 1.0, dtype);
            let (y, z) = plan.scope(|| exp_and_zeros(x.as_tensor())).unwrap();
            assert_eq!(z.dims(), &[3]);
            let g = backward(&(y.sum_all().unwrap() + z.sum_all().unwrap()).unwrap()).unwrap();
            let expected = x.as_tensor().exp().unwrap();
            assert!(rel_diff(g.get(&x).unwrap(), &expected) < 1e-6, "{plan}");
            let z = plan.scope(|| only_zeros(x.as_tensor())).unwrap();
            assert_eq!(
                z.to_dtype(DType::F64)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap(),
                0.0
            );
        }
    }
}

#[test]
fn the_statement_api_may_return_constants_but_not_ops_on_tracked_values() {
    for dtype in [DType::F32, DType::F64] {
        let x = var(&[4, 5], 2, 1.0, dtype);
        // A constant beside a statement's output, on the region's first
        // forward (which looks at every value) and on later ones.
        for _ in 0..2 {
            let (y, z): (Tensor, Tensor) = Region::new("api")
                .run(&[x.as_tensor()], move |ctx, ins| {
                    let y = ctx.recompute("sq", &[&ins[0]], |t| t[0].sqr())?;
                    Ok((y, Tensor::ones(2, dtype, &Device::Cpu)?))
                })
                .unwrap();
            assert_eq!(
                z.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap(),
                vec![1.0, 1.0]
            );
            let g = backward(&(y.sum_all().unwrap() + z.sum_all().unwrap()).unwrap()).unwrap();
            let expected = (x.as_tensor() * 2.0).unwrap();
            assert!(rel_diff(g.get(&x).unwrap(), &expected) < 1e-12);
        }
        // An op on the input outside any statement loses its gradient: the
        // region's first forward sees it (its inputs are leaves there).
        let w = Var::ones(3, dtype, &Device::Cpu).unwrap();
        let e = Region::new("outside")
            .run(&[x.as_tensor()], |_ctx, ins| Ok(ins[0].exp()?))
            .unwrap_err();
        assert!(
            matches!(e, RematError::OutputOutsideStatement { index: 0, .. }),
            "{e:?}"
        );
        // So is an op on a parameter, on any forward.
        let wt = w.as_tensor().clone();
        for _ in 0..2 {
            let wt = wt.clone();
            let e = Region::new("outside.param")
                .run(&[x.as_tensor()], move |ctx, ins| {
                    let y = ctx.recompute("sq", &[&ins[0]], |t| t[0].sqr())?;
                    Ok((y, wt.exp()?))
                })
                .map(|_: (Tensor, Tensor)| ())
                .unwrap_err();
            assert!(
                matches!(e, RematError::OutputOutsideStatement { index: 1, .. }),
                "{e:?}"
            );
        }
    }
}

remat! {
    /// Saved statements whose outputs are views of the block's input.
    fn saved_views(x: &Tensor) -> Result<(bool, bool)> {
        #[save] let t = x.t()?;
        #[save] let n = x.narrow(1, 1, 2)?;
        let seen = (t.is_contiguous(), n.is_contiguous());
        Ok(seen)
    }
}

#[test]
fn saved_views_stay_views() {
    // The block sees the views its saved statements made, not copies.
    let x = var(&[4, 5], 3, 1.0, DType::F32);
    for plan in [Plan::declared(), Plan::save_all()] {
        let seen = plan.scope(|| saved_views(x.as_tensor())).unwrap();
        assert_eq!(seen, (false, false), "{plan}");
    }
    // The statement API, after the region's first forward (which hands the
    // block copies of every value that needs gradients, to look for
    // undeclared reads): views.
    for call in 0..2 {
        let y: (Tensor, Tensor) = Region::new("views")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let t = ctx.save("t", &[&ins[0]], |t| t[0].t())?;
                let n = ctx.save("n", &[&ins[0]], |t| t[0].narrow(1, 1, 2))?;
                if !ctx.is_replay() {
                    let copies = call == 0;
                    assert_eq!((t.is_contiguous(), n.is_contiguous()), (copies, copies));
                }
                let a = ctx.recompute("a", &[&t], |t| t[0].exp())?;
                let b = ctx.recompute("b", &[&n], |t| t[0].sqr())?;
                Ok((a, b))
            })
            .unwrap();
        let g = backward(&(y.0.sum_all().unwrap() + y.1.sum_all().unwrap()).unwrap()).unwrap();
        let plain = (x.as_tensor().t().unwrap().exp().unwrap().sum_all().unwrap()
            + x.as_tensor()
                .narrow(1, 1, 2)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap())
        .unwrap();
        let pg = plain.backward().unwrap();
        assert!(rel_diff(g.get(&x).unwrap(), pg.get(&x).unwrap()) < 1e-6);
    }
}

remat! {
    /// A ramp and a causal mask built from the input's metadata only, read
    /// by the statements around them.
    fn ramp_and_mask(x: &Tensor) -> Result<Tensor> {
        let t = x.dim(1)?;
        let ramp = Tensor::arange(0u32, t as u32, x.device())?.to_dtype(x.dtype())?;
        let mask = Tensor::tril2(t, x.dtype(), x.device())?;
        let h = x.broadcast_add(&ramp)?;
        let m = h.matmul(&mask)?;
        let y = (m * &h)?;
        Ok(y)
    }
}

#[test]
fn constants_from_an_inputs_metadata_under_every_plan() {
    let names = ["t", "ramp", "mask", "h", "m", "y"];
    for dtype in [DType::F32, DType::F64] {
        let x = var(&[3, 4], 4, 1.0, dtype);
        let plain = {
            let t = 4usize;
            let ramp = Tensor::arange(0u32, t as u32, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let mask = Tensor::tril2(t, dtype, &Device::Cpu).unwrap();
            let h = x.as_tensor().broadcast_add(&ramp).unwrap();
            let y = (h.matmul(&mask).unwrap() * &h).unwrap();
            let g = backward(&y.sum_all().unwrap()).unwrap();
            (y.detach(), g.get(&x).unwrap().clone())
        };
        let mut plans = vec![Plan::declared(), Plan::save_all(), Plan::recompute_all()];
        plans.extend(names.iter().map(|n| Plan::save_only([*n])));
        plans.push(Plan::save_only(["ramp", "mask"]));
        plans.push(Plan::save_only(["ramp", "m"]));
        for plan in plans {
            let y = plan.scope(|| ramp_and_mask(x.as_tensor())).unwrap();
            assert!(rel_diff(&y, &plain.0) < 1e-12, "{plan}");
            let g = backward(&y.sum_all().unwrap())
                .unwrap_or_else(|e| panic!("{plan} ({dtype:?}): {e}"));
            assert!(rel_diff(g.get(&x).unwrap(), &plain.1) < 1e-6, "{plan}");
        }
    }
}

/// The plans a block's gradients are compared under, each with whether it
/// runs with offloaded residuals moved as on a GPU.
fn every_plan(
    saved: &'static [&'static str],
    offloaded: &'static [&'static str],
) -> Vec<(Plan, bool)> {
    vec![
        (Plan::off(), false),
        (Plan::declared(), false),
        (Plan::recompute_all(), false),
        (Plan::save_all(), false),
        (Plan::save_only(saved.iter().copied()), false),
        (
            Plan::save_and_offload_only(saved.iter().copied(), offloaded.iter().copied()),
            true,
        ),
        (Plan::budget(0.5), false),
    ]
}

/// Loss and gradients of `inputs` through `f` under `plan`, twice (a
/// first and a later forward), the second's.
fn grads_under(
    plan: &Plan,
    swap: bool,
    inputs: &[&Var],
    f: &dyn Fn() -> Result<Tensor>,
) -> std::result::Result<Vec<Tensor>, String> {
    let mut out = Vec::new();
    for _ in 0..2 {
        let run = || plan.scope(f).map_err(|e| e.to_string());
        let y = if swap {
            remat_runtime::offload::swap_on_cpu(run)
        } else {
            run()
        }?;
        let g = backward(&weighted_loss(&y)).map_err(|e| e.to_string())?;
        out = inputs.iter().map(|v| g.get(v).unwrap().clone()).collect();
    }
    Ok(out)
}

/// Every plan's gradients against plain candle's.
fn agrees_with_plain(
    what: &str,
    dtype: DType,
    plans: Vec<(Plan, bool)>,
    inputs: &[&Var],
    plain: &dyn Fn() -> Result<Tensor>,
    block: &dyn Fn() -> Result<Tensor>,
) {
    let g = backward(&weighted_loss(&plain().unwrap())).unwrap();
    let expected: Vec<Tensor> = inputs.iter().map(|v| g.get(v).unwrap().clone()).collect();
    // The same ops on the same values; only the order in which the
    // backward adds the contributions of a value read twice differs.
    let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
    for (plan, swap) in plans {
        let got = grads_under(&plan, swap, inputs, block)
            .unwrap_or_else(|e| panic!("{what}, {dtype:?}, plan {plan}: {e}"));
        for (i, (a, b)) in got.iter().zip(&expected).enumerate() {
            let d = rel_diff(a, b);
            assert!(
                d < tol,
                "{what}, {dtype:?}, plan {plan}: input {i} off by {d:e}"
            );
        }
    }
}

remat! {
    fn chunks(x: &Tensor, w: &Var) -> Result<Tensor> {
        let parts = x.matmul(w)?.chunk(3, 1)?;
        let q = parts[0].tanh()?;
        let k = parts.get(1).unwrap().exp()?;
        let v = (parts.last().unwrap() * 2.0)?;
        Ok(((q * k)? + v)?)
    }
}

fn chunks_plain(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let parts = x.matmul(w)?.chunk(3, 1)?;
    let (q, k, v) = (parts[0].tanh()?, parts[1].exp()?, (&parts[2] * 2.0)?);
    (q * k)? + v
}

remat! {
    fn slice_and_tuple(xs: &[Tensor], w: &Var) -> Result<Tensor> {
        let a = xs[0].matmul(w)?;
        let pair = (a.tanh()?, (&xs[1] * 3.0)?);
        #[save] let s = pair.0.sin()?;
        let c = (&pair.1 + xs[1].sqr()?)?;
        Ok((s + c)?)
    }
}

fn slice_and_tuple_plain(xs: &[&Tensor], w: &Tensor) -> Result<Tensor> {
    let a = xs[0].matmul(w)?;
    let (t, u) = (a.tanh()?, (xs[1] * 3.0)?);
    t.sin()? + (u + xs[1].sqr()?)?
}

#[test]
fn a_statement_reading_one_part_of_a_value_gets_its_gradients() {
    for dtype in [DType::F32, DType::F64] {
        let x = var(&[4, 6], 1, 1.0, dtype);
        let w = var(&[6, 6], 2, 0.5, dtype);
        agrees_with_plain(
            "chunks",
            dtype,
            every_plan(&["parts", "k"], &["q"]),
            &[&x, &w],
            &|| chunks_plain(x.as_tensor(), w.as_tensor()),
            &|| chunks(x.as_tensor(), &w),
        );
        let (a, b) = (var(&[3, 6], 3, 1.0, dtype), var(&[3, 6], 4, 1.0, dtype));
        let xs = [a.as_tensor().clone(), b.as_tensor().clone()];
        agrees_with_plain(
            "a slice and a tuple",
            dtype,
            every_plan(&["a", "pair"], &["c"]),
            &[&a, &b, &w],
            &|| slice_and_tuple_plain(&[a.as_tensor(), b.as_tensor()], w.as_tensor()),
            &|| slice_and_tuple(&xs, &w),
        );
    }
}

remat! {
    fn part_through_a_cut(x: &Tensor, w: &Var, g: &Tensor) -> Result<Tensor> {
        let parts = x.matmul(w)?.chunk(2, 1)?;
        let y = x.narrow(1, 0, 3)?.exp()?;
        let q = (candle_nn::ops::rms_norm(&parts[0].contiguous()?, g, 1e-5)? + &y)?;
        Ok((q + &parts[1])?)
    }
}

#[test]
fn a_part_read_only_through_an_op_without_backward_is_still_a_cut() {
    let x = var(&[4, 6], 1, 1.0, DType::F32);
    let w = var(&[6, 6], 2, 0.5, DType::F32);
    let g = Tensor::ones(3, DType::F32, &Device::Cpu).unwrap();
    for plan in [Plan::off(), Plan::recompute_all(), Plan::save_all()] {
        let err = plan
            .scope(|| part_through_a_cut(x.as_tensor(), &w, &g))
            .and_then(|y| Ok(backward(&y.sum_all()?)?))
            .expect_err("a cut");
        assert!(
            err.to_string()
                .contains("statement `q`: `parts` (input 0, shape [4, 3])"),
            "{plan}: {err}"
        );
    }
}

remat! {
    fn maybe_cross(x: &Tensor, w: &Var, enc: Option<&Tensor>) -> Result<Tensor> {
        let h = x.matmul(w)?;
        let h = match enc {
            Some(e) => (&h + e.matmul(w)?.tanh()?)?,
            None => h,
        };
        #[save] let f = h.exp()?;
        let g = (&h * 0.5)?.sin()?;
        Ok(((&h + f)? + g)?)
    }
}

fn maybe_cross_plain(x: &Tensor, w: &Tensor, enc: Option<&Tensor>) -> Result<Tensor> {
    let mut h = x.matmul(w)?;
    if let Some(e) = enc {
        h = (&h + e.matmul(w)?.tanh()?)?;
    }
    let f = h.exp()?;
    let g = (&h * 0.5)?.sin()?;
    (&h + f)? + g
}

remat! {
    fn passes_an_input(x: &Tensor, w: &Var, skip: bool) -> Result<Tensor> {
        let y = if skip { x.clone() } else { x.matmul(w)? };
        #[save] let f = y.exp()?;
        Ok(((&y * 2.0)? + f)?)
    }
}

fn passes_an_input_plain(x: &Tensor, w: &Tensor, skip: bool) -> Result<Tensor> {
    let y = if skip { x.clone() } else { x.matmul(w)? };
    (&y * 2.0)? + y.exp()?
}

#[test]
fn a_saved_statement_may_give_its_input_back_as_it_is() {
    for dtype in [DType::F32, DType::F64] {
        let x = var(&[4, 5], 1, 1.0, dtype);
        let w = var(&[5, 5], 2, 0.5, dtype);
        let e = var(&[4, 5], 3, 1.0, dtype);
        for cross in [false, true] {
            let enc = cross.then(|| e.as_tensor().clone());
            let inputs: &[&Var] = if cross { &[&x, &w, &e] } else { &[&x, &w] };
            agrees_with_plain(
                &format!("maybe_cross (cross: {cross})"),
                dtype,
                every_plan(&["h#2", "f"], &["h#2"]),
                inputs,
                &|| maybe_cross_plain(x.as_tensor(), w.as_tensor(), enc.as_ref()),
                &|| maybe_cross(x.as_tensor(), &w, enc.as_ref()),
            );
        }
        let w2 = var(&[5, 5], 4, 0.5, dtype);
        for skip in [false, true] {
            let inputs: &[&Var] = if skip { &[&x] } else { &[&x, &w2] };
            agrees_with_plain(
                &format!("passes_an_input (skip: {skip})"),
                dtype,
                every_plan(&["y"], &["y"]),
                inputs,
                &|| passes_an_input_plain(x.as_tensor(), w2.as_tensor(), skip),
                &|| passes_an_input(x.as_tensor(), &w2, skip),
            );
        }
    }
}

/// A residual stack whose skip connection and bias are optional: the
/// statements read `x`, `bias` and `scale` only on the branches that use
/// them.
#[derive(Clone)]
struct Residual {
    w: Var,
    skip: bool,
}

impl Residual {
    remat! {
        fn forward(&self, x: &Tensor, bias: &Tensor, scale: Option<&Tensor>) -> Result<Tensor> {
            let h = x.matmul(&self.w)?.tanh()?;
            let y = if self.skip { (&h + x)? } else { h.clone() };
            let mut z = y.sqr()?;
            if self.skip {
                z = z.broadcast_add(bias)?;
            }
            let s = match scale {
                Some(s) => z.broadcast_mul(s)?,
                None => (&z * 0.5)?,
            };
            let o = if self.skip {
                if z.dim(0)? > 1 { (&s + &y)? } else { (&s - &y)? }
            } else {
                (&s + &h)?
            };
            Ok(o)
        }
    }

    fn plain(&self, x: &Tensor, bias: &Tensor, scale: Option<&Tensor>) -> Result<Tensor> {
        let h = x.matmul(self.w.as_tensor())?.tanh()?;
        let y = if self.skip { (&h + x)? } else { h.clone() };
        let mut z = y.sqr()?;
        if self.skip {
            z = z.broadcast_add(bias)?;
        }
        let s = match scale {
            Some(s) => z.broadcast_mul(s)?,
            None => (&z * 0.5)?,
        };
        if self.skip {
            &s + &y
        } else {
            &s + &h
        }
    }
}

#[test]
fn a_value_read_only_on_a_branch_not_taken_is_no_cut_under_any_plan() {
    for dtype in [DType::F32, DType::F64] {
        let x = var(&[4, 5], 11, 1.0, dtype);
        let w = var(&[5, 5], 12, 0.5, dtype);
        let bias = var(&[5], 13, 1.0, dtype);
        let scale = var(&[5], 14, 1.0, dtype);
        for skip in [false, true] {
            for scaled in [false, true] {
                let layer = Residual { w: w.clone(), skip };
                let sc = scaled.then(|| scale.as_tensor().clone());
                let mut inputs = vec![&x, &w];
                if skip {
                    inputs.push(&bias);
                }
                if scaled {
                    inputs.push(&scale);
                }
                agrees_with_plain(
                    &format!("residual (skip: {skip}, scaled: {scaled})"),
                    dtype,
                    every_plan(&["y", "s"], &["z"]),
                    &inputs,
                    &|| layer.plain(x.as_tensor(), bias.as_tensor(), sc.as_ref()),
                    &|| layer.forward(x.as_tensor(), bias.as_tensor(), sc.as_ref()),
                );
            }
        }
    }
}

remat! {
    /// A cut on a value read on every branch is still a cut.
    fn cut_on_every_branch(x: &Tensor, h: &Tensor, skip: bool) -> Result<Tensor> {
        let y = if skip {
            (candle_nn::ops::softmax_last_dim(x)? + h)?
        } else {
            (candle_nn::ops::softmax_last_dim(x)? * h)?
        };
        Ok(y)
    }
}

#[test]
fn a_cut_on_a_value_read_on_every_branch_is_still_an_error_under_every_plan() {
    let x = var(&[4, 5], 15, 1.0, DType::F32);
    let h = var(&[4, 5], 16, 1.0, DType::F32);
    // `Plan::off` (first in the list) checks a block's first plain run on a
    // thread only: the first skip.
    for (k, (plan, _)) in every_plan(&["y"], &[]).into_iter().enumerate() {
        for skip in [false, true].into_iter().filter(|&s| k > 0 || !s) {
            let e = match plan.scope(|| cut_on_every_branch(x.as_tensor(), h.as_tensor(), skip)) {
                Err(e) => e.to_string(),
                Ok(y) => match backward(&weighted_loss(&y)) {
                    Err(e) => e.to_string(),
                    Ok(_) => panic!("{plan}, skip {skip}: no error"),
                },
            };
            assert!(
                e.contains("statement `y`: `x` (input 0, shape [4, 5]) needs gradients"),
                "{plan}, skip {skip}: {e}"
            );
        }
    }
}

/// Gradients of `vars` through `f` under `plan` (twice: a first and a
/// later forward; the second's), `None` where a `Var` gets none.
fn presence_under(
    plan: &Plan,
    swap: bool,
    vars: &[&Var],
    f: &dyn Fn() -> Result<Tensor>,
) -> std::result::Result<Vec<Option<Tensor>>, String> {
    let mut out = Vec::new();
    for _ in 0..2 {
        let run = || plan.scope(f).map_err(|e| e.to_string());
        let y = if swap {
            remat_runtime::offload::swap_on_cpu(run)
        } else {
            run()
        }?;
        let g = backward(&weighted_loss(&y)).map_err(|e| e.to_string())?;
        out = vars.iter().map(|v| g.get(v).cloned()).collect();
    }
    Ok(out)
}

/// Every plan against plain candle: the same `Var`s get a gradient, and
/// the same one.
fn same_as_plain(
    what: &str,
    dtype: DType,
    vars: &[&Var],
    plain: &dyn Fn() -> Result<Tensor>,
    block: &dyn Fn() -> Result<Tensor>,
) {
    let g = backward(&weighted_loss(&plain().unwrap())).unwrap();
    let expected: Vec<Option<Tensor>> = vars.iter().map(|v| g.get(v).cloned()).collect();
    let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
    for (plan, swap) in every_plan(&["y", "acc"], &["h"]) {
        let got = presence_under(&plan, swap, vars, block)
            .unwrap_or_else(|e| panic!("{what}, {dtype:?}, plan {plan}: {e}"));
        for (i, (a, b)) in got.iter().zip(&expected).enumerate() {
            match (a, b) {
                (Some(a), Some(b)) => {
                    let d = rel_diff(a, b);
                    assert!(d < tol, "{what}, {dtype:?}, {plan}: var {i} off by {d:e}");
                }
                (None, None) => {}
                _ => panic!(
                    "{what}, {dtype:?}, {plan}: var {i} has a gradient {} plain candle",
                    if a.is_some() {
                        "where none in"
                    } else {
                        "missing from"
                    }
                ),
            }
        }
    }
}

/// One way of writing [`Conditioned`]'s forward.
type Form = fn(&Conditioned, &Tensor, Option<&Tensor>) -> Result<Tensor>;

/// A layer with an optional extra input (a memory to attend to, a
/// conditioning vector) that it uses only when configured to, written in
/// the ways Rust allows.
#[derive(Clone)]
struct Conditioned {
    w: Var,
    use_extra: bool,
}

impl Conditioned {
    remat! {
        fn guard(&self, x: &Tensor, extra: Option<&Tensor>) -> Result<Tensor> {
            let h = x.matmul(self.w.as_tensor())?;
            let y = match extra {
                Some(e) if self.use_extra => (&h + e)?,
                _ => h.tanh()?,
            };
            Ok(y)
        }
    }

    remat! {
        fn tuple(&self, x: &Tensor, extra: Option<&Tensor>) -> Result<Tensor> {
            let h = x.matmul(self.w.as_tensor())?;
            let y = match (extra, self.use_extra) {
                (Some(e), true) => (&h + e)?,
                _ => h.tanh()?,
            };
            Ok(y)
        }
    }

    remat! {
        fn filtered(&self, x: &Tensor, extra: Option<&Tensor>) -> Result<Tensor> {
            let h = x.matmul(self.w.as_tensor())?;
            let y = if let Some(e) = extra.filter(|_| self.use_extra) {
                (&h + e)?
            } else {
                h.tanh()?
            };
            Ok(y)
        }
    }

    remat! {
        fn nested(&self, x: &Tensor, extra: Option<&Tensor>) -> Result<Tensor> {
            let h = x.matmul(self.w.as_tensor())?;
            let y = match extra {
                Some(e) => {
                    if self.use_extra {
                        (&h + e)?
                    } else {
                        h.tanh()?
                    }
                }
                None => h.tanh()?,
            };
            Ok(y)
        }
    }

    fn plain(&self, x: &Tensor, extra: Option<&Tensor>) -> Result<Tensor> {
        let h = x.matmul(self.w.as_tensor())?;
        match extra {
            Some(e) if self.use_extra => &h + e,
            _ => h.tanh(),
        }
    }
}

#[test]
fn an_option_taken_apart_under_a_guard_a_tuple_or_an_adapter_is_no_cut() {
    for dtype in [DType::F32, DType::F64] {
        let x = var(&[3, 4], 81, 1.0, dtype);
        let src = var(&[3, 4], 82, 1.0, dtype);
        for use_extra in [false, true] {
            let layer = Conditioned {
                w: var(&[4, 4], 83, 0.5, dtype),
                use_extra,
            };
            let vars = [&x, &layer.w, &src];
            // The extra input is made from a `Var` (not one itself): plain
            // candle gives that `Var` a gradient only where it is used.
            let extra = || src.as_tensor().sin().unwrap();
            let forms: [(&str, Form); 4] = [
                ("guard", Conditioned::guard),
                ("tuple", Conditioned::tuple),
                ("filter", Conditioned::filtered),
                ("if in an arm", Conditioned::nested),
            ];
            for (form, f) in forms {
                same_as_plain(
                    &format!("{form}, use_extra {use_extra}"),
                    dtype,
                    &vars,
                    &|| layer.plain(x.as_tensor(), Some(&extra())),
                    &|| f(&layer, x.as_tensor(), Some(&extra())),
                );
            }
        }
    }
}

remat! {
    /// Feature-pyramid levels after the first.
    fn levels_after_first(feats: &[Tensor]) -> Result<Tensor> {
        let mut acc = feats[1].zeros_like()?;
        for f in feats.iter().skip(1) {
            acc = (acc + f)?;
        }
        Ok(acc.tanh()?)
    }
}

remat! {
    /// The first two levels, folded.
    fn first_two(feats: &[Tensor]) -> Result<Tensor> {
        let acc = feats
            .iter()
            .take(2)
            .try_fold(feats[0].zeros_like()?, |a, f| a + f)?;
        Ok(acc.tanh()?)
    }
}

remat! {
    /// Levels weighted by a shorter list of weights, every other level, and
    /// all but the first by their index.
    fn weighted(feats: &[Tensor], ws: &[Tensor]) -> Result<Tensor> {
        let mut acc = feats[0].zeros_like()?;
        for (f, w) in feats.iter().zip(ws.iter()) {
            acc = (acc + f.broadcast_mul(w)?)?;
        }
        let even = feats.iter().step_by(2).map(|f| f.sqr()).collect::<Result<Vec<_>>>()?;
        let mut rest = feats[0].zeros_like()?;
        for (i, f) in feats.iter().enumerate() {
            if i != 0 {
                rest = (rest + f.exp()?)?;
            }
        }
        Ok(((acc + &even[0])? + rest)?)
    }
}

fn levels_plain(feats: &[Tensor], ws: &[Tensor], form: usize) -> Result<Tensor> {
    let zeros = feats[0].zeros_like()?;
    let sum = |fs: Vec<Tensor>| fs.into_iter().try_fold(zeros.clone(), |a, f| a + f);
    match form {
        0 => sum(feats[1..].to_vec())?.tanh(),
        1 => sum(feats[..2].to_vec())?.tanh(),
        _ => {
            let acc = sum(feats
                .iter()
                .zip(ws)
                .map(|(f, w)| f.broadcast_mul(w))
                .collect::<Result<_>>()?)?;
            let rest = sum(feats[1..].iter().map(|f| f.exp()).collect::<Result<_>>()?)?;
            (acc + feats[0].sqr()?)? + rest
        }
    }
}

#[test]
fn a_list_iterated_through_skip_take_zip_step_or_enumerate_is_no_cut() {
    for dtype in [DType::F32, DType::F64] {
        let srcs: Vec<Var> = (0..4).map(|i| var(&[2, 4], 91 + i, 1.0, dtype)).collect();
        let ws: Vec<Var> = (0..2).map(|i| var(&[4], 96 + i, 1.0, dtype)).collect();
        let vars: Vec<&Var> = srcs.iter().chain(&ws).collect();
        // The levels are made from `Var`s: those no statement uses get no
        // gradient, in plain candle and here.
        let feats =
            || -> Vec<Tensor> { srcs.iter().map(|s| s.as_tensor().tanh().unwrap()).collect() };
        let w: Vec<Tensor> = ws.iter().map(|w| w.as_tensor().clone()).collect();
        for form in 0..3 {
            same_as_plain(
                &format!("levels, form {form}"),
                dtype,
                &vars,
                &|| levels_plain(&feats(), &w, form),
                &|| match form {
                    0 => levels_after_first(&feats()),
                    1 => first_two(&feats()),
                    _ => weighted(&feats(), &w),
                },
            );
        }
    }
}

/// A model's forward as candle-transformers writes it: a `mut` hidden state
/// whose dtype, shape and device later statements read (a mask converted
/// to its dtype, a length, zeros of its shape), then layers that update it.
/// Such reads change nothing: the hidden state keeps its gradient.
#[derive(Clone)]
struct Stack {
    emb: Var,
    layers: Vec<Var>,
}

impl Stack {
    remat! {
        fn forward(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
            let mut xs = x.matmul(self.emb.as_tensor())?;
            let mask = mask.to_dtype(xs.dtype())?;
            let n = xs.dim(1)?;
            let mut acc = xs.zeros_like()?;
            let bias = Tensor::ones(xs.dims(), xs.dtype(), xs.device())?;
            for w in self.layers.iter() {
                xs = xs.matmul(w)?.broadcast_add(&mask)?.tanh()?;
                acc = (acc + &xs)?;
            }
            Ok(((acc + bias)? * (1.0 / n as f64))?)
        }
    }

    remat! {
        /// The hidden state as a `mut` parameter, its dtype a plain value.
        fn over_hidden(&self, mut xs: Tensor, mask: &Tensor) -> Result<Tensor> {
            let rows = xs.dim(0)?;
            let dt = xs.dtype();
            let mask = mask.to_dtype(dt)?;
            for w in self.layers.iter() {
                xs = xs.matmul(w)?.broadcast_add(&mask)?.tanh()?;
            }
            Ok((xs * rows as f64)?)
        }
    }

    fn plain(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let mut xs = x.matmul(self.emb.as_tensor())?;
        let mask = mask.to_dtype(xs.dtype())?;
        let n = xs.dim(1)?;
        let mut acc = xs.zeros_like()?;
        let bias = Tensor::ones(xs.dims(), xs.dtype(), xs.device())?;
        for w in self.layers.iter() {
            xs = xs.matmul(w)?.broadcast_add(&mask)?.tanh()?;
            acc = (acc + &xs)?;
        }
        (acc + bias)? * (1.0 / n as f64)
    }

    fn plain_from_hidden(&self, mut xs: Tensor, mask: &Tensor) -> Result<Tensor> {
        let rows = xs.dim(0)?;
        let mask = mask.to_dtype(xs.dtype())?;
        for w in self.layers.iter() {
            xs = xs.matmul(w)?.broadcast_add(&mask)?.tanh()?;
        }
        xs * rows as f64
    }
}

#[test]
fn a_mut_binding_read_for_its_dtype_or_shape_keeps_its_gradient() {
    for dtype in [DType::F32, DType::F64] {
        let stack = Stack {
            emb: var(&[4, 4], 101, 0.5, dtype),
            layers: (0..2).map(|i| var(&[4, 4], 102 + i, 0.5, dtype)).collect(),
        };
        let x = var(&[3, 4], 105, 1.0, dtype);
        // An f32 mask whatever the model's dtype, as tokenizers give it.
        let mask = crate::common::tensor(&[4], 106, 1.0, DType::F32);
        let vars: Vec<&Var> = [&stack.emb, &x].into_iter().chain(&stack.layers).collect();
        same_as_plain(
            "a mut hidden state",
            dtype,
            &vars,
            &|| stack.plain(x.as_tensor(), &mask),
            &|| stack.forward(x.as_tensor(), &mask),
        );
        let hidden = || x.as_tensor().matmul(stack.emb.as_tensor()).unwrap();
        same_as_plain(
            "a mut parameter",
            dtype,
            &vars,
            &|| stack.plain_from_hidden(hidden(), &mask),
            &|| stack.over_hidden(hidden(), &mask),
        );
    }
}
