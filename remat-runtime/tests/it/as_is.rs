//! Statements whose value is a parameter or a tracked input as it is (a
//! clone, a cast to its own dtype, a full narrow, `contiguous` on a
//! contiguous tensor) or a view of it, read by statements on both sides of
//! a saved one: under every plan and every save/recompute combination the
//! gradients are plain candle's.

use candle_core::{DType, IndexOp, Module, Result, Tensor, Var};
use candle_nn::Linear;
use remat_runtime::{remat, Plan, Policy};

use crate::common::{rel_diff, var, weighted_loss, weighted_sum};

/// The ways a candle user takes a tensor "as it is" or as a view that
/// reads every element once.
const WAYS: usize = 14;

fn as_is(t: &Tensor, way: usize) -> Result<Tensor> {
    let (r, c) = t.dims2()?;
    match way {
        0 => Ok(t.clone()),
        1 => t.to_dtype(t.dtype()),
        2 => t.contiguous(),
        3 => t.narrow(0, 0, r),
        4 => t.i((.., ..)),
        5 => Tensor::cat(&[t], 0),
        6 => t.reshape((r, c)),
        7 => t.t()?.t(),
        8 => t.unsqueeze(0)?.squeeze(0),
        9 => t.broadcast_as((r, c)),
        10 => t.copy(),
        11 => t.flatten_all()?.reshape((r, c)),
        12 => t.affine(1.0, 0.0),
        _ => t.broadcast_left(1)?.squeeze(0),
    }
}

remat! {
    /// `w` taken as it is, read before and after the saved `z`.
    fn parameter_as_is(x: &Tensor, w: &Var, way: usize) -> Result<Tensor> {
        let wc = as_is(w, way)?;
        let y = x.matmul(&wc)?;
        #[save]
        let z = y.tanh()?;
        let s = wc.sqr()?.sum_keepdim(0)?;
        Ok(z.broadcast_add(&s)?)
    }
}

remat! {
    /// The input taken as it is, read before and after the saved `z`.
    fn input_as_is(x: &Tensor, w: &Var, way: usize) -> Result<Tensor> {
        let xc = as_is(x, way)?;
        let y = xc.matmul(w)?;
        #[save]
        let z = y.tanh()?;
        let s = xc.sqr()?.sum_keepdim(0)?;
        Ok(z.broadcast_add(&s)?)
    }
}

remat! {
    /// `w` taken as it is and also returned: its gradient comes from the
    /// block's output too.
    fn parameter_as_is_returned(x: &Tensor, w: &Var, way: usize) -> Result<(Tensor, Tensor)> {
        let wc = as_is(w, way)?;
        #[save]
        let y = x.matmul(&wc)?;
        let z = y.tanh()?;
        let s = wc.sqr()?.sum_keepdim(0)?;
        Ok((z.broadcast_add(&s)?, wc))
    }
}

remat! {
    /// A statement's output taken as it is by another statement, read on
    /// both sides of the saved `z`.
    fn output_as_is(x: &Tensor, w: &Var, way: usize) -> Result<Tensor> {
        let a = x.matmul(w)?;
        let ac = as_is(&a, way)?;
        let y = ac.tanh()?;
        #[save]
        let z = y.exp()?;
        let s = ac.sqr()?.sum_keepdim(0)?;
        Ok(z.broadcast_add(&s)?)
    }
}

fn reference(x: &Tensor, w: &Tensor, of_input: bool) -> Tensor {
    let twice = if of_input { x } else { w };
    let y = x.matmul(w).unwrap().tanh().unwrap();
    let s = twice.sqr().unwrap().sum_keepdim(0).unwrap();
    y.broadcast_add(&s).unwrap()
}

/// Every plan a user might pick: the annotations, the uniform ones, a
/// budget (two steps: the first measures), and every save/recompute
/// combination of the four statements (annotations overridden).
fn plans(names: &'static [&'static str]) -> Vec<(Plan, usize)> {
    let mut plans = vec![
        (Plan::declared(), 1),
        (Plan::recompute_all(), 1),
        (Plan::save_all(), 1),
        (Plan::budget(0.4), 2),
        (Plan::budget(0.0), 2),
    ];
    for mask in 0..1u32 << names.len() {
        let plan = Plan::from_fn(&format!("combination {mask:05b}"), move |s| {
            match names.iter().position(|n| *n == s.name) {
                Some(i) if mask >> i & 1 == 1 => Policy::Save,
                _ => Policy::Recompute,
            }
        });
        plans.push((plan, 1));
    }
    plans
}

