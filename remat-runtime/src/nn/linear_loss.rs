//! A language model's head and its loss in one node: the final norm, the
//! projection to the vocabulary and the mean cross-entropy, chunk by chunk
//! over the tokens, without the `(tokens, vocabulary)` logits.

use std::sync::Mutex;

use candle_core::{CustomOp3, DType, Result, Tensor, D};

use super::attach::{forward_computed, Computed};
use super::bundle::{bundle_all, Slot};
use super::prenorm::{norm_forward, PreNorm};
use super::product_sum::ProductSum;

/// What [`linear_cross_entropy`] computes besides the projection: the norm
/// before it, the head's bias, the ignored label, label smoothing and the
/// memory a chunk of logits may take.
///
/// ```
/// let o = remat_runtime::nn::LinearCrossEntropy::default();
/// assert_eq!(o.ignore_index, Some(-100));
/// assert_eq!(o.label_smoothing, 0.0);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct LinearCrossEntropy<'a> {
    /// The final norm, applied to the hidden states first (`None`: none).
    pub norm: Option<PreNorm<'a>>,
    /// The head's bias, `(V)` (`None`: none, as in most language models).
    pub bias: Option<&'a Tensor>,
    /// Tokens whose label is this are left out of the loss and its mean
    /// (`-100`, Hugging Face's and PyTorch's convention; `None`: every
    /// label is a class).
    pub ignore_index: Option<i64>,
    /// `ε` of label smoothing: the target distribution is `1 - ε` on the
    /// label plus `ε / V` on every class, as in PyTorch's `cross_entropy`.
    pub label_smoothing: f64,
    /// The most bytes the blocks of one chunk of logits may take at once
    /// (about five `(rows, V)` blocks in the statistics' dtype). `None`:
    /// the size of the hidden states or 64 MiB, whichever is larger, and on
    /// the CPU at least the size of the head weight's gradient in the
    /// statistics' dtype (which the op holds anyway; fewer chunks read the
    /// weight from memory fewer times).
    pub chunk_bytes: Option<usize>,
}

impl Default for LinearCrossEntropy<'_> {
    fn default() -> Self {
        LinearCrossEntropy {
            norm: None,
            bias: None,
            ignore_index: Some(-100),
            label_smoothing: 0.0,
            chunk_bytes: None,
        }
    }
}

/// `(rows, V)` blocks alive at once while a chunk is processed.
const BLOCKS: usize = 5;

