//! Runtime errors: each asserts the error kind, that the message names the
//! region and the record, and that the region is left in a clean state.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::common::*;
use candle_core::{DType, Tensor, Var};
use remat_runtime::{backward, Policy, Region, RematError};

fn x() -> Var {
    var(&[2, 3], 1, 1.0, DType::F32)
}

#[test]
fn placeholder_read_names_the_reader_and_the_producer() {
    // The forward's recomputed statement reads the product of a constant; the
    // replay's reads the saved output `h`, which the forward never handed to a
    // recomputed statement: only a placeholder of it exists during replay.
    let x = x();
    let y = Region::new("blk")
        .run(&[x.as_tensor()], |ctx, ins| {
            let h = ctx.save("h", &[&ins[0]], |t| t[0].exp())?;
            let other = Tensor::ones(h.dims(), DType::F32, h.device())?;
            let read = if ctx.is_replay() { &h } else { &other };
            let s = ctx.recompute("s", &[read], |t| t[0].sin())?;
            ctx.save("out", &[&h, &s], |t| (&t[0] * &t[1])?.sum_all())
        })
        .unwrap();
    let e = backward(&y).unwrap_err();
    assert!(
        matches!(&e, RematError::PlaceholderRead { region, statement, producer }
        if region == "blk" && statement == "s" && producer == "h"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("`s`") && msg.contains("`h`") && msg.contains("blk"),
        "{msg}"
    );
    // The tape was released whole: a second attempt says why, no panic.
    let again = backward(&y).unwrap_err();
    assert!(matches!(&again, RematError::TapeReleased { reason, .. } if reason.contains("failed")));
}

static WIDTH: AtomicUsize = AtomicUsize::new(3);

#[test]
fn replay_shape_mismatch_from_a_changing_global() {
    let x = x();
    let y = Region::new("blk")
        .run(&[x.as_tensor()], |ctx, ins| {
            let w = ctx.recompute("widen", &[&ins[0]], |t| {
                // reads mutable global state: not replayable
                let n = WIDTH.load(Ordering::SeqCst);
                t[0].sum_keepdim(1)?.broadcast_as((2, n))?.contiguous()
            })?;
            ctx.recompute("sum", &[&w], |t| t[0].sum_all())
        })
        .unwrap();
    WIDTH.store(5, Ordering::SeqCst);
    let e = backward(&y).unwrap_err();
    WIDTH.store(3, Ordering::SeqCst);
    assert!(
        matches!(&e, RematError::ReplayMismatch { statement, mismatch, .. } if statement == "widen" && mismatch.what == "shape"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("`widen`") && msg.contains("[2, 3]") && msg.contains("[2, 5]"),
        "{msg}"
    );
}

#[test]
fn second_backward_without_retain() {
    let x = x();
    let y = Region::new("blk")
        .run(&[x.as_tensor()], |ctx, ins| {
            ctx.save("sq", &[&ins[0]], |t| t[0].sqr()?.sum_all())
        })
        .unwrap();
    backward(&y).unwrap();
    let e = backward(&y).unwrap_err();
    assert!(
        matches!(&e, RematError::TapeReleased { region, .. } if region == "blk"),
        "{e:?}"
    );
    assert!(e.to_string().contains("retain_tape"));
    // Through candle's own backward the error is a message, not a panic.
    let plain = y.backward().unwrap_err().to_string();
    assert!(
        plain.contains("blk") && plain.contains("retain_tape"),
        "{plain}"
    );
}

static EARLY: AtomicBool = AtomicBool::new(false);

#[test]
fn unconsumed_record() {
    let x = x();
    let y = Region::new("blk")
        .run(&[x.as_tensor()], |ctx, ins| {
            let a = ctx.recompute("a", &[&ins[0]], |t| t[0].exp())?;
            if EARLY.load(Ordering::SeqCst) {
                return Ok(a.sum_all()?);
            }
            let b = ctx.save("b", &[&a], |t| t[0].sin())?;
            ctx.recompute("c", &[&b, &a], |t| (&t[0] + &t[1])?.sum_all())
        })
        .unwrap();
    EARLY.store(true, Ordering::SeqCst);
    let e = backward(&y).unwrap_err();
    EARLY.store(false, Ordering::SeqCst);
    assert!(
        matches!(&e, RematError::NotReplayed { region, statements } if region == "blk" && statements == &["b", "c"]),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("statements `b`, `c` were not replayed"),
        "{e}"
    );
}

#[test]
fn replay_running_another_statement_is_a_desync() {
    static FLIP: AtomicBool = AtomicBool::new(false);
    let x = x();
    let y = Region::new("blk")
        .run(&[x.as_tensor()], |ctx, ins| {
            let name = if FLIP.load(Ordering::SeqCst) {
                "other"
            } else {
                "first"
            };
            ctx.recompute(name, &[&ins[0]], |t| t[0].sum_all())
        })
        .unwrap();
    FLIP.store(true, Ordering::SeqCst);
    let e = backward(&y).unwrap_err();
    assert!(matches!(&e, RematError::ReplayDesync { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("`first`") && msg.contains("`other`"), "{msg}");
}

#[test]
fn duplicate_statement_name() {
    let x = x();
    let e = Region::new("blk")
        .run(&[x.as_tensor()], |ctx, ins| {
            let a = ctx.recompute("a", &[&ins[0]], |t| t[0].exp())?;
            ctx.save("a", &[&a], |t| t[0].sum_all())
        })
        .unwrap_err();
    assert!(
        matches!(&e, RematError::DuplicateName { region, statement } if region == "blk" && statement == "a")
    );
}

#[test]
fn tracked_tensor_captured_from_outside_is_refused() {
    let x = x();
    let outside = (x.as_tensor() * 2.0).unwrap(); // tracked, not a Var
    let e = Region::new("blk")
        .run(&[], move |ctx, _| {
            ctx.recompute("use", &[&outside], |t| t[0].exp())
        })
        .unwrap_err();
    assert!(
        matches!(&e, RematError::ForeignTrackedInput { statement, index: 0, .. } if statement == "use"),
        "{e:?}"
    );
}

#[test]
fn failing_statement_names_itself_and_the_next_step_works() {
    let m = Mlp::new(3, 4, 2, DType::F32);
    let x = x();
    let me = m.clone();
    let e = Region::new("blk")
        .run(&[x.as_tensor()], move |ctx, ins| {
            let h = me.body(ctx, &ins[0], &all(Policy::Save))?;
            // wrong shapes: (2, 3) x (2, 3)
            ctx.recompute("bad", &[&h, &ins[0]], |t| t[0].matmul(&t[1]))
        })
        .unwrap_err();
    assert!(
        matches!(&e, RematError::Statement { region, statement, .. } if region == "blk" && statement == "bad")
    );
    assert!(e.to_string().contains("statement `bad`"));
    // Nothing half-recorded: the next call works.
    let y = m
        .region("blk", x.as_tensor(), all(Policy::Save), true)
        .unwrap();
    assert!(backward(&y.sum_all().unwrap()).unwrap().get(&x).is_some());
}

#[test]
fn replay_returning_another_number_of_outputs() {
    static MORE: AtomicBool = AtomicBool::new(false);
    let x = x();
    let y: Vec<Tensor> = Region::new("blk")
        .run(&[x.as_tensor()], |ctx, ins| {
            let a = ctx.recompute("a", &[&ins[0]], |t| t[0].exp())?;
            let s = ctx.recompute("s", &[&a], |t| t[0].sum_all())?;
            let mut outs = vec![s];
            if MORE.load(Ordering::SeqCst) {
                outs.push(a);
            }
            Ok(outs)
        })
        .unwrap();
    MORE.store(true, Ordering::SeqCst);
    let e = backward(&y[0]).unwrap_err();
    MORE.store(false, Ordering::SeqCst);
    assert!(
        matches!(&e, RematError::OutputCount { region, forward: 1, replay: 2 } if region == "blk"),
        "{e:?}"
    );
}

#[test]
fn dropout_probability_out_of_range() {
    let x = x();
    for p in [-0.1, 1.0, 2.0] {
        let e = remat_runtime::nn::dropout(x.as_tensor(), p).unwrap_err();
        assert!(e.to_string().contains("outside [0, 1)"), "{e}");
    }
}

#[test]
fn checkpoint_sequential_with_a_bad_segment_count() {
    let x = x();
    let blocks = || (0..3).map(|_| |t: &Tensor| t.exp());
    for k in [0, 4] {
        let e =
            remat_runtime::checkpoint_sequential("stack", k, x.as_tensor(), blocks()).unwrap_err();
        assert!(
            matches!(&e, RematError::SegmentCount { name, segments, blocks: 3 }
                if name == "stack" && *segments == k),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("`stack`") && e.to_string().contains("between 1 and"),
            "{e}"
        );
    }
}

#[test]
fn missing_gradients_are_named() {
    let x = x();
    let unused = Var::ones(2, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let grads = x.as_tensor().sum_all().unwrap().backward().unwrap();
    let e = remat_runtime::check_gradients(&grads, [("x", &x), ("unused", &unused)]).unwrap_err();
    assert!(matches!(&e, RematError::MissingGradients { names } if names == &["unused"]));
    assert!(e.to_string().contains("layer_norm_slow"), "{e}");
}

/// An op whose backward fails when `FAIL_BACKWARD` is set: the identity
/// otherwise.
struct FailingBackward;

static FAIL_BACKWARD: AtomicBool = AtomicBool::new(false);

impl candle_core::CustomOp1 for FailingBackward {
    fn name(&self) -> &'static str {
        "failing-backward"
    }
    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (a, b) = l.contiguous_offsets().expect("contiguous");
        match s {
            candle_core::CpuStorage::F32(v) => Ok((
                candle_core::CpuStorage::F32(v[a..b].to_vec()),
                l.shape().clone(),
            )),
            _ => candle_core::bail!("f32 only"),
        }
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if FAIL_BACKWARD.load(Ordering::SeqCst) {
            candle_core::bail!("the op's backward failed")
        }
        Ok(Some(grad.clone()))
    }
}

#[derive(Clone)]
struct Two {
    w1: Var,
    w2: Var,
}

remat_runtime::remat! {
    fn failing_block(x: &Tensor, p: &Two) -> candle_core::Result<Tensor> {
        let h = x.matmul(&p.w1)?.tanh()?;
        let f = h.apply_op1(FailingBackward)?;
        #[save] let o = f.matmul(&p.w2)?;
        Ok((x + o)?)
    }
}

remat_runtime::remat! {
    fn outer_of_failing(x: &Tensor, p: &Two) -> candle_core::Result<Tensor> {
        let a = x.exp()?;
        let b = failing_block(&a, p)?;
        Ok((b * 0.5)?)
    }
}

/// An error raised by an op's backward during a region's backward names
/// the region and the statements of the unit it ran in (and, nested, the
/// outer region and statement too), under every plan; the next step after
/// it gives plain candle's gradients.
#[test]
fn an_op_backward_that_fails_names_the_region_and_its_statements() {
    let x = var(&[4, 3], 1, 1.0, DType::F32);
    let p = Two {
        w1: var(&[3, 5], 2, 0.5, DType::F32),
        w2: var(&[5, 3], 3, 0.5, DType::F32),
    };
    for plan in [
        remat_runtime::Plan::declared(),
        remat_runtime::Plan::recompute_all(),
        remat_runtime::Plan::save_all(),
    ] {
        for nested in [false, true] {
            let run = || {
                plan.scope(|| {
                    if nested {
                        outer_of_failing(x.as_tensor(), &p)
                    } else {
                        failing_block(x.as_tensor(), &p)
                    }
                })
                .unwrap()
            };
            let y = run();
            FAIL_BACKWARD.store(true, Ordering::SeqCst);
            let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
            FAIL_BACKWARD.store(false, Ordering::SeqCst);
            let what = format!("{plan}, nested {nested}: {e}");
            assert!(e.contains("region `failing_block`, statement `"), "{what}");
            assert!(e.contains("the op's backward failed"), "{what}");
            // The unit holding `f` is named: `f` alone when it is saved,
            // with the recomputed statements around it otherwise.
            let unit = e
                .split("region `failing_block`, statement `")
                .nth(1)
                .unwrap();
            let unit = &unit[..unit.find('`').unwrap()];
            assert!(unit.split(", ").any(|s| s == "f"), "{what}");
            if nested {
                assert!(
                    e.contains("region `outer_of_failing`, statement `"),
                    "{what}"
                );
            }
            // The next step runs clean and gives plain candle's gradients.
            let g = run().sum_all().unwrap().backward().unwrap();
            let plain = |x: &Tensor| {
                let h = x.matmul(p.w1.as_tensor())?.tanh()?;
                x + h.matmul(p.w2.as_tensor())?
            };
            let y_ref = if nested {
                (plain(&x.as_tensor().exp().unwrap()).unwrap() * 0.5).unwrap()
            } else {
                plain(x.as_tensor()).unwrap()
            };
            let g_ref = y_ref.sum_all().unwrap().backward().unwrap();
            for v in [&x, &p.w1, &p.w2] {
                let d = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
                assert!(d <= 1e-6, "{what}: {d}");
            }
        }
    }
}

/// A block's own error type, as applications write them.
#[derive(Debug)]
enum LayerError {
    Candle(candle_core::Error),
    EmptyBatch { layer: usize },
}

impl From<candle_core::Error> for LayerError {
    fn from(e: candle_core::Error) -> Self {
        LayerError::Candle(e)
    }
}

remat_runtime::remat! {
    fn checked_layer(x: &Tensor, w: &Tensor, layer: usize) -> Result<Tensor, LayerError> {
        let h = x.matmul(w)?;
        #[save]
        let y = if h.dim(0)? == 0 {
            return Err(LayerError::EmptyBatch { layer });
        } else {
            h.tanh()?
        };
        Ok((y * 2.0)?)
    }
}

/// A block returning `Result<_, LayerError>` (an enum of the user's own
/// with `From<candle_core::Error>`) compiles and trains with plain
/// gradients under every plan; an error of its own type a statement
/// returns (`return Err(..)`, or a candle error its `?` turned into one)
/// comes back as it was.
#[test]
fn a_block_with_its_own_error_type_gives_its_errors_back() {
    use remat_runtime::Plan;
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let x = var(&[3, 4], 71, 1.0, dtype);
        let w = var(&[4, 4], 72, 0.5, dtype);
        let reference = (x.matmul(&w).unwrap().tanh().unwrap() * 2.0)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for plan in [Plan::declared(), Plan::recompute_all(), Plan::save_all()] {
            let y = plan
                .scope(|| checked_layer(x.as_tensor(), w.as_tensor(), 0))
                .unwrap();
            let g = backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap();
            for v in [&x, &w] {
                let d = rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
                assert!(d <= tol, "{dtype:?} {plan}: {d}");
            }
            let empty = Tensor::zeros((0, 4), dtype, &candle_core::Device::Cpu).unwrap();
            let e = plan
                .scope(|| checked_layer(&empty, w.as_tensor(), 3))
                .unwrap_err();
            assert!(
                matches!(e, LayerError::EmptyBatch { layer: 3 }),
                "{plan}: {e:?}"
            );
            let wrong = var(&[5, 4], 73, 0.5, dtype);
            let e = plan
                .scope(|| checked_layer(x.as_tensor(), wrong.as_tensor(), 0))
                .unwrap_err();
            let LayerError::Candle(c) = &e else {
                panic!("{plan}: {e:?}")
            };
            // The statement's own `?` made it a `LayerError`: it comes back
            // as the statement made it.
            let text = c.to_string();
            assert!(text.contains("shape mismatch in matmul"), "{plan}: {text}");
        }
    }
}
