//! Plans for the peak of a training step: measured candidates from full
//! recomputation to plain candle, and the fastest of them under a peak.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use super::calls::{CallId, PerCall};
use super::{Plan, Rule};
use crate::replay::timed::timed;
use crate::{RematError, Result};

/// One plan the profile measured, with the peak of its step.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PeakCandidate {
    /// The plan.
    pub plan: Plan,
    /// The peak its step reached, in the unit `step` measured it in.
    pub peak: usize,
    /// The replay time of the open statements it recomputes, each as
    /// measured under full recomputation (0 for plain candle): the model
    /// the profile ranks plans by.
    pub recompute_seconds: f64,
}

/// Plans for the peak of a training step: [`PeakPlan::profile`] measures
/// the peaks of plans from full recomputation to plain candle, deciding
/// call by call (the k-th call of a region saves its own statements);
/// [`PeakPlan::for_peak`] then gives the fastest of them whose step peaks
/// at most a requested number of bytes.
///
/// The search is greedy, from both ends. From full recomputation, each
/// round measures the peak of the plans that save one more statement than
/// the plan so far, and keeps the statement that saves the most recompute
/// time per byte it adds to the peak (a statement that adds nothing first;
/// often those of the last calls: a call's saved residuals live from its
/// forward to its backward, which comes sooner the later the call), until
/// the plan peaks as high as plain candle. From every open statement
/// saved, each round recomputes the statement whose recompute time buys
/// the most bytes off the peak, until the plan peaks as low as full
/// recomputation. Every plan measured is a candidate, so the profile holds
/// many plans between the two ends, near each end as densely as in the
/// middle. Past 40 open statements in a step, only the first search runs,
/// and lazily: its first round measures every statement, later rounds the
/// most promising first by what each added when last measured, stopping
/// once no earlier measurement says another could do better (fewer plans
/// between the ends). Times are a model: the replay time of the open
/// statements a plan recomputes, each statement's least over two
/// full-recompute steps and over its region's calls (its forward time if
/// it was not replayed); a replay can be cheaper than the forward (see
/// "unread outputs" in `docs/semantics.md`). On a busy machine two
/// profiles may order statements of similar cost differently; a region
/// called inside another region's statement is counted twice, in its own
/// statements and in the statement calling it. Peaks are measured.
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
/// open statements over all the calls of a step, the profile runs it at
/// most `6 + n (n + 1)` times, plus once for each plan kept (on the bench
/// GPT, 16 statements: 314 steps); past 40 statements, `n` times in
/// the first round and at least 3 times in each later one. Its forwards
/// and backwards must not change the weights (no optimizer step), and the
/// batch must have the shapes of the steps the plan will run.
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
        // Plain candle first: it warms what a step allocates once (caches,
        // maps, threads) before anything is timed, and no plan that peaks
        // as high as it is worth measuring further.
        let off = Plan::off();
        step(&off)?;
        let plain = step(&off)?;
        // Which statements each region leaves open, with their forward
        // times (what recomputing one costs if its replay is not timed):
        // a budget plan's first call measures them (and saves them all).
        let budget = Plan::budget(1.0);
        step(&budget)?;
        let mut seconds: HashMap<String, Vec<(String, f64)>> = HashMap::new();
        for solution in budget.solutions() {
            let open = solution.statements.into_iter().filter(|p| !p.declared);
            let open = open.map(|p| (p.name, p.seconds.max(0.0)));
            seconds.insert(solution.region, open.collect());
        }
        // Full recomputation, call by call. Every plan below is measured
        // by its first step, which also counts the plan's tally of calls:
        // so is this one, so that their peaks compare.
        let (plan, rule) = per_call(&HashMap::new(), "recompute all (by call)");
        let (full, mut replayed) = timed(|| step(&plan));
        let full = full?;
        let calls = rule.calls();
        // What recomputing a statement costs is its replay: cheaper than
        // its forward when the replay leaves its output uncomputed. The
        // least of two steps' replays (and of the region's calls).
        let (again, second) = timed(|| step(&plan));
        again?;
        for (key, s) in second {
            let least = replayed.entry(key).or_insert(s);
            *least = least.min(s);
        }
        let open: Vec<Open> = calls
            .iter()
            .flat_map(|call| {
                let names = seconds.get(&call.0).into_iter().flatten();
                let replayed = &replayed;
                names.map(move |(name, forward)| Open {
                    call: call.clone(),
                    name: name.clone(),
                    seconds: replayed
                        .get(&(call.0.clone(), name.clone()))
                        .copied()
                        .unwrap_or(*forward),
                })
            })
            .collect();
        let total: f64 = open.iter().map(|o| o.seconds).sum();
        let lazy = open.len() > EXHAUSTIVE;
        let mut search = Search {
            step: &mut step,
            open,
            calls,
            total,
            measured: vec![
                PeakCandidate {
                    plan,
                    peak: full,
                    recompute_seconds: total,
                },
                PeakCandidate {
                    plan: off,
                    peak: plain,
                    recompute_seconds: 0.0,
                },
            ],
        };
        search.saving_up(full, plain, lazy)?;
        if !lazy {
            search.recomputing_down(full)?;
        }
        let measured = search.measured;
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

