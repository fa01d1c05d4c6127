//! Region shapes beyond a single block: tied weights, nesting, unused and
//! pass-through outputs, non-tensor values, inert regions, retained tapes and
//! candle-nn optimizers. Each is checked against the same computation run as
//! plain candle code; see `grad_equality.rs` for the tolerance rationale.

use crate::common::*;
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;
use remat_runtime::{retain_tape, MemoryReport, Policy, Region, RematError};

fn grads_of(loss: &Tensor, wrt: &[&Var]) -> Vec<Tensor> {
    let g = loss.backward().unwrap();
    wrt.iter()
        .map(|v| g.get(v).expect("every variable gets a gradient").clone())
        .collect()
}

fn assert_close(label: &str, a: &[Tensor], b: &[Tensor], tol: f64) {
    for (i, (a, b)) in a.iter().zip(b).enumerate() {
        let d = rel_diff(a, b);
        assert!(
            d <= tol,
            "{label}: gradient {i} differs by {d:e} (tolerance {tol:e})"
        );
    }
}

#[test]
fn tied_weights_shared_between_regions_and_outside() {
    // `wte` is an input of region `embed`, a captured parameter of region
    // `head`, and used outside any region: its gradient sums all three uses.
    let wte = var(&[10, 8], 1, 0.5, DType::F32);
    let w = var(&[8, 8], 2, 0.5, DType::F32);
    let loss = |enabled: bool| -> Tensor {
        let wt = w.as_tensor().clone();
        let e = Region::new("embed")
            .enabled(enabled)
            .run(&[wte.as_tensor()], move |ctx, ins| {
                ctx.recompute("proj", &[&ins[0]], |t| t[0].matmul(&wt)?.tanh())
            })
            .unwrap();
        let tied = wte.as_tensor().clone();
        let logits = Region::new("head")
            .enabled(enabled)
            .run(&[&e], move |ctx, ins| {
                ctx.save("logits", &[&ins[0]], |t| t[0].matmul(&tied.t()?))
            })
            .unwrap();
        let outside = wte.as_tensor().sqr().unwrap().sum_all().unwrap();
        (weighted_sum(&logits, 77) + outside).unwrap()
    };
    let plain = grads_of(&loss(false), &[&wte, &w]);
    let on = grads_of(&loss(true), &[&wte, &w]);
    assert_close("tied", &on, &plain, 1e-6);
}

#[test]
fn nested_regions_under_both_outer_policies() {
    let inner = Mlp::new(8, 16, 3, DType::F32);
    let w = var(&[8, 8], 4, 0.5, DType::F32);
    let x = var(&[5, 8], 5, 1.0, DType::F32);
    for outer_policy in [Policy::Recompute, Policy::Save] {
        let loss = |enabled: bool| -> Tensor {
            let (inner, wt) = (inner.clone(), w.as_tensor().clone());
            let y = Region::new("outer")
                .enabled(enabled)
                .run(&[x.as_tensor()], move |ctx, ins| {
                    let h = ctx.recompute("pre", &[&ins[0]], |t| t[0].matmul(&wt))?;
                    let inner = inner.clone();
                    let m = ctx.statement("inner", outer_policy, &[&h], move |t| {
                        inner.region("inner", &t[0], saving(&["fc1"]), enabled)
                    })?;
                    ctx.recompute("post", &[&m, &ins[0]], |t| t[0].sin()? + &t[1])
                })
                .unwrap();
            weighted_sum(&y, 77)
        };
        let mut wrt = vec![&x, &w];
        let vars = inner.vars();
        wrt.extend(vars.iter());
        let plain = grads_of(&loss(false), &wrt);
        let on = grads_of(&loss(true), &wrt);
        assert_close(&format!("nested, outer {outer_policy}"), &on, &plain, 1e-6);
    }
}

