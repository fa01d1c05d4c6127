//! Gradients through checkpointed regions against the same model run as
//! plain candle code.
//!
//! Tolerances: where the remat run performs the same floating-point
//! operations in the same order as the reference, the results are asserted
//! bit-for-bit equal (tolerance 0). Where a gradient is a sum of
//! contributions from several statements, the runtime adds them in its own
//! order (one candle backward per segment, then the sums across segments),
//! which can change the last bits of an f32 sum; those comparisons use 1e-6
//! relative (max |a - b| / max |reference|), a few ulps of f32 (eps 1.2e-7)
//! times the handful of terms involved.

use crate::common::*;
use candle_core::{DType, Tensor, Var};
use remat_runtime::{Policy, Region};

struct Run {
    out: Vec<Tensor>,
    grads: Vec<Option<Tensor>>,
}

/// A loss that weighs every output element differently, so that each output
/// gradient is a distinct non-trivial tensor.
fn weighted_outputs(outs: &[Tensor]) -> Tensor {
    let mut loss: Option<Tensor> = None;
    for (i, o) in outs.iter().enumerate() {
        let l = weighted_sum(o, 1000 + i as u64);
        loss = Some(match loss {
            None => l,
            Some(prev) => (prev + l).unwrap(),
        });
    }
    loss.unwrap()
}

fn run(outs: Vec<Tensor>, wrt: &[&Var]) -> Run {
    let grads = weighted_outputs(&outs).backward().unwrap();
    Run {
        grads: wrt.iter().map(|v| grads.get(v).cloned()).collect(),
        out: outs,
    }
}

/// Compares two runs and returns the largest relative difference seen.
fn compare(label: &str, got: &Run, reference: &Run) -> f64 {
    let mut worst = 0.0f64;
    for (i, (a, b)) in got.out.iter().zip(&reference.out).enumerate() {
        let d = rel_diff(a, b);
        assert_eq!(d, 0.0, "{label}: forward output {i} differs ({d:e})");
    }
    for (i, (a, b)) in got.grads.iter().zip(&reference.grads).enumerate() {
        let (a, b) = match (a, b) {
            (Some(a), Some(b)) => (a, b),
            (None, None) => continue,
            _ => panic!("{label}: gradient {i} present in one run only"),
        };
        worst = worst.max(rel_diff(a, b));
    }
    println!("{label}: max relative gradient difference {worst:e}");
    worst
}

fn mlp_case(pol: PolicyFn) -> f64 {
    let m = Mlp::new(16, 48, 1, DType::F32);
    let x = var(&[6, 16], 7, 1.0, DType::F32);
    let mut wrt: Vec<&Var> = vec![&x];
    let vars = m.vars();
    wrt.extend(vars.iter());
    let plain = run(vec![m.plain(x.as_tensor()).unwrap()], &wrt);
    let off = run(
        vec![m.region("mlp", x.as_tensor(), pol.clone(), false).unwrap()],
        &wrt,
    );
    let on = run(
        vec![m.region("mlp", x.as_tensor(), pol, true).unwrap()],
        &wrt,
    );
    assert_eq!(compare("statements vs hand-written", &off, &plain), 0.0);
    compare("remat vs hand-written", &on, &plain)
}

#[test]
fn mlp_all_recompute_is_exact() {
    assert_eq!(mlp_case(all(Policy::Recompute)), 0.0);
}

#[test]
fn mlp_all_save_is_exact() {
    assert_eq!(mlp_case(all(Policy::Save)), 0.0);
}

#[test]
fn mlp_mixed_is_exact() {
    assert_eq!(mlp_case(saving(&["fc1", "fc2"])), 0.0);
    assert_eq!(mlp_case(saving(&["act"])), 0.0);
}

fn gpt_case(pol: PolicyFn) -> f64 {
    let m = Gpt::new(32, 4, 11, DType::F32);
    let x = var(&[2, 8, 32], 5, 1.0, DType::F32);
    let mask = causal_mask(8, DType::F32);
    let vars = m.vars();
    let mut wrt: Vec<&Var> = vec![&x];
    wrt.extend(vars.iter());
    let plain = run(
        vec![m
            .region("gpt", x.as_tensor(), &mask, pol.clone(), false)
            .unwrap()],
        &wrt,
    );
    let on = run(
        vec![m.region("gpt", x.as_tensor(), &mask, pol, true).unwrap()],
        &wrt,
    );
    compare("gpt remat vs plain", &on, &plain)
}

