//! Outputs nothing in the replay reads: the replay leaves the output of a
//! region's last statement uncomputed when `nn`'s op gives it as the
//! statement's whole value (the op's backward reads its inputs, not its
//! output), and computes every output something reads or could have read
//! (a second output, a mask made from it). Each case records what the statement's op gave in the forward and
//! in the replay (NaN: left uncomputed), and compares the gradients with
//! the same code run as plain candle (`Plan::off`): equal bit for bit, the
//! replay running the same kernels on the same bits.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::common::*;
use candle_core::{DType, Tensor, Var};
use remat_runtime::nn::{self, PreNorm};
use remat_runtime::{backward, Ctx, Plan, Region, RematError, Result};

/// Whether the op gave NaN, each time the statement ran.
type Seen = Arc<Mutex<Vec<bool>>>;

fn has_nan(t: &Tensor) -> bool {
    let v = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
    v.to_vec1::<f64>().unwrap().iter().any(|v| v.is_nan())
}

/// The op the block's last statement ends with.
#[derive(Clone, Copy, Debug)]
enum Op {
    Linear,
    GeluMlp,
    SwigluMlp,
}

/// How the statement after the op treats its output.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Use {
    /// Returned as it is, the region's output: left uncomputed.
    Returned,
    /// Another op of the statement reads it (`relu`).
    ReadInside,
    /// Returned beside a value computed from it (both region outputs).
    ReturnedWithDerived,
    /// Returned beside an integer mask made from it, which a recomputed
    /// statement after it reads (no graph shows that read).
    ReturnedWithMask,
    /// Returned twice.
    ReturnedTwice,
    /// A recomputed statement after it reads it.
    ReadByRecomputed,
    /// Only a saved statement after it reads it: the replay does not run
    /// that statement, so the output is still left uncomputed.
    ReadBySaved,
    /// The block's own code makes a mask from it, outside any statement,
    /// and a recomputed statement after it reads the mask (a constant to
    /// the region: no graph or declared read shows where it came from).
    MaskedByBlockCode,
}

#[derive(Clone)]
struct Layer {
    w_in: Var,
    b_in: Var,
    ln_g: Var,
    ln_b: Var,
    fc: Var,
    fc_b: Var,
    proj: Var,
    proj_b: Var,
    gate: Var,
    up: Var,
    down: Var,
    rms_g: Var,
}

const D: usize = 8;
const HIDDEN: usize = 16;

impl Layer {
    fn new(dtype: DType) -> Self {
        let v = |dims: &[usize], seed| var(dims, seed, 0.4, dtype);
        Layer {
            w_in: v(&[D, D], 1),
            b_in: v(&[D], 2),
            ln_g: v(&[D], 3),
            ln_b: v(&[D], 4),
            fc: v(&[HIDDEN, D], 5),
            fc_b: v(&[HIDDEN], 6),
            proj: v(&[D, HIDDEN], 7),
            proj_b: v(&[D], 8),
            gate: v(&[HIDDEN, D], 9),
            up: v(&[HIDDEN, D], 10),
            down: v(&[D, HIDDEN], 11),
            rms_g: v(&[D], 12),
        }
    }

    fn vars(&self) -> Vec<&Var> {
        vec![
            &self.w_in,
            &self.b_in,
            &self.ln_g,
            &self.ln_b,
            &self.fc,
            &self.fc_b,
            &self.proj,
            &self.proj_b,
            &self.gate,
            &self.up,
            &self.down,
            &self.rms_g,
        ]
    }

    /// The op, on `h` `(batch, seq, D)`.
    fn op(&self, op: Op, h: &Tensor) -> candle_core::Result<Tensor> {
        match op {
            // Two op calls: the replay counts them to find the second.
            Op::Linear => {
                let a = nn::linear(h, &self.w_in, Some(&self.b_in))?;
                nn::linear_add(&a, &self.w_in, None, h)
            }
            Op::GeluMlp => {
                let norm = PreNorm::Layer {
                    gain: &self.ln_g,
                    bias: &self.ln_b,
                    eps: 1e-5,
                };
                nn::gelu_mlp(
                    h,
                    Some(norm),
                    &self.fc,
                    Some(&self.fc_b),
                    &self.proj,
                    Some(&self.proj_b),
                    Some(h),
                )
            }
            Op::SwigluMlp => {
                let norm = PreNorm::Rms {
                    gain: &self.rms_g,
                    eps: 1e-6,
                };
                nn::swiglu_mlp(h, Some(norm), &self.gate, &self.up, &self.down, Some(h))
            }
        }
    }

