//! `remat_runtime::candle_nn`, the drop-ins for candle-nn's backward-less
//! ops: gradients against f64 finite differences (independent of any
//! backward) and against candle's composed `*_slow` versions, outputs
//! against candle's fused forward, in f64, f32 and bf16; the modules built
//! from a `VarBuilder`; errors; and one model file that trains only after
//! its `use` lines are switched.
//!
//! Tolerances, each relative to the largest element of the reference:
//!
//! * f64 against finite differences: <= 1e-10. Richardson's five-point
//!   central difference with step 1e-3 has a truncation error of about
//!   h^4/30 |f^(5)| ~ 3e-14 and a rounding error of about 1e-16 |L| / h ~
//!   1e-13 on these inputs (|x| <= 3, no near-zero RMS); 1.0e-12 measured.
//! * f64 against the composed ops: <= 1e-10 (the same formulas in another
//!   order: rounding, ~1e-15).
//! * f32 against the composed ops, forward and gradients: <= 1e-6 (a few
//!   f32 units in the last place, 2^-23 ~ 1.2e-7 each, from sums
//!   reassociated over rows of 8).
//! * f32 and bf16 outputs against candle's fused ops: softmax and the
//!   rotations run candle's kernels and are equal bit for bit; the norms
//!   compute in another order: <= 1e-6 in f32; in bf16 candle rounds the
//!   RMS, the quotient and the product with the gain to bf16 (2^-9
//!   relative each) where the drop-in rounds once, so <= 4 * 2^-9 = 2^-7.
//! * bf16 gradients against the f64 gradients of the same bf16 inputs and
//!   output weights: the norms compute in f32 and round once (2^-9):
//!   <= 2^-8. The rotations compute in bf16 as candle's kernels do: their
//!   tables (cos and sin of bf16 angles) and each product and sum are
//!   rounded (2^-9 each, four in all): <= 2^-7. Softmax computes in bf16
//!   as candle's does, its backward's row sum of 8 terms included:
//!   <= 2^-6.

use crate::common::{f64s, lcg, rel_diff, tensor, worst_difference, Quotient};
use candle_core::{DType, Device, Module, Result, Tensor, Var, D};
use candle_nn::{VarBuilder, VarMap};
use remat_runtime::candle_nn::{self as dropin, ops, rotary_emb};

type Op = dyn Fn(&[Tensor]) -> Result<Tensor>;

/// One drop-in op: its inputs (shape, scale and offset of each; the
/// first `trained` get gradients), the op, candle's composed version, and
/// candle's fused op (compared in f32 and bf16: its norms refuse f64),
/// which is the drop-in's own kernel for softmax and the rotations.
struct Case {
    name: &'static str,
    inputs: Vec<(Vec<usize>, f64, f64)>,
    trained: usize,
    op: Box<Op>,
    composed: Box<Op>,
    fused: Box<Op>,
    same_kernel: bool,
}

fn inputs(case: &Case, dtype: DType) -> Vec<Tensor> {
    case.inputs
        .iter()
        .enumerate()
        .map(|(i, (dims, scale, offset))| {
            (tensor(dims, 40 + i as u64, *scale, DType::F64) + *offset)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        })
        .collect()
}

