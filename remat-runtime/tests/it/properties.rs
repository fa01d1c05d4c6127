//! Property test: random blocks (random op sequences over random inputs and
//! parameters, random declared policies, random plans, random consumers and
//! region outputs) give the forward values and gradients of the same
//! program run as plain candle code. proptest shrinks a failure to a
//! minimal block.
//!
//! f64 throughout; tolerance 1e-10 relative to each gradient tensor, or
//! 1e-12 absolute where a gradient cancels to zero (found by this test: an
//! output `a - b` of two identical values leaves only rounding noise of
//! 1e-17 whose sign depends on summation order). The only differences
//! allowed are the order in which contributions from different units are
//! summed.
//!
//! `PROPTEST_CASES=5000 cargo test -p remat-runtime --test it properties`
//! runs longer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use proptest::prelude::*;

use crate::common::max_abs;
use remat_runtime::{Plan, Policy, Region, RematError, StatementInfo};

const N: usize = 4;

/// Cases run so far, for region names.
static CASES: AtomicUsize = AtomicUsize::new(0);

#[derive(Debug, Clone)]
enum Op {
    Tanh(usize),
    Sin(usize),
    Mul(usize, usize),
    Avg(usize, usize),
    /// `x W_k`, with one of three parameters.
    Matmul(usize, usize),
    /// Row means, broadcast back.
    RowMean(usize),
    Transpose(usize),
    /// Two outputs: `(tanh(a) * b, a - b)`.
    Pair(usize, usize),
}

#[derive(Debug, Clone)]
struct Stmt {
    op: Op,
    declared: Option<Policy>,
}

#[derive(Debug, Clone)]
enum PlanKind {
    Declared,
    RecomputeAll,
    SaveAll,
    SaveOnly(Vec<bool>),
    /// Open statements: saved where the first mask says, else offloaded
    /// where the second says, else recomputed.
    SaveAndOffload(Vec<bool>, Vec<bool>),
}

#[derive(Debug, Clone)]
struct Program {
    /// Per region input: does it need gradients?
    inputs: Vec<bool>,
    stmts: Vec<Stmt>,
    /// Values the region returns (indices reduced modulo the value count).
    outputs: Vec<usize>,
    plan: PlanKind,
    /// Offloaded statements move their residuals out and back (as on a
    /// GPU) instead of being kept as saved on this CPU.
    swap: bool,
}

/// A misuse of the statement API (indices reduced modulo the count).
#[derive(Debug, Clone)]
enum Misuse {
    /// Statement `i`'s closure also reads value `j` (an earlier value)
    /// without declaring it: its first output gets `0.5 * value` added.
    Capture(usize, usize),
    /// The region also returns `10 * value`, computed outside any statement.
    OutsideOp(usize),
    /// The region also returns parameter `w` as it is.
    ReturnVar(usize),
    /// Statement `i` computes something else each time it runs (as candle's
    /// own random ops do): its outputs are scaled by `1 + 0.1 * runs`.
    Nondeterministic(usize),
    /// Parameter `w` is changed between the forward and the backward.
    UpdateParam(usize),
}

