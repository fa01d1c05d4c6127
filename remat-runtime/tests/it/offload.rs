//! `Policy::Offload`: residuals kept in host memory between the forward and
//! the backward.
//!
//! On a CPU device an offloaded statement is kept as a saved one; under
//! `offload::swap_on_cpu` its residuals are moved out of candle's graph into
//! the tape's host store and back, as on a CUDA device. Either way the
//! statement computes exactly what a saved statement computes, in the same
//! order, so gradients are compared with the `Save` run bit for bit
//! (tolerance 0). The saved run itself is compared with plain candle in
//! tests/it/grad_equality.rs; here the comparison with plain uses that file's
//! 1e-6 relative tolerance (sums across units in another order).

use std::sync::Arc;

use crate::common::*;
use candle_core::{DType, Device, Tensor, Var};
use remat_runtime::inspect::Trace;
use remat_runtime::{offload, retain_tape, MemoryReport, Plan, Policy, Region, RematError};

const LAYERS: usize = 2;

struct Run {
    loss: f64,
    grads: Vec<Tensor>,
    report: MemoryReport,
}

fn gpt_stack(blocks: &[Gpt], x: &Var, mask: &Tensor, pol: &PolicyFn, enabled: bool) -> Run {
    let mut h = x.as_tensor().clone();
    for (i, b) in blocks.iter().enumerate() {
        h = b
            .region(&format!("gpt.{i}"), &h, mask, pol.clone(), enabled)
            .unwrap();
    }
    let w = tensor(h.dims(), 77, 1.0, DType::F32);
    let loss = (h * w).unwrap().sum_all().unwrap();
    let report = MemoryReport::capture();
    let store = loss.backward().unwrap();
    let grads = std::iter::once(x.clone())
        .chain(blocks.iter().flat_map(Gpt::vars))
        .map(|v| {
            store
                .get(&v)
                .expect("every variable gets a gradient")
                .clone()
        })
        .collect();
    Run {
        loss: loss.to_scalar::<f32>().unwrap() as f64,
        grads,
        report,
    }
}

fn setup() -> (Vec<Gpt>, Var, Tensor) {
    let blocks = (0..LAYERS)
        .map(|i| Gpt::new(16, 2, 100 * i as u64, DType::F32))
        .collect();
    let x = var(&[2, 6, 16], 5, 1.0, DType::F32);
    (blocks, x, causal_mask(6, DType::F32))
}

/// `pol` with every `Offload` turned into `Save`.
fn as_saved(pol: &PolicyFn) -> PolicyFn {
    let pol = pol.clone();
    Arc::new(move |n| match pol(n) {
        Policy::Offload => Policy::Save,
        p => p,
    })
}

fn assert_same(label: &str, a: &Run, b: &Run) {
    assert_eq!(a.loss, b.loss, "{label}: loss");
    for (i, (x, y)) in a.grads.iter().zip(&b.grads).enumerate() {
        assert_eq!(rel_diff(x, y), 0.0, "{label}: gradient {i}");
    }
}

fn policies() -> Vec<(&'static str, PolicyFn)> {
    let offload_some: PolicyFn = Arc::new(|n| match n {
        "attn.qkv" | "mlp.fc" | "mlp.proj" => Policy::Offload,
        "attn.core" => Policy::Save,
        _ => Policy::Recompute,
    });
    // `heads` feeds the recomputed `attn.core`: its outputs are ferried and
    // come back during the replay, not during the sweep.
    let ferried: PolicyFn = Arc::new(|n| match n {
        "heads" | "mlp.res" => Policy::Offload,
        _ => Policy::Recompute,
    });
    vec![
        ("offload all", all(Policy::Offload)),
        ("offload matmuls, save attention", offload_some),
        ("offload a ferried statement and the region output", ferried),
    ]
}