#[test]
fn a_parameter_or_input_taken_as_it_is_gets_plain_candle_s_gradients_under_every_plan() {
    let mut wrong = Vec::new();
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        for of_input in [false, true] {
            let names: &'static [&'static str] = if of_input {
                &["xc", "y", "z", "s"]
            } else {
                &["wc", "y", "z", "s"]
            };
            for way in 0..WAYS {
                let x = var(&[4, 4], 1, 1.0, dtype);
                let w = var(&[4, 4], 2, 0.5, dtype);
                let expected = weighted_loss(&reference(x.as_tensor(), w.as_tensor(), of_input))
                    .backward()
                    .unwrap();
                for (plan, steps) in plans(names) {
                    for step in 0..steps {
                        let run = || match of_input {
                            true => input_as_is(x.as_tensor(), &w, way),
                            false => parameter_as_is(x.as_tensor(), &w, way),
                        };
                        let case = format!(
                            "{dtype:?} {} way {way}, {plan} step {step}",
                            if of_input { "input" } else { "parameter" }
                        );
                        let grads = match plan.scope(run).and_then(|y| weighted_loss(&y).backward())
                        {
                            Ok(g) => g,
                            Err(e) => {
                                wrong.push(format!(
                                    "{case}: {}",
                                    e.to_string().lines().next().unwrap()
                                ));
                                continue;
                            }
                        };
                        for (name, v) in [("x", &x), ("w", &w)] {
                            let d = rel_diff(grads.get(v).unwrap(), expected.get(v).unwrap());
                            if d.is_nan() || d > tol {
                                wrong.push(format!("{case}: grad {name} off by {d:e}"));
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{} wrong:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

#[test]
fn a_parameter_taken_as_it_is_and_returned_gets_plain_candle_s_gradients_under_every_plan() {
    let loss = |out: &Tensor, wc: &Tensor| (weighted_loss(out) + weighted_sum(wc, 7)).unwrap();
    let mut wrong = Vec::new();
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        for way in 0..WAYS {
            let x = var(&[4, 4], 1, 1.0, dtype);
            let w = var(&[4, 4], 2, 0.5, dtype);
            let out = reference(x.as_tensor(), w.as_tensor(), false);
            let expected = loss(&out, w.as_tensor()).backward().unwrap();
            for (plan, steps) in plans(&["wc", "y", "z", "s"]) {
                for step in 0..steps {
                    let case = format!("{dtype:?} way {way}, {plan} step {step}");
                    let run = || parameter_as_is_returned(x.as_tensor(), &w, way);
                    let grads = match plan.scope(run).and_then(|(o, wc)| loss(&o, &wc).backward()) {
                        Ok(g) => g,
                        Err(e) => {
                            wrong
                                .push(format!("{case}: {}", e.to_string().lines().next().unwrap()));
                            continue;
                        }
                    };
                    for (name, v) in [("x", &x), ("w", &w)] {
                        let d = rel_diff(grads.get(v).unwrap(), expected.get(v).unwrap());
                        if d.is_nan() || d > tol {
                            wrong.push(format!("{case}: grad {name} off by {d:e}"));
                        }
                    }
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{} wrong:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

/// A tied autoencoder: the encoder's weight cast to the input's dtype (a
/// no-op when they agree) is the decoder's too.
#[derive(Clone)]
struct TiedAutoencoder {
    encoder: Linear,
}

impl Module for TiedAutoencoder {
    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let w = self.encoder.weight().to_dtype(xs.dtype())?;
            let h = xs.broadcast_matmul(&w.t()?)?;
            #[save]
            let a = h.gelu_erf()?;
            let o = a.broadcast_matmul(&w)?;
            Ok(o)
        }
    }
}

#[test]
fn a_tied_autoencoder_casting_its_weight_to_its_own_dtype_gets_plain_candle_s_gradients() {
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        let x = var(&[2, 3, 6], 3, 1.0, dtype);
        let w = var(&[4, 6], 4, 0.5, dtype);
        let model = TiedAutoencoder {
            encoder: Linear::new(w.as_tensor().clone(), None),
        };
        let plain = x
            .as_tensor()
            .broadcast_matmul(&w.as_tensor().t().unwrap())
            .unwrap()
            .gelu_erf()
            .unwrap()
            .broadcast_matmul(w.as_tensor())
            .unwrap();
        let expected = weighted_loss(&plain).backward().unwrap();
        for (plan, steps) in plans(&["w", "h", "a", "o"]) {
            for step in 0..steps {
                let y = plan.scope(|| model.forward(x.as_tensor())).unwrap();
                assert!(rel_diff(&y, &plain) <= tol, "{plan}");
                let grads = weighted_loss(&y).backward().unwrap();
                for (name, v) in [("x", &x), ("w", &w)] {
                    let d = rel_diff(grads.get(v).unwrap(), expected.get(v).unwrap());
                    assert!(
                        d <= tol,
                        "{dtype:?} {plan} step {step}: grad {name} off by {d:e}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_statement_s_output_taken_as_it_is_gets_plain_candle_s_gradients_under_every_plan() {
    let mut wrong = Vec::new();
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        for way in 0..WAYS {
            let x = var(&[4, 4], 1, 1.0, dtype);
            let w = var(&[4, 4], 2, 0.5, dtype);
            let a = x.as_tensor().matmul(w.as_tensor()).unwrap();
            let s = a.sqr().unwrap().sum_keepdim(0).unwrap();
            let out = a.tanh().unwrap().exp().unwrap().broadcast_add(&s).unwrap();
            let expected = weighted_loss(&out).backward().unwrap();
            for (plan, steps) in plans(&["a", "ac", "y", "z", "s"]) {
                for step in 0..steps {
                    let case = format!("{dtype:?} way {way}, {plan} step {step}");
                    let run = || output_as_is(x.as_tensor(), &w, way);
                    let grads = match plan.scope(run).and_then(|y| weighted_loss(&y).backward()) {
                        Ok(g) => g,
                        Err(e) => {
                            wrong
                                .push(format!("{case}: {}", e.to_string().lines().next().unwrap()));
                            continue;
                        }
                    };
                    for (name, v) in [("x", &x), ("w", &w)] {
                        let d = rel_diff(grads.get(v).unwrap(), expected.get(v).unwrap());
                        if d.is_nan() || d > tol {
                            wrong.push(format!("{case}: grad {name} off by {d:e}"));
                        }
                    }
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{} wrong:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

remat! {
    /// A value bound detached by a statement of its own, read beside the
    /// value it came from.
    fn detached_then_read(x: &Tensor, w: &Var) -> Result<Tensor> {
        let h = x.matmul(w)?;
        let frozen = h.detach();
        let mixed = (&h * frozen.tanh()?)?;
        Ok(mixed)
    }
}

remat! {
    /// A stop-gradient passed on as it is, and a straight-through estimator
    /// (VQ-VAE's `z + (q - z).detach()`).
    fn stop_gradients(x: &Tensor, w: &Var) -> Result<Tensor> {
        let a = x.matmul(w)?;
        let b = a.detach();
        let c = b.clone();
        let q = (c.clone() * 4.0)?.round()?;
        let st = (&a + (q / 4.0 - &a)?.detach())?;
        let d = (&a * c.exp()?)?;
        let e = d.tanh()?;
        let f = ((&e + &st)? + &a)?;
        Ok(f)
    }
}

#[test]
fn a_value_bound_detached_by_its_own_statement_gets_plain_candle_s_gradients_under_every_plan() {
    let mut wrong = Vec::new();
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        let x = var(&[4, 4], 5, 1.0, dtype);
        let w = var(&[4, 4], 6, 0.5, dtype);
        let (xt, wt) = (x.as_tensor(), w.as_tensor());
        let h = xt.matmul(wt).unwrap();
        let mixed = (&h * h.detach().tanh().unwrap()).unwrap();
        let a = h;
        let c = a.detach();
        let q = (c.clone() * 4.0).unwrap().round().unwrap();
        let st = (&a + ((q / 4.0).unwrap() - &a).unwrap().detach()).unwrap();
        let e = (&a * c.exp().unwrap()).unwrap().tanh().unwrap();
        let f = ((e + st).unwrap() + &a).unwrap();
        let blocks: [(&str, &'static [&'static str], Tensor); 2] = [
            ("detached_then_read", &["h", "frozen", "mixed"], mixed),
            (
                "stop_gradients",
                &["a", "b", "c", "q", "st", "d", "e", "f"],
                f,
            ),
        ];
        for (block, names, out) in blocks {
            let expected = weighted_loss(&out).backward().unwrap();
            let mut all = plans(names);
            all.push((Plan::off(), 1));
            for (plan, steps) in all {
                for step in 0..steps {
                    let case = format!("{dtype:?} {block}, {plan} step {step}");
                    let run = || match block {
                        "detached_then_read" => detached_then_read(xt, &w),
                        _ => stop_gradients(xt, &w),
                    };
                    let y = match plan.scope(run) {
                        Ok(y) => y,
                        Err(e) => {
                            wrong.push(format!("{case}: forward: {e}"));
                            continue;
                        }
                    };
                    if rel_diff(&y, &out).is_nan() || rel_diff(&y, &out) > tol {
                        wrong.push(format!("{case}: output off by {:e}", rel_diff(&y, &out)));
                    }
                    let grads = match weighted_loss(&y).backward() {
                        Ok(g) => g,
                        Err(e) => {
                            wrong
                                .push(format!("{case}: {}", e.to_string().lines().next().unwrap()));
                            continue;
                        }
                    };
                    for (name, v) in [("x", &x), ("w", &w)] {
                        match grads.get(v) {
                            None => wrong.push(format!("{case}: no gradient for {name}")),
                            Some(g) => {
                                let d = rel_diff(g, expected.get(v).unwrap());
                                if d.is_nan() || d > tol {
                                    wrong.push(format!("{case}: grad {name} off by {d:e}"));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{} wrong:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}