/// The mean cross-entropy of a linear head's logits, `x W^T (+ b)` (after
/// `o.norm` of `x`), against class indices `targets`, without the logits:
/// tokens are taken in chunks of rows, each chunk's `(rows, V)` logits made,
/// used and dropped, so that no `(tokens, V)` tensor ever exists. The
/// gradients of `x`, `w`, the bias and the norm's parameters are computed
/// in the same pass (as Liger-Kernel's and Cut Cross-Entropy's fused losses
/// do): the node keeps them, not the logits, and its backward scales them.
///
/// `x` is `(.., C)` (a model's `(B, T, C)` hidden states), `w` is `(V, C)`
/// (`candle_nn::Linear`'s weight, or the token embedding of a tied head),
/// `targets` holds one label per row of `x` (`u32`, `i64` or `i32`). The
/// loss is the mean over the tokens not labelled `o.ignore_index` (`0`,
/// with zero gradients, when every token is ignored); a label outside
/// `0..V` that is not ignored is an error. Logits are made in `x`'s dtype
/// (a bf16 model's matmul) and their statistics, the loss and the
/// gradients accumulated in `f32` (`f64` for `f64`); the loss is `f32`
/// (`f64`). The same as `cross_entropy(linear(norm(x), w, b), targets)`
/// within rounding.
///
/// The node's gradients of `x` and `w` are held from the forward to the
/// backward; a loss is the last thing a forward computes, so they exist
/// only as long as the head's backward would hold them anyway. Keep the
/// head outside checkpointed blocks (or `#[save]` it): a replay would run
/// it twice.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use remat_runtime::nn::{linear_cross_entropy, LinearCrossEntropy, PreNorm};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1.0, (2, 3, 8), &dev)?; // (B, T, C)
/// let w = Var::randn(0f32, 0.1, (50, 8), &dev)?; // (V, C)
/// let g = Var::ones(8, DType::F32, &dev)?;
/// let targets = Tensor::new(&[[1i64, 7, -100], [3, 49, 0]], &dev)?;
/// let norm = Some(PreNorm::Rms { gain: &g, eps: 1e-6 });
/// let loss = linear_cross_entropy(&x, &w, &targets, &LinearCrossEntropy { norm, ..Default::default() })?;
/// let grads = loss.backward()?;
/// assert!(grads.get(&x).is_some() && grads.get(&w).is_some() && grads.get(&g).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_cross_entropy(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    o: &LinearCrossEntropy,
) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("linear_cross_entropy");
    let (v, c) = w.dims2()?;
    if x.rank() == 0 || x.dim(D::Minus1)? != c {
        candle_core::bail!(
            "linear_cross_entropy: the hidden states are {:?} but the head's weight is {:?} \
             ((V, C): their last dimensions must be equal)",
            x.dims(),
            w.dims()
        );
    }
    if w.dtype() != x.dtype() {
        candle_core::bail!(
            "linear_cross_entropy: the hidden states are {:?} but the head's weight is {:?}: \
             convert one to the other's dtype",
            x.dtype(),
            w.dtype()
        );
    }
    let n: usize = x.dims()[..x.rank() - 1].iter().product();
    if targets.elem_count() != n {
        candle_core::bail!(
            "linear_cross_entropy: {} labels for {n} tokens (hidden states {:?}, labels {:?})",
            targets.elem_count(),
            x.dims(),
            targets.dims()
        );
    }
    if !(0.0..=1.0).contains(&o.label_smoothing) {
        candle_core::bail!(
            "linear_cross_entropy: label smoothing {} is outside [0, 1]",
            o.label_smoothing
        );
    }
    if let Some(b) = o.bias {
        if b.dims() != [v] {
            candle_core::bail!(
                "linear_cross_entropy: the bias is {:?}, expected ({v})",
                b.dims()
            );
        }
    }
    let labels = labels(targets, v, o.ignore_index)?;
    let work = match x.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    // By default the hidden states' size or 64 MiB; on the CPU at least
    // the weight's gradient, which the node holds anyway (its backward
    // holds three of those: the gradient, candle's zeros and their sum), as
    // each chunk streams the weight from memory three times: fewer chunks
    // are faster there.
    let bound = o.chunk_bytes.unwrap_or_else(|| {
        let floor = match x.device().is_cpu() {
            true => v * c * work.size_in_bytes(),
            false => 0,
        };
        (n * c * x.dtype().size_in_bytes()).max(floor).max(64 << 20)
    });
    let rows = (bound / (BLOCKS * v.max(1) * work.size_in_bytes())).clamp(1, n.max(1));
    let sums = chunks(x, w, &labels, o, work, rows)?;

    let mut params: Vec<&Tensor> = o.norm.map(|n| n.params()).unwrap_or_default();
    let norm_params = params.len();
    params.push(w);
    params.extend(o.bias);
    let (pack, slot) = match params.len() {
        1 => (w.clone(), None),
        _ => {
            let (pack, slot) = bundle_all(&params)?;
            (pack, Some(slot))
        }
    };
    // In the statistics' dtype until the backward scales them; each then
    // rounded once to its tensor's dtype.
    let mut grads = sums.dnorm;
    grads.push(sums.dw);
    if o.bias.is_some() {
        grads.push(sums.db);
    }
    debug_assert_eq!(grads.len(), norm_params + 1 + usize::from(o.bias.is_some()));
    let dtypes = std::iter::once(x.dtype())
        .chain(params.iter().map(|p| p.dtype()))
        .collect();
    let op = LinearLoss {
        out: Computed::new(sums.loss),
        grads: Mutex::new(Some((sums.dx.reshape(x.shape())?, grads))),
        dtypes,
        slot,
    };
    x.apply_op3(&pack, targets, op)
}

/// Each token's label as a class index (ignored tokens: 0) and whether it
/// counts, checked against the vocabulary.
struct Labels {
    /// `(N, 1)`, `u32`.
    index: Tensor,
    /// `(N, 1)`, 1 for a counted token, 0 for an ignored one, `f32`.
    counted: Tensor,
    /// The same as `u8`, for `where_cond`.
    keep: Tensor,
    /// Counted tokens.
    count: usize,
}

