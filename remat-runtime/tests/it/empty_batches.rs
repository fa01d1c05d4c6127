//! Empty batches are valid input: a statement whose tensors have no
//! elements (an expert no token chose, a batch of length 0) gives plain
//! candle's values and gradients under every plan, with no false alarm,
//! and so do `nn`'s products on zero rows.

use candle_core::{DType, Module, Result, Tensor, Var};
use candle_nn::Linear;
use remat_runtime::{backward, nn, remat, Plan};

use crate::common::{rel_diff, tensor, var, weighted_loss};

fn plans() -> [Plan; 5] {
    [
        Plan::off(),
        Plan::declared(),
        Plan::recompute_all(),
        Plan::save_all(),
        Plan::budget(0.4),
    ]
}

/// `a` equals `b` (to 1e-12 relative), or both are empty of one shape.
fn close(a: &Tensor, b: &Tensor) -> bool {
    a.dims() == b.dims() && (a.elem_count() == 0 || rel_diff(a, b) < 1e-12)
}

/// Each of `vars`' gradients in `got` is `want`'s: the same values, or
/// absent in both.
fn same_grads(
    got: &candle_core::backprop::GradStore,
    want: &candle_core::backprop::GradStore,
    vars: &[&Var],
    what: &str,
) {
    for (i, v) in vars.iter().enumerate() {
        match (got.get(v), want.get(v)) {
            (Some(g), Some(w)) => assert!(close(g, w), "{what}: var {i}"),
            (None, None) => {}
            (g, w) => panic!(
                "{what}: var {i}: got {:?}, plain {:?}",
                g.map(|t| t.dims().to_vec()),
                w.map(|t| t.dims().to_vec())
            ),
        }
    }
}

remat! {
    fn scaled(x: &Tensor, s: &Tensor) -> Result<Tensor> {
        let y = x.broadcast_mul(s)?;
        Ok(y)
    }
}

remat! {
    fn projected(x: &Tensor, w: &Var, b: &Var) -> Result<Tensor> {
        let h = x.matmul(&w.t()?)?.broadcast_add(b)?;
        let y = h.tanh()?;
        Ok(y)
    }
}

#[test]
fn statements_on_empty_batches_give_plain_candles_gradients() {
    for dtype in [DType::F32, DType::F64] {
        let s = var(&[4], 1, 1.0, dtype);
        let (w, b) = (var(&[3, 4], 2, 0.5, dtype), var(&[3], 3, 0.5, dtype));
        for rows in [0, 2] {
            let x = tensor(&[rows, 4], 4, 1.0, dtype);
            let plain_scaled = x.broadcast_mul(s.as_tensor()).unwrap();
            let plain_projected = x
                .matmul(&w.as_tensor().t().unwrap())
                .unwrap()
                .broadcast_add(b.as_tensor())
                .unwrap()
                .tanh()
                .unwrap();
            let plain = (weighted_loss(&plain_scaled) + weighted_loss(&plain_projected))
                .unwrap()
                .backward()
                .unwrap();
            for plan in plans() {
                for step in 0..2 {
                    let what = format!("{dtype:?}, {rows} rows, {plan}, step {step}");
                    let y1 = plan.scope(|| scaled(&x, s.as_tensor()));
                    let y1 = y1.unwrap_or_else(|e| panic!("{what}: {e}"));
                    let y2 = plan.scope(|| projected(&x, &w, &b));
                    let y2 = y2.unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(y1.dims(), [rows, 4], "{what}");
                    assert_eq!(y2.dims(), [rows, 3], "{what}");
                    let loss = (weighted_loss(&y1) + weighted_loss(&y2)).unwrap();
                    let g = backward(&loss).unwrap_or_else(|e| panic!("{what}: {e}"));
                    same_grads(&g, &plain, &[&s, &w, &b], &what);
                }
            }
        }
    }
}

/// A mixture of two experts, every token routed to expert 0: expert 1
/// reads no row.
#[derive(Clone)]
struct Moe {
    experts: Vec<Linear>,
}

impl Moe {
    fn mix(&self, xs: &Tensor, choice: &[u32]) -> Result<Tensor> {
        let mut ys = xs.zeros_like()?;
        for (e, expert) in self.experts.iter().enumerate() {
            let rows: Vec<u32> = (0..choice.len() as u32)
                .filter(|&i| choice[i as usize] == e as u32)
                .collect();
            let rows = Tensor::new(rows.as_slice(), xs.device())?;
            let picked = xs.index_select(&rows, 0)?;
            ys = ys.index_add(&rows, &expert.forward(&picked)?.tanh()?, 0)?;
        }
        Ok(ys)
    }

    remat! {
        fn forward(&self, xs: &Tensor, choice: &[u32]) -> Result<Tensor> {
            let ys = self.mix(xs, choice)?;
            let out = (ys + xs)?;
            Ok(out)
        }
    }
}

