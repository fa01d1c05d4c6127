//! Gradients of a checkpointed GPT-style block against central finite
//! differences in f64: a check independent of candle's own backward.
//!
//! Tolerance: with step h = 1e-5 the central difference has truncation error
//! O(h^2 * |f'''|) ~ 1e-10 and rounding error ~ eps * |L| / h ~ 1e-16 * 10 /
//! 1e-5 = 1e-10, so every element must agree to 1e-7 relative to the largest
//! gradient of its tensor; a wrong gradient misses by orders of magnitude.

use crate::common::*;
use candle_core::{DType, Tensor, Var};

fn loss(m: &Gpt, x: &Tensor, mask: &Tensor, enabled: bool) -> Tensor {
    let y = m
        .region(
            "gpt",
            x,
            mask,
            saving(&["attn.qkv", "attn.core", "mlp.proj"]),
            enabled,
        )
        .unwrap();
    (&y * tensor(y.dims(), 5, 1.0, DType::F64))
        .unwrap()
        .sum_all()
        .unwrap()
}

fn value(t: &Tensor) -> f64 {
    t.to_scalar::<f64>().unwrap()
}

#[test]
fn gpt_block_gradients_match_central_differences() {
    let m = Gpt::new(8, 2, 21, DType::F64);
    let x = var(&[2, 3, 8], 22, 1.0, DType::F64);
    let mask = causal_mask(3, DType::F64);
    let grads = loss(&m, x.as_tensor(), &mask, true).backward().unwrap();
    let mut vars: Vec<(String, Var)> = vec![("x".into(), x.clone())];
    vars.extend(
        m.vars()
            .into_iter()
            .enumerate()
            .map(|(i, v)| (format!("param {i}"), v)),
    );
    let mut checked = 0;
    for (name, v) in &vars {
        let analytic = f64s(grads.get(v).unwrap());
        let base = f64s(v.as_tensor());
        let (err, i, numeric) =
            worst_difference(&base, &analytic, 1e-3, Quotient::Central(1e-5), |moved| {
                v.set(&Tensor::from_vec(moved, v.dims(), v.device()).unwrap())
                    .unwrap();
                // The finite differences use the plain forward: no runtime code.
                value(&loss(&m, x.as_tensor(), &mask, false))
            });
        assert!(
            err <= 1e-7,
            "{name}[{i}]: remat {} vs finite difference {numeric} (error {err:e})",
            analytic[i]
        );
        checked += base.len();
        v.set(&Tensor::from_vec(base, v.dims(), v.device()).unwrap())
            .unwrap();
    }
    assert!(checked > 900, "checked {checked} elements");
}