#[test]
fn offloaded_statements_compute_what_saved_ones_do() {
    let (blocks, x, mask) = setup();
    let plain = gpt_stack(&blocks, &x, &mask, &all(Policy::Recompute), false);
    for (label, pol) in policies() {
        let saved = gpt_stack(&blocks, &x, &mask, &as_saved(&pol), true);
        let kept = gpt_stack(&blocks, &x, &mask, &pol, true);
        let moved = offload::swap_on_cpu(|| gpt_stack(&blocks, &x, &mask, &pol, true));
        // Moving storages out and back changes no value and no order.
        assert_same(&format!("{label}: moved vs kept"), &moved, &kept);
        // Against saving: an offloaded statement is a unit of its own where
        // consecutive saved statements share one graph, so sums across
        // statements run in another order.
        for (reference, what) in [(&saved, "saved"), (&plain, "plain")] {
            for (i, (g, r)) in moved.grads.iter().zip(&reference.grads).enumerate() {
                let d = rel_diff(g, r);
                assert!(d <= 1e-6, "{label}: gradient {i} vs {what}: {d:e}");
            }
        }

        // Where the bytes are: kept on a CPU an offloaded record holds its
        // residuals on the device; moved, the same bytes sit on the host and
        // none on the device. Other records are untouched.
        for (k, m) in kept.report.entries.iter().zip(&moved.report.entries) {
            assert_eq!(
                (&k.statement, k.call, k.policy),
                (&m.statement, m.call, m.policy)
            );
            if k.policy == Some(Policy::Offload) {
                assert!(k.bytes > 0, "{label}: {} holds something", k.statement);
                assert_eq!(k.host_bytes, 0);
                assert_eq!(
                    (m.bytes, m.host_bytes),
                    (0, k.bytes),
                    "{label}: {}",
                    k.statement
                );
            } else {
                assert_eq!(
                    (m.bytes, m.host_bytes),
                    (k.bytes, 0),
                    "{label}: {}",
                    k.statement
                );
            }
        }
        assert!(moved.report.total_host_bytes() > 0);
        assert_eq!(
            moved.report.total_bytes() + moved.report.total_host_bytes(),
            kept.report.total_bytes(),
            "{label}"
        );
        // Saving chains consecutive statements without leaf copies; an
        // offloaded statement always copies its inputs, so kept on a CPU it
        // holds at least what saving holds.
        assert!(kept.report.total_bytes() >= saved.report.total_bytes());
    }
}

#[test]
fn the_report_shows_a_host_column_only_when_something_is_offloaded() {
    let x = Var::ones((4, 8), DType::F32, &Device::Cpu).unwrap();
    let block = |ctx: &mut remat_runtime::Ctx, ins: &[Tensor]| {
        let e = ctx.offload("e", &[&ins[0]], |t| t[0].exp())?;
        ctx.recompute("s", &[&e], |t| t[0].sum_all())
    };
    let y = Region::new("r").run(&[x.as_tensor()], block).unwrap();
    let kept = MemoryReport::capture().to_string();
    drop(y);
    let y = offload::swap_on_cpu(|| Region::new("r").run(&[x.as_tensor()], block)).unwrap();
    let moved = MemoryReport::capture().to_string();
    drop(y);
    assert!(!kept.contains("host"), "{kept}");
    let line = |text: &str, start: &str| {
        text.lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .find(|l| l.starts_with(start))
            .unwrap()
    };
    assert_eq!(line(&kept, "r#0 e"), "r#0 e offload 256 [4, 8]");
    assert!(moved.lines().next().unwrap().contains(" host "), "{moved}");
    assert_eq!(line(&moved, "r#0 e"), "r#0 e offload 0 256 [4, 8]");
    // Only the offloaded statement reads x, from its own leaf copy (moved
    // to the host); the tape holds x on its device, to see a change in
    // place before the backward (as the caller's `Var` does).
    assert_eq!(line(&moved, "total"), "total 128 256");
}

