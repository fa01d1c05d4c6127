//! Budget plans: the statements to save so that a call holds at most a
//! byte budget, solved per region on its first call.

use std::fmt;
use std::sync::Mutex;

use super::planner::{self, Item};
use super::StatementInfo;
use crate::{lock, Policy};

/// How much a budget plan may hold per region call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Target {
    /// Between saving nothing (0) and everything (1).
    Fraction(f64),
    /// At most this many bytes.
    Bytes(usize),
}

pub(super) struct Budget {
    target: Target,
    /// Solutions by region name.
    solved: Mutex<Vec<Solution>>,
}

impl Budget {
    pub fn new(target: Target) -> Self {
        Budget {
            target,
            solved: Mutex::new(Vec::new()),
        }
    }

    /// The policy of `s`: the solution's, or, on the measuring call, save
    /// every open statement.
    pub fn policy(&self, s: &StatementInfo) -> Policy {
        let solved = lock(&self.solved);
        match solved.iter().find(|sol| sol.region == s.region) {
            Some(sol) => sol
                .statements
                .iter()
                .find(|p| p.name == s.name)
                .map_or(s.declared.unwrap_or_default(), |p| p.policy),
            None => s.declared.unwrap_or(Policy::Save),
        }
    }

    /// Whether `region` has not been planned yet.
    pub fn wants_profile(&self, region: &str) -> bool {
        !lock(&self.solved).iter().any(|s| s.region == region)
    }

    /// Plans `region` from the costs measured on its first call.
    pub fn plan_region(&self, region: &str, items: Vec<Item>) {
        let forced_only = planner::forced_saves(&items);
        let open_saved: Vec<bool> = items.iter().map(|i| i.may_save()).collect();
        // Saving more can hold less: a saved statement chained to the one
        // before it needs no leaf copy of what that one gave (a plain copy
        // of a parameter, saved at no cost, spares its reader the copy).
        let min_bytes = planner::bytes(&items, &planner::least(&items));
        let max_bytes = planner::bytes(&items, &open_saved).max(min_bytes);
        let budget = match self.target {
            Target::Bytes(n) => n,
            Target::Fraction(f) => {
                min_bytes + ((max_bytes - min_bytes) as f64 * f.clamp(0.0, 1.0)).round() as usize
            }
        };
        let save = planner::solve(&items, budget);
        let solution = Solution {
            region: region.to_string(),
            budget,
            bytes: planner::bytes(&items, &save),
            min_bytes,
            max_bytes,
            recompute_seconds: planner::seconds(&items, &save),
            max_recompute_seconds: planner::seconds(&items, &forced_only),
            statements: items
                .iter()
                .zip(&save)
                .map(|(i, &s)| PlannedStatement {
                    name: i.name.clone(),
                    policy: match (i.forced, s) {
                        (Some(Policy::Offload), _) => Policy::Offload,
                        (_, true) => Policy::Save,
                        (_, false) => Policy::Recompute,
                    },
                    declared: i.forced.is_some(),
                    seconds: i.seconds,
                    bytes: i.own,
                })
                .collect(),
        };
        let mut solved = lock(&self.solved);
        if !solved.iter().any(|s| s.region == region) {
            solved.push(solution);
        }
    }

    pub fn solutions(&self) -> Vec<Solution> {
        lock(&self.solved).clone()
    }
}

/// What a budget plan decided for one region, statement by statement.
///
/// Costs come from the region's first call under the plan, which runs with
/// every open statement saved to measure them: `bytes` as the memory report
/// counts them, `seconds` the statement's wall time in that forward.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::{Plan, Policy, Region};
/// let x = Var::ones((8, 8), DType::F32, &Device::Cpu)?;
/// let plan = Plan::budget(1.0);
/// for _ in 0..2 {
///     let y = Region::new("r").plan(plan.clone()).run(&[x.as_tensor()], |ctx, ins| {
///         let e = ctx.open("e", &[&ins[0]], |t| t[0].exp())?;
///         ctx.open("s", &[&e], |t| t[0].sum_all())
///     })?;
///     y.backward()?;
/// }
/// let solution = &plan.solutions()[0];
/// assert_eq!(solution.region, "r");
/// // A full budget saves every open statement: nothing is recomputed.
/// assert!(solution.statements.iter().all(|s| s.policy == Policy::Save));
/// assert_eq!(solution.bytes, solution.max_bytes);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Solution {
    /// The region's name.
    pub region: String,
    /// The budget in bytes.
    pub budget: usize,
    /// Bytes held by the plan chosen (cost model).
    pub bytes: usize,
    /// The least bytes a plan can hold: the statements the code saves,
    /// with the open ones whose saving holds less (saving a statement
    /// chained to a saved one spares the leaf copy of what it gave).
    pub min_bytes: usize,
    /// Bytes when every statement the code leaves open is saved (at least
    /// `min_bytes`).
    pub max_bytes: usize,
    /// Recompute time of the plan chosen.
    pub recompute_seconds: f64,
    /// Recompute time when nothing open is saved.
    pub max_recompute_seconds: f64,
    /// Per statement, in order.
    pub statements: Vec<PlannedStatement>,
}

/// One statement of a [`Solution`].
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::{Plan, Policy, Region};
/// let x = Var::ones(8, DType::F32, &Device::Cpu)?;
/// let plan = Plan::budget(0.0);
/// Region::new("r").plan(plan.clone()).run(&[x.as_tensor()], |ctx, ins| {
///     ctx.open("e", &[&ins[0]], |t| t[0].exp()?.sum_all())
/// })?;
/// let e = &plan.solutions()[0].statements[0];
/// // A zero budget recomputes every open statement.
/// assert_eq!((e.name.as_str(), e.policy, e.declared), ("e", Policy::Recompute, false));
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct PlannedStatement {
    /// The statement's name.
    pub name: String,
    /// The policy chosen.
    pub policy: Policy,
    /// Whether the code fixed it (the planner never changes those).
    pub declared: bool,
    /// Its measured forward time: what recomputing it costs.
    pub seconds: f64,
    /// Bytes of its own saved graph (leaf copies of its inputs not included).
    pub bytes: usize,
}

impl fmt::Display for Solution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "plan for `{}`: {} of {} bytes budgeted (range {}..{}); recompute {:.3} ms of {:.3} ms",
            self.region,
            self.bytes,
            self.budget,
            self.min_bytes,
            self.max_bytes,
            self.recompute_seconds * 1e3,
            self.max_recompute_seconds * 1e3
        )?;
        writeln!(
            f,
            "  {:<20} {:<10} {:>12} {:>10}",
            "statement", "policy", "bytes", "ms"
        )?;
        for s in &self.statements {
            let policy = format!("{}{}", s.policy, if s.declared { "*" } else { "" });
            writeln!(
                f,
                "  {:<20} {:<10} {:>12} {:>10.3}",
                s.name,
                policy,
                s.bytes,
                s.seconds * 1e3
            )?;
        }
        write!(f, "  (* fixed in the code)")
    }
}
