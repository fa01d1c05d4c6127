//! `remat_runtime::nn`: each op's gradients against central finite
//! differences in f64 (independent of any backward), and its forward and
//! gradients against candle's composed ops in f32.
//!
//! Tolerances. f64 central differences with step 1e-5: truncation
//! ~h^2 |f'''| ~ 1e-10 and rounding ~1e-16 * |L| / h ~ 1e-10, so each element
//! must agree to 1e-7 of its tensor's largest gradient. f32 against the
//! composed ops: the same formulas reassociated (blocked softmax, a fused
//! sum), so 1e-5 relative to the largest element (a few f32 ulps of
//! accumulated rounding over sums of <= 64 terms).

use crate::common::*;
use candle_core::{DType, Result, Tensor, Var, D};
use remat_runtime::nn;

type Op = dyn Fn(&[Tensor]) -> Result<Tensor>;

/// `sum(op(inputs) * W)` for a fixed `W`.
fn weighted(op: &Op, inputs: &[Tensor]) -> Tensor {
    weighted_sum(&op(inputs).unwrap(), 99)
}

/// The largest error of `op`'s analytic gradients against central
/// differences, relative to each input's largest gradient. `grad[i]` says
/// whether input `i` is differentiable (class indices are not).
fn finite_differences(op: &Op, inputs: &[Tensor], grad: &[bool]) -> f64 {
    let vars: Vec<Option<Var>> = inputs
        .iter()
        .zip(grad)
        .map(|(t, &g)| g.then(|| Var::from_tensor(t).unwrap()))
        .collect();
    let tracked: Vec<Tensor> = inputs
        .iter()
        .zip(&vars)
        .map(|(t, v)| v.as_ref().map_or(t.clone(), |v| v.as_tensor().clone()))
        .collect();
    let grads = weighted(op, &tracked).backward().unwrap();
    let mut worst = 0f64;
    for (i, v) in vars.iter().enumerate() {
        let Some(v) = v else { continue };
        let analytic = f64s(grads.get(v).expect("a gradient"));
        let (err, _, _) = worst_difference(
            &f64s(&inputs[i]),
            &analytic,
            1e-6,
            Quotient::Central(1e-5),
            |moved| {
                let mut ins = inputs.to_vec();
                ins[i] = Tensor::from_vec(moved, inputs[i].shape(), inputs[i].device()).unwrap();
                weighted(op, &ins).to_scalar::<f64>().unwrap()
            },
        );
        worst = worst.max(err);
    }
    worst
}

/// The largest difference of forward and gradients between `op` and
/// `reference`, in f32.
fn against(op: &Op, reference: &Op, inputs: &[Tensor], grad: &[bool]) -> f64 {
    let run = |f: &Op| {
        let vars: Vec<Option<Var>> = inputs
            .iter()
            .zip(grad)
            .map(|(t, &g)| g.then(|| Var::from_tensor(t).unwrap()))
            .collect();
        let ins: Vec<Tensor> = inputs
            .iter()
            .zip(&vars)
            .map(|(t, v)| v.as_ref().map_or(t.clone(), |v| v.as_tensor().clone()))
            .collect();
        let y = f(&ins).unwrap();
        let g = weighted(f, &ins).backward().unwrap();
        let gs: Vec<Tensor> = vars
            .iter()
            .flatten()
            .map(|v| g.get(v).unwrap().clone())
            .collect();
        (y, gs)
    };
    let (y, gs) = run(op);
    let (y_ref, gs_ref) = run(reference);
    let mut worst = rel_diff(&y, &y_ref);
    for (g, r) in gs.iter().zip(&gs_ref) {
        worst = worst.max(rel_diff(g, r));
    }
    worst
}

fn check(
    op: &Op,
    reference: &Op,
    shapes: &[&[usize]],
    grad: &[bool],
    extra: &dyn Fn(DType) -> Vec<Tensor>,
) {
    for (dtype, tol, what) in [
        (DType::F64, 1e-7, "finite differences"),
        (DType::F32, 1e-5, "composed ops"),
    ] {
        let mut inputs: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| tensor(s, 70 + i as u64, 1.0, dtype))
            .collect();
        inputs.extend(extra(dtype));
        let err = match dtype {
            DType::F64 => finite_differences(op, &inputs, grad),
            _ => against(op, reference, &inputs, grad),
        };
        assert!(err <= tol, "{what}: {err:e} > {tol:e}");
    }
}

fn none(_: DType) -> Vec<Tensor> {
    Vec::new()
}

#[test]
fn linear() {
    let op: &Op = &|t| nn::linear(&t[0], &t[1], Some(&t[2]));
    let composed: &Op = &|t| t[0].broadcast_matmul(&t[1].t()?)?.broadcast_add(&t[2]);
    check(
        op,
        composed,
        &[&[2, 3, 4], &[5, 4], &[5]],
        &[true; 3],
        &none,
    );
    let op: &Op = &|t| nn::linear(&t[0], &t[1], None);
    let composed: &Op = &|t| t[0].broadcast_matmul(&t[1].t()?);
    check(op, composed, &[&[3, 4], &[2, 4]], &[true; 2], &none);
}

#[test]
fn linear_add() {
    // With a bias: the four tensors go through a bundle of the weight and
    // bias; without one, three arguments.
    let op: &Op = &|t| nn::linear_add(&t[0], &t[1], Some(&t[2]), &t[3]);
    let composed: &Op = &|t| t[3].add(&t[0].broadcast_matmul(&t[1].t()?)?.broadcast_add(&t[2])?);
    let shapes: &[&[usize]] = &[&[2, 3, 4], &[5, 4], &[5], &[2, 3, 5]];
    check(op, composed, shapes, &[true; 4], &none);
    // Frozen weight and bias (not variables): the bundle takes no part in
    // the backward; the input and the residual still get their gradients.
    check(op, composed, shapes, &[true, false, false, true], &none);
    let op: &Op = &|t| nn::linear_add(&t[0], &t[1], None, &t[2]);
    let composed: &Op = &|t| t[2].add(&t[0].broadcast_matmul(&t[1].t()?)?);
    check(
        op,
        composed,
        &[&[3, 4], &[2, 4], &[3, 2]],
        &[true; 3],
        &none,
    );
}

