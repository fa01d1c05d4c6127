//! Replays over cancelling data: a reduction, a matmul or a softmax whose
//! result is far smaller than what it adds up, reading a value the forward
//! read as a view (a transpose, a chunk of a packed projection, a view
//! passed as the block's input, a saved view). The replay reads such a
//! value from a leaf copy; had it read the copy contiguous, candle's
//! kernels would add in another order, and the check, which compares
//! within a tolerance of the output's magnitude, would refuse a right
//! replay. Every plan must give plain candle's loss and gradients, in
//! every float dtype, without an error.

use candle_core::{DType, Result, Tensor, Var, D};
use remat_runtime::{backward, remat, Plan};

use crate::common::{rel_diff, var, weighted_loss};

/// Values of a large magnitude whose signs alternate along every dim, plus
/// noise a few units in the last place of that magnitude: a sum along any
/// dim nearly cancels (to about `1e-5` of its sum of magnitudes in `f32`,
/// `1e-2` in the 16-bit dtypes, where the magnitude stays in range).
fn cancelling(dims: &[usize], seed: u64, dtype: DType) -> Var {
    let (magnitude, noise) = match dtype {
        DType::F16 => (20.0, 0.5),
        DType::BF16 => (1e3, 8.0),
        _ => (1e3, 1e-2),
    };
    let noise = crate::common::lcg(dims.iter().product(), seed, noise);
    let values: Vec<f64> = noise
        .iter()
        .enumerate()
        .map(|(flat, n)| {
            let (mut rest, mut parity) = (flat, 0);
            for &d in dims.iter().rev() {
                parity += rest % d;
                rest /= d;
            }
            let sign = if parity % 2 == 0 { 1.0 } else { -1.0 };
            sign * magnitude + n
        })
        .collect();
    let t = Tensor::from_vec(values, dims, &candle_core::Device::Cpu).unwrap();
    Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
}

/// An encoder block's statistics over tokens: centred over the tokens,
/// read through a transposed view from another unit (the saved `gate`
/// splits the replay), summed where it cancels.
#[derive(Clone)]
struct TokenDrift {
    w: Var,
}

impl TokenDrift {
    remat! {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let centred = x.broadcast_sub(&x.mean_keepdim(1)?)?;
            let by_channel = centred.transpose(1, 2)?;
            #[save]
            let gate = x.broadcast_matmul(self.w.as_tensor())?.tanh()?;
            let drift = by_channel.sum_keepdim(D::Minus1)?;
            let y = gate.broadcast_mul(&drift.transpose(1, 2)?)?;
            Ok((y + centred)?)
        }
    }
}

/// A packed projection's halves, each centred, the first read as a
/// chunk (a strided view) by a reduction in another unit.
#[derive(Clone)]
struct PackedHalves {
    w: Var,
}

impl PackedHalves {
    remat! {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let (b, t, c) = x.dims3()?;
            let packed = x.broadcast_matmul(self.w.as_tensor())?.reshape((b, t, 2, c))?;
            let centred = packed.broadcast_sub(&packed.mean_keepdim(D::Minus1)?)?;
            let first = centred.narrow(2, 0, 1)?.squeeze(2)?;
            #[save]
            let second = centred.narrow(2, 1, 1)?.squeeze(2)?.sqr()?;
            let total = first.sum_keepdim(D::Minus1)?;
            let y = (second.broadcast_mul(&total)? + first)?;
            Ok(y)
        }
    }
}

/// Attention scores whose dot products cancel, the keys read through a
/// transposed view from another unit, then a softmax and a row sum over a
/// view of it.
#[derive(Clone)]
struct Scores {
    wq: Var,
    wk: Var,
}

impl Scores {
    remat! {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
            let q = centred.broadcast_matmul(self.wq.as_tensor())?;
            let k_t = centred.broadcast_matmul(self.wk.as_tensor())?.transpose(1, 2)?;
            #[save]
            let scale = (q.sqr()?.mean_keepdim(D::Minus1)? + 1.0)?.sqrt()?;
            let scores = q.matmul(&k_t)?;
            let probs = candle_nn::ops::softmax(&scores, D::Minus1)?.transpose(1, 2)?;
            #[save]
            let pooled = probs.sum_keepdim(D::Minus1)?;
            let y = scores.broadcast_div(&scale)?.broadcast_mul(&pooled)?;
            Ok(y)
        }
    }
}

remat! {
    /// A block whose input is a view (the caller passes `x.t()`), summed
    /// where it cancels, and a saved view read by a recomputed reduction.
    fn drift_of_a_view(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let drift = x.sum_keepdim(D::Minus1)?;
        #[save]
        let shifted_t = x.broadcast_sub(&drift)?.t()?;
        let back = shifted_t.sum_keepdim(D::Minus1)?;
        let y = x.matmul(w)?.broadcast_mul(&drift)?.broadcast_add(&back.t()?)?;
        Ok(y)
    }
}

fn plans() -> Vec<Plan> {
    vec![
        Plan::declared(),
        Plan::recompute_all(),
        Plan::save_all(),
        Plan::budget(0.5),
    ]
}

/// The loss and the gradients of `vars` under `plan`.
fn step(plan: &Plan, vars: &[&Var], f: &dyn Fn() -> Result<Tensor>) -> (Tensor, Vec<Tensor>) {
    let y = plan.scope(f).unwrap_or_else(|e| panic!("{plan}: {e}"));
    let loss = weighted_loss(&y.to_dtype(DType::F32).unwrap());
    let g = backward(&loss).unwrap_or_else(|e| panic!("{plan}: {e}"));
    let grads = vars.iter().map(|v| g.get(v).unwrap().clone()).collect();
    (loss, grads)
}

