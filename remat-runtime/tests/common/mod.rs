//! Models and helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var, D};
use remat_runtime::{Ctx, Policy, Region, Result};

/// Deterministic pseudo-random numbers in [-scale, scale] (candle's CPU RNG
/// cannot be seeded).
pub fn lcg(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

pub fn tensor(dims: &[usize], seed: u64, scale: f64, dtype: DType) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(lcg(n, seed, scale), dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

pub fn var(dims: &[usize], seed: u64, scale: f64, dtype: DType) -> Var {
    Var::from_tensor(&tensor(dims, seed, scale, dtype)).unwrap()
}

/// A loss that weighs every output element by a fixed pseudo-random weight
/// (a plain sum would give a normalized output's gradients zero).
pub fn weighted_loss(y: &Tensor) -> Tensor {
    let n = y.elem_count();
    let w: Vec<f64> = (0..n)
        .map(|i| ((i * 7919 % 97) as f64 / 48.5) - 1.0)
        .collect();
    let w = Tensor::from_vec(w, y.shape(), y.device())
        .unwrap()
        .to_dtype(y.dtype())
        .unwrap();
    (y * w).unwrap().sum_all().unwrap()
}

/// `sum(y * W)` for a fixed pseudo-random `W` of `y`'s shape drawn from
/// `seed`: a loss whose gradient is a distinct non-trivial tensor.
pub fn weighted_sum(y: &Tensor, seed: u64) -> Tensor {
    (y * tensor(y.dims(), seed, 1.0, y.dtype()))
        .unwrap()
        .sum_all()
        .unwrap()
}

/// Dropout composed of candle ops from `remat_runtime::random::uniform`'s
/// draw (the mask kept in the graph): the reference of `nn::dropout`.
pub fn composed_dropout(x: &Tensor, p: f64) -> candle_core::Result<Tensor> {
    let u =
        remat_runtime::random::uniform(x.shape(), x.device()).map_err(candle_core::Error::wrap)?;
    let keep = u.ge(p)?.to_dtype(x.dtype())?;
    x * (keep * (1.0 / (1.0 - p)))?
}

/// Largest absolute element.
pub fn max_abs(t: &Tensor) -> f64 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// Largest absolute difference divided by the largest absolute reference
/// value; infinite where either holds a NaN (candle's `max` skips them, so
/// NaNs would otherwise compare equal to anything).
pub fn rel_diff(a: &Tensor, reference: &Tensor) -> f64 {
    assert_eq!(a.dims(), reference.dims());
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let r = reference
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap();
    let has_nan = |t: &Tensor| t.to_vec1::<f64>().unwrap().iter().any(|v| v.is_nan());
    if has_nan(&a) || has_nan(&r) {
        return f64::INFINITY;
    }
    let diff: f64 = (&a - &r)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap();
    let scale: f64 = r.abs().unwrap().max(0).unwrap().to_scalar().unwrap();
    if diff == 0.0 {
        0.0
    } else {
        diff / scale.max(1e-30)
    }
}

/// Which policy each statement gets.
pub type PolicyFn = Arc<dyn Fn(&str) -> Policy + Send + Sync>;

pub fn all(p: Policy) -> PolicyFn {
    Arc::new(move |_| p)
}

pub fn saving(names: &'static [&'static str]) -> PolicyFn {
    Arc::new(move |n| {
        if names.contains(&n) {
            Policy::Save
        } else {
            Policy::Recompute
        }
    })
}

// ---------------------------------------------------------------- MLP block

#[derive(Clone)]
pub struct Mlp {
    pub w1: Var,
    pub b1: Var,
    pub w2: Var,
    pub b2: Var,
}

impl Mlp {
    pub fn new(d: usize, hidden: usize, seed: u64, dtype: DType) -> Self {
        Mlp {
            w1: var(&[d, hidden], seed, 0.3, dtype),
            b1: var(&[hidden], seed + 1, 0.1, dtype),
            w2: var(&[hidden, d], seed + 2, 0.3, dtype),
            b2: var(&[d], seed + 3, 0.1, dtype),
        }
    }

    pub fn vars(&self) -> Vec<Var> {
        vec![
            self.w1.clone(),
            self.b1.clone(),
            self.w2.clone(),
            self.b2.clone(),
        ]
    }

    /// The block written as plain candle code, with no runtime involved.
    pub fn plain(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.matmul(&self.w1)?.broadcast_add(&self.b1)?;
        let g = h.gelu_erf()?;
        let o = g.matmul(&self.w2)?.broadcast_add(&self.b2)?;
        x + o
    }

    /// The same block as statements.
    pub fn body(&self, ctx: &mut Ctx, x: &Tensor, pol: &PolicyFn) -> Result<Tensor> {
        let p = self.clone();
        let h = ctx.statement("fc1", pol("fc1"), &[x], |t| {
            t[0].matmul(&p.w1)?.broadcast_add(&p.b1)
        })?;
        let g = ctx.statement("act", pol("act"), &[&h], |t| t[0].gelu_erf())?;
        let o = ctx.statement("fc2", pol("fc2"), &[&g], |t| {
            t[0].matmul(&p.w2)?.broadcast_add(&p.b2)
        })?;
        ctx.statement("residual", pol("residual"), &[x, &o], |t| &t[0] + &t[1])
    }

    pub fn region(&self, name: &str, x: &Tensor, pol: PolicyFn, enabled: bool) -> Result<Tensor> {
        let me = self.clone();
        Region::new(name)
            .enabled(enabled)
            .run(&[x], move |ctx, ins| me.body(ctx, &ins[0], &pol))
    }
}

// ---------------------------------------------------------- GPT-2 style block

#[derive(Clone)]
pub struct Gpt {
    pub n_head: usize,
    pub ln1_g: Var,
    pub ln1_b: Var,
    pub w_qkv: Var,
    pub b_qkv: Var,
    pub w_proj: Var,
    pub b_proj: Var,
    pub ln2_g: Var,
    pub ln2_b: Var,
    pub w_fc: Var,
    pub b_fc: Var,
    pub w_out: Var,
    pub b_out: Var,
}

pub const GPT_STATEMENTS: [&str; 10] = [
    "ln1",
    "attn.qkv",
    "heads",
    "attn.core",
    "merge",
    "attn.res",
    "ln2",
    "mlp.fc",
    "mlp.proj",
    "mlp.res",
];

impl Gpt {
    pub fn new(c: usize, n_head: usize, seed: u64, dtype: DType) -> Self {
        let s = 0.5 / (c as f64).sqrt();
        Gpt {
            n_head,
            ln1_g: Var::from_tensor(&(tensor(&[c], seed, 0.1, dtype) + 1.0).unwrap()).unwrap(),
            ln1_b: var(&[c], seed + 1, 0.1, dtype),
            w_qkv: var(&[c, 3 * c], seed + 2, s, dtype),
            b_qkv: var(&[3 * c], seed + 3, 0.1, dtype),
            w_proj: var(&[c, c], seed + 4, s, dtype),
            b_proj: var(&[c], seed + 5, 0.1, dtype),
            ln2_g: Var::from_tensor(&(tensor(&[c], seed + 6, 0.1, dtype) + 1.0).unwrap()).unwrap(),
            ln2_b: var(&[c], seed + 7, 0.1, dtype),
            w_fc: var(&[c, 4 * c], seed + 8, s, dtype),
            b_fc: var(&[4 * c], seed + 9, 0.1, dtype),
            w_out: var(&[4 * c, c], seed + 10, s, dtype),
            b_out: var(&[c], seed + 11, 0.1, dtype),
        }
    }

    pub fn vars(&self) -> Vec<Var> {
        vec![
            self.ln1_g.clone(),
            self.ln1_b.clone(),
            self.w_qkv.clone(),
            self.b_qkv.clone(),
            self.w_proj.clone(),
            self.b_proj.clone(),
            self.ln2_g.clone(),
            self.ln2_b.clone(),
            self.w_fc.clone(),
            self.b_fc.clone(),
            self.w_out.clone(),
            self.b_out.clone(),
        ]
    }

    /// Pre-LN block: causal self-attention and a GELU MLP, with differentiable
    /// candle ops only.
    pub fn body(&self, ctx: &mut Ctx, x: &Tensor, mask: &Tensor, pol: &PolicyFn) -> Result<Tensor> {
        let p = self.clone();
        let (b, t, c) = x.dims3()?;
        let nh = self.n_head;
        let hd = c / nh;
        let h = ctx.statement("ln1", pol("ln1"), &[x], |a| {
            candle_nn::ops::layer_norm_slow(&a[0], &p.ln1_g, &p.ln1_b, 1e-5)
        })?;
        let qkv = ctx.statement("attn.qkv", pol("attn.qkv"), &[&h], |a| {
            a[0].broadcast_matmul(&p.w_qkv)?.broadcast_add(&p.b_qkv)
        })?;
        let (q, k, v) = ctx.statement("heads", pol("heads"), &[&qkv], |a| {
            let split = |i: usize| -> candle_core::Result<Tensor> {
                a[0].narrow(2, i * c, c)?
                    .reshape((b, t, nh, hd))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            Ok::<_, remat_runtime::RematError>((split(0)?, split(1)?, split(2)?))
        })?;
        let y = ctx.statement("attn.core", pol("attn.core"), &[&q, &k, &v, mask], |a| {
            let att = (a[0].matmul(&a[1].t()?)? * (1.0 / (hd as f64).sqrt()))?;
            let att = att.broadcast_add(&a[3])?;
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            att.matmul(&a[2])
        })?;
        let y = ctx.statement("merge", pol("merge"), &[&y], |a| {
            a[0].transpose(1, 2)?.reshape((b, t, c))
        })?;
        let x = ctx.statement("attn.res", pol("attn.res"), &[x, &y], |a| {
            let proj = a[1].broadcast_matmul(&p.w_proj)?.broadcast_add(&p.b_proj)?;
            &a[0] + proj
        })?;
        let h = ctx.statement("ln2", pol("ln2"), &[&x], |a| {
            candle_nn::ops::layer_norm_slow(&a[0], &p.ln2_g, &p.ln2_b, 1e-5)
        })?;
        let f = ctx.statement("mlp.fc", pol("mlp.fc"), &[&h], |a| {
            a[0].broadcast_matmul(&p.w_fc)?
                .broadcast_add(&p.b_fc)?
                .gelu()
        })?;
        let o = ctx.statement("mlp.proj", pol("mlp.proj"), &[&f], |a| {
            a[0].broadcast_matmul(&p.w_out)?.broadcast_add(&p.b_out)
        })?;
        ctx.statement("mlp.res", pol("mlp.res"), &[&x, &o], |a| &a[0] + &a[1])
    }

    /// The same parameters, copied to `dev`.
    pub fn to_device(&self, dev: &Device) -> Self {
        let to = |v: &Var| Var::from_tensor(&v.as_tensor().to_device(dev).unwrap()).unwrap();
        Gpt {
            n_head: self.n_head,
            ln1_g: to(&self.ln1_g),
            ln1_b: to(&self.ln1_b),
            w_qkv: to(&self.w_qkv),
            b_qkv: to(&self.b_qkv),
            w_proj: to(&self.w_proj),
            b_proj: to(&self.b_proj),
            ln2_g: to(&self.ln2_g),
            ln2_b: to(&self.ln2_b),
            w_fc: to(&self.w_fc),
            b_fc: to(&self.b_fc),
            w_out: to(&self.w_out),
            b_out: to(&self.b_out),
        }
    }

    pub fn region(
        &self,
        name: &str,
        x: &Tensor,
        mask: &Tensor,
        pol: PolicyFn,
        enabled: bool,
    ) -> Result<Tensor> {
        let me = self.clone();
        Region::new(name)
            .enabled(enabled)
            .run(&[x, mask], move |ctx, ins| {
                me.body(ctx, &ins[0], &ins[1], &pol)
            })
    }
}

/// Additive causal mask: 0 on and below the diagonal, -inf above.
/// Queries, keys and values `(B, H, T, D)` of a packed `(B, T, 3 H D)`
/// projection, split with contiguous copies as a model written with
/// candle's ops does.
/// A difference quotient: how a finite-difference check differentiates a
/// loss along one element.
#[derive(Clone, Copy, Debug)]
pub enum Quotient {
    /// `(L(x + h) - L(x - h)) / 2h`: error O(h²).
    Central(f64),
    /// Richardson's five points, `(8 (L(x + h) - L(x - h)) - (L(x + 2h) -
    /// L(x - 2h))) / 12h`: error O(h⁴).
    FivePoint(f64),
}

/// The worst element of a finite-difference check of one input: for each
/// element `j` of `base` (the input's values, flattened), `quotient` of
/// `loss` moved along `j` against `analytic[j]`. Returns the largest error
/// relative to `analytic`'s largest magnitude floored at `floor`, the
/// element where it is, and the quotient there. `loss(moved)` is the loss
/// with the input's values replaced by `moved`. A NaN quotient (an
/// infinite entry moved: `inf - inf`) counts as 0.
pub fn worst_difference(
    base: &[f64],
    analytic: &[f64],
    floor: f64,
    quotient: Quotient,
    mut loss: impl FnMut(Vec<f64>) -> f64,
) -> (f64, usize, f64) {
    assert_eq!(base.len(), analytic.len());
    let scale = analytic.iter().fold(floor, |a, b| a.max(b.abs()));
    let mut worst = (0f64, 0usize, 0f64);
    for (j, &g) in analytic.iter().enumerate() {
        let mut at = |d: f64| {
            let mut moved = base.to_vec();
            moved[j] += d;
            loss(moved)
        };
        let numeric = match quotient {
            Quotient::Central(h) => (at(h) - at(-h)) / (2.0 * h),
            Quotient::FivePoint(h) => {
                (8.0 * (at(h) - at(-h)) - (at(2.0 * h) - at(-2.0 * h))) / (12.0 * h)
            }
        };
        let numeric = if numeric.is_nan() { 0.0 } else { numeric };
        let err = (numeric - g).abs() / scale;
        if err > worst.0 {
            worst = (err, j, numeric);
        }
    }
    worst
}

/// A tensor's values as `f64`s, flattened.
pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

pub fn split_heads(qkv: &Tensor, n_head: usize) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (b, t, c3) = qkv.dims3()?;
    let c = c3 / 3;
    let split = |i: usize| {
        qkv.narrow(2, i * c, c)?
            .reshape((b, t, n_head, c / n_head))?
            .transpose(1, 2)?
            .contiguous()
    };
    Ok((split(0)?, split(1)?, split(2)?))
}

/// Grouped-query attention's `repeat_kv`, as candle-transformers writes
/// it: `(b, h, s, d)` to `(b, h * n, s, d)`, each head `n` times in a row.
pub fn repeat_kv(x: &Tensor, n: usize) -> candle_core::Result<Tensor> {
    let (b, h, s, d) = x.dims4()?;
    Tensor::cat(&vec![x; n], 2)?.reshape((b, h * n, s, d))
}

/// The additive causal mask of `t` queries over as many keys: 0 where
/// query `i` may see key `j` (`j <= i`), `-inf` elsewhere.
pub fn causal_mask(t: usize, dtype: DType) -> Tensor {
    causal_mask_over(t, t, dtype)
}

/// The additive causal mask of `t` queries over `s` keys, the queries
/// being the last `t` positions: 0 where query `i` may see key `j` (`j <=
/// i + s - t`), `-inf` elsewhere.
pub fn causal_mask_over(t: usize, s: usize, dtype: DType) -> Tensor {
    let v: Vec<f32> = (0..t * s)
        .map(|x| {
            if x % s > x / s + s - t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(v, (t, s), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}
