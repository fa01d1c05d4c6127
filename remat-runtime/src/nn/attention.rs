//! Memory-efficient attention: no `(B, H, T, S)` tensor outlives one block
//! of query rows, in the forward or the backward.

use candle_core::{CustomOp3, DType, Result, Tensor, D};

use super::attach::{forward_computed, Computed};

/// Query rows per block: the forward and the backward hold
/// `(B, H, BLOCK, S)` scores at a time.
const BLOCK: usize = 64;

struct Attention {
    out: Computed,
    /// Per query row, `log(sum(exp(scores)))`, `(B, H, T, 1)`.
    lse: Tensor,
    /// The additive mask, `(.., T or 1, S)`, if any (causal or given).
    mask: Option<Tensor>,
    scale: f64,
    /// Query heads per key/value head.
    group: usize,
}

/// `softmax(q k^T / sqrt(D) + mask) v` for `q` `(B, H, T, D)` and `k`, `v`
/// `(B, Hkv, S, D)` (views, e.g. of one projection split into heads, are
/// kept as views), computed in blocks of query rows. `Hkv` divides `H`:
/// fewer key/value heads is grouped-query attention, query head `i` reading
/// key/value head `i / (H / Hkv)` (candle-transformers' and Hugging Face's
/// `repeat_kv`), without repeating them in the graph. `causal` masks key
/// `j > i + S - T` for query `i`; `mask` is added to the scores (shape
/// broadcastable to `(B, H, T, S)`, `-inf` where masked). The graph keeps
/// `q`, `k`, `v`, the output and one log-sum-exp per query row (as
/// FlashAttention does); the backward recomputes the probabilities block by
/// block. The output is a `(B, H, T, D)` view of a `(B, T, H, D)` tensor, so
/// merging the heads (`y.transpose(1, 2)?.reshape((B, T, H * D))`) is a
/// view too, not a second copy the graph keeps.
///
/// ```
/// use candle_core::{Device, Var};
/// let dev = Device::Cpu;
/// let q = Var::randn(0f32, 1., (1, 2, 5, 4), &dev)?;
/// let k = Var::randn(0f32, 1., (1, 2, 5, 4), &dev)?;
/// let v = Var::randn(0f32, 1., (1, 2, 5, 4), &dev)?;
/// let y = remat_runtime::nn::attention(&q, &k, &v, true, None)?;
/// assert_eq!(y.dims(), &[1, 2, 5, 4]);
/// let g = y.sum_all()?.backward()?;
/// assert!(g.get(&q).is_some() && g.get(&k).is_some() && g.get(&v).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let (_, h, t, d) = q.dims4()?;
    let (_, hkv, s, _) = k.dims4()?;
    if hkv == 0 || h % hkv != 0 || v.dim(1)? != hkv {
        candle_core::bail!(
            "attention: {h} query heads need key and value heads that divide them (keys have {hkv}, values {})",
            v.dim(1)?
        );
    }
    let group = h / hkv;
    let scale = 1.0 / (d as f64).sqrt();
    let mut full = mask.map(|m| m.detach());
    if causal {
        let c = causal_mask(t, s, q.dtype(), q.device())?;
        full = Some(match full {
            Some(m) => m.broadcast_add(&c)?,
            None => c,
        });
    }
    // Contiguous copies for the products, freed after the forward: the
    // graph keeps `q`, `k`, `v` as given (views of a projection need not be
    // copied to be kept).
    let (qd, kt, vd) = (
        q.detach().contiguous()?,
        repeat_heads(&k.detach(), group)?.t()?.contiguous()?,
        repeat_heads(&v.detach(), group)?.contiguous()?,
    );
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for (start, len) in blocks(t) {
        let p = scores(&qd, &kt, full.as_ref(), start, len, scale)?;
        let max = p.max_keepdim(D::Minus1)?;
        let e = p.broadcast_sub(&max)?.exp()?;
        let sum = e.sum_keepdim(D::Minus1)?;
        outs.push(e.matmul(&vd)?.broadcast_div(&sum)?);
        lses.push((sum.log()? + max)?);
    }
    // The node's output is stored as `(B, T, H, D)` and returned as a
    // transposed view: merging the heads afterwards (`transpose(1, 2)` and
    // a reshape to `(B, T, H * D)`) is then a view, not a kept copy.
    let op = Attention {
        out: Computed::new(Tensor::cat(&outs, 2)?.transpose(1, 2)?.contiguous()?),
        lse: Tensor::cat(&lses, 2)?,
        mask: full,
        scale,
        group,
    };
    q.apply_op3(k, v, op)?.transpose(1, 2)
}

