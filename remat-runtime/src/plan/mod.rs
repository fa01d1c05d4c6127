//! Which statements a region call saves, decided at run time.
//!
//! * this file: [`Plan`] and its constructors;
//! * `budget`: budget plans, their [`Solution`]s;
//! * `planner`: the exact solver behind a budget;
//! * `calls`: plans that decide call by call;
//! * `peak`: [`PeakPlan`], plans measured for the peak of a step;
//! * `compiled`: the statement names of every `remat!` block of the program.

mod budget;
mod calls;
pub(crate) mod compiled;
pub(crate) use calls::{in_replay, replaying};
mod peak;
mod planner;

pub use budget::{PlannedStatement, Solution};
pub use peak::{PeakCandidate, PeakPlan};
pub(crate) use planner::{items, Item};

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex};

use crate::ambient::scoped;
use crate::Policy;
use budget::{Budget, Target};

thread_local! {
    /// The plans of the [`Plan::scope`]s running on this thread; the last is
    /// the innermost.
    static PLAN_SCOPES: RefCell<Vec<Plan>> = const { RefCell::new(Vec::new()) };
}

/// What a [`Plan`] sees of a statement when it decides its policy.
///
/// ```
/// use remat_runtime::{Plan, Policy, StatementInfo};
/// let open = StatementInfo { region: "block", name: "act", declared: None };
/// assert_eq!(Plan::save_only(["act"]).policy(&open), Policy::Save);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatementInfo<'a> {
    /// The region's name.
    pub region: &'a str,
    /// The statement's name.
    pub name: &'a str,
    /// The policy written in the code (`#[save]`, `#[recompute]`,
    /// [`Ctx::save`](crate::Ctx::save), ...), or `None` for a statement left
    /// to the plan (an unannotated `remat!` statement, [`Ctx::open`](crate::Ctx::open)).
    pub declared: Option<Policy>,
}

type PolicyFn = dyn Fn(&StatementInfo) -> Policy + Send + Sync;

/// How a plan decides.
#[derive(Clone)]
enum Rule {
    Declared,
    Off,
    All(Policy),
    /// Open statements: saved when named in `save`, offloaded when named in
    /// `offload`, recomputed otherwise.
    Names(Arc<Names>),
    Custom(Arc<PolicyFn>),
    Budget(Arc<Budget>),
    /// Each call of a region by its own set (a [`PeakPlan`]'s candidates).
    PerCall(Arc<calls::PerCall>),
}

/// The names of a [`Plan::save_only`] or [`Plan::save_and_offload_only`]
/// plan, and the names of the statements it has decided so far (to find
/// names no statement has).
struct Names {
    save: HashSet<String>,
    offload: HashSet<String>,
    seen: Mutex<HashSet<String>>,
}

impl Names {
    fn new(save: HashSet<String>, offload: HashSet<String>) -> Self {
        Names {
            save,
            offload,
            seen: Mutex::new(HashSet::new()),
        }
    }
}

/// Decides, for every statement of the regions it governs, whether it is
/// saved or recomputed: checkpointing configured at run time, without
/// touching the block's code. The counterpart of JAX's `checkpoint`
/// policies and PyTorch's selective-checkpoint `policy_fn`, keyed by the
/// statements' stable names instead of by operator.
///
/// A region call takes its plan from [`Region::plan`](crate::Region::plan),
/// or else from the innermost [`Plan::scope`] around the call, or else
/// [`Plan::declared`]. The plan a forward used is kept on the tape: the replay
/// (and every region nested in the block) follows the same decisions, even
/// though the backward runs outside the scope.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::{MemoryReport, Plan, Policy, Region};
///
/// let x = Var::ones((4, 8), DType::F32, &Device::Cpu)?;
/// let block = |ctx: &mut remat_runtime::Ctx, ins: &[candle_core::Tensor]| {
///     let e = ctx.open("e", &[&ins[0]], |t| t[0].exp())?;
///     ctx.open("s", &[&e], |t| t[0].sum_all())
/// };
/// // By default, statements left to the plan are recomputed: nothing is held.
/// let y = Region::new("r").run(&[x.as_tensor()], block)?;
/// assert_eq!(MemoryReport::capture().entries[1].bytes, 0);
/// drop(y);
/// // Saving `e` by name, without changing the block:
/// let y = Plan::save_only(["e"]).scope(|| Region::new("r").run(&[x.as_tensor()], block))?;
/// let report = MemoryReport::capture();
/// assert_eq!(report.entries[1].policy, Some(Policy::Save));
/// assert_eq!(report.entries[1].bytes, 2 * 32 * 4);
/// let grads = y.backward()?; // the replay follows the same plan
/// assert!(grads.get(&x).is_some());
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
#[derive(Clone)]
pub struct Plan {
    rule: Rule,
    label: Arc<str>,
}

