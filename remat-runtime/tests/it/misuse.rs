//! Misuses of the statement API that used to give wrong or missing
//! gradients without an error: each is now a named error or a gradient
//! equal to plain candle's (f64; the only difference allowed is summation
//! order, hence 1e-12).

use candle_core::{DType, Tensor, Var};
use remat_runtime::{backward, Ctx, MemoryReport, Region, RematError};

use crate::common::*;

fn x() -> Var {
    var(&[3, 4], 11, 1.0, DType::F64)
}

fn w() -> Var {
    var(&[4, 4], 12, 0.5, DType::F64)
}

/// Largest absolute difference between two gradients.
fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    max_abs(&(a - b).unwrap())
}

#[test]
fn a_tensor_op_outside_any_statement_is_refused() {
    for save in [false, true] {
        let x = x();
        let e = Region::new("blk")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let a = if save {
                    ctx.save("a", &[&ins[0]], |t| t[0].exp())?
                } else {
                    ctx.recompute("a", &[&ins[0]], |t| t[0].exp())?
                };
                // Outside any statement: nothing in the replay produces it.
                Ok((&a * 10.0)?)
            })
            .unwrap_err();
        assert!(
            matches!(&e, RematError::OutputOutsideStatement { region, index: 0 } if region == "blk"),
            "{e:?}"
        );
        assert!(e.to_string().contains("compute it in a statement"), "{e}");
        // Nothing half made: no tape is left behind.
        assert!(MemoryReport::capture().entries.is_empty());
    }
}

/// Gradients of `loss = sum(x @ w) + 3 * sum(w_out)` where the region
/// returns `w` itself as `w_out`, against plain candle.
fn returned_var_case(use_in_statement: bool) {
    let (x, w) = (x(), w());
    let wt = w.clone();
    let (y, w_out) = Region::new("blk")
        .run(&[x.as_tensor()], move |ctx, ins| {
            let y = if use_in_statement {
                let w = wt.as_tensor().clone();
                ctx.recompute("y", &[&ins[0]], move |t| t[0].matmul(&w))?
            } else {
                ctx.recompute("y", &[&ins[0]], |t| t[0].sqr())?
            };
            Ok((y, wt.as_tensor().clone()))
        })
        .unwrap();
    let loss = (y.sum_all().unwrap() + (w_out.sum_all().unwrap() * 3.0).unwrap()).unwrap();
    let g = loss.backward().unwrap();

    let plain_y = if use_in_statement {
        x.as_tensor().matmul(w.as_tensor()).unwrap()
    } else {
        x.as_tensor().sqr().unwrap()
    };
    let plain = (plain_y.sum_all().unwrap() + (w.as_tensor().sum_all().unwrap() * 3.0).unwrap())
        .unwrap()
        .backward()
        .unwrap();
    for (name, v) in [("x", &x), ("w", &w)] {
        let got = g.get(v).unwrap_or_else(|| panic!("no gradient for {name}"));
        assert!(max_diff(got, plain.get(v).unwrap()) < 1e-12, "{name}");
    }
}

#[test]
fn a_var_used_in_a_statement_and_returned_keeps_both_gradient_paths() {
    returned_var_case(true);
}

#[test]
fn a_captured_var_returned_as_it_is_gets_its_gradient() {
    returned_var_case(false);
}

#[test]
fn a_region_input_read_by_statements_is_held_once() {
    // 3 x 4 f64: 96 bytes. Read by a saved statement only (through its own
    // leaf copy), the input is held all the same, to see a change in place
    // before the backward; read by a recomputed one too, it is held once.
    for (recomputed_reader, held) in [(false, 96), (true, 96)] {
        let x = x();
        let y = Region::new("blk")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let e = ctx.save("e", &[&ins[0]], |t| t[0].exp())?;
                if recomputed_reader {
                    ctx.recompute("s", &[&e, &ins[0]], |t| (&t[0] * &t[1])?.sum_all())
                } else {
                    ctx.recompute("s", &[&e], |t| t[0].sum_all())
                }
            })
            .unwrap();
        let report = MemoryReport::capture();
        let inputs = &report.entries[0];
        assert_eq!(inputs.statement, "(inputs)");
        assert_eq!(inputs.bytes, held, "recomputed reader: {recomputed_reader}");
        assert_eq!(inputs.shapes, vec![vec![3, 4]]);
        // Gradients are unchanged: d/dx sum(exp(x)) (* x).
        let g = y.backward().unwrap();
        let ex = x.as_tensor().exp().unwrap();
        let expected = if recomputed_reader {
            ((&ex * x.as_tensor()).unwrap() + &ex).unwrap()
        } else {
            ex
        };
        assert!(max_diff(g.get(&x).unwrap(), &expected) < 1e-12);
    }
}