#[test]
fn unused_and_pass_through_outputs() {
    let x = var(&[3, 4], 6, 1.0, DType::F32);
    let y = var(&[3, 4], 7, 1.0, DType::F32);
    let run = |enabled: bool| -> Vec<Tensor> {
        let (a, unused, pass, saved): (Tensor, Tensor, Tensor, Tensor) = Region::new("r")
            .enabled(enabled)
            .run(&[x.as_tensor(), y.as_tensor()], |ctx, ins| {
                let a = ctx.recompute("a", &[&ins[0], &ins[1]], |t| &t[0] * &t[1])?;
                let unused = ctx.recompute("unused", &[&a], |t| t[0].exp())?;
                let saved = ctx.save("s", &[&a], |t| t[0].cos())?;
                Ok((a, unused, ins[1].clone(), saved))
            })
            .unwrap();
        drop(unused);
        let loss = ((weighted_sum(&a, 77) + weighted_sum(&pass, 77)).unwrap()
            + weighted_sum(&saved, 77))
        .unwrap();
        grads_of(&loss, &[&x, &y])
    };
    assert_close("unused/pass-through", &run(true), &run(false), 1e-6);
}

#[test]
fn non_tensor_values_and_arguments() {
    #[derive(Clone)]
    struct Config {
        scale: f64,
    }
    let cfg = Config { scale: 0.5 };
    let x = var(&[2, 6], 8, 1.0, DType::F32);
    let run = |enabled: bool, pol: Policy| -> Vec<Tensor> {
        let cfg = cfg.clone();
        let y: Tensor = Region::new("r")
            .enabled(enabled)
            .run(&[x.as_tensor()], move |ctx, ins| {
                // a statement returning a tensor and a plain value, kept or recomputed
                let (h, n) = ctx.statement("h", pol, &[&ins[0]], |t| {
                    Ok::<_, remat_runtime::RematError>(((&t[0] * cfg.scale)?.exp()?, t[0].dim(1)?))
                })?;
                let h = ctx.recompute("norm", &[&h], |t| &t[0] / n as f64)?;
                Ok(h)
            })
            .unwrap();
        grads_of(&weighted_sum(&y, 77), &[&x])
    };
    for pol in [Policy::Save, Policy::Recompute] {
        assert_close("non-tensor", &run(true, pol), &run(false, pol), 0.0);
    }
}

#[test]
fn inert_region_keeps_no_tape() {
    // No input needs gradients and no parameter is used: a plain forward.
    let x = tensor(&[4, 4], 9, 1.0, DType::F32);
    let w = tensor(&[4, 4], 10, 1.0, DType::F32);
    let y = Region::new("inference")
        .run(&[&x], move |ctx, ins| {
            ctx.save("mm", &[&ins[0]], |t| t[0].matmul(&w))
        })
        .unwrap();
    assert!(!y.track_op(), "an inert region returns untracked tensors");
    assert!(MemoryReport::capture().entries.is_empty());
}

#[test]
fn retained_tape_allows_a_second_backward() {
    let m = Mlp::new(6, 12, 11, DType::F32);
    let x = var(&[3, 6], 12, 1.0, DType::F32);
    let y = m
        .region("mlp", x.as_tensor(), saving(&["fc1"]), true)
        .unwrap();
    let loss = weighted_sum(&y, 77);
    let mut wrt = vec![&x];
    let vars = m.vars();
    wrt.extend(vars.iter());
    let first = retain_tape(|| grads_of(&loss, &wrt));
    let second = grads_of(&loss, &wrt);
    assert_close("retained", &second, &first, 0.0);
    let third = remat_runtime::backward(&loss).unwrap_err();
    assert!(matches!(third, RematError::TapeReleased { ref region, .. } if region == "mlp"));
}

#[test]
fn optimizer_backward_step_matches_plain_training() {
    // Three SGD steps on a 2-block GPT stack, with and without remat, through
    // candle-nn's `Optimizer::backward_step`. SGD keeps the comparison linear
    // in the gradients: Adam divides by sqrt(v), which turns the ~1e-9 noise
    // on gradients that are zero in exact arithmetic (the key bias of
    // attention) into full-size updates of either sign in both runs alike.
    let train = |enabled: bool| -> Vec<Tensor> {
        let blocks: Vec<Gpt> = (0..2)
            .map(|i| Gpt::new(16, 2, 200 + 20 * i, DType::F32))
            .collect();
        let x = tensor(&[2, 4, 16], 13, 1.0, DType::F32);
        let mask = causal_mask(4, DType::F32);
        let vars: Vec<Var> = blocks.iter().flat_map(|b| b.vars()).collect();
        let mut opt = candle_nn::SGD::new(vars.clone(), 0.1).unwrap();
        for _ in 0..3 {
            let mut h = x.clone();
            for (i, b) in blocks.iter().enumerate() {
                let pol = saving(&["attn.qkv", "attn.core"]);
                h = b.region(&format!("b{i}"), &h, &mask, pol, enabled).unwrap();
            }
            opt.backward_step(&weighted_sum(&h, 77)).unwrap();
        }
        vars.iter().map(|v| v.as_tensor().copy().unwrap()).collect()
    };
    // Gradients agree to ~1e-7 relative and the step is 0.1 x gradient.
    assert_close("sgd", &train(true), &train(false), 1e-6);
}

