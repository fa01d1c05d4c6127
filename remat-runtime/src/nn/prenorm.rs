//! The norm in front of a fused op (a pre-norm transformer's), computed
//! inside the op: the graph keeps the op's input, and the normalized input
//! is recomputed in the backward from one mean and `1/std` per row.

use candle_core::{DType, Result, Tensor, D};

use super::norm::{norm_grads, normalize, renormalize, scale_shift, sum_rows};
use super::norm_pass::work_dtype;
use super::{kernels, norm_pass};

/// The norm a fused op applies to its input first: layer norm (gain and
/// bias) or RMS norm (gain), over the last dimension, as
/// [`layer_norm`](super::layer_norm) and [`rms_norm`](super::rms_norm)
/// compute them.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// let g = Tensor::ones(4, DType::F32, &Device::Cpu)?;
/// let b = Tensor::zeros(4, DType::F32, &Device::Cpu)?;
/// let _layer = remat_runtime::nn::PreNorm::Layer { gain: &g, bias: &b, eps: 1e-5 };
/// let _rms = remat_runtime::nn::PreNorm::Rms { gain: &g, eps: 1e-6 };
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub enum PreNorm<'a> {
    /// `(x - mean) / sqrt(var + eps) * gain + bias`.
    Layer {
        /// Gain, `(C)`.
        gain: &'a Tensor,
        /// Bias, `(C)`.
        bias: &'a Tensor,
        /// Added to the variance.
        eps: f64,
    },
    /// `x / sqrt(mean(x^2) + eps) * gain`.
    Rms {
        /// Gain, `(C)`.
        gain: &'a Tensor,
        /// Added to the mean square.
        eps: f64,
    },
}

impl<'a> PreNorm<'a> {
    /// The norm's parameters, in the order their gradients come back.
    pub(super) fn params(&self) -> Vec<&'a Tensor> {
        match *self {
            PreNorm::Layer { gain, bias, .. } => vec![gain, bias],
            PreNorm::Rms { gain, .. } => vec![gain],
        }
    }
}

/// A norm applied in a forward: what its backward reads.
pub(super) struct Normed {
    gain: Tensor,
    /// The layer norm's bias; `None` for an RMS norm.
    bias: Option<Tensor>,
    /// Per row, `(rows, 1)`; `None` for an RMS norm.
    mean: Option<Tensor>,
    /// Per row, `1 / sqrt(var + eps)` or `1 / rms`, `(rows, 1)`.
    rstd: Tensor,
    /// The parameters' own dtypes (the gradients'), gain first.
    dtypes: Vec<DType>,
    /// Set when one pass normalized the rows (`norm.cu`'s kernels on CUDA,
    /// `norm_pass` on the CPU): the parameters as given and eps, for their
    /// recompute and backward.
    kernel: Option<Kernel>,
}

/// Whether one pass can normalize the rows of `x`: `norm.cu`'s kernels on
/// CUDA, `norm_pass` on the CPU.
fn one_pass(x: &Tensor, gain: &Tensor, bias: Option<&Tensor>) -> bool {
    kernels::norm_fit(x, gain, bias) || norm_pass::fit(x, gain, bias)
}

/// The rows of `x` normalized in one pass, with each row's mean and
/// `1 / std` (see [`one_pass`]).
fn one_pass_forward(
    x: &Tensor,
    gain: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    if x.device().is_cpu() {
        norm_pass::forward(x, gain, bias, eps)
    } else {
        kernels::norm_forward(x, gain, bias, eps)
    }
}

/// What the norm's one pass reads again after the forward.
struct Kernel {
    gain: Tensor,
    bias: Option<Tensor>,
    eps: f64,
}

impl Normed {
    /// The normalized rows of `x` `(rows, C)` (detached) and what the
    /// backward reads.
    /// Computed in f32 for f16 and bf16 inputs, as the norms are.
    pub fn forward(norm: &PreNorm, x: &Tensor) -> Result<(Tensor, Normed)> {
        let (gain, bias, eps) = match *norm {
            PreNorm::Layer { gain, bias, eps } => (gain, Some(bias), eps),
            PreNorm::Rms { gain, eps } => (gain, None, eps),
        };
        if one_pass(x, gain, bias) {
            let (y, mean, rstd) = one_pass_forward(x, gain, bias, eps)?;
            let work = rstd.dtype();
            let normed = Normed {
                gain: gain.detach().to_dtype(work)?,
                bias: bias.map(|b| b.detach().to_dtype(work)).transpose()?,
                mean: bias.is_some().then_some(mean),
                rstd,
                dtypes: norm.params().iter().map(|p| p.dtype()).collect(),
                kernel: Some(Kernel {
                    gain: gain.detach(),
                    bias: bias.map(Tensor::detach),
                    eps,
                }),
            };
            return Ok((y, normed));
        }
        let dtype = x.dtype();
        let x = &x.to_dtype(work_dtype(dtype))?;
        let work = x.dtype();
        let (y, normed) = match *norm {
            PreNorm::Layer { gain, bias, eps } => {
                let (xhat, mean, rstd) = normalize(x, eps)?;
                let (gain, bias) = (gain.detach().to_dtype(work)?, bias.detach().to_dtype(work)?);
                let y = scale_shift(&xhat, &gain, &bias)?;
                let normed = Normed {
                    gain,
                    bias: Some(bias),
                    mean: Some(mean),
                    rstd,
                    dtypes: norm.params().iter().map(|p| p.dtype()).collect(),
                    kernel: None,
                };
                (y, normed)
            }
            PreNorm::Rms { gain, eps } => {
                let rstd = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
                let gain = gain.detach().to_dtype(work)?;
                let y = x.broadcast_mul(&rstd)?.broadcast_mul(&gain)?;
                let normed = Normed {
                    gain,
                    bias: None,
                    mean: None,
                    rstd,
                    dtypes: norm.params().iter().map(|p| p.dtype()).collect(),
                    kernel: None,
                };
                (y, normed)
            }
        };
        Ok((y.to_dtype(dtype)?, normed))
    }