#[test]
fn gpt_block_all_recompute() {
    // One segment replays the block exactly as the plain graph runs it.
    assert_eq!(gpt_case(all(Policy::Recompute)), 0.0);
}

#[test]
fn gpt_block_all_save() {
    assert!(gpt_case(all(Policy::Save)) <= 1e-6);
}

#[test]
fn gpt_block_mixed_with_ferried_outputs() {
    // `attn.qkv` is saved and read by the recomputed `heads`: its output is
    // ferried on the tape. `mlp.proj` is saved and read by `mlp.res`.
    assert!(gpt_case(saving(&["attn.qkv", "attn.core", "mlp.proj"])) <= 1e-6);
    // saved statements feeding saved statements: outputs become placeholders.
    assert!(
        gpt_case(saving(&[
            "heads",
            "attn.core",
            "merge",
            "mlp.fc",
            "mlp.proj"
        ])) <= 1e-6
    );
}

#[test]
fn stack_of_gpt_blocks_called_in_a_loop() {
    let blocks: Vec<Gpt> = (0..4)
        .map(|i| Gpt::new(32, 4, 100 + 20 * i, DType::F32))
        .collect();
    let x = var(&[2, 8, 32], 9, 1.0, DType::F32);
    let mask = causal_mask(8, DType::F32);
    let mut wrt: Vec<&Var> = vec![&x];
    let vars: Vec<Var> = blocks.iter().flat_map(|b| b.vars()).collect();
    wrt.extend(vars.iter());
    let stack = |enabled: bool| {
        let mut h = x.as_tensor().clone();
        for (i, b) in blocks.iter().enumerate() {
            let pol = if i % 2 == 0 {
                all(Policy::Recompute)
            } else {
                saving(&["attn.qkv", "mlp.fc"])
            };
            h = b
                .region(&format!("block.{i}"), &h, &mask, pol, enabled)
                .unwrap();
        }
        h
    };
    let plain = run(vec![stack(false)], &wrt);
    let on = run(vec![stack(true)], &wrt);
    assert!(compare("4-block stack", &on, &plain) <= 1e-6);
}

/// A region with 5 inputs (anchor chain longer than one op can take) and 2
/// outputs, both used by the loss.
fn five_in_two_out(enabled: bool, pol: PolicyFn) -> (Vec<Tensor>, Vec<Var>) {
    let ins: Vec<Var> = (0..5)
        .map(|i| var(&[4, 6], 20 + i, 1.0, DType::F32))
        .collect();
    let w = var(&[6, 6], 30, 0.5, DType::F32);
    let wt = w.as_tensor().clone();
    let refs: Vec<&Tensor> = ins.iter().map(|v| v.as_tensor()).collect();
    let (a, b): (Tensor, Tensor) = Region::new("five")
        .enabled(enabled)
        .run(&refs, move |ctx, t| {
            let s = ctx.statement("sum01", pol("sum01"), &[&t[0], &t[1]], |a| &a[0] * &a[1])?;
            let m = ctx.statement("mm", pol("mm"), &[&s, &t[2]], |a| {
                a[0].matmul(&wt)? + a[1].tanh()?
            })?;
            let (p, q) = ctx.statement("pair", pol("pair"), &[&m, &t[3], &t[4]], |a| {
                Ok::<_, remat_runtime::RematError>((
                    (&a[0] * &a[1])?.exp()?,
                    (a[0].sqr()? - &a[2])?,
                ))
            })?;
            let q2 = ctx.statement("q2", pol("q2"), &[&q, &t[0]], |a| &a[0] + &a[1])?;
            Ok((p, q2))
        })
        .unwrap();
    let mut vars = ins;
    vars.push(w);
    (vec![a, b], vars)
}

#[test]
fn five_inputs_two_outputs() {
    for pol in [
        all(Policy::Recompute),
        all(Policy::Save),
        saving(&["mm", "q2"]),
        saving(&["pair"]),
    ] {
        let (outs, vars) = five_in_two_out(false, pol.clone());
        let wrt: Vec<&Var> = vars.iter().collect();
        let plain = run(outs, &wrt);
        let (outs, vars) = five_in_two_out(true, pol);
        let wrt: Vec<&Var> = vars.iter().collect();
        let on = run(outs, &wrt);
        // Different Var objects with identical values: compare by position.
        assert_eq!(compare("5 in / 2 out", &on, &plain), 0.0);
    }
}
