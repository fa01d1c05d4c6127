//! Taps: the region outputs candle sees.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, Shape, Storage, Tensor};

use super::{copy_compact, wrong_device};
use crate::backward::{Call, TapeState};

/// Attaches a region call's `outputs` to candle's graph: one tap per
/// output on the top of the anchor chain over `anchored` (constants stay as
/// they are); then moves what the call's offloaded statements hold to the
/// host, now that the taps have copied the outputs.
pub(crate) fn attach(
    call: &Arc<Call>,
    anchored: &[Tensor],
    outputs: Vec<Tensor>,
    constant: &[bool],
) -> crate::Result<Vec<Tensor>> {
    let top = super::anchor_chain(call, anchored)?;
    let attached = outputs
        .into_iter()
        .enumerate()
        .map(|(index, t)| {
            if constant[index] {
                return Ok(t);
            }
            let tap = Tap {
                call: call.clone(),
                index,
                value: Mutex::new(Some(t)),
            };
            Ok(top.apply_op1(tap)?)
        })
        .collect::<crate::Result<Vec<Tensor>>>()?;
    if let TapeState::Live { tape, .. } = &mut *crate::lock(&call.tape) {
        tape.swap_out(&call.name)?;
    }
    Ok(attached)
}

/// A region output: copies the value the block computed in its forward,
/// hands the output's gradient to the region call in its backward.
pub(crate) struct Tap {
    pub call: Arc<Call>,
    pub index: usize,
    /// The output the block computed, taken by the tap's forward.
    pub value: Mutex<Option<Tensor>>,
}

impl Tap {
    fn with_value<R>(
        &self,
        f: impl FnOnce(&Storage, &Layout) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let value = self
            .value
            .lock()
            .map_err(|_| candle_core::Error::Msg("remat: poisoned tap".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("remat: tap evaluated twice".into()))?;
        let (storage, layout) = value.storage_and_layout();
        f(&storage, layout)
    }
}

impl CustomOp1 for Tap {
    fn name(&self) -> &'static str {
        "remat-tap"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.with_value(|s, l| match s {
            Storage::Cpu(s) => copy_compact(s, l),
            _ => Err(wrong_device("a region output")),
        })
    }
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        self.with_value(|s, l| match s {
            Storage::Cuda(s) => copy_compact(s, l),
            _ => Err(wrong_device("a region output")),
        })
    }
    fn bwd(&self, arg: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.call.set_output_grad(self.index, grad.clone());
        Ok(Some(arg.zeros_like()?))
    }
}
