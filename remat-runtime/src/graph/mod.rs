//! candle glue: the custom ops that attach a region to candle's graph, and
//! the leaves its statements run on.
//!
//! * anchors (`anchor`): a chain of nodes whose arguments are the tensors
//!   that need gradients (tracked region inputs and parameters). The top
//!   anchor runs the region's backward; every anchor hands back the gradient
//!   of its argument.
//! * taps (`tap`): one per region output, each an op on the top anchor whose
//!   forward copies the output the block computed and whose backward hands
//!   the output's gradient to the region call; `attach` ties a call's
//!   outputs to candle's graph through both.
//! * seeds (`seed`): start a candle backward from a tensor with a given
//!   upstream gradient, without building `(out * g).sum()`.
//! * leaves (`leaf`): the fresh variables statements run on, and which
//!   tracked tensors a statement may read.
//! * relayouts (`relayout`): a leaf read through a view with the strides
//!   the forward read its value in, so that a replay adds in the forward's
//!   order.
//! * this file: storage helpers of the ops, and the typed error an op's
//!   backward raises, kept for `remat_runtime::backward` ([`to_candle`],
//!   [`take_error`]).

mod anchor;
mod leaf;
mod relayout;
mod seed;
mod tap;

pub(crate) use anchor::anchor_chain;
pub use leaf::Reach;
pub(crate) use leaf::{
    carries_grad, check_cut, check_input, check_reached, check_reads, make_leaf, new_handle,
};
pub(crate) use relayout::Relayout;
pub(crate) use seed::Seed;
pub(crate) use tap::{attach, calls_so_far, forget, given_before};

use std::cell::RefCell;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{DType, Device, Layout, Shape, Tensor};

use crate::RematError;

thread_local! {
    /// Kept because candle keeps only an error's message.
    static LAST_ERROR: RefCell<Option<RematError>> = const { RefCell::new(None) };
}

/// A scalar NaN of `dtype` on `device` (zero for integer dtypes): what a
/// value the replay does not compute reads as.
pub(crate) fn nan_scalar(dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    if dtype.is_float() {
        Tensor::new(f64::NAN, device)?.to_dtype(dtype)
    } else {
        Tensor::zeros((), dtype, device)
    }
}

/// A scalar `f32` zero on the device of `like`.
pub(crate) fn scalar_zero<S>(like: &S) -> candle_core::Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let shape = Shape::from(());
    Ok((like.device().zeros_impl(&shape, DType::F32)?, shape))
}

/// Copies the elements `layout` addresses in `src` into a new contiguous storage.
pub(crate) fn copy_compact<S>(src: &S, layout: &Layout) -> candle_core::Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let shape = layout.shape().clone();
    // SAFETY: `alloc_uninit` returns storage for `shape.elem_count()` elements
    // of `src.dtype()`; `copy_strided_src` with offset 0 writes every one of
    // them (the layout has exactly that many elements) before the storage is
    // returned, so no uninitialised element is ever read. This is the same
    // sequence candle's own `Tensor::copy` uses.
    let mut dst = unsafe { src.device().alloc_uninit(&shape, src.dtype())? };
    src.copy_strided_src(&mut dst, 0, layout)?;
    Ok((dst, shape))
}

pub(crate) fn wrong_device(op: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "remat: the value of {op} is on a different device than the region"
    ))
}

/// Turns a runtime error raised inside candle's backward into a candle error,
/// remembering the typed error for [`take_error`]: the first one raised on
/// this thread is kept, so that the typed `backward` can return it (candle
/// only keeps its message).
pub(crate) fn to_candle(e: RematError) -> candle_core::Error {
    LAST_ERROR.with(|slot| {
        let mut slot = slot.borrow_mut();
        if slot.is_none() {
            *slot = Some(e.clone());
        }
    });
    candle_core::Error::wrap(e)
}

/// Takes the error [`to_candle`] remembered on this thread, if any.
pub(crate) fn take_error() -> Option<RematError> {
    LAST_ERROR.with(|slot| slot.borrow_mut().take())
}
