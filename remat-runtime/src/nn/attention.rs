//! Memory-efficient attention: no `(B, H, T, S)` tensor outlives one block
//! of query rows, in the forward or the backward.

use candle_core::{CustomOp1, CustomOp2, CustomOp3, DType, Result, Shape, Tensor, D};

use super::attach::{forward_computed, Computed};
use super::bundle::{bundle, Slot};
use super::unchanged::Unchanged;

/// Query rows per block: the forward and the backward hold
/// `(B, H, BLOCK, S)` scores at a time.
const BLOCK: usize = 64;

/// The node of [`attention`]: `q`, `k`, `v` are its arguments, or with a
/// tracked mask `q`, `bundle(k, v)` and the mask.
struct Attention {
    out: Computed,
    rest: Residuals,
    /// With a tracked mask: `k` and `v`, read here, and the slot their
    /// gradients leave through.
    bundled: Option<(Tensor, Tensor, Slot)>,
}

/// The node of [`attention_qkv`]: the packed projection is its argument
/// (`CustomOp1`), and with a tracked mask the mask its second
/// (`CustomOp2`).
struct AttentionQkv {
    out: Computed,
    rest: Residuals,
    heads: usize,
}

/// What the backward reads besides `q`, `k`, `v` and the output.
pub(super) struct Residuals {
    /// Per query row, `1 / sum_j exp(s_j - max_j s_j)` over its scores `s`,
    /// `(B, H, T, 1)`; 0 for a row that sees no key (every score `-inf`).
    /// The backward recomputes the row's maximum from the scores it
    /// recomputes anyway: `p = exp(s - max) / sum` never subtracts two
    /// numbers of a masked row's size (a log-sum-exp of `-1e9 + 1.8` is
    /// `-1e9` in f32).
    inv_sum: Tensor,
    /// With the CUDA kernels (`super::kernels`): per query row its maximum
    /// score and `1 / sum`, `(2, B, H, T)` f32; the backward runs on the
    /// kernels too (and `inv_sum` is unused).
    stats: Option<Tensor>,
    mask: Option<Mask>,
    /// `(T, S)`: 0 where query `i` may see key `j`, `-inf` elsewhere.
    causal: Option<Tensor>,
    scale: f64,
    /// Query heads per key/value head.
    group: usize,
    keys: Keys,
    /// Some dimension is 0: the output is zeros, so are the gradients.
    empty: bool,
}

/// The additive mask given to the op.
struct Mask {
    /// The mask, detached (its storage, not a copy), as 4-D `(B or 1, H or
    /// 1, T or 1, S or 1)`.
    scores: Tensor,
    /// The mask's own shape: its gradient's.
    shape: Shape,
    /// It is tracked (a `Var`, or computed from one): it gets a gradient.
    tracked: bool,
    /// An untracked mask's values at the forward, checked before the
    /// backward reads it (a tracked one is a graph input, as in candle).
    unchanged: Unchanged,
    /// The op's name, for that check's error.
    op: String,
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

/// `softmax(q k^T / sqrt(D) + mask) v` for `q` `(B, H, T, D)`, `k` `(B,
/// Hkv, S, D)` and `v` `(B, Hkv, S, Dv)`, `Dv` usually `D` (views, e.g. of
/// one projection split into heads, are kept as views), computed in blocks
/// of query rows. `Hkv` divides `H`: fewer key/value heads is grouped-query
/// attention, query head `i` reading key/value head `i / (H / Hkv)`
/// (candle-transformers' and Hugging Face's `repeat_kv`), without repeating
/// them in the graph. `causal` masks key `j > i + S - T` for query `i`. The
/// graph keeps `q`, `k`, `v`, the output and one softmax normaliser per
/// query row (as FlashAttention keeps a log-sum-exp); the backward
/// recomputes the probabilities block by block. Under causal masking each
/// block of query rows reads only the keys it may see (about half the work
/// of the full scores for `S = T`); it needs `S >= T`. The output is a
/// `(B, H, T, Dv)` view of a `(B, T, H, Dv)` tensor, so merging the heads
/// (`y.transpose(1, 2)?.reshape((B, T, H * Dv))`) is a view too, not a
/// second copy the graph keeps.
///
/// `mask` is added to the scores: any shape that broadcasts to `(B, H, T,
/// S)` (`(S,)` for key padding, `(T, S)`, `(B, 1, 1, S)`, `(H, T, S)`,
/// ...), of the queries' dtype; another shape or dtype is an error. A
/// tracked mask (a `Var`, or computed from one: a learned bias, ALiBi) gets
/// its gradient; an untracked one costs nothing more. A row whose keys all
/// carry the same huge finite value (`-1e9`) behaves as plain softmax does:
/// uniform over its keys. A row with `-inf` on every key (causal masking
/// included) gives output 0 and contributes no gradient, with no NaN
/// anywhere, as PyTorch's `scaled_dot_product_attention` since 2.5. `T =
/// 0`, `S = 0` or `Dv = 0` gives zeros. See "Attention masks" in
/// `docs/semantics.md`.
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
/// // A learned bias over the keys gets its gradient.
/// let bias = Var::zeros(5, candle_core::DType::F32, &dev)?;
/// let y = remat_runtime::nn::attention(&q, &k, &v, false, Some(&bias))?;
/// let g = (y.sqr()?.sum_all()?).backward()?;
/// assert_eq!(g.get(&bias).unwrap().dims(), &[5]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("attention");
    let (out, rest) = forward("attention", q, k, v, causal, mask)?;
    // The node's output is stored as `(B, T, H, D)` and returned as a
    // transposed view: merging the heads afterwards (`transpose(1, 2)` and
    // a reshape to `(B, T, H * D)`) is then a view, not a kept copy.
    let out = Computed::new(out);
    let y = match mask {
        Some(m) if rest.mask_tracked() => {
            let (kv, slot) = bundle(k, v)?;
            let op = Attention {
                out,
                rest,
                bundled: Some((k.detach(), v.detach(), slot)),
            };
            q.apply_op3(&kv, m, op)?
        }
        _ => {
            let op = Attention {
                out,
                rest,
                bundled: None,
            };
            q.apply_op3(k, v, op)?
        }
    };
    y.transpose(1, 2)
}

