//! A LLaMA-style decoder written the way candle users write models:
//! parameters come from a [`VarBuilder`] over a [`VarMap`] under
//! Hugging Face's tensor names (`model.layers.0.self_attn.q_proj.weight`),
//! layers are [`candle_nn::Embedding`] and [`candle_nn::Linear`] (no bias),
//! and each decoder layer is one `remat!` function. RMS norm, rotary
//! embeddings, attention, SwiGLU and the loss are [`remat_runtime::nn`]'s
//! differentiable ops: candle's fused `RmsNorm`, `rotary_emb::rope` and
//! `sdpa` have no backward. Grouped-query attention is [`nn::attention`]'s
//! own (no repeated key/value heads in the graph); the causal mask is an
//! `Option<&Tensor>` as in candle-transformers.
//!
//! The weights save and load with [`VarMap::save`] and [`VarMap::load`]
//! (safetensors), so a checkpoint in these names fine-tunes here.

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{embedding, linear_no_bias, Embedding, Linear, VarBuilder, VarMap};
use remat_runtime::{nn, remat};

use crate::gpt::causal_mask;
use crate::rng::Rng;

/// The model's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Config {
    /// Vocabulary size.
    pub vocab: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the SwiGLU layer.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key and value heads (divides `heads`; fewer is grouped-query
    /// attention).
    pub kv_heads: usize,
    /// Longest sequence (the rotary tables' length).
    pub max_seq: usize,
    /// RMS norm epsilon.
    pub eps: f64,
    /// Rotary embedding base.
    pub rope_theta: f64,
}

impl Config {
    /// A small model for a CPU: 4 layers, hidden 128, 4 query heads sharing
    /// 2 key/value heads.
    pub fn small(vocab: usize, max_seq: usize) -> Self {
        Config {
            vocab,
            hidden: 128,
            intermediate: 352,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            max_seq,
            eps: 1e-5,
            rope_theta: 10_000.0,
        }
    }

    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// RMS norm's gain (`weight`), applied with [`nn::rms_norm`].
#[derive(Clone)]
pub struct RmsNorm {
    /// The gain, `(hidden)`, initialised to ones.
    pub weight: Tensor,
    /// Epsilon.
    pub eps: f64,
}

impl RmsNorm {
    fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(size, "weight", candle_nn::Init::Const(1.0))?;
        Ok(RmsNorm { weight, eps })
    }

    /// Normalises the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        nn::rms_norm(x, &self.weight, self.eps)
    }
}

/// The cosine and sine tables of rotary embeddings, `(max_seq, head_dim/2)`.
#[derive(Clone)]
pub struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    fn new(cfg: &Config, dtype: DType, dev: &Device) -> Result<Self> {
        let half = cfg.head_dim() / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / cfg.head_dim() as f64) as f32)
            .collect();
        let inv = Tensor::from_vec(inv, (1, half), dev)?;
        let t = Tensor::arange(0u32, cfg.max_seq as u32, dev)?
            .to_dtype(DType::F32)?
            .reshape((cfg.max_seq, 1))?;
        let angles = t.broadcast_mul(&inv)?;
        Ok(Rotary {
            cos: angles.cos()?.to_dtype(dtype)?,
            sin: angles.sin()?.to_dtype(dtype)?,
        })
    }

    /// Rotates `x` `(B, H, T, D)` by the positions `0..T`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.dim(2)?;
        nn::rope(x, &self.cos.narrow(0, 0, t)?, &self.sin.narrow(0, 0, t)?)
    }
}

/// Self-attention's projections.
#[derive(Clone)]
pub struct SelfAttention {
    /// `(heads * head_dim, hidden)`.
    pub q_proj: Linear,
    /// `(kv_heads * head_dim, hidden)`.
    pub k_proj: Linear,
    /// `(kv_heads * head_dim, hidden)`.
    pub v_proj: Linear,
    /// `(hidden, heads * head_dim)`.
    pub o_proj: Linear,
    heads: usize,
    kv_heads: usize,
}

