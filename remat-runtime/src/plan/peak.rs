//! Plans for the peak of a training step: measured candidates from full
//! recomputation to plain candle, and the fastest of them under a peak.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use super::calls::{Call, PerCall};
use super::{Plan, Rule};
use crate::{RematError, Result};

/// One plan the profile measured, with the peak of its step.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PeakCandidate {
    /// The plan.
    pub plan: Plan,
    /// The peak its step reached, in the unit `step` measured it in.
    pub peak: usize,
    /// The forward time of the statements it recomputes, as measured by
    /// one profiling step (0 for plain candle).
    pub recompute_seconds: f64,
}

/// Plans for the peak of a training step: [`PeakPlan::profile`] measures
/// the peaks of plans from full recomputation to plain candle, deciding
/// call by call (the k-th call of a region saves its own statements);
/// [`PeakPlan::for_peak`] then gives the fastest of them whose step peaks
/// at most a requested number of bytes.
///
/// The search is greedy: from full recomputation, each round tries every
/// statement not yet saved, one more at a time, measures the peak of each
/// such plan, and keeps the statement that saves the most recompute time
/// per byte it adds to the peak (often the last calls first: a call's
/// saved residuals live from its forward to its backward, which comes
/// sooner the later the call). Every plan measured is a candidate, so the
/// profile holds many plans between the two ends, not one series. Times
/// are a model: the forward time of the statements a plan recomputes, as
/// one profiling step measured them (on a busy machine two profiles may
/// order statements of similar cost differently). Peaks are measured.
///
/// Only the candidates no other beats on both peak and time are kept, and
/// each is measured once more (as a step after its first), so the plan
/// [`for_peak`](PeakPlan::for_peak) gives peaks at most the request, and
/// never lower when the request grows (tested over requests from full
/// recomputation's peak to plain candle's).
///
/// `step` runs one training step (forward and backward) of the model
/// under the plan it is given and returns the step's peak: on the CPU from
/// a [`CountingAlloc`](crate::inspect::CountingAlloc), on CUDA from
/// [`device_memory_peak`](crate::inspect::device_memory_peak). With `n`
/// open statements over all the calls of a step, the profile runs it
/// `5 + n (n + 1) / 2` times, plus once for each plan kept (470 and then
/// some for three layers of ten statements). Its forwards and backwards
/// must not change the weights (no optimizer step), and the batch must
/// have the shapes of the steps the plan will run.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use remat_runtime::inspect::CountingAlloc;
/// use remat_runtime::plan::PeakPlan;
/// use remat_runtime::Region;
///
/// #[global_allocator]
/// static ALLOC: CountingAlloc = CountingAlloc::new();
///
/// let x = Var::ones((64, 64), DType::F32, &Device::Cpu)?;
/// let layer = |h: &Tensor| {
///     Region::new("layer").run(&[h], |ctx, ins| {
///         let e = ctx.open("e", &[&ins[0]], |t| t[0].exp())?;
///         ctx.open("s", &[&e], |t| t[0].sin())
///     })
/// };
/// let profile = PeakPlan::profile(|plan| {
///     let before = ALLOC.live();
///     ALLOC.reset_peak();
///     let y = plan.scope(|| layer(&layer(x.as_tensor())?))?;
///     y.sum_all()?.backward()?;
///     Ok(ALLOC.peak() - before)
/// })?;
/// let lowest = profile.candidates()[0].peak;
/// println!("{profile}");
/// let plan = profile.for_peak(lowest + lowest / 2)?;
/// assert!(profile.for_peak(lowest - 1).is_err());
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
#[derive(Debug, Clone)]
pub struct PeakPlan {
    /// From the lowest peak (slowest) to the highest (fastest).
    candidates: Vec<PeakCandidate>,
}