#[test]
fn candle_randomness_in_a_recomputed_statement_is_caught() {
    // candle's CPU generator draws a new mask in the replay.
    for draw in ["dropout", "rand_like"] {
        let x = var(&[16, 32], 13, 1.0, DType::F32);
        let y = Region::new("blk")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let d = ctx.recompute("drop", &[&ins[0]], move |t| match draw {
                    "dropout" => candle_nn::ops::dropout(&t[0], 0.5),
                    _ => Ok((&t[0] * t[0].rand_like(0.0, 1.0)?)?),
                })?;
                ctx.save("loss", &[&d], |t| t[0].sqr()?.sum_all())
            })
            .unwrap();
        let e = backward(&y).unwrap_err();
        assert!(
            matches!(&e, RematError::ReplayDiverged { region, statement, output: 0, .. }
                if region == "blk" && statement == "drop"),
            "{draw}: {e:?}"
        );
        assert!(e.to_string().contains("remat_runtime::random"), "{e}");
    }
}

#[test]
fn the_replay_check_can_be_turned_off() {
    // Off, the replay is not compared: the gradient is the replay's (wrong),
    // and no error names it. This is what the check prevents.
    let x = var(&[16, 32], 13, 1.0, DType::F32);
    let y = remat_runtime::without_fingerprints(|| {
        Region::new("blk").run(&[x.as_tensor()], |ctx, ins| {
            let d = ctx.recompute("drop", &[&ins[0]], |t| candle_nn::ops::dropout(&t[0], 0.5))?;
            ctx.save("loss", &[&d], |t| t[0].sqr()?.sum_all())
        })
    })
    .unwrap();
    assert!(backward(&y).is_ok());
}

#[test]
fn a_parameter_changed_before_the_backward_is_caught() {
    let (x, w) = (x(), w());
    let wt = w.as_tensor().clone();
    let y = Region::new("blk")
        .run(&[x.as_tensor()], move |ctx, ins| {
            let w = wt.clone();
            let h = ctx.recompute("h", &[&ins[0]], move |t| t[0].matmul(&w)?.tanh())?;
            ctx.save("loss", &[&h], |t| t[0].sum_all())
        })
        .unwrap();
    // An optimizer step before the backward.
    w.set(&(w.as_tensor() * 0.999).unwrap()).unwrap();
    let e = backward(&y).unwrap_err();
    assert!(
        matches!(&e, RematError::ParameterChanged { region, index: 0, shape, .. }
            if region == "blk" && shape == &[4, 4]),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("run the backward before changing parameters"),
        "{e}"
    );
}

#[test]
fn fingerprints_take_integer_and_empty_outputs() {
    // A mask (u8), an empty tensor and a value, recomputed: the replay check
    // passes and the gradient is right.
    let x = x();
    let y = Region::new("blk")
        .run(&[x.as_tensor()], |ctx, ins| {
            let (mask, empty, v) = ctx.recompute("parts", &[&ins[0]], |t| {
                let mask = t[0].ge(0.0)?;
                let empty = t[0].narrow(1, 0, 0)?;
                Ok::<_, remat_runtime::RematError>((mask, empty, t[0].exp()?))
            })?;
            ctx.recompute("use", &[&mask, &empty, &v], |t| {
                (t[0].to_dtype(DType::F64)? * &t[2])?.sum_all()
            })
        })
        .unwrap();
    let g = backward(&y).unwrap();
    let expected = (x.as_tensor().ge(0.0).unwrap().to_dtype(DType::F64).unwrap()
        * x.as_tensor().exp().unwrap())
    .unwrap();
    assert!(max_diff(g.get(&x).unwrap(), &expected) < 1e-12);
}

/// Runs `block` as region `name` twice on `x`. The first forward of a
/// region looks for undeclared reads and must refuse; the second does not
/// look (a block's reads are a property of its code), and its result is
/// returned for the replay's own checks.
fn twice<F>(name: &str, x: &Tensor, block: F) -> remat_runtime::Result<Tensor>
where
    F: Fn(&mut Ctx, &[Tensor]) -> remat_runtime::Result<Tensor> + Clone + Send + Sync + 'static,
{
    let first = Region::new(name).run(&[x], block.clone()).unwrap_err();
    assert!(
        matches!(&first, RematError::UndeclaredInput { region, .. } if region == name),
        "first forward: {first:?}"
    );
    assert!(
        first.to_string().contains("declare it as an input"),
        "{first}"
    );
    Region::new(name).run(&[x], block)
}

fn undeclared(e: &RematError, statement: &str) -> bool {
    matches!(e, RematError::UndeclaredInput { statement: s, .. } if s == statement)
}

