//! A transformer's MLP as one node whose wide intermediates are released by
//! its backward as soon as it has read them.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, InplaceOp2, Layout, Result, Shape};
use candle_core::{Tensor, WithDType};

use super::attach::{forward_computed, Computed};
use super::bundle::{bundle_all, Slot};
use super::kernels::{sum_rows, weight_grad};
use super::linear::{output_dims, product, rows};
use super::prenorm::{norm_backward, norm_forward, normalized, Normed, PreNorm};
use crate::tape::unread;

/// Which MLP.
#[derive(Clone, Copy)]
enum Kind {
    /// `gelu(x W1^T + b1) W2^T + b2`.
    Gelu { fc_bias: bool, proj_bias: bool },
    /// `(silu(x Wg^T) * x Wu^T) Wd^T`.
    Swiglu,
}

/// The weights (and biases), detached, in the bundle's order.
struct Weights {
    kind: Kind,
    params: Vec<Tensor>,
}

struct Mlp {
    out: Computed,
    /// The norm applied first.
    norm: Option<Normed>,
    weights: Weights,
    residual: bool,
    slot: Slot,
    /// The wide intermediates the backward reads (`x W1^T + b1`; or
    /// `x Wg^T` and `x Wu^T`), taken and released by the first backward;
    /// a second backward through the same graph recomputes them.
    kept: Mutex<Option<Vec<Tensor>>>,
}

/// `residual + gelu(n W1^T + b1) W2^T + b2` with `n = norm(x)`, or `x`
/// without a norm: a GPT, BERT or ViT MLP (GELU's tanh approximation,
/// `Tensor::gelu`), the norm before it and its residual add as one node,
/// with candle-nn's `(out, in)` weights. The graph keeps `x`, the
/// parameters and the residual; `n` is recomputed in the backward from one
/// mean and `1/std` per row. The node keeps the wide product
/// `n W1^T + b1` (four times the residual stream in a GPT block) for its
/// backward and releases it there, as soon as the backward has read it:
/// with [`layer_norm_linear`](super::layer_norm_linear) and
/// [`gelu_linear_add`](super::gelu_linear_add) as two nodes the graph holds
/// it until the whole backward returns, and candle sums its gradient into a
/// zero tensor, three such tensors at once. The gradients equal those of
/// [`layer_norm`](super::layer_norm), [`linear`](super::linear) and
/// `gelu_linear_add` bit for bit, but for `W2`'s above 256 rows: on a CPU
/// the backward writes `dh` over the kept product a quarter of the rows at
/// a time, and `W2`'s gradient sums the quarters' products (the same terms
/// in another order, a few ulps from one product).
///
/// ```
/// use candle_core::{DType, Device, Var};
/// let dev = Device::Cpu;
/// let x = Var::ones((2, 3, 4), DType::F32, &dev)?;
/// let (w1, b1) = (Var::ones((8, 4), DType::F32, &dev)?, Var::zeros(8, DType::F32, &dev)?);
/// let (w2, b2) = (Var::ones((4, 8), DType::F32, &dev)?, Var::zeros(4, DType::F32, &dev)?);
/// let (g, b) = (Var::ones(4, DType::F32, &dev)?, Var::zeros(4, DType::F32, &dev)?);
/// let norm = remat_runtime::nn::PreNorm::Layer { gain: &g, bias: &b, eps: 1e-5 };
/// let y = remat_runtime::nn::gelu_mlp(&x, Some(norm), &w1, Some(&b1), &w2, Some(&b2), Some(&x))?;
/// assert_eq!(y.dims(), &[2, 3, 4]);
/// let grads = y.sum_all()?.backward()?;
/// assert!(grads.get(&w1).is_some() && grads.get(&b2).is_some() && grads.get(&g).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn gelu_mlp(
    x: &Tensor,
    norm: Option<PreNorm>,
    w1: &Tensor,
    b1: Option<&Tensor>,
    w2: &Tensor,
    b2: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("gelu_mlp");
    let kind = Kind::Gelu {
        fc_bias: b1.is_some(),
        proj_bias: b2.is_some(),
    };
    let params = [Some(w1), b1, Some(w2), b2];
    fused(
        x,
        norm,
        kind,
        params.into_iter().flatten().collect(),
        residual,
    )
}

