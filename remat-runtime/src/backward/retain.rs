//! Entering a backward from user code: keeping tapes for a second
//! backward, and the typed errors of [`backward`].

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use crate::ambient::{deeper, depth, Depth};
use crate::graph::take_error;
use crate::Result;

/// Runs `f` (typically a `loss.backward()`) with region tapes retained: the
/// regions it reaches keep their tapes, so that a later backward through them
/// works. The counterpart of PyTorch's `retain_graph=True`.
///
/// Without it, a region's tape is released as its backward consumes it and a
/// second backward fails with
/// [`RematError::TapeReleased`](crate::RematError::TapeReleased).
///
/// ```
/// use candle_core::{Device, Var};
/// use remat_runtime::{retain_tape, Region};
/// let x = Var::ones(2, candle_core::DType::F32, &Device::Cpu)?;
/// let y = Region::new("r").run(&[x.as_tensor()], |ctx, ins| {
///     ctx.recompute("s", &[&ins[0]], |t| t[0].sqr()?.sum_all())
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
    deeper(Depth::Retain, f)
}

/// Whether a [`retain_tape`] closure is running on this thread.
pub(crate) fn retaining() -> bool {
    depth(Depth::Retain) > 0
}

/// `loss.backward()`, with the runtime's errors returned as
/// [`RematError`](crate::RematError) values instead of candle's wrapped
/// messages.
///
/// ```
/// use candle_core::{Device, Var};
/// use remat_runtime::{backward, Region, RematError};
/// let x = Var::ones(2, candle_core::DType::F32, &Device::Cpu)?;
/// let y = Region::new("r").run(&[x.as_tensor()], |ctx, ins| {
///     ctx.recompute("s", &[&ins[0]], |t| t[0].sum_all())
/// })?;
/// backward(&y)?;
/// let again = backward(&y).unwrap_err();
/// assert!(matches!(again, RematError::TapeReleased { .. }));
/// # Ok::<(), RematError>(())
/// ```
pub fn backward(loss: &Tensor) -> Result<GradStore> {
    take_error();
    let result = loss.backward();
    let typed = take_error();
    match (result, typed) {
        (Ok(grads), _) => Ok(grads),
        (Err(_), Some(e)) => Err(e),
        (Err(e), None) => Err(e.into()),
    }
}
