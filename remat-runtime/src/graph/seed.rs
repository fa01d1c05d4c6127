//! Seeds: a candle backward started from a tensor with a given gradient.

use std::sync::Mutex;

use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, Shape, Tensor};

use super::scalar_zero;

/// Starts a backward from its argument with upstream gradient `grad`. The
/// gradient is handed over once, not kept: candle's backward holds it only
/// until it has summed it into the argument's gradient.
pub(crate) struct Seed {
    grad: Mutex<Option<Tensor>>,
}

impl Seed {
    pub fn new(grad: Tensor) -> Self {
        Seed {
            grad: Mutex::new(Some(grad)),
        }
    }
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
        crate::lock(&self.grad)
            .take()
            .map(Some)
            .ok_or_else(|| candle_core::Error::Msg("remat: a seed was run twice".into()))
    }
}