fn cases() -> Vec<Case> {
    // A rotation's input 1 is its angles, (positions, head_dim / 2).
    let trig = |t: &[Tensor]| -> Result<(Tensor, Tensor)> { Ok((t[1].cos()?, t[1].sin()?)) };
    let rotate_half = |x: &Tensor| -> Result<Tensor> {
        let d = x.dim(D::Minus1)?;
        Tensor::cat(
            &[
                &x.narrow(D::Minus1, d / 2, d / 2)?.neg()?,
                &x.narrow(D::Minus1, 0, d / 2)?,
            ],
            D::Minus1,
        )
    };
    let norm = |s: f64| (vec![8], 0.3, s);
    vec![
        Case {
            name: "ops::rms_norm",
            inputs: vec![(vec![2, 3, 8], 2.0, 0.0), norm(1.0)],
            trained: 2,
            op: Box::new(|t| ops::rms_norm(&t[0], &t[1], 1e-5)),
            composed: Box::new(|t| candle_nn::ops::rms_norm_slow(&t[0], &t[1], 1e-5)),
            fused: Box::new(|t| candle_nn::ops::rms_norm(&t[0], &t[1], 1e-5)),
            same_kernel: false,
        },
        Case {
            name: "ops::layer_norm",
            inputs: vec![(vec![2, 3, 8], 2.0, 0.7), norm(1.0), norm(0.0)],
            trained: 3,
            op: Box::new(|t| ops::layer_norm(&t[0], &t[1], &t[2], 1e-5)),
            composed: Box::new(|t| candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5)),
            fused: Box::new(|t| candle_nn::ops::layer_norm(&t[0], &t[1], &t[2], 1e-5)),
            same_kernel: false,
        },
        Case {
            name: "ops::softmax_last_dim",
            inputs: vec![(vec![2, 3, 8], 3.0, 0.0)],
            trained: 1,
            op: Box::new(|t| ops::softmax_last_dim(&t[0])),
            composed: Box::new(|t| candle_nn::ops::softmax(&t[0], D::Minus1)),
            fused: Box::new(|t| candle_nn::ops::softmax_last_dim(&t[0])),
            same_kernel: true,
        },
        Case {
            // Tables one position longer than the sequence, as
            // candle-transformers' are (max_position_embeddings rows).
            name: "rotary_emb::rope",
            inputs: vec![(vec![2, 2, 3, 8], 1.0, 0.0), (vec![4, 4], 3.0, 0.0)],
            trained: 1,
            op: Box::new(move |t| {
                let (c, s) = trig(t)?;
                rotary_emb::rope(&t[0], &c, &s)
            }),
            composed: Box::new(move |t| {
                let (c, s) = trig(t)?;
                candle_nn::rotary_emb::rope_slow(&t[0], &c, &s)
            }),
            fused: Box::new(move |t| {
                let (c, s) = trig(t)?;
                candle_nn::rotary_emb::rope(&t[0], &c, &s)
            }),
            same_kernel: true,
        },
        Case {
            name: "rotary_emb::rope_i",
            inputs: vec![(vec![2, 2, 3, 8], 1.0, 0.0), (vec![4, 4], 3.0, 0.0)],
            trained: 1,
            op: Box::new(move |t| {
                let (c, s) = trig(t)?;
                rotary_emb::rope_i(&t[0], &c, &s)
            }),
            composed: Box::new(move |t| {
                let (c, s) = trig(t)?;
                candle_nn::rotary_emb::rope_i_slow(&t[0], &c, &s)
            }),
            fused: Box::new(move |t| {
                let (c, s) = trig(t)?;
                candle_nn::rotary_emb::rope_i(&t[0], &c, &s)
            }),
            same_kernel: true,
        },
        Case {
            // candle has no rope_thd_slow: rope_slow in the (b, h, t, d)
            // layout, transposed back.
            name: "rotary_emb::rope_thd",
            inputs: vec![(vec![2, 3, 2, 8], 1.0, 0.0), (vec![3, 4], 3.0, 0.0)],
            trained: 1,
            op: Box::new(move |t| {
                let (c, s) = trig(t)?;
                rotary_emb::rope_thd(&t[0], &c, &s)
            }),
            composed: Box::new(move |t| {
                let (c, s) = trig(t)?;
                candle_nn::rotary_emb::rope_slow(&t[0].transpose(1, 2)?, &c, &s)?.transpose(1, 2)
            }),
            fused: Box::new(move |t| {
                let (c, s) = trig(t)?;
                candle_nn::rotary_emb::rope_thd(&t[0], &c, &s)
            }),
            same_kernel: true,
        },
        Case {
            // Tables per sequence, (batch, seq, head_dim / 2): candle's
            // rope_slow does not take them, so the composed rotation is
            // written out.
            name: "rotary_emb::rope (batched tables)",
            inputs: vec![(vec![2, 2, 3, 8], 1.0, 0.0), (vec![2, 3, 4], 3.0, 0.0)],
            trained: 1,
            op: Box::new(move |t| {
                let (c, s) = trig(t)?;
                rotary_emb::rope(&t[0], &c, &s)
            }),
            composed: Box::new(move |t| {
                let (c, s) = trig(t)?;
                let full = |x: &Tensor| Tensor::cat(&[x, x], D::Minus1)?.unsqueeze(1);
                t[0].broadcast_mul(&full(&c)?)? + rotate_half(&t[0])?.broadcast_mul(&full(&s)?)?
            }),
            fused: Box::new(move |t| {
                let (c, s) = trig(t)?;
                candle_nn::rotary_emb::rope(&t[0], &c, &s)
            }),
            same_kernel: true,
        },
        Case {
            name: "LayerNorm::new",
            inputs: vec![(vec![2, 3, 8], 2.0, -0.5), norm(1.0), norm(0.0)],
            trained: 3,
            op: Box::new(|t| {
                dropin::LayerNorm::new(t[1].clone(), t[2].clone(), 1e-5).forward(&t[0])
            }),
            composed: Box::new(|t| candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5)),
            fused: Box::new(|t| {
                candle_nn::LayerNorm::new(t[1].clone(), t[2].clone(), 1e-5).forward(&t[0])
            }),
            same_kernel: false,
        },
        Case {
            name: "LayerNorm::new_no_bias",
            inputs: vec![(vec![2, 3, 8], 2.0, 0.5), norm(1.0)],
            trained: 2,
            op: Box::new(|t| dropin::LayerNorm::new_no_bias(t[1].clone(), 1e-5).forward(&t[0])),
            composed: Box::new(|t| {
                candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[1].zeros_like()?, 1e-5)
            }),
            fused: Box::new(|t| {
                candle_nn::LayerNorm::new_no_bias(t[1].clone(), 1e-5).forward(&t[0])
            }),
            same_kernel: false,
        },
        Case {
            name: "RmsNorm::new",
            inputs: vec![(vec![2, 3, 8], 2.0, 0.0), norm(1.0)],
            trained: 2,
            op: Box::new(|t| dropin::RmsNorm::new(t[1].clone(), 1e-5).forward(&t[0])),
            composed: Box::new(|t| candle_nn::ops::rms_norm_slow(&t[0], &t[1], 1e-5)),
            fused: Box::new(|t| candle_nn::RmsNorm::new(t[1].clone(), 1e-5).forward(&t[0])),
            same_kernel: false,
        },
        Case {
            // A transposed, non-contiguous input (candle's RmsNorm then
            // takes its composed path).
            name: "RmsNorm::new (non-contiguous input)",
            inputs: vec![(vec![2, 8, 3], 2.0, 0.0), norm(1.0)],
            trained: 2,
            op: Box::new(|t| {
                dropin::RmsNorm::new(t[1].clone(), 1e-5).forward(&t[0].transpose(1, 2)?)
            }),
            composed: Box::new(|t| {
                candle_nn::ops::rms_norm_slow(&t[0].transpose(1, 2)?, &t[1], 1e-5)
            }),
            fused: Box::new(|t| {
                candle_nn::RmsNorm::new(t[1].clone(), 1e-5).forward(&t[0].transpose(1, 2)?)
            }),
            same_kernel: false,
        },
    ]
}

/// `op`'s output and the gradients of its first `trained` inputs for the
/// loss `sum(op(inputs) * w)`, `w` a fixed tensor of the output's shape
/// (drawn in f64, then rounded to the output's dtype).
fn run(op: &Op, inputs: &[Tensor], trained: usize) -> (Tensor, Vec<Tensor>) {
    run_rounded(op, inputs, trained, None)
}

