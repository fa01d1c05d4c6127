//! A corpus of transformer layers written the way candle-transformers
//! writes them (T5, Mistral, Gemma/Phi, Whisper, and a layer that copies a
//! sub-layer into a `mut` binding), each layer's `forward` a `remat!`
//! method, each compared against the same body outside `remat!` (a second
//! method, `plain`) for every gradient, under `off`, full recompute and
//! save-all, in f32 and f64. Fused ops come from `remat_runtime::candle_nn`
//! (candle-nn's have no backward); the rest is candle's own API.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core as candle;
use candle_core::{DType, Device, IndexOp, Module, Result, Tensor, Var, D};
use candle_nn::{Activation, Embedding, Linear, VarBuilder, VarMap};
use remat_runtime::candle_nn::ops::{rms_norm, softmax_last_dim};
use remat_runtime::candle_nn::rotary_emb::rope;
use remat_runtime::{backward, remat, Plan};

use crate::common::{max_abs, var, weighted_loss as loss};

fn plans() -> [Plan; 3] {
    [Plan::off(), Plan::recompute_all(), Plan::save_all()]
}

/// The tolerance, relative to the largest gradient element of the layer.
/// Both sides run the same ops on the same values; what differs is the
/// order in which the backward adds the contributions of several consumers
/// of one value (candle's single sweep against the replay's statement by
/// statement sweep, whose inputs' gradients are summed when the region hands
/// them back), so results agree to rounding: a few ulps of f64 (1e-12
/// leaves room for the sums over a layer), and in f32 a few ulps through
/// softmax, norms and matmuls (1e-5).
fn tol(dtype: DType) -> f64 {
    if dtype == DType::F32 {
        1e-5
    } else {
        1e-12
    }
}

fn init(stdev: f64) -> candle_nn::Init {
    candle_nn::Init::Randn { mean: 0.0, stdev }
}

fn linear(vb: &VarBuilder, i: usize, o: usize, bias: bool, name: &str) -> Result<Linear> {
    let w = vb.get_with_hints((o, i), &format!("{name}.weight"), init(0.3))?;
    let b = if bias {
        Some(vb.get_with_hints(o, &format!("{name}.bias"), init(0.3))?)
    } else {
        None
    };
    Ok(Linear::new(w, b))
}

/// Every variable of `vm` and every tracked input: gradient under `plan`
/// against the plain loss's, and the outputs equal.
fn check(
    what: &str,
    vm: &VarMap,
    inputs: &[&Var],
    plan: &Plan,
    run: impl Fn() -> Result<Tensor>,
    plain: impl Fn() -> Result<Tensor>,
    tol: f64,
) {
    let y = plan.scope(&run).unwrap();
    let py = plain().unwrap();
    let dy = max_abs(
        &(y.to_dtype(DType::F64).unwrap() - py.to_dtype(DType::F64).unwrap())
            .unwrap()
            .abs()
            .unwrap(),
    );
    assert!(
        dy <= tol * max_abs(&py.to_dtype(DType::F64).unwrap()),
        "{what} {plan}: outputs differ by {dy}"
    );
    let g = backward(&loss(&y)).unwrap();
    let pg = loss(&py).backward().unwrap();
    let mut vars: Vec<(String, Var)> = vm.data().lock().unwrap().clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, x) in inputs.iter().enumerate() {
        vars.push((format!("(input {i})"), (*x).clone()));
    }
    let scale = vars
        .iter()
        .map(|(_, v)| {
            let g = pg
                .get(v)
                .unwrap_or_else(|| panic!("{what}: plain candle gave no gradient"));
            max_abs(&g.to_dtype(DType::F64).unwrap())
        })
        .fold(0f64, f64::max);
    assert!(scale > 0.0, "{what}: all gradients are zero");
    for (name, v) in &vars {
        let a = g
            .get(v)
            .unwrap_or_else(|| panic!("{what} {plan}: {name} got no gradient"));
        let b = pg.get(v).unwrap();
        assert!(
            max_abs(&a.to_dtype(DType::F64).unwrap()).is_finite(),
            "{what} {plan}: {name} is not finite"
        );
        let d =
            max_abs(&(a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap());
        assert!(
            d <= tol * scale,
            "{what} {plan}: {name} {:?} differs by {d} (scale {scale})",
            v.dims()
        );
    }
}

/// candle-transformers' `masked_fill`: `on_true` where `mask` is 1.
fn masked_fill(on_false: &Tensor, mask: &Tensor, on_true: f32) -> Result<Tensor> {
    let shape = mask.shape();
    let on_true = Tensor::new(on_true, on_false.device())?
        .to_dtype(on_false.dtype())?
        .broadcast_as(shape.dims())?;
    mask.where_cond(&on_true, on_false)
}

/// candle-transformers' `utils::repeat_kv`.
fn repeat_kv(xs: Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        Ok(xs)
    } else {
        let (b_sz, n_kv_head, seq_len, head_dim) = xs.dims4()?;
        Tensor::cat(&vec![&xs; n_rep], 2)?.reshape((b_sz, n_kv_head * n_rep, seq_len, head_dim))
    }
}

/// Rotary tables `(max_pos, dim / 2)`, as candle-transformers builds them.
#[derive(Debug, Clone)]
struct RotaryEmbedding {
    sin: Tensor,
    cos: Tensor,
    dim: usize,
}

impl RotaryEmbedding {
    fn new(dim: usize, max_pos: usize, base: f32, dtype: DType, dev: &Device) -> Result<Self> {
        let inv_freq: Vec<_> = (0..dim)
            .step_by(2)
            .map(|i| 1f32 / base.powf(i as f32 / dim as f32))
            .collect();
        let inv_freq_len = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq, (1, inv_freq_len), dev)?.to_dtype(dtype)?;
        let t = Tensor::arange(0u32, max_pos as u32, dev)?
            .to_dtype(dtype)?
            .reshape((max_pos, 1))?;
        let freqs = t.matmul(&inv_freq)?;
        Ok(Self {
            sin: freqs.sin()?,
            cos: freqs.cos()?,
            dim,
        })
    }

    fn apply_rotary_emb_qkv(
        &self,
        q: &Tensor,
        k: &Tensor,
        seqlen_offset: usize,
    ) -> Result<(Tensor, Tensor)> {
        let (_b_sz, _h, seq_len, _n_embd) = q.dims4()?;
        let cos = self.cos.narrow(0, seqlen_offset, seq_len)?;
        let sin = self.sin.narrow(0, seqlen_offset, seq_len)?;
        let q_embed = rope(&q.contiguous()?, &cos, &sin)?;
        let k_embed = rope(&k.contiguous()?, &cos, &sin)?;
        Ok((q_embed, k_embed))
    }
}

// ---------------------------------------------------------------------------
// 1. T5: a decoder layer with relative position bias and cross-attention.
// ---------------------------------------------------------------------------