#[test]
fn nothing_moves_when_nothing_in_the_statement_depends_on_its_inputs() {
    // The statement's graph leads only to a parameter: no leaf copy, so no
    // storage the runtime can prove private; it stays on the device.
    let w = Var::ones((4, 4), DType::F32, &Device::Cpu).unwrap();
    let c = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
    let wt = w.as_tensor().clone();
    let y = offload::swap_on_cpu(|| {
        Region::new("r").run(&[&c], move |ctx, ins| {
            let h = ctx.offload("h", &[&ins[0]], |t| t[0].matmul(&wt)?.exp())?;
            ctx.recompute("s", &[&h], |t| t[0].sum_all())
        })
    })
    .unwrap();
    let report = MemoryReport::capture();
    let h = report.entries.iter().find(|e| e.statement == "h").unwrap();
    assert_eq!(h.host_bytes, 0);
    assert_eq!(h.bytes, 2 * 4 * 4 * 2, "matmul and exp outputs stay");
    let g = y
        .backward()
        .unwrap()
        .get(&w)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    // d/dw sum(exp(c w)) = c^T exp(c w): every entry 2 e^4.
    let want = 2.0 * 4f32.exp();
    assert!(g.iter().flatten().all(|&v| (v - want).abs() <= want * 1e-6));
}

#[test]
fn a_region_nested_in_an_offloaded_statement_moves_with_it() {
    let w = var(&[8, 8], 3, 0.3, DType::F32);
    let x = var(&[3, 8], 4, 1.0, DType::F32);
    let run = |outer: Policy| {
        let wt = w.as_tensor().clone();
        let y = Region::new("outer")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let wt = wt.clone();
                let h = ctx.statement("inner", outer, &[&ins[0]], move |t| {
                    let wt = wt.clone();
                    Region::new("inner").run(&[&t[0]], move |ictx, i| {
                        let a = ictx.save("a", &[&i[0]], |t| t[0].matmul(&wt)?.tanh())?;
                        ictx.recompute("b", &[&a], |t| t[0].sqr())
                    })
                })?;
                ctx.recompute("sum", &[&h], |t| t[0].sum_all())
            })
            .unwrap();
        let store = y.backward().unwrap();
        (
            store.get(&w).unwrap().clone(),
            store.get(&x).unwrap().clone(),
        )
    };
    let saved = run(Policy::Save);
    let moved = offload::swap_on_cpu(|| run(Policy::Offload));
    assert_eq!(rel_diff(&moved.0, &saved.0), 0.0);
    assert_eq!(rel_diff(&moved.1, &saved.1), 0.0);
}

#[test]
fn plans_override_and_choose_offload() {
    let (blocks, x, mask) = setup();
    let declared = all(Policy::Offload);
    // `recompute_all` and `save_all` override annotations, offload included.
    for (plan, want) in [
        (Plan::recompute_all(), Policy::Recompute),
        (Plan::save_all(), Policy::Save),
    ] {
        let run = plan.scope(|| gpt_stack(&blocks, &x, &mask, &declared, true));
        assert!(run
            .report
            .entries
            .iter()
            .all(|e| e.policy.is_none() || e.policy == Some(want)));
    }
    // JAX's save_and_offload_only_these_names, for open statements.
    let xs = x.as_tensor().clone();
    let block = |ctx: &mut remat_runtime::Ctx, ins: &[Tensor]| {
        let a = ctx.open("a", &[&ins[0]], |t| t[0].exp())?;
        let b = ctx.open("b", &[&a], |t| t[0].sin())?;
        let c = ctx.open("c", &[&b], |t| t[0].sqr())?;
        ctx.offload("d", &[&c], |t| t[0].sum_all())
    };
    let plan = Plan::save_and_offload_only(["a"], ["b"]);
    let y = offload::swap_on_cpu(|| Region::new("r").plan(plan).run(&[&xs], block)).unwrap();
    let policies: Vec<_> = MemoryReport::capture()
        .entries
        .iter()
        .map(|e| e.policy)
        .collect();
    use Policy::*;
    assert_eq!(
        policies,
        [
            None,
            Some(Save),
            Some(Offload),
            Some(Recompute),
            Some(Offload)
        ]
    );
    let g = y.backward().unwrap().get(&x).unwrap().clone();
    // d/dx sum(sin(e^x)^2) = 2 sin(e^x) cos(e^x) e^x
    let e = x.as_tensor().exp().unwrap();
    let want = ((e.sin().unwrap() * e.cos().unwrap()).unwrap() * &e).unwrap() * 2.0;
    assert!(rel_diff(&g, &want.unwrap()) <= 1e-6);

    // A budget plan leaves a declared offload as it is, and charges it no
    // device bytes and no recompute time.
    let plan = Plan::budget(0.0);
    for _ in 0..2 {
        let y = Region::new("r")
            .plan(plan.clone())
            .run(&[&xs], block)
            .unwrap();
        y.backward().unwrap();
    }
    let solution = &plan.solutions()[0];
    let d = solution.statements.iter().find(|s| s.name == "d").unwrap();
    assert_eq!(
        (d.policy, d.declared, d.bytes, d.seconds),
        (Offload, true, 0, 0.0)
    );
    assert!(solution.statements[..3]
        .iter()
        .all(|s| s.policy == Recompute));
}