fn labels(targets: &Tensor, v: usize, ignore: Option<i64>) -> Result<Labels> {
    let t = match targets.dtype() {
        DType::U32 | DType::I64 | DType::I32 | DType::U8 | DType::I16 => {
            targets.detach().flatten_all()?.to_dtype(DType::I64)?
        }
        other => candle_core::bail!(
            "linear_cross_entropy: labels are class indices (u32, i64 or i32), got {other:?}"
        ),
    };
    let values = t.to_vec1::<i64>()?;
    let mut count = 0;
    let mut index = Vec::with_capacity(values.len());
    let mut counted = Vec::with_capacity(values.len());
    for (i, &label) in values.iter().enumerate() {
        if Some(label) == ignore {
            index.push(0u32);
            counted.push(0f32);
        } else if (0..v as i64).contains(&label) {
            index.push(label as u32);
            counted.push(1f32);
            count += 1;
        } else {
            candle_core::bail!(
                "linear_cross_entropy: label {label} of token {i} is not a class of the \
                 vocabulary (0..{v}){}",
                match ignore {
                    Some(ig) => format!(" nor the ignored label {ig}"),
                    None => String::new(),
                }
            );
        }
    }
    let n = values.len();
    let dev = targets.device();
    let counted = Tensor::from_vec(counted, (n, 1), dev)?;
    Ok(Labels {
        index: Tensor::from_vec(index, (n, 1), dev)?,
        keep: counted.ne(0f32)?,
        counted,
        count,
    })
}

/// The loss and every gradient, summed over the chunks.
struct Sums {
    loss: Tensor,
    dx: Tensor,
    dw: Tensor,
    db: Tensor,
    dnorm: Vec<Tensor>,
}

/// The chunks of `rows` tokens, one after the other.
fn chunks(
    x: &Tensor,
    w: &Tensor,
    labels: &Labels,
    o: &LinearCrossEntropy,
    work: DType,
    rows: usize,
) -> Result<Sums> {
    let (v, c) = w.dims2()?;
    let n = labels.index.dim(0)?;
    let dev = x.device();
    let x_rows = x.detach().reshape((n, c))?;
    let w = w.detach();
    let w_work = (w.dtype() == work).then(|| w.clone());
    let bias = o.bias.map(|b| b.detach().to_dtype(x.dtype())).transpose()?;
    // The mean over counted tokens; no token counted: loss and gradients 0.
    let scale = if labels.count == 0 {
        0.0
    } else {
        1.0 / labels.count as f64
    };
    let eps = o.label_smoothing;
    let mut loss = Tensor::zeros((), work, dev)?;
    let mut dw = ProductSum::zeros(v, c, work, dev)?;
    let mut db = Tensor::zeros(v, work, dev)?;
    let mut dnorm: Option<Vec<Tensor>> = None;
    let mut dx = Vec::with_capacity(n.div_ceil(rows.max(1)));
    let mut start = 0;
    while start < n {
        let len = rows.min(n - start);
        let xc = x_rows.narrow(0, start, len)?;
        let (h, normed) = norm_forward(o.norm.as_ref(), xc.clone())?;
        let mut z = h.matmul(&w.t()?)?;
        if let Some(b) = &bias {
            z = z.broadcast_add(b)?;
        }
        let z = z.to_dtype(work)?;
        let index = labels.index.narrow(0, start, len)?;
        let counted = labels.counted.narrow(0, start, len)?.to_dtype(work)?;
        let max = z.max_keepdim(1)?;
        let e = z.broadcast_sub(&max)?.exp()?;
        let sum = e.sum_keepdim(1)?;
        let lse = (sum.log()? + &max)?;
        // Per token: (1 - eps) (lse - z_label) + eps (lse - mean z).
        let picked = z.gather(&index, 1)?;
        let mut token = ((&lse - &picked)? * (1.0 - eps))?;
        if eps > 0.0 {
            let mean = z.mean_keepdim(1)?;
            token = (token + ((&lse - mean)? * eps)?)?;
        }
        drop(z);
        // Ignored tokens add nothing (where, not times 0: their label's
        // logit may be infinite).
        let token = labels
            .keep
            .narrow(0, start, len)?
            .where_cond(&token, &token.zeros_like()?)?;
        loss = (loss + token.sum_all()?)?;
        // d loss / d z = softmax - (1 - eps) onehot - eps / V, for counted
        // tokens (entries at most 1: safe in f16, where the product with a
        // 16-bit weight runs); the mean's 1 / count is applied in the
        // statistics' dtype, after the products (in the weight's gradient,
        // by the product itself).
        let dz = e.broadcast_div(&sum)?;
        drop(e);
        let dz = if eps > 0.0 {
            dz.affine(1.0, -eps / v as f64)?
        } else {
            dz
        };
        let minus = Tensor::full(-(1.0 - eps), (len, 1), dev)?.to_dtype(work)?;
        dz.scatter_add_set(&index, &minus, 1)?;
        let dz = dz.broadcast_mul(&counted)?;
        db = (db + dz.sum(0)?)?;
        dw.add(&dz, &h.to_dtype(work)?, scale)?;
        let dh = match &w_work {
            Some(w) => dz.matmul(w)?,
            None => dz.to_dtype(x.dtype())?.matmul(&w)?.to_dtype(work)?,
        };
        drop(dz);
        let dh = (dh * scale)?;
        let (dxc, dparams) = match &normed {
            Some(normed) => normed.backward_work(&xc, &dh)?,
            None => (dh, Vec::new()),
        };
        dx.push(dxc);
        dnorm = Some(match dnorm {
            None => dparams,
            Some(acc) => acc
                .iter()
                .zip(&dparams)
                .map(|(a, b)| a + b)
                .collect::<Result<_>>()?,
        });
        start += len;
    }
    let dnorm = match (dnorm, o.norm) {
        (Some(d), _) => d,
        // No token: the norm's parameters get zeros.
        (None, Some(norm)) => norm
            .params()
            .iter()
            .map(|p| Tensor::zeros(p.shape(), work, dev))
            .collect::<Result<_>>()?,
        (None, None) => Vec::new(),
    };
    let dx = match dx.len() {
        0 => Tensor::zeros((n, c), work, dev)?,
        _ => Tensor::cat(&dx, 0)?,
    };
    Ok(Sums {
        loss: (loss * scale)?,
        dx,
        dw: dw.into_tensor()?,
        db: (db * scale)?,
        dnorm,
    })
}

