//! Dropout in checkpointed blocks: the replay draws the masks the forward
//! drew, whatever the plan, so gradients equal those of the same block run
//! as plain candle code with the same seed (and therefore the same masks).
//! Tolerance 1e-6 relative, as in `grad_equality.rs`.

use crate::common::*;
use candle_core::{DType, Result, Tensor, Var};
use remat_runtime::{random, remat, Plan, Region};

#[derive(Clone)]
pub struct P {
    w1: Var,
    w2: Var,
}

remat! {
    fn dropout_block(x: &Tensor, p: &P) -> Result<Tensor> {
        let h = x.matmul(&p.w1)?;
        let d = remat_runtime::nn::dropout(&h, 0.3)?;
        let g = d.tanh()?;
        let o = g.matmul(&p.w2)?;
        let e = remat_runtime::nn::dropout(&o, 0.5)?;
        Ok((x + e)?)
    }
}

fn setup() -> (Var, P) {
    (
        var(&[6, 8], 1, 1.0, DType::F32),
        P {
            w1: var(&[8, 32], 2, 0.3, DType::F32),
            w2: var(&[32, 8], 3, 0.3, DType::F32),
        },
    )
}

fn grads(plan: &Plan, x: &Var, p: &P) -> (Tensor, Vec<Tensor>) {
    random::seed(11);
    // Two calls: the second gets its own masks.
    let y = plan
        .scope(|| -> Result<Tensor> {
            let y = dropout_block(x.as_tensor(), p)?;
            dropout_block(&y, p)
        })
        .unwrap();
    let g = y.sum_all().unwrap().backward().unwrap();
    let g = [x, &p.w1, &p.w2]
        .iter()
        .map(|v| g.get(v).unwrap().clone())
        .collect();
    (y, g)
}

#[test]
fn dropout_replays_the_same_masks_under_every_plan() {
    let (x, p) = setup();
    let (y_ref, g_ref) = grads(&Plan::off(), &x, &p);
    let plans = [
        Plan::declared(),
        Plan::recompute_all(),
        Plan::save_all(),
        Plan::save_only(["h", "d"]),
        Plan::save_only(["g", "e"]),
        Plan::save_only(["d", "o"]),
        Plan::budget(0.5),
    ];
    for plan in plans {
        // Budget plans measure on the first call, then follow their plan.
        for _ in 0..2 {
            let (y, g) = grads(&plan, &x, &p);
            assert_eq!(rel_diff(&y, &y_ref), 0.0, "{plan}: forward");
            for (a, b) in g.iter().zip(&g_ref) {
                let d = rel_diff(a, b);
                assert!(d <= 1e-6, "{plan}: {d}");
            }
        }
    }
}

#[test]
fn masks_differ_between_statements_calls_and_seeds() {
    let x = Tensor::ones((64, 64), DType::F32, &candle_core::Device::Cpu).unwrap();
    let masks = |seed| {
        random::seed(seed);
        let run = || {
            Region::new("r")
                .run(&[&x], |ctx, ins| {
                    let a =
                        ctx.open("a", &[&ins[0]], |t| remat_runtime::nn::dropout(&t[0], 0.5))?;
                    let b =
                        ctx.open("b", &[&ins[0]], |t| remat_runtime::nn::dropout(&t[0], 0.5))?;
                    Ok((a, b))
                })
                .unwrap()
        };
        let (a1, b1) = run();
        let (a2, _) = run();
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (v(&a1), v(&b1), v(&a2))
    };
    let (a1, b1, a2) = masks(5);
    assert_ne!(a1, b1, "two statements of one call");
    assert_ne!(a1, a2, "two calls");
    let (a1_again, b1_again, _) = masks(5);
    assert_eq!((&a1, &b1), (&a1_again, &b1_again), "same seed, same masks");
    let (a1_other, _, _) = masks(6);
    assert_ne!(a1, a1_other, "another seed");
    // About half dropped, the rest scaled by 2.
    let kept = a1.iter().filter(|&&v| v == 2.0).count();
    assert_eq!(kept + a1.iter().filter(|&&v| v == 0.0).count(), a1.len());
    assert!((1900..2200).contains(&kept), "{kept}");
}

#[test]
fn nested_region_draws_the_same_in_the_outer_replay() {
    let (x, p) = setup();
    let run = |plan: Plan| {
        random::seed(3);
        let pc = p.clone();
        let y = Region::new("outer")
            .plan(plan)
            .run(&[x.as_tensor()], move |ctx, ins| {
                let pc = pc.clone();
                // The inner call runs in the forward and again in the replay
                // of `inner`: it must get the same seed both times.
                ctx.open("inner", &[&ins[0]], move |t| dropout_block(&t[0], &pc))
            })
            .unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        (y, g.get(&p.w1).unwrap().clone())
    };
    let (y_ref, g_ref) = run(Plan::off());
    let (y, g) = run(Plan::recompute_all());
    assert_eq!(rel_diff(&y, &y_ref), 0.0);
    assert!(rel_diff(&g, &g_ref) <= 1e-6);
}
