//! The one guard for the state the runtime keeps per thread.
//!
//! Checkpointing has to reach code it does not call: a `loss.backward()`
//! runs a region's replay from inside candle, and a statement's closure
//! draws random numbers through functions that take no context. What such
//! code needs travels in thread-locals, each declared next to the code that
//! owns it, or here when it is a counter or a switch. A change for the
//! length of a closure goes through [`scoped`], which undoes it when the
//! closure returns or unwinds; the others are said in the table (the
//! error taken by `backward`, the random seed and counter, the two
//! registries appended to and pruned). This is the one list, the
//! process-wide state after it (docs/architecture.md points here):
//!
//! | state | where | holds | set by | undone by | why a thread-local |
//! |---|---|---|---|---|---|
//! | `PLAN_SCOPES` | `plan/mod.rs` | the stack of `Plan::scope`s | `Plan::scope`, and `Plan::inherit` for a region's block | [`scoped`] pops | a user's scope reaches the regions of model code that takes no plan |
//! | `SWITCHES` | here | the forward's switches: no fingerprints (`without_fingerprints`), offloaded residuals moved on a CPU (`offload::swap_on_cpu`) | [`switched`] | [`scoped`] restores | the same: set around model code |
//! | `TRACES` | `inspect/trace.rs` | the stack of traces being recorded | `Trace::record` | [`scoped`] pops | the same |
//! | `RANDOM_BASE`, `RANDOM_OUTSIDE` | `random.rs` | the seed and counter of draws outside statements | `random::seed` | reseeded only | `nn::dropout` and `random::uniform` take no context |
//! | `RANDOM_STREAMS` | `random.rs` | the stack of statements drawing random numbers | every statement | [`scoped`] pops | the same, inside a statement's closure |
//! | `WATCHES` | `tape/unread.rs` | per running statement, its `nn` op calls and the one to leave uncomputed | every statement, in every mode | [`scoped`] pops | `nn`'s ops take no context |
//! | `FIRST_RUNS` | `tape/recorder.rs` | the regions whose first recorded, generated or plain run on this thread checked what it reads, with the outputs it found to be constants | every region call | only grows (one name per region) | a cache per thread, as the first forward's leaf copies are |
//! | `TIMES` | `replay/timed.rs` | the least replay time of each statement | `PeakPlan::profile`'s full-recompute steps | [`scoped`] restores | replays run from inside candle's backward, which passes no handle |
//! | `LIVE_CALLS` | `inspect/memory.rs` | the region calls `MemoryReport::capture` sees | every region call | pruned when calls end | `MemoryReport::capture()` takes no handle |
//! | `LAST_ERROR` | `graph/mod.rs` | the first typed error raised inside candle's backward | the graph's ops | taken by `backward` | candle's backward returns its own error type |
//! | `SINK` | `backward/optimizer.rs` | the `OptimizerInBackward` whose `backward_step` runs | `backward_step` | [`scoped`] restores | reached from inside candle's backward |
//! | `DEPTHS` | here | how many of each nesting scope run: `retain_tape` closures, region backwards one inside another, region replays (their nested regions are not new calls of a step) | [`deeper`] | [`scoped`] decrements | the same |
//!
//! Process-wide, not per thread:
//!
//! * the claims of live region calls on their variables
//!   (`backward/pending.rs`, counted up by each call and down when its
//!   backward ends or it is dropped);
//! * the call counts of a plan that decides call by call (`plan/calls.rs`,
//!   inside the plan, reset by `Plan::scope`);
//! * whether CUDA values are checksummed by remat's kernels (`KERNELS` in
//!   `tape/checksum/mod.rs`: `inspect::checksum_kernels`,
//!   `REMAT_CHECKSUM_KERNELS=0|1`; on by default), and several at a launch
//!   (`BATCHES`: `inspect::checksum_batches`, `REMAT_CHECKSUM_BATCHES=0|1`;
//!   off by default);
//! * whether `nn`'s ops run on remat's CUDA kernels (`ON` in
//!   `nn/kernels/mod.rs`: `nn::cuda_kernels`, `REMAT_NN_KERNELS=0|1`; on by
//!   default), and f16/bf16 attention on tensor cores (`tensor_cores_on`,
//!   `REMAT_NN_TENSOR_CORES=0|1`, read once; on by default);
//! * the profile being recorded (`inspect/profile.rs`: one
//!   `Profile::record` at a time, timing the scopes of its own thread; a
//!   scope costs one atomic load while none is recorded).

