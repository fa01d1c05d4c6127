//! Real model code from several families, written as candle-transformers
//! writes its layers (methods on `&self` in `remat!`, candle-nn's `Linear`
//! and `Embedding`, the drop-ins): T5's relative-position bias computed
//! from the sequence lengths, a ViT's patch embedding with its class token
//! and positions, Llama's grouped-query attention with fixed and learned
//! rotary tables, a Whisper layer over sinusoids and cancelling inputs.
//! Each is compared with the same model in plain candle (same weights),
//! the output and every gradient, under eight or nine plans, two steps
//! each. (First written as a held-out suite by a reviewer who had not seen
//! the project's tests.)

#![allow(clippy::too_many_arguments)]

use candle_core::{DType, Device, Module, Result, Tensor, Var, D};
use candle_nn::{Embedding, Linear};
use remat_runtime::{nn, remat, Plan, Policy};

use crate::common::{causal_mask, rel_diff, repeat_kv, tensor, var};

// ------------------------------------------------------------------ harness

fn parity(name: &str) -> usize {
    name.bytes().map(|b| b as usize).sum::<usize>() % 2
}

fn plans(save_names: &[&'static str]) -> Vec<Plan> {
    let mut v = vec![
        Plan::off(),
        Plan::declared(),
        Plan::recompute_all(),
        Plan::save_all(),
        Plan::budget(0.5),
        Plan::budget(0.15),
        Plan::from_fn("alternate-even", |s| {
            s.declared.unwrap_or(if parity(s.name) == 0 {
                Policy::Save
            } else {
                Policy::Recompute
            })
        }),
        Plan::from_fn("alternate-odd", |s| {
            s.declared.unwrap_or(if parity(s.name) == 1 {
                Policy::Save
            } else {
                Policy::Recompute
            })
        }),
    ];
    if !save_names.is_empty() {
        v.push(Plan::save_only(save_names.iter().copied()));
    }
    v
}

fn loss_of(y: &Tensor) -> Result<Tensor> {
    // sum(y * W) in f64 for a fixed pseudo-random W.
    let y64 = y.to_dtype(DType::F64)?;
    let w = tensor(y.dims(), 991, 1.0, DType::F64);
    (y64 * w)?.sum_all()
}

/// Compares the block under every plan (two steps each) with plain candle:
/// the output and the gradient of every var. Returns the failures.
fn compare(
    label: &str,
    vars: &[(&str, &Var)],
    tol: f64,
    plans: Vec<Plan>,
    plain: &dyn Fn() -> Result<Tensor>,
    blk: &dyn Fn() -> Result<Tensor>,
) -> Vec<String> {
    let mut fails = vec![];
    let y_ref = plain().unwrap();
    let g_ref = loss_of(&y_ref).unwrap().backward().unwrap();
    for plan in plans {
        for step in 0..2 {
            let y = match plan.scope(blk) {
                Ok(y) => y,
                Err(e) => {
                    fails.push(format!("{label} [{plan}] step {step}: forward error: {e}"));
                    break;
                }
            };
            let d = rel_diff(&y, &y_ref);
            if d.is_nan() || d > tol {
                fails.push(format!(
                    "{label} [{plan}] step {step}: output rel diff {d:e}"
                ));
            }
            let g = match loss_of(&y).unwrap().backward() {
                Ok(g) => g,
                Err(e) => {
                    fails.push(format!("{label} [{plan}] step {step}: backward error: {e}"));
                    break;
                }
            };
            for (name, v) in vars {
                match (g.get(v), g_ref.get(v)) {
                    (Some(a), Some(b)) => {
                        let d = rel_diff(a, b);
                        if d.is_nan() || d > tol {
                            fails.push(format!(
                                "{label} [{plan}] step {step}: grad `{name}` rel diff {d:e}"
                            ));
                        }
                    }
                    (None, Some(_)) => fails.push(format!(
                        "{label} [{plan}] step {step}: grad `{name}` MISSING (plain candle has one)"
                    )),
                    (Some(_), None) => fails.push(format!(
                        "{label} [{plan}] step {step}: grad `{name}` present, plain candle has none"
                    )),
                    (None, None) => {}
                }
            }
        }
    }
    fails
}

fn report(fails: Vec<String>) {
    if !fails.is_empty() {
        for f in &fails {
            eprintln!("FAIL {f}");
        }
        panic!("{} failures", fails.len());
    }
}

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 2e-5,
        DType::F16 => 5e-3,
        _ => 3e-2,
    }
}