#[test]
fn gelu_linear_add() {
    let op: &Op = &|t| nn::gelu_linear_add(&t[0], &t[1], Some(&t[2]), &t[3]);
    let composed: &Op = &|t| {
        t[3].add(
            &t[0]
                .gelu()?
                .broadcast_matmul(&t[1].t()?)?
                .broadcast_add(&t[2])?,
        )
    };
    check(
        op,
        composed,
        &[&[2, 3, 8], &[5, 8], &[5], &[2, 3, 5]],
        &[true; 4],
        &none,
    );
    let op: &Op = &|t| nn::gelu_linear_add(&t[0], &t[1], None, &t[2]);
    let composed: &Op = &|t| t[2].add(&t[0].gelu()?.broadcast_matmul(&t[1].t()?)?);
    check(
        op,
        composed,
        &[&[3, 8], &[2, 8], &[3, 2]],
        &[true; 3],
        &none,
    );
}

/// `residual + gelu(x W1^T + b1) W2^T + b2` with candle's composed ops.
fn gelu_mlp_composed(t: &[Tensor]) -> Result<Tensor> {
    let h = t[0].broadcast_matmul(&t[1].t()?)?.broadcast_add(&t[2])?;
    let y = h
        .gelu()?
        .broadcast_matmul(&t[3].t()?)?
        .broadcast_add(&t[4])?;
    t[5].add(&y)
}

#[test]
fn gelu_mlp() {
    let op: &Op = &|t| {
        nn::gelu_mlp(
            &t[0],
            None,
            &t[1],
            Some(&t[2]),
            &t[3],
            Some(&t[4]),
            Some(&t[5]),
        )
    };
    let shapes: &[&[usize]] = &[&[2, 3, 4], &[8, 4], &[8], &[4, 8], &[4], &[2, 3, 4]];
    check(op, &gelu_mlp_composed, shapes, &[true; 6], &none);
    // Frozen parameters: the input and the residual still get theirs.
    let frozen = [true, false, false, false, false, true];
    check(op, &gelu_mlp_composed, shapes, &frozen, &none);
    // 260 rows: the backward runs over chunks of rows (256 and 4).
    let shapes: &[&[usize]] = &[&[2, 130, 3], &[5, 3], &[5], &[3, 5], &[3], &[2, 130, 3]];
    check(op, &gelu_mlp_composed, shapes, &[true; 6], &none);
    // Without biases or residual, and an output wider than the input.
    let op: &Op = &|t| nn::gelu_mlp(&t[0], None, &t[1], None, &t[2], None, None);
    let composed: &Op = &|t| t[0].matmul(&t[1].t()?)?.gelu()?.matmul(&t[2].t()?);
    check(
        op,
        composed,
        &[&[3, 4], &[6, 4], &[5, 6]],
        &[true; 3],
        &none,
    );
}

/// Variables of `shapes` in `dtype`, drawn from seeds `seed`, `seed + 1`,
/// .., and their tensors.
fn vars_of(shapes: &[&[usize]], seed: u64, dtype: DType) -> (Vec<Var>, Vec<Tensor>) {
    let vars: Vec<Var> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| var(s, seed + i as u64, 1.0, dtype))
        .collect();
    let tensors = vars.iter().map(|v| v.as_tensor().clone()).collect();
    (vars, tensors)
}

/// A layer norm with gain `t[1]` and bias `t[2]`.
fn layer(t: &[Tensor]) -> nn::PreNorm<'_> {
    nn::PreNorm::Layer {
        gain: &t[1],
        bias: &t[2],
        eps: 1e-5,
    }
}

/// An RMS norm with gain `t[1]`.
fn rms(t: &[Tensor]) -> nn::PreNorm<'_> {
    nn::PreNorm::Rms {
        gain: &t[1],
        eps: 1e-6,
    }
}

#[test]
fn mlps_with_their_norm() {
    // `residual + mlp(norm(x))` with the norm inside the node, against
    // candle's composed norms; the residual is `x`, as in a block.
    let op: &Op = &|t| {
        nn::gelu_mlp(
            &t[0],
            Some(layer(t)),
            &t[3],
            Some(&t[4]),
            &t[5],
            None,
            Some(&t[0]),
        )
    };
    let composed: &Op = &|t| {
        let n = candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5)?;
        let h = n.broadcast_matmul(&t[3].t()?)?.broadcast_add(&t[4])?;
        t[0].add(&h.gelu()?.broadcast_matmul(&t[5].t()?)?)
    };
    let shapes: &[&[usize]] = &[&[2, 3, 4], &[4], &[4], &[8, 4], &[8], &[4, 8]];
    check(op, composed, shapes, &[true; 6], &none);
    let op: &Op = &|t| nn::swiglu_mlp(&t[0], Some(rms(t)), &t[2], &t[3], &t[4], Some(&t[0]));
    let composed: &Op = &|t| {
        let n = candle_nn::ops::rms_norm_slow(&t[0], &t[1], 1e-6)?;
        let gate = candle_nn::ops::silu(&n.broadcast_matmul(&t[2].t()?)?)?;
        let up = n.broadcast_matmul(&t[3].t()?)?;
        t[0].add(&(gate * up)?.broadcast_matmul(&t[4].t()?)?)
    };
    let shapes: &[&[usize]] = &[&[2, 3, 4], &[4], &[8, 4], &[8, 4], &[4, 8]];
    check(op, composed, shapes, &[true; 5], &none);
}

#[test]
fn gelu_mlp_equals_its_ops_bit_for_bit() {
    // `layer_norm`, `linear` then `gelu_linear_add`: the same arithmetic in
    // the same order, so every value and gradient is equal, not close.
    for (dtype, norm) in [(DType::F32, false), (DType::F64, false), (DType::F32, true)] {
        let run = |fused: bool| {
            let shapes: [&[usize]; 7] = [&[2, 5, 6], &[16, 6], &[16], &[6, 16], &[6], &[6], &[6]];
            let (vars, ts) = vars_of(&shapes, 40, dtype);
            let t: Vec<&Tensor> = ts.iter().collect();
            let pre = nn::PreNorm::Layer {
                gain: t[5],
                bias: t[6],
                eps: 1e-5,
            };
            let y = match (fused, norm) {
                (true, true) => nn::gelu_mlp(
                    t[0],
                    Some(pre),
                    t[1],
                    Some(t[2]),
                    t[3],
                    Some(t[4]),
                    Some(t[0]),
                ),
                (true, false) => {
                    nn::gelu_mlp(t[0], None, t[1], Some(t[2]), t[3], Some(t[4]), Some(t[0]))
                }
                (false, _) => {
                    let n = if norm {
                        nn::layer_norm(t[0], t[5], t[6], 1e-5).unwrap()
                    } else {
                        t[0].clone()
                    };
                    let h = nn::linear(&n, t[1], Some(t[2])).unwrap();
                    nn::gelu_linear_add(&h, t[3], Some(t[4]), t[0])
                }
            }
            .unwrap();
            let grads = weighted_loss(&y).backward().unwrap();
            let mut all = vec![y.flatten_all().unwrap()];
            let used = if norm { 7 } else { 5 };
            all.extend(
                vars[..used]
                    .iter()
                    .map(|v| grads.get(v).unwrap().flatten_all().unwrap()),
            );
            all
        };
        let (fused, ops) = (run(true), run(false));
        assert_eq!(fused.len(), ops.len());
        for (i, (a, b)) in fused.iter().zip(&ops).enumerate() {
            assert_eq!(rel_diff(a, b), 0.0, "{dtype:?}, norm {norm}, tensor {i}");
        }
    }
}

