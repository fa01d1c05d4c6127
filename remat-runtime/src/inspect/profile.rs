//! Where a step's time goes: each `nn` op, the replay check, and the rest of
//! a region's forward, replay and backward, timed with the device
//! synchronised around each (what PyTorch's profiler shows by op, in the
//! words of this crate).
//!
//! Process-wide, not per thread: one [`Profile::record`] at a time, which
//! times what runs on its own thread; scopes cost one atomic load while none
//! runs.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use candle_core::Device;

use super::trace::Phase;
use crate::ambient::scoped;
use crate::{lock, Result};

/// Whether a profile is being recorded (read by every scope).
static ON: AtomicBool = AtomicBool::new(false);
/// The profile being recorded.
static RECORDING: Mutex<Option<Recording>> = Mutex::new(None);

struct Open {
    key: (&'static str, Phase),
    /// Time spent in it so far, its nested scopes' excluded.
    seconds: f64,
    /// When it last started or a nested scope ended.
    since: Instant,
}

struct Recording {
    device: Device,
    /// The thread of `Profile::record`: the only one timed.
    thread: std::thread::ThreadId,
    open: Vec<Open>,
    rows: HashMap<(&'static str, Phase), (usize, f64)>,
    /// The first error of a synchronisation, reported by `record`.
    failed: Option<candle_core::Error>,
}

/// Waits for the device of this thread's recording, without holding the
/// lock (other threads' ops go on), and returns the time; `None` when no
/// profile is recorded on this thread.
fn now() -> Option<Instant> {
    let device = {
        let guard = lock(&RECORDING);
        let r = guard.as_ref()?;
        if r.thread != std::thread::current().id() {
            return None;
        }
        r.device.clone()
    };
    if let Err(e) = device.synchronize() {
        if let Some(r) = lock(&RECORDING).as_mut() {
            r.failed.get_or_insert(e);
        }
    }
    Some(Instant::now())
}

/// Time spent in one kind of work in one phase, over a [`Profile`].
///
/// ```
/// use remat_runtime::inspect::{Phase, ProfileRow};
/// let row = ProfileRow { what: "layer_norm", phase: Phase::Backward, calls: 2, seconds: 0.5 };
/// assert_eq!(row.seconds / row.calls as f64, 0.25);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileRow {
    /// An `nn` op (`attention`, `linear_add`, ..); `replay check` (the
    /// checksums of the forward and the replay and their comparison);
    /// `region` (the rest of a region's forward or replay: candle's own ops
    /// in its statements, the tape); `region backward` (the rest of a
    /// region's backward: candle's backward of its statements' ops, the
    /// sums of gradients).
    pub what: &'static str,
    /// The forward, a region's replay, or the backward.
    pub phase: Phase,
    /// How many times it ran.
    pub calls: usize,
    /// Seconds spent in it, the device's work included, the scopes nested
    /// in it excluded.
    pub seconds: f64,
}

/// The time of every `nn` op and of the checkpointing machinery while
/// [`Profile::record`] ran, by phase; what ran outside them (candle's ops
/// outside regions and `nn`, the backward of candle's graph outside
/// regions) is the step's time less [`Profile::total`].
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use remat_runtime::inspect::{Phase, Profile};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1., (4, 8), &dev)?;
/// let w = Var::randn(0f32, 1., (8, 8), &dev)?;
/// let (grads, profile) = Profile::record(&dev, || {
///     remat_runtime::nn::linear(x.as_tensor(), w.as_tensor(), None)?.sum_all()?.backward()
/// })?;
/// grads?;
/// let phases: Vec<Phase> = profile.rows.iter().map(|r| r.phase).collect();
/// assert!(phases.contains(&Phase::Forward) && phases.contains(&Phase::Backward));
/// println!("{profile}");
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    /// The longest first.
    pub rows: Vec<ProfileRow>,
}

impl Profile {
    /// Runs `f`, waiting for `device` before and after each op and region
    /// step it runs on this thread, and returns its result with the time of each. The
    /// waits slow the run down a little (one synchronisation per scope): take
    /// the step's own time from a run without a profile.
    ///
    /// # Errors
    ///
    /// [`RematError::ProfileRunning`](crate::RematError::ProfileRunning)
    /// when another profile is being recorded; a device error of a
    /// synchronisation.
    pub fn record<R>(device: &Device, f: impl FnOnce() -> R) -> Result<(R, Profile)> {
        {
            let mut r = lock(&RECORDING);
            if r.is_some() {
                return Err(crate::RematError::ProfileRunning);
            }
            *r = Some(Recording {
                device: device.clone(),
                thread: std::thread::current().id(),
                open: Vec::new(),
                rows: HashMap::new(),
                failed: None,
            });
        }
        // Only this thread's recording is ended here: another thread may
        // start its own as soon as this one is taken.
        let mine = std::thread::current().id();
        let take = || {
            let mut r = lock(&RECORDING);
            if r.as_ref().is_some_and(|r| r.thread == mine) {
                ON.store(false, Ordering::Release);
                r.take()
            } else {
                None
            }
        };
        let (out, recording) = scoped(
            || ON.store(true, Ordering::Release),
            || {
                take();
            },
            || (f(), take()),
        );
        let Some(recording) = recording else {
            return Err(crate::RematError::ProfileRunning);
        };
        if let Some(e) = recording.failed {
            return Err(e.into());
        }
        let mut rows: Vec<ProfileRow> = recording
            .rows
            .into_iter()
            .map(|((what, phase), (calls, seconds))| ProfileRow {
                what,
                phase,
                calls,
                seconds,
            })
            .collect();
        rows.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then(a.what.cmp(b.what)));
        Ok((out, Profile { rows }))
    }

    /// Seconds in all rows.
    ///
    /// ```
    /// assert_eq!(remat_runtime::inspect::Profile::default().total(), 0.0);
    /// ```
    pub fn total(&self) -> f64 {
        self.rows.iter().map(|r| r.seconds).sum()
    }
}