fn lin(i: usize, o: usize, bias: bool, seed: u64, dtype: DType) -> (Linear, Vec<Var>) {
    let w = var(&[o, i], seed, 0.4, dtype);
    let b = var(&[o], seed + 1, 0.1, dtype);
    let l = Linear::new(
        w.as_tensor().clone(),
        if bias {
            Some(b.as_tensor().clone())
        } else {
            None
        },
    );
    let mut v = vec![w];
    if bias {
        v.push(b);
    }
    (l, v)
}

fn softmax_ref(x: &Tensor) -> Result<Tensor> {
    candle_nn::ops::softmax(x, D::Minus1)
}

fn layer_norm_ref(x: &Tensor, g: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F64)?;
    let mean = x32.mean_keepdim(D::Minus1)?;
    let xc = x32.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = xc
        .broadcast_div(&(var + eps)?.sqrt()?)?
        .to_dtype(x.dtype())?;
    xn.broadcast_mul(g)?.broadcast_add(b)
}

// ------------------------------------------------------- 1. T5 relative bias

fn t5_bucket(rel: i64, bidirectional: bool, num_buckets: u32, max_distance: u32) -> u32 {
    let mut nb = num_buckets;
    let mut ret = 0u32;
    let mut n = -rel;
    if bidirectional {
        nb /= 2;
        if n < 0 {
            ret += nb;
            n = -n;
        }
    } else {
        n = n.max(0);
    }
    let n = n as u32;
    let max_exact = nb / 2;
    if n < max_exact {
        ret + n
    } else {
        let v = max_exact as f32
            + ((n as f32 / max_exact as f32).ln() / (max_distance as f32 / max_exact as f32).ln()
                * (nb - max_exact) as f32);
        ret + (v as u32).min(nb - 1)
    }
}

fn t5_buckets(q: usize, k: usize) -> Vec<Vec<u32>> {
    (0..q)
        .map(|i| {
            (0..k)
                .map(|j| t5_bucket(j as i64 - i as i64, true, 8, 16))
                .collect()
        })
        .collect()
}

#[derive(Clone)]
struct T5Attn {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    rel: Embedding,
    ln_w: Tensor,
    heads: usize,
}

impl T5Attn {
    fn new(c: usize, heads: usize, dtype: DType) -> (Self, Vec<Var>) {
        let mut vars = vec![];
        let mut mk = |seed| {
            let (l, v) = lin(c, c, false, seed, dtype);
            vars.extend(v);
            l
        };
        let (q, k, v, o) = (mk(10), mk(20), mk(30), mk(40));
        let rel = var(&[8, heads], 50, 0.5, dtype);
        let ln = var(&[c], 60, 1.0, dtype);
        vars.push(rel.clone());
        vars.push(ln.clone());
        (
            T5Attn {
                q,
                k,
                v,
                o,
                rel: Embedding::new(rel.as_tensor().clone(), heads),
                ln_w: ln.as_tensor().clone(),
                heads,
            },
            vars,
        )
    }

    fn split(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        x.reshape((b, t, self.heads, c / self.heads))?
            .transpose(1, 2)?
            .contiguous()
    }

    remat! {
        fn forward(&self, xs: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
            let (b, t, c) = xs.dims3()?;
            let h = remat_runtime::candle_nn::ops::rms_norm(xs, &self.ln_w, 1e-6)?;
            #[save] let q = self.split(&self.q.forward(&h)?)?;
            let k = self.split(&self.k.forward(&h)?)?;
            let v = self.split(&self.v.forward(&h)?)?;
            // T5: no scaling; the bias from the sequence lengths.
            let buckets = Tensor::new(t5_buckets(t, t), xs.device())?;
            let bias = self.rel.forward(&buckets)?.permute((2, 0, 1))?.unsqueeze(0)?;
            let scores = q.matmul(&k.t()?)?.broadcast_add(&bias)?;
            let scores = match mask {
                Some(m) => scores.broadcast_add(m)?,
                None => scores,
            };
            let p = remat_runtime::candle_nn::ops::softmax_last_dim(&scores)?;
            let a = p.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
            let o = self.o.forward(&a)?;
            Ok((xs + o)?)
        }
    }

