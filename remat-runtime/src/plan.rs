//! Which statements a region call saves, decided at run time.

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use crate::Policy;

/// What a [`Plan`] sees of a statement when it decides its policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatementInfo<'a> {
    /// The region's name.
    pub region: &'a str,
    /// The statement's name.
    pub name: &'a str,
    /// The policy written in the code (`#[save]`, `#[recompute]`,
    /// [`Ctx::save`](crate::Ctx::save), ...), or `None` for a statement left
    /// to the plan (an unannotated `remat!` statement, [`Ctx::auto`](crate::Ctx::auto)).
    pub declared: Option<Policy>,
}

type PolicyFn = dyn Fn(&StatementInfo) -> Policy + Send + Sync;

#[derive(Clone)]
enum Kind {
    Declared,
    Off,
    All(Policy),
    SaveOnly(Arc<HashSet<String>>),
    Custom(Arc<PolicyFn>),
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
///     let e = ctx.auto("e", &[&ins[0]], |t| Ok(t[0].exp()?))?;
///     ctx.auto("s", &[&e], |t| Ok(t[0].sum_all()?))
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
    kind: Kind,
    label: Arc<str>,
}

thread_local! {
    static SCOPES: RefCell<Vec<Plan>> = const { RefCell::new(Vec::new()) };
}

/// Pops the scope pushed by [`Plan::scope`], also when the closure panics.
struct ScopeGuard;

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        SCOPES.with(|s| s.borrow_mut().pop());
    }
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
    fn new(kind: Kind, label: impl Into<Arc<str>>) -> Self {
        Plan {
            kind,
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
        Plan::new(Kind::Declared, "declared")
    }

    /// No checkpointing: regions run as plain candle code (no tape, no
    /// replay), as [`Region::enabled`](crate::Region::enabled)`(false)` does.
    ///
    /// ```
    /// assert!(remat_runtime::Plan::off().is_off());
    /// ```
    pub fn off() -> Self {
        Plan::new(Kind::Off, "off")
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
        Plan::new(Kind::All(Policy::Recompute), "recompute all")
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
        Plan::new(Kind::All(Policy::Save), "save all")
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
        Plan::new(Kind::SaveOnly(Arc::new(names.into_iter().collect())), label)
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
        Plan::new(Kind::Custom(Arc::new(f)), label)
    }

    /// The policy this plan gives the statement.
    ///
    /// ```
    /// use remat_runtime::{Plan, Policy, StatementInfo};
    /// let s = StatementInfo { region: "b", name: "h", declared: Some(Policy::Save) };
    /// assert_eq!(Plan::declared().policy(&s), Policy::Save);
    /// ```
    pub fn policy(&self, s: &StatementInfo) -> Policy {
        match &self.kind {
            Kind::Declared | Kind::Off => s.declared.unwrap_or_default(),
            Kind::All(p) => *p,
            Kind::SaveOnly(names) => s.declared.unwrap_or(if names.contains(s.name) {
                Policy::Save
            } else {
                Policy::Recompute
            }),
            Kind::Custom(f) => f(s),
        }
    }

    /// Whether regions under this plan run as plain candle code.
    ///
    /// ```
    /// assert!(!remat_runtime::Plan::declared().is_off());
    /// ```
    pub fn is_off(&self) -> bool {
        matches!(self.kind, Kind::Off)
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
        SCOPES.with(|s| s.borrow_mut().push(self.clone()));
        let _guard = ScopeGuard;
        f()
    }

    /// The plan of the innermost [`Plan::scope`] on this thread, or
    /// [`Plan::declared`].
    ///
    /// ```
    /// assert_eq!(remat_runtime::Plan::current().to_string(), "declared");
    /// ```
    pub fn current() -> Plan {
        SCOPES.with(|s| s.borrow().last().cloned().unwrap_or_default())
    }
}