/// `(B, Hkv, S, D)` to `(B, Hkv * n, S, D)`, each head `n` times in a row.
fn repeat_heads(x: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x.clone());
    }
    let (b, h, s, d) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, h, n, s, d))?
        .contiguous()?
        .reshape((b, h * n, s, d))
}

/// The gradient of [`repeat_heads`]: the `n` copies of each head summed.
fn sum_heads(x: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x.clone());
    }
    let (b, h, s, d) = x.dims4()?;
    x.reshape((b, h / n, n, s, d))?.sum(2)
}

/// `(start, len)` of each block of `t` query rows.
fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t).step_by(BLOCK).map(move |s| (s, BLOCK.min(t - s)))
}

/// `0` where query `i` may see key `j` (`j <= i + s - t`), `-inf` elsewhere,
/// `(t, s)`.
fn causal_mask(t: usize, s: usize, dtype: DType, dev: &candle_core::Device) -> Result<Tensor> {
    let i = Tensor::arange(0u32, t as u32, dev)?
        .affine(1.0, (s - t) as f64)?
        .unsqueeze(1)?;
    let j = Tensor::arange(0u32, s as u32, dev)?.unsqueeze(0)?;
    let hidden = j.broadcast_gt(&i)?;
    let zeros = Tensor::zeros((t, s), dtype, dev)?;
    let inf = Tensor::full(f32::NEG_INFINITY, (t, s), dev)?.to_dtype(dtype)?;
    hidden.where_cond(&inf, &zeros)
}

/// The scaled, masked scores of query rows `start..start + len`.
fn scores(
    q: &Tensor,
    kt: &Tensor,
    mask: Option<&Tensor>,
    start: usize,
    len: usize,
    scale: f64,
) -> Result<Tensor> {
    let s = (q.narrow(2, start, len)?.matmul(kt)? * scale)?;
    match mask {
        Some(m) => {
            let rows = m.dim(m.rank() - 2)?;
            let m = if rows == 1 {
                m.clone()
            } else {
                m.narrow(m.rank() - 2, start, len)?
            };
            s.broadcast_add(&m)
        }
        None => Ok(s),
    }
}

impl CustomOp3 for Attention {
    forward_computed!("remat-attention", s1 l1, s2 l2, s3 l3);
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (q, k, v) = (
            q.detach().contiguous()?,
            repeat_heads(&k.detach(), self.group)?.contiguous()?,
            repeat_heads(&v.detach(), self.group)?.contiguous()?,
        );
        // `out` and `dout` are `(B, T, H, D)`, the node's layout.
        let out = out.detach().transpose(1, 2)?;
        let dout = dout.detach().transpose(1, 2)?.contiguous()?;
        let kt = k.t()?.contiguous()?;
        let vt = v.t()?.contiguous()?;
        let t = q.dim(2)?;
        // D_i = sum_j dO_ij O_ij: the softmax backward's row term.
        let di = (&dout * &out)?.sum_keepdim(D::Minus1)?;
        let mut dq = Vec::new();
        let mut dk = k.zeros_like()?;
        let mut dv = v.zeros_like()?;
        for (start, len) in blocks(t) {
            let s = scores(&q, &kt, self.mask.as_ref(), start, len, self.scale)?;
            let p = s.broadcast_sub(&self.lse.narrow(2, start, len)?)?.exp()?;
            let dout_b = dout.narrow(2, start, len)?;
            dv = (dv + p.t()?.matmul(&dout_b)?)?;
            let dp = dout_b.matmul(&vt)?;
            let ds = (p * dp.broadcast_sub(&di.narrow(2, start, len)?)?)?;
            dq.push((ds.matmul(&k)? * self.scale)?);
            dk = (dk + (ds.t()?.matmul(&q.narrow(2, start, len)?.contiguous()?)? * self.scale)?)?;
        }
        Ok((
            Some(Tensor::cat(&dq, 2)?),
            Some(sum_heads(&dk, self.group)?),
            Some(sum_heads(&dv, self.group)?),
        ))
    }
}