/// [`attention`] over the packed projection of a transformer block:
/// `qkv` is `(B, T, 3 C)` (queries, keys, values side by side, each `C =
/// heads * D` wide, as one `C -> 3 C` linear layer makes them), the output
/// `(B, T, C)` with the heads merged. The graph keeps `qkv`, the output and
/// one softmax normaliser per query row; the backward returns one `(B, T,
/// 3 C)` gradient. Splitting `qkv` with `narrow`/`reshape`/`transpose`
/// views before [`attention`] computes the same, but candle's backward of
/// each view materialises a zero-padded `(B, T, 3 C)` gradient (three of
/// them, summed), which this op does not. `mask` as in [`attention`]
/// (broadcast to `(B, heads, T, T)`; tracked masks get their gradient; a
/// row with `-inf` on every key gives 0).
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
    let _profile = crate::inspect::profile::op("attention_qkv");
    if qkv.rank() != 3 {
        candle_core::bail!(
            "attention_qkv: the packed projection is {:?}, expected (B, T, 3 x heads x D)",
            qkv.dims()
        );
    }
    let (b, t, c3) = qkv.dims3()?;
    if heads == 0 || heads.checked_mul(3).is_none_or(|w| c3 % w != 0) {
        candle_core::bail!(
            "attention_qkv: the packed projection is {c3} wide, which is not 3 x {heads} heads x a head size"
        );
    }
    let (q, k, v) = split(&qkv.detach(), heads)?;
    let (out, rest) = forward("attention_qkv", &q, &k, &v, causal, mask)?;
    let tracked = rest.mask_tracked();
    let op = AttentionQkv {
        out: Computed::new(out.reshape((b, t, c3 / 3))?),
        rest,
        heads,
    };
    match mask {
        Some(m) if tracked => qkv.apply_op2(m, op),
        _ => qkv.apply_op1(op),
    }
}

/// Queries, keys and values `(B, H, T, D)` as views of `qkv` `(B, T, 3 H D)`.
pub(super) fn split(qkv: &Tensor, heads: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, c3) = qkv.dims3()?;
    let parts = qkv.reshape((b, t, 3, heads, c3 / (3 * heads)))?;
    let part = |i: usize| parts.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
    Ok((part(0)?, part(1)?, part(2)?))
}

