//! A trace of every statement a region ran, in the forward and in the
//! replay: what JAX's `print_saved_residuals` and PyTorch's
//! `checkpoint(debug=True)` show, by statement name.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;

use candle_core::DType;

use crate::ambient::scoped;
use crate::tape::{Meta, Record};
use crate::Policy;

thread_local! {
    /// One collector per `Trace::record` running; events go to the last.
    static TRACES: RefCell<Vec<Collector>> = const { RefCell::new(Vec::new()) };
}

/// When a statement ran.
///
/// ```
/// use remat_runtime::inspect::{Phase, Trace};
/// let ((), trace) = Trace::record(|| ());
/// assert!(trace.events.iter().all(|e| e.phase == Phase::Forward));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Phase {
    /// In the region's forward.
    Forward,
    /// In the replay at the start of the region's backward.
    Replay,
    /// In the backward (a [`Profile`](super::Profile)'s rows; a trace's
    /// events are statements, which run in the forward or the replay).
    Backward,
}

/// One statement of one region call, in one phase (see [`Trace`]).
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::inspect::{Phase, Trace};
/// use remat_runtime::{Policy, Region};
/// let x = Var::ones(4, DType::F32, &Device::Cpu)?;
/// let (y, trace) = Trace::record(|| {
///     Region::new("r").run(&[x.as_tensor()], |ctx, ins| ctx.save("e", &[&ins[0]], |t| t[0].exp()))
/// });
/// let e = &trace.events[0];
/// assert_eq!((e.phase, e.region.as_str(), e.statement.as_str()), (Phase::Forward, "r#0", "e"));
/// assert_eq!(e.policy, Policy::Save);
/// assert_eq!(e.bytes, 2 * 4 * 4); // the leaf copy of x and the output
/// drop(y?);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TraceEvent {
    /// Forward or replay.
    pub phase: Phase,
    /// The region and which of its calls in the trace: `block#0`.
    pub region: String,
    /// The statement's name.
    pub statement: String,
    /// The policy it ran under.
    pub policy: Policy,
    /// The policy written in the code (`None`: left to the plan).
    pub declared: Option<Policy>,
    /// Shapes of its tensor inputs.
    pub inputs: Vec<Vec<usize>>,
    /// Shapes of its tensor outputs.
    pub outputs: Vec<Vec<usize>>,
    /// Dtype of its first output.
    pub dtype: Option<DType>,
    /// Forward: bytes the tape holds for it (its saved graph and leaf
    /// copies, storages counted once per region call; 0 when recomputed).
    /// Replay: bytes of the outputs it recomputed (0 when restored).
    pub bytes: usize,
}

/// The statements run on this thread while [`Trace::record`] was running.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::inspect::Trace;
/// use remat_runtime::Region;
/// let x = Var::ones((2, 4), DType::F32, &Device::Cpu)?;
/// let (grads, trace) = Trace::record(|| {
///     let y = Region::new("r").run(&[x.as_tensor()], |ctx, ins| {
///         let e = ctx.save("e", &[&ins[0]], |t| t[0].exp())?;
///         ctx.recompute("s", &[&e], |t| t[0].sum_all())
///     })?;
///     y.backward()
/// });
/// grads?;
/// assert_eq!(trace.events.len(), 4); // e and s, forward and replay
/// println!("{trace}");
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    /// In the order they ran.
    pub events: Vec<TraceEvent>,
}

/// One trace being recorded: its events, and the calls of each region so
/// far (for the `region#n` labels).
#[derive(Default)]
pub(crate) struct Collector {
    events: Vec<TraceEvent>,
    calls: HashMap<String, usize>,
}

impl Trace {
    /// Runs `f` and returns its result with the trace of every statement run
    /// on this thread meanwhile (forwards, and the replays of backwards run
    /// inside `f`). Nested calls each get their own trace.
    ///
    /// ```
    /// let ((), trace) = remat_runtime::inspect::Trace::record(|| ());
    /// assert!(trace.events.is_empty());
    /// ```
    pub fn record<R>(f: impl FnOnce() -> R) -> (R, Trace) {
        scoped(
            || TRACES.with(|a| a.borrow_mut().push(Collector::default())),
            || {
                TRACES.with(|a| {
                    a.borrow_mut().pop();
                })
            },
            || {
                let out = f();
                let events = TRACES.with(|a| {
                    a.borrow_mut()
                        .last_mut()
                        .map(|c| std::mem::take(&mut c.events))
                        .unwrap_or_default()
                });
                (out, Trace { events })
            },
        )
    }
}