/// The node: the loss, and the gradients the forward computed, scaled by
/// the backward.
struct LinearLoss {
    out: Computed,
    /// `x`'s gradient, then the norm's parameters', `w`'s and the bias's,
    /// in the statistics' dtype; taken by the backward.
    grads: Mutex<Option<(Tensor, Vec<Tensor>)>>,
    /// The dtypes of `x` and of the parameters, in the same order.
    dtypes: Vec<DType>,
    /// Where the parameters' gradients go when they are bundled (a norm or
    /// a bias besides `w`).
    slot: Option<Slot>,
}

impl CustomOp3 for LinearLoss {
    forward_computed!("remat-linear-cross-entropy", s1 l1, s2 l2, s3 l3);
    fn bwd(
        &self,
        x: &Tensor,
        pack: &Tensor,
        _: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _profile = crate::inspect::profile::backward("linear_cross_entropy");
        let (dx, params) = crate::lock(&self.grads).take().ok_or_else(|| {
            candle_core::Error::Msg(
                "linear_cross_entropy: the backward ran twice over one forward".into(),
            )
        })?;
        // Scaled in the statistics' dtype (a loss scale of 2^16 overflows
        // f16), then rounded once. On the CPU, the usual `loss.backward()`
        // (a gradient of exactly 1) skips the product: a tied head's weight
        // gradient is the size of the embedding.
        let g = g.detach();
        let one = g.device().is_cpu() && g.to_dtype(DType::F64)?.to_scalar::<f64>()? == 1.0;
        let scaled = |t: Tensor, dtype: DType| match one {
            true => t.to_dtype(dtype),
            false => t.broadcast_mul(&g.to_dtype(t.dtype())?)?.to_dtype(dtype),
        };
        let dx = x
            .track_op()
            .then(|| scaled(dx, self.dtypes[0]))
            .transpose()?;
        let params: Vec<Tensor> = params
            .into_iter()
            .zip(&self.dtypes[1..])
            .map(|(t, &dtype)| scaled(t, dtype))
            .collect::<Result<_>>()?;
        let pack_grad = match &self.slot {
            Some(slot) => slot.put_all(pack, params)?,
            None => params.into_iter().next(),
        };
        Ok((dx, pack_grad, None))
    }
}