/// T5's norm: no mean subtraction, no bias.
#[derive(Debug, Clone)]
struct T5LayerNorm {
    weight: Tensor,
    variance_epsilon: f64,
}

impl Module for T5LayerNorm {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let variance = xs.sqr()?.mean_keepdim(D::Minus1)?;
        let xs = xs.broadcast_div(&(variance + self.variance_epsilon)?.sqrt()?)?;
        xs.broadcast_mul(&self.weight)
    }
}

#[derive(Debug, Clone)]
struct T5Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    n_heads: usize,
    d_kv: usize,
    relative_attention_bias: Option<Embedding>,
    relative_attention_num_buckets: usize,
    relative_attention_max_distance: usize,
}

impl T5Attention {
    fn load(
        has_bias: bool,
        d_model: usize,
        n_heads: usize,
        d_kv: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        let inner = n_heads * d_kv;
        let relative_attention_bias = if has_bias {
            let w =
                vb.get_with_hints((32, n_heads), "relative_attention_bias.weight", init(0.5))?;
            Some(Embedding::new(w, n_heads))
        } else {
            None
        };
        Ok(Self {
            q: linear(&vb, d_model, inner, false, "q")?,
            k: linear(&vb, d_model, inner, false, "k")?,
            v: linear(&vb, d_model, inner, false, "v")?,
            o: linear(&vb, inner, d_model, false, "o")?,
            n_heads,
            d_kv,
            relative_attention_bias,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
        })
    }

    /// T5's bidirectional relative position buckets, `(q_len, kv_len)`.
    fn buckets(&self, q_len: usize, kv_len: usize) -> Vec<Vec<u32>> {
        let num_buckets = self.relative_attention_num_buckets as u32 / 2;
        let max_exact = num_buckets / 2;
        let max_distance = self.relative_attention_max_distance as f32;
        (0..q_len as u32)
            .map(|i| {
                (0..kv_len as u32)
                    .map(|j| {
                        let (n, offset) = if i < j {
                            (j - i, num_buckets)
                        } else {
                            (i - j, 0)
                        };
                        if n < max_exact {
                            n + offset
                        } else {
                            let b = f32::log(
                                n as f32 / max_exact as f32,
                                max_distance / max_exact as f32,
                            ) * (num_buckets - max_exact) as f32;
                            u32::min(offset + max_exact + b as u32, offset + num_buckets - 1)
                        }
                    })
                    .collect()
            })
            .collect()
    }
}

#[derive(Debug, Clone)]
struct T5DecoderLayer {
    self_attn: T5Attention,
    self_attn_norm: T5LayerNorm,
    cross_attn: T5Attention,
    cross_attn_norm: T5LayerNorm,
    wi_0: Linear,
    wi_1: Linear,
    wo: Linear,
    ff_norm: T5LayerNorm,
    act: Activation,
}

impl T5DecoderLayer {
    fn load(
        d_model: usize,
        d_ff: usize,
        n_heads: usize,
        d_kv: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        let norm = |name: &str| -> Result<T5LayerNorm> {
            Ok(T5LayerNorm {
                weight: vb.get_with_hints(d_model, &format!("{name}.weight"), init(1.0))?,
                variance_epsilon: 1e-6,
            })
        };
        let ff = vb.pp("layer.2.DenseReluDense");
        Ok(Self {
            self_attn: T5Attention::load(
                true,
                d_model,
                n_heads,
                d_kv,
                vb.pp("layer.0.SelfAttention"),
            )?,
            self_attn_norm: norm("layer.0.layer_norm")?,
            cross_attn: T5Attention::load(
                false,
                d_model,
                n_heads,
                d_kv,
                vb.pp("layer.1.EncDecAttention"),
            )?,
            cross_attn_norm: norm("layer.1.layer_norm")?,
            wi_0: linear(&ff, d_model, d_ff, false, "wi_0")?,
            wi_1: linear(&ff, d_model, d_ff, false, "wi_1")?,
            wo: linear(&ff, d_ff, d_model, false, "wo")?,
            ff_norm: norm("layer.2.layer_norm")?,
            act: Activation::NewGelu,
        })
    }

    remat! {
        /// Self-attention (causal unless a mask is given, plus the learned
        /// relative position bias), cross-attention over the encoder's
        /// output, gated-GELU feed-forward; pre-norm, residual each time.
        fn forward(
            &self,
            xs: &Tensor,
            encoder_hidden: &Tensor,
            mask: Option<&Tensor>,
            encoder_mask: Option<&Tensor>,
        ) -> Result<Tensor> {
            let (b_sz, q_len, _) = xs.dims3()?;
            let kv_len = encoder_hidden.dim(1)?;
            let inner = self.self_attn.n_heads * self.self_attn.d_kv;
            let mask = match mask {
                Some(mask) => Some(mask.clone()),
                // remat! refused: this `let mask: Vec<u8> = ...collect();`
                // as a statement of its own ("this statement's value is a
                // `Vec<u8>`, which a remat! statement cannot give"); inside
                // the arm it is part of the statement `mask`, which gives an
                // `Option<Tensor>`.
                None if q_len > 1 => {
                    let mask: Vec<u8> = (0..q_len)
                        .flat_map(|i| (0..q_len).map(move |j| u8::from(j > i)))
                        .collect();
                    Some(Tensor::from_slice(&mask, (q_len, q_len), xs.device())?)
                }
                None => None,
            };
            // T5's RMS norm, written out.
            let variance = xs.sqr()?.mean_keepdim(D::Minus1)?;
            let normed = xs
                .broadcast_div(&(variance + self.self_attn_norm.variance_epsilon)?.sqrt()?)?
                .broadcast_mul(&self.self_attn_norm.weight)?;
            #[save(name = "self.q")]
            let q = self.self_attn.q.forward(&normed)?;
            let k = self.self_attn.k.forward(&normed)?;
            let v = self.self_attn.v.forward(&normed)?;
            let q = q.reshape((b_sz, q_len, self.self_attn.n_heads, self.self_attn.d_kv))?.transpose(1, 2)?.contiguous()?;
            let k = k.reshape((b_sz, q_len, self.self_attn.n_heads, self.self_attn.d_kv))?.transpose(1, 2)?.contiguous()?;
            let v = v.reshape((b_sz, q_len, self.self_attn.n_heads, self.self_attn.d_kv))?.transpose(1, 2)?.contiguous()?;
            let scores = q.matmul(&k.t()?)?;
            let scores = match &mask {
                None => scores,
                Some(mask) => masked_fill(
                    &scores,
                    &mask.unsqueeze(0)?.unsqueeze(0)?.repeat((b_sz, self.self_attn.n_heads))?,
                    f32::NEG_INFINITY,
                )?,
            };
            let scores = match &self.self_attn.relative_attention_bias {
                None => scores,
                Some(relative_attention_bias) => {
                    let relative_buckets = Tensor::new(self.self_attn.buckets(q_len, q_len), q.device())?;
                    let position_bias = relative_attention_bias
                        .forward(&relative_buckets)?
                        .permute((2, 0, 1))?
                        .unsqueeze(0)?;
                    scores.broadcast_add(&position_bias)?
                }
            };
            let attn_weights = softmax_last_dim(&scores)?;
            let attn_output = attn_weights.matmul(&v)?.transpose(1, 2)?.reshape((b_sz, q_len, inner))?;
            #[save]
            let ys = self.self_attn.o.forward(&attn_output)?;
            let xs = (xs + ys)?;
            // Cross-attention: keys and values from the encoder.
            let normed = self.cross_attn_norm.forward(&xs)?;
            let q = self.cross_attn.q.forward(&normed)?;
            #[save(name = "cross.k")]
            let k = self.cross_attn.k.forward(encoder_hidden)?;
            #[save(name = "cross.v")]
            let v = self.cross_attn.v.forward(encoder_hidden)?;
            let q = q.reshape((b_sz, q_len, self.cross_attn.n_heads, self.cross_attn.d_kv))?.transpose(1, 2)?;
            let k = k.reshape((b_sz, kv_len, self.cross_attn.n_heads, self.cross_attn.d_kv))?.transpose(1, 2)?;
            let v = v.reshape((b_sz, kv_len, self.cross_attn.n_heads, self.cross_attn.d_kv))?.transpose(1, 2)?;
            let scores = q.contiguous()?.matmul(&k.t()?.contiguous()?)?;
            let scores = if let Some(encoder_mask) = encoder_mask {
                scores.broadcast_add(encoder_mask)?
            } else {
                scores
            };
            let attn_weights = softmax_last_dim(&scores)?;
            let attn_output = attn_weights.matmul(&v.contiguous()?)?.transpose(1, 2)?.reshape((b_sz, q_len, inner))?;
            let ys = self.cross_attn.o.forward(&attn_output)?;
            let xs = (xs + ys)?;
            // Gated-GELU feed-forward (T5 v1.1).
            let h = self.ff_norm.forward(&xs)?;
            let hidden_gelu = self.act.forward(&self.wi_0.forward(&h)?)?;
            let hidden_linear = self.wi_1.forward(&h)?;
            #[save(name = "ff.wo")]
            let ff = self.wo.forward(&(hidden_gelu * hidden_linear)?)?;
            Ok((xs + ff)?)
        }
    }