    /// `h = x W^T + b`, then the op on `h` used as `how` says.
    fn forward(
        &self,
        ctx: &mut Ctx,
        x: &Tensor,
        op: Op,
        how: Use,
        seen: &Seen,
    ) -> Result<Vec<Tensor>> {
        let h = ctx.recompute("h", &[x], |t| {
            nn::linear(&t[0], &self.w_in, Some(&self.b_in))
        })?;
        let record = |t: &Tensor| seen.lock().unwrap().push(has_nan(t));
        let one = |y: Result<Tensor>| Ok(vec![y?]);
        match how {
            Use::Returned => one(ctx.recompute("y", &[&h], |t| {
                let y = self.op(op, &t[0])?;
                record(&y);
                Ok::<_, candle_core::Error>(y)
            })),
            Use::ReadInside => one(ctx.recompute("y", &[&h], |t| {
                let y = self.op(op, &t[0])?;
                record(&y);
                y.relu()
            })),
            Use::ReturnedWithDerived => ctx.recompute("y", &[&h], |t| {
                let y = self.op(op, &t[0])?;
                record(&y);
                let e = y.tanh()?;
                Ok::<_, candle_core::Error>(vec![y, e])
            }),
            Use::ReturnedWithMask => {
                let (y, positive) = ctx.recompute("y", &[&h], |t| {
                    let y = self.op(op, &t[0])?;
                    record(&y);
                    let positive = y.ge(0.0)?;
                    Ok::<_, candle_core::Error>((y, positive))
                })?;
                let z = ctx.recompute("z", &[&positive, &h], |t| {
                    let gate = t[0].to_dtype(t[1].dtype())?;
                    t[1].broadcast_mul(&gate)
                })?;
                Ok(vec![y, z])
            }
            Use::ReturnedTwice => ctx.recompute("y", &[&h], |t| {
                let y = self.op(op, &t[0])?;
                record(&y);
                Ok::<_, candle_core::Error>(vec![y.clone(), y])
            }),
            Use::MaskedByBlockCode => {
                let y = ctx.recompute("y", &[&h], |t| {
                    let y = self.op(op, &t[0])?;
                    record(&y);
                    Ok::<_, candle_core::Error>(y)
                })?;
                let keep = y.detach().ge(0.0)?.to_dtype(h.dtype())?;
                let z = ctx.recompute("z", &[&h, &keep], |t| t[0].broadcast_mul(&t[1]))?;
                Ok(vec![y, z])
            }
            Use::ReadByRecomputed | Use::ReadBySaved => {
                let y = ctx.recompute("y", &[&h], |t| {
                    let y = self.op(op, &t[0])?;
                    record(&y);
                    Ok::<_, candle_core::Error>(y)
                })?;
                let z = |t: &[Tensor]| (t[0].tanh()? * &t[1])?.sum_keepdim(2);
                one(if how == Use::ReadBySaved {
                    ctx.save("z", &[&y, &h], z)
                } else {
                    ctx.recompute("z", &[&y, &h], z)
                })
            }
        }
    }
}