#[test]
fn swiglu_mlp() {
    let op: &Op = &|t| nn::swiglu_mlp(&t[0], None, &t[1], &t[2], &t[3], Some(&t[4]));
    let composed: &Op = &|t| {
        let gate = candle_nn::ops::silu(&t[0].broadcast_matmul(&t[1].t()?)?)?;
        let up = t[0].broadcast_matmul(&t[2].t()?)?;
        t[4].add(&(gate * up)?.broadcast_matmul(&t[3].t()?)?)
    };
    let shapes: &[&[usize]] = &[&[2, 3, 4], &[8, 4], &[8, 4], &[4, 8], &[2, 3, 4]];
    check(op, composed, shapes, &[true; 5], &none);
    // 260 rows: the backward runs over chunks of rows (256 and 4).
    let shapes: &[&[usize]] = &[&[2, 130, 3], &[5, 3], &[5, 3], &[3, 5], &[2, 130, 3]];
    check(op, composed, shapes, &[true; 5], &none);
    check(
        op,
        composed,
        shapes,
        &[true, false, true, false, true],
        &none,
    );
    let op: &Op = &|t| nn::swiglu_mlp(&t[0], None, &t[1], &t[2], &t[3], None);
    let composed: &Op = &|t| {
        let gate = candle_nn::ops::silu(&t[0].matmul(&t[1].t()?)?)?;
        (gate * t[0].matmul(&t[2].t()?)?)?.matmul(&t[3].t()?)
    };
    check(
        op,
        composed,
        &[&[3, 4], &[6, 4], &[6, 4], &[5, 6]],
        &[true; 4],
        &none,
    );
}

#[test]
fn an_mlp_s_second_backward_recomputes_what_the_first_released() {
    // The first backward takes the kept intermediates and frees them; a
    // second backward through the same graph must give the same gradients.
    let (vars, ts) = vars_of(&[&[3, 4], &[8, 4], &[8, 4], &[4, 8]], 50, DType::F32);
    let t: Vec<&Tensor> = ts.iter().collect();
    let x3 = t[0].reshape((1, 3, 4)).unwrap();
    let w3 = Tensor::cat(&[t[1], t[2]], 0)
        .unwrap()
        .narrow(0, 0, 12)
        .unwrap();
    for y in [
        nn::qkv_attention(&x3, None, &w3, None, 2, true, None).unwrap(),
        nn::swiglu_mlp(t[0], None, t[1], t[2], t[3], None).unwrap(),
        nn::gelu_mlp(t[0], None, t[1], None, t[3], None, Some(t[0])).unwrap(),
    ] {
        let loss = weighted_loss(&y);
        let (first, second) = (loss.backward().unwrap(), loss.backward().unwrap());
        for v in &vars {
            if let Some(g) = first.get(v) {
                assert_eq!(rel_diff(g, second.get(v).unwrap()), 0.0);
            }
        }
    }
}

/// The three sublayer ops on the same inputs (norms inside), in `dtype`,
/// and every input's gradient, in f32.
fn sublayers(dtype: DType, x_view: bool) -> Vec<Tensor> {
    let shapes: [&[usize]; 7] = [
        &[2, 5, 8],
        &[8],
        &[8],
        &[24, 8],
        &[32, 8],
        &[8, 32],
        &[32, 8],
    ];
    let (vars, t) = vars_of(&shapes, 80, dtype);
    // A transposed view as the input: the ops must not assume contiguity.
    let x = if x_view {
        t[0].transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    } else {
        t[0].clone()
    };
    let ln = nn::PreNorm::Layer {
        gain: &t[1],
        bias: &t[2],
        eps: 1e-5,
    };
    let rms = nn::PreNorm::Rms {
        gain: &t[1],
        eps: 1e-6,
    };
    let att = nn::qkv_attention(&x, Some(ln), &t[3], None, 2, true, None).unwrap();
    let h = nn::gelu_mlp(&att, Some(ln), &t[4], None, &t[5], None, Some(&x)).unwrap();
    let y = nn::swiglu_mlp(&h, Some(rms), &t[4], &t[6], &t[5], Some(&h)).unwrap();
    let loss = weighted_loss(&y.to_dtype(DType::F32).unwrap());
    let grads = loss.backward().unwrap();
    let mut all = vec![y.to_dtype(DType::F32).unwrap()];
    all.extend(
        vars.iter()
            .map(|v| grads.get(v).unwrap().to_dtype(DType::F32).unwrap()),
    );
    all
}

#[test]
fn sublayer_ops_in_half_precision_and_on_views() {
    let reference = sublayers(DType::F32, false);
    // A strided input gives the same values and gradients, bit for bit.
    for (a, b) in sublayers(DType::F32, true).iter().zip(&reference) {
        assert_eq!(rel_diff(a, b), 0.0);
    }
    // bf16 and f16 (the norms in their f32 work dtype): within their
    // precision (8 and 11 bits of mantissa, over sums of up to 32 terms).
    for (dtype, tol) in [(DType::BF16, 0.1), (DType::F16, 0.02)] {
        for (i, (a, b)) in sublayers(dtype, false).iter().zip(&reference).enumerate() {
            let err = rel_diff(a, b);
            assert!(err < tol, "{dtype:?}, tensor {i}: {err:e}");
        }
    }
}

#[test]
fn sublayer_ops_over_no_tokens() {
    // T = 0: empty outputs and zero gradients, no error.
    let x = Var::from_tensor(&tensor(&[2, 0, 8], 1, 1.0, DType::F32)).unwrap();
    let w = Var::from_tensor(&tensor(&[24, 8], 2, 1.0, DType::F32)).unwrap();
    let (w1, w2) = (
        tensor(&[32, 8], 3, 1.0, DType::F32),
        tensor(&[8, 32], 4, 1.0, DType::F32),
    );
    let att = nn::qkv_attention(&x, None, &w, None, 2, true, None).unwrap();
    let y = nn::gelu_mlp(&att, None, &w1, None, &w2, None, Some(&att)).unwrap();
    let y = nn::swiglu_mlp(&y, None, &w1, &w1, &w2, None).unwrap();
    assert_eq!(y.dims(), &[2, 0, 8]);
    let grads = y.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        max_abs(&grads.get(&w).unwrap().to_dtype(DType::F64).unwrap()),
        0.0
    );
    assert_eq!(grads.get(&x).unwrap().dims(), &[2, 0, 8]);
}

