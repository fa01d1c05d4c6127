//! `candle_nn::ops`' fused ops that have no backward in candle, with one:
//! [`rms_norm`], [`layer_norm`], [`softmax_last_dim`].
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use remat_runtime::candle_nn::ops;
//!
//! let x = Var::new(&[[1f32, 2., 3.]], &Device::Cpu)?;
//! let alpha = Var::new(&[1f32, 1., 1.], &Device::Cpu)?;
//! let y = ops::softmax_last_dim(&ops::rms_norm(&x, &alpha, 1e-6)?)?;
//! let grads = y.narrow(1, 0, 1)?.sum_all()?.backward()?;
//! assert!(grads.get(&x).is_some() && grads.get(&alpha).is_some());
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{bail, Result, Tensor};

use crate::nn;

/// `candle_nn::ops::rms_norm` with a backward: `alpha * xs /
/// sqrt(mean(xs^2) + eps)` over the last dimension, `alpha` of that
/// dimension's size. The
/// graph keeps `xs`, `alpha` and one number per row ([`nn::rms_norm`]); in
/// bf16 and f16 the norm is computed in f32 and rounded once.
///
/// ```
/// use candle_core::{Device, Var};
/// let x = Var::new(&[[3f32, 4.]], &Device::Cpu)?;
/// let alpha = Var::new(&[1f32, 2.], &Device::Cpu)?;
/// let y = remat_runtime::candle_nn::ops::rms_norm(&x, &alpha, 0.0)?;
/// let rms = 12.5f32.sqrt(); // of 3 and 4
/// let y = y.to_vec2::<f32>()?;
/// assert!((y[0][0] - 3. / rms).abs() < 1e-6 && (y[0][1] - 8. / rms).abs() < 1e-6);
/// let grads = remat_runtime::candle_nn::ops::rms_norm(&x, &alpha, 0.0)?.sum_all()?.backward()?;
/// assert!(grads.get(&alpha).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rms_norm(xs: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
    check_norm("ops::rms_norm", xs, alpha, None)?;
    norm(xs, alpha, None, false, eps as f64)
}

/// `candle_nn::ops::layer_norm` with a backward: `(xs - mean) / sqrt(var +
/// eps) * alpha + beta` over the last dimension. The graph keeps `xs`,
/// `alpha`, `beta` and two numbers per row ([`nn::layer_norm`]); in bf16 and
/// f16 the norm is computed in f32 and rounded once.
///
/// ```
/// use candle_core::{Device, Var};
/// let dev = Device::Cpu;
/// let x = Var::new(&[[1f32, 2., 3.]], &dev)?;
/// let (alpha, beta) = (Var::new(&[1f32, 1., 1.], &dev)?, Var::new(&[0f32, 0., 0.], &dev)?);
/// let y = remat_runtime::candle_nn::ops::layer_norm(&x, &alpha, &beta, 1e-5)?;
/// let grads = (&y * &y)?.sum_all()?.backward()?;
/// assert!(grads.get(&x).is_some() && grads.get(&beta).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn layer_norm(xs: &Tensor, alpha: &Tensor, beta: &Tensor, eps: f32) -> Result<Tensor> {
    check_norm("ops::layer_norm", xs, alpha, Some(beta))?;
    norm(xs, alpha, Some(beta), true, eps as f64)
}

/// `candle_nn::ops::softmax_last_dim` with a backward: candle's fused
/// forward (the same values, bit for bit), and a backward that reads only
/// the output ([`nn::softmax_last_dim`]).
///
/// ```
/// use candle_core::{Device, Var};
/// let x = Var::new(&[[0f32, 0.]], &Device::Cpu)?;
/// let y = remat_runtime::candle_nn::ops::softmax_last_dim(&x)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[0.5, 0.5]]);
/// let grads = y.narrow(1, 0, 1)?.sum_all()?.backward()?;
/// assert_eq!(grads.get(&x).unwrap().to_vec2::<f32>()?, [[0.25, -0.25]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn softmax_last_dim(xs: &Tensor) -> Result<Tensor> {
    if xs.rank() == 0 || !xs.dtype().is_float() {
        bail!(
            "remat_runtime::candle_nn::ops::softmax_last_dim: expected a floating-point tensor \
             with at least one dimension, got {:?} {:?}",
            xs.dtype(),
            xs.shape()
        )
    }
    nn::softmax_last_dim(&xs.contiguous()?)
}

/// Fails, naming `op` and the shapes, unless `alpha` (and `beta`) are
/// one-dimensional of the size of the last dimension of `x`, all of one
/// floating-point dtype and on one device.
pub(super) fn check_norm(
    op: &str,
    x: &Tensor,
    alpha: &Tensor,
    beta: Option<&Tensor>,
) -> Result<()> {
    let shapes = || {
        let beta = beta.map_or(String::new(), |b| format!(", beta {:?}", b.shape()));
        format!("x {:?}, alpha {:?}{beta}", x.shape(), alpha.shape())
    };
    let Some(&n) = x.dims().last() else {
        bail!(
            "remat_runtime::candle_nn::{op}: x has no dimension to normalize ({})",
            shapes()
        )
    };
    for (name, t) in [("alpha", Some(alpha)), ("beta", beta)] {
        let Some(t) = t else { continue };
        if t.dims() != [n] {
            bail!(
                "remat_runtime::candle_nn::{op}: {name} must be [{n}], the size of x's last \
                 dimension ({})",
                shapes()
            )
        }
        if t.dtype() != x.dtype() || !t.device().same_device(x.device()) {
            bail!(
                "remat_runtime::candle_nn::{op}: x is {:?} on {:?} but {name} is {:?} on {:?} ({})",
                x.dtype(),
                x.device().location(),
                t.dtype(),
                t.device().location(),
                shapes()
            )
        }
    }
    if !x.dtype().is_float() {
        bail!(
            "remat_runtime::candle_nn::{op}: expected a floating-point dtype, got {:?} ({})",
            x.dtype(),
            shapes()
        )
    }
    Ok(())
}

/// The norm of `x` over its last dimension with gain `alpha` and an
/// optional bias: a layer norm when `remove_mean`, else an RMS norm; in f32
/// for dtypes narrower than f32 (the shapes are checked by the caller).
pub(super) fn norm(
    x: &Tensor,
    alpha: &Tensor,
    beta: Option<&Tensor>,
    remove_mean: bool,
    eps: f64,
) -> Result<Tensor> {
    // `nn`'s norms compute bf16 and f16 in f32 themselves.
    match (remove_mean, beta) {
        (true, Some(beta)) => nn::layer_norm(x, alpha, beta, eps),
        (true, None) => nn::layer_norm(x, alpha, &alpha.zeros_like()?, eps),
        (false, beta) => {
            let y = nn::rms_norm(x, alpha, eps)?;
            match beta {
                Some(beta) => y.broadcast_add(beta),
                None => Ok(y),
            }
        }
    }
}