/// Runs the layer in a region and as plain candle; returns what the op gave
/// in the forward and in the replay, and asserts the gradients equal plain
/// candle's: bit for bit, but where a saved statement reads `h` beside the
/// recomputed ones (its gradient summed from two units in another order
/// than candle's: 1e-6 relative in f32, 1e-14 in f64, a few ulps).
fn run(op: Op, how: Use, dtype: DType) -> Vec<bool> {
    let layer = Layer::new(dtype);
    let x = var(&[2, 3, D], 20, 1.0, dtype);
    let seen: Seen = Arc::default();
    let call = || {
        let (layer, seen) = (layer.clone(), seen.clone());
        Region::new("layer")
            .run(&[x.as_tensor()], move |ctx, ins| {
                layer.forward(ctx, &ins[0], op, how, &seen)
            })
            .unwrap()
    };
    let loss = |ys: &[Tensor]| {
        let losses: Vec<Tensor> = ys.iter().map(weighted_loss).collect();
        Tensor::stack(&losses, 0).unwrap().sum_all().unwrap()
    };
    let plain = Plan::off().scope(call);
    let g_plain = loss(&plain).backward().unwrap();
    seen.lock().unwrap().clear();
    let ys = call();
    for (y, reference) in ys.iter().zip(&plain) {
        assert_eq!(rel_diff(y, reference), 0.0, "{op:?} {how:?}");
    }
    let g = loss(&ys).backward().unwrap();
    let tolerance = match (how, dtype) {
        (Use::ReadBySaved, DType::F32) => 1e-6,
        (Use::ReadBySaved, _) => 1e-14,
        _ => 0.0,
    };
    let mut vars = layer.vars();
    vars.push(&x);
    for v in vars {
        if let Some(reference) = g_plain.get(v) {
            let diff = rel_diff(g.get(v).unwrap(), reference);
            assert!(diff <= tolerance, "{op:?} {how:?}: {diff}");
        }
    }
    let seen = seen.lock().unwrap().clone();
    seen
}

#[test]
fn the_last_statements_op_output_is_left_uncomputed_and_gradients_equal_plain() {
    for dtype in [DType::F32, DType::F64] {
        for op in [Op::Linear, Op::GeluMlp, Op::SwigluMlp] {
            // Forward, then replay.
            assert_eq!(run(op, Use::Returned, dtype), [false, true], "{op:?}");
            assert_eq!(run(op, Use::ReadBySaved, dtype), [false, true], "{op:?}");
        }
    }
}

#[test]
fn an_output_something_reads_is_computed() {
    for op in [Op::Linear, Op::GeluMlp, Op::SwigluMlp] {
        for how in [
            Use::ReadInside,
            Use::ReturnedWithDerived,
            Use::ReturnedWithMask,
            Use::ReturnedTwice,
            Use::ReadByRecomputed,
            Use::MaskedByBlockCode,
        ] {
            assert_eq!(run(op, how, DType::F32), [false, false], "{op:?} {how:?}");
        }
    }
}

#[test]
fn every_plan_gives_plain_gradients_with_unread_outputs() {
    // Saving `h` or `y` or both: the replay runs what is left.
    let layer = Layer::new(DType::F32);
    let x = var(&[2, 3, D], 21, 1.0, DType::F32);
    let seen: Seen = Arc::default();
    let call = || {
        let (layer, seen) = (layer.clone(), seen.clone());
        Region::new("layer")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let h = ctx.open("h", &[&ins[0]], |t| {
                    nn::linear(&t[0], &layer.w_in, Some(&layer.b_in))
                })?;
                ctx.open("y", &[&h], |t| {
                    let y = layer.op(Op::GeluMlp, &t[0])?;
                    seen.lock().unwrap().push(has_nan(&y));
                    Ok::<_, candle_core::Error>(y)
                })
            })
            .unwrap()
    };
    let plain = Plan::off().scope(call);
    let g_plain = weighted_loss(&plain).backward().unwrap();
    for (saved, replayed) in [
        (&[][..], true),
        (&["h"][..], true),
        (&["y"][..], false),
        (&["h", "y"][..], false),
    ] {
        seen.lock().unwrap().clear();
        let y = Plan::save_only(saved.iter().copied()).scope(call);
        let g = weighted_loss(&y).backward().unwrap();
        for v in layer.vars().into_iter().chain([&x]) {
            if let Some(reference) = g_plain.get(v) {
                assert_eq!(rel_diff(g.get(v).unwrap(), reference), 0.0, "{saved:?}");
            }
        }
        let expected: &[bool] = if replayed { &[false, true] } else { &[false] };
        assert_eq!(&seen.lock().unwrap()[..], expected, "{saved:?}");
    }
}

