//! The one guard for the state the runtime keeps per thread.
//!
//! Checkpointing has to reach code it does not call: a `loss.backward()`
//! runs a region's replay from inside candle, and a statement's closure
//! draws random numbers through functions that take no context. What such
//! code needs travels in thread-locals, each declared next to the code that
//! owns it. Each is changed only through [`scoped`], which undoes the change
//! when its closure returns or unwinds, or (for the two registries) only
//! appended to and pruned.
//!
//! | state | where | holds | set by | undone by |
//! |---|---|---|---|---|
//! | `PLAN_SCOPES` | `plan/mod.rs` | the stack of `Plan::scope`s | `Plan::scope`, and `Plan::inherit` for a region's block | [`scoped`] pops |
//! | `RETAIN_DEPTH` | `backward/retain.rs` | how many `retain_tape` calls are running | `retain_tape` | [`scoped`] decrements |
//! | `LAST_ERROR` | `graph/mod.rs` | the first typed error raised inside candle's backward | the graph's ops | taken by `backward` |
//! | `FINGERPRINTS_OFF` | `tape/fingerprint.rs` | forwards take no fingerprints for the replay check | `without_fingerprints` | [`scoped`] restores |
//! | `SWAP_ON_CPU` | `offload/mod.rs` | offloaded statements move their residuals on a CPU | `offload::swap_on_cpu` | [`scoped`] restores |
//! | `TRACES` | `inspect/trace.rs` | the stack of traces being recorded | `Trace::record` | [`scoped`] pops |
//! | `RANDOM_BASE`, `RANDOM_OUTSIDE` | `random.rs` | the seed and counter of draws outside statements | `random::seed` | reseeded only |
//! | `RANDOM_STREAMS` | `random.rs` | the stack of statements drawing random numbers | every statement | [`scoped`] pops |
//! | `CAPTURES_CHECKED` | `tape/recorder.rs` | the regions whose first forward looked for undeclared reads, with the outputs it found to be constants | every region call | only grows (one name per region) |
//! | `WATCHES` | `tape/unread.rs` | per running statement, its `nn` op calls and the one to leave uncomputed | every statement, in every mode | [`scoped`] pops |
//! | `TIMES` | `replay/timed.rs` | the least replay time of each statement | `PeakPlan::profile`'s full-recompute steps | [`scoped`] restores |
//! | `LIVE_CALLS` | `inspect/memory.rs` | the region calls `MemoryReport::capture` sees | every region call | pruned when calls end |
//! | `SINK` | `backward/optimizer.rs` | the `OptimizerInBackward` whose `backward_step` runs | `backward_step` | [`scoped`] restores |
//! | `DEPTH` | `backward/optimizer.rs` | how many region backwards run one inside another | `Call::backward` | [`scoped`] decrements |
//! | `REPLAYS` | `plan/calls.rs` | how many region replays run (their nested regions are not new calls of a step) | a region's replay | [`scoped`] decrements |
//!
//! Four more are process-wide, not per thread: the claims of live region
//! calls on their variables (`backward/pending.rs`, counted up by each call
//! and down when its backward ends or it is dropped), the call counts
//! of a plan that decides call by call (`plan/calls.rs`, inside the plan,
//! reset by `Plan::scope`), and two switches: whether CUDA values are
//! checksummed by remat's kernels (`tape/checksum/mod.rs`, set by
//! `inspect::checksum_kernels` or `REMAT_CHECKSUM_KERNELS=0|1`; on by default)
//! and whether several at a launch (`inspect::checksum_batches`,
//! `REMAT_CHECKSUM_BATCHES=0|1`; off by default).

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
    use std::cell::Cell;

    use super::*;

    thread_local! {
        static DEPTH: Cell<usize> = const { Cell::new(0) };
    }

    #[test]
    fn scoped_undoes_on_unwind() {
        let result = std::panic::catch_unwind(|| {
            scoped(
                || DEPTH.with(|d| d.set(d.get() + 1)),
                || DEPTH.with(|d| d.set(d.get() - 1)),
                || panic!("inside"),
            )
        });
        assert!(result.is_err());
        assert_eq!(DEPTH.with(Cell::get), 0);
    }
}