    fn plain(&self, xs: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, t, c) = xs.dims3()?;
        let h = candle_nn::ops::rms_norm_slow(xs, &self.ln_w, 1e-6)?;
        let q = self.split(&self.q.forward(&h)?)?;
        let k = self.split(&self.k.forward(&h)?)?;
        let v = self.split(&self.v.forward(&h)?)?;
        let buckets = Tensor::new(t5_buckets(t, t), xs.device())?;
        let bias = self
            .rel
            .forward(&buckets)?
            .permute((2, 0, 1))?
            .unsqueeze(0)?;
        let mut scores = q.matmul(&k.t()?)?.broadcast_add(&bias)?;
        if let Some(m) = mask {
            scores = scores.broadcast_add(m)?;
        }
        let p = softmax_ref(&scores)?;
        let a = p.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        xs + self.o.forward(&a)?
    }
}

#[test]
fn t5_relative_bias_from_lengths_with_and_without_a_padding_mask() {
    let mut fails = vec![];
    for dtype in [DType::F64, DType::F32] {
        let (m, vars) = T5Attn::new(8, 2, dtype);
        let x = var(&[2, 5, 8], 1, 1.0, dtype);
        // key padding mask (B, 1, 1, S): the last key of sequence 1 padded.
        let pad = Tensor::new(
            &[[0f64, 0., 0., 0., 0.], [0., 0., 0., 0., -1e9]],
            &Device::Cpu,
        )
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .reshape((2, 1, 1, 5))
        .unwrap();
        let mut named: Vec<(&str, &Var)> = vec![("x", &x)];
        let names = ["q", "k", "v", "o", "rel", "ln"];
        for (n, v) in names.iter().zip(vars.iter()) {
            named.push((n, v));
        }
        for mask in [None, Some(&pad)] {
            let label = format!("t5 {dtype:?} mask={}", mask.is_some());
            fails.extend(compare(
                &label,
                &named,
                tol(dtype),
                plans(&["q", "bias", "p", "buckets"]),
                &|| m.plain(x.as_tensor(), mask),
                &|| m.forward(x.as_tensor(), mask),
            ));
        }
    }
    report(fails);
}

// --------------------------------------------- 2. ViT patch embed + cls + pos

#[derive(Clone)]
struct VitEmbed {
    patch: Linear,
    cls: Tensor,
    pos: Tensor,
    ln_g: Tensor,
    ln_b: Tensor,
    qkv_w: Tensor,
    p: usize,
    heads: usize,
}

impl VitEmbed {
    remat! {
        fn forward(&self, img: &Tensor) -> Result<Tensor> {
            let (b, ch, hh, ww) = img.dims4()?;
            let p = self.p;
            let patches = img
                .reshape((b, ch, hh / p, p, ww / p, p))?
                .permute((0, 2, 4, 1, 3, 5))?
                .reshape((b, (hh / p) * (ww / p), ch * p * p))?;
            let emb = self.patch.forward(&patches)?;
            let cls = self.cls.broadcast_as((b, 1, emb.dim(2)?))?;
            let xs = Tensor::cat(&[&cls, &emb], 1)?;
            let xs = xs.broadcast_add(&self.pos)?;
            let h = remat_runtime::candle_nn::ops::layer_norm(&xs, &self.ln_g, &self.ln_b, 1e-6)?;
            let att = nn::qkv_attention(&h, None, &self.qkv_w, None, self.heads, false, None)?;
            Ok((xs + att)?)
        }
    }