use std::cell::Cell;

/// The scopes of a backward that may run one inside another on a thread,
/// each counted while it runs (in `DEPTHS`).
#[derive(Clone, Copy)]
pub(crate) enum Depth {
    /// `retain_tape` closures (`backward/retain.rs`).
    Retain,
    /// Region backwards, one inside another's replay and sweep
    /// (`backward/optimizer.rs`).
    Backward,
    /// Region replays (`plan/calls.rs`).
    Replay,
}

/// The forward's switches, off unless a closure turns one on (in
/// `SWITCHES`).
#[derive(Clone, Copy)]
pub(crate) enum Switch {
    /// Forwards take no fingerprints (`without_fingerprints`).
    NoFingerprints,
    /// Offloaded statements on a CPU move their residuals
    /// (`offload::swap_on_cpu`).
    SwapOnCpu,
}

struct Depths {
    retain: Cell<usize>,
    backward: Cell<usize>,
    replay: Cell<usize>,
}

struct Switches {
    no_fingerprints: Cell<bool>,
    swap_on_cpu: Cell<bool>,
}

thread_local! {
    static DEPTHS: Depths = const {
        Depths {
            retain: Cell::new(0),
            backward: Cell::new(0),
            replay: Cell::new(0),
        }
    };
    static SWITCHES: Switches = const {
        Switches {
            no_fingerprints: Cell::new(false),
            swap_on_cpu: Cell::new(false),
        }
    };
}

fn count(d: &Depths, which: Depth) -> &Cell<usize> {
    match which {
        Depth::Retain => &d.retain,
        Depth::Backward => &d.backward,
        Depth::Replay => &d.replay,
    }
}

fn flag(s: &Switches, which: Switch) -> &Cell<bool> {
    match which {
        Switch::NoFingerprints => &s.no_fingerprints,
        Switch::SwapOnCpu => &s.swap_on_cpu,
    }
}

/// Runs `body` one level deeper in `which`.
pub(crate) fn deeper<R>(which: Depth, body: impl FnOnce() -> R) -> R {
    let step = |by: isize| {
        DEPTHS.with(|d| {
            let c = count(d, which);
            c.set(c.get().wrapping_add_signed(by));
        })
    };
    scoped(|| step(1), || step(-1), body)
}

/// How many `which` scopes run on this thread.
pub(crate) fn depth(which: Depth) -> usize {
    DEPTHS.with(|d| count(d, which).get())
}

/// Runs `body` with `which` on, then restores it.
pub(crate) fn switched<R>(which: Switch, body: impl FnOnce() -> R) -> R {
    let before = is_on(which);
    scoped(
        || SWITCHES.with(|s| flag(s, which).set(true)),
        || SWITCHES.with(|s| flag(s, which).set(before)),
        body,
    )
}

/// Whether `which` is on on this thread.
pub(crate) fn is_on(which: Switch) -> bool {
    SWITCHES.with(|s| flag(s, which).get())
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

    #[test]
    fn depths_count_nested_scopes_and_switches_restore_what_was_before() {
        let inner = deeper(Depth::Replay, || {
            deeper(Depth::Replay, || {
                (
                    depth(Depth::Replay),
                    depth(Depth::Retain),
                    depth(Depth::Backward),
                )
            })
        });
        assert_eq!(inner, (2, 0, 0));
        let unwound = std::panic::catch_unwind(|| deeper(Depth::Retain, || panic!("inside")));
        assert!(unwound.is_err());
        assert_eq!(depth(Depth::Retain), 0);
        assert_eq!(depth(Depth::Replay), 0);
        // A switch already on stays on after an inner scope turns it on.
        switched(Switch::SwapOnCpu, || {
            switched(Switch::SwapOnCpu, || assert!(is_on(Switch::SwapOnCpu)));
            assert!(is_on(Switch::SwapOnCpu));
            assert!(!is_on(Switch::NoFingerprints));
        });
        assert!(!is_on(Switch::SwapOnCpu));
        let unwound = std::panic::catch_unwind(|| switched(Switch::NoFingerprints, || panic!("x")));
        assert!(unwound.is_err());
        assert!(!is_on(Switch::NoFingerprints));
    }
}