impl PeakPlan {
    /// Measures plans with `step` (see [`PeakPlan`]).
    pub fn profile(mut step: impl FnMut(&Plan) -> Result<usize>) -> Result<Self> {
        // What recomputing each open statement costs: its forward time,
        // measured by a budget plan's first call (which saves them all).
        let budget = Plan::budget(1.0);
        step(&budget)?;
        let mut seconds: HashMap<String, Vec<(String, f64)>> = HashMap::new();
        for solution in budget.solutions() {
            let open = solution.statements.into_iter().filter(|p| !p.declared);
            let open = open.map(|p| (p.name, p.seconds.max(0.0)));
            seconds.insert(solution.region, open.collect());
        }
        // Full recomputation, call by call: twice, the first step warms
        // what a step allocates once (caches, maps).
        let (plan, rule) = per_call(&HashMap::new(), "recompute all (by call)");
        step(&plan)?;
        let mut current = step(&plan)?;
        let calls = rule.calls();
        let open: Vec<Open> = calls
            .iter()
            .flat_map(|call| {
                let names = seconds.get(&call.0).into_iter().flatten();
                names.map(|(name, seconds)| Open {
                    call: call.clone(),
                    name: name.clone(),
                    seconds: *seconds,
                })
            })
            .collect();
        let total: f64 = open.iter().map(|o| o.seconds).sum();
        let mut measured = vec![PeakCandidate {
            plan,
            peak: current,
            recompute_seconds: total,
        }];
        // Greedy: each round measures every statement not yet saved added
        // to the plan so far, and keeps the one that saves the most time
        // per byte it adds to the peak.
        let mut saved: Vec<usize> = Vec::new();
        while saved.len() < open.len() {
            let mut best: Option<(f64, usize, usize)> = None;
            for i in (0..open.len()).filter(|i| !saved.contains(i)) {
                let with: Vec<usize> = saved.iter().copied().chain([i]).collect();
                let (plan, time) = plan_of(&open, &with, &calls, total);
                let peak = step(&plan)?;
                let score = (peak as f64 - current as f64) / open[i].seconds.max(1e-12);
                if best.is_none_or(|(s, _, _)| score < s) {
                    best = Some((score, i, peak));
                }
                measured.push(PeakCandidate {
                    plan,
                    peak,
                    recompute_seconds: time,
                });
            }
            let Some((_, i, peak)) = best else { break };
            saved.push(i);
            current = peak;
        }
        let off = Plan::off();
        step(&off)?;
        let peak = step(&off)?;
        measured.push(PeakCandidate {
            plan: off,
            peak,
            recompute_seconds: 0.0,
        });
        // The plans no other beats on both peak and time, measured once
        // more: a plan's first step also counts what the plan allocates
        // once (its tally of the step's calls), its later steps do not.
        let mut candidates = front(measured);
        for c in &mut candidates {
            c.peak = step(&c.plan)?;
        }
        Ok(PeakPlan {
            candidates: front(candidates),
        })
    }

    /// The fastest measured plan whose step peaked at most `bytes` (run
    /// each training step in its own `plan.scope(..)`: the plan counts the
    /// calls of a region from its scope);
    /// [`RematError::PeakUnreachable`] when every plan measured peaked
    /// higher.
    pub fn for_peak(&self, bytes: usize) -> Result<Plan> {
        self.candidates
            .iter()
            .rev()
            .find(|c| c.peak <= bytes)
            .map(|c| c.plan.clone())
            .ok_or_else(|| RematError::PeakUnreachable {
                requested: bytes,
                lowest: self.candidates.first().map_or(0, |c| c.peak),
            })
    }

    /// The plans kept, from the lowest peak (the slowest) to the highest
    /// (the fastest), with their measured peaks.
    pub fn candidates(&self) -> &[PeakCandidate] {
        &self.candidates
    }
}

/// An open statement of one call of a step.
struct Open {
    call: Call,
    name: String,
    /// Its measured forward time: what recomputing it costs.
    seconds: f64,
}

/// The plan saving `open[i]` for each `i` in `saved`, and the time it
/// spends recomputing the others.
fn plan_of(open: &[Open], saved: &[usize], calls: &[Call], total: f64) -> (Plan, f64) {
    let mut assigned: HashMap<Call, Vec<String>> = HashMap::new();
    let mut time = total;
    for &i in saved {
        let o = &open[i];
        assigned
            .entry(o.call.clone())
            .or_default()
            .push(o.name.clone());
        time -= o.seconds;
    }
    let (plan, _) = per_call(&assigned, &label(&assigned, calls));
    (plan, time.max(0.0))
}

/// The candidates no other has both a peak as low and a shorter
/// recompute time (plain candle counts as the fastest of all), from the
/// lowest peak (the slowest) to the highest (the fastest).
fn front(mut measured: Vec<PeakCandidate>) -> Vec<PeakCandidate> {
    let time = |c: &PeakCandidate| {
        if c.plan.is_off() {
            -1.0
        } else {
            c.recompute_seconds
        }
    };
    measured.sort_by(|a, b| a.peak.cmp(&b.peak).then(time(a).total_cmp(&time(b))));
    let mut kept: Vec<PeakCandidate> = Vec::new();
    for c in measured {
        if kept.last().is_none_or(|slower| time(&c) < time(slower)) {
            kept.push(c);
        }
    }
    kept
}

/// A plan saving, in each call of `assigned`, the statements named there.
fn per_call(assigned: &HashMap<Call, Vec<String>>, label: &str) -> (Plan, Arc<PerCall>) {
    let save = assigned
        .iter()
        .map(|(call, names)| (call.clone(), names.iter().cloned().collect::<HashSet<_>>()))
        .collect();
    let rule = Arc::new(PerCall::new(save));
    (Plan::new(Rule::PerCall(rule.clone()), label), rule)
}

/// `peak plan: block#2 saves fc, block#3 saves qkv fc mlp`: what each call
/// saves, in call order.
fn label(assigned: &HashMap<Call, Vec<String>>, calls: &[Call]) -> String {
    let parts: Vec<String> = calls
        .iter()
        .filter_map(|call| {
            let names = assigned.get(call)?;
            Some(format!("{}#{} saves {}", call.0, call.1, names.join(" ")))
        })
        .collect();
    format!("peak plan: {}", parts.join(", "))
}

impl fmt::Display for PeakPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:>14}  plan", "peak")?;
        for c in &self.candidates {
            writeln!(f, "{:>14}  {}", c.peak, c.plan)?;
        }
        Ok(())
    }
}
