//! Layer norm and RMS norm over the last dimension.

use candle_core::{CustomOp2, CustomOp3, Result, Tensor, D};

use super::attach::{forward_computed, Computed};
use super::norm_pass::{self, work_dtype};

struct LayerNorm {
    out: Computed,
    /// Normalized by `norm_pass` (the CPU's one pass), which the backward
    /// takes too.
    pass: bool,
    /// Per row, `(.., 1)`, in the dtype the norm computes in (`work_dtype`).
    mean: Tensor,
    /// Per row, `1 / sqrt(var + eps)`, `(.., 1)`.
    rstd: Tensor,
}

/// Layer norm over the last dimension: `(x - mean) / sqrt(var + eps) * g + b`,
/// as `candle_nn::ops::layer_norm_slow` computes it, with a backward. The
/// graph keeps `x`, `g`, `b` and the mean and `1/std` of each row (PyTorch
/// keeps the same). On the CPU the forward and the backward are one pass
/// over the rows each, every element computed in f64 (the outputs rounded
/// once; half-precision gradients through f32).
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let x = Var::new(&[[1f32, 2., 3.], [0., 0., 3.]], &dev)?;
/// let g = Var::ones(3, candle_core::DType::F32, &dev)?;
/// let b = Var::zeros(3, candle_core::DType::F32, &dev)?;
/// let y = remat_runtime::nn::layer_norm(&x, &g, &b, 1e-5)?;
/// let grads = (&y * &y)?.sum_all()?.backward()?;
/// assert!(grads.get(&g).is_some() && grads.get(&x).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("layer_norm");
    check_gain("layer_norm", x, g, Some(b))?;
    if let Some(rows) = pass_rows(x, g, Some(b)) {
        let (y, mean, rstd) = norm_pass::forward(&rows, g, Some(b), eps)?;
        let stats = x.dims()[..x.rank() - 1]
            .iter()
            .copied()
            .chain([1])
            .collect::<Vec<_>>();
        let op = LayerNorm {
            out: Computed::new(y.reshape(x.shape())?),
            pass: true,
            mean: mean.reshape(stats.as_slice())?,
            rstd: rstd.reshape(stats.as_slice())?,
        };
        return x.apply_op3(g, b, op);
    }
    let work = work_dtype(x.dtype());
    let (xhat, mean, rstd) = normalize(&x.detach().to_dtype(work)?, eps)?;
    let y = scale_shift(
        &xhat,
        &g.detach().to_dtype(work)?,
        &b.detach().to_dtype(work)?,
    )?
    .to_dtype(x.dtype())?;
    let op = LayerNorm {
        out: Computed::new(y),
        pass: false,
        mean,
        rstd,
    };
    x.apply_op3(g, b, op)
}

/// An error naming `op`'s gain `g` or shift `b` when either is not
/// `(C,)` (or broadcast from it), `C` the width of `x`'s rows.
pub(super) fn check_gain(op: &str, x: &Tensor, g: &Tensor, b: Option<&Tensor>) -> Result<()> {
    let Some(&c) = x.dims().last() else {
        candle_core::bail!("{op}: the input is a scalar; a norm reads (.., C) rows");
    };
    for (what, t) in [("gain", Some(g)), ("shift", b)] {
        if let Some(t) = t.filter(|t| t.dims().last() != Some(&c)) {
            candle_core::bail!(
                "{op}: the {what} has shape {:?} but the input {:?} has rows {c} wide: it is ({c},)",
                t.dims(),
                x.dims()
            );
        }
    }
    Ok(())
}

/// `x` (detached) as `(rows, C)` when the CPU's one pass can normalize its
/// rows (see `norm_pass`), at least one row and one feature.
pub(super) fn pass_rows(x: &Tensor, g: &Tensor, b: Option<&Tensor>) -> Option<Tensor> {
    let c = *x.dims().last()?;
    if x.elem_count() == 0 || !x.device().is_cpu() {
        return None;
    }
    let rows = x.detach().reshape((x.elem_count() / c, c)).ok()?;
    norm_pass::fit(&rows, g, b).then_some(rows)
}

/// `(x - mean) / sqrt(var + eps)` over the last dimension, with the mean
/// and `1 / sqrt(var + eps)` of each row, `(.., 1)`.
pub(super) fn normalize(x: &Tensor, eps: f64) -> Result<(Tensor, Tensor, Tensor)> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (var + eps)?.sqrt()?.recip()?;
    Ok((centered.broadcast_mul(&rstd)?, mean, rstd))
}

/// `x` normalized again from the mean and `1 / std` of its rows (what a
/// backward recomputes instead of keeping).
pub(super) fn renormalize(x: &Tensor, mean: &Tensor, rstd: &Tensor) -> Result<Tensor> {
    x.detach()
        .to_dtype(mean.dtype())?
        .broadcast_sub(mean)?
        .broadcast_mul(rstd)
}

/// `xhat * g + beta`: a layer norm's gain and bias.
pub(super) fn scale_shift(xhat: &Tensor, g: &Tensor, beta: &Tensor) -> Result<Tensor> {
    xhat.broadcast_mul(g)?.broadcast_add(beta)
}

/// The gradients of `x` and the gain, for a norm whose normalized input is
/// `xhat = x * rstd` after centering; `center` says whether the mean was
/// subtracted (layer norm) or not (RMS norm).
pub(super) fn norm_grads(
    xhat: &Tensor,
    rstd: &Tensor,
    g: &Tensor,
    dy: &Tensor,
    center: bool,
) -> Result<(Tensor, Tensor)> {
    let dxhat = dy.broadcast_mul(g)?;
    let proj = (&dxhat * xhat)?.mean_keepdim(D::Minus1)?;
    let mut dx = (&dxhat - xhat.broadcast_mul(&proj)?)?;
    if center {
        dx = dx.broadcast_sub(&dxhat.mean_keepdim(D::Minus1)?)?;
    }
    let dx = dx.broadcast_mul(rstd)?;
    let dg = sum_rows(&(dy * xhat)?)?;
    Ok((dx, dg))
}

