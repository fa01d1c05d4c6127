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
}

/// `softmax(q k^T / sqrt(D) + mask) v` for `q` `(B, H, T, D)` and `k`, `v`
/// `(B, H, S, D)` (views, e.g. of one projection split into heads, are
/// kept as views), computed in blocks of query rows. `causal` masks key
/// `j > i + S - T` for query `i`; `mask` is added to the scores (shape
/// broadcastable to `(B, H, T, S)`, `-inf` where masked). The graph keeps
/// `q`, `k`, `v`, the output and one log-sum-exp per query row (as
/// FlashAttention does); the backward recomputes the probabilities block by
/// block.
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
    let (_, _, t, d) = q.dims4()?;
    let s = k.dim(2)?;
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
        k.detach().t()?.contiguous()?,
        v.detach().contiguous()?,
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
    let op = Attention {
        out: Computed::new(Tensor::cat(&outs, 2)?),
        lse: Tensor::cat(&lses, 2)?,
        mask: full,
        scale,
    };
    q.apply_op3(k, v, op)
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
            k.detach().contiguous()?,
            v.detach().contiguous()?,
        );
        let (out, dout) = (out.detach(), dout.detach().contiguous()?);
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
        Ok((Some(Tensor::cat(&dq, 2)?), Some(dk), Some(dv)))
    }
}
