//! Memory-efficient attention: no `(B, H, T, S)` tensor outlives one block
//! of query rows, in the forward or the backward.

use candle_core::{CustomOp1, CustomOp3, DType, Result, Tensor, D};

use super::attach::{forward_computed, Computed};

/// Query rows per block: the forward and the backward hold
/// `(B, H, BLOCK, S)` scores at a time.
const BLOCK: usize = 64;

/// The node of [`attention`]: `q`, `k`, `v` are its arguments.
struct Attention {
    out: Computed,
    rest: Residuals,
}

/// The node of [`attention_qkv`]: the packed projection is its argument.
struct AttentionQkv {
    out: Computed,
    rest: Residuals,
    heads: usize,
}

/// What the backward reads besides `q`, `k`, `v` and the output.
struct Residuals {
    /// Per query row, `log(sum(exp(scores)))`, `(B, H, T, 1)`.
    lse: Tensor,
    /// The additive mask, `(.., T or 1, S)`, if any (causal or given).
    mask: Option<Tensor>,
    scale: f64,
    /// Query heads per key/value head.
    group: usize,
    keys: Keys,
}

/// Which keys a block of query rows reads.
#[derive(Clone, Copy)]
struct Keys {
    queries: usize,
    keys: usize,
    causal: bool,
}

impl Keys {
    /// The keys query rows `start..start + len` may see: all of them, or
    /// under causal masking (query `i` sees keys up to `i + S - T`) the
    /// prefix up to the last row's diagonal.
    fn for_rows(self, start: usize, len: usize) -> usize {
        if self.causal {
            (start + len + self.keys - self.queries).min(self.keys)
        } else {
            self.keys
        }
    }
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
/// block. Under causal masking each block of query rows reads only the keys
/// it may see (about half the work of the full scores for `S = T`); it
/// needs `S >= T`. The output is a `(B, H, T, D)` view of a `(B, T, H, D)`
/// tensor, so merging the heads (`y.transpose(1, 2)?.reshape((B, T, H *
/// D))`) is a view too, not a second copy the graph keeps.
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
    let (out, rest) = forward(q, k, v, causal, mask)?;
    // The node's output is stored as `(B, T, H, D)` and returned as a
    // transposed view: merging the heads afterwards (`transpose(1, 2)` and
    // a reshape to `(B, T, H * D)`) is then a view, not a kept copy.
    let op = Attention {
        out: Computed::new(out),
        rest,
    };
    q.apply_op3(k, v, op)?.transpose(1, 2)
}

/// [`attention`] over the packed projection of a transformer block:
/// `qkv` is `(B, T, 3 C)` (queries, keys, values side by side, each `C =
/// heads * D` wide, as one `C -> 3 C` linear layer makes them), the output
/// `(B, T, C)` with the heads merged. The graph keeps `qkv`, the output and
/// one log-sum-exp per query row; the backward returns one `(B, T, 3 C)`
/// gradient. Splitting `qkv` with `narrow`/`reshape`/`transpose` views
/// before [`attention`] computes the same, but candle's backward of each
/// view materialises a zero-padded `(B, T, 3 C)` gradient (three of them,
/// summed), which this op does not.
///
/// ```
/// use candle_core::{Device, Var};
/// let dev = Device::Cpu;
/// let qkv = Var::randn(0f32, 1., (1, 5, 3 * 8), &dev)?; // 2 heads of 4
/// let y = remat_runtime::nn::attention_qkv(&qkv, 2, true, None)?;
/// assert_eq!(y.dims(), &[1, 5, 8]);
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&qkv).unwrap().dims(), &[1, 5, 24]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention_qkv(
    qkv: &Tensor,
    heads: usize,
    causal: bool,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let (b, t, c3) = qkv.dims3()?;
    if heads == 0 || c3 % (3 * heads) != 0 {
        candle_core::bail!(
            "attention_qkv: the packed projection is {c3} wide, which is not 3 x {heads} heads x a head size"
        );
    }
    let (q, k, v) = split(&qkv.detach(), heads)?;
    let (out, rest) = forward(&q, &k, &v, causal, mask)?;
    let op = AttentionQkv {
        out: Computed::new(out.reshape((b, t, c3 / 3))?),
        rest,
        heads,
    };
    qkv.apply_op1(op)
}

/// Queries, keys and values `(B, H, T, D)` as views of `qkv` `(B, T, 3 H D)`.
fn split(qkv: &Tensor, heads: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, c3) = qkv.dims3()?;
    let parts = qkv.reshape((b, t, 3, heads, c3 / (3 * heads)))?;
    let part = |i: usize| parts.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
    Ok((part(0)?, part(1)?, part(2)?))
}