impl SelfAttention {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (h, d) = (cfg.hidden, cfg.head_dim());
        Ok(SelfAttention {
            q_proj: linear_no_bias(h, cfg.heads * d, vb.pp("q_proj"))?,
            k_proj: linear_no_bias(h, cfg.kv_heads * d, vb.pp("k_proj"))?,
            v_proj: linear_no_bias(h, cfg.kv_heads * d, vb.pp("v_proj"))?,
            o_proj: linear_no_bias(cfg.heads * d, h, vb.pp("o_proj"))?,
            heads: cfg.heads,
            kv_heads: cfg.kv_heads,
        })
    }

    /// The projections `(B, T, H*D)` as heads `(B, H, T, D)`, queries and
    /// keys rotated; keys and values keep their `kv_heads` heads
    /// ([`nn::attention`] groups the query heads over them).
    pub fn heads(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rotary: &Rotary,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let split = |x: &Tensor, n: usize| {
            let (b, t, c) = x.dims3()?;
            x.reshape((b, t, n, c / n))?.transpose(1, 2)
        };
        let q = rotary.apply(&split(q, self.heads)?)?;
        let k = rotary.apply(&split(k, self.kv_heads)?)?;
        let v = split(v, self.kv_heads)?;
        Ok((q, k, v))
    }
}

/// `(B, H, T, D)` back to `(B, T, H*D)`.
pub fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = x.dims4()?;
    x.transpose(1, 2)?.reshape((b, t, h * d))
}

/// The SwiGLU feed-forward layer's projections.
#[derive(Clone)]
pub struct Mlp {
    /// `(intermediate, hidden)`.
    pub gate_proj: Linear,
    /// `(intermediate, hidden)`.
    pub up_proj: Linear,
    /// `(hidden, intermediate)`.
    pub down_proj: Linear,
}

impl Mlp {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (h, i) = (cfg.hidden, cfg.intermediate);
        Ok(Mlp {
            gate_proj: linear_no_bias(h, i, vb.pp("gate_proj"))?,
            up_proj: linear_no_bias(h, i, vb.pp("up_proj"))?,
            down_proj: linear_no_bias(i, h, vb.pp("down_proj"))?,
        })
    }

    /// The gate and up projections as one `(2 * intermediate, hidden)`
    /// weight: one matrix product, whose output [`nn::swiglu`] splits.
    pub fn gate_up(&self) -> Result<Tensor> {
        Tensor::cat(&[self.gate_proj.weight(), self.up_proj.weight()], 0)
    }
}

/// One decoder layer's parameters.
#[derive(Clone)]
pub struct DecoderLayer {
    /// Norm before attention.
    pub input_layernorm: RmsNorm,
    /// Attention.
    pub self_attn: SelfAttention,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// The MLP.
    pub mlp: Mlp,
}

impl DecoderLayer {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        Ok(DecoderLayer {
            input_layernorm: RmsNorm::new(cfg.hidden, cfg.eps, vb.pp("input_layernorm"))?,
            self_attn: SelfAttention::new(cfg, vb.pp("self_attn"))?,
            post_attention_layernorm: RmsNorm::new(
                cfg.hidden,
                cfg.eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp: Mlp::new(cfg, vb.pp("mlp"))?,
        })
    }
}

remat! {
    /// One decoder layer: pre-norm grouped-query attention and a SwiGLU
    /// MLP, each added to the residual stream. No statement is annotated:
    /// the plan decides what is saved, by the names below.
    pub fn decoder_layer(x: &Tensor, p: &DecoderLayer, rotary: &Rotary, mask: Option<&Tensor>) -> Result<Tensor> {
        let h = p.input_layernorm.forward(x)?;
        let q = p.self_attn.q_proj.forward(&h)?;
        let k = p.self_attn.k_proj.forward(&h)?;
        let v = p.self_attn.v_proj.forward(&h)?;
        let (q, k, v) = p.self_attn.heads(&q, &k, &v, rotary)?;
        let att = merge_heads(&nn::attention(&q, &k, &v, false, mask)?)?;
        let o = p.self_attn.o_proj.forward(&att)?;
        let x = (x + o)?;
        let h = p.post_attention_layernorm.forward(&x)?;
        let gate_up = nn::linear(&h, &p.mlp.gate_up()?, None)?;
        let down = p.mlp.down_proj.forward(&nn::swiglu(&gate_up)?)?;
        Ok((x + down)?)
    }
}

remat! {
    /// The final norm, the output head and the mean cross-entropy (in f32
    /// whatever the model's dtype).
    pub fn head_loss(x: &Tensor, norm: &RmsNorm, lm_head: &Linear, targets: &Tensor) -> Result<Tensor> {
        let h = norm.forward(x)?;
        let logits = lm_head.forward(&h)?.to_dtype(DType::F32)?;
        let loss = nn::cross_entropy(&logits.flatten_to(1)?, &targets.flatten_all()?)?;
        Ok(loss)
    }
}