#[test]
fn a_retained_tape_backs_up_twice_and_traces_the_offloaded_statement() {
    let x = var(&[3, 5], 9, 1.0, DType::F32);
    let block = |ctx: &mut remat_runtime::Ctx, ins: &[Tensor]| {
        let e = ctx.offload("e", &[&ins[0]], |t| t[0].exp()?.sin())?;
        ctx.recompute("s", &[&e], |t| t[0].sum_all())
    };
    let (y, trace) = Trace::record(|| {
        offload::swap_on_cpu(|| Region::new("r").run(&[x.as_tensor()], block)).unwrap()
    });
    let first = retain_tape(|| y.backward()).unwrap();
    let second = y.backward().unwrap();
    let (a, b) = (first.get(&x).unwrap(), second.get(&x).unwrap());
    assert_eq!(rel_diff(a, b), 0.0);
    let e = x.as_tensor().exp().unwrap();
    let want = (e.cos().unwrap() * &e).unwrap();
    assert!(rel_diff(a, &want) <= 1e-6);
    let text = trace.to_string();
    assert!(text.contains("e            offload"), "{text}");
    // The third backward finds the tape consumed.
    let err = y.backward().unwrap_err().to_string();
    assert!(err.contains("consumed by an earlier backward"), "{err}");
}

#[test]
fn a_replay_that_saves_what_the_forward_offloaded_is_a_desync() {
    let x = var(&[2, 2], 1, 1.0, DType::F32);
    let y = offload::swap_on_cpu(|| {
        Region::new("blk").run(&[x.as_tensor()], |ctx, ins| {
            let policy = if ctx.is_replay() {
                Policy::Save
            } else {
                Policy::Offload
            };
            let h = ctx.statement("h", policy, &[&ins[0]], |t| t[0].exp())?;
            ctx.recompute("s", &[&h], |t| t[0].sum_all())
        })
    })
    .unwrap();
    let err = remat_runtime::backward(&y).unwrap_err();
    let RematError::ReplayDesync {
        region, expected, ..
    } = err.root()
    else {
        panic!("{err}")
    };
    assert_eq!(region, "blk");
    assert!(expected.contains("offload statement `h`"), "{expected}");
    // The failed backward released the tape, host copies included.
    assert!(MemoryReport::capture().entries.is_empty());
}

#[test]
fn an_offloaded_statement_cannot_reuse_a_saved_statements_name() {
    let x = var(&[2, 2], 1, 1.0, DType::F32);
    let err = Region::new("blk")
        .run(&[x.as_tensor()], |ctx, ins| {
            let h = ctx.save("h", &[&ins[0]], |t| t[0].exp())?;
            ctx.offload("h", &[&h], |t| t[0].sum_all())
        })
        .unwrap_err();
    assert!(
        matches!(&err, RematError::DuplicateName { region, statement } if region == "blk" && statement == "h"),
        "{err}"
    );
    assert!(MemoryReport::capture().entries.is_empty());
}
