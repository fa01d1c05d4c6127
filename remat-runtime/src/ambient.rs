//! Every piece of state the runtime keeps per thread, in one place.
//!
//! Checkpointing has to reach code it does not call: a `loss.backward()`
//! runs a region's replay from inside candle, and a statement's closure
//! draws random numbers through functions that take no context. What such
//! code needs travels in these thread-locals. Each is changed only through
//! [`scoped`], which undoes the change when its closure returns or unwinds,
//! or (for the two registries) only appended to and pruned.
//!
//! | state | holds | set by | undone by |
//! |---|---|---|---|
//! | [`PLAN_SCOPES`] | the stack of [`Plan::scope`]s | `Plan::scope` | [`scoped`] pops |
//! | [`RETAIN_DEPTH`] | how many [`retain_tape`](crate::retain_tape) calls are running | `retain_tape` | [`scoped`] decrements |
//! | [`LAST_ERROR`] | the first typed error raised inside candle's backward | the graph's ops | taken by [`backward`](crate::backward) |
//! | [`FINGERPRINTS_OFF`] | forwards take no fingerprints for the replay check | [`without_fingerprints`](crate::without_fingerprints) | [`scoped`] restores |
//! | [`SWAP_ON_CPU`] | offloaded statements move their residuals on a CPU | [`offload::swap_on_cpu`](crate::offload::swap_on_cpu) | [`scoped`] restores |
//! | [`TRACES`] | the stack of traces being recorded | [`Trace::record`](crate::inspect::Trace::record) | [`scoped`] pops |
//! | [`RANDOM_BASE`], [`RANDOM_OUTSIDE`] | the seed and counter of draws outside statements | [`random::seed`](crate::random::seed) | reseeded only |
//! | [`RANDOM_STREAMS`] | the stack of statements drawing random numbers | every statement | [`scoped`] pops |
//! | [`CAPTURES_CHECKED`] | the regions whose first forward looked for undeclared reads, with the outputs it found to be constants | every region call | only grows (one name per region) |
//! | [`LIVE_CALLS`] | the region calls [`MemoryReport::capture`](crate::MemoryReport::capture) sees | every region call | pruned when calls end |

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Weak;

use crate::backward::Call;
use crate::inspect::trace::Collector;
use crate::random::Stream;
use crate::{Plan, RematError};

thread_local! {
    /// The plans of the [`Plan::scope`]s running on this thread; the last is
    /// the innermost.
    pub(crate) static PLAN_SCOPES: RefCell<Vec<Plan>> = const { RefCell::new(Vec::new()) };
    /// Above zero while a `retain_tape` closure runs.
    pub(crate) static RETAIN_DEPTH: Cell<usize> = const { Cell::new(0) };
    /// Kept because candle keeps only an error's message.
    pub(crate) static LAST_ERROR: RefCell<Option<RematError>> = const { RefCell::new(None) };
    /// Set while a `without_fingerprints` closure runs.
    pub(crate) static FINGERPRINTS_OFF: Cell<bool> = const { Cell::new(false) };
    /// Set while an `offload::swap_on_cpu` closure runs.
    pub(crate) static SWAP_ON_CPU: Cell<bool> = const { Cell::new(false) };
    /// One collector per `Trace::record` running; events go to the last.
    pub(crate) static TRACES: RefCell<Vec<Collector>> = const { RefCell::new(Vec::new()) };
    /// The base seed of draws made outside any statement.
    pub(crate) static RANDOM_BASE: Cell<u64> = const { Cell::new(0x05EE_D0F4_E3A7) };
    /// How many draws outside any statement were made since the last seed.
    pub(crate) static RANDOM_OUTSIDE: Cell<u64> = const { Cell::new(0) };
    /// The random stream of each statement running; draws use the last.
    pub(crate) static RANDOM_STREAMS: RefCell<Vec<Stream>> = const { RefCell::new(Vec::new()) };
    /// The regions whose first forward on this thread looked for
    /// undeclared reads, each with the outputs that forward found to be
    /// constants (bit `j`: output `j`, a tensor no statement gave and that
    /// carries no gradient).
    pub(crate) static CAPTURES_CHECKED: RefCell<HashMap<String, u64>> = RefCell::new(HashMap::new());
    /// Every region call made on this thread that may still hold a tape.
    pub(crate) static LIVE_CALLS: RefCell<Vec<Weak<Call>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `undo` when dropped: on return and on unwinding alike.
struct Scoped<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> Drop for Scoped<F> {
    fn drop(&mut self) {
        if let Some(undo) = self.0.take() {
            undo();
        }
    }
}

/// Runs `enter`, then `body`, then `undo`, also when `body` panics: the one
/// way ambient state is changed for the length of a closure.
pub(crate) fn scoped<R>(enter: impl FnOnce(), undo: impl FnOnce(), body: impl FnOnce() -> R) -> R {
    enter();
    let _undo = Scoped(Some(undo));
    body()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scoped_undoes_on_unwind() {
        let result = std::panic::catch_unwind(|| {
            scoped(
                || RETAIN_DEPTH.with(|d| d.set(d.get() + 1)),
                || RETAIN_DEPTH.with(|d| d.set(d.get() - 1)),
                || panic!("inside"),
            )
        });
        assert!(result.is_err());
        assert_eq!(RETAIN_DEPTH.with(Cell::get), 0);
    }
}