impl Default for Plan {
    fn default() -> Self {
        Plan::declared()
    }
}

impl fmt::Debug for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Plan({})", self.label)
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label)
    }
}

impl Plan {
    fn new(rule: Rule, label: impl Into<Arc<str>>) -> Self {
        Plan {
            rule,
            label: label.into(),
        }
    }

    /// The code decides: annotated statements follow their annotation,
    /// statements left to the plan are recomputed. The default.
    ///
    /// ```
    /// use remat_runtime::{Plan, Policy, StatementInfo};
    /// let s = StatementInfo { region: "b", name: "h", declared: None };
    /// assert_eq!(Plan::declared().policy(&s), Policy::Recompute);
    /// ```
    pub fn declared() -> Self {
        // One shared value: region calls without a plan allocate nothing.
        static DECLARED: LazyLock<Plan> = LazyLock::new(|| Plan::new(Rule::Declared, "declared"));
        DECLARED.clone()
    }

    /// No checkpointing: regions run as plain candle code (no tape, no
    /// replay), as [`Region::enabled`](crate::Region::enabled)`(false)` does.
    ///
    /// ```
    /// assert!(remat_runtime::Plan::off().is_off());
    /// ```
    pub fn off() -> Self {
        Plan::new(Rule::Off, "off")
    }

    /// Every statement recomputed, annotations included: full activation
    /// checkpointing, like wrapping the block in PyTorch's `checkpoint`.
    ///
    /// ```
    /// use remat_runtime::{Plan, Policy, StatementInfo};
    /// let s = StatementInfo { region: "b", name: "h", declared: Some(Policy::Save) };
    /// assert_eq!(Plan::recompute_all().policy(&s), Policy::Recompute);
    /// ```
    pub fn recompute_all() -> Self {
        Plan::new(Rule::All(Policy::Recompute), "recompute all")
    }

    /// Every statement saved, annotations included: nothing is recomputed
    /// (the block still goes through the tape).
    ///
    /// ```
    /// use remat_runtime::{Plan, Policy, StatementInfo};
    /// let s = StatementInfo { region: "b", name: "h", declared: Some(Policy::Recompute) };
    /// assert_eq!(Plan::save_all().policy(&s), Policy::Save);
    /// ```
    pub fn save_all() -> Self {
        Plan::new(Rule::All(Policy::Save), "save all")
    }

    /// Statements left to the plan are saved when their name is listed and
    /// recomputed otherwise; annotated statements follow their annotation.
    /// JAX's `save_only_these_names`, with the names checked unique at
    /// compile time by `remat!`.
    ///
    /// ```
    /// use remat_runtime::{Plan, Policy, StatementInfo};
    /// let plan = Plan::save_only(["qkv", "att"]);
    /// let s = |name, declared| StatementInfo { region: "b", name, declared };
    /// assert_eq!(plan.policy(&s("qkv", None)), Policy::Save);
    /// assert_eq!(plan.policy(&s("gelu", None)), Policy::Recompute);
    /// assert_eq!(plan.policy(&s("att", Some(Policy::Recompute))), Policy::Recompute);
    /// ```
    pub fn save_only<I, S>(names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let names: Vec<String> = names.into_iter().map(Into::into).collect();
        let label = format!("save only {}", names.join(", "));
        let names = Names::new(names.into_iter().collect(), HashSet::new());
        Plan::new(Rule::Names(Arc::new(names)), label)
    }

    /// Statements left to the plan are saved when their name is in `save`,
    /// offloaded to host memory when it is in `offload` (see
    /// [`crate::offload`]) and recomputed otherwise; annotated statements
    /// follow their annotation. JAX's `save_and_offload_only_these_names`.
    /// A name in both lists is saved.
    ///
    /// ```
    /// use remat_runtime::{Plan, Policy, StatementInfo};
    /// let plan = Plan::save_and_offload_only(["qkv"], ["fc"]);
    /// let s = |name| StatementInfo { region: "b", name, declared: None };
    /// assert_eq!(plan.policy(&s("qkv")), Policy::Save);
    /// assert_eq!(plan.policy(&s("fc")), Policy::Offload);
    /// assert_eq!(plan.policy(&s("gelu")), Policy::Recompute);
    /// assert_eq!(plan.to_string(), "save qkv; offload fc");
    /// let offload_only = Plan::save_and_offload_only(Vec::<&str>::new(), ["fc", "act"]);
    /// assert_eq!(offload_only.to_string(), "offload fc, act");
    /// ```
    pub fn save_and_offload_only<I, J, S, T>(save: I, offload: J) -> Self
    where
        I: IntoIterator<Item = S>,
        J: IntoIterator<Item = T>,
        S: Into<String>,
        T: Into<String>,
    {
        let save: Vec<String> = save.into_iter().map(Into::into).collect();
        let offload: Vec<String> = offload.into_iter().map(Into::into).collect();
        let label = [("save", &save), ("offload", &offload)]
            .iter()
            .filter(|(_, names)| !names.is_empty())
            .map(|(what, names)| format!("{what} {}", names.join(", ")))
            .collect::<Vec<_>>()
            .join("; ");
        let names = Names::new(save.into_iter().collect(), offload.into_iter().collect());
        Plan::new(Rule::Names(Arc::new(names)), label)
    }