/// The output, `(B, T, H, D)` contiguous, and what the backward reads.
fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    mask: Option<&Tensor>,
) -> Result<(Tensor, Residuals)> {
    let (_, h, t, d) = q.dims4()?;
    let (_, hkv, s, _) = k.dims4()?;
    if hkv == 0 || h % hkv != 0 || v.dim(1)? != hkv {
        candle_core::bail!(
            "attention: {h} query heads need key and value heads that divide them (keys have {hkv}, values {})",
            v.dim(1)?
        );
    }
    if causal && s < t {
        candle_core::bail!(
            "attention: causal masking needs at least as many keys as queries ({t} queries, {s} keys)"
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
        repeat_heads(&k.detach(), group)?.contiguous()?.t()?,
        repeat_heads(&v.detach(), group)?.contiguous()?,
    );
    let keys = Keys {
        queries: t,
        keys: s,
        causal,
    };
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for (start, len) in blocks(t) {
        let n = keys.for_rows(start, len);
        let p = scores(&qd, &kt, full.as_ref(), start, len, n, scale)?;
        let max = p.max_keepdim(D::Minus1)?;
        let e = p.broadcast_sub(&max)?.exp()?;
        let sum = e.sum_keepdim(D::Minus1)?;
        outs.push(e.matmul(&vd.narrow(2, 0, n)?)?.broadcast_div(&sum)?);
        lses.push((sum.log()? + max)?);
    }
    let out = Tensor::cat(&outs, 2)?.transpose(1, 2)?.contiguous()?;
    let rest = Residuals {
        lse: Tensor::cat(&lses, 2)?,
        mask: full,
        scale,
        group,
        keys,
    };
    Ok((out, rest))
}

/// Adds `term` to the first rows (dimension 2) of the sum in `acc`, or
/// starts it with `term`. The sum is this op's own tensor, written in
/// place.
fn accumulate(acc: &mut Option<Tensor>, term: Tensor) -> Result<()> {
    match acc {
        None => *acc = Some(term),
        Some(sum) if sum.dims() == term.dims() => *sum = (&*sum + term)?,
        Some(sum) => {
            let head = (sum.narrow(2, 0, term.dim(2)?)? + term)?;
            sum.slice_set(&head, 2, 0)?;
        }
    }
    Ok(())
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
fn blocks(t: usize) -> impl DoubleEndedIterator<Item = (usize, usize)> {
    (0..t.div_ceil(BLOCK)).map(move |i| (i * BLOCK, BLOCK.min(t - i * BLOCK)))
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

/// The scaled, masked scores of query rows `start..start + len` against
/// the first `keys` keys.
fn scores(
    q: &Tensor,
    kt: &Tensor,
    mask: Option<&Tensor>,
    start: usize,
    len: usize,
    keys: usize,
    scale: f64,
) -> Result<Tensor> {
    let s = (q.narrow(2, start, len)?.matmul(&kt.narrow(3, 0, keys)?)? * scale)?;
    match mask {
        Some(m) => {
            let rows = m.dim(m.rank() - 2)?;
            let m = if rows == 1 {
                m.clone()
            } else {
                m.narrow(m.rank() - 2, start, len)?
            };
            s.broadcast_add(&m.narrow(m.rank() - 1, 0, keys)?)
        }
        None => Ok(s),
    }
}

impl Residuals {
    /// `(dq, dk, dv)` for queries, keys and values `(B, H or Hkv, T or S,
    /// D)` and the output and its gradient `(B, T, H, D)` (the nodes'
    /// layout).
    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v) = (
            q.detach().contiguous()?,
            repeat_heads(&k.detach(), self.group)?.contiguous()?,
            repeat_heads(&v.detach(), self.group)?.contiguous()?,
        );
        let out = out.detach().transpose(1, 2)?;
        let dout = dout.detach().transpose(1, 2)?.contiguous()?;
        // Transposed views: the products read strided operands.
        let (kt, vt) = (k.t()?, v.t()?);
        let t = q.dim(2)?;
        // D_i = sum_j dO_ij O_ij: the softmax backward's row term.
        let di = (&dout * &out)?.sum_keepdim(D::Minus1)?;
        // Each block's `(B, H, len, keys)` temporaries die within its
        // iteration. The last block sees every key: walking the blocks from
        // the last, `dk` and `dv` start from its terms, and the earlier
        // blocks' (under causal masking, over fewer keys) add to their
        // first rows.
        let mut dq = Vec::new();
        let (mut dk, mut dv) = (None, None);
        for (start, len) in blocks(t).rev() {
            let n = self.keys.for_rows(start, len);
            let p = scores(&q, &kt, self.mask.as_ref(), start, len, n, self.scale)?
                .broadcast_sub(&self.lse.narrow(2, start, len)?)?
                .exp()?;
            let dout_b = dout.narrow(2, start, len)?;
            accumulate(&mut dv, p.t()?.matmul(&dout_b)?)?;
            // dS = P (dP - D), scaled once for both products.
            let ds = ((dout_b
                .matmul(&vt.narrow(3, 0, n)?)?
                .broadcast_sub(&di.narrow(2, start, len)?)?
                * p)?
                * self.scale)?;
            dq.push(ds.matmul(&k.narrow(2, 0, n)?)?);
            accumulate(&mut dk, ds.t()?.matmul(&q.narrow(2, start, len)?)?)?;
        }
        dq.reverse();
        let none = || candle_core::Error::Msg("remat nn: attention over no query rows".into());
        let (dk, dv) = (dk.ok_or_else(none)?, dv.ok_or_else(none)?);
        Ok((
            Tensor::cat(&dq, 2)?,
            sum_heads(&dk, self.group)?,
            sum_heads(&dv, self.group)?,
        ))
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
        let (dq, dk, dv) = self.rest.backward(q, k, v, out, dout)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

impl CustomOp1 for AttentionQkv {
    forward_computed!("remat-attention-qkv", s1 l1);
    fn bwd(&self, qkv: &Tensor, out: &Tensor, dout: &Tensor) -> Result<Option<Tensor>> {
        let (b, t, c3) = qkv.dims3()?;
        let (q, k, v) = split(&qkv.detach(), self.heads)?;
        let heads = (b, t, self.heads, c3 / (3 * self.heads));
        let (out, dout) = (out.reshape(heads)?, dout.reshape(heads)?);
        let (dq, dk, dv) = self.rest.backward(&q, &k, &v, &out, &dout)?;
        // Back to `(B, T, 3, H, D)`, the packed layout, in one copy.
        let packed = Tensor::stack(
            &[
                dq.transpose(1, 2)?,
                dk.transpose(1, 2)?,
                dv.transpose(1, 2)?,
            ],
            2,
        )?;
        Ok(Some(packed.reshape((b, t, c3))?))
    }
}