    /// `x / std` (centered for a layer norm), recomputed from `x`.
    fn xhat(&self, x: &Tensor) -> Result<Tensor> {
        match &self.mean {
            Some(mean) => renormalize(x, mean, &self.rstd),
            None => x.to_dtype(self.rstd.dtype())?.broadcast_mul(&self.rstd),
        }
    }

    /// The normalized rows, recomputed from `x` as the forward computed
    /// them.
    pub fn recompute(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(k) = self
            .kernel
            .as_ref()
            .filter(|k| one_pass(x, &k.gain, k.bias.as_ref()))
        {
            // The forward's pass again: the forward's bits.
            return Ok(one_pass_forward(x, &k.gain, k.bias.as_ref(), k.eps)?.0);
        }
        let xhat = self.xhat(x)?;
        match &self.bias {
            Some(bias) => scale_shift(&xhat, &self.gain, bias),
            None => xhat.broadcast_mul(&self.gain),
        }?
        .to_dtype(x.dtype())
    }

    /// The gradients of `x` and of the norm's parameters (gain, then the
    /// bias of a layer norm) for the gradient `dy` of the normalized rows,
    /// in `x`'s dtype and the parameters' own.
    pub fn backward(&self, x: &Tensor, dy: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        let (dx, grads) = self.backward_work(x, dy)?;
        let grads = grads
            .into_iter()
            .zip(&self.dtypes)
            .map(|(g, &dtype)| g.to_dtype(dtype))
            .collect::<Result<_>>()?;
        Ok((dx.to_dtype(x.dtype())?, grads))
    }

    /// [`Normed::backward`] with every gradient left in the dtype the norm
    /// computes in (`f32` for f16 and bf16 inputs), for a caller that
    /// sums or scales them further before rounding.
    pub fn backward_work(&self, x: &Tensor, dy: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        // The CUDA kernels take dy in x's dtype only (a caller's f32
        // gradient of bf16 rows stays f32 on the composed path there).
        if let Some(k) = self.kernel.as_ref().filter(|k| {
            let bias = k.bias.as_ref();
            norm_pass::fit(x, &k.gain, bias)
                || (dy.dtype() == x.dtype() && kernels::norm_fit(x, &k.gain, bias))
        }) {
            let layer = k.bias.is_some();
            let mean = match &self.mean {
                Some(mean) => mean.clone(),
                None => self.rstd.zeros_like()?,
            };
            let stats = (&mean, &self.rstd);
            let (dx, dg, db) = if x.device().is_cpu() {
                norm_pass::backward(x, &k.gain, dy, stats, layer)?
            } else {
                kernels::norm_backward(x, &k.gain, dy, stats, layer)?
            };
            return Ok((dx, if layer { vec![dg, db] } else { vec![dg] }));
        }
        let xhat = self.xhat(x)?;
        let dy = dy.to_dtype(self.rstd.dtype())?;
        let layer = self.mean.is_some();
        let (dx, dg) = norm_grads(&xhat, &self.rstd, &self.gain, &dy, layer)?;
        let mut grads = vec![dg];
        if layer {
            grads.push(sum_rows(&dy)?);
        }
        Ok((dx, grads))
    }
}

/// The rows `x` normalized by `norm`, and what its backward reads (`x`
/// itself and nothing without a norm).
pub(super) fn norm_forward(norm: Option<&PreNorm>, x: Tensor) -> Result<(Tensor, Option<Normed>)> {
    let _profile = crate::inspect::profile::op("(inside an op) norm");
    match norm {
        Some(norm) => {
            let (n, normed) = Normed::forward(norm, &x)?;
            Ok((n, Some(normed)))
        }
        None => Ok((x, None)),
    }
}

/// `x`'s rows normalized as `norm`'s forward did (`x` itself without a
/// norm).
pub(super) fn normalized(norm: Option<&Normed>, x: &Tensor) -> Result<Tensor> {
    match norm {
        Some(normed) => normed.recompute(x),
        None => Ok(x.clone()),
    }
}

/// The gradient of `x` and of the norm's parameters for the gradient `dn`
/// of its normalized rows (`dn` itself and none without a norm).
pub(super) fn norm_backward(
    norm: Option<&Normed>,
    x: &Tensor,
    dn: Tensor,
) -> Result<(Tensor, Vec<Tensor>)> {
    match norm {
        Some(normed) => normed.backward(x, &dn),
        None => Ok((dn, Vec::new())),
    }
}