/// [`run`] with `w` rounded to `round` first (a bf16 run's `w`, for its
/// f64 reference).
fn run_rounded(
    op: &Op,
    inputs: &[Tensor],
    trained: usize,
    round: Option<DType>,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs[..trained]
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let mut ins: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    ins.extend_from_slice(&inputs[trained..]);
    let y = op(&ins).unwrap();
    let w = tensor(y.dims(), 99, 1.0, DType::F64)
        .to_dtype(round.unwrap_or(y.dtype()))
        .and_then(|w| w.to_dtype(y.dtype()))
        .unwrap();
    let grads = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let gs = vars
        .iter()
        .enumerate()
        .map(|(i, v)| {
            grads
                .get(v)
                .unwrap_or_else(|| panic!("input {i} got no gradient"))
                .clone()
        })
        .collect();
    (y.detach(), gs)
}

/// The largest error of `op`'s gradients in f64 against Richardson's
/// five-point central differences, relative to each input's largest
/// gradient.
fn finite_differences(op: &Op, inputs: &[Tensor], trained: usize) -> f64 {
    let (y, analytic) = run(op, inputs, trained);
    let w = tensor(y.dims(), 99, 1.0, DType::F64);
    let loss = |ins: &[Tensor]| -> f64 {
        (op(ins).unwrap() * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar()
            .unwrap()
    };
    let mut worst = 0f64;
    for (i, g) in analytic.iter().enumerate() {
        let g = f64s(g);
        assert!(g.iter().any(|&x| x != 0.0), "input {i}: zero gradient");
        let (err, _, _) = worst_difference(
            &f64s(&inputs[i]),
            &g,
            0.0,
            Quotient::FivePoint(1e-3),
            |moved| {
                let mut ins = inputs.to_vec();
                ins[i] = Tensor::from_vec(moved, inputs[i].shape(), &Device::Cpu).unwrap();
                loss(&ins)
            },
        );
        worst = worst.max(err);
    }
    worst
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    for case in cases() {
        let err = finite_differences(&*case.op, &inputs(&case, DType::F64), case.trained);
        assert!(err <= 1e-10, "{}: {err:e}", case.name);
    }
}

#[test]
fn outputs_and_gradients_match_candle_s_composed_ops_in_f64_and_f32() {
    for (dtype, tolerance) in [(DType::F64, 1e-10), (DType::F32, 1e-6)] {
        for case in cases() {
            let ins = inputs(&case, dtype);
            let (y, gs) = run(&*case.op, &ins, case.trained);
            let (y_ref, gs_ref) = run(&*case.composed, &ins, case.trained);
            assert_eq!(y.dtype(), dtype);
            let err = rel_diff(&y, &y_ref);
            assert!(err <= tolerance, "{} {dtype:?} forward: {err:e}", case.name);
            for (i, (g, r)) in gs.iter().zip(&gs_ref).enumerate() {
                let err = rel_diff(g, r);
                assert!(
                    err <= tolerance,
                    "{} {dtype:?} input {i}: {err:e}",
                    case.name
                );
            }
        }
    }
}

#[test]
fn outputs_equal_candle_s_fused_forward() {
    for (dtype, norm_tolerance) in [(DType::F32, 1e-6), (DType::BF16, 2f64.powi(-7))] {
        for case in cases() {
            let ins = inputs(&case, dtype);
            let y = (case.op)(&ins).unwrap();
            let want = (case.fused)(&ins).unwrap();
            assert_eq!(y.dims(), want.dims(), "{}", case.name);
            assert_eq!(y.dtype(), dtype, "{}", case.name);
            assert_eq!(y.is_contiguous(), want.is_contiguous(), "{}", case.name);
            if case.same_kernel {
                let bits = |t: &Tensor| {
                    t.to_dtype(DType::F64)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f64>()
                        .unwrap()
                };
                assert_eq!(bits(&y), bits(&want), "{} {dtype:?}", case.name);
            } else {
                let err = rel_diff(&y, &want);
                assert!(err <= norm_tolerance, "{} {dtype:?}: {err:e}", case.name);
            }
        }
    }
}

/// Rows as wide as a real model's: a bf16 sum of 1024 squares, accumulated
/// in bf16, would lose a third of its value (adding terms near 1 to a sum
/// above 512, where bf16's spacing is 4, rounds them away); candle's
/// kernels and the drop-ins sum in f32.
#[test]
fn bf16_norms_compute_their_statistics_in_f32() {
    let x = tensor(&[4, 1024], 1, 2.0, DType::BF16);
    let alpha = (tensor(&[1024], 2, 0.3, DType::BF16) + 1.0).unwrap();
    let beta = tensor(&[1024], 3, 0.3, DType::BF16);
    let pairs = [
        (
            ops::rms_norm(&x, &alpha, 1e-6).unwrap(),
            candle_nn::ops::rms_norm(&x, &alpha, 1e-6).unwrap(),
        ),
        (
            ops::layer_norm(&x, &alpha, &beta, 1e-6).unwrap(),
            candle_nn::ops::layer_norm(&x, &alpha, &beta, 1e-6).unwrap(),
        ),
    ];
    for (got, want) in pairs {
        let err = rel_diff(&got, &want);
        assert!(err <= 2f64.powi(-7), "{err:e}");
    }
}

#[test]
fn bf16_gradients_are_the_f64_gradients_rounded() {
    for case in cases() {
        let ins = inputs(&case, DType::BF16);
        let (_, gs) = run(&*case.op, &ins, case.trained);
        // The same bf16 values, in f64, through the f64 op checked above.
        let ins64: Vec<Tensor> = ins
            .iter()
            .map(|t| t.to_dtype(DType::F64).unwrap())
            .collect();
        let (_, want) = run_rounded(&*case.op, &ins64, case.trained, Some(DType::BF16));
        let tolerance = if case.name.contains("softmax") {
            2f64.powi(-6)
        } else if case.name.contains("rope") {
            2f64.powi(-7)
        } else {
            2f64.powi(-8)
        };
        for (i, (g, w)) in gs.iter().zip(&want).enumerate() {
            assert_eq!(g.dtype(), DType::BF16, "{}", case.name);
            let err = rel_diff(g, w);
            assert!(err <= tolerance, "{} input {i}: {err:e}", case.name);
        }
    }
}

#[test]
fn modules_build_from_a_var_builder_as_candle_s_do() {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let rms = dropin::rms_norm(8, 1e-6, vb.pp("rms")).unwrap();
    let ln = dropin::layer_norm(8, 1e-5, vb.pp("ln")).unwrap();
    let ln_no_bias = dropin::layer_norm_no_bias(8, 1e-5, vb.pp("ln_no_bias")).unwrap();
    let rms_bias = dropin::layer_norm(
        8,
        dropin::LayerNormConfig {
            eps: 1e-6,
            remove_mean: false,
            affine: true,
        },
        vb.pp("rms_bias"),
    )
    .unwrap();
    let named = named_vars(&varmap);
    let names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "ln.bias",
            "ln.weight",
            "ln_no_bias.weight",
            "rms.weight",
            "rms_bias.bias",
            "rms_bias.weight"
        ]
    );
    // candle's initial values: gains one, biases zero.
    for (name, var) in &named {
        let want = if name.ends_with("weight") { 1.0 } else { 0.0 };
        let got = var.as_tensor().to_vec1::<f32>().unwrap();
        assert!(got.iter().all(|&v| v == want), "{name}: {got:?}");
    }
    for (i, (_, var)) in named.iter().enumerate() {
        var.set(&(tensor(&[8], i as u64, 0.3, DType::F32) + 1.0).unwrap())
            .unwrap();
    }
    // candle-nn's builders on the same VarBuilder find the same Vars.
    let candle_modules: Vec<Box<dyn Module>> = vec![
        Box::new(candle_nn::rms_norm(8, 1e-6, vb.pp("rms")).unwrap()),
        Box::new(candle_nn::layer_norm(8, 1e-5, vb.pp("ln")).unwrap()),
        Box::new(candle_nn::layer_norm_no_bias(8, 1e-5, vb.pp("ln_no_bias")).unwrap()),
        Box::new(
            candle_nn::layer_norm(
                8,
                candle_nn::LayerNormConfig {
                    eps: 1e-6,
                    remove_mean: false,
                    affine: true,
                },
                vb.pp("rms_bias"),
            )
            .unwrap(),
        ),
    ];
    assert_eq!(named_vars(&varmap).len(), 6);
    let modules: Vec<Box<dyn Module>> = vec![
        Box::new(rms),
        Box::new(ln),
        Box::new(ln_no_bias),
        Box::new(rms_bias),
    ];
    let x = tensor(&[2, 3, 8], 5, 2.0, DType::F32);
    let trained = |ms: &[Box<dyn Module>]| {
        let mut loss = Tensor::zeros((), DType::F32, &dev).unwrap();
        for m in ms {
            let y = m.forward(&x).unwrap();
            let w = tensor(y.dims(), 9, 1.0, DType::F32);
            loss = (loss + (y * w).unwrap().sum_all().unwrap()).unwrap();
        }
        let grads = loss.backward().unwrap();
        let with: Vec<&str> = named
            .iter()
            .filter(|(_, v)| grads.get(v).is_some())
            .map(|(n, _)| n.as_str())
            .collect();
        (loss.to_scalar::<f32>().unwrap(), with)
    };
    let (loss, with) = trained(&modules);
    let (candle_loss, candle_with) = trained(&candle_modules);
    assert!(
        ((loss - candle_loss) / candle_loss).abs() <= 1e-6,
        "{loss} {candle_loss}"
    );
    assert_eq!(with, names, "every gain and bias trains");
    // candle's fused path (RmsNorm, LayerNorm with a bias, on a contiguous
    // input) has no backward; its composed path (no bias, or no mean
    // removed) has one.
    assert_eq!(
        candle_with,
        ["ln_no_bias.weight", "rms_bias.bias", "rms_bias.weight"]
    );

    // PyTorch's older names, `gamma` and `beta`, as candle reads them.
    let old = VarBuilder::from_tensors(
        [
            ("ln.gamma".to_string(), tensor(&[8], 1, 1.0, DType::F32)),
            ("ln.beta".to_string(), tensor(&[8], 2, 1.0, DType::F32)),
        ]
        .into(),
        DType::F32,
        &dev,
    );
    let ln = dropin::layer_norm(8, 1e-5, old.pp("ln")).unwrap();
    assert_eq!(
        ln.weight().to_vec1::<f32>().unwrap(),
        tensor(&[8], 1, 1.0, DType::F32).to_vec1::<f32>().unwrap()
    );
    assert!(ln.bias().is_some());

    // From candle-nn's modules: the same Vars, now trained.
    let w = Var::from_tensor(&tensor(&[8], 3, 1.0, DType::F32)).unwrap();
    let b = Var::from_tensor(&tensor(&[8], 4, 1.0, DType::F32)).unwrap();
    let rms: dropin::RmsNorm = candle_nn::RmsNorm::new(w.as_tensor().clone(), 1e-6).into();
    let ln: dropin::LayerNorm =
        candle_nn::LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-5).into();
    assert_eq!(
        (
            rms.eps(),
            ln.eps(),
            ln.remove_mean(),
            rms.clone().into_inner().remove_mean()
        ),
        (1e-6, 1e-5, true, false)
    );
    let loss = (rms.forward(&x).unwrap().sum_all().unwrap()
        + ln.forward(&x).unwrap().sqr().unwrap().sum_all().unwrap())
    .unwrap();
    let grads = loss.backward().unwrap();
    assert!(grads.get(&w).is_some() && grads.get(&b).is_some());
}

