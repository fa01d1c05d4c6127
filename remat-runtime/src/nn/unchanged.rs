//! A tensor a fused op keeps for its backward without a gradient of its own
//! (an additive mask, a bias, rotary tables) must still hold the forward's
//! values when the backward reads it: a write into it in between
//! (`slice_set`, `Var::set`, a storage shared with another tensor) would
//! give wrong gradients without a word, where candle's composed ops keep
//! what they need (the softmax's output). candle has no version counters,
//! so the op takes the tensor's digest in the forward and compares it
//! before its backward reads the tensor.
//!
//! On the CPU, with the replay check on (not inside
//! `without_fingerprints`): one pass over the tensor at memory speed in
//! each direction. Off the CPU nothing is checked (a comparison there would
//! wait on the device in every op's backward).

use candle_core::{Result, Tensor};

use crate::tape::{checksum, fingerprint};

/// The forward's digest of a tensor an op's backward reads.
pub(super) struct Unchanged(Option<[f64; checksum::WORDS]>);

impl Unchanged {
    /// `t`'s digest now, where it is checked (see the module).
    pub fn of(t: &Tensor) -> Unchanged {
        Unchanged(
            fingerprint::enabled()
                .then(|| checksum::bits_on_cpu(t))
                .flatten(),
        )
    }

    /// Nothing to check: no backward reads the tensor.
    pub fn none() -> Unchanged {
        Unchanged(None)
    }

    /// An error naming `op` and `what` (`"the mask"`) if `t` no longer
    /// holds the values it held when [`Unchanged::of`] took its digest.
    pub fn check(&self, t: &Tensor, op: &str, what: &str) -> Result<()> {
        let Some(forward) = self.0 else {
            return Ok(());
        };
        let now = checksum::bits_on_cpu(t);
        let same = now.is_some_and(|now| {
            now.iter()
                .zip(&forward)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        });
        if !same {
            candle_core::bail!(
                "{op}: {what} {:?} changed between the forward and the backward (written in \
                 place: `slice_set`, `Var::set`, or a storage shared with another tensor), and \
                 the backward reads it: its gradients would be wrong. Write the new values \
                 into a new tensor, or change it after the backward",
                t.dims()
            )
        }
        Ok(())
    }
}