    fn plain(&self, img: &Tensor) -> Result<Tensor> {
        let (b, ch, hh, ww) = img.dims4()?;
        let p = self.p;
        let patches = img
            .reshape((b, ch, hh / p, p, ww / p, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .reshape((b, (hh / p) * (ww / p), ch * p * p))?;
        let emb = self.patch.forward(&patches)?;
        let cls = self.cls.broadcast_as((b, 1, emb.dim(2)?))?;
        let xs = Tensor::cat(&[&cls, &emb], 1)?.broadcast_add(&self.pos)?;
        let h = layer_norm_ref(&xs, &self.ln_g, &self.ln_b, 1e-6)?;
        let qkv = h.broadcast_matmul(&self.qkv_w.t()?)?;
        let (b, t, c3) = qkv.dims3()?;
        let c = c3 / 3;
        let d = c / self.heads;
        let sp = |i: usize| -> Result<Tensor> {
            qkv.narrow(2, i * c, c)?
                .reshape((b, t, self.heads, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (sp(0)?, sp(1)?, sp(2)?);
        let s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
        let a = softmax_ref(&s)?
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, c))?;
        xs + a
    }
}

#[test]
fn vit_patch_embedding_cls_token_and_position_add() {
    let mut fails = vec![];
    for dtype in [DType::F64, DType::F32] {
        let c = 8;
        let (patch, pv) = lin(3 * 2 * 2, c, true, 70, dtype);
        let cls = var(&[1, 1, c], 80, 0.5, dtype);
        let pos = var(&[1, 5, c], 81, 0.5, dtype);
        let g = var(&[c], 82, 1.0, dtype);
        let bb = var(&[c], 83, 0.2, dtype);
        let qkv = var(&[3 * c, c], 84, 0.4, dtype);
        let m = VitEmbed {
            patch,
            cls: cls.as_tensor().clone(),
            pos: pos.as_tensor().clone(),
            ln_g: g.as_tensor().clone(),
            ln_b: bb.as_tensor().clone(),
            qkv_w: qkv.as_tensor().clone(),
            p: 2,
            heads: 2,
        };
        let img = var(&[2, 3, 4, 4], 85, 1.0, dtype);
        let named: Vec<(&str, &Var)> = vec![
            ("img", &img),
            ("patch.w", &pv[0]),
            ("patch.b", &pv[1]),
            ("cls", &cls),
            ("pos", &pos),
            ("ln.g", &g),
            ("ln.b", &bb),
            ("qkv", &qkv),
        ];
        fails.extend(compare(
            &format!("vit {dtype:?}"),
            &named,
            tol(dtype),
            plans(&["cls", "emb", "xs#2", "h"]),
            &|| m.plain(img.as_tensor()),
            &|| m.forward(img.as_tensor()),
        ));
    }
    report(fails);
}

// ------------------------------------------- 3. Llama rope: fixed and learned

#[derive(Clone)]
struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    fn new(dim: usize, max: usize, dtype: DType) -> Self {
        let inv: Vec<f32> = (0..dim)
            .step_by(2)
            .map(|i| 1f32 / 10000f32.powf(i as f32 / dim as f32))
            .collect();
        let inv = Tensor::new(inv.as_slice(), &Device::Cpu).unwrap();
        let t = Tensor::arange(0u32, max as u32, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .reshape((max, 1))
            .unwrap();
        let f = t
            .broadcast_mul(&inv.reshape((1, dim / 2)).unwrap())
            .unwrap();
        Rotary {
            cos: f.cos().unwrap().to_dtype(dtype).unwrap(),
            sin: f.sin().unwrap().to_dtype(dtype).unwrap(),
        }
    }
}

#[derive(Clone)]
struct LlamaAttn {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    norm: remat_runtime::candle_nn::RmsNorm,
    rot: Rotary,
    /// A learned scaling of the rotary frequencies (None: the fixed tables).
    freq_scale: Option<Tensor>,
    inv_freq: Tensor,
    heads: usize,
    kv_heads: usize,
}

fn rope_ref(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    candle_nn::rotary_emb::rope_slow(&x.contiguous()?, cos, sin)
}

impl LlamaAttn {
    fn new(
        c: usize,
        heads: usize,
        kv_heads: usize,
        learned: bool,
        dtype: DType,
    ) -> (Self, Vec<Var>) {
        let d = c / heads;
        let (q, mut vars) = lin(c, c, true, 100, dtype);
        let (k, v1) = lin(c, kv_heads * d, true, 110, dtype);
        let (v, v2) = lin(c, kv_heads * d, true, 120, dtype);
        let (o, v3) = lin(c, c, false, 130, dtype);
        vars.extend(v1);
        vars.extend(v2);
        vars.extend(v3);
        let nw = var(&[c], 140, 1.0, dtype);
        vars.push(nw.clone());
        let scale = var(&[1], 141, 1.0, dtype);
        let scale = Var::from_tensor(&(scale.as_tensor().abs().unwrap() + 0.5).unwrap()).unwrap();
        if learned {
            vars.push(scale.clone());
        }
        let inv: Vec<f64> = (0..d)
            .step_by(2)
            .map(|i| 1f64 / 10000f64.powf(i as f64 / d as f64))
            .collect();
        let inv_freq = Tensor::new(inv.as_slice(), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        (
            LlamaAttn {
                q,
                k,
                v,
                o,
                norm: remat_runtime::candle_nn::RmsNorm::new(nw.as_tensor().clone(), 1e-6),
                rot: Rotary::new(d, 16, dtype),
                freq_scale: if learned {
                    Some(scale.as_tensor().clone())
                } else {
                    None
                },
                inv_freq,
                heads,
                kv_heads,
            },
            vars,
        )
    }

    fn tables(&self, t: usize, offset: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        match &self.freq_scale {
            None => Ok((
                self.rot.cos.narrow(0, offset, t)?,
                self.rot.sin.narrow(0, offset, t)?,
            )),
            Some(s) => {
                let pos = Tensor::arange(offset as u32, (offset + t) as u32, dev)?
                    .to_dtype(self.inv_freq.dtype())?
                    .reshape((t, 1))?;
                let f = pos.broadcast_mul(&self.inv_freq.broadcast_mul(s)?.unsqueeze(0)?)?;
                Ok((f.cos()?, f.sin()?))
            }
        }
    }

    remat! {
        fn forward(&self, xs: &Tensor, offset: usize, mask: Option<&Tensor>) -> Result<Tensor> {
            let (b, t, c) = xs.dims3()?;
            let d = c / self.heads;
            let h = self.norm.forward(xs)?;
            let q = self.q.forward(&h)?.reshape((b, t, self.heads, d))?.transpose(1, 2)?;
            let k = self.k.forward(&h)?.reshape((b, t, self.kv_heads, d))?.transpose(1, 2)?;
            let v = self.v.forward(&h)?.reshape((b, t, self.kv_heads, d))?.transpose(1, 2)?;
            let (cos, sin) = self.tables(t, offset, xs.device())?;
            let q = remat_runtime::candle_nn::rotary_emb::rope(&q.contiguous()?, &cos, &sin)?;
            let k = remat_runtime::candle_nn::rotary_emb::rope(&k.contiguous()?, &cos, &sin)?;
            let rep = self.heads / self.kv_heads;
            let k = repeat_kv(&k, rep)?;
            let v = repeat_kv(&v.contiguous()?, rep)?;
            let s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
            let s = match mask { Some(m) => s.broadcast_add(m)?, None => s };
            let p = remat_runtime::candle_nn::ops::softmax_last_dim(&s)?;
            let a = p.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
            Ok((xs + self.o.forward(&a)?)?)
        }
    }

    fn plain(&self, xs: &Tensor, offset: usize, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, t, c) = xs.dims3()?;
        let d = c / self.heads;
        let h = candle_nn::ops::rms_norm_slow(xs, self.norm.weight(), 1e-6)?;
        let q = self
            .q
            .forward(&h)?
            .reshape((b, t, self.heads, d))?
            .transpose(1, 2)?;
        let k = self
            .k
            .forward(&h)?
            .reshape((b, t, self.kv_heads, d))?
            .transpose(1, 2)?;
        let v = self
            .v
            .forward(&h)?
            .reshape((b, t, self.kv_heads, d))?
            .transpose(1, 2)?;
        let (cos, sin) = self.tables(t, offset, xs.device())?;
        let q = rope_ref(&q, &cos, &sin)?;
        let k = rope_ref(&k, &cos, &sin)?;
        let rep = self.heads / self.kv_heads;
        let k = repeat_kv(&k, rep)?;
        let v = repeat_kv(&v.contiguous()?, rep)?;
        let mut s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
        if let Some(m) = mask {
            s = s.broadcast_add(m)?;
        }
        let a = softmax_ref(&s)?
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, c))?;
        xs + self.o.forward(&a)?
    }
}

#[test]
fn llama_gqa_with_fixed_and_learned_rotary_tables() {
    let mut fails = vec![];
    for dtype in [DType::F64, DType::F32] {
        for learned in [false, true] {
            let (m, vars) = LlamaAttn::new(16, 4, 2, learned, dtype);
            let x = var(&[2, 6, 16], 3, 1.0, dtype);
            let mask = causal_mask(6, dtype);
            let mut named: Vec<(&str, &Var)> = vec![("x", &x)];
            let names = [
                "q.w",
                "q.b",
                "k.w",
                "k.b",
                "v.w",
                "v.b",
                "o.w",
                "norm",
                "freq_scale",
            ];
            for (n, v) in names.iter().zip(vars.iter()) {
                named.push((n, v));
            }
            for offset in [0usize, 3] {
                let label = format!("llama {dtype:?} learned={learned} offset={offset}");
                fails.extend(compare(
                    &label,
                    &named,
                    tol(dtype),
                    plans(&["q#2", "k#2", "(cos, sin)", "p"]),
                    &|| m.plain(x.as_tensor(), offset, Some(&mask)),
                    &|| m.forward(x.as_tensor(), offset, Some(&mask)),
                ));
            }
        }
    }
    report(fails);
}

// ---------------------------------- 4. Whisper sinusoids + cancelling values

#[derive(Clone)]
struct WhisperLayer {
    ln: remat_runtime::candle_nn::LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

fn sinusoids(t: usize, c: usize, dev: &Device, dtype: DType) -> Result<Tensor> {
    let half = c / 2;
    let inc = (10000f64).ln() / (half as f64 - 1.0);
    let inv: Vec<f32> = (0..half)
        .map(|i| (-(inc * i as f64)).exp() as f32)
        .collect();
    let inv = Tensor::new(inv.as_slice(), dev)?.unsqueeze(0)?;
    let pos = Tensor::arange(0, t as u32, dev)?
        .to_dtype(DType::F32)?
        .unsqueeze(1)?;
    let s = pos.broadcast_mul(&inv)?;
    Tensor::cat(&[s.sin()?, s.cos()?], 1)?.to_dtype(dtype)
}

impl WhisperLayer {
    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let (_b, t, c) = xs.dims3()?;
            let pos = sinusoids(t, c, xs.device(), xs.dtype())?;
            let xs = xs.broadcast_add(&pos)?;
            let h = self.ln.forward(&xs)?;
            let f = self.fc1.forward(&h)?.gelu_erf()?;
            let f = self.fc2.forward(&f)?;
            Ok((xs + f)?)
        }
    }