#[test]
fn misfits_are_errors_naming_the_op_and_the_shapes() {
    let dev = Device::Cpu;
    let f32s = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &dev).unwrap();
    let x = f32s(&[2, 3, 8]);
    let scalar = Tensor::new(1f32, &dev).unwrap();
    let ints = Tensor::zeros((2, 8), DType::U32, &dev).unwrap();
    let bf16 = Tensor::zeros(8, DType::BF16, &dev).unwrap();
    let (c4, c3) = (f32s(&[3, 4]), f32s(&[3, 3]));
    let cases: Vec<(Result<Tensor>, &[&str])> = vec![
        (
            ops::rms_norm(&x, &f32s(&[7]), 1e-5),
            &["ops::rms_norm", "alpha must be [8]", "[2, 3, 8]", "[7]"],
        ),
        (
            ops::rms_norm(&x, &f32s(&[8, 1]), 1e-5),
            &["ops::rms_norm", "[8, 1]"],
        ),
        (
            ops::rms_norm(&x, &bf16, 1e-5),
            &["ops::rms_norm", "F32", "BF16"],
        ),
        (
            ops::rms_norm(&scalar, &f32s(&[1]), 1e-5),
            &["ops::rms_norm", "no dimension"],
        ),
        (
            ops::rms_norm(&ints, &Tensor::zeros(8, DType::U32, &dev).unwrap(), 1e-5),
            &["ops::rms_norm", "floating-point", "U32"],
        ),
        (
            ops::layer_norm(&x, &f32s(&[8]), &f32s(&[9]), 1e-5),
            &["ops::layer_norm", "beta must be [8]", "[9]"],
        ),
        (
            ops::softmax_last_dim(&scalar),
            &["softmax_last_dim", "at least one dimension"],
        ),
        (ops::softmax_last_dim(&ints), &["softmax_last_dim", "U32"]),
        (
            dropin::LayerNorm::new(f32s(&[7]), f32s(&[7]), 1e-5).forward(&x),
            &["LayerNorm::forward", "[7]"],
        ),
        (
            dropin::RmsNorm::new(f32s(&[7]), 1e-5).forward(&x),
            &["RMS norm", "[7]"],
        ),
        (
            rotary_emb::rope(&x, &c4, &c4),
            &["rotary_emb::rope:", "4 dimensions", "[2, 3, 8]"],
        ),
        (
            rotary_emb::rope(&f32s(&[1, 1, 3, 7]), &c3, &c3),
            &["rotary_emb::rope:", "odd"],
        ),
        (
            rotary_emb::rope(&f32s(&[1, 1, 4, 8]), &c4, &c4),
            &["rotary_emb::rope:", "at least 4 positions", "[3, 4]"],
        ),
        (
            rotary_emb::rope_i(&f32s(&[1, 1, 3, 8]), &c3, &c3),
            &["rotary_emb::rope_i:", "4 columns"],
        ),
        (
            rotary_emb::rope(&f32s(&[1, 1, 3, 8]), &f32s(&[2, 3, 4]), &c4),
            &[
                "rotary_emb::rope:",
                "cos must be (seq, head_dim / 2) or (batch",
            ],
        ),
        (
            rotary_emb::rope_i(
                &f32s(&[1, 1, 3, 8]),
                &c4.to_dtype(DType::BF16).unwrap(),
                &c4,
            ),
            &["rotary_emb::rope_i:", "BF16"],
        ),
        (
            rotary_emb::rope_thd(&f32s(&[1, 4, 1, 8]), &c4, &c4),
            &[
                "rotary_emb::rope_thd:",
                "at least 4 positions",
                "(batch, seq, heads, head_dim)",
            ],
        ),
    ];
    for (result, words) in cases {
        let message = match result {
            Ok(_) => panic!("accepted: {words:?}"),
            Err(e) => e.to_string(),
        };
        for w in words {
            assert!(message.contains(w), "{w:?} not in: {message}");
        }
    }
}

