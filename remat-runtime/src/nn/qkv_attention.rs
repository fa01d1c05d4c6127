//! A transformer block's attention from its input: the norm, the
//! query-key-value projection and the attention as one node.

use std::sync::Mutex;

use candle_core::{CustomOp2, Result, Tensor};

use super::attach::{forward_computed, Computed};
use super::attention::{forward, packed_grads, split, Residuals};
use super::bundle::{bundle_all, Slot};
use super::kernels::{sum_rows, weight_grad};
use super::linear::{product, rows};
use super::prenorm::{norm_backward, norm_forward, normalized, Normed, PreNorm};

struct QkvAttention {
    out: Computed,
    norm: Option<Normed>,
    /// The projection's weight `(3 C, C)` and bias, detached.
    w: Tensor,
    b: Option<Tensor>,
    heads: usize,
    rest: Residuals,
    /// Where the parameters' gradients go when they are bundled; `None`
    /// when the weight alone is the node's second argument.
    slot: Option<Slot>,
    /// The projection `(B, T, 3 C)`, taken and released by the first
    /// backward; a second backward through the same graph recomputes it.
    kept: Mutex<Option<Tensor>>,
}

/// `attention_qkv(norm(x) W^T + b)`: a pre-norm transformer block's
/// attention from the block's input `x` `(B, T, C)`, with the norm (or
/// none), the packed query-key-value projection (`w` `(3 C, C)` in
/// candle-nn's `(out, in)` layout, as GPT-2's `c_attn` or a ViT's `qkv`)
/// and [`attention_qkv`](super::attention_qkv) (`heads` heads, `causal`,
/// `mask`, as there) as one node. The output is `(B, T, C)` with the
/// heads merged, before the output projection.
///
/// The graph keeps `x` and the parameters; the node keeps the projection
/// `(B, T, 3 C)` and one softmax normalizer per query row, and its backward
/// releases the projection as soon as it has copied its parts. Written as
/// `layer_norm_linear` and `attention_qkv`, the graph holds the projection
/// until the whole backward returns, and candle sums its gradient into a
/// zero tensor (three such tensors at once). The gradients equal those of
/// [`layer_norm`](super::layer_norm), [`linear`](super::linear) and
/// `attention_qkv` bit for bit.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1., (1, 5, 8), &dev)?;
/// let (g, b) = (Var::ones(8, DType::F32, &dev)?, Var::zeros(8, DType::F32, &dev)?);
/// let w = Var::randn(0f32, 0.2, (24, 8), &dev)?; // 2 heads of 4
/// let norm = remat_runtime::nn::PreNorm::Layer { gain: &g, bias: &b, eps: 1e-5 };
/// let y = remat_runtime::nn::qkv_attention(&x, Some(norm), &w, None, 2, true, None)?;
/// assert_eq!(y.dims(), &[1, 5, 8]);
/// let grads = y.sqr()?.sum_all()?.backward()?;
/// assert!(grads.get(&x).is_some() && grads.get(&w).is_some() && grads.get(&g).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn qkv_attention(
    x: &Tensor,
    norm: Option<PreNorm>,
    w: &Tensor,
    b: Option<&Tensor>,
    heads: usize,
    causal: bool,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("qkv_attention");
    let (bt, t, _) = x.dims3().map_err(|_| {
        candle_core::Error::Msg(format!(
            "qkv_attention: the input is {:?}, expected (B, T, C)",
            x.dims()
        ))
    })?;
    let c3 = w.dim(0)?;
    if heads == 0 || heads.checked_mul(3).is_none_or(|h| c3 % h != 0) {
        candle_core::bail!(
            "qkv_attention: the projection is {c3} wide, which is not 3 x {heads} heads x a head size"
        );
    }
    let x_rows = x.detach().reshape(rows(x)?)?;
    let (n, normed) = norm_forward(norm.as_ref(), x_rows)?;
    let (w0, b0) = (w.detach(), b.map(Tensor::detach));
    let qkv = product(&n, &w0, b0.as_ref())?.reshape((bt, t, c3))?;
    drop(n);
    let (q, k, v) = split(&qkv, heads)?;
    let (out, rest) = forward("qkv_attention", &q, &k, &v, causal, mask)?;
    drop((q, k, v));
    let out = out.reshape((bt, t, c3 / 3))?;
    let mut params = norm.map(|n| n.params()).unwrap_or_default();
    params.push(w);
    params.extend(b);
    if let Some(m) = mask.filter(|_| rest.mask_tracked()) {
        params.push(m);
    }
    let (second, slot) = match params.as_slice() {
        [only] => ((*only).clone(), None),
        _ => {
            let (pack, slot) = bundle_all(&params)?;
            (pack, Some(slot))
        }
    };
    let op = QkvAttention {
        out: Computed::new(out),
        norm: normed,
        w: w0,
        b: b0,
        heads,
        rest,
        slot,
        kept: Mutex::new(Some(qkv)),
    };
    x.apply_op2(&second, op)
}

impl CustomOp2 for QkvAttention {
    forward_computed!("remat-qkv-attention", s1 l1, s2 l2);
    fn bwd(
        &self,
        x: &Tensor,
        second: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _profile = crate::inspect::profile::backward("qkv_attention");
        let x = x.detach();
        let (bt, t, _) = x.dims3()?;
        let x2 = x.reshape(rows(&x)?)?;
        // The normalized input, recomputed when it is read: after the
        // projection is released.
        let n = || normalized(self.norm.as_ref(), &x2);
        let kept = crate::lock(&self.kept).take();
        let qkv = match kept {
            Some(qkv) => qkv,
            None => product(&n()?, &self.w, self.b.as_ref())?.reshape((bt, t, self.w.dim(0)?))?,
        };
        let (dqkv, dmask) = packed_grads(&self.rest, self.heads, qkv, out, &dout.detach())?;
        let dqkv = dqkv.reshape((x2.dim(0)?, self.w.dim(0)?))?;
        // The projection's backward, as `linear`'s.
        let dn = dqkv.matmul(&self.w)?;
        let n = n()?;
        let dw = weight_grad(&n, &dqkv)?;
        let db = self.b.as_ref().map(|_| sum_rows(&dqkv)).transpose()?;
        drop((dqkv, n));
        let (dx, mut grads) = norm_backward(self.norm.as_ref(), &x2, dn)?;
        grads.push(dw);
        grads.extend(db);
        grads.extend(dmask);
        let second = match &self.slot {
            Some(slot) => slot.put_all(second, grads)?,
            None => grads.pop(),
        };
        Ok((Some(dx.reshape(x.shape())?), second))
    }
}
