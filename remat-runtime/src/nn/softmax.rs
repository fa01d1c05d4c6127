//! Softmax over the last dimension.

use candle_core::{CustomOp1, Result, Tensor, D};

use super::attach::{forward_computed, Computed};

struct Softmax {
    out: Computed,
}

/// Softmax over the last dimension, with candle's fused forward
/// (`candle_nn::ops::softmax_last_dim`, which has no backward in candle)
/// and a backward that reads only the output.
///
/// ```
/// use candle_core::{Device, Var};
/// let x = Var::new(&[[1f32, 2., 3.]], &Device::Cpu)?;
/// let y = remat_runtime::nn::softmax_last_dim(&x)?;
/// let g = y.narrow(1, 2, 1)?.sum_all()?.backward()?;
/// assert!(g.get(&x).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("softmax_last_dim");
    let y = candle_nn::ops::softmax_last_dim(&x.detach())?;
    x.apply_op1(Softmax {
        out: Computed::new(y),
    })
}

impl CustomOp1 for Softmax {
    forward_computed!("remat-softmax", s1 l1);
    fn bwd(&self, _: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let _profile = crate::inspect::profile::backward("softmax");
        let (y, dy) = (y.detach(), dy.detach());
        let dot = (&dy * &y)?.sum_keepdim(D::Minus1)?;
        Ok(Some((dy.broadcast_sub(&dot)? * y)?))
    }
}