/// The variables of `varmap` by name, in name order.
fn named_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let mut named: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// candle's composed versions, under the names of the ops they compose.
mod composed {
    use candle_core::{Module, Result, Tensor};
    use candle_nn::{LayerNormConfig, VarBuilder};

    pub mod ops {
        use candle_core::{Result, Tensor, D};
        pub fn rms_norm(x: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
            candle_nn::ops::rms_norm_slow(x, alpha, eps)
        }
        pub fn layer_norm(x: &Tensor, alpha: &Tensor, beta: &Tensor, eps: f32) -> Result<Tensor> {
            candle_nn::ops::layer_norm_slow(x, alpha, beta, eps)
        }
        pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
            candle_nn::ops::softmax(x, D::Minus1)
        }
    }

    pub mod rotary_emb {
        use candle_core::{Result, Tensor};
        pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
            candle_nn::rotary_emb::rope_slow(x, cos, sin)
        }
        pub fn rope_i(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
            candle_nn::rotary_emb::rope_i_slow(x, cos, sin)
        }
        pub fn rope_thd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
            rope(&x.transpose(1, 2)?, cos, sin)?.transpose(1, 2)
        }
    }

    /// candle's RmsNorm through its composed forward.
    #[derive(Debug, Clone)]
    pub struct RmsNorm(candle_nn::RmsNorm);

    impl RmsNorm {
        pub fn weight(&self) -> &Tensor {
            self.0.weight()
        }
        pub fn eps(&self) -> f64 {
            self.0.eps()
        }
    }

    impl Module for RmsNorm {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.0.forward_diff(x)
        }
    }

    pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
        candle_nn::rms_norm(size, eps, vb).map(RmsNorm)
    }

    /// candle's LayerNorm (with a bias) through `layer_norm_slow`.
    #[derive(Debug, Clone)]
    pub struct LayerNorm(candle_nn::LayerNorm);

    impl Module for LayerNorm {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let bias = self
                .0
                .bias()
                .ok_or_else(|| candle_core::Error::Msg("no bias".into()))?;
            ops::layer_norm(x, self.0.weight(), bias, self.0.eps() as f32)
        }
    }

    pub fn layer_norm<C: Into<LayerNormConfig>>(
        size: usize,
        config: C,
        vb: VarBuilder,
    ) -> Result<LayerNorm> {
        candle_nn::layer_norm(size, config, vb).map(LayerNorm)
    }
}

mod candle_nn_file {
    use candle_nn::{layer_norm, ops, rms_norm, rotary_emb, LayerNorm, RmsNorm};
    include!("dropin/model.rs");
}

mod dropin_file {
    use remat_runtime::candle_nn::{layer_norm, ops, rms_norm, rotary_emb, LayerNorm, RmsNorm};
    include!("dropin/model.rs");
}

mod composed_file {
    use super::composed::{layer_norm, ops, rms_norm, rotary_emb, LayerNorm, RmsNorm};
    include!("dropin/model.rs");
}

