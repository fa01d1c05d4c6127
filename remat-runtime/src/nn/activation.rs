//! SwiGLU.

use candle_core::{CustomOp1, Result, Tensor, D};

use super::attach::{forward_computed, Computed};

struct Swiglu {
    out: Computed,
}

/// `silu(a) * b` for `x = [a, b]` split in halves along the last dimension,
/// as `candle_nn::ops::swiglu` computes it, with a backward that reads only
/// `x` (candle's composed version also keeps `silu(a)` and the sigmoid).
///
/// ```
/// use candle_core::{Device, Var};
/// let x = Var::new(&[[0f32, 1., 2., 3.]], &Device::Cpu)?;
/// let y = remat_runtime::nn::swiglu(&x)?;
/// assert_eq!(y.dims(), &[1, 2]);
/// let g = y.sum_all()?.backward()?;
/// assert!(g.get(&x).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn swiglu(x: &Tensor) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("swiglu");
    if x.dims().last().is_none_or(|c| c % 2 != 0) {
        candle_core::bail!(
            "swiglu: the input has shape {:?}; its last dimension holds the gate and the value side by side, so it must be even",
            x.dims()
        );
    }
    let y = candle_nn::ops::swiglu(&x.detach())?;
    x.apply_op1(Swiglu {
        out: Computed::new(y),
    })
}

impl CustomOp1 for Swiglu {
    forward_computed!("remat-swiglu", s1 l1);
    fn bwd(&self, x: &Tensor, _: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let _profile = crate::inspect::profile::backward("swiglu");
        let (x, dy) = (x.detach(), dy.detach());
        let half = x.dim(D::Minus1)? / 2;
        let a = x.narrow(D::Minus1, 0, half)?;
        let b = x.narrow(D::Minus1, half, half)?;
        let s = candle_nn::ops::sigmoid(&a)?;
        let silu = (&a * &s)?;
        // d silu / da = s (1 + a (1 - s))
        let dsilu = (&s * ((&a * (1.0 - &s)?)? + 1.0)?)?;
        let da = ((&dy * &b)? * dsilu)?;
        let db = (&dy * silu)?;
        Ok(Some(Tensor::cat(&[da, db], D::Minus1)?))
    }
}
