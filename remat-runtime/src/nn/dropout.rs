//! Dropout that keeps no mask.

use candle_core::{CustomOp1, Result, Shape, Tensor};

use super::attach::{forward_computed, Computed};
use crate::random;

struct Dropout {
    out: Computed,
    /// The draw the mask comes from: the backward draws it again.
    key: u64,
    p: f64,
}

/// `x * mask / (1 - p)` with a mask drawn from
/// [`remat_runtime::random`](crate::random) (the running statement's stream,
/// so a replay draws the same mask). The graph keeps no mask:
/// the backward draws it again from its key.
///
/// ```
/// use candle_core::{Device, Var};
/// let x = Var::ones(1000, candle_core::DType::F32, &Device::Cpu)?;
/// let y = remat_runtime::nn::dropout(&x, 0.25)?;
/// let g = y.sum_all()?.backward()?.get(&x).unwrap().to_vec1::<f32>()?;
/// // The gradient is the mask itself, scaled: the same elements as `y`.
/// assert_eq!(g, y.to_vec1::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn dropout(x: &Tensor, p: f64) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("dropout");
    if !(0.0..1.0).contains(&p) {
        candle_core::bail!("dropout probability {p} is outside [0, 1)");
    }
    if p == 0.0 {
        return Ok(x.clone());
    }
    let key = random::draw_key();
    let y = (x.detach() * scaled_mask(key, x.shape(), p, x)?)?;
    x.apply_op1(Dropout {
        out: Computed::new(y),
        key,
        p,
    })
}

/// `mask / (1 - p)` of the draw `key`, in `like`'s dtype and device.
fn scaled_mask(key: u64, shape: &Shape, p: f64, like: &Tensor) -> Result<Tensor> {
    let keep = random::uniform_keyed(key, shape, like.device())?
        .ge(p)?
        .to_dtype(like.dtype())?;
    keep * (1.0 / (1.0 - p))
}

impl CustomOp1 for Dropout {
    forward_computed!("remat-dropout", s1 l1);
    fn bwd(&self, x: &Tensor, _: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let _profile = crate::inspect::profile::backward("dropout");
        Ok(Some(
            (dy.detach() * scaled_mask(self.key, x.shape(), self.p, x)?)?,
        ))
    }
}