/// `residual + (silu(n Wg^T) * n Wu^T) Wd^T` with `n = norm(x)`, or `x`
/// without a norm: a Llama, Mistral or Qwen2 MLP (`gate_proj`, `up_proj`,
/// `down_proj` without biases, candle-nn's `(out, in)` weights), the norm
/// before it (their `post_attention_layernorm`, an RMS norm) and its
/// residual add as one node. The graph keeps `x`, the weights and the
/// residual; `n` is recomputed in the backward; the node keeps the gate's and the
/// up projection's outputs for its backward and releases them there, as
/// soon as the backward has read them (written as separate ops, the graph
/// holds them, `silu` of the gate and their product until the whole
/// backward returns). On a CPU the backward writes their gradients over
/// them a quarter of the rows at a time (above 256 rows), and `Wd`'s
/// gradient sums the quarters' products (a few ulps from one product).
///
/// ```
/// use candle_core::{DType, Device, Var};
/// let dev = Device::Cpu;
/// let x = Var::ones((2, 4), DType::F32, &dev)?;
/// let gate = Var::ones((8, 4), DType::F32, &dev)?;
/// let up = Var::ones((8, 4), DType::F32, &dev)?;
/// let down = Var::ones((4, 8), DType::F32, &dev)?;
/// let gain = Var::ones(4, DType::F32, &dev)?;
/// let norm = remat_runtime::nn::PreNorm::Rms { gain: &gain, eps: 1e-6 };
/// let y = remat_runtime::nn::swiglu_mlp(&x, Some(norm), &gate, &up, &down, Some(&x))?;
/// assert_eq!(y.dims(), &[2, 4]);
/// let grads = y.sum_all()?.backward()?;
/// assert!(grads.get(&x).is_some() && grads.get(&gate).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn swiglu_mlp(
    x: &Tensor,
    norm: Option<PreNorm>,
    gate: &Tensor,
    up: &Tensor,
    down: &Tensor,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("swiglu_mlp");
    fused(x, norm, Kind::Swiglu, vec![gate, up, down], residual)
}

fn fused(
    x: &Tensor,
    norm: Option<PreNorm>,
    kind: Kind,
    params: Vec<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let weights = Weights {
        kind,
        params: params.iter().map(|p| p.detach()).collect(),
    };
    let dims = output_dims(x, weights.projection())?;
    if let Some(r) = residual {
        if r.dims() != dims.as_slice() {
            let name = match kind {
                Kind::Gelu { .. } => "gelu_mlp",
                Kind::Swiglu => "swiglu_mlp",
            };
            candle_core::bail!(
                "{name}: the residual has shape {:?} but the MLP's output has {dims:?}: \
                 they must be equal",
                r.dims()
            );
        }
    }
    let x_rows = x.detach().reshape(rows(x)?)?;
    let (n, norm_state) = norm_forward(norm.as_ref(), x_rows)?;
    let kept = weights.intermediates(&n)?;
    drop(n);
    let mut bundled = norm.map(|n| n.params()).unwrap_or_default();
    bundled.extend(params);
    bundled.extend(residual);
    let (pack, slot) = bundle_all(&bundled)?;
    // The backward reads the kept intermediates, not the output.
    unread::op_output(x, |unread| {
        let y = if unread {
            unread::uncomputed(dims, x.dtype(), x.device())?
        } else {
            let y = weights.forward(&kept)?.reshape(dims)?;
            match residual {
                Some(r) => (y + r.detach())?,
                None => y,
            }
        };
        let op = Mlp {
            out: Computed::new(y),
            norm: norm_state,
            weights,
            residual: residual.is_some(),
            slot,
            kept: Mutex::new(Some(kept)),
        };
        x.apply_op2(&pack, op)
    })
}

impl Weights {
    /// The last projection's weight, `(out, hidden)`.
    fn projection(&self) -> &Tensor {
        match self.kind {
            Kind::Gelu { fc_bias, .. } => &self.params[1 + usize::from(fc_bias)],
            Kind::Swiglu => &self.params[2],
        }
    }

    /// The wide intermediates from `x` `(rows, in)`, detached.
    fn intermediates(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let p = &self.params;
        match self.kind {
            Kind::Gelu { fc_bias, .. } => {
                let b1 = fc_bias.then(|| &p[1]);
                Ok(vec![product(x, &p[0], b1)?])
            }
            Kind::Swiglu => Ok(vec![product(x, &p[0], None)?, product(x, &p[1], None)?]),
        }
    }

    /// The output `(rows, out)` from the intermediates, before the residual.
    fn forward(&self, kept: &[Tensor]) -> Result<Tensor> {
        let p = &self.params;
        match self.kind {
            Kind::Gelu { fc_bias, proj_bias } => {
                let w2 = &p[1 + usize::from(fc_bias)];
                let b2 = proj_bias.then(|| &p[2 + usize::from(fc_bias)]);
                product(&kept[0].gelu()?, w2, b2)
            }
            Kind::Swiglu => {
                let a = (candle_nn::ops::silu(&kept[0])? * &kept[1])?;
                product(&a, &p[2], None)
            }
        }
    }