    fn plain(
        &self,
        xs: &Tensor,
        encoder_hidden: &Tensor,
        mask: Option<&Tensor>,
        encoder_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b_sz, q_len, _) = xs.dims3()?;
        let kv_len = encoder_hidden.dim(1)?;
        let inner = self.self_attn.n_heads * self.self_attn.d_kv;
        let mask = match mask {
            Some(mask) => Some(mask.clone()),
            None if q_len > 1 => {
                let mask: Vec<u8> = (0..q_len)
                    .flat_map(|i| (0..q_len).map(move |j| u8::from(j > i)))
                    .collect();
                Some(Tensor::from_slice(&mask, (q_len, q_len), xs.device())?)
            }
            None => None,
        };
        let variance = xs.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = xs
            .broadcast_div(&(variance + self.self_attn_norm.variance_epsilon)?.sqrt()?)?
            .broadcast_mul(&self.self_attn_norm.weight)?;
        let q = self.self_attn.q.forward(&normed)?;
        let k = self.self_attn.k.forward(&normed)?;
        let v = self.self_attn.v.forward(&normed)?;
        let q = q
            .reshape((b_sz, q_len, self.self_attn.n_heads, self.self_attn.d_kv))?
            .transpose(1, 2)?
            .contiguous()?;
        let k = k
            .reshape((b_sz, q_len, self.self_attn.n_heads, self.self_attn.d_kv))?
            .transpose(1, 2)?
            .contiguous()?;
        let v = v
            .reshape((b_sz, q_len, self.self_attn.n_heads, self.self_attn.d_kv))?
            .transpose(1, 2)?
            .contiguous()?;
        let scores = q.matmul(&k.t()?)?;
        let scores = match &mask {
            None => scores,
            Some(mask) => masked_fill(
                &scores,
                &mask
                    .unsqueeze(0)?
                    .unsqueeze(0)?
                    .repeat((b_sz, self.self_attn.n_heads))?,
                f32::NEG_INFINITY,
            )?,
        };
        let scores = match &self.self_attn.relative_attention_bias {
            None => scores,
            Some(relative_attention_bias) => {
                let relative_buckets =
                    Tensor::new(self.self_attn.buckets(q_len, q_len), q.device())?;
                let position_bias = relative_attention_bias
                    .forward(&relative_buckets)?
                    .permute((2, 0, 1))?
                    .unsqueeze(0)?;
                scores.broadcast_add(&position_bias)?
            }
        };
        let attn_weights = softmax_last_dim(&scores)?;
        let attn_output = attn_weights
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b_sz, q_len, inner))?;
        let ys = self.self_attn.o.forward(&attn_output)?;
        let xs = (xs + ys)?;
        let normed = self.cross_attn_norm.forward(&xs)?;
        let q = self.cross_attn.q.forward(&normed)?;
        let k = self.cross_attn.k.forward(encoder_hidden)?;
        let v = self.cross_attn.v.forward(encoder_hidden)?;
        let q = q
            .reshape((b_sz, q_len, self.cross_attn.n_heads, self.cross_attn.d_kv))?
            .transpose(1, 2)?;
        let k = k
            .reshape((b_sz, kv_len, self.cross_attn.n_heads, self.cross_attn.d_kv))?
            .transpose(1, 2)?;
        let v = v
            .reshape((b_sz, kv_len, self.cross_attn.n_heads, self.cross_attn.d_kv))?
            .transpose(1, 2)?;
        let scores = q.contiguous()?.matmul(&k.t()?.contiguous()?)?;
        let scores = if let Some(encoder_mask) = encoder_mask {
            scores.broadcast_add(encoder_mask)?
        } else {
            scores
        };
        let attn_weights = softmax_last_dim(&scores)?;
        let attn_output = attn_weights
            .matmul(&v.contiguous()?)?
            .transpose(1, 2)?
            .reshape((b_sz, q_len, inner))?;
        let ys = self.cross_attn.o.forward(&attn_output)?;
        let xs = (xs + ys)?;
        let h = self.ff_norm.forward(&xs)?;
        let hidden_gelu = self.act.forward(&self.wi_0.forward(&h)?)?;
        let hidden_linear = self.wi_1.forward(&h)?;
        let ff = self.wo.forward(&(hidden_gelu * hidden_linear)?)?;
        xs + ff
    }
}