/// `(B, H, T, D, Hkv, S, Dv)` of `q` `(B, H, T, D)`, `k` `(B, Hkv, S, D)`
/// and `v` `(B, Hkv, S, Dv)`, or an error naming `op` and the shapes.
fn check_inputs(
    op: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<(usize, usize, usize, usize, usize, usize, usize)> {
    let shapes = || {
        format!(
            "q {:?}, k {:?}, v {:?}; expected q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)",
            q.dims(),
            k.dims(),
            v.dims()
        )
    };
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        candle_core::bail!("{op}: {}", shapes());
    }
    let (b, h, t, d) = q.dims4()?;
    let (bk, hkv, s, dk) = k.dims4()?;
    let hv = v.dim(1)?;
    if h == 0 || hkv == 0 || hv != hkv || h % hkv != 0 {
        candle_core::bail!(
            "{op}: {h} query heads need key and value heads that divide them (keys have {hkv}, values {hv}; {})",
            shapes()
        );
    }
    if (bk, dk) != (b, d) || v.dims()[..3] != k.dims()[..3] {
        candle_core::bail!("{op}: {}", shapes());
    }
    let (qt, kt, vt) = (q.dtype(), k.dtype(), v.dtype());
    if !qt.is_float() || kt != qt || vt != qt {
        candle_core::bail!("{op}: q, k, v are {qt:?}, {kt:?}, {vt:?}; expected one float dtype");
    }
    if !k.device().same_device(q.device()) || !v.device().same_device(q.device()) {
        candle_core::bail!("{op}: q, k, v are on different devices");
    }
    Ok((b, h, t, d, hkv, s, v.dim(3)?))
}

impl Mask {
    /// The mask `m` of scores `(B, H, T, S)` = `dims` of queries `q`, or an
    /// error naming `op`, the mask's shape and the scores'.
    fn new(op: &str, m: &Tensor, q: &Tensor, dims: [usize; 4]) -> Result<Self> {
        let md = m.dims();
        let fits = md.len() <= 4
            && md
                .iter()
                .rev()
                .zip(dims.iter().rev())
                .all(|(&a, &b)| a == b || a == 1);
        if !fits {
            candle_core::bail!(
                "{op}: the mask {md:?} does not broadcast to the scores (B, H, T, S) = {dims:?}"
            );
        }
        if m.dtype() != q.dtype() {
            candle_core::bail!(
                "{op}: the mask {md:?} is {:?} and the queries {:?}: the mask is added to the \
                 scores and must have their dtype (0 where a key is seen, -inf where it is not)",
                m.dtype(),
                q.dtype()
            );
        }
        if !m.device().same_device(q.device()) {
            candle_core::bail!("{op}: the mask is on another device than the queries");
        }
        let mut scores = m.detach();
        while scores.rank() < 4 {
            scores = scores.unsqueeze(0)?;
        }
        Ok(Mask {
            unchanged: Unchanged::none(),
            scores,
            shape: m.shape().clone(),
            tracked: m.track_op(),
            op: op.to_string(),
        })
    }

    /// The mask for query rows `start..start + len` and the first `keys`
    /// keys.
    fn block(&self, start: usize, len: usize, keys: usize) -> Result<Tensor> {
        let mut m = self.scores.clone();
        if m.dim(2)? > 1 {
            m = m.narrow(2, start, len)?;
        }
        if m.dim(3)? > 1 {
            m = m.narrow(3, 0, keys)?;
        }
        Ok(m)
    }

    /// The mask's gradient from `ds`, the gradient of a block's scores
    /// `(B, H, len, keys)`: summed over the dimensions the mask broadcasts
    /// over, zero for keys past `keys`.
    fn gradient_term(&self, ds: &Tensor) -> Result<Tensor> {
        let mut g = ds.clone();
        for dim in 0..4 {
            if self.scores.dim(dim)? == 1 && g.dim(dim)? != 1 {
                g = g.sum_keepdim(dim)?;
            }
        }
        let (n, s) = (g.dim(3)?, self.scores.dim(3)?);
        if s > n {
            g = g.pad_with_zeros(3, 0, s - n)?;
        }
        Ok(g)
    }
}