/// Every plan runs without an error, twice (a region's first forward runs
/// its statements on copies, later ones on the values as they are). Where
/// only recomputed statements differ from plain candle (`Plan::off()`: the
/// block's own code, no tape), the loss and the gradients are plain
/// candle's bit for bit: the replay read every value in the forward's
/// layout. Saved statements run on contiguous copies of what they read,
/// which rounds otherwise: over values that cancel to a few units in the
/// last place, that is another result altogether, so only finiteness is
/// asserted for the plans that save.
fn agree(vars: &[&Var], dtype: DType, f: &dyn Fn() -> Result<Tensor>) {
    let (loss, grads) = step(&Plan::off(), vars, f);
    for plan in plans() {
        for _ in 0..2 {
            let (l, g) = step(&plan, vars, f);
            if plan.to_string() == Plan::recompute_all().to_string() {
                assert_eq!(rel_diff(&l, &loss), 0.0, "{plan} {dtype:?}: loss");
                for (i, (a, b)) in g.iter().zip(&grads).enumerate() {
                    let r = rel_diff(a, b);
                    assert_eq!(r, 0.0, "{plan} {dtype:?}: gradient {i} differs by {r:e}");
                }
            }
            for t in std::iter::once(&l).chain(&g) {
                let t = t.to_dtype(DType::F64).unwrap().sum_all().unwrap();
                assert!(
                    t.to_scalar::<f64>().unwrap().is_finite(),
                    "{plan} {dtype:?}"
                );
            }
        }
    }
}

const DTYPES: [DType; 4] = [DType::F64, DType::F32, DType::BF16, DType::F16];

#[test]
fn a_reduction_over_a_transposed_view_from_another_unit() {
    for dtype in DTYPES {
        let x = cancelling(&[2, 64, 8], 1, dtype);
        let m = TokenDrift {
            w: var(&[8, 8], 2, 0.3, dtype),
        };
        agree(&[&x, &m.w], dtype, &|| m.forward(x.as_tensor()));
    }
}

#[test]
fn a_reduction_over_a_chunk_of_a_packed_projection() {
    for dtype in DTYPES {
        let x = cancelling(&[2, 6, 40], 3, dtype);
        let m = PackedHalves {
            w: var(&[40, 80], 4, 0.2, dtype),
        };
        agree(&[&x, &m.w], dtype, &|| m.forward(x.as_tensor()));
    }
}

#[test]
fn cancelling_scores_and_a_softmax_over_views() {
    for dtype in DTYPES {
        let x = cancelling(&[2, 40, 32], 5, dtype);
        let m = Scores {
            wq: var(&[32, 32], 6, 0.3, dtype),
            wk: var(&[32, 32], 7, 0.3, dtype),
        };
        agree(&[&x, &m.wq, &m.wk], dtype, &|| m.forward(x.as_tensor()));
    }
}

#[test]
fn a_view_as_the_blocks_input_and_a_saved_view() {
    for dtype in DTYPES {
        let x = cancelling(&[64, 40], 8, dtype);
        let w = var(&[64, 64], 9, 0.3, dtype);
        agree(&[&x, &w], dtype, &|| {
            drift_of_a_view(&x.as_tensor().t()?, w.as_tensor())
        });
    }
}

#[test]
fn a_statement_api_region_from_its_first_call() {
    // Its first forward hands the block contiguous copies of what needs
    // gradients (to see undeclared reads); later ones the values as they
    // are: each replay reads as its own forward read.
    for dtype in DTYPES {
        let x = cancelling(&[64, 48], 10, dtype);
        let w = var(&[64, 64], 11, 0.3, dtype);
        let run = |plan: &Plan| {
            let wt = w.as_tensor().clone();
            let y = plan
                .scope(|| {
                    remat_runtime::Region::new("drift").run(
                        &[&x.as_tensor().t().unwrap()],
                        move |ctx, ins| {
                            let drift =
                                ctx.recompute("drift", &[&ins[0]], |t| t[0].sum_keepdim(1))?;
                            let _ = ctx.save("cut", &[&ins[0]], |t| t[0].sqr())?;
                            let h = ctx.recompute("h", &[&ins[0], &drift], |t| {
                                t[0].matmul(&wt)?.broadcast_mul(&t[1])
                            })?;
                            ctx.recompute("y", &[&h], |t| t[0].sum_keepdim(1))
                        },
                    )
                })
                .unwrap_or_else(|e| panic!("{plan} {dtype:?}: {e}"));
            let g = backward(&weighted_loss(&y.to_dtype(DType::F32).unwrap()))
                .unwrap_or_else(|e| panic!("{plan} {dtype:?}: {e}"));
            (g.get(&x).unwrap().clone(), g.get(&w).unwrap().clone())
        };
        let plain = run(&Plan::off());
        for call in 0..3 {
            let full = run(&Plan::recompute_all());
            assert_eq!(rel_diff(&full.0, &plain.0), 0.0, "{dtype:?} call {call}");
            assert_eq!(rel_diff(&full.1, &plain.1), 0.0, "{dtype:?} call {call}");
            run(&Plan::declared());
        }
    }
}
