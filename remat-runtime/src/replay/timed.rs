//! Replay times: how long each recomputed statement takes in the replay,
//! measured on request for the time model of [`PeakPlan`](crate::plan::PeakPlan)
//! (a statement's replay can be cheaper than its forward: an unread output
//! is not computed again, see `tape/unread.rs`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Instant;

use crate::ambient::scoped;

/// The least replay time of each (region, statement) seen, in seconds.
pub(crate) type Times = HashMap<(String, String), f64>;

thread_local! {
    /// Set while [`timed`] runs: the least replay time of each statement.
    static TIMES: RefCell<Option<Times>> = const { RefCell::new(None) };
}

/// Runs `f` measuring the replay of every recomputed statement in it;
/// returns what `f` returned and the least time of each (region, statement)
/// over its calls.
pub(crate) fn timed<R>(f: impl FnOnce() -> R) -> (R, Times) {
    let before = TIMES.with(|t| t.borrow_mut().replace(Times::new()));
    let mut times = Times::new();
    let out = scoped(
        || {},
        || {
            let mine = TIMES.with(|t| std::mem::replace(&mut *t.borrow_mut(), before));
            times = mine.unwrap_or_default();
        },
        f,
    );
    (out, times)
}

/// Runs a statement's replay `f`, timing it when [`timed`] is running.
pub(crate) fn replay<R>(region: &str, statement: &str, f: impl FnOnce() -> R) -> R {
    if TIMES.with(|t| t.borrow().is_none()) {
        return f();
    }
    let start = Instant::now();
    let out = f();
    let seconds = start.elapsed().as_secs_f64();
    TIMES.with(|t| {
        if let Some(times) = t.borrow_mut().as_mut() {
            let key = (region.to_string(), statement.to_string());
            let least = times.entry(key).or_insert(seconds);
            *least = least.min(seconds);
        }
    });
    out
}