/// Whether a trace is being recorded on this thread.
pub(crate) fn enabled() -> bool {
    TRACES.with(|a| !a.borrow().is_empty())
}

/// The label of a new call of `region` in the current trace (`region#n`), or
/// `None` when no trace is recorded.
pub(crate) fn begin_call(region: &str) -> Option<String> {
    TRACES.with(|a| {
        let mut a = a.borrow_mut();
        let c = a.last_mut()?;
        let n = c.calls.entry(region.to_string()).or_insert(0);
        let label = format!("{region}#{n}");
        *n += 1;
        Some(label)
    })
}

/// Adds an event to the current trace, if one is recorded.
pub(crate) fn push(event: TraceEvent) {
    TRACES.with(|a| {
        if let Some(c) = a.borrow_mut().last_mut() {
            c.events.push(event);
        }
    });
}

fn shapes(metas: &[Meta]) -> Vec<Vec<usize>> {
    metas.iter().map(|m| m.shape.dims().to_vec()).collect()
}

impl TraceEvent {
    /// The event of `record` of the call labelled `region`.
    pub(crate) fn of(phase: Phase, region: &str, record: &Record, bytes: usize) -> Self {
        TraceEvent {
            phase,
            region: region.to_string(),
            statement: record.name.clone(),
            policy: record.policy,
            declared: record.declared,
            inputs: shapes(&record.inputs),
            outputs: shapes(&record.outputs),
            dtype: record.outputs.first().map(|m| m.dtype),
            bytes,
        }
    }
}

/// `[2, 8] [8]`, or `-` for none.
fn fmt_shapes(shapes: &[Vec<usize>]) -> String {
    if shapes.is_empty() {
        "-".to_string()
    } else {
        shapes
            .iter()
            .map(|s| format!("{s:?}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// How a statement's policy came about: `save`, `recompute`, or `save
/// (plan)` when the plan chose it.
pub(crate) fn policy_label(policy: Policy, declared: Option<Policy>) -> String {
    match declared {
        Some(_) => policy.to_string(),
        None => format!("{policy} (plan)"),
    }
}

impl fmt::Display for TraceEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (phase, what) = match (self.phase, self.policy) {
            (Phase::Forward, _) => ("forward", "ran"),
            (Phase::Replay, Policy::Recompute) => ("replay", "recomputed"),
            (Phase::Replay, Policy::Save | Policy::Offload) => ("replay", "restored"),
            (Phase::Backward, _) => ("backward", "ran"),
        };
        write!(
            f,
            "{phase:<7} {:<10} {:<12} {:<17} {:<10} {} -> {}  {} B",
            self.region,
            self.statement,
            policy_label(self.policy, self.declared),
            what,
            fmt_shapes(&self.inputs),
            fmt_shapes(&self.outputs),
            self.bytes
        )
    }
}

impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.events.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// The forward's records and the replay's statements side by side, up to
/// and just past the first divergence at position `at`, where the replay
/// ran `found`.
pub(crate) fn side_by_side(forward: &[(String, String)], at: usize, found: &str) -> String {
    let width = forward
        .iter()
        .map(|(n, p)| n.len() + p.len() + 1)
        .chain([found.len()])
        .max()
        .unwrap_or(0)
        .max(7);
    let mut out = format!("   # {:<width$} | replay", "forward");
    let end = (at + 2).min(forward.len()).max(at + 1);
    for i in 0..end {
        let fwd = forward
            .get(i)
            .map_or("(none)".to_string(), |(n, p)| format!("{n} {p}"));
        let (rep, mark) = match i.cmp(&at) {
            std::cmp::Ordering::Less => (fwd.clone(), ""),
            std::cmp::Ordering::Equal => (found.to_string(), "  <- first divergence"),
            std::cmp::Ordering::Greater => (String::new(), ""),
        };
        out.push_str(&format!("\n{i:>4} {fwd:<width$} | {rep}{mark}"));
    }
    out
}