#[test]
fn sublayer_ops_at_the_edges() {
    // A scalar input is an error, not a panic.
    let s = tensor(&[], 1, 1.0, DType::F32);
    let (w1, w2) = (
        tensor(&[4, 1], 2, 1.0, DType::F32),
        tensor(&[1, 4], 3, 1.0, DType::F32),
    );
    let err = nn::gelu_mlp(&s, None, &w1, None, &w2, None, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("scalar"), "{err}");
    // An output of width 0, and an input of width 0: empty outputs, zero
    // gradients, as candle's ops give.
    let x = Var::from_tensor(&tensor(&[2, 3, 4], 4, 1.0, DType::F32)).unwrap();
    let w1 = Var::from_tensor(&tensor(&[8, 4], 5, 1.0, DType::F32)).unwrap();
    let w2 = Var::zeros((0, 8), DType::F32, x.device()).unwrap();
    let y = nn::gelu_mlp(&x, None, &w1, None, &w2, None, None).unwrap();
    assert_eq!(y.dims(), &[2, 3, 0]);
    let grads = y.sum_all().unwrap().backward().unwrap();
    let g = grads.get(&w1).unwrap().to_dtype(DType::F64).unwrap();
    assert_eq!(max_abs(&g), 0.0);
    let x0 = Var::zeros((2, 3, 0), DType::F32, x.device()).unwrap();
    let w0 = Var::zeros((8, 0), DType::F32, x.device()).unwrap();
    let w2 = Var::from_tensor(&tensor(&[5, 8], 6, 1.0, DType::F32)).unwrap();
    let y = nn::gelu_mlp(&x0, None, &w0, None, &w2, None, None).unwrap();
    assert_eq!(y.dims(), &[2, 3, 5]);
    let grads = y.sum_all().unwrap().backward().unwrap();
    assert_eq!(grads.get(&x0).unwrap().dims(), &[2, 3, 0]);
    // A norm whose gain and bias differ in dtype: each gradient in its own.
    let g = Var::ones(4, DType::F32, x.device()).unwrap();
    let b = Var::zeros(4, DType::BF16, x.device()).unwrap();
    let norm = nn::PreNorm::Layer {
        gain: &g,
        bias: &b,
        eps: 1e-5,
    };
    let y = nn::gelu_mlp(&x, Some(norm), &w1, None, &w1.t().unwrap(), None, None).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    assert_eq!(grads.get(&g).unwrap().dtype(), DType::F32);
    assert_eq!(grads.get(&b).unwrap().dtype(), DType::BF16);
}

#[test]
fn an_mlp_refuses_a_residual_of_another_shape() {
    let x = tensor(&[2, 4], 1, 1.0, DType::F32);
    let w1 = tensor(&[8, 4], 2, 1.0, DType::F32);
    let w2 = tensor(&[3, 8], 3, 1.0, DType::F32);
    let err = nn::gelu_mlp(&x, None, &w1, None, &w2, None, Some(&x))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("gelu_mlp") && err.contains("[2, 4]") && err.contains("[2, 3]"),
        "{err}"
    );
}

#[test]
fn linear_add_refuses_a_residual_of_another_shape() {
    let x = tensor(&[2, 4], 1, 1.0, DType::F32);
    let w = tensor(&[3, 4], 2, 1.0, DType::F32);
    let r = tensor(&[2, 4], 3, 1.0, DType::F32);
    let err = nn::linear_add(&x, &w, None, &r).unwrap_err().to_string();
    assert!(
        err.contains("residual has shape [2, 4]") && err.contains("[2, 3]"),
        "{err}"
    );
}

#[test]
fn layer_norm() {
    let op: &Op = &|t| nn::layer_norm(&t[0], &t[1], &t[2], 1e-5);
    let composed: &Op = &|t| candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5);
    check(op, composed, &[&[2, 3, 6], &[6], &[6]], &[true; 3], &none);
}

#[test]
fn layer_norm_linear() {
    // Gain and bias through one bundle, weight and bias through another;
    // without a bias the weight is the node's own argument.
    let op: &Op = &|t| nn::layer_norm_linear(&t[0], &t[1], &t[2], 1e-5, &t[3], Some(&t[4]));
    let composed: &Op = &|t| {
        candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5)?
            .broadcast_matmul(&t[3].t()?)?
            .broadcast_add(&t[4])
    };
    let shapes: &[&[usize]] = &[&[2, 3, 6], &[6], &[6], &[4, 6], &[4]];
    check(op, composed, shapes, &[true; 5], &none);
    // Frozen norm parameters, trained weight: one bundle in the backward.
    check(
        op,
        composed,
        shapes,
        &[true, false, false, true, true],
        &none,
    );
    let op: &Op = &|t| nn::layer_norm_linear(&t[0], &t[1], &t[2], 1e-5, &t[3], None);
    let composed: &Op = &|t| {
        candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5)?.broadcast_matmul(&t[3].t()?)
    };
    check(
        op,
        composed,
        &[&[3, 6], &[6], &[6], &[2, 6]],
        &[true; 4],
        &none,
    );
}

#[test]
fn rms_norm() {
    let op: &Op = &|t| nn::rms_norm(&t[0], &t[1], 1e-6);
    let composed: &Op = &|t| candle_nn::ops::rms_norm_slow(&t[0], &t[1], 1e-6);
    check(op, composed, &[&[2, 3, 6], &[6]], &[true; 2], &none);
}

#[test]
fn softmax_last_dim() {
    let op: &Op = &|t| nn::softmax_last_dim(&t[0]);
    let composed: &Op = &|t| candle_nn::ops::softmax(&t[0], D::Minus1);
    check(op, composed, &[&[2, 3, 5]], &[true], &none);
}

#[test]
fn cross_entropy() {
    let op: &Op = &|t| nn::cross_entropy(&t[0], &t[1]);
    let composed: &Op = &|t| candle_nn::loss::cross_entropy(&t[0], &t[1]);
    let targets =
        |_: DType| vec![Tensor::new(&[3u32, 0, 4, 1], &candle_core::Device::Cpu).unwrap()];
    check(op, composed, &[&[4, 5]], &[true, false], &targets);
}