#[test]
fn a_captured_output_of_another_unit_is_refused() {
    // `a` is recomputed in the first unit; `c`, in the unit after the saved
    // `b`, reads `a` through its closure instead of declaring it.
    let x = x();
    let y = twice("blk", x.as_tensor(), |ctx, ins| {
        let a = ctx.recompute("a", &[&ins[0]], |t| (&t[0] * 2.0)?.sin())?;
        let b = ctx.save("b", &[&ins[0]], |t| (&t[0] * 2.0)?.exp())?;
        ctx.recompute("c", &[&b], |t| (&t[0] + &a)?.sum_all())
    });
    let e = backward(&y.unwrap()).unwrap_err();
    assert!(undeclared(&e, "c"), "replay: {e:?}");
}

#[test]
fn a_captured_output_of_the_same_unit_is_refused_first_and_right_after() {
    // Within one unit the capture is harmless to the gradient (one candle
    // backward sees it), but it is still an undeclared read: under another
    // plan the two statements could be in different units.
    let x = x();
    let y = twice("blk", x.as_tensor(), |ctx, ins| {
        let a = ctx.recompute("a", &[&ins[0]], |t| (&t[0] * 2.0)?.sin())?;
        let b = ctx.recompute("b", &[&ins[0]], |t| (&t[0] * 2.0)?.exp())?;
        ctx.recompute("c", &[&b], |t| (&t[0] + &a)?.sum_all())
    });
    let g = y.unwrap().backward().unwrap();
    let x2 = (x.as_tensor() * 2.0).unwrap();
    let expected = ((x2.exp().unwrap() + x2.cos().unwrap()).unwrap() * 2.0).unwrap();
    assert!(max_diff(g.get(&x).unwrap(), &expected) < 1e-12);
}

#[test]
fn a_captured_region_input_or_saved_output_is_refused() {
    // `c` reads, through its closure, the region input or the saved `b`
    // (both declared by `d`, in another unit: kept for the replay), or the
    // saved `e` (declared by no recomputed statement: a placeholder in the
    // replay).
    for captured in ["input", "ferried", "placeholder"] {
        let x = x();
        let name = format!("blk-{captured}");
        let y = twice(&name, x.as_tensor(), move |ctx, ins| {
            let x = ins[0].clone();
            let b = ctx.save("b", &[&x], |t| (&t[0] * 2.0)?.exp())?;
            let e = ctx.save("e", &[&x], |t| (&t[0] * 3.0)?.sin())?;
            let d = ctx.recompute("d", &[&b, &x], |t| t[0].cos()? * &t[1])?;
            let f = ctx.save("f", &[&d], |t| &t[0] * 1.5)?;
            let read = match captured {
                "input" => x.clone(),
                "ferried" => b.clone(),
                _ => e.clone(),
            };
            let c = ctx.recompute("c", &[&f], move |t| &t[0] * &read)?;
            ctx.save("out", &[&c, &e], |t| (&t[0] + &t[1])?.sum_all())
        });
        let e = backward(&y.unwrap()).unwrap_err();
        let named = match captured {
            // A placeholder computes with NaN: the fingerprint shows it.
            "placeholder" => {
                matches!(&e, RematError::ReplayDiverged { statement, .. } if statement == "c")
            }
            _ => undeclared(&e, "c"),
        };
        assert!(named, "{captured}, replay: {e:?}");
    }
}

#[test]
fn a_capture_that_makes_a_constant_need_gradients_is_refused() {
    // `x` needs no gradient, so `m` would be handed on as a constant; only
    // the captured `h` (from `w`) makes it depend on a parameter, and the
    // saved `out` would keep no way back to `m`.
    let w = w();
    let wt = w.as_tensor().clone();
    let x = x().as_tensor().detach();
    let y = twice("blk", &x, move |ctx, ins| {
        let w = wt.clone();
        let h = ctx.recompute("h", &[&ins[0]], move |t| t[0].matmul(&w))?;
        let m = ctx.recompute("m", &[&ins[0]], |t| t[0].tanh()? + &h)?;
        let w = wt.clone();
        ctx.save("out", &[&m], move |t| t[0].matmul(&w)?.sum_all())
    });
    // The replay sees `m` gain a gradient it did not have in the forward.
    let e = backward(&y.unwrap()).unwrap_err();
    assert!(undeclared(&e, "m"), "replay: {e:?}");
}

#[test]
fn a_saved_statement_capturing_a_value_is_refused_by_the_first_forward() {
    // The one capture only the first forward sees: a saved statement's graph
    // holds no trace of a captured value in later forwards (see "What remat
    // checks for you" in docs/semantics.md).
    let x = x();
    let y = twice("blk", x.as_tensor(), |ctx, ins| {
        let a = ctx.recompute("a", &[&ins[0]], |t| t[0].sin())?;
        ctx.save("s", &[&ins[0]], |t| (&t[0] * &a)?.sum_all())
    });
    assert!(y.is_ok());
}
