//! The anchor chain: the tensors that need gradients, tied to a region call.

use std::sync::Arc;

use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp3, Layout, Shape, Tensor};

use super::{scalar_zero, to_candle};
use crate::backward::Call;
use crate::Result;

/// The first anchor of a chain: one argument.
struct AnchorFirst {
    call: Arc<Call>,
    top: bool,
}

/// Every further anchor: the previous anchor and two more arguments (the
/// second is the first again when one is left), so that a call adds half
/// as many nodes to candle's graph as it anchors tensors.
struct AnchorLink {
    call: Arc<Call>,
    /// The position of the first of the two arguments.
    index: usize,
    /// Whether the second argument is a real one.
    pair: bool,
    top: bool,
}

fn anchor_grad(
    call: &Call,
    index: usize,
    top: bool,
    arg: &Tensor,
) -> candle_core::Result<Option<Tensor>> {
    if top {
        call.backward().map_err(to_candle)?;
    }
    match call.take_anchor_grad(index) {
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
        anchor_grad(&self.call, 0, self.top, arg)
    }
}

impl CustomOp3 for AnchorLink {
    fn name(&self) -> &'static str {
        "remat-anchor"
    }
    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
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
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        scalar_zero(s)
    }
    fn bwd(
        &self,
        prev: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The top anchor runs the call's backward before any gradient is
        // taken.
        let ga = anchor_grad(&self.call, self.index, self.top, a)?;
        let gb = match self.pair {
            true => anchor_grad(&self.call, self.index + 1, false, b)?,
            false => None,
        };
        Ok((Some(prev.zeros_like()?), ga, gb))
    }
}

/// Builds the anchor chain of `call` over `args` (at least one) and returns
/// its top.
pub(crate) fn anchor_chain(call: &Arc<Call>, args: &[Tensor]) -> Result<Tensor> {
    let mut top = args[0].apply_op1(AnchorFirst {
        call: call.clone(),
        top: args.len() == 1,
    })?;
    let mut index = 1;
    while index < args.len() {
        let pair = index + 1 < args.len();
        let link = AnchorLink {
            call: call.clone(),
            index,
            pair,
            top: index + 1 + usize::from(pair) == args.len(),
        };
        let second = &args[index + usize::from(pair)];
        top = top.apply_op3(&args[index], second, link)?;
        index += 1 + usize::from(pair);
    }
    Ok(top)
}