    /// The gradients of `x` and of the parameters in the bundle's order,
    /// for the output's gradient `g` `(rows, out)`.
    fn grads(
        &self,
        n: &dyn Fn() -> Result<Tensor>,
        mut kept: Vec<Tensor>,
        g: &Tensor,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let p = &self.params;
        match self.kind {
            Kind::Gelu { fc_bias, proj_bias } => {
                let h = kept.pop().expect("one intermediate");
                let w2 = &p[1 + usize::from(fc_bias)];
                let (dw2, dh) = gelu_grads(h, g, w2)?;
                let dw1 = weight_grad(&n()?, &dh)?;
                let dx = dh.matmul(&p[0])?;
                let mut grads = vec![dw1];
                if fc_bias {
                    grads.push(sum_rows(&dh)?);
                }
                drop(dh);
                grads.push(dw2);
                if proj_bias {
                    grads.push(sum_rows(g)?);
                }
                Ok((dx, grads))
            }
            Kind::Swiglu => {
                let u = kept.pop().expect("two intermediates");
                let gate = kept.pop().expect("two intermediates");
                let (dwd, dgate, dup) = swiglu_chunks(gate, u, g, &p[2])?;
                let dx = (dgate.matmul(&p[0])? + dup.matmul(&p[1])?)?;
                let n = n()?;
                let dwg = weight_grad(&n, &dgate)?;
                let dwu = weight_grad(&n, &dup)?;
                Ok((dx, vec![dwg, dwu, dwd]))
            }
        }
    }
}

impl CustomOp2 for Mlp {
    forward_computed!("remat-mlp", s1 l1, s2 l2);
    fn bwd(
        &self,
        x: &Tensor,
        pack: &Tensor,
        _: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _profile = crate::inspect::profile::backward("mlp");
        let x = x.detach();
        let dy = dy.detach();
        let x2 = x.reshape(rows(&x)?)?;
        let g = dy.reshape((x2.dim(0)?, dy.dim(candle_core::D::Minus1)?))?;
        // The normalized input, recomputed when it is read: after the wide
        // intermediates are released.
        let n = || normalized(self.norm.as_ref(), &x2);
        let kept = crate::lock(&self.kept).take();
        let kept = match kept {
            Some(kept) => kept,
            None => self.weights.intermediates(&n()?)?,
        };
        let (dn, mlp_grads) = self.weights.grads(&n, kept, &g)?;
        let (dx, mut grads) = norm_backward(self.norm.as_ref(), &x2, dn)?;
        grads.extend(mlp_grads);
        if self.residual {
            grads.push(dy);
        }
        Ok((
            Some(dx.reshape(x.shape())?),
            self.slot.put_all(pack, grads)?,
        ))
    }
}

/// Rows of `h` per chunk of the GELU MLP's backward: a quarter of them,
/// and at least [`MIN_CHUNK`].
fn chunk_rows(rows: usize) -> usize {
    rows.div_ceil(4).max(MIN_CHUNK)
}

/// Below this many rows the backward runs in one chunk.
const MIN_CHUNK: usize = 256;

/// `dW2 = g^T gelu(h)` and `dh = (g W2) * gelu'(h)` from the kept `h`
/// `(rows, hidden)`, the output's gradient `g` `(rows, out)` and `W2`
/// `(out, hidden)`.
///
/// On a CPU, `dh` is written over `h` a chunk of rows at a time: each
/// chunk's `gelu(h)` and `g W2` are the only other wide tensors, a quarter
/// of `h` each, where the whole `g W2` beside `h` would double it. `dW2`
/// then sums the chunks' products (the same terms summed in another order:
/// a few ulps from one product; for bf16 and f16 each chunk's product,
/// rounded to the dtype by the matmul, is summed in f32 and the sum rounded
/// once more; one chunk below [`MIN_CHUNK`] rows, as `gelu_linear_add`
/// computes it).
/// Elsewhere, as `gelu_linear_add` computes it.
fn gelu_grads(h: Tensor, g: &Tensor, w2: &Tensor) -> Result<(Tensor, Tensor)> {
    let rows = h.dim(0)?;
    if rows == 0 || !(one_pass(&h) && g.dtype() == h.dtype()) {
        // `gelu(h)` for `dW2` only, released before `dh`'s tensor exists.
        let dw2 = g.t()?.matmul(&h.gelu()?)?;
        let dh = super::gelu::backward(&h, &g.matmul(w2)?)?;
        return Ok((dw2, dh));
    }
    let chunk = chunk_rows(rows);
    let mut dw2 = Sum::default();
    for start in (0..rows).step_by(chunk) {
        let len = chunk.min(rows - start);
        let (h_c, g_c) = (h.narrow(0, start, len)?, g.narrow(0, start, len)?);
        dw2.add(g_c.t()?.matmul(&h_c.gelu()?)?)?;
        let da_c = g_c.matmul(w2)?;
        // `h`'s rows become `dh`'s: `h` is this node's own (taken from it
        // or recomputed), read by no one else.
        h_c.inplace_op2(&da_c, &GELU_GRAD)?;
    }
    Ok((dw2.total()?, h))
}