/// The output, `(B, T, H, D)` contiguous, and what the backward reads.
pub(super) fn forward(
    op: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    mask: Option<&Tensor>,
) -> Result<(Tensor, Residuals)> {
    let _profile = crate::inspect::profile::op("(inside an op) attention");
    let (b, h, t, d, hkv, s, dv) = check_inputs(op, q, k, v)?;
    if causal && s < t {
        candle_core::bail!(
            "{op}: causal masking needs at least as many keys as queries ({t} queries, {s} keys)"
        );
    }
    let mask = mask
        .map(|m| Mask::new(op, m, q, [b, h, t, s]))
        .transpose()?;
    // An untracked mask the backward will read again: its digest now
    // (none when nothing needs a gradient: no backward runs).
    let mask = mask.map(|mut m| {
        if !m.tracked && [q, k, v].iter().any(|t| t.track_op()) {
            m.unchanged = Unchanged::of(&m.scores);
        }
        m
    });
    let group = h / hkv;
    // With no query/key features every score is 0 (the scale is moot).
    let scale = if d == 0 { 1.0 } else { 1.0 / (d as f64).sqrt() };
    let keys = Keys {
        queries: t,
        keys: s,
        causal,
    };
    if [b, t, s, dv].contains(&0) {
        // Nothing to attend to or nothing to compute: zeros (no key is a
        // row masked everywhere).
        let rest = Residuals {
            inv_sum: Tensor::zeros((b, h, t, 1), q.dtype(), q.device())?,
            stats: None,
            mask,
            causal: None,
            scale,
            group,
            keys,
            empty: true,
        };
        return Ok((Tensor::zeros((b, t, h, dv), q.dtype(), q.device())?, rest));
    }
    if super::kernels::fit(q, k, v) && !mask.as_ref().is_some_and(|m| m.tracked) {
        let scores = mask.as_ref().map(|m| &m.scores);
        let (out, stats) = super::kernels::forward(q, k, v, scores, causal, scale)?;
        let rest = Residuals {
            inv_sum: stats.clone(),
            stats: Some(stats),
            mask,
            causal: None,
            scale,
            group,
            keys,
            empty: false,
        };
        return Ok((out, rest));
    }
    let causal = if causal {
        Some(causal_mask(t, s, q.dtype(), q.device())?)
    } else {
        None
    };
    // Contiguous copies for the products, freed after the forward: the
    // graph keeps `q`, `k`, `v` as given (views of a projection need not be
    // copied to be kept).
    let (qd, kt, vd) = (
        q.detach().contiguous()?,
        repeat_heads(&k.detach(), group)?.contiguous()?.t()?,
        repeat_heads(&v.detach(), group)?.contiguous()?,
    );
    let mut outs = Vec::new();
    let mut inv_sums = Vec::new();
    for (start, len) in blocks(t) {
        let n = keys.for_rows(start, len);
        let sc = scores(
            &qd,
            &kt,
            mask.as_ref(),
            causal.as_ref(),
            start,
            len,
            n,
            scale,
        )?;
        let e = exp_shifted(&sc)?;
        drop(sc);
        let inv = inverse_sums(&e)?;
        outs.push(e.matmul(&vd.narrow(2, 0, n)?)?.broadcast_mul(&inv)?);
        inv_sums.push(inv);
    }
    let out = Tensor::cat(&outs, 2)?.transpose(1, 2)?.contiguous()?;
    let rest = Residuals {
        inv_sum: Tensor::cat(&inv_sums, 2)?,
        stats: None,
        mask,
        causal,
        scale,
        group,
        keys,
        empty: false,
    };
    Ok((out, rest))
}

/// `exp(s - max(s))` over the last dimension, the maximum taken as 0 in a
/// row whose scores are all `-inf` (zeros then, not NaN).
fn exp_shifted(s: &Tensor) -> Result<Tensor> {
    let max = s.max_keepdim(D::Minus1)?;
    let max = max
        .eq(f64::NEG_INFINITY)?
        .where_cond(&max.zeros_like()?, &max)?;
    s.broadcast_sub(&max)?.exp()
}