impl fmt::Display for Profile {
    /// A Markdown table: what, phase, calls, milliseconds, share.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = self.total().max(f64::MIN_POSITIVE);
        writeln!(f, "| what | phase | calls | ms | share |")?;
        writeln!(f, "|---|---|---:|---:|---:|")?;
        for r in &self.rows {
            writeln!(
                f,
                "| {} | {:?} | {} | {:.2} | {:.1}% |",
                r.what,
                r.phase,
                r.calls,
                r.seconds * 1e3,
                100.0 * r.seconds / total
            )?;
        }
        Ok(())
    }
}

/// A scope being timed; ends when dropped.
#[must_use]
pub(crate) struct Scope(bool);

/// Times `what` in `phase` until the scope is dropped, if a profile is
/// being recorded.
pub(crate) fn scope(what: &'static str, phase: Phase) -> Scope {
    if !ON.load(Ordering::Acquire) {
        return Scope(false);
    }
    // Only this thread ends its recording: it outlives the two locks.
    let Some(now) = now() else {
        return Scope(false);
    };
    let mut guard = lock(&RECORDING);
    let Some(r) = guard.as_mut() else {
        return Scope(false);
    };
    if let Some(parent) = r.open.last_mut() {
        parent.seconds += (now - parent.since).as_secs_f64();
    }
    r.open.push(Open {
        key: (what, phase),
        seconds: 0.0,
        since: now,
    });
    Scope(true)
}

/// Times an `nn` op's forward: in the forward, or in a region's replay.
pub(crate) fn op(what: &'static str) -> Scope {
    let phase = if crate::plan::in_replay() {
        Phase::Replay
    } else {
        Phase::Forward
    };
    scope(what, phase)
}

/// Times an `nn` op's backward.
pub(crate) fn backward(what: &'static str) -> Scope {
    scope(what, Phase::Backward)
}

impl Drop for Scope {
    fn drop(&mut self) {
        if !self.0 {
            return;
        }
        let Some(now) = now() else { return };
        let mut guard = lock(&RECORDING);
        let Some(r) = guard.as_mut() else { return };
        let Some(open) = r.open.pop() else { return };
        let row = r.rows.entry(open.key).or_insert((0, 0.0));
        row.0 += 1;
        row.1 += open.seconds + (now - open.since).as_secs_f64();
        if let Some(parent) = r.open.last_mut() {
            parent.since = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// One test: a profile is process-wide.
    #[test]
    fn scopes_count_their_own_time_once_one_profile_at_a_time() -> Result<()> {
        let ((), p) = Profile::record(&Device::Cpu, || {
            let _outer = scope("outer", Phase::Forward);
            std::thread::sleep(Duration::from_millis(20));
            {
                let _inner = scope("inner", Phase::Backward);
                std::thread::sleep(Duration::from_millis(40));
            }
            let _again = scope("inner", Phase::Backward);
            // Another thread's work is not timed.
            std::thread::spawn(|| {
                let _s = scope("elsewhere", Phase::Forward);
            })
            .join()
            .unwrap();
        })?;
        let get = |w| p.rows.iter().find(|r| r.what == w).unwrap();
        assert_eq!((get("outer").calls, get("inner").calls), (1, 2));
        assert!(get("inner").seconds >= 0.040 && get("outer").seconds >= 0.020);
        // The outer scope excludes the inner's 40 ms.
        assert!(get("outer").seconds < 0.040, "{p}");
        assert_eq!((p.rows.len(), p.rows[0].what), (2, "inner"));

        let (inner, _) = Profile::record(&Device::Cpu, || {
            Profile::record(&Device::Cpu, || ()).map(|_| ())
        })?;
        assert!(matches!(inner, Err(crate::RematError::ProfileRunning)));
        assert!(!ON.load(Ordering::Acquire));
        let _late = scope("late", Phase::Forward);
        assert!(lock(&RECORDING).is_none());
        // A panic inside leaves no profile running.
        let caught = std::panic::catch_unwind(|| Profile::record(&Device::Cpu, || panic!("boom")));
        assert!(caught.is_err() && lock(&RECORDING).is_none());
        let (_, p) = Profile::record(&Device::Cpu, || {
            let _s = scope("x", Phase::Forward);
        })?;
        assert_eq!(p.rows.len(), 1);
        Ok(())
    }
}