/// `t` summed over every dimension but the last: a gain's or bias's
/// gradient.
pub(super) fn sum_rows(t: &Tensor) -> Result<Tensor> {
    t.sum((0..t.rank() - 1).collect::<Vec<_>>())
}

impl CustomOp3 for LayerNorm {
    forward_computed!("remat-layer-norm", s1 l1, s2 l2, s3 l3);
    fn bwd(
        &self,
        x: &Tensor,
        g: &Tensor,
        b: &Tensor,
        _: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _profile = crate::inspect::profile::backward("layer_norm");
        if self.pass {
            let (rows, c) = (x.elem_count() / x.dim(D::Minus1)?, x.dim(D::Minus1)?);
            let stats = (&self.mean, &self.rstd);
            let (dx, dg, db) = norm_pass::backward(
                &x.detach().reshape((rows, c))?,
                &g.detach(),
                &dy.detach().reshape((rows, c))?,
                stats,
                true,
            )?;
            return Ok((
                Some(dx.reshape(x.shape())?.to_dtype(x.dtype())?),
                Some(dg.to_dtype(g.dtype())?),
                Some(db.to_dtype(b.dtype())?),
            ));
        }
        let work = self.rstd.dtype();
        let dy = dy.detach().to_dtype(work)?;
        let xhat = renormalize(x, &self.mean, &self.rstd)?;
        let (dx, dg) = norm_grads(&xhat, &self.rstd, &g.detach().to_dtype(work)?, &dy, true)?;
        let db = sum_rows(&dy)?;
        Ok((
            Some(dx.to_dtype(x.dtype())?),
            Some(dg.to_dtype(g.dtype())?),
            Some(db.to_dtype(b.dtype())?),
        ))
    }
}

struct RmsNorm {
    out: Computed,
    /// Normalized by `norm_pass`, which the backward takes too.
    pass: bool,
    /// Per row, `1 / sqrt(mean(x^2) + eps)`, `(.., 1)`.
    rstd: Tensor,
}

/// RMS norm over the last dimension: `x / sqrt(mean(x^2) + eps) * g`, as
/// `candle_nn::ops::rms_norm_slow` computes it, with a backward. The graph
/// keeps `x`, `g` and `1/rms` of each row. On the CPU, one pass over the
/// rows each way, every element in f64.
///
/// ```
/// use candle_core::{Device, Var};
/// let dev = Device::Cpu;
/// let x = Var::new(&[[1f32, 2., 3.]], &dev)?;
/// let g = Var::ones(3, candle_core::DType::F32, &dev)?;
/// let y = remat_runtime::nn::rms_norm(&x, &g, 1e-6)?;
/// let grads = y.sum_all()?.backward()?;
/// assert!(grads.get(&g).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rms_norm(x: &Tensor, g: &Tensor, eps: f64) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("rms_norm");
    check_gain("rms_norm", x, g, None)?;
    if let Some(rows) = pass_rows(x, g, None) {
        let (y, _, rstd) = norm_pass::forward(&rows, g, None, eps)?;
        let stats = x.dims()[..x.rank() - 1]
            .iter()
            .copied()
            .chain([1])
            .collect::<Vec<_>>();
        let op = RmsNorm {
            out: Computed::new(y.reshape(x.shape())?),
            pass: true,
            rstd: rstd.reshape(stats.as_slice())?,
        };
        return x.apply_op2(g, op);
    }
    let xd = x.detach().to_dtype(work_dtype(x.dtype()))?;
    let rstd = (xd.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let y = xd
        .broadcast_mul(&rstd)?
        .broadcast_mul(&g.detach().to_dtype(xd.dtype())?)?
        .to_dtype(x.dtype())?;
    let op = RmsNorm {
        out: Computed::new(y),
        pass: false,
        rstd,
    };
    x.apply_op2(g, op)
}

impl CustomOp2 for RmsNorm {
    forward_computed!("remat-rms-norm", s1 l1, s2 l2);
    fn bwd(
        &self,
        x: &Tensor,
        g: &Tensor,
        _: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _profile = crate::inspect::profile::backward("rms_norm");
        if self.pass {
            let (rows, c) = (x.elem_count() / x.dim(D::Minus1)?, x.dim(D::Minus1)?);
            let mean = self.rstd.zeros_like()?;
            let (dx, dg, _) = norm_pass::backward(
                &x.detach().reshape((rows, c))?,
                &g.detach(),
                &dy.detach().reshape((rows, c))?,
                (&mean, &self.rstd),
                false,
            )?;
            return Ok((
                Some(dx.reshape(x.shape())?.to_dtype(x.dtype())?),
                Some(dg.to_dtype(g.dtype())?),
            ));
        }
        let work = self.rstd.dtype();
        let xhat = x.detach().to_dtype(work)?.broadcast_mul(&self.rstd)?;
        let (g32, dy32) = (g.detach().to_dtype(work)?, dy.detach().to_dtype(work)?);
        let (dx, dg) = norm_grads(&xhat, &self.rstd, &g32, &dy32, false)?;
        Ok((Some(dx.to_dtype(x.dtype())?), Some(dg.to_dtype(g.dtype())?)))
    }
}