/// Up to this many open statements in a step, the greedy search runs from
/// both ends, and every round measures every statement left (at most 1646
/// steps in all).
const EXHAUSTIVE: usize = 40;
/// Past [`EXHAUSTIVE`], the statements each round measures at least.
const PER_ROUND: usize = 3;

/// The greedy searches of a profile: the open statements of a step, and
/// every plan measured so far.
struct Search<'a, S> {
    step: &'a mut S,
    open: Vec<Open>,
    calls: Vec<CallId>,
    /// The recompute time of full recomputation.
    total: f64,
    measured: Vec<PeakCandidate>,
}

impl<S: FnMut(&Plan) -> Result<usize>> Search<'_, S> {
    /// Measures the plan saving `open[i]` for each `i` in `saved`; it
    /// becomes a candidate.
    fn measure(&mut self, saved: &[usize]) -> Result<usize> {
        let (plan, time) = plan_of(&self.open, saved, &self.calls, self.total);
        let peak = (self.step)(&plan)?;
        self.measured.push(PeakCandidate {
            plan,
            peak,
            recompute_seconds: time,
        });
        Ok(peak)
    }

    /// From full recomputation (peak `current`): each round adds the
    /// statement that saves the most time per byte it adds to the peak,
    /// until the plan peaks as high as plain candle (`plain`). Every round
    /// measures every statement left; when `lazy`, the first does, and
    /// later ones the most promising by what they added when last
    /// measured, at least `PER_ROUND` of them and then on while one
    /// measured before could still beat the best of the round (what a
    /// statement adds rarely shrinks as more is saved).
    fn saving_up(&mut self, mut current: usize, plain: usize, lazy: bool) -> Result<()> {
        let seconds: Vec<f64> = self.open.iter().map(|o| o.seconds).collect();
        let n = seconds.len();
        let mut saved: Vec<usize> = Vec::new();
        let mut added: Vec<Option<i64>> = vec![None; n];
        while saved.len() < n && current < plain {
            let mut order: Vec<usize> = (0..n).filter(|i| !saved.contains(i)).collect();
            order.sort_by(|&a, &b| match (added[a], added[b]) {
                (None, None) => Ordering::Equal,
                (None, Some(_)) => Ordering::Less,
                (Some(_), None) => Ordering::Greater,
                (Some(x), Some(y)) => rank(x, seconds[a], y, seconds[b]),
            });
            let mut best: Option<(usize, i64, usize)> = None;
            for (k, &i) in order.iter().enumerate() {
                if let (Some((b, by, _)), Some(was)) = (best, added[i]) {
                    let hopeless = rank(was, seconds[i], by, seconds[b]).is_ge();
                    if lazy && k >= PER_ROUND && hopeless {
                        break;
                    }
                }
                let with: Vec<usize> = saved.iter().copied().chain([i]).collect();
                let peak = self.measure(&with)?;
                let by = peak as i64 - current as i64;
                added[i] = Some(by);
                if best.is_none_or(|(b, bb, _)| rank(by, seconds[i], bb, seconds[b]).is_lt()) {
                    best = Some((i, by, peak));
                }
            }
            let Some((i, _, peak)) = best else { break };
            saved.push(i);
            current = peak;
        }
        Ok(())
    }

    /// From every open statement saved: each round recomputes the
    /// statement whose recompute time buys the most bytes off the peak,
    /// until the plan peaks as low as full recomputation (`full`), so that
    /// plans near plain candle's peak are measured as densely as those
    /// near full recomputation's.
    fn recomputing_down(&mut self, full: usize) -> Result<()> {
        let seconds: Vec<f64> = self.open.iter().map(|o| o.seconds).collect();
        let mut kept: Vec<usize> = (0..seconds.len()).collect();
        let mut current = self.measure(&kept)?;
        while !kept.is_empty() && current > full {
            let mut best: Option<(usize, i64, usize)> = None;
            for i in kept.clone() {
                let without: Vec<usize> = kept.iter().copied().filter(|&k| k != i).collect();
                let peak = self.measure(&without)?;
                let by = current as i64 - peak as i64;
                if best
                    .is_none_or(|(b, bb, _)| rank_recompute(by, seconds[i], bb, seconds[b]).is_lt())
                {
                    best = Some((i, by, peak));
                }
            }
            let Some((i, _, peak)) = best else { break };
            kept.retain(|&k| k != i);
            current = peak;
        }
        Ok(())
    }
}