    fn plain(&self, xs: &Tensor) -> Result<Tensor> {
        let (_b, t, c) = xs.dims3()?;
        let xs = xs.broadcast_add(&sinusoids(t, c, xs.device(), xs.dtype())?)?;
        let h = layer_norm_ref(&xs, self.ln.weight(), self.ln.bias().unwrap(), 1e-5)?;
        let f = self.fc2.forward(&self.fc1.forward(&h)?.gelu_erf()?)?;
        xs + f
    }
}

#[test]
fn whisper_sinusoids_over_cancelling_inputs_in_every_dtype() {
    let mut fails = vec![];
    for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        let c = 16;
        let g = var(&[c], 150, 1.0, dtype);
        let b = var(&[c], 151, 0.1, dtype);
        let (fc1, v1) = lin(c, 32, true, 152, dtype);
        let (fc2, v2) = lin(32, c, true, 154, dtype);
        let m = WhisperLayer {
            ln: remat_runtime::candle_nn::LayerNorm::new(
                g.as_tensor().clone(),
                b.as_tensor().clone(),
                1e-5,
            ),
            fc1,
            fc2,
        };
        // Large mean, tiny variance: 300 + noise of 0.05.
        let x0 = (tensor(&[2, 7, c], 5, 0.05, DType::F64) + 300.0).unwrap();
        let x = Var::from_tensor(&x0.to_dtype(dtype).unwrap()).unwrap();
        let named: Vec<(&str, &Var)> = vec![
            ("x", &x),
            ("ln.g", &g),
            ("ln.b", &b),
            ("fc1.w", &v1[0]),
            ("fc1.b", &v1[1]),
            ("fc2.w", &v2[0]),
            ("fc2.b", &v2[1]),
        ];
        // half precision: the drop-in norm computes in f32, the reference
        // in f64: compare loosely.
        let t = match dtype {
            DType::F64 => 1e-9,
            DType::F32 => 1e-3,
            _ => 6e-2,
        };
        fails.extend(compare(
            &format!("whisper {dtype:?}"),
            &named,
            t,
            plans(&["h", "f"]),
            &|| m.plain(x.as_tensor()),
            &|| m.forward(x.as_tensor()),
        ));
    }
    report(fails);
}

#[test]
fn harness_sanity_detects_a_wrong_reference() {
    let dtype = DType::F32;
    let (m, vars) = LlamaAttn::new(16, 4, 2, true, dtype);
    let x = var(&[2, 6, 16], 3, 1.0, dtype);
    let named: Vec<(&str, &Var)> = vec![("x", &x), ("scale", &vars[vars.len() - 1])];
    let fails = compare(
        "sanity",
        &named,
        tol(dtype),
        vec![Plan::recompute_all()],
        &|| m.plain(x.as_tensor(), 0, None)? * 1.001,
        &|| m.forward(x.as_tensor(), 0, None),
    );
    assert_eq!(fails.len(), 6);
}
