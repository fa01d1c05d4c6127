//! Plans for the peak of a training step: measured candidates from full
//! recomputation to plain candle, and the fastest of them under a peak.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use super::calls::{Call, PerCall};
use super::{Plan, Rule};
use crate::{Policy, RematError, Result};

/// The budget fractions whose solutions order the statements a call
/// saves: first those the smallest budget saves.
const LEVELS: [f64; 4] = [0.25, 0.5, 0.75, 1.0];

/// One plan the profile measured, with the peak of its step.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PeakCandidate {
    /// The plan.
    pub plan: Plan,
    /// The peak its step reached, in the unit `step` measured it in.
    pub peak: usize,
}

/// Plans for the peak of a training step: [`PeakPlan::profile`] measures a
/// series of plans, from full recomputation to plain candle, each saving a
/// little more than the one before; [`PeakPlan::for_peak`] then gives the
/// fastest of them whose step peaks at most a requested number of bytes.
///
/// The series saves **the last calls first**: a call's saved residuals are
/// alive from its forward until its backward, which comes sooner the later
/// the call (the head before the last block, the last block before the
/// first), so saving late in the model costs the peak least. Within a
/// call, statements are added one at a time, in the order budget plans
/// ([`Plan::budget`] at 25, 50, 75 and 100% of the range) first save them:
/// those that recompute the most time per byte first. That order comes
/// from measured times, so on a busy machine two profiles may order
/// statements of similar cost differently. Plain candle ends the series.
///
/// Only the candidates no faster one beats on peak are kept, so the peak
/// of the plan [`for_peak`](PeakPlan::for_peak) gives never falls when the
/// request grows (tested over requests from full recomputation's peak to
/// plain candle's), and is at most the request: it is the measured peak of
/// the same step, not a model of it.
///
/// `step` runs one training step (forward and backward) of the model
/// under the plan it is given and returns the step's peak: on the CPU from
/// a [`CountingAlloc`](crate::inspect::CountingAlloc), on CUDA from
/// [`device_memory_peak`](crate::inspect::device_memory_peak). The profile
/// runs it 4 + 2 x (2 + the open statements of every call of a step)
/// times. Its forwards and backwards must not change the weights (no
/// optimizer step), and the batch must have the shapes of the steps the
/// plan will run.
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
    /// Measures the series of plans with `step` (see [`PeakPlan`]).
    pub fn profile(mut step: impl FnMut(&Plan) -> Result<usize>) -> Result<Self> {
        // Each plan runs twice and the second step counts: the first warms
        // what a step allocates once (caches, maps).
        fn measure(step: &mut impl FnMut(&Plan) -> Result<usize>, plan: &Plan) -> Result<usize> {
            step(plan)?;
            step(plan)
        }
        // The order in which each region's statements are saved: by the
        // smallest budget whose solution saves them, then in block order.
        let mut order: HashMap<String, Vec<String>> = HashMap::new();
        for fraction in LEVELS {
            let plan = Plan::budget(fraction);
            step(&plan)?;
            for solution in plan.solutions() {
                let names = order.entry(solution.region).or_default();
                for p in solution.statements {
                    if p.policy == Policy::Save && !p.declared && !names.contains(&p.name) {
                        names.push(p.name);
                    }
                }
            }
        }
        let mut measured = Vec::new();
        let mut assigned: HashMap<Call, Vec<String>> = HashMap::new();
        let (plan, rule) = per_call(&assigned, "recompute all (by call)");
        let peak = measure(&mut step, &plan)?;
        let calls = rule.calls();
        measured.push(PeakCandidate { plan, peak });
        for call in calls.iter().rev() {
            for name in order.get(&call.0).into_iter().flatten() {
                assigned.entry(call.clone()).or_default().push(name.clone());
                let (plan, _) = per_call(&assigned, &label(&assigned, &calls));
                let peak = measure(&mut step, &plan)?;
                measured.push(PeakCandidate { plan, peak });
            }
        }
        let off = Plan::off();
        let peak = measure(&mut step, &off)?;
        measured.push(PeakCandidate { plan: off, peak });
        // From the fastest (the last) back: keep a candidate only if its
        // peak is below that of every faster one.
        let mut candidates: Vec<PeakCandidate> = Vec::new();
        for c in measured.into_iter().rev() {
            if candidates.last().is_none_or(|faster| c.peak < faster.peak) {
                candidates.push(c);
            }
        }
        candidates.reverse();
        Ok(PeakPlan { candidates })
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