/// Which of two statements to save first, given the bytes each added to
/// the peak (`a`, `b`) and the recompute time each saves: first those
/// that add nothing, the most time first; then the fewest bytes per
/// second saved.
fn rank(a: i64, a_seconds: f64, b: i64, b_seconds: f64) -> Ordering {
    match (a <= 0, b <= 0) {
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        (true, true) => b_seconds.total_cmp(&a_seconds).then(a.cmp(&b)),
        (false, false) => per_second(a, a_seconds).total_cmp(&per_second(b, b_seconds)),
    }
}

/// Which of two saved statements to recompute first, given the bytes
/// recomputing each took off the peak (`a`, `b`) and the recompute time
/// each adds: first those that lower the peak, the most bytes per second
/// first; then those that change nothing, the cheapest first; then the
/// fewest bytes added.
fn rank_recompute(a: i64, a_seconds: f64, b: i64, b_seconds: f64) -> Ordering {
    let class = |bytes: i64| match bytes.cmp(&0) {
        Ordering::Greater => 0,
        Ordering::Equal => 1,
        Ordering::Less => 2,
    };
    class(a).cmp(&class(b)).then_with(|| match class(a) {
        0 => per_second(b, b_seconds).total_cmp(&per_second(a, a_seconds)),
        1 => a_seconds.total_cmp(&b_seconds),
        _ => b.cmp(&a).then(a_seconds.total_cmp(&b_seconds)),
    })
}

/// Bytes of peak per second of recompute time.
fn per_second(bytes: i64, seconds: f64) -> f64 {
    bytes as f64 / seconds.max(1e-12)
}

/// An open statement of one call of a step.
struct Open {
    call: CallId,
    name: String,
    /// What recomputing it costs: its replay time under full
    /// recomputation (its forward time if it was not replayed).
    seconds: f64,
}

/// The plan saving `open[i]` for each `i` in `saved`, and the time it
/// spends recomputing the others.
fn plan_of(open: &[Open], saved: &[usize], calls: &[CallId], total: f64) -> (Plan, f64) {
    let mut assigned: HashMap<CallId, Vec<String>> = HashMap::new();
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

/// The candidates no other has both a peak as low and a recompute time
/// as short (plain candle counts as the fastest of all), from the
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
fn per_call(assigned: &HashMap<CallId, Vec<String>>, label: &str) -> (Plan, Arc<PerCall>) {
    let save = assigned
        .iter()
        .map(|(call, names)| (call.clone(), names.iter().cloned().collect::<HashSet<_>>()))
        .collect();
    let rule = Arc::new(PerCall::new(save));
    (Plan::new(Rule::PerCall(rule.clone()), label), rule)
}

/// `peak plan: block#2 saves fc, block#3 saves qkv fc mlp`: what each call
/// saves, in call order.
fn label(assigned: &HashMap<CallId, Vec<String>>, calls: &[CallId]) -> String {
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