#[test]
fn a_replay_that_reads_an_output_its_forward_did_not_is_a_desync() {
    // The code reads the op's output only in its second run (a counter it
    // captures): the replay left it uncomputed, and says so instead of
    // giving gradients through NaN.
    let layer = Layer::new(DType::F32);
    let x = var(&[2, 3, D], 22, 1.0, DType::F32);
    let runs = Arc::new(AtomicUsize::new(0));
    let y = Region::new("flaky")
        .run(&[x.as_tensor()], move |ctx, ins| {
            let runs = runs.clone();
            let layer = layer.clone();
            ctx.recompute("y", &[&ins[0]], move |t| {
                let y = layer.op(Op::GeluMlp, &t[0])?;
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    Ok(y)
                } else {
                    y.exp()
                }
            })
        })
        .unwrap();
    let e = backward(&weighted_loss(&y)).unwrap_err();
    let RematError::ReplayDesync {
        region, expected, ..
    } = &e
    else {
        panic!("{e:?}");
    };
    assert_eq!(region, "flaky");
    assert!(expected.contains("`y`"), "{e}");
}

#[test]
fn a_replay_that_computes_the_ops_input_otherwise_is_an_error() {
    // The op's output is not computed, but its input is compared with the
    // forward's: a scale read from state that changed (1 in the forward, 3
    // in the replay) is reported, not turned into gradients.
    let layer = Layer::new(DType::F32);
    let x = var(&[2, 3, D], 23, 1.0, DType::F32);
    let runs = Arc::new(AtomicUsize::new(0));
    let y = Region::new("scaled")
        .run(&[x.as_tensor()], move |ctx, ins| {
            let scale = if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                1.0
            } else {
                3.0
            };
            let layer = layer.clone();
            ctx.recompute("y", &[&ins[0]], move |t| {
                layer.op(Op::GeluMlp, &(&t[0] * scale)?)
            })
        })
        .unwrap();
    let e = backward(&weighted_loss(&y)).unwrap_err();
    let RematError::ReplayDiverged {
        region, statement, ..
    } = &e
    else {
        panic!("{e:?}");
    };
    assert_eq!((region.as_str(), statement.as_str()), ("scaled", "y"));
}

#[test]
fn a_region_inside_the_last_statement_counts_its_own_op_calls() {
    // The last statement runs a region of its own (its open statements
    // get the plan's policies, in the forward and again in the replay)
    // before the op that gives its value: that op is still the one left
    // uncomputed, and the gradients are plain candle's.
    let layer = Layer::new(DType::F32);
    let x = var(&[2, 3, D], 24, 1.0, DType::F32);
    let seen: Seen = Arc::default();
    let call = || {
        let (layer, seen) = (layer.clone(), seen.clone());
        Region::new("outer")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let layer = layer.clone();
                let seen = seen.clone();
                ctx.recompute("y", &[&ins[0]], move |t| {
                    let inner = layer.clone();
                    let h = Region::new("inner").run(&t[..1], move |ctx, ins| {
                        let a = ctx.open("a", &[&ins[0]], |t| {
                            nn::linear(&t[0], &inner.w_in, Some(&inner.b_in))
                        })?;
                        ctx.open("b", &[&a], |t| {
                            nn::linear_add(&t[0], &inner.w_in, None, &t[0])
                        })
                    })?;
                    let y = layer.op(Op::SwigluMlp, &h)?;
                    seen.lock().unwrap().push(has_nan(&y));
                    Ok::<_, RematError>(y)
                })
            })
            .unwrap()
    };
    let plain = Plan::off().scope(call);
    let g_plain = weighted_loss(&plain).backward().unwrap();
    // `save_all` saves `y` too (annotations included): no replay.
    for (plan, replayed) in [
        (Plan::recompute_all(), true),
        (Plan::save_all(), false),
        (Plan::save_only(["b"]), true),
        (Plan::budget(0.5), true),
    ] {
        seen.lock().unwrap().clear();
        let y = plan.scope(call);
        let g = weighted_loss(&y).backward().unwrap();
        for v in layer.vars().into_iter().chain([&x]) {
            if let Some(reference) = g_plain.get(v) {
                assert_eq!(rel_diff(g.get(v).unwrap(), reference), 0.0);
            }
        }
        let expected: &[bool] = if replayed { &[false, true] } else { &[false] };
        assert_eq!(&seen.lock().unwrap()[..], expected, "{plan:?}");
    }
}