macro_rules! tiny {
    ($file:ident) => {
        $file::Config {
            vocab_size: 11,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 3,
            num_attention_heads: 2,
            max_position_embeddings: 8,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
        }
    };
}

/// The loss and each parameter's gradient (if any), by name.
fn loss_and_gradients(
    loss: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    named: &[(String, Var)],
) -> (f64, Vec<Option<Tensor>>) {
    let ids: Vec<u32> = lcg(12, 3, 1.0)
        .iter()
        .map(|u| ((u + 1.0) * 5.4) as u32)
        .collect();
    let targets: Vec<u32> = lcg(12, 4, 1.0)
        .iter()
        .map(|u| ((u + 1.0) * 5.4) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (2, 6), &Device::Cpu).unwrap();
    let targets = Tensor::from_vec(targets, (2, 6), &Device::Cpu).unwrap();
    let loss = loss(&ids, &targets).unwrap();
    let grads = loss.backward().unwrap();
    let value = loss
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    (
        value,
        named.iter().map(|(_, v)| grads.get(v).cloned()).collect(),
    )
}

#[test]
fn a_model_file_trains_once_its_use_lines_name_the_drop_ins() {
    // One VarMap, three models on its Vars: the same file under three sets
    // of `use` lines.
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let candle = candle_nn_file::Model::new(&tiny!(candle_nn_file), vb.clone()).unwrap();
    let dropin = dropin_file::Model::new(&tiny!(dropin_file), vb.clone()).unwrap();
    let composed = composed_file::Model::new(&tiny!(composed_file), vb).unwrap();
    let named = named_vars(&varmap);
    assert_eq!(named.len(), 50);
    for (i, (name, var)) in named.iter().enumerate() {
        let noise = tensor(var.dims(), 100 + i as u64, 0.3, DType::F32);
        let value = if name.contains("norm") {
            (noise + 1.0).unwrap()
        } else {
            noise
        };
        var.set(&value).unwrap();
    }
    let (loss_candle, g_candle) = loss_and_gradients(|x, y| candle.loss(x, y), &named);
    let (loss_dropin, g_dropin) = loss_and_gradients(|x, y| dropin.loss(x, y), &named);
    let (loss_composed, g_composed) = loss_and_gradients(|x, y| composed.loss(x, y), &named);

    // The same forward...
    assert!(
        (loss_dropin / loss_candle - 1.0).abs() <= 1e-6,
        "{loss_dropin} {loss_candle}"
    );
    // ... but with candle-nn's ops, 1 parameter of 50 gets a gradient: the
    // output head, after the last backward-less op (the final RMS norm).
    let trained = |g: &[Option<Tensor>]| -> Vec<&str> {
        named
            .iter()
            .zip(g)
            .filter(|(_, g)| g.is_some())
            .map(|((n, _), _)| n.as_str())
            .collect()
    };
    assert_eq!(trained(&g_candle), ["lm_head.weight"]);
    // check_gradients names the other 49.
    let grads_of = |g: &[Option<Tensor>]| {
        let mut store = Tensor::zeros((), DType::F32, &Device::Cpu)
            .unwrap()
            .backward()
            .unwrap();
        for ((_, v), g) in named.iter().zip(g) {
            if let Some(g) = g {
                store.insert(v, g.clone());
            }
        }
        store
    };
    match remat_runtime::check_gradients(&grads_of(&g_candle), named.iter().map(|(n, v)| (n, v))) {
        Err(remat_runtime::RematError::MissingGradients { names }) => {
            assert_eq!(names.len(), 49);
            assert!(names.contains(&"model.layers.0.self_attn.q_proj.bias".to_string()));
        }
        other => panic!("{other:?}"),
    }
    // With the drop-ins all 50 do, equal to the composed reference's; the
    // head's equals candle-nn's.
    remat_runtime::check_gradients(&grads_of(&g_dropin), named.iter().map(|(n, v)| (n, v)))
        .unwrap();
    assert_eq!(trained(&g_composed).len(), 50);
    assert!((loss_dropin / loss_composed - 1.0).abs() <= 1e-6);
    let head = named
        .iter()
        .position(|(n, _)| n == "lm_head.weight")
        .unwrap();
    let err = rel_diff(
        g_dropin[head].as_ref().unwrap(),
        g_candle[head].as_ref().unwrap(),
    );
    assert!(err <= 1e-6, "lm_head: {err:e}");
    // Through three layers of norms, attention and products, the ops'
    // f32 differences of <= 1e-6 compound: 1e-5 (2.4e-6 measured).
    for (((name, _), a), b) in named.iter().zip(&g_dropin).zip(&g_composed) {
        let err = rel_diff(a.as_ref().unwrap(), b.as_ref().unwrap());
        assert!(err <= 1e-5, "f32 {name}: {err:e}");
    }

    // In f64 (which candle's fused norms refuse), the drop-ins' gradients
    // are the composed ones to 1e-10.
    let varmap64 = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap64, DType::F64, &Device::Cpu);
    let dropin = dropin_file::Model::new(&tiny!(dropin_file), vb.clone()).unwrap();
    let composed = composed_file::Model::new(&tiny!(composed_file), vb.clone()).unwrap();
    assert!(candle_nn_file::Model::new(&tiny!(candle_nn_file), vb)
        .unwrap()
        .loss(
            &Tensor::zeros((1, 2), DType::U32, &Device::Cpu).unwrap(),
            &Tensor::zeros((1, 2), DType::U32, &Device::Cpu).unwrap()
        )
        .is_err());
    let named64 = named_vars(&varmap64);
    for ((_, v64), (_, v)) in named64.iter().zip(&named) {
        v64.set(&v.as_tensor().to_dtype(DType::F64).unwrap())
            .unwrap();
    }
    let (loss_dropin, g_dropin) = loss_and_gradients(|x, y| dropin.loss(x, y), &named64);
    let (loss_composed, g_composed) = loss_and_gradients(|x, y| composed.loss(x, y), &named64);
    assert!((loss_dropin / loss_composed - 1.0).abs() <= 1e-12);
    for (((name, _), a), b) in named64.iter().zip(&g_dropin).zip(&g_composed) {
        let err = rel_diff(a.as_ref().unwrap(), b.as_ref().unwrap());
        assert!(err <= 1e-10, "f64 {name}: {err:e}");
    }
}