/// The sum of the chunks' products of a weight's gradient: in the terms'
/// dtype for f32 and f64; for narrower floats in f32, rounded to the dtype
/// once at the end (each term was already rounded by its product).
#[derive(Default)]
struct Sum(Option<(Tensor, DType)>);

impl Sum {
    fn add(&mut self, term: Tensor) -> Result<()> {
        let dtype = term.dtype();
        let term = match dtype {
            DType::F16 | DType::BF16 => term.to_dtype(DType::F32)?,
            _ => term,
        };
        self.0 = Some(match self.0.take() {
            None => (term, dtype),
            Some((acc, dtype)) => ((acc + term)?, dtype),
        });
        Ok(())
    }

    fn total(self) -> Result<Tensor> {
        match self.0 {
            Some((sum, dtype)) => sum.to_dtype(dtype),
            None => candle_core::bail!("remat nn: an MLP over no rows"),
        }
    }
}

/// `dWd = g^T (silu(gate) * up)` and the gradients of `gate` and `up`
/// (the kept `(rows, hidden)` products), for the output's gradient `g`
/// `(rows, out)` and `Wd` `(out, hidden)`.
///
/// On a CPU, the gradients are written over `gate` and `up` a chunk of
/// rows at a time, as [`gelu_grads`] does (and `dWd` sums the chunks'
/// products). Elsewhere in one piece.
fn swiglu_chunks(
    gate: Tensor,
    up: Tensor,
    g: &Tensor,
    wd: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let rows = gate.dim(0)?;
    let same = up.dtype() == gate.dtype() && g.dtype() == gate.dtype();
    if rows == 0 || !(same && one_pass(&gate) && one_pass(&up)) {
        let dwd = g.t()?.matmul(&(candle_nn::ops::silu(&gate)? * &up)?)?;
        let (dgate, dup) = swiglu_grads(&gate, &up, g.matmul(wd)?)?;
        return Ok((dwd, dgate, dup));
    }
    let chunk = chunk_rows(rows);
    let mut dwd = Sum::default();
    for start in (0..rows).step_by(chunk) {
        let len = chunk.min(rows - start);
        let (gate_c, up_c, g_c) = (
            gate.narrow(0, start, len)?,
            up.narrow(0, start, len)?,
            g.narrow(0, start, len)?,
        );
        dwd.add(
            g_c.t()?
                .matmul(&(candle_nn::ops::silu(&gate_c)? * &up_c)?)?,
        )?;
        let (dgate_c, dup_c) = swiglu_grads(&gate_c, &up_c, g_c.matmul(wd)?)?;
        // `gate` and `up` are this node's own, read by no one else.
        gate_c.inplace_op2(&dgate_c, &COPY)?;
        up_c.inplace_op2(&dup_c, &COPY)?;
    }
    Ok((dwd.total()?, gate, up))
}

/// `(da * u * silu'(gate), da * silu(gate))`, the second written over `da`
/// on a CPU.
fn swiglu_grads(gate: &Tensor, u: &Tensor, da: Tensor) -> Result<(Tensor, Tensor)> {
    let same = u.dtype() == gate.dtype() && da.dtype() == gate.dtype();
    if same && one_pass(gate) && one_pass(u) && one_pass(&da) {
        let dgate = gate.apply_op3_no_bwd(u, &da, &SwigluGateGrad)?;
        da.inplace_op2(gate, &SWIGLU_UP_GRAD)?;
        return Ok((dgate, da));
    }
    let s = candle_nn::ops::sigmoid(gate)?;
    let dsilu = (&s * ((gate * (1.0 - &s)?)? + 1.0)?)?;
    let dgate = ((&da * u)? * dsilu)?;
    let dup = (&da * (gate * &s)?)?;
    Ok((dgate, dup))
}