#[test]
fn an_expert_no_token_chose_is_not_a_cut() {
    for dtype in [DType::F32, DType::F64] {
        let ws: Vec<Var> = (0..2).map(|e| var(&[4, 4], 10 + e, 0.5, dtype)).collect();
        let moe = Moe {
            experts: ws
                .iter()
                .map(|w| Linear::new(w.as_tensor().clone(), None))
                .collect(),
        };
        let x = var(&[5, 4], 20, 1.0, dtype);
        let choice = [0u32; 5];
        let plain =
            weighted_loss(&(moe.mix(x.as_tensor(), &choice).unwrap() + x.as_tensor()).unwrap())
                .backward()
                .unwrap();
        for plan in plans() {
            for step in 0..2 {
                let what = format!("{dtype:?}, {plan}, step {step}");
                let y = plan.scope(|| moe.forward(x.as_tensor(), &choice));
                let y = y.unwrap_or_else(|e| panic!("{what}: {e}"));
                let g = backward(&weighted_loss(&y)).unwrap_or_else(|e| panic!("{what}: {e}"));
                same_grads(&g, &plain, &[&x, &ws[0], &ws[1]], &what);
            }
        }
    }
}

/// `nn`'s products on `x` (rows x 4) with weight `w` (3 x 4), bias `b`,
/// residual `r`, norm gain and shift `g`, `beta`: by `which`.
fn product(
    which: usize,
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    r: &Tensor,
    g: &Tensor,
    beta: &Tensor,
) -> Result<Tensor> {
    match which {
        0 => nn::linear(x, w, Some(b)),
        1 => nn::linear_add(x, w, Some(b), r),
        2 => nn::gelu_linear_add(x, w, Some(b), r),
        _ => nn::layer_norm_linear(x, g, beta, 1e-5, w, Some(b)),
    }
}

/// The same in candle's ops.
fn product_composed(
    which: usize,
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    r: &Tensor,
    g: &Tensor,
    beta: &Tensor,
) -> Result<Tensor> {
    let lin = |x: &Tensor| x.matmul(&w.t()?)?.broadcast_add(b);
    match which {
        0 => lin(x),
        1 => lin(x)? + r,
        2 => {
            // GELU's tanh approximation in elementary ops (candle's `gelu`
            // backward is a few 1e-7 off in f64).
            let inner = (((x.sqr()? * x)? * 0.044715)? + x)? * (2.0 / std::f64::consts::PI).sqrt();
            let gelu = ((inner?.tanh()? + 1.0)? * x)? * 0.5;
            lin(&gelu?)? + r
        }
        _ => {
            let mean = x.mean_keepdim(1)?;
            let c = x.broadcast_sub(&mean)?;
            let var = c.sqr()?.mean_keepdim(1)?;
            let n = c.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
            lin(&n.broadcast_mul(g)?.broadcast_add(beta)?)
        }
    }
}

remat! {
    fn product_block(
        which: usize,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        r: &Tensor,
        g: &Tensor,
        beta: &Tensor,
    ) -> Result<Tensor> {
        let y = product(which, x, w, b, r, g, beta)?;
        let z = y.tanh()?;
        Ok(z)
    }
}

#[test]
fn nn_products_on_zero_rows_give_composed_gradients() {
    let dtype = DType::F64;
    let (w, b) = (var(&[3, 4], 30, 0.5, dtype), var(&[3], 31, 0.5, dtype));
    let (g, beta) = (var(&[4], 32, 1.0, dtype), var(&[4], 33, 0.5, dtype));
    for rows in [0, 3] {
        let x = var(&[rows, 4], 34, 1.0, dtype);
        let r = var(&[rows, 3], 35, 1.0, dtype);
        let vars = [&x, &w, &b, &r, &g, &beta];
        let t = |v: &Var| v.as_tensor().clone();
        for which in 0..4 {
            let what = format!("op {which}, {rows} rows");
            let composed =
                product_composed(which, &t(&x), &t(&w), &t(&b), &t(&r), &t(&g), &t(&beta)).unwrap();
            let want = weighted_loss(&composed).backward().unwrap();
            let fused = product(which, &t(&x), &t(&w), &t(&b), &t(&r), &t(&g), &t(&beta));
            let fused = fused.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(close(&fused, &composed), "{what}");
            let got = weighted_loss(&fused)
                .backward()
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            // The fused ops give every argument its gradient (zeros where
            // candle's composed ops give one too).
            for (i, v) in vars.iter().enumerate() {
                if let Some(wg) = want.get(v) {
                    let gg = got
                        .get(v)
                        .unwrap_or_else(|| panic!("{what}: var {i}: none"));
                    assert!(close(gg, wg), "{what}: var {i}");
                }
            }
            let composed_tanh = composed.tanh().unwrap();
            let want = weighted_loss(&composed_tanh).backward().unwrap();
            for plan in plans() {
                let what = format!("{what}, in a block, {plan}");
                // What the op does not read is passed detached (a tracked
                // value read for nothing is a cut).
                let uses = [
                    true,
                    true,
                    true,
                    matches!(which, 1 | 2),
                    which == 3,
                    which == 3,
                ];
                let a: Vec<Tensor> = vars
                    .iter()
                    .zip(uses)
                    .map(|(v, used)| if used { t(v) } else { v.as_tensor().detach() })
                    .collect();
                let y =
                    plan.scope(|| product_block(which, &a[0], &a[1], &a[2], &a[3], &a[4], &a[5]));
                let y = y.unwrap_or_else(|e| panic!("{what}: {e}"));
                let got = backward(&weighted_loss(&y)).unwrap_or_else(|e| panic!("{what}: {e}"));
                for (i, v) in vars.iter().enumerate() {
                    if let Some(wg) = want.get(v) {
                        let gg = got
                            .get(v)
                            .unwrap_or_else(|| panic!("{what}: var {i}: none"));
                        assert!(close(gg, wg), "{what}: var {i}");
                    }
                }
            }
        }
    }
}