#[test]
fn t5_decoder_layer_with_relative_bias_and_cross_attention() {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F64] {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, dtype, &dev);
        let layer = T5DecoderLayer::load(12, 20, 3, 4, vb.pp("decoder.block.0")).unwrap();
        for (b, t, s) in [(1, 5, 3), (2, 7, 6)] {
            let x = var(&[b, t, 12], 1, 1.0, dtype);
            let enc = var(&[b, s, 12], 2, 1.0, dtype);
            // Encoder padding: the second sequence's last two positions are
            // -1e9; the explicit self mask (u8, filled with -inf) is causal
            // and its last row masks every key but the first.
            let enc_mask: Vec<f32> = (0..b * s)
                .map(|i| {
                    if i / s == 1 && i % s >= s - 2 {
                        -1e9
                    } else {
                        0.0
                    }
                })
                .collect();
            let enc_mask = Tensor::from_vec(enc_mask, (b, 1, 1, s), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let self_mask: Vec<u8> = (0..t * t)
                .map(|i| u8::from(i % t > i / t || (i / t == t - 1 && i % t >= 1)))
                .collect();
            let self_mask = Tensor::from_slice(&self_mask, (t, t), &dev).unwrap();
            for (mask, encoder_mask) in [
                (None, None),
                (None, Some(&enc_mask)),
                (Some(&self_mask), Some(&enc_mask)),
            ] {
                for plan in plans() {
                    check(
                        &format!("t5 {dtype:?} b{b} t{t}"),
                        &vm,
                        &[&x, &enc],
                        &plan,
                        || layer.forward(x.as_tensor(), enc.as_tensor(), mask, encoder_mask),
                        || layer.plain(x.as_tensor(), enc.as_tensor(), mask, encoder_mask),
                        tol(dtype),
                    );
                }
            }
        }
    }
}

#[test]
fn every_plan_a_peak_profile_keeps_over_t5_decoder_layers_gives_plain_gradients() {
    // Three decoder layers reading one encoder output: plans that decide
    // call by call save different statements in each layer, while every
    // layer's cross-attention reads the same encoder value.
    use remat_runtime::plan::PeakPlan;
    use remat_runtime::MemoryReport;
    let dev = Device::Cpu;
    let dtype = DType::F64;
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, dtype, &dev);
    let layers: Vec<T5DecoderLayer> = (0..3)
        .map(|i| T5DecoderLayer::load(12, 20, 3, 4, vb.pp(format!("decoder.block.{i}"))).unwrap())
        .collect();
    let (x, enc) = (
        var(&[2, 5, 12], 1, 1.0, dtype),
        var(&[2, 4, 12], 2, 1.0, dtype),
    );
    let run = || {
        let mut h = x.as_tensor().clone();
        for layer in &layers {
            h = layer.forward(&h, enc.as_tensor(), None, None)?;
        }
        Ok(h)
    };
    let plain = || {
        let mut h = x.as_tensor().clone();
        for layer in &layers {
            h = layer.plain(&h, enc.as_tensor(), None, None)?;
        }
        Ok(h)
    };
    // A stand-in for a measured peak: the bytes the tapes hold after the
    // forward (plain candle's graph holds more than any of them).
    let profile = PeakPlan::profile(|plan| {
        let y = plan.scope(run)?;
        let held = if plan.is_off() {
            1 << 30
        } else {
            MemoryReport::capture().total_bytes()
        };
        backward(&loss(&y))?;
        Ok(held)
    })
    .unwrap();
    assert!(profile.candidates().len() >= 3, "{profile}");
    for c in profile.candidates() {
        check("t5 x3", &vm, &[&x, &enc], &c.plan, run, plain, tol(dtype));
    }
}

// ---------------------------------------------------------------------------
// 2. Mistral: sliding-window causal mask built in the block, GQA.
// ---------------------------------------------------------------------------

#[derive(Debug, Clone)]
#[allow(clippy::upper_case_acronyms)]
struct MLP {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    act_fn: Activation,
}

impl Module for MLP {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let lhs = xs.apply(&self.gate_proj)?.apply(&self.act_fn)?;
        let rhs = xs.apply(&self.up_proj)?;
        (lhs * rhs)?.apply(&self.down_proj)
    }
}

impl MLP {
    fn load(hidden: usize, inter: usize, act_fn: Activation, vb: &VarBuilder) -> Result<Self> {
        Ok(Self {
            gate_proj: linear(vb, hidden, inter, false, "mlp.gate_proj")?,
            up_proj: linear(vb, hidden, inter, false, "mlp.up_proj")?,
            down_proj: linear(vb, inter, hidden, false, "mlp.down_proj")?,
            act_fn,
        })
    }
}

#[derive(Debug, Clone)]
struct MistralDecoderLayer {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    mlp: MLP,
    input_layernorm: remat_runtime::candle_nn::RmsNorm,
    post_attention_layernorm: remat_runtime::candle_nn::RmsNorm,
    rotary_emb: Arc<RotaryEmbedding>,
    num_heads: usize,
    num_kv_heads: usize,
    num_kv_groups: usize,
    head_dim: usize,
    sliding_window: Option<usize>,
}

impl MistralDecoderLayer {
    fn load(hidden: usize, heads: usize, kv_heads: usize, vb: VarBuilder) -> Result<Self> {
        let head_dim = hidden / heads;
        let dtype = vb.dtype();
        let ones = candle_nn::Init::Randn {
            mean: 1.0,
            stdev: 0.2,
        };
        let norm = |name: &str| -> Result<remat_runtime::candle_nn::RmsNorm> {
            let w = vb.get_with_hints(hidden, &format!("{name}.weight"), ones)?;
            Ok(remat_runtime::candle_nn::RmsNorm::new(w, 1e-5))
        };
        Ok(Self {
            q_proj: linear(&vb, hidden, heads * head_dim, false, "self_attn.q_proj")?,
            k_proj: linear(&vb, hidden, kv_heads * head_dim, false, "self_attn.k_proj")?,
            v_proj: linear(&vb, hidden, kv_heads * head_dim, false, "self_attn.v_proj")?,
            o_proj: linear(&vb, heads * head_dim, hidden, false, "self_attn.o_proj")?,
            mlp: MLP::load(hidden, 2 * hidden, Activation::Silu, &vb)?,
            input_layernorm: norm("input_layernorm")?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            rotary_emb: Arc::new(RotaryEmbedding::new(
                head_dim,
                32,
                10000.,
                dtype,
                vb.device(),
            )?),
            num_heads: heads,
            num_kv_heads: kv_heads,
            num_kv_groups: heads / kv_heads,
            head_dim,
            sliding_window: Some(2),
        })
    }