/// The bits of every element of `t`, through `f64` (exact for every float
/// dtype).
fn bits(t: &Tensor) -> Vec<u64> {
    let t = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
    t.to_vec1::<f64>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// The drop-in `AdamW` against candle-nn's: the same parameters, bit for
/// bit, after three steps, for a scalar, a vector, matrices whose rows do
/// not divide into the blocks and a 3-d tensor, in f32, f64, bf16 and f16,
/// with blocks
/// of one row, of a few rows, and of the whole parameter; with weight decay
/// and a learning rate changed between steps.
#[test]
fn adamw_steps_as_candle_nn_s_bit_for_bit_in_blocks_of_rows() {
    use candle_nn::{Optimizer, ParamsAdamW};
    let shapes: [&[usize]; 5] = [&[], &[7], &[5, 3], &[13, 4], &[3, 4, 5]];
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for block_bytes in [1, 3 * 4 * dtype.size_in_bytes(), 1 << 20] {
            let make = || -> Vec<Var> {
                shapes
                    .iter()
                    .enumerate()
                    .map(|(i, s)| Var::from_tensor(&tensor(s, 40 + i as u64, 1.0, dtype)).unwrap())
                    .collect()
            };
            let (ours, theirs) = (make(), make());
            let params = ParamsAdamW {
                lr: 0.01,
                weight_decay: 0.1,
                ..Default::default()
            };
            let mut a = dropin::AdamW::new(ours.clone(), params.clone())
                .unwrap()
                .with_block_bytes(block_bytes);
            let mut b = candle_nn::AdamW::new(theirs.clone(), params).unwrap();
            // A loss with gradients of every sign and size.
            let loss = |vars: &[Var]| -> Tensor {
                let terms: Vec<Tensor> = vars
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        let w = tensor(v.dims(), 60 + i as u64, 1.0, dtype);
                        (v.as_tensor().sqr().unwrap() * &w)
                            .unwrap()
                            .tanh()
                            .unwrap()
                            .sum_all()
                            .unwrap()
                    })
                    .collect();
                Tensor::stack(&terms, 0).unwrap().sum_all().unwrap()
            };
            for step in 0..3 {
                if step == 2 {
                    a.set_learning_rate(0.003);
                    b.set_learning_rate(0.003);
                }
                a.backward_step(&loss(&ours)).unwrap();
                b.backward_step(&loss(&theirs)).unwrap();
            }
            for (x, y) in ours.iter().zip(&theirs) {
                assert_eq!(
                    bits(x.as_tensor()),
                    bits(y.as_tensor()),
                    "{dtype:?}, blocks of {block_bytes} bytes, {:?}",
                    x.dims()
                );
            }
        }
    }
}

/// A gradient of another shape than its parameter is refused before any
/// block of the parameter or its moments is written.
#[test]
fn adamw_refuses_a_gradient_of_another_shape_and_writes_nothing() {
    use candle_nn::{Optimizer, ParamsAdamW};
    let w = Var::from_tensor(&tensor(&[6, 2], 80, 1.0, DType::F32)).unwrap();
    let before = w.as_tensor().to_vec2::<f32>().unwrap();
    let mut opt = dropin::AdamW::new(vec![w.clone()], ParamsAdamW::default())
        .unwrap()
        .with_block_bytes(8);
    // A gradient with fewer rows, put in the store by hand.
    let mut grads = (w.as_tensor() * 0.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    grads.insert(
        w.as_tensor(),
        Tensor::ones((4, 2), DType::F32, &Device::Cpu).unwrap(),
    );
    assert!(opt.step(&grads).is_err());
    assert_eq!(w.as_tensor().to_vec2::<f32>().unwrap(), before);
}

/// `MasterWeights` against an independent run: candle-nn's `AdamW` over
/// `f32` copies of the low-precision parameters, fed the same gradients
/// cast to `f32`. After each of four steps every master equals its copy
/// bit for bit and every parameter is its master rounded to its dtype;
/// an `f32` parameter in the same optimizer steps as candle-nn's would.
/// With remat's `AdamW` and candle-nn's inside, bf16 and f16, write-back
/// blocks of one row, a few rows and the whole master, a learning rate
/// changed between steps and a parameter left without a gradient in one
/// step (AdamW still counts that step, as one optimizer over all would).
#[test]
fn master_weights_step_as_an_f32_optimizer_of_the_masters() {
    use candle_nn::{Optimizer, ParamsAdamW};
    use dropin::MasterWeights;
    for dtype in [DType::BF16, DType::F16] {
        for block_bytes in [1, 3 * 4 * 4, 1 << 20] {
            let at = format!("{dtype:?}, blocks of {block_bytes} B");
            master_weights_against_copies(dtype, &format!("remat's AdamW, {at}"), |vars, p| {
                MasterWeights::<dropin::AdamW>::new(vars, p)
                    .unwrap()
                    .with_block_bytes(block_bytes)
            });
            master_weights_against_copies(
                dtype,
                &format!("candle-nn's AdamW, {at}"),
                |vars, p: ParamsAdamW| {
                    MasterWeights::<candle_nn::AdamW>::new(vars, p)
                        .unwrap()
                        .with_block_bytes(block_bytes)
                },
            );
        }
    }
}

/// [`master_weights_step_as_an_f32_optimizer_of_the_masters`] for one
/// dtype and one optimizer made by `make`.
fn master_weights_against_copies<O>(
    dtype: DType,
    at: &str,
    make: impl Fn(Vec<Var>, candle_nn::ParamsAdamW) -> dropin::MasterWeights<O>,
) where
    O: candle_nn::Optimizer<Config = candle_nn::ParamsAdamW>,
{
    use candle_nn::{Optimizer, ParamsAdamW};
    let shapes: [&[usize]; 5] = [&[], &[7], &[5, 3], &[13, 4], &[3, 4, 5]];
    let params = ParamsAdamW {
        lr: 0.01,
        weight_decay: 0.1,
        ..Default::default()
    };
    // The low-precision parameters, then one in f32.
    let ours: Vec<Var> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| Var::from_tensor(&tensor(s, 40 + i as u64, 1.0, dtype)).unwrap())
        .chain([Var::from_tensor(&tensor(&[3, 2], 49, 1.0, DType::F32)).unwrap()])
        .collect();
    let copies: Vec<Var> = ours
        .iter()
        .map(|v| Var::from_tensor(&v.as_tensor().to_dtype(DType::F32).unwrap()).unwrap())
        .collect();
    let mut opt = make(ours.clone(), params.clone());
    let mut reference = candle_nn::AdamW::new(copies.clone(), params).unwrap();
    for step in 0..4 {
        if step == 2 {
            opt.set_learning_rate(0.003);
            reference.set_learning_rate(0.003);
        }
        assert_eq!(opt.learning_rate(), reference.learning_rate());
        // Gradients of every sign and size; parameter 2 gets none in step 1.
        let terms: Vec<Tensor> = ours
            .iter()
            .enumerate()
            .filter(|&(i, _)| !(step == 1 && i == 2))
            .map(|(i, v)| {
                let w = tensor(v.dims(), 60 + i as u64, 1.0, v.dtype());
                (v.as_tensor().sqr().unwrap() * &w)
                    .unwrap()
                    .tanh()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
            })
            .collect();
        let grads = Tensor::stack(&terms, 0)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut cast = candle_core::backprop::GradStore::default();
        for (v, c) in ours.iter().zip(&copies) {
            if let Some(g) = grads.get(v) {
                assert_eq!(g.dtype(), v.dtype());
                cast.insert(c.as_tensor(), g.to_dtype(DType::F32).unwrap());
            }
        }
        assert_eq!(cast.get_ids().count(), ours.len() - usize::from(step == 1));
        opt.step(&grads).unwrap();
        reference.step(&cast).unwrap();
        for (v, c) in ours.iter().zip(&copies) {
            let at = format!("{at}, step {step}, {:?} {:?}", v.dtype(), v.dims());
            let rounded = c.as_tensor().to_dtype(v.dtype()).unwrap();
            assert_eq!(bits(v.as_tensor()), bits(&rounded), "{at}");
            match opt.master(v) {
                None => assert_eq!(v.dtype(), DType::F32, "{at}"),
                Some(m) => assert_eq!(bits(m.as_tensor()), bits(c.as_tensor()), "{at}"),
            }
        }
    }
    // The updates moved every parameter.
    for (v, i) in ours.iter().zip(0u64..) {
        let first = tensor(v.dims(), 40 + i, 1.0, v.dtype());
        assert_ne!(bits(v.as_tensor()), bits(&first), "{at}: {:?}", v.dims());
    }
}