/// `softmax(q k^T / sqrt(d) + mask) v`, composed.
fn attention_composed(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let d = q.dim(D::Minus1)?;
    let s = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?;
    let s = match mask {
        Some(m) => s.broadcast_add(m)?,
        None => s,
    };
    candle_nn::ops::softmax(&s, D::Minus1)?.matmul(v)
}

#[test]
fn attention_causal() {
    // T = 70 spans two blocks of query rows (64 + 6).
    let op: &Op = &|t| nn::attention(&t[0], &t[1], &t[2], true, None);
    let composed: &Op = &|t| {
        let mask = causal_mask(t[0].dim(2)?, t[0].dtype());
        attention_composed(&t[0], &t[1], &t[2], Some(&mask))
    };
    let shape: &[usize] = &[1, 2, 70, 3];
    for_shapes(op, composed, &[shape, shape, shape]);
    let shape: &[usize] = &[2, 2, 5, 4];
    for_shapes(op, composed, &[shape, shape, shape]);
}

#[test]
fn attention_causal_over_more_keys_than_queries() {
    // 70 queries over 75 keys (a cached prefix of 5): query i sees keys up
    // to i + 5. Each block of query rows reads only the keys it may see.
    const PREFIX: usize = 5;
    let op: &Op = &|t| nn::attention(&t[0], &t[1], &t[2], true, None);
    let composed: &Op = &|t| {
        let (n, s) = (t[0].dim(2)?, t[1].dim(2)?);
        let v: Vec<f32> = (0..n * s)
            .map(|i| {
                if i % s > i / s + PREFIX {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(v, (n, s), t[0].device())?.to_dtype(t[0].dtype())?;
        attention_composed(&t[0], &t[1], &t[2], Some(&mask))
    };
    let kv: &[usize] = &[1, 2, 70 + PREFIX, 3];
    for_shapes(op, composed, &[&[1, 2, 70, 3], kv, kv]);
    // Fewer keys than queries leaves the first rows nothing to see.
    let q = tensor(&[1, 2, 6, 3], 1, 1.0, DType::F32);
    let k = tensor(&[1, 2, 4, 3], 2, 1.0, DType::F32);
    let err = nn::attention(&q, &k, &k, true, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("6 queries, 4 keys"), "{err}");
}

/// candle-transformers' `repeat_kv`: `(B, Hkv, S, D)` to `(B, Hkv * n, S, D)`
/// by a `cat` of the heads, independently of the op's own repeat.
#[test]
fn attention_grouped_query() {
    // 4 query heads over 2 and over 1 key/value heads; T = 70 spans two
    // blocks of query rows.
    for (kv_heads, t) in [(2, 70), (1, 5)] {
        let op: &Op = &|x| nn::attention(&x[0], &x[1], &x[2], true, None);
        let composed: &Op = &|x| {
            let n = x[0].dim(1)? / x[1].dim(1)?;
            let mask = causal_mask(x[0].dim(2)?, x[0].dtype());
            attention_composed(
                &x[0],
                &repeat_kv(&x[1], n)?,
                &repeat_kv(&x[2], n)?,
                Some(&mask),
            )
        };
        let kv: &[usize] = &[1, kv_heads, t, 3];
        for_shapes(op, composed, &[&[1, 4, t, 3], kv, kv]);
    }
    // Key/value heads that do not divide the query heads are refused.
    let q = tensor(&[1, 4, 5, 3], 1, 1.0, DType::F32);
    let k = tensor(&[1, 3, 5, 3], 2, 1.0, DType::F32);
    let err = nn::attention(&q, &k, &k, true, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("4 query heads"), "{err}");
}

#[test]
fn attention_with_a_mask_and_no_causality() {
    let op: &Op = &|t| nn::attention(&t[0], &t[1], &t[2], false, Some(&t[3]));
    let composed: &Op = &|t| attention_composed(&t[0], &t[1], &t[2], Some(&t[3]));
    let mask = |dtype: DType| vec![tensor(&[1, 1, 5, 6], 80, 1.0, dtype)];
    check(
        op,
        composed,
        &[&[1, 2, 5, 3], &[1, 2, 6, 3], &[1, 2, 6, 3]],
        &[true, true, true, false],
        &mask,
    );
}

fn for_shapes(op: &Op, composed: &Op, shapes: &[&[usize]]) {
    check(op, composed, shapes, &[true; 3], &none);
}

/// `(T, D/2)` rotation tables at arbitrary angles.
fn tables(t: usize, half: usize, dtype: DType) -> Vec<Tensor> {
    let angles = tensor(&[t, half], 90, 3.0, dtype);
    vec![angles.cos().unwrap(), angles.sin().unwrap()]
}

#[test]
fn rope() {
    let op: &Op = &|t| nn::rope(&t[0], &t[1], &t[2]);
    let composed: &Op = &|t| candle_nn::rotary_emb::rope_slow(&t[0], &t[1], &t[2]);
    check(
        op,
        composed,
        &[&[1, 2, 3, 6]],
        &[true, false, false],
        &|d| tables(3, 3, d),
    );
    // Tables that need gradients (learned frequencies) get them.
    check(op, composed, &[&[1, 2, 3, 6]], &[true, true, true], &|d| {
        tables(3, 3, d)
    });
}

#[test]
fn rope_interleaved() {
    let op: &Op = &|t| nn::rope_i(&t[0], &t[1], &t[2]);
    let composed: &Op = &|t| candle_nn::rotary_emb::rope_i_slow(&t[0], &t[1], &t[2]);
    check(
        op,
        composed,
        &[&[2, 1, 3, 4]],
        &[true, false, false],
        &|d| tables(3, 2, d),
    );
    check(op, composed, &[&[2, 1, 3, 4]], &[true, true, true], &|d| {
        tables(3, 2, d)
    });
}

/// The drop-ins, with tables computed from a learned frequency vector and
/// a learned scale (as NTK/YaRN-style scaling with a learned factor does):
/// every parameter gets plain candle's gradient (composed rotation), inside
/// a checkpointed region too.
#[test]
fn rope_drop_ins_with_learned_frequencies() {
    use remat_runtime::candle_nn::rotary_emb as dropin;
    use remat_runtime::Region;
    let (t, half) = (5, 3);
    let inv_freq = var(&[1, half], 91, 0.5, DType::F32);
    let scale = var(&[1], 92, 1.0, DType::F32);
    let x = var(&[2, 3, t, 2 * half], 93, 1.0, DType::F32);
    let positions = Tensor::arange(0f32, t as f32, x.device())
        .unwrap()
        .reshape((t, 1))
        .unwrap();
    type Rot = fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;
    let cases: [(Rot, Rot, bool); 3] = [
        (dropin::rope, candle_nn::rotary_emb::rope_slow, false),
        (dropin::rope_i, candle_nn::rotary_emb::rope_i_slow, false),
        (dropin::rope_thd, candle_nn::rotary_emb::rope_slow, true),
    ];
    for (rotate, reference, thd) in cases {
        let loss = |rot: Rot, is_reference: bool, checkpointed: bool| {
            let positions = positions.clone();
            let run = move |x: &Tensor, f: &Tensor, s: &Tensor| -> Result<Tensor> {
                let angles = positions.broadcast_mul(&f.broadcast_mul(s)?)?;
                let (cos, sin) = (angles.cos()?, angles.sin()?);
                match (thd, is_reference) {
                    // The reference rotates the (B, H, T, D) view.
                    (true, true) => rot(&x.transpose(1, 2)?, &cos, &sin)?.transpose(1, 2),
                    _ => rot(x, &cos, &sin),
                }
            };
            let xin = match thd {
                true => x.as_tensor().transpose(1, 2).unwrap().contiguous().unwrap(),
                false => x.as_tensor().clone(),
            };
            let y = if checkpointed {
                let (f, s) = (inv_freq.as_tensor().clone(), scale.as_tensor().clone());
                let run = run.clone();
                Region::new("rope")
                    .run(&[&xin], move |ctx, ins| {
                        ctx.recompute("rot", &[&ins[0]], |v| run(&v[0], &f, &s))
                    })
                    .unwrap()
            } else {
                run(&xin, inv_freq.as_tensor(), scale.as_tensor()).unwrap()
            };
            let g = weighted_loss(&y).backward().unwrap();
            [&x, &inv_freq, &scale].map(|v| g.get(v).expect("a gradient").clone())
        };
        let want = loss(reference, true, false);
        for checkpointed in [false, true] {
            let got = loss(rotate, false, checkpointed);
            for (g, w) in got.iter().zip(&want) {
                let d = rel_diff(g, w);
                assert!(d <= 1e-5, "thd {thd}, checkpointed {checkpointed}: {d}");
            }
        }
    }
}

#[test]
fn swiglu() {
    let op: &Op = &|t| nn::swiglu(&t[0]);
    let composed: &Op = &|t| candle_nn::ops::swiglu(&t[0]);
    check(op, composed, &[&[2, 3, 8]], &[true], &none);
}

#[test]
fn gelu() {
    let op: &Op = &|t| nn::gelu(&t[0]);
    let composed: &Op = &|t| t[0].gelu();
    check(op, composed, &[&[2, 3, 8]], &[true], &none);
}

#[test]
fn attention_on_views_of_one_projection() {
    // q, k, v as transposed views `(B, T, H, D) -> (B, H, T, D)`, the way a
    // model splits one projection into heads without copying.
    fn view(t: &Tensor) -> Result<Tensor> {
        t.transpose(1, 2)
    }
    let op: &Op = &|t| nn::attention(&view(&t[0])?, &view(&t[1])?, &view(&t[2])?, true, None);
    let composed: &Op = &|t| {
        let mask = causal_mask(t[0].dim(1)?, t[0].dtype());
        let c = |t: &Tensor| view(t)?.contiguous();
        attention_composed(&c(&t[0])?, &c(&t[1])?, &c(&t[2])?, Some(&mask))
    };
    let shape: &[usize] = &[2, 5, 2, 3];
    for_shapes(op, composed, &[shape, shape, shape]);
}

#[test]
fn attention_over_the_packed_projection() {
    // `qkv` `(B, T, 3 H D)`, 2 heads of 3; T = 70 spans two blocks of query
    // rows. The reference splits it with contiguous copies and merges the
    // heads back, as a model written with candle's ops does.
    const HEADS: usize = 2;
    const HEAD: usize = 3;
    let op: &Op = &|t| nn::attention_qkv(&t[0], HEADS, true, None);
    let composed: &Op = &|t| {
        let (b, n, c3) = t[0].dims3()?;
        let c = c3 / 3;
        let part = |i: usize| {
            t[0].narrow(2, i * c, c)?
                .reshape((b, n, HEADS, HEAD))?
                .transpose(1, 2)?
                .contiguous()
        };
        let mask = causal_mask(n, t[0].dtype());
        let y = attention_composed(&part(0)?, &part(1)?, &part(2)?, Some(&mask))?;
        y.transpose(1, 2)?.reshape((b, n, c))
    };
    for t in [70, 5] {
        check(op, composed, &[&[2, t, 3 * HEADS * HEAD]], &[true], &none);
    }
    // A width that is not three times the heads is refused.
    let qkv = tensor(&[1, 4, 20], 1, 1.0, DType::F32);
    let err = nn::attention_qkv(&qkv, 3, true, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("20 wide") && err.contains("3 heads"), "{err}");
}

#[test]
fn qkv_attention() {
    // The norm, the projection with its bias, causal attention over 2
    // heads of 3; T = 70 spans two blocks of query rows.
    let op: &Op = &|t| nn::qkv_attention(&t[0], Some(layer(t)), &t[3], Some(&t[4]), 2, true, None);
    let composed: &Op = &|t| {
        let (b, n, c) = t[0].dims3()?;
        let x = candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5)?;
        let qkv = x.broadcast_matmul(&t[3].t()?)?.broadcast_add(&t[4])?;
        let (q, k, v) = split_heads(&qkv, 2)?;
        let y = attention_composed(&q, &k, &v, Some(&causal_mask(n, t[0].dtype())))?;
        y.transpose(1, 2)?.reshape((b, n, c))
    };
    for t in [70, 5] {
        check(
            op,
            composed,
            &[&[2, t, 6], &[6], &[6], &[18, 6], &[18]],
            &[true; 5],
            &none,
        );
    }
    // No norm, no bias; a learned padding mask over the keys gets its
    // gradient (it travels in the node's bundle).
    let op: &Op = &|t| nn::qkv_attention(&t[0], None, &t[1], None, 2, false, Some(&t[2]));
    let composed: &Op = &|t| {
        let (b, n, c) = t[0].dims3()?;
        let (q, k, v) = split_heads(&t[0].broadcast_matmul(&t[1].t()?)?, 2)?;
        let y = attention_composed(&q, &k, &v, Some(&t[2]))?;
        y.transpose(1, 2)?.reshape((b, n, c))
    };
    check(
        op,
        composed,
        &[&[2, 5, 6], &[18, 6], &[5]],
        &[true; 3],
        &none,
    );
    // Only the weight: the node's second argument is the weight itself.
    check(
        op,
        composed,
        &[&[2, 5, 6], &[18, 6], &[5]],
        &[true, true, false],
        &none,
    );
    // A projection that is not three times the heads is refused.
    let (x, w) = (
        tensor(&[1, 4, 6], 1, 1.0, DType::F32),
        tensor(&[20, 6], 2, 1.0, DType::F32),
    );
    let err = nn::qkv_attention(&x, None, &w, None, 3, true, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("20 wide") && err.contains("3 heads"), "{err}");
}

#[test]
fn qkv_attention_equals_its_ops_bit_for_bit() {
    // `layer_norm`, `linear` and `attention_qkv`: the same arithmetic in
    // the same order.
    for dtype in [DType::F32, DType::F64] {
        let run = |fused: bool| {
            let shapes: [&[usize]; 5] = [&[2, 70, 8], &[8], &[8], &[24, 8], &[24]];
            let (vars, t) = vars_of(&shapes, 60, dtype);
            let y = if fused {
                nn::qkv_attention(&t[0], Some(layer(&t)), &t[3], Some(&t[4]), 2, true, None)
            } else {
                let n = nn::layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap();
                let qkv = nn::linear(&n, &t[3], Some(&t[4])).unwrap();
                nn::attention_qkv(&qkv, 2, true, None)
            }
            .unwrap();
            let grads = weighted_loss(&y).backward().unwrap();
            let mut all = vec![y.flatten_all().unwrap()];
            all.extend(
                vars.iter()
                    .map(|v| grads.get(v).unwrap().flatten_all().unwrap()),
            );
            all
        };
        for (i, (a, b)) in run(true).iter().zip(&run(false)).enumerate() {
            assert_eq!(rel_diff(a, b), 0.0, "{dtype:?}, tensor {i}");
        }
    }
}

#[test]
fn dropout() {
    // Seeded before each call: the same mask every time, so the op is a
    // fixed linear map that finite differences can check, and the same
    // draws as the composed one.
    let op: &Op = &|t| {
        remat_runtime::random::seed(11);
        nn::dropout(&t[0], 0.3)
    };
    let composed: &Op = &|t| {
        remat_runtime::random::seed(11);
        composed_dropout(&t[0], 0.3)
    };
    check(op, composed, &[&[4, 3, 8]], &[true], &none);
}

#[test]
fn dropout_replays_its_mask_in_a_recomputed_statement() {
    use remat_runtime::{Plan, Region};
    let x = var(&[6, 10], 12, 1.0, DType::F32);
    let run = |plan: Plan| {
        remat_runtime::random::seed(3);
        let y = plan
            .scope(|| {
                Region::new("drop").run(&[x.as_tensor()], |ctx, ins| {
                    let h = ctx.open("h", &[&ins[0]], |t| nn::dropout(&t[0].tanh()?, 0.5))?;
                    ctx.open("y", &[&h], |t| (&t[0] * &t[0])?.sum_all())
                })
            })
            .unwrap();
        let g = y.backward().unwrap();
        (y, g.get(&x).unwrap().clone())
    };
    let (y_off, g_off) = run(Plan::off());
    let (y, g) = run(Plan::recompute_all());
    assert_eq!(rel_diff(&y, &y_off), 0.0);
    // The replay draws the same mask: the same gradient, exactly.
    assert_eq!(rel_diff(&g, &g_off), 0.0);
}

/// Batched tables `(B, T, D/2)` that need gradients, both layouts: the
/// same values as the fused rotation with plain tables, and every gradient
/// equal to candle's composed rotation run batch by batch.
#[test]
fn rope_with_batched_learned_tables() {
    type Rot = fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;
    let cases: [(Rot, Rot); 2] = [
        (nn::rope, candle_nn::rotary_emb::rope_slow),
        (nn::rope_i, candle_nn::rotary_emb::rope_i_slow),
    ];
    for (fused, slow) in cases {
        let x = var(&[2, 3, 4, 6], 94, 1.0, DType::F64);
        let angles = var(&[2, 4, 3], 95, 2.0, DType::F64);
        let run = |per_batch: bool| {
            let a = angles.as_tensor();
            let (cos, sin) = (a.cos().unwrap(), a.sin().unwrap());
            let y = if per_batch {
                let parts: Vec<Tensor> = (0..2)
                    .map(|b| {
                        let xb = x.as_tensor().narrow(0, b, 1).unwrap();
                        slow(&xb, &cos.get(b).unwrap(), &sin.get(b).unwrap()).unwrap()
                    })
                    .collect();
                Tensor::cat(&parts, 0).unwrap()
            } else {
                fused(x.as_tensor(), &cos, &sin).unwrap()
            };
            let g = weighted_loss(&y).backward().unwrap();
            (
                y,
                g.get(&x).unwrap().clone(),
                g.get(&angles).unwrap().clone(),
            )
        };
        let (y, gx, ga) = run(false);
        let (y_ref, gx_ref, ga_ref) = run(true);
        assert_eq!(y.dims(), x.dims());
        assert!(rel_diff(&y, &y_ref) <= 1e-12);
        assert!(rel_diff(&gx, &gx_ref) <= 1e-12);
        assert!(rel_diff(&ga, &ga_ref) <= 1e-12);
        // Untracked tables take the fused kernel: the same values.
        let a = angles.as_tensor().detach();
        let plain = fused(x.as_tensor(), &a.cos().unwrap(), &a.sin().unwrap()).unwrap();
        assert!(rel_diff(&plain, &y_ref) <= 1e-12);
    }
}

/// `gelu'(x) * dy` by hand, in f64 (the tanh approximation candle's `gelu`
/// computes).
fn gelu_grad_by_hand(x: f64, dy: f64) -> f64 {
    let (c, a) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044715);
    let t = (c * (x + a * x * x * x)).tanh();
    dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * a * x * x))
}