#[test]
fn parameter_used_by_several_units_sums_its_gradients() {
    // `w` is used by a saved, a recomputed and another saved statement: three
    // units of the sweep, whose contributions the runtime adds up.
    let w = var(&[5, 5], 14, 0.5, DType::F32);
    let x = var(&[3, 5], 15, 1.0, DType::F32);
    let run = |enabled: bool| -> Vec<Tensor> {
        let wt = w.as_tensor().clone();
        let y = Region::new("r")
            .enabled(enabled)
            .run(&[x.as_tensor()], move |ctx, ins| {
                let a = ctx.save("a", &[&ins[0]], |t| t[0].matmul(&wt)?.tanh())?;
                let b = ctx.recompute("b", &[&a], |t| t[0].matmul(&wt)?.sin())?;
                ctx.save("c", &[&b], |t| t[0].matmul(&wt))
            })
            .unwrap();
        grads_of(&weighted_sum(&y, 77), &[&x, &w])
    };
    assert_close("shared parameter", &run(true), &run(false), 1e-6);
}

#[test]
fn regions_on_several_threads_at_once() {
    // Each thread trains its own copy of a 2-block stack; every thread's
    // gradients must equal its own plain run.
    let handles: Vec<_> = (0..4u64)
        .map(|k| {
            std::thread::spawn(move || {
                let blocks: Vec<Gpt> = (0..2)
                    .map(|i| Gpt::new(16, 2, 300 + 40 * k + 20 * i, DType::F32))
                    .collect();
                let x = var(&[2, 4, 16], 400 + k, 1.0, DType::F32);
                let mask = causal_mask(4, DType::F32);
                let mut wrt = vec![x.clone()];
                wrt.extend(blocks.iter().flat_map(|b| b.vars()));
                let run = |enabled: bool| {
                    let mut h = x.as_tensor().clone();
                    for (i, b) in blocks.iter().enumerate() {
                        let pol = saving(&["attn.qkv", "mlp.proj"]);
                        h = b.region(&format!("b{i}"), &h, &mask, pol, enabled).unwrap();
                    }
                    let refs: Vec<&Var> = wrt.iter().collect();
                    grads_of(&weighted_sum(&h, 77), &refs)
                };
                let (on, plain) = (run(true), run(false));
                assert_close(&format!("thread {k}"), &on, &plain, 1e-6);
            })
        })
        .collect();
    for h in handles {
        h.join().expect("thread panicked");
    }
}

#[test]
fn saved_statements_chained_and_read_across_the_chain() {
    // `b` and `c` continue the graph of the saved statements before them; `c`
    // also reads `a`, two records back, and the recomputed `d` reads `a` too.
    let x = var(&[3, 3], 16, 1.0, DType::F32);
    let w = var(&[3, 3], 17, 0.5, DType::F32);
    let run = |enabled: bool| -> Vec<Tensor> {
        let wt = w.as_tensor().clone();
        let y = Region::new("chain")
            .enabled(enabled)
            .run(&[x.as_tensor()], move |ctx, ins| {
                let a = ctx.save("a", &[&ins[0]], |t| t[0].matmul(&wt)?.tanh())?;
                let b = ctx.save("b", &[&a], |t| t[0].exp())?;
                let c = ctx.save("c", &[&a, &b], |t| &t[0] * &t[1])?;
                let d = ctx.recompute("d", &[&a, &c], |t| &t[0] + t[1].sin()?)?;
                ctx.save("e", &[&d, &ins[0]], |t| &t[0] * &t[1])
            })
            .unwrap();
        grads_of(&weighted_sum(&y, 77), &[&x, &w])
    };
    assert_close("chain", &run(true), &run(false), 1e-6);
}