/// Whether the one-pass CPU kernels apply to `t` (each element computed in
/// f64 and rounded once to the dtype).
fn one_pass(t: &Tensor) -> bool {
    let float = matches!(
        t.dtype(),
        DType::F32 | DType::F64 | DType::F16 | DType::BF16
    );
    t.device().is_cpu() && float && t.is_contiguous()
}

/// The contiguous slice of a CPU storage, by its layout.
fn slice<'a, T: WithDType>(s: &'a [T], l: &Layout) -> Result<&'a [T]> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("remat nn: an MLP's backward wants contiguous tensors")
    };
    Ok(&s[a..b])
}

/// `s(x) = 1 / (1 + e^-x)`, in f64.
fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `a <- f(a, b)` element by element (computed in f64), over contiguous CPU
/// tensors of one float dtype.
struct Over {
    name: &'static str,
    f: fn(f64, f64) -> f64,
}

/// `h <- da * gelu'(h)`: the GELU's input's gradient, over its input.
const GELU_GRAD: Over = Over {
    name: "remat-gelu-grad-over-input",
    f: |h, da| super::gelu::derivative(h) * da,
};

/// `da <- da * silu(gate)`: the up projection's gradient.
const SWIGLU_UP_GRAD: Over = Over {
    name: "remat-swiglu-up-grad",
    f: |da, gate| da * gate * sigmoid(gate),
};

/// `a <- b`.
const COPY: Over = Over {
    name: "remat-copy-over",
    f: |_, b| b,
};

impl InplaceOp2 for Over {
    fn name(&self) -> &'static str {
        self.name
    }
    fn cpu_fwd(&self, a: &mut CpuStorage, la: &Layout, b: &CpuStorage, lb: &Layout) -> Result<()> {
        fn pass<T: WithDType>(a: &mut [T], b: &[T], f: fn(f64, f64) -> f64) {
            for (a, &b) in a.iter_mut().zip(b) {
                *a = T::from_f64(f(a.to_f64(), b.to_f64()));
            }
        }
        let Some((s, e)) = la.contiguous_offsets() else {
            candle_core::bail!("remat nn: an MLP's backward wants contiguous tensors")
        };
        match (a, b) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => pass(&mut a[s..e], slice(b, lb)?, self.f),
            (CpuStorage::F64(a), CpuStorage::F64(b)) => pass(&mut a[s..e], slice(b, lb)?, self.f),
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => pass(&mut a[s..e], slice(b, lb)?, self.f),
            (CpuStorage::F16(a), CpuStorage::F16(b)) => pass(&mut a[s..e], slice(b, lb)?, self.f),
            _ => candle_core::bail!("remat nn: the one-pass MLP backward is for float tensors"),
        }
        Ok(())
    }
}

/// `da * u * silu'(gate)`: the gate's gradient, in one pass.
struct SwigluGateGrad;

impl CustomOp3 for SwigluGateGrad {
    fn name(&self) -> &'static str {
        "remat-swiglu-gate-grad"
    }
    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        lg: &Layout,
        u: &CpuStorage,
        lu: &Layout,
        da: &CpuStorage,
        ld: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn pass<T: WithDType>(gate: &[T], u: &[T], da: &[T]) -> Vec<T> {
            gate.iter()
                .zip(u)
                .zip(da)
                .map(|((&x, &u), &d)| {
                    let x = x.to_f64();
                    let s = sigmoid(x);
                    T::from_f64(d.to_f64() * u.to_f64() * s * (1.0 + x * (1.0 - s)))
                })
                .collect()
        }
        let out = match (g, u, da) {
            (CpuStorage::F32(g), CpuStorage::F32(u), CpuStorage::F32(d)) => {
                CpuStorage::F32(pass(slice(g, lg)?, slice(u, lu)?, slice(d, ld)?))
            }
            (CpuStorage::F64(g), CpuStorage::F64(u), CpuStorage::F64(d)) => {
                CpuStorage::F64(pass(slice(g, lg)?, slice(u, lu)?, slice(d, ld)?))
            }
            (CpuStorage::BF16(g), CpuStorage::BF16(u), CpuStorage::BF16(d)) => {
                CpuStorage::BF16(pass(slice(g, lg)?, slice(u, lu)?, slice(d, ld)?))
            }
            (CpuStorage::F16(g), CpuStorage::F16(u), CpuStorage::F16(d)) => {
                CpuStorage::F16(pass(slice(g, lg)?, slice(u, lu)?, slice(d, ld)?))
            }
            _ => candle_core::bail!("remat nn: the one-pass MLP backward is for float tensors"),
        };
        Ok((out, lg.shape().clone()))
    }
}
