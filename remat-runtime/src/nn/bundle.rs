//! Two tensors as one argument of a node: candle's custom ops take at most
//! three.

use std::sync::{Arc, Mutex};

use candle_core::{CustomOp2, Result, Tensor};

use super::attach::{forward_computed, Computed};

/// Where an op's backward leaves the gradients of a bundle's two tensors
/// until the bundle's backward hands them out.
#[derive(Clone, Default)]
pub(crate) struct Slot(Arc<Mutex<Option<(Tensor, Tensor)>>>);

impl Slot {
    /// Leaves the gradients of the bundled tensors, if the bundle `node`
    /// takes part in the backward; gives the gradient to return for the
    /// bundle itself (zeros: candle wants one for every tracked argument).
    pub fn put(&self, node: &Tensor, a: Tensor, b: Tensor) -> Result<Option<Tensor>> {
        if !node.track_op() {
            return Ok(None);
        }
        *crate::lock(&self.0) = Some((a, b));
        Ok(Some(node.zeros_like()?))
    }
}

/// The node of a bundle: a one-element output whose arguments are the two
/// tensors.
struct Bundle {
    out: Computed,
    slot: Slot,
}

/// `a` and `b` as one tensor of one element whose node has them as its
/// arguments, and the slot where the op that reads it leaves their
/// gradients. The bundle must be read by that one op only: candle runs its
/// backward after the op's (its only consumer), which fills the slot.
pub(crate) fn bundle(a: &Tensor, b: &Tensor) -> Result<(Tensor, Slot)> {
    let slot = Slot::default();
    let op = Bundle {
        out: Computed::new(Tensor::zeros(1, a.dtype(), a.device())?),
        slot: slot.clone(),
    };
    Ok((a.apply_op2(b, op)?, slot))
}

impl CustomOp2 for Bundle {
    forward_computed!("remat-bundle", s1 l1, s2 l2);
    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (a, b) = crate::lock(&self.slot.0).take().ok_or_else(|| {
            candle_core::Error::Msg(
                "remat nn: a fused op's parameters have no gradients: their bundle's backward ran \
                 before the op's (report this as a bug)"
                    .into(),
            )
        })?;
        Ok((Some(a), Some(b)))
    }
}