    remat! {
        /// `attention_mask`: `(b, seq)` u8, 1 for the tokens to attend to
        /// (left padding), filled with -1e9 by `where_cond`.
        fn forward(&self, xs: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
            let residual = xs.clone();
            let (b_sz, q_len, _) = xs.dims3()?;
            let sliding_window = self.sliding_window.unwrap_or(q_len + 1);
            let mask: Vec<f32> = (0..q_len)
                .flat_map(|i| {
                    (0..q_len).map(move |j| {
                        if i < j || j + sliding_window < i {
                            f32::NEG_INFINITY
                        } else {
                            0.
                        }
                    })
                })
                .collect();
            let mask = Tensor::from_slice(&mask, (q_len, q_len), xs.device())?
                .expand((b_sz, 1, q_len, q_len))?
                .to_dtype(xs.dtype())?;
            let xs = self.input_layernorm.forward(xs)?;
            #[save]
            let query_states = self.q_proj.forward(&xs)?;
            #[save]
            let key_states = self.k_proj.forward(&xs)?;
            let value_states = self.v_proj.forward(&xs)?;
            let query_states = query_states
                .reshape((b_sz, q_len, self.num_heads, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()?;
            let key_states = key_states
                .reshape((b_sz, q_len, self.num_kv_heads, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()?;
            let value_states = value_states
                .reshape((b_sz, q_len, self.num_kv_heads, self.head_dim))?
                .transpose(1, 2)?;
            let (query_states, key_states) =
                self.rotary_emb.apply_rotary_emb_qkv(&query_states, &key_states, 0)?;
            let key_states = repeat_kv(key_states, self.num_kv_groups)?.contiguous()?;
            let value_states = repeat_kv(value_states, self.num_kv_groups)?.contiguous()?;
            let scale = 1f64 / f64::sqrt(self.head_dim as f64);
            let attn_weights = (query_states.matmul(&key_states.transpose(2, 3)?)? * scale)?;
            let attn_weights = attn_weights.broadcast_add(&mask)?;
            let attn_weights = match attention_mask {
                None => attn_weights,
                Some(keep) => {
                    let keep = keep.reshape((b_sz, 1, 1, q_len))?.broadcast_as(attn_weights.shape())?;
                    let fill = Tensor::new(-1e9f32, attn_weights.device())?
                        .to_dtype(attn_weights.dtype())?
                        .broadcast_as(attn_weights.shape())?;
                    keep.where_cond(&attn_weights, &fill)?
                }
            };
            let attn_weights = softmax_last_dim(&attn_weights)?;
            #[save(name = "attn")]
            let attn_output = attn_weights.matmul(&value_states)?;
            let attn_output = attn_output
                .transpose(1, 2)?
                .reshape((b_sz, q_len, self.num_heads * self.head_dim))?
                .apply(&self.o_proj)?;
            let xs = (attn_output + residual)?;
            let residual = &xs;
            let xs = xs.apply(&self.post_attention_layernorm)?.apply(&self.mlp)?;
            residual + xs
        }
    }

    fn plain(&self, xs: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        let residual = xs.clone();
        let (b_sz, q_len, _) = xs.dims3()?;
        let sliding_window = self.sliding_window.unwrap_or(q_len + 1);
        let mask: Vec<f32> = (0..q_len)
            .flat_map(|i| {
                (0..q_len).map(move |j| {
                    if i < j || j + sliding_window < i {
                        f32::NEG_INFINITY
                    } else {
                        0.
                    }
                })
            })
            .collect();
        let mask = Tensor::from_slice(&mask, (q_len, q_len), xs.device())?
            .expand((b_sz, 1, q_len, q_len))?
            .to_dtype(xs.dtype())?;
        let xs = self.input_layernorm.forward(xs)?;
        let query_states = self.q_proj.forward(&xs)?;
        let key_states = self.k_proj.forward(&xs)?;
        let value_states = self.v_proj.forward(&xs)?;
        let query_states = query_states
            .reshape((b_sz, q_len, self.num_heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()?;
        let key_states = key_states
            .reshape((b_sz, q_len, self.num_kv_heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()?;
        let value_states = value_states
            .reshape((b_sz, q_len, self.num_kv_heads, self.head_dim))?
            .transpose(1, 2)?;
        let (query_states, key_states) =
            self.rotary_emb
                .apply_rotary_emb_qkv(&query_states, &key_states, 0)?;
        let key_states = repeat_kv(key_states, self.num_kv_groups)?.contiguous()?;
        let value_states = repeat_kv(value_states, self.num_kv_groups)?.contiguous()?;
        let scale = 1f64 / f64::sqrt(self.head_dim as f64);
        let attn_weights = (query_states.matmul(&key_states.transpose(2, 3)?)? * scale)?;
        let attn_weights = attn_weights.broadcast_add(&mask)?;
        let attn_weights = match attention_mask {
            None => attn_weights,
            Some(keep) => {
                let keep = keep
                    .reshape((b_sz, 1, 1, q_len))?
                    .broadcast_as(attn_weights.shape())?;
                let fill = Tensor::new(-1e9f32, attn_weights.device())?
                    .to_dtype(attn_weights.dtype())?
                    .broadcast_as(attn_weights.shape())?;
                keep.where_cond(&attn_weights, &fill)?
            }
        };
        let attn_weights = softmax_last_dim(&attn_weights)?;
        let attn_output = attn_weights.matmul(&value_states)?;
        let attn_output = attn_output
            .transpose(1, 2)?
            .reshape((b_sz, q_len, self.num_heads * self.head_dim))?
            .apply(&self.o_proj)?;
        let xs = (attn_output + residual)?;
        let residual = &xs;
        let xs = xs.apply(&self.post_attention_layernorm)?.apply(&self.mlp)?;
        residual + xs
    }
}

#[test]
fn mistral_decoder_layer_with_a_sliding_window_mask_built_in_the_block() {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F64] {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, dtype, &dev);
        let mut layer = MistralDecoderLayer::load(16, 4, 2, vb.pp("model.layers.0")).unwrap();
        for (b, t) in [(1, 1), (1, 5), (2, 7)] {
            let x = var(&[b, t, 16], 3, 1.0, dtype);
            // Left padding in the second sequence: its first two tokens are
            // never attended to (row 0 holds only -1e9 and -inf).
            let keep: Vec<u8> = (0..b * t)
                .map(|i| u8::from(!(i / t == 1 && i % t < 2)))
                .collect();
            let keep = Tensor::from_vec(keep, (b, t), &dev).unwrap();
            for window in [Some(2), None] {
                layer.sliding_window = window;
                for mask in [None, Some(&keep)] {
                    for plan in plans() {
                        check(
                            &format!("mistral {dtype:?} b{b} t{t} window {window:?}"),
                            &vm,
                            &[&x],
                            &plan,
                            || layer.forward(x.as_tensor(), mask),
                            || layer.plain(x.as_tensor(), mask),
                            tol(dtype),
                        );
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// 3. Gemma / Phi: (1 + weight) RMS norm, partial rotary, parallel residual.
// ---------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct PhiGemmaLayer {
    input_layernorm: Tensor,
    rms_norm_eps: f64,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    dense: Linear,
    mlp: MLP,
    rotary_emb: RotaryEmbedding,
    num_heads: usize,
    head_dim: usize,
    softmax_scale: f64,
}

impl PhiGemmaLayer {
    fn load(
        hidden: usize,
        heads: usize,
        partial: f64,
        act: Activation,
        vb: VarBuilder,
    ) -> Result<Self> {
        let head_dim = hidden / heads;
        let rot_dim = (partial * head_dim as f64) as usize;
        Ok(Self {
            // Gemma stores the norm's scale as an offset from 1.
            input_layernorm: vb.get_with_hints(hidden, "input_layernorm.weight", init(0.2))?,
            rms_norm_eps: 1e-6,
            q_proj: linear(&vb, hidden, hidden, true, "self_attn.q_proj")?,
            k_proj: linear(&vb, hidden, hidden, true, "self_attn.k_proj")?,
            v_proj: linear(&vb, hidden, hidden, true, "self_attn.v_proj")?,
            dense: linear(&vb, hidden, hidden, true, "self_attn.dense")?,
            mlp: MLP::load(hidden, 3 * hidden, act, &vb)?,
            rotary_emb: RotaryEmbedding::new(rot_dim, 32, 10000., vb.dtype(), vb.device())?,
            num_heads: heads,
            head_dim,
            softmax_scale: 1f64 / (head_dim as f64).sqrt(),
        })
    }

    /// Phi's partial rotary: the first `dim` of each head rotated, the rest
    /// passed through.
    fn apply_partial_rotary(&self, xs: &Tensor, seqlen_offset: usize) -> Result<Tensor> {
        let (_b_size, _num_heads, seq_len, headdim) = xs.dims4()?;
        let rot_dim = self.rotary_emb.dim;
        let xs_rot = xs.narrow(D::Minus1, 0, rot_dim)?.contiguous()?;
        let xs_pass = xs.narrow(D::Minus1, rot_dim, headdim - rot_dim)?;
        let c = self.rotary_emb.cos.narrow(0, seqlen_offset, seq_len)?;
        let s = self.rotary_emb.sin.narrow(0, seqlen_offset, seq_len)?;
        let xs_rot = rope(&xs_rot, &c, &s)?;
        Tensor::cat(&[&xs_rot, &xs_pass], D::Minus1)
    }

    remat! {
        /// `mask`: `(seq, seq)` u8, 1 where a query must not see a key.
        fn forward(&self, xs: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
            let residual = xs.clone();
            // Gemma's RMS norm: computed in f32 for half types, scaled by
            // (1 + weight).
            let x_dtype = xs.dtype();
            let internal_dtype = match x_dtype {
                DType::F16 | DType::BF16 => DType::F32,
                d => d,
            };
            let hidden_size = xs.dim(D::Minus1)?;
            let x = xs.to_dtype(internal_dtype)?;
            let norm_x = (x.sqr()?.sum_keepdim(D::Minus1)? / hidden_size as f64)?;
            let x_normed = x.broadcast_div(&(norm_x + self.rms_norm_eps)?.sqrt()?)?;
            #[save(name = "normed")]
            let xs = x_normed.to_dtype(x_dtype)?.broadcast_mul(&(&self.input_layernorm + 1.0)?)?;
            let (b_size, seq_len, _n_embd) = xs.dims3()?;
            let query_states = self.q_proj.forward(&xs)?;
            let key_states = self.k_proj.forward(&xs)?;
            let value_states = self.v_proj.forward(&xs)?;
            let query_states = query_states
                .reshape((b_size, seq_len, self.num_heads, self.head_dim))?
                .transpose(1, 2)?;
            let key_states = key_states
                .reshape((b_size, seq_len, self.num_heads, self.head_dim))?
                .transpose(1, 2)?;
            let value_states = value_states
                .reshape((b_size, seq_len, self.num_heads, self.head_dim))?
                .transpose(1, 2)?;
            // Partial rotary, written out for the queries, by the helper
            // for the keys.
            let rot_dim = self.rotary_emb.dim;
            let q_rot = query_states.narrow(D::Minus1, 0, rot_dim)?.contiguous()?;
            let q_pass = query_states.narrow(D::Minus1, rot_dim, self.head_dim - rot_dim)?;
            let cos = self.rotary_emb.cos.narrow(0, 0, seq_len)?;
            let sin = self.rotary_emb.sin.narrow(0, 0, seq_len)?;
            let query_states = Tensor::cat(&[&rope(&q_rot, &cos, &sin)?, &q_pass], D::Minus1)?;
            let key_states = self.apply_partial_rotary(&key_states, 0)?.contiguous()?;
            let attn_weights = (query_states.contiguous()?.matmul(&key_states.t()?)? * self.softmax_scale)?;
            let attn_weights = match mask {
                None => attn_weights,
                Some(mask) => masked_fill(
                    &attn_weights,
                    &mask.broadcast_left((b_size, self.num_heads))?,
                    f32::NEG_INFINITY,
                )?,
            };
            let attn_weights = softmax_last_dim(&attn_weights)?;
            let attn_output = attn_weights.matmul(&value_states.contiguous()?)?;
            let attn_output = attn_output.transpose(1, 2)?.reshape((b_size, seq_len, ()))?;
            #[save(name = "dense")]
            let attn_outputs = self.dense.forward(&attn_output)?;
            // The MLP reads the same normed input: a parallel residual.
            #[save]
            let feed_forward_hidden_states = self.mlp.forward(&xs)?;
            attn_outputs + feed_forward_hidden_states + residual
        }
    }

    fn plain(&self, xs: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let residual = xs.clone();
        let x_dtype = xs.dtype();
        let internal_dtype = match x_dtype {
            DType::F16 | DType::BF16 => DType::F32,
            d => d,
        };
        let hidden_size = xs.dim(D::Minus1)?;
        let x = xs.to_dtype(internal_dtype)?;
        let norm_x = (x.sqr()?.sum_keepdim(D::Minus1)? / hidden_size as f64)?;
        let x_normed = x.broadcast_div(&(norm_x + self.rms_norm_eps)?.sqrt()?)?;
        let xs = x_normed
            .to_dtype(x_dtype)?
            .broadcast_mul(&(&self.input_layernorm + 1.0)?)?;
        let (b_size, seq_len, _n_embd) = xs.dims3()?;
        let query_states = self.q_proj.forward(&xs)?;
        let key_states = self.k_proj.forward(&xs)?;
        let value_states = self.v_proj.forward(&xs)?;
        let query_states = query_states
            .reshape((b_size, seq_len, self.num_heads, self.head_dim))?
            .transpose(1, 2)?;
        let key_states = key_states
            .reshape((b_size, seq_len, self.num_heads, self.head_dim))?
            .transpose(1, 2)?;
        let value_states = value_states
            .reshape((b_size, seq_len, self.num_heads, self.head_dim))?
            .transpose(1, 2)?;
        let rot_dim = self.rotary_emb.dim;
        let q_rot = query_states.narrow(D::Minus1, 0, rot_dim)?.contiguous()?;
        let q_pass = query_states.narrow(D::Minus1, rot_dim, self.head_dim - rot_dim)?;
        let cos = self.rotary_emb.cos.narrow(0, 0, seq_len)?;
        let sin = self.rotary_emb.sin.narrow(0, 0, seq_len)?;
        let query_states = Tensor::cat(&[&rope(&q_rot, &cos, &sin)?, &q_pass], D::Minus1)?;
        let key_states = self.apply_partial_rotary(&key_states, 0)?.contiguous()?;
        let attn_weights =
            (query_states.contiguous()?.matmul(&key_states.t()?)? * self.softmax_scale)?;
        let attn_weights = match mask {
            None => attn_weights,
            Some(mask) => masked_fill(
                &attn_weights,
                &mask.broadcast_left((b_size, self.num_heads))?,
                f32::NEG_INFINITY,
            )?,
        };
        let attn_weights = softmax_last_dim(&attn_weights)?;
        let attn_output = attn_weights.matmul(&value_states.contiguous()?)?;
        let attn_output = attn_output
            .transpose(1, 2)?
            .reshape((b_size, seq_len, ()))?;
        let attn_outputs = self.dense.forward(&attn_output)?;
        let feed_forward_hidden_states = self.mlp.forward(&xs)?;
        attn_outputs + feed_forward_hidden_states + residual
    }
}

#[test]
fn gemma_phi_layer_with_partial_rotary_and_a_parallel_residual() {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F64] {
        for act in [
            Activation::GeluPytorchTanh,
            Activation::Gelu,
            Activation::NewGelu,
        ] {
            let vm = VarMap::new();
            let vb = VarBuilder::from_varmap(&vm, dtype, &dev);
            let layer = PhiGemmaLayer::load(16, 2, 0.5, act, vb.pp("model.layers.0")).unwrap();
            assert_eq!(layer.rotary_emb.dim, 4);
            for (b, t) in [(1, 3), (2, 5)] {
                let x = var(&[b, t, 16], 4, 1.0, dtype);
                let causal: Vec<u8> = (0..t)
                    .flat_map(|i| (0..t).map(move |j| u8::from(j > i)))
                    .collect();
                let causal = Tensor::from_slice(&causal, (t, t), &dev).unwrap();
                for mask in [None, Some(&causal)] {
                    for plan in plans() {
                        check(
                            &format!("phi/gemma {dtype:?} {act:?} b{b} t{t}"),
                            &vm,
                            &[&x],
                            &plan,
                            || layer.forward(x.as_tensor(), mask),
                            || layer.plain(x.as_tensor(), mask),
                            tol(dtype),
                        );
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// 4. Whisper: an encoder layer with a tracing guard and `bail!`.
// ---------------------------------------------------------------------------

/// A span that counts how often it is entered (a stand-in for tracing's).
#[derive(Debug, Clone, Default)]
struct Span(Arc<AtomicUsize>);

struct Entered;

impl Span {
    fn enter(&self) -> Entered {
        self.0.fetch_add(1, Ordering::SeqCst);
        Entered
    }
}

#[derive(Debug, Clone)]
struct MultiHeadAttention {
    query: Linear,
    key: Linear,
    value: Linear,
    out: Linear,
    n_head: usize,
}

impl MultiHeadAttention {
    fn reshape_head(&self, x: &Tensor) -> Result<Tensor> {
        let (n_batch, n_ctx, n_state) = x.dims3()?;
        let target_dims = &[n_batch, n_ctx, self.n_head, n_state / self.n_head];
        x.reshape(target_dims)?.transpose(1, 2)
    }
}

#[derive(Debug, Clone)]
struct ResidualAttentionBlock {
    attn: MultiHeadAttention,
    attn_ln: remat_runtime::candle_nn::LayerNorm,
    mlp_linear1: Linear,
    mlp_linear2: Linear,
    mlp_ln: remat_runtime::candle_nn::LayerNorm,
    n_state: usize,
    span: Span,
}

impl ResidualAttentionBlock {
    fn load(n_state: usize, n_head: usize, vb: VarBuilder) -> Result<Self> {
        let ln = |name: &str| -> Result<remat_runtime::candle_nn::LayerNorm> {
            remat_runtime::candle_nn::layer_norm(n_state, 1e-5, vb.pp(name))
        };
        let n_mlp = n_state * 4;
        Ok(Self {
            attn: MultiHeadAttention {
                query: linear(&vb, n_state, n_state, true, "attn.query")?,
                key: linear(&vb, n_state, n_state, false, "attn.key")?,
                value: linear(&vb, n_state, n_state, true, "attn.value")?,
                out: linear(&vb, n_state, n_state, true, "attn.out")?,
                n_head,
            },
            attn_ln: ln("attn_ln")?,
            mlp_linear1: linear(&vb, n_state, n_mlp, true, "mlp.0")?,
            mlp_linear2: linear(&vb, n_mlp, n_state, true, "mlp.2")?,
            mlp_ln: ln("mlp_ln")?,
            n_state,
            span: Span::default(),
        })
    }

    remat! {
        /// `mask`: an additive `(n, n)` mask with `n >= seq`, sliced to the
        /// sequence as Whisper's decoder does.
        fn forward(&self, xs: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
            let _enter = self.span.enter();
            let (_, n_ctx, n_state) = xs.dims3()?;
            if n_state != self.n_state {
                candle::bail!("whisper: expected {} features per frame, got {n_state}", self.n_state)
            }
            let residual = xs.clone();
            let x = self.attn_ln.forward(xs)?;
            #[save(name = "attn.q")]
            let q = self.attn.query.forward(&x)?;
            let k = self.attn.key.forward(&x)?;
            let v = self.attn.value.forward(&x)?;
            let scale = ((n_state / self.attn.n_head) as f64).powf(-0.25);
            let q = (self.attn.reshape_head(&q)? * scale)?;
            let k = (self.attn.reshape_head(&k)?.transpose(2, 3)? * scale)?;
            let v = self.attn.reshape_head(&v)?.contiguous()?;
            let mut qk = q.matmul(&k)?;
            if let Some(mask) = mask {
                let mask = mask.i((0..n_ctx, 0..n_ctx))?;
                qk = qk.broadcast_add(&mask)?
            }
            let w = candle_nn::ops::softmax(&qk, D::Minus1)?;
            let wv = w.matmul(&v)?.transpose(1, 2)?.flatten_from(2)?;
            #[save(name = "attn.out")]
            let attn = self.attn.out.forward(&wv)?;
            let x = (residual + attn)?;
            let mlp = self.mlp_linear2.forward(&self.mlp_linear1.forward(&self.mlp_ln.forward(&x)?)?.gelu()?)?;
            x + mlp
        }
    }

    fn plain(&self, xs: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let _enter = self.span.enter();
        let (_, n_ctx, n_state) = xs.dims3()?;
        if n_state != self.n_state {
            candle::bail!(
                "whisper: expected {} features per frame, got {n_state}",
                self.n_state
            )
        }
        let residual = xs.clone();
        let x = self.attn_ln.forward(xs)?;
        let q = self.attn.query.forward(&x)?;
        let k = self.attn.key.forward(&x)?;
        let v = self.attn.value.forward(&x)?;
        let scale = ((n_state / self.attn.n_head) as f64).powf(-0.25);
        let q = (self.attn.reshape_head(&q)? * scale)?;
        let k = (self.attn.reshape_head(&k)?.transpose(2, 3)? * scale)?;
        let v = self.attn.reshape_head(&v)?.contiguous()?;
        let mut qk = q.matmul(&k)?;
        if let Some(mask) = mask {
            let mask = mask.i((0..n_ctx, 0..n_ctx))?;
            qk = qk.broadcast_add(&mask)?
        }
        let w = candle_nn::ops::softmax(&qk, D::Minus1)?;
        let wv = w.matmul(&v)?.transpose(1, 2)?.flatten_from(2)?;
        let attn = self.attn.out.forward(&wv)?;
        let x = (residual + attn)?;
        let mlp = self.mlp_linear2.forward(
            &self
                .mlp_linear1
                .forward(&self.mlp_ln.forward(&x)?)?
                .gelu()?,
        )?;
        x + mlp
    }
}

#[test]
fn whisper_encoder_layer_with_a_guard_and_bail() {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F64] {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, dtype, &dev);
        let layer = ResidualAttentionBlock::load(12, 3, vb.pp("encoder.blocks.0")).unwrap();
        // Causal with -inf above the diagonal, and a last row of -1e9 (a
        // row that sees every key equally), larger than the sequence.
        let n = 9;
        let causal: Vec<f32> = (0..n)
            .flat_map(|i| (0..n).map(move |j| if j > i { f32::NEG_INFINITY } else { 0f32 }))
            .collect();
        let causal = Tensor::from_vec(causal, (n, n), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        for (b, t) in [(1, 1), (1, 5), (2, 7)] {
            let x = var(&[b, t, 12], 5, 1.0, dtype);
            let rows: Vec<f32> = (0..n * n)
                .map(|i| if i / n == t - 1 { -1e9 } else { 0.0 })
                .collect();
            let rows = Tensor::from_vec(rows, (n, n), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            for mask in [None, Some(&causal), Some(&rows)] {
                for plan in plans() {
                    let before = layer.span.0.load(Ordering::SeqCst);
                    check(
                        &format!("whisper {dtype:?} b{b} t{t}"),
                        &vm,
                        &[&x],
                        &plan,
                        || layer.forward(x.as_tensor(), mask),
                        || layer.plain(x.as_tensor(), mask),
                        tol(dtype),
                    );
                    // The forward, the plain run, and the replay (none
                    // under `off`) each enter the span once.
                    let entered = layer.span.0.load(Ordering::SeqCst) - before;
                    let expected = if plan.to_string().contains("off") {
                        2
                    } else {
                        3
                    };
                    assert_eq!(entered, expected, "{plan}");
                }
            }
        }
        // `bail!` on a bad shape: the error comes back from the forward,
        // in the user's words.
        let bad = var(&[1, 3, 10], 6, 1.0, dtype);
        for plan in plans() {
            let e = plan
                .scope(|| layer.forward(bad.as_tensor(), None))
                .unwrap_err();
            assert!(
                e.to_string()
                    .contains("whisper: expected 12 features per frame, got 10"),
                "{plan}: {e}"
            );
        }
    }
}

// ---------------------------------------------------------------------------
// 5. A sub-layer copied into a `mut` binding and called several times.
// ---------------------------------------------------------------------------

/// An MLP whose forward takes `&mut self` (it counts its calls, as a
/// generation-time layer keeps a cache): a caller holding `&self` copies it
/// into a `mut` binding first.
#[derive(Debug, Clone)]
struct CountingMlp {
    fc1: Linear,
    fc2: Linear,
    act: Activation,
    calls: usize,
}

impl CountingMlp {
    fn forward(&mut self, xs: &Tensor) -> Result<Tensor> {
        self.calls += 1;
        xs.apply(&self.fc1)?.apply(&self.act)?.apply(&self.fc2)
    }
}

#[derive(Debug, Clone)]
struct LoopedLayer {
    norm: remat_runtime::candle_nn::RmsNorm,
    norm_weight: Tensor,
    mlp: CountingMlp,
}

impl Module for LoopedLayer {
    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let mut mlp = self.mlp.clone();
            let h = self.norm.forward(xs)?;
            #[save]
            let a = mlp.forward(&h)?;
            let h = (xs + a)?;
            let b = mlp.forward(&h)?;
            let h2 = rms_norm(&(&h + &b)?, &self.norm_weight, 1e-6)?;
            #[save(name = "third")]
            let c = mlp.forward(&h2)?;
            Ok((h + c)?)
        }
    }
}

impl LoopedLayer {
    fn plain(&self, xs: &Tensor) -> Result<Tensor> {
        let mut mlp = self.mlp.clone();
        let h = self.norm.forward(xs)?;
        let a = mlp.forward(&h)?;
        let h = (xs + a)?;
        let b = mlp.forward(&h)?;
        let h2 = rms_norm(&(&h + &b)?, &self.norm_weight, 1e-6)?;
        let c = mlp.forward(&h2)?;
        h + c
    }
}

#[test]
fn a_sub_layer_copied_into_a_mut_binding_and_called_three_times() {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F64] {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, dtype, &dev);
        let w = vb
            .get_with_hints(
                10,
                "norm.weight",
                candle_nn::Init::Randn {
                    mean: 1.0,
                    stdev: 0.2,
                },
            )
            .unwrap();
        let layer = LoopedLayer {
            norm: remat_runtime::candle_nn::RmsNorm::new(w.clone(), 1e-6),
            norm_weight: w,
            mlp: CountingMlp {
                fc1: linear(&vb, 10, 14, true, "mlp.fc1").unwrap(),
                fc2: linear(&vb, 14, 10, true, "mlp.fc2").unwrap(),
                act: Activation::GeluPytorchTanh,
                calls: 0,
            },
        };
        for (b, t) in [(1, 3), (2, 5)] {
            let x = var(&[b, t, 10], 7, 1.0, dtype);
            for plan in plans() {
                check(
                    &format!("looped {dtype:?} b{b} t{t}"),
                    &vm,
                    &[&x],
                    &plan,
                    || x.as_tensor().apply(&layer),
                    || layer.plain(x.as_tensor()),
                    tol(dtype),
                );
            }
        }
    }
}
