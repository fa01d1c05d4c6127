//! Several tensors as one argument of a node: candle's custom ops take at
//! most three.

use std::sync::{Arc, Mutex};

use candle_core::{CustomOp2, Result, Tensor};

use super::attach::{forward_computed, Computed};

/// Where an op's backward leaves the gradients of a bundle's tensors until
/// the bundle's nodes hand them out.
#[derive(Clone, Default)]
pub(crate) struct Slot(Arc<Mutex<Option<Vec<Option<Tensor>>>>>);

impl Slot {
    /// [`Slot::put_all`] for a bundle of two tensors.
    pub fn put(&self, node: &Tensor, a: Tensor, b: Tensor) -> Result<Option<Tensor>> {
        self.put_all(node, vec![a, b])
    }

    /// Leaves the gradients of the bundled tensors, in the bundle's order,
    /// if the bundle `node` takes part in the backward; gives the gradient
    /// to return for the bundle itself (zeros: candle wants one for every
    /// tracked argument).
    pub fn put_all(&self, node: &Tensor, grads: Vec<Tensor>) -> Result<Option<Tensor>> {
        if !node.track_op() {
            return Ok(None);
        }
        *crate::lock(&self.0) = Some(grads.into_iter().map(Some).collect());
        Ok(Some(node.zeros_like()?))
    }

    /// The gradient of the `i`-th bundled tensor, handed out once.
    fn take(&self, i: usize) -> Result<Tensor> {
        crate::lock(&self.0)
            .as_mut()
            .and_then(|grads| grads.get_mut(i).and_then(Option::take))
            .ok_or_else(|| {
                candle_core::Error::Msg(
                    "remat nn: a fused op's parameters have no gradients: their bundle's \
                     backward ran before the op's (report this as a bug)"
                        .into(),
                )
            })
    }
}

/// One link of a bundle: the `first`-th tensor and either the next link or,
/// in the last link, the last tensor.
struct Bundle {
    out: Computed,
    slot: Slot,
    first: usize,
    last: bool,
}

/// `a` and `b` as one tensor: [`bundle_all`] of two.
pub(crate) fn bundle(a: &Tensor, b: &Tensor) -> Result<(Tensor, Slot)> {
    bundle_all(&[a, b])
}

/// Two or more tensors as one tensor of one element, whose nodes (a chain
/// of two-argument links) have them as arguments, and the slot where the op
/// that reads it leaves their gradients. The bundle must be read by that
/// one op only: candle runs its links' backward after the op's (their only
/// consumer), which fills the slot.
pub(crate) fn bundle_all(tensors: &[&Tensor]) -> Result<(Tensor, Slot)> {
    let n = tensors.len();
    if n < 2 {
        candle_core::bail!("remat nn: a bundle holds at least two tensors, got {n}");
    }
    let slot = Slot::default();
    let link = |a: &Tensor, b: &Tensor, first: usize, last: bool| {
        let op = Bundle {
            out: Computed::new(Tensor::zeros(1, a.dtype(), a.device())?),
            slot: slot.clone(),
            first,
            last,
        };
        a.apply_op2(b, op)
    };
    let mut node = link(tensors[n - 2], tensors[n - 1], n - 2, true)?;
    for first in (0..n - 2).rev() {
        node = link(tensors[first], &node, first, false)?;
    }
    Ok((node, slot))
}

impl CustomOp2 for Bundle {
    forward_computed!("remat-bundle", s1 l1, s2 l2);
    fn bwd(
        &self,
        _: &Tensor,
        next: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let a = self.slot.take(self.first)?;
        let b = if self.last {
            self.slot.take(self.first + 1)?
        } else {
            // The next link: its own backward hands out the rest.
            next.zeros_like()?
        };
        Ok((Some(a), Some(b)))
    }
}