#[test]
fn half_precision_backwards_on_the_cpu_compute_in_f64_and_round_once() {
    for dtype in [DType::BF16, DType::F16] {
        // GELU: every element of the input's gradient is the f64 value
        // from the half values, rounded once to the dtype.
        let x = Var::from_tensor(&tensor(&[3, 700], 1, 3.0, dtype)).unwrap();
        let dy = tensor(&[3, 700], 2, 1.0, dtype);
        let y = nn::gelu(x.as_tensor()).unwrap();
        let g = (y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        let got = g.get(&x).unwrap().to_dtype(DType::F64).unwrap();
        let (xs, dys) = (f64s(x.as_tensor()), f64s(&dy));
        let want: Vec<f64> = xs
            .iter()
            .zip(&dys)
            .map(|(&x, &dy)| gelu_grad_by_hand(x, dy))
            .collect();
        let want = Tensor::from_vec(want, (3, 700), &candle_core::Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        assert_eq!(max_abs(&(got - want).unwrap()), 0.0, "{dtype:?}");

        // The MLPs over 600 rows (three chunks of the backward): the same
        // ops in f64 on the same half values, within the dtype's rounding.
        let shapes: [&[usize]; 4] = [&[600, 16], &[64, 16], &[16, 64], &[64, 16]];
        let (vars, t) = vars_of(&shapes, 90, dtype);
        let wide: Vec<Var> = t
            .iter()
            .map(|t| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap())
            .collect();
        let run = |t: &[Tensor]| {
            let h = nn::gelu_mlp(&t[0], None, &t[1], None, &t[2], None, None).unwrap();
            let y = nn::swiglu_mlp(&h, None, &t[1], &t[3], &t[2], Some(&h)).unwrap();
            weighted_loss(&y.to_dtype(DType::F64).unwrap())
                .backward()
                .unwrap()
        };
        let t64: Vec<Tensor> = wide.iter().map(|v| v.as_tensor().clone()).collect();
        let (g, g64) = (run(&t), run(&t64));
        // The forward rounds each product and activation to the dtype (8
        // and 11 bits of mantissa), and the backward's products too: a
        // handful of roundings along each path through the two MLPs
        // (measured: 1.2e-2 in bf16, 1.5e-3 in f16).
        let tolerance = if dtype == DType::BF16 {
            2f64.powi(-6)
        } else {
            2f64.powi(-9)
        };
        for (i, (v, w)) in vars.iter().zip(&wide).enumerate() {
            let err = rel_diff(
                &g.get(v).unwrap().to_dtype(DType::F64).unwrap(),
                g64.get(w).unwrap(),
            );
            assert!(err <= tolerance, "{dtype:?}, gradient {i}: {err:e}");
        }
    }
}

#[test]
fn products_refuse_weights_that_do_not_fit_naming_them() {
    // A transposed weight, a weight of the wrong rank, a bias of the wrong
    // width: an error naming the op and the weight or the bias, before
    // anything is computed (candle's would name a matmul's operands).
    let x = tensor(&[2, 3, 8], 1, 1.0, DType::F32);
    let w = tensor(&[5, 8], 2, 1.0, DType::F32);
    let b = tensor(&[5], 3, 1.0, DType::F32);
    let r = tensor(&[2, 3, 5], 4, 1.0, DType::F32);
    let (g, beta) = (
        tensor(&[8], 5, 1.0, DType::F32),
        tensor(&[8], 6, 1.0, DType::F32),
    );
    type Product<'a> = &'a dyn Fn(&Tensor, Option<&Tensor>) -> Result<Tensor>;
    let ops: [(&str, Product); 4] = [
        ("linear", &|w, b| nn::linear(&x, w, b)),
        ("linear_add", &|w, b| nn::linear_add(&x, w, b, &r)),
        ("gelu_linear_add", &|w, b| nn::gelu_linear_add(&x, w, b, &r)),
        ("layer_norm_linear", &|w, b| {
            nn::layer_norm_linear(&x, &g, &beta, 1e-5, w, b)
        }),
    ];
    for (name, op) in ops {
        assert_eq!(op(&w, Some(&b)).unwrap().dims(), [2, 3, 5], "{name}");
        let e = op(&w.t().unwrap(), Some(&b)).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{name}: the input has shape [2, 3, 8] but the weight [8, 5]"
            )) && e.contains("(out, in)"),
            "{e}"
        );
        let e = op(&w.unsqueeze(0).unwrap(), None).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("{name}: the weight has shape [1, 5, 8]")),
            "{e}"
        );
        let e = op(&w, Some(&tensor(&[4], 7, 1.0, DType::F32)))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("{name}: the bias has shape [4]")),
            "{e}"
        );
    }
}

