//! The custom candle ops that attach a region to candle's graph.
//!
//! * anchors: a chain of nodes whose arguments are the tensors that need
//!   gradients (tracked region inputs and parameters). The top anchor runs the
//!   region's backward; every anchor hands back the gradient of its argument.
//! * taps: one per region output, each an op on the top anchor whose forward
//!   copies the output the block computed and whose backward stashes the
//!   output's gradient.
//! * seeds: start a candle backward from a tensor with a given upstream
//!   gradient, without building `(out * g).sum()`.

use std::sync::{Arc, Mutex};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Storage, Tensor,
};

use crate::state::RegionState;

/// A scalar `f32` zero on the device of `like`.
fn scalar_zero<S>(like: &S) -> candle_core::Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let shape = Shape::from(());
    Ok((like.device().zeros_impl(&shape, DType::F32)?, shape))
}

/// Copies the elements `layout` addresses in `src` into a new contiguous storage.
fn copy_compact<S>(src: &S, layout: &Layout) -> candle_core::Result<(S, Shape)>
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

fn wrong_device(op: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "remat: the output stashed for {op} is on a different device than the region"
    ))
}

/// Turns a runtime error raised inside candle's backward into a candle error,
/// remembering the typed error for [`crate::backward`].
pub(crate) fn to_candle(e: crate::RematError) -> candle_core::Error {
    crate::retain::remember_error(&e);
    candle_core::Error::wrap(e)
}

/// The first anchor of a chain: one argument.
pub(crate) struct AnchorFirst {
    pub state: Arc<RegionState>,
    pub top: bool,
}

/// Every further anchor: the previous anchor and one more argument.
pub(crate) struct AnchorLink {
    pub state: Arc<RegionState>,
    pub index: usize,
    pub top: bool,
}

fn anchor_grad(
    state: &RegionState,
    index: usize,
    top: bool,
    arg: &Tensor,
) -> candle_core::Result<Option<Tensor>> {
    if top {
        state.backward().map_err(to_candle)?;
    }
    match state.take_result(index) {
        Some(g) => Ok(Some(g)),
        // Candle skips variables that get no gradient, but panics on a tracked
        // non-variable node that gets none: hand back zeros there.
        None if arg.is_variable() => Ok(None),
        None => Ok(Some(arg.zeros_like()?)),
    }
}

impl CustomOp1 for AnchorFirst {
    fn name(&self) -> &'static str {
        "remat-anchor"
    }
    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        scalar_zero(s)
    }
    fn cuda_fwd(&self, s: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        scalar_zero(s)
    }
    fn bwd(&self, arg: &Tensor, _: &Tensor, _: &Tensor) -> candle_core::Result<Option<Tensor>> {
        anchor_grad(&self.state, 0, self.top, arg)
    }
}

impl CustomOp2 for AnchorLink {
    fn name(&self) -> &'static str {
        "remat-anchor"
    }
    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        scalar_zero(s)
    }
    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        scalar_zero(s)
    }
    fn bwd(
        &self,
        prev: &Tensor,
        arg: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = anchor_grad(&self.state, self.index, self.top, arg)?;
        Ok((Some(prev.zeros_like()?), g))
    }
}

/// A region output: copies the stashed value in its forward, stashes the
/// output's gradient in its backward.
pub(crate) struct Tap {
    pub state: Arc<RegionState>,
    pub index: usize,
    pub stash: Mutex<Option<Tensor>>,
}

impl Tap {
    fn with_stash<R>(
        &self,
        f: impl FnOnce(&Storage, &Layout) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let stashed = self
            .stash
            .lock()
            .map_err(|_| candle_core::Error::Msg("remat: poisoned tap".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("remat: tap evaluated twice".into()))?;
        let (storage, layout) = stashed.storage_and_layout();
        f(&storage, layout)
    }
}

impl CustomOp1 for Tap {
    fn name(&self) -> &'static str {
        "remat-tap"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.with_stash(|s, l| match s {
            Storage::Cpu(s) => copy_compact(s, l),
            _ => Err(wrong_device("a region output")),
        })
    }
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        self.with_stash(|s, l| match s {
            Storage::Cuda(s) => copy_compact(s, l),
            _ => Err(wrong_device("a region output")),
        })
    }
    fn bwd(&self, arg: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.state.stash_output_grad(self.index, grad.clone());
        Ok(Some(arg.zeros_like()?))
    }
}

/// Starts a backward from its argument with upstream gradient `grad`.
pub(crate) struct Seed {
    pub grad: Tensor,
}

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "remat-seed"
    }
    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        scalar_zero(s)
    }
    fn cuda_fwd(&self, s: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        scalar_zero(s)
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.grad.clone()))
    }
}