    /// A memory budget between saving nothing (`0.0`: full recomputation of
    /// what the code leaves open) and saving everything (`1.0`), like
    /// PyTorch's `activation_memory_budget` (which exists only under
    /// `torch.compile`). For each region, the planner saves the statements
    /// that minimise the recompute time within the budget, exactly (see
    /// [`Solution`]); statements the code annotates keep their annotation.
    ///
    /// The first call of each region under the plan measures the costs: it
    /// saves every open statement and times each one. Later calls follow the
    /// solution, which [`Plan::solutions`] shows. Use one `Plan` value for a
    /// whole training run: the solutions live in it.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// use remat_runtime::{Plan, Policy, Region};
    /// let x = Var::ones((64, 64), DType::F32, &Device::Cpu)?;
    /// let plan = Plan::budget(0.5);
    /// let block = |ctx: &mut remat_runtime::Ctx, ins: &[candle_core::Tensor]| {
    ///     let a = ctx.open("a", &[&ins[0]], |t| t[0].exp())?;
    ///     let b = ctx.open("b", &[&a], |t| t[0].matmul(&t[0]))?;
    ///     ctx.open("c", &[&b], |t| t[0].sum_all())
    /// };
    /// for _ in 0..2 {
    ///     let y = Region::new("r").plan(plan.clone()).run(&[x.as_tensor()], block)?;
    ///     y.backward()?;
    /// }
    /// let solution = &plan.solutions()[0];
    /// assert!(solution.bytes <= solution.budget);
    /// println!("{solution}");
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn budget(fraction: f64) -> Self {
        Plan::with_budget(Target::Fraction(fraction), format!("budget {fraction}"))
    }

    /// A memory budget in bytes per region call; see [`Plan::budget`].
    ///
    /// ```
    /// assert_eq!(remat_runtime::Plan::budget_bytes(1 << 20).to_string(), "budget 1048576 bytes");
    /// ```
    pub fn budget_bytes(bytes: usize) -> Self {
        Plan::with_budget(Target::Bytes(bytes), format!("budget {bytes} bytes"))
    }

    fn with_budget(target: Target, label: String) -> Self {
        Plan::new(Rule::Budget(Arc::new(Budget::new(target))), label)
    }

    /// A plan from a function of the statement, like PyTorch's `policy_fn`.
    /// The function sees the declared policy and decides whether to honour
    /// it. It must give the same answer for the same statement every time
    /// it is asked within one forward.
    ///
    /// ```
    /// use remat_runtime::{Plan, Policy, StatementInfo};
    /// let plan = Plan::from_fn("matmuls", |s| {
    ///     s.declared.unwrap_or(if s.name.ends_with("proj") { Policy::Save } else { Policy::Recompute })
    /// });
    /// let s = StatementInfo { region: "b", name: "c_proj", declared: None };
    /// assert_eq!(plan.policy(&s), Policy::Save);
    /// assert_eq!(plan.to_string(), "matmuls");
    /// ```
    pub fn from_fn(
        label: &str,
        f: impl Fn(&StatementInfo) -> Policy + Send + Sync + 'static,
    ) -> Self {
        Plan::new(Rule::Custom(Arc::new(f)), label)
    }

    /// The policy this plan gives the statement.
    ///
    /// ```
    /// use remat_runtime::{Plan, Policy, StatementInfo};
    /// let s = StatementInfo { region: "b", name: "h", declared: Some(Policy::Save) };
    /// assert_eq!(Plan::declared().policy(&s), Policy::Save);
    /// ```
    pub fn policy(&self, s: &StatementInfo) -> Policy {
        match &self.rule {
            Rule::Declared | Rule::Off => s.declared.unwrap_or_default(),
            Rule::All(p) => *p,
            Rule::Names(names) => {
                let mut seen = crate::lock(&names.seen);
                if !seen.contains(s.name) {
                    seen.insert(s.name.to_string());
                }
                s.declared.unwrap_or(if names.save.contains(s.name) {
                    Policy::Save
                } else if names.offload.contains(s.name) {
                    Policy::Offload
                } else {
                    Policy::Recompute
                })
            }
            Rule::Custom(f) => f(s),
            Rule::Budget(b) => b.policy(s),
            Rule::PerCall(c) => c.policy(s),
        }
    }