fn misuse() -> impl Strategy<Value = Misuse> {
    let i = any::<usize>();
    prop_oneof![
        (i, i).prop_map(|(a, b)| Misuse::Capture(a, b)),
        i.prop_map(Misuse::OutsideOp),
        (0..3usize).prop_map(Misuse::ReturnVar),
        i.prop_map(Misuse::Nondeterministic),
        (0..3usize).prop_map(Misuse::UpdateParam),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let i = any::<usize>();
    prop_oneof![
        i.prop_map(Op::Tanh),
        i.prop_map(Op::Sin),
        (i, i).prop_map(|(a, b)| Op::Mul(a, b)),
        (i, i).prop_map(|(a, b)| Op::Avg(a, b)),
        (i, 0..3usize).prop_map(|(a, w)| Op::Matmul(a, w)),
        i.prop_map(Op::RowMean),
        i.prop_map(Op::Transpose),
        (i, i).prop_map(|(a, b)| Op::Pair(a, b)),
    ]
}

fn declared() -> impl Strategy<Value = Option<Policy>> {
    prop_oneof![
        Just(None),
        Just(Some(Policy::Save)),
        Just(Some(Policy::Offload)),
        Just(Some(Policy::Recompute))
    ]
}

fn program() -> impl Strategy<Value = Program> {
    (
        prop::collection::vec(any::<bool>(), 1..4),
        prop::collection::vec(
            (op(), declared()).prop_map(|(op, declared)| Stmt { op, declared }),
            1..12,
        ),
        prop::collection::vec(any::<usize>(), 1..4),
        prop_oneof![
            Just(PlanKind::Declared),
            Just(PlanKind::RecomputeAll),
            Just(PlanKind::SaveAll),
            prop::collection::vec(any::<bool>(), 12).prop_map(PlanKind::SaveOnly),
            (
                prop::collection::vec(any::<bool>(), 12),
                prop::collection::vec(any::<bool>(), 12)
            )
                .prop_map(|(s, o)| PlanKind::SaveAndOffload(s, o)),
        ],
        any::<bool>(),
    )
        .prop_map(|(inputs, stmts, outputs, plan, swap)| Program {
            inputs,
            stmts,
            outputs,
            plan,
            swap,
        })
}

/// Deterministic values in [-1, 1].
fn values(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

fn tensor(seed: u64, scale: f64) -> Tensor {
    let v: Vec<f64> = values(seed, N * N).into_iter().map(|x| x * scale).collect();
    Tensor::from_vec(v, (N, N), &Device::Cpu).unwrap()
}

/// Runs statement `op` on `vals` (operand indices reduced modulo the count).
fn apply(op: &Op, vals: &[Tensor], ws: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
    let n = vals.len();
    let v = |i: &usize| &vals[i % n];
    Ok(match op {
        Op::Tanh(a) => vec![v(a).tanh()?],
        Op::Sin(a) => vec![v(a).sin()?],
        Op::Mul(a, b) => vec![(v(a) * v(b))?],
        Op::Avg(a, b) => vec![((v(a) + v(b))? * 0.5)?],
        Op::Matmul(a, w) => vec![v(a).matmul(&ws[*w])?],
        Op::RowMean(a) => vec![v(a).mean_keepdim(1)?.broadcast_as((N, N))?],
        Op::Transpose(a) => vec![v(a).t()?],
        Op::Pair(a, b) => vec![(v(a).tanh()? * v(b))?, (v(a) - v(b))?],
    })
}

/// The operand indices of `op`, reduced modulo `n`.
fn operands(op: &Op, n: usize) -> Vec<usize> {
    match op {
        Op::Tanh(a) | Op::Sin(a) | Op::RowMean(a) | Op::Transpose(a) | Op::Matmul(a, _) => {
            vec![a % n]
        }
        Op::Mul(a, b) | Op::Avg(a, b) | Op::Pair(a, b) => vec![a % n, b % n],
    }
}

fn plan(p: &Program) -> Plan {
    match &p.plan {
        PlanKind::Declared => Plan::declared(),
        PlanKind::RecomputeAll => Plan::recompute_all(),
        PlanKind::SaveAll => Plan::save_all(),
        PlanKind::SaveOnly(mask) => Plan::save_only(
            (0..p.stmts.len())
                .filter(|&i| mask[i % mask.len()])
                .map(|i| format!("s{i}")),
        ),
        PlanKind::SaveAndOffload(save, offload) => {
            let names = |mask: &[bool]| -> Vec<String> {
                (0..p.stmts.len())
                    .filter(|&i| mask[i % mask.len()])
                    .map(|i| format!("s{i}"))
                    .collect()
            };
            Plan::save_and_offload_only(names(save), names(offload))
        }
    }
}

/// Runs the program as a region under `plan` and returns the region
/// outputs, with `misuse` written into it.
fn run_region(
    name: &str,
    p: &Program,
    misuse: Option<&Misuse>,
    inputs: &[Tensor],
    ws: &[Tensor],
    plan: Plan,
) -> remat_runtime::Result<Vec<Tensor>> {
    let (stmts, outputs, ws) = (p.stmts.clone(), p.outputs.clone(), ws.to_vec());
    let misuse = misuse.cloned();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    Region::new(name)
        .plan(plan)
        .run(refs.as_slice(), move |ctx, ins| {
            let mut vals: Vec<Tensor> = ins.to_vec();
            for (i, s) in stmts.iter().enumerate() {
                let idx = operands(&s.op, vals.len());
                let args: Vec<&Tensor> = idx.iter().map(|&j| &vals[j]).collect();
                // The closure sees its operands in `idx` order; rebuild a
                // value list it can index the same way.
                let op = s.op.clone();
                let ws = ws.clone();
                let captured = match &misuse {
                    Some(Misuse::Capture(c, j)) if c % stmts.len() == i => {
                        Some(vals[j % vals.len()].clone())
                    }
                    _ => None,
                };
                let runs = match &misuse {
                    Some(Misuse::Nondeterministic(c)) if c % stmts.len() == i => {
                        Some(Arc::new(AtomicUsize::new(0)))
                    }
                    _ => None,
                };
                let f = move |t: &[Tensor]| -> remat_runtime::Result<Vec<Tensor>> {
                    let remap = remap(&op, t);
                    let mut out = apply(&remap.0, &remap.1, &ws)?;
                    if let Some(c) = &captured {
                        out[0] = (&out[0] + (c * 0.5)?)?;
                    }
                    if let Some(runs) = &runs {
                        let k = runs.fetch_add(1, Ordering::SeqCst) as f64;
                        out = out
                            .iter()
                            .map(|o| o * (1.0 + 0.1 * k))
                            .collect::<candle_core::Result<_>>()?;
                    }
                    Ok(out)
                };
                let name = format!("s{i}");
                let out = match s.declared {
                    Some(policy) => ctx.statement(&name, policy, args.as_slice(), f)?,
                    None => ctx.open(&name, args.as_slice(), f)?,
                };
                vals.extend(out);
            }
            let n = vals.len();
            let mut outs: Vec<Tensor> = outputs.iter().map(|&o| vals[o % n].clone()).collect();
            match &misuse {
                Some(Misuse::OutsideOp(j)) => outs.push((&vals[j % n] * 10.0)?),
                Some(Misuse::ReturnVar(w)) => outs.push(ws[*w].clone()),
                _ => {}
            }
            Ok(outs)
        })
}

/// The op rewritten to read its operands from `t` (the statement's inputs
/// in operand order).
fn remap(op: &Op, t: &[Tensor]) -> (Op, Vec<Tensor>) {
    let op = match op {
        Op::Tanh(_) => Op::Tanh(0),
        Op::Sin(_) => Op::Sin(0),
        Op::RowMean(_) => Op::RowMean(0),
        Op::Transpose(_) => Op::Transpose(0),
        Op::Matmul(_, w) => Op::Matmul(0, *w),
        Op::Mul(..) => Op::Mul(0, 1),
        Op::Avg(..) => Op::Avg(0, 1),
        Op::Pair(..) => Op::Pair(0, 1),
    };
    (op, t.to_vec())
}

/// The same program as plain candle code, with `misuse` (a capture is an
/// input like any other here; a nondeterministic statement runs once).
fn run_plain(
    p: &Program,
    misuse: Option<&Misuse>,
    inputs: &[Tensor],
    ws: &[Tensor],
) -> Vec<Tensor> {
    let mut vals: Vec<Tensor> = inputs.to_vec();
    for (i, s) in p.stmts.iter().enumerate() {
        let mut out = apply(&s.op, &vals, ws).unwrap();
        if let Some(Misuse::Capture(c, j)) = misuse {
            if c % p.stmts.len() == i {
                let captured = &vals[j % vals.len()];
                out[0] = (&out[0] + (captured * 0.5).unwrap()).unwrap();
            }
        }
        vals.extend(out);
    }
    let n = vals.len();
    let mut outs: Vec<Tensor> = p.outputs.iter().map(|&o| vals[o % n].clone()).collect();
    match misuse {
        Some(Misuse::OutsideOp(j)) => outs.push((&vals[j % n] * 10.0).unwrap()),
        Some(Misuse::ReturnVar(w)) => outs.push(ws[*w].clone()),
        _ => {}
    }
    outs
}

/// Whether `e` is one of the errors that name a misuse.
fn names_a_misuse(e: &RematError) -> bool {
    matches!(
        e.root(),
        RematError::OutputOutsideStatement { .. }
            | RematError::UndeclaredInput { .. }
            | RematError::ReplayDiverged { .. }
            | RematError::ParameterChanged { .. }
    )
}

/// The one misuse only a region's first forward catches: a *saved*
/// statement whose closure captures a value (in later forwards candle
/// records no graph through a value that needs no gradient inside the
/// statement, and its op graph is private to it).
fn uncaught(p: &Program, misuse: Option<&Misuse>) -> bool {
    let Some(Misuse::Capture(c, _)) = misuse else {
        return false;
    };
    let i = c % p.stmts.len();
    let name = format!("s{i}");
    let info = StatementInfo {
        region: "prop",
        name: &name,
        declared: p.stmts[i].declared,
    };
    plan(p).policy(&info) != Policy::Recompute
}

/// Runs `p` (with `misuse`) as a region and as plain candle code. The
/// oracle: a named error, or forward values and gradients equal to plain
/// candle's; never a silent difference.
fn check(p: &Program, misuse: Option<&Misuse>) -> Result<(), TestCaseError> {
    let vars: Vec<Var> = p
        .inputs
        .iter()
        .enumerate()
        .map(|(i, _)| Var::from_tensor(&tensor(i as u64 + 1, 1.0)).unwrap())
        .collect();
    let inputs: Vec<Tensor> = vars
        .iter()
        .zip(&p.inputs)
        .map(|(v, &grad)| {
            if grad {
                v.as_tensor().clone()
            } else {
                v.as_tensor().detach()
            }
        })
        .collect();
    let ws: Vec<Var> = (0..3)
        .map(|k| Var::from_tensor(&tensor(100 + k, 0.5)).unwrap())
        .collect();
    let wt: Vec<Tensor> = ws.iter().map(|w| w.as_tensor().clone()).collect();
    let loss = |outs: &[Tensor]| {
        outs.iter()
            .enumerate()
            .map(|(i, o)| {
                (o * tensor(200 + i as u64, 1.0))
                    .unwrap()
                    .sum_all()
                    .unwrap()
            })
            .reduce(|a, b| (a + b).unwrap())
            .unwrap()
    };
    let reference = run_plain(p, misuse, &inputs, &wt);
    // Every other case is a region's first forward on this thread (which
    // looks for undeclared reads); the others are its second, after a
    // first one of the same block whose values are dropped (a region name
    // stands for one block: another program's first forward under the
    // same name would leave it what that block's outputs were).
    let case = CASES.fetch_add(1, Ordering::Relaxed);
    let first = case % 2 == 0;
    let name = format!("prop#{case}");
    let forward = || {
        if p.swap {
            remat_runtime::offload::swap_on_cpu(|| {
                run_region(&name, p, misuse, &inputs, &wt, plan(p))
            })
        } else {
            run_region(&name, p, misuse, &inputs, &wt, plan(p))
        }
    };
    if !first {
        match forward() {
            Ok(_) => {}
            Err(e) if misuse.is_some() && names_a_misuse(&e) => return Ok(()),
            Err(e) => return Err(TestCaseError::fail(format!("first forward failed: {e}"))),
        }
    }
    let got = forward();
    let got = match got {
        Ok(got) => got,
        Err(e) if misuse.is_some() && names_a_misuse(&e) => return Ok(()),
        Err(e) => return Err(TestCaseError::fail(format!("forward failed: {e}"))),
    };
    prop_assert_eq!(got.len(), reference.len());
    for (a, b) in got.iter().zip(&reference) {
        prop_assert_eq!(max_abs(&(a - b).unwrap()), 0.0, "forward values differ");
    }
    let (loss_ref, loss_got) = (loss(&reference), loss(&got));
    if let Some(Misuse::UpdateParam(w)) = misuse {
        // An optimizer step before the backward, seen by both.
        ws[*w].set(&(ws[*w].as_tensor() * 1.001).unwrap()).unwrap();
    }
    let g_ref = loss_ref.backward().unwrap();
    let g = match remat_runtime::backward(&loss_got) {
        Ok(g) => g,
        Err(e) if misuse.is_some() && names_a_misuse(&e) => return Ok(()),
        Err(e) => return Err(TestCaseError::fail(format!("backward failed: {e}"))),
    };
    if !first && uncaught(p, misuse) {
        return Ok(());
    }
    let tracked = vars
        .iter()
        .zip(&p.inputs)
        .filter(|(_, &grad)| grad)
        .map(|(v, _)| v)
        .chain(&ws);
    for v in tracked {
        match (g.get(v), g_ref.get(v)) {
            (Some(a), Some(b)) => {
                // Relative to the tensor, with an absolute floor for
                // gradients that cancel to zero exactly, where only f64
                // rounding noise (~1e-16) is left to compare.
                let (d, scale) = (max_abs(&(a - b).unwrap()), max_abs(b));
                prop_assert!(
                    d <= 1e-10 * scale || d <= 1e-12,
                    "gradient differs by {d:e} (largest reference magnitude {scale:e})"
                );
            }
            (None, None) => {}
            (a, b) => prop_assert!(
                false,
                "gradient present with remat: {}, in plain candle: {}",
                a.is_some(),
                b.is_some()
            ),
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_blocks_match_plain_candle(p in program()) {
        check(&p, None)?;
    }

    /// The same blocks with one misuse each: a named error, or values and
    /// gradients equal to plain candle's.
    #[test]
    fn random_misused_blocks_are_refused_or_right(p in program(), m in misuse()) {
        check(&p, Some(&m))?;
    }
}