#[test]
fn norms_losses_and_rotations_refuse_arguments_that_do_not_fit_naming_them() {
    let f = |dims: &[usize]| tensor(dims, 8, 1.0, DType::F32);
    let x = f(&[2, 3, 8]);
    let err = |r: Result<Tensor>| r.unwrap_err().to_string();
    let e = err(nn::layer_norm(&x, &f(&[7]), &f(&[8]), 1e-5));
    assert!(
        e.starts_with("layer_norm: the gain has shape [7] but the input [2, 3, 8]"),
        "{e}"
    );
    let e = err(nn::layer_norm(&x, &f(&[8]), &f(&[2, 9]), 1e-5));
    assert!(
        e.starts_with("layer_norm: the shift has shape [2, 9]"),
        "{e}"
    );
    let e = err(nn::rms_norm(&x, &f(&[9]), 1e-5));
    assert!(e.starts_with("rms_norm: the gain has shape [9]"), "{e}");
    let logits = f(&[4, 5]);
    let e = err(nn::cross_entropy(&logits, &f(&[4])));
    assert!(
        e.starts_with("cross_entropy: the targets are F32 of shape [4]"),
        "{e}"
    );
    let ids = Tensor::new(&[1u32, 0, 4], &candle_core::Device::Cpu).unwrap();
    let e = err(nn::cross_entropy(&logits, &ids));
    assert!(e.contains("of shape (4,)"), "{e}");
    let e = err(nn::cross_entropy(&f(&[2, 4, 5]), &ids));
    assert!(
        e.starts_with("cross_entropy: the logits have shape [2, 4, 5]"),
        "{e}"
    );
    let e = err(nn::swiglu(&f(&[2, 7])));
    assert!(e.starts_with("swiglu: the input has shape [2, 7]"), "{e}");
    let q = f(&[1, 2, 3, 4]);
    let e = err(nn::rope(&q, &f(&[2, 2]), &f(&[2, 2])));
    assert!(e.starts_with("rope: the tables are [2, 2] (cos) and [2, 2] (sin) but the input [1, 2, 3, 4] needs (3, 2)"), "{e}");
    let e = err(nn::rope_i(&q, &f(&[3, 2]), &f(&[3, 4])));
    assert!(
        e.starts_with("rope_i: the tables are [3, 2] (cos) and [3, 4] (sin)"),
        "{e}"
    );
    // What fits still runs.
    assert_eq!(
        nn::rope(&q, &f(&[3, 2]), &f(&[3, 2])).unwrap().dims(),
        [1, 2, 3, 4]
    );
    assert_eq!(nn::swiglu(&f(&[2, 8])).unwrap().dims(), [2, 4]);
}