    /// The names this plan lists that no statement has (sorted): neither a
    /// statement the plan decided so far nor one of a `remat!` block
    /// compiled into the program (a block that has not run yet, such as a
    /// layer enabled later, still has its names). With them, every name a
    /// plan may use (sorted). `None` when every name was found, or the plan
    /// lists no names.
    ///
    /// ```
    /// use remat_runtime::{Plan, StatementInfo};
    /// let plan = Plan::save_only(["qkv", "qvk"]);
    /// for name in ["qkv", "fc"] {
    ///     plan.policy(&StatementInfo { region: "b", name, declared: None });
    /// }
    /// let (unknown, known) = plan.unknown_names().unwrap();
    /// assert_eq!((unknown, known), (vec!["qvk".to_string()], vec!["fc".into(), "qkv".into()]));
    /// ```
    pub fn unknown_names(&self) -> Option<(Vec<String>, Vec<String>)> {
        let Rule::Names(names) = &self.rule else {
            return None;
        };
        let seen = crate::lock(&names.seen);
        let mut unknown: Vec<String> = names
            .save
            .iter()
            .chain(&names.offload)
            .filter(|n| !seen.contains(*n) && !compiled::has(n))
            .cloned()
            .collect();
        if unknown.is_empty() {
            return None;
        }
        unknown.sort();
        unknown.dedup();
        // Every name a plan may use, `(q, k, v)` and `(statement 3)`
        // included; not `(return)`, a block's tail, which no plan can name.
        let mut known: Vec<String> = seen
            .iter()
            .cloned()
            .chain(compiled::names().map(str::to_string))
            .filter(|n| n != "(return)")
            .collect();
        known.sort();
        known.dedup();
        Some((unknown, known))
    }

    /// Whether this is a budget plan that has not planned `region` yet.
    pub(crate) fn wants_profile(&self, region: &str) -> bool {
        match &self.rule {
            Rule::Budget(b) => b.wants_profile(region),
            _ => false,
        }
    }

    /// Plans `region` from the costs measured on its first call (budget
    /// plans only).
    pub(crate) fn plan_region(&self, region: &str, items: Vec<Item>) {
        if let Rule::Budget(b) = &self.rule {
            b.plan_region(region, items);
        }
    }

    /// What a budget plan decided so far, one [`Solution`] per region; empty
    /// for other plans.
    ///
    /// ```
    /// assert!(remat_runtime::Plan::budget(0.5).solutions().is_empty());
    /// ```
    pub fn solutions(&self) -> Vec<Solution> {
        match &self.rule {
            Rule::Budget(b) => b.solutions(),
            _ => Vec::new(),
        }
    }

    /// Whether regions under this plan run as plain candle code.
    ///
    /// ```
    /// assert!(!remat_runtime::Plan::declared().is_off());
    /// ```
    pub fn is_off(&self) -> bool {
        matches!(self.rule, Rule::Off)
    }

    /// Runs `f` with this plan governing every region call made in it on this
    /// thread (unless the region has its own [`Region::plan`](crate::Region::plan)).
    /// Scopes nest; the innermost wins.
    ///
    /// ```
    /// use remat_runtime::Plan;
    /// let label = Plan::recompute_all().scope(|| Plan::current().to_string());
    /// assert_eq!(label, "recompute all");
    /// assert_eq!(Plan::current().to_string(), "declared");
    /// ```
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        if let Rule::PerCall(c) = &self.rule {
            // A plan that decides call by call counts calls per scope: a
            // step.
            c.reset();
        }
        self.inherit(f)
    }

    /// Runs `f` under this plan, as the block of a region call runs under
    /// its region's plan: a scope that is not a new step.
    pub(crate) fn inherit<R>(&self, f: impl FnOnce() -> R) -> R {
        scoped(
            || PLAN_SCOPES.with(|s| s.borrow_mut().push(self.clone())),
            || {
                PLAN_SCOPES.with(|s| {
                    s.borrow_mut().pop();
                })
            },
            f,
        )
    }

    /// The plan of the innermost [`Plan::scope`] on this thread, or
    /// [`Plan::declared`].
    ///
    /// ```
    /// assert_eq!(remat_runtime::Plan::current().to_string(), "declared");
    /// ```
    pub fn current() -> Plan {
        PLAN_SCOPES.with(|s| s.borrow().last().cloned().unwrap_or_default())
    }
}