/// `1 / sum(e)` over the last dimension of [`exp_shifted`]'s `e`, 0 where
/// the sum is 0 (a row with no key to see; otherwise the sum is at least
/// 1, its maximum's term).
fn inverse_sums(e: &Tensor) -> Result<Tensor> {
    let sum = e.sum_keepdim(D::Minus1)?;
    sum.gt(0f64)?.where_cond(&sum.recip()?, &sum.zeros_like()?)
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
/// the first `keys` keys: `q k^T * scale + mask + causal`, in the order
/// plain candle computes them (a huge finite mask value absorbs the score
/// the same way).
#[allow(clippy::too_many_arguments)]
fn scores(
    q: &Tensor,
    kt: &Tensor,
    mask: Option<&Mask>,
    causal: Option<&Tensor>,
    start: usize,
    len: usize,
    keys: usize,
    scale: f64,
) -> Result<Tensor> {
    let mut s = (q.narrow(2, start, len)?.matmul(&kt.narrow(3, 0, keys)?)? * scale)?;
    if let Some(m) = mask {
        s = s.broadcast_add(&m.block(start, len, keys)?)?;
    }
    if let Some(c) = causal {
        s = s.broadcast_add(&c.narrow(0, start, len)?.narrow(1, 0, keys)?)?;
    }
    Ok(s)
}

/// The gradients of one call: `dq`, `dk`, `dv` shaped as `q`, `k`, `v`,
/// and the mask's (its own shape) when it is tracked.
struct Grads {
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    dmask: Option<Tensor>,
    /// Where the kernels wrote `dq`, `dk` and `dv` into one `(B, T, 3C)`
    /// tensor, as asked (`dq`, `dk`, `dv` are views of it).
    packed: Option<Tensor>,
}

impl Residuals {
    pub(super) fn mask_tracked(&self) -> bool {
        self.mask.as_ref().is_some_and(|m| m.tracked)
    }

    /// The gradients for queries, keys and values `(B, H or Hkv, T or S,
    /// D)` and the output and its gradient `(B, T, H, D)` (the nodes'
    /// layout).
    ///
    /// `q`, `k` and `v` are taken: views of a projection no one else holds
    /// are released once their contiguous copies exist. `packed`: the
    /// caller wants them packed as `(B, T, 3C)` (`attention_qkv`'s
    /// gradient; the kernels then write them there).
    fn backward(
        &self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: &Tensor,
        dout: &Tensor,
        packed: bool,
    ) -> Result<Grads> {
        let _profile = crate::inspect::profile::backward("(inside an op) attention");
        if let Some(m) = &self.mask {
            m.unchanged.check(&m.scores, &m.op, "the mask")?;
        }
        let tracked = self.mask.as_ref().filter(|m| m.tracked);
        if self.empty {
            let dmask = tracked
                .map(|m| Tensor::zeros(m.shape.clone(), q.dtype(), q.device()))
                .transpose()?;
            return Ok(Grads {
                dq: q.zeros_like()?,
                dk: k.zeros_like()?,
                dv: v.zeros_like()?,
                dmask,
                packed: None,
            });
        }
        if let Some(stats) = &self.stats {
            let scores = self.mask.as_ref().map(|m| &m.scores);
            let (causal, scale) = (self.keys.causal, self.scale);
            let args = (&q, &k, &v, scores, causal, scale);
            let (dq, dk, dv, packed) = super::kernels::backward(args, out, dout, stats, packed)?;
            return Ok(Grads {
                dq,
                dk,
                dv,
                dmask: None,
                packed,
            });
        }
        let (q, k, v) = {
            let (q0, k0, v0) = (q, k, v);
            (
                q0.detach().contiguous()?,
                repeat_heads(&k0.detach(), self.group)?.contiguous()?,
                repeat_heads(&v0.detach(), self.group)?.contiguous()?,
            )
        };
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
        // The mask's gradient: one term per block when it has rows (last
        // block first), else their sum.
        let (mut dmask_rows, mut dmask_sum) = (Vec::new(), None);
        for (start, len) in blocks(t).rev() {
            let n = self.keys.for_rows(start, len);
            let sc = scores(
                &q,
                &kt,
                self.mask.as_ref(),
                self.causal.as_ref(),
                start,
                len,
                n,
                self.scale,
            )?;
            // P = exp(S - max S) / l, as the forward computed it: the row's
            // maximum recomputed from the same scores, 1 / l kept.
            let p = exp_shifted(&sc)?.broadcast_mul(&self.inv_sum.narrow(2, start, len)?)?;
            drop(sc);
            let dout_b = dout.narrow(2, start, len)?;
            accumulate(&mut dv, p.t()?.matmul(&dout_b)?)?;
            // dS = P (dP - D), the scores' gradient (the mask's, summed).
            let ds = (dout_b
                .matmul(&vt.narrow(3, 0, n)?)?
                .broadcast_sub(&di.narrow(2, start, len)?)?
                * p)?;
            if let Some(m) = tracked {
                let term = m.gradient_term(&ds)?;
                if m.scores.dim(2)? > 1 {
                    dmask_rows.push(term);
                } else {
                    accumulate(&mut dmask_sum, term)?;
                }
            }
            // Scaled once for both products.
            let ds = (ds * self.scale)?;
            dq.push(ds.matmul(&k.narrow(2, 0, n)?)?);
            accumulate(&mut dk, ds.t()?.matmul(&q.narrow(2, start, len)?)?)?;
        }
        dq.reverse();
        dmask_rows.reverse();
        let none = || candle_core::Error::Msg("remat nn: attention over no query rows".into());
        let (dk, dv) = (dk.ok_or_else(none)?, dv.ok_or_else(none)?);
        let dmask = match tracked {
            None => None,
            Some(m) => {
                let g = if dmask_rows.is_empty() {
                    dmask_sum.ok_or_else(none)?
                } else {
                    Tensor::cat(&dmask_rows, 2)?
                };
                Some(g.reshape(m.shape.clone())?)
            }
        };
        Ok(Grads {
            dq: Tensor::cat(&dq, 2)?,
            dk: sum_heads(&dk, self.group)?,
            dv: sum_heads(&dv, self.group)?,
            dmask,
            packed: None,
        })
    }
}

impl CustomOp3 for Attention {
    forward_computed!("remat-attention", s1 l1, s2 l2, s3 l3);
    fn bwd(
        &self,
        q: &Tensor,
        second: &Tensor,
        third: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _profile = crate::inspect::profile::backward("attention");
        match &self.bundled {
            None => {
                let g = self.rest.backward(
                    q.clone(),
                    second.clone(),
                    third.clone(),
                    out,
                    dout,
                    false,
                )?;
                Ok((Some(g.dq), Some(g.dk), Some(g.dv)))
            }
            // `second` is the bundle of `k` and `v`, `third` the mask.
            Some((k, v, slot)) => {
                let g = self
                    .rest
                    .backward(q.clone(), k.clone(), v.clone(), out, dout, false)?;
                let kv = slot.put(second, g.dk, g.dv)?;
                Ok((Some(g.dq), kv, g.dmask))
            }
        }
    }
}

impl AttentionQkv {
    /// The gradient of `qkv` `(B, T, 3 C)`, and of the mask when tracked.
    fn grads(&self, qkv: &Tensor, out: &Tensor, dout: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        packed_grads(&self.rest, self.heads, qkv.detach(), out, dout)
    }
}

/// The gradient of the packed projection `qkv` `(B, T, 3 C)` (taken: if
/// no one else holds it, it is released once the backward has copied its
/// parts), and of the mask when tracked.
pub(super) fn packed_grads(
    rest: &Residuals,
    heads: usize,
    qkv: Tensor,
    out: &Tensor,
    dout: &Tensor,
) -> Result<(Tensor, Option<Tensor>)> {
    let (b, t, c3) = qkv.dims3()?;
    let (q, k, v) = split(&qkv, heads)?;
    drop(qkv);
    let heads = (b, t, heads, c3 / (3 * heads));
    let (out, dout) = (out.reshape(heads)?, dout.reshape(heads)?);
    let g = rest.backward(q, k, v, &out, &dout, true)?;
    if let Some(packed) = g.packed {
        return Ok((packed, g.dmask));
    }
    // Back to `(B, T, 3, H, D)`, the packed layout, in one copy.
    let packed = Tensor::stack(
        &[
            g.dq.transpose(1, 2)?,
            g.dk.transpose(1, 2)?,
            g.dv.transpose(1, 2)?,
        ],
        2,
    )?;
    Ok((packed.reshape((b, t, c3))?, g.dmask))
}

impl CustomOp1 for AttentionQkv {
    forward_computed!("remat-attention-qkv", s1 l1);
    fn bwd(&self, qkv: &Tensor, out: &Tensor, dout: &Tensor) -> Result<Option<Tensor>> {
        let _profile = crate::inspect::profile::backward("attention_qkv");
        Ok(Some(self.grads(qkv, out, dout)?.0))
    }
}

impl CustomOp2 for AttentionQkv {
    forward_computed!("remat-attention-qkv", s1 l1, s2 l2);
    fn bwd(
        &self,
        qkv: &Tensor,
        _mask: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _profile = crate::inspect::profile::backward("attention_qkv");
        let (dqkv, dmask) = self.grads(qkv, out, dout)?;
        Ok((Some(dqkv), dmask))
    }
}