/// The statements the selective policy saves: the outputs of the matrix
/// products (PyTorch's "save every matmul" without the attention core).
pub const SELECTIVE: &[&str] = &["q", "k", "v", "o", "gate_up", "down"];

/// The whole model.
#[derive(Clone)]
pub struct Llama {
    /// Its shape.
    pub config: Config,
    /// `model.embed_tokens`.
    pub embed_tokens: Embedding,
    /// `model.layers.N`.
    pub layers: Vec<DecoderLayer>,
    /// `model.norm`.
    pub norm: RmsNorm,
    /// `lm_head`.
    pub lm_head: Linear,
    /// The rotary embedding's tables (computed, not parameters).
    pub rotary: Rotary,
}

impl Llama {
    /// Builds the model from `vb` under Hugging Face's LLaMA names; with a
    /// [`VarBuilder::from_varmap`], every parameter becomes a `Var` of the
    /// map.
    pub fn new(config: Config, vb: VarBuilder) -> Result<Self> {
        if config.hidden == 0
            || config.heads == 0
            || config.hidden % config.heads != 0
            || config.kv_heads == 0
            || config.heads % config.kv_heads != 0
            || config.head_dim() % 2 != 0
        {
            candle_core::bail!(
                "heads {} must divide hidden {} into an even head size, and kv-heads {} must divide heads",
                config.heads,
                config.hidden,
                config.kv_heads
            );
        }
        let m = vb.pp("model");
        let layers = (0..config.layers)
            .map(|i| DecoderLayer::new(&config, m.pp("layers").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Llama {
            embed_tokens: embedding(config.vocab, config.hidden, m.pp("embed_tokens"))?,
            layers,
            norm: RmsNorm::new(config.hidden, config.eps, m.pp("norm"))?,
            lm_head: linear_no_bias(config.hidden, config.vocab, vb.pp("lm_head"))?,
            rotary: Rotary::new(&config, vb.dtype(), vb.device())?,
            config,
        })
    }

    /// The residual stream after the decoder layers, `(B, T, hidden)`.
    fn trunk(&self, ids: &Tensor) -> Result<Tensor> {
        let t = ids.dim(1)?;
        let mut x = self.embed_tokens.forward(ids)?;
        let mask = causal_mask(t, x.device())?.to_dtype(x.dtype())?;
        for layer in &self.layers {
            x = decoder_layer(&x, layer, &self.rotary, Some(&mask))?;
        }
        Ok(x)
    }

    /// Mean cross-entropy (nats per token) of predicting `targets` from
    /// token ids `ids`, both `(B, T)`, under the current `Plan`.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        head_loss(&self.trunk(ids)?, &self.norm, &self.lm_head, targets)
    }

    /// Logits `(B, T, vocab)` in f32.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.lm_head
            .forward(&self.norm.forward(&self.trunk(ids)?)?)?
            .to_dtype(DType::F32)
    }
}

/// The variables of `varmap` with their names, in name order (the map's
/// own order changes from process to process).
pub fn named_vars(varmap: &VarMap) -> Result<Vec<(String, Var)>> {
    let vars = varmap
        .data()
        .lock()
        .map_err(|_| candle_core::Error::Msg("the var map's lock is poisoned".into()))?;
    let mut named: Vec<(String, Var)> = vars.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(named)
}

/// Draws every variable of `varmap` again from `rng`, in name order:
/// RMS norm gains stay ones, other weights are normal with standard
/// deviation 0.02 (`o_proj` and `down_proj`, which add to the residual
/// stream, scaled by `1/sqrt(2 layers)`, as GPT-2 does). candle's CPU
/// random generator cannot be seeded (`Device::set_seed` fails on a CPU),
/// so a run is reproducible only with weights drawn here.
pub fn init_weights(varmap: &VarMap, layers: usize, rng: &mut Rng) -> Result<()> {
    for (name, var) in named_vars(varmap)? {
        if name.ends_with("norm.weight") {
            continue;
        }
        let std = if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
            0.02 / (2.0 * layers as f64).sqrt()
        } else {
            0.02
        };
        let values =
            Tensor::from_vec(rng.normal(var.elem_count(), std), var.shape(), var.device())?;
        var.set(&values.to_dtype(var.dtype())?)?;
    }
    Ok(())
}