/// `MasterWeights` refuses a gradient of another shape before any
/// parameter steps (nothing written, no step counted), and holds a
/// parameter passed twice once (an f32 one is updated once a step).
#[test]
fn master_weights_refuse_a_bad_gradient_first_and_hold_a_parameter_once() {
    use candle_nn::{Optimizer, ParamsAdamW};
    use dropin::MasterWeights;
    let a = Var::from_tensor(&tensor(&[4, 2], 81, 1.0, DType::BF16)).unwrap();
    let b = Var::from_tensor(&tensor(&[3, 2], 82, 1.0, DType::BF16)).unwrap();
    let c = Var::from_tensor(&tensor(&[5], 83, 1.0, DType::F32)).unwrap();
    let vars = vec![a.clone(), b.clone(), c.clone(), a.clone(), c.clone()];
    let mut opt = MasterWeights::<dropin::AdamW>::new(vars, ParamsAdamW::default()).unwrap();
    let f32s = |t: &Tensor| -> Vec<f32> {
        let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        t.to_vec1().unwrap()
    };
    let start: Vec<Vec<f32>> = [&a, &b, &c].iter().map(|v| f32s(v.as_tensor())).collect();
    let loss = || {
        let terms = [&a, &b, &c].map(|v| {
            v.as_tensor()
                .to_dtype(DType::F32)
                .unwrap()
                .sum_all()
                .unwrap()
        });
        Tensor::stack(&terms, 0).unwrap().sum_all().unwrap()
    };
    // `b`'s gradient with a row too few, after `a`'s good one.
    let mut grads = loss().backward().unwrap();
    let wrong = Tensor::ones((2, 2), DType::BF16, &Device::Cpu).unwrap();
    grads.insert(b.as_tensor(), wrong);
    assert!(opt.step(&grads).is_err());
    let now: Vec<Vec<f32>> = [&a, &b, &c].iter().map(|v| f32s(v.as_tensor())).collect();
    assert_eq!(now, start);
    assert_eq!(f32s(opt.master(&a).unwrap().as_tensor()), start[0]);
    // Then a good step moves each as the first step of one AdamW over
    // copies of them does (a step count of one, each updated once).
    let copies: Vec<Var> = [opt.master(&a).unwrap(), opt.master(&b).unwrap(), &c]
        .iter()
        .map(|v| Var::from_tensor(&v.as_tensor().copy().unwrap()).unwrap())
        .collect();
    let mut plain = candle_nn::AdamW::new(copies.clone(), ParamsAdamW::default()).unwrap();
    let sum = Tensor::stack(
        &copies
            .iter()
            .map(|v| v.as_tensor().sum_all().unwrap())
            .collect::<Vec<_>>(),
        0,
    );
    plain
        .backward_step(&sum.unwrap().sum_all().unwrap())
        .unwrap();
    opt.backward_step(&loss()).unwrap();
    assert_eq!(
        f32s(opt.master(&a).unwrap().as_tensor()),
        f32s(copies[0].as_tensor())
    );
    assert_eq!(
        f32s(opt.master(&b).unwrap().as_tensor()),
        f32s(copies[1].as_tensor())
    );
    assert_eq!(f32s(c.as_tensor()), f32s(copies[2].as_tensor()));
}
