//! Layer norm followed by a linear layer, as one node.

use candle_core::{CustomOp3, Result, Tensor};

use super::attach::{forward_computed, Computed};
use super::bundle::{bundle, Slot};
use super::linear::{output_dims, product, rows};
use super::norm::{norm_grads, normalize, pass_rows, renormalize, scale_shift, sum_rows};
use super::norm_pass;

struct LayerNormLinear {
    out: Computed,
    /// Per row, `(.., 1)`.
    mean: Tensor,
    /// Per row, `1 / sqrt(var + eps)`, `(.., 1)`.
    rstd: Tensor,
    /// The norm ran as the CPU's one pass (`norm_pass`), with this eps:
    /// the backward recomputes and differentiates it the same way.
    pass: Option<f64>,
    /// The norm's gain and bias, read here; their gradients leave through
    /// the first bundle.
    gain: Tensor,
    shift: Tensor,
    norm_slot: Slot,
    /// With a bias: the weight, read here, and the slot of the second
    /// bundle; without one the weight is the node's third argument.
    linear: Option<(Tensor, Slot)>,
}

/// `layer_norm(x, g, beta, eps) W^T + b`: a pre-norm transformer's norm and
/// the linear layer after it (`w` is `(out, in)` as in `candle_nn::Linear`)
/// as one node. The graph keeps `x` (a block's residual stream, which it
/// keeps anyway), the mean and `1/std` of each row, and the parameters; the
/// normalized input the product reads is recomputed in the backward (one
/// pass over `x`) instead of kept. The same as
/// [`linear`](super::linear)`(&`[`layer_norm`](super::layer_norm)`(x, g, beta, eps)?, w, b)`.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// let dev = Device::Cpu;
/// let x = Var::new(&[[1f32, 2., 3.], [0., 0., 3.]], &dev)?;
/// let g = Var::ones(3, DType::F32, &dev)?;
/// let beta = Var::zeros(3, DType::F32, &dev)?;
/// let w = Var::ones((2, 3), DType::F32, &dev)?;
/// let b = Var::zeros(2, DType::F32, &dev)?;
/// let y = remat_runtime::nn::layer_norm_linear(&x, &g, &beta, 1e-5, &w, Some(&b))?;
/// assert_eq!(y.dims(), &[2, 2]);
/// let grads = (&y * &y)?.sum_all()?.backward()?;
/// assert!(grads.get(&x).is_some() && grads.get(&g).is_some() && grads.get(&w).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn layer_norm_linear(
    x: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    eps: f64,
    w: &Tensor,
    b: Option<&Tensor>,
) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("layer_norm_linear");
    super::linear::check_weight("layer_norm_linear", x, w, b)?;
    super::norm::check_gain("layer_norm_linear", x, g, Some(beta))?;
    let (h, mean, rstd, pass) = match pass_rows(x, g, Some(beta)) {
        Some(rows) => {
            let (h, mean, rstd) = norm_pass::forward(&rows, g, Some(beta), eps)?;
            (h.reshape(x.shape())?, mean, rstd, Some(eps))
        }
        None => {
            let (xhat, mean, rstd) = normalize(&x.detach(), eps)?;
            let h = scale_shift(&xhat, &g.detach(), &beta.detach())?;
            (h, mean, rstd, None)
        }
    };
    let y = product(&h, w, b)?.reshape(output_dims(x, w)?)?;
    drop(h);
    let (norm, norm_slot) = bundle(g, beta)?;
    let mut op = LayerNormLinear {
        out: Computed::new(y),
        mean,
        rstd,
        pass,
        gain: g.detach(),
        shift: beta.detach(),
        norm_slot,
        linear: None,
    };
    match b {
        None => x.apply_op3(&norm, w, op),
        Some(b) => {
            let (linear, slot) = bundle(w, b)?;
            op.linear = Some((w.detach(), slot));
            x.apply_op3(&norm, &linear, op)
        }
    }
}

impl CustomOp3 for LayerNormLinear {
    forward_computed!("remat-layer-norm-linear", s1 l1, s2 l2, s3 l3);
    fn bwd(
        &self,
        x: &Tensor,
        norm: &Tensor,
        third: &Tensor,
        _: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _profile = crate::inspect::profile::backward("layer_norm_linear");
        let (rows, input) = rows(x)?;
        let w = match &self.linear {
            Some((w, _)) => w.clone(),
            None => third.detach(),
        };
        let dy = dy
            .detach()
            .reshape((rows, dy.dim(candle_core::D::Minus1)?))?;
        if let Some(eps) = self.pass {
            // The norm's one pass again: the forward's bits, then its
            // backward.
            let x2 = x.detach().reshape((rows, input))?;
            let (h, _, _) = norm_pass::forward(&x2, &self.gain, Some(&self.shift), eps)?;
            let dw = dy.t()?.matmul(&h)?;
            drop(h);
            let dh = dy.matmul(&w)?;
            let stats = (&self.mean, &self.rstd);
            let (dx, dg, dbeta) = norm_pass::backward(&x2, &self.gain, &dh, stats, true)?;
            let dx = dx.reshape(x.shape())?.to_dtype(x.dtype())?;
            let (dg, dbeta) = (
                dg.to_dtype(self.gain.dtype())?,
                dbeta.to_dtype(self.shift.dtype())?,
            );
            let norm_grad = self.norm_slot.put(norm, dg, dbeta)?;
            let third_grad = match &self.linear {
                Some((_, slot)) => slot.put(third, dw, dy.sum(0)?)?,
                None => Some(dw),
            };
            return Ok((Some(dx), norm_grad, third_grad));
        }
        // The normalized input, recomputed.
        let xhat = renormalize(x, &self.mean, &self.rstd)?;
        let h = scale_shift(&xhat, &self.gain, &self.shift)?.reshape((rows, input))?;
        let dw = dy.t()?.matmul(&h)?;
        drop(h);
        let dh = dy.matmul(&w)?.reshape(x.shape())?;
        let (dx, dg) = norm_grads(&xhat, &self.rstd, &self.gain, &dh, true)?;
        let dbeta = sum_rows(&dh)?;
        let norm_grad = self.norm_slot.put(norm, dg, dbeta)?;
        let third_grad = match &self.linear {
            Some((_, slot)) => slot.put(third, dw, dy.sum(0)?)?,
            None => Some(dw),
        };
        Ok((Some(dx), norm_grad, third_grad))
    }
}
