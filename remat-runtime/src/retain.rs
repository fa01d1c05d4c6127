//! Running backward: keeping tapes for a second backward, typed errors.

use std::cell::{Cell, RefCell};

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use crate::{RematError, Result};

thread_local! {
    static RETAIN: Cell<usize> = const { Cell::new(0) };
    static LAST_ERROR: RefCell<Option<RematError>> = const { RefCell::new(None) };
}

struct RetainGuard;

impl Drop for RetainGuard {
    fn drop(&mut self) {
        RETAIN.with(|r| r.set(r.get() - 1));
    }
}

/// Runs `f` (typically a `loss.backward()`) with region tapes retained: the
/// regions it reaches keep their tapes, so that a later backward through them
/// works. The counterpart of PyTorch's `retain_graph=True`.
///
/// Without it, a region's tape is released as its backward consumes it and a
/// second backward fails with [`RematError::TapeReleased`].
///
/// ```
/// use candle_core::{Device, Var};
/// use remat_runtime::{checkpoint, retain_tape};
/// let x = Var::ones(2, candle_core::DType::F32, &Device::Cpu)?;
/// let y = checkpoint("r", &[x.as_tensor()], |ctx, ins| {
///     ctx.recompute("s", &[&ins[0]], |t| Ok(t[0].sqr()?.sum_all()?))
/// })?;
/// let first = retain_tape(|| y.backward())?;
/// let second = y.backward()?;
/// assert_eq!(
///     first.get(&x).unwrap().to_vec1::<f32>()?,
///     second.get(&x).unwrap().to_vec1::<f32>()?
/// );
/// assert!(y.backward().is_err()); // the second backward did not retain
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn retain_tape<R>(f: impl FnOnce() -> R) -> R {
    RETAIN.with(|r| r.set(r.get() + 1));
    let _guard = RetainGuard;
    f()
}

pub(crate) fn retaining() -> bool {
    RETAIN.with(|r| r.get() > 0)
}

/// Keeps the first runtime error raised inside a backward on this thread, so
/// that [`backward`] can return it typed (candle only keeps its message).
pub(crate) fn remember_error(e: &RematError) {
    LAST_ERROR.with(|slot| {
        let mut slot = slot.borrow_mut();
        if slot.is_none() {
            *slot = Some(e.clone());
        }
    });
}

/// `loss.backward()`, with the runtime's errors returned as [`RematError`]
/// values instead of candle's wrapped messages.
///
/// ```
/// use candle_core::{Device, Var};
/// use remat_runtime::{backward, checkpoint, RematError};
/// let x = Var::ones(2, candle_core::DType::F32, &Device::Cpu)?;
/// let y = checkpoint("r", &[x.as_tensor()], |ctx, ins| {
///     ctx.recompute("s", &[&ins[0]], |t| Ok(t[0].sum_all()?))
/// })?;
/// backward(&y)?;
/// let again = backward(&y).unwrap_err();
/// assert!(matches!(again, RematError::TapeReleased { .. }));
/// # Ok::<(), RematError>(())
/// ```
pub fn backward(loss: &Tensor) -> Result<GradStore> {
    LAST_ERROR.with(|slot| slot.borrow_mut().take());
    let result = loss.backward();
    let typed = LAST_ERROR.with(|slot| slot.borrow_mut().take());
    match (result, typed) {
        (Ok(grads), _) => Ok(grads),
        (Err(_), Some(e)) => Err(e),
        (Err(e), None) => Err(e.into()),
    }
}
