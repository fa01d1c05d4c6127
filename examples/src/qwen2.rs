//! A Qwen2-family decoder (Qwen2, Qwen2.5) written as candle-transformers
//! writes it in `candle-transformers/src/models/qwen2.rs`: the same
//! structs, the same `Config` field names (Hugging Face's `config.json`),
//! the same tensor names (`model.layers.0.self_attn.q_proj.weight`),
//! grouped-query attention with biased query/key/value projections,
//! rotary embeddings, RMS norms, a SwiGLU MLP and a tied or untied head.
//! Three things differ, each the recipe of the guide's "Checkpointing a
//! candle-transformers model":
//!
//! 1. **The `use` lines**: `ops`, `rotary_emb`, `rms_norm` and `RmsNorm`
//!    come from [`remat_runtime::candle_nn`], whose ops have a backward;
//!    with candle-nn's, only `lm_head` would train.
//! 2. **The layer's forward is a `remat!` block** ([`DecoderLayer::forward`],
//!    a method as in candle-transformers), with the three projections and
//!    the MLP's products as statements of their own, so that a plan can
//!    save them by name ([`SELECTIVE`]).
//! 3. **No KV cache**: it serves generation (one token at a time), and a
//!    forward that appends to it would append twice when the block is
//!    replayed in the backward. `Attention` takes `&self`, and there is no
//!    `seqlen_offset`.
//!
//! The weights of a checkpoint directory (`config.json`,
//! `model.safetensors` or its shards, `tokenizer.json`) are read with
//! [`VarBuilder::from_mmaped_safetensors`] into the `Var`s of a [`VarMap`]
//! ([`load`]): a model built on the mmaped builder itself would hold
//! constant tensors, which get no gradient, so fine-tuning builds it on a
//! `VarMap` (the way candle trains) and fills each `Var` from the file,
//! converted to the training dtype (Hub checkpoints are bf16). [`save`]
//! writes the same layout back, so a fine-tuned model loads again here, in
//! candle-transformers or in `transformers`.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{linear, linear_no_bias, Activation, Embedding, Linear, VarBuilder, VarMap};
use remat_runtime::candle_nn::{ops, rms_norm, rotary_emb, RmsNorm};
use remat_runtime::{nn, remat, Plan};

use crate::data::Corpus;
use crate::gpt::Checkpointing;
use crate::rng::Rng;

/// The model's `config.json`, under Hugging Face's names (the fields
/// candle-transformers' `Config` reads; the sliding window, off in Qwen2's
/// configs, is not implemented).
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct Config {
    /// Tokens in the vocabulary (rows of `embed_tokens`).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key and value heads (fewer than the query heads: grouped-query
    /// attention).
    pub num_key_value_heads: usize,
    /// Rows of the rotary tables: the longest sequence.
    pub max_position_embeddings: usize,
    /// Rotary embedding base.
    pub rope_theta: f64,
    /// RMS norm epsilon.
    pub rms_norm_eps: f64,
    /// Whether `lm_head` is `embed_tokens` (no `lm_head.weight` in the
    /// checkpoint).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The MLP's gate activation (`silu` in Qwen2).
    #[serde(default = "silu")]
    pub hidden_act: Activation,
}

fn silu() -> Activation {
    Activation::Silu
}

impl Config {
    /// A small Qwen2 for a CPU, in Qwen2-0.5B's proportions (14 query heads
    /// over 2 key/value heads there; 4 over 2 here), tied embeddings.
    pub fn tiny(vocab_size: usize) -> Self {
        Config {
            vocab_size,
            hidden_size: 128,
            intermediate_size: 352,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            max_position_embeddings: 512,
            rope_theta: 1_000_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            hidden_act: Activation::Silu,
        }
    }

    /// Qwen2.5-0.5B's dimensions (24 layers, hidden 896, 14 query and 2
    /// key/value heads, MLP 4864, vocabulary 151,936, tied head), or `None`
    /// for another name.
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "qwen2.5-0.5b" => Some(Config {
                vocab_size: 151_936,
                hidden_size: 896,
                intermediate_size: 4864,
                num_hidden_layers: 24,
                num_attention_heads: 14,
                num_key_value_heads: 2,
                max_position_embeddings: 32_768,
                ..Config::tiny(151_936)
            }),
            _ => None,
        }
    }

    /// The size of one head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Fails, naming the fields, unless the heads divide the width into an
    /// even head size and the key/value heads divide the query heads.
    pub fn check(&self) -> Result<()> {
        let (h, q, kv) = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
        );
        if h == 0 || q == 0 || kv == 0 || h % q != 0 || q % kv != 0 || (h / q) % 2 != 0 {
            candle_core::bail!(
                "config: num_attention_heads {q} must divide hidden_size {h} into an even head \
                 size, and num_key_value_heads {kv} must divide num_attention_heads"
            );
        }
        if self.vocab_size == 0 || self.max_position_embeddings == 0 {
            candle_core::bail!("config: vocab_size and max_position_embeddings must be positive");
        }
        Ok(())
    }
}

/// The rotary embedding's tables, `(max_position_embeddings, head_dim / 2)`.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    sin: Tensor,
    cos: Tensor,
}

impl RotaryEmbedding {
    fn new(dtype: DType, cfg: &Config, dev: &Device) -> Result<Self> {
        let dim = cfg.head_dim();
        let max_seq_len = cfg.max_position_embeddings;
        let inv_freq: Vec<_> = (0..dim)
            .step_by(2)
            .map(|i| 1f32 / cfg.rope_theta.powf(i as f64 / dim as f64) as f32)
            .collect();
        let inv_freq_len = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq, (1, inv_freq_len), dev)?;
        // In f32, then converted (candle-transformers multiplies in the
        // model's dtype: in bf16, positions above 256 are rounded).
        let t = Tensor::arange(0u32, max_seq_len as u32, dev)?
            .to_dtype(DType::F32)?
            .reshape((max_seq_len, 1))?;
        let freqs = t.matmul(&inv_freq)?;
        Ok(Self {
            sin: freqs.sin()?.to_dtype(dtype)?,
            cos: freqs.cos()?.to_dtype(dtype)?,
        })
    }

    fn apply_rotary_emb_qkv(&self, q: &Tensor, k: &Tensor) -> Result<(Tensor, Tensor)> {
        let (_b_sz, _h, seq_len, _n_embd) = q.dims4()?;
        let cos = self.cos.narrow(0, 0, seq_len)?;
        let sin = self.sin.narrow(0, 0, seq_len)?;
        let q_embed = rotary_emb::rope(&q.contiguous()?, &cos, &sin)?;
        let k_embed = rotary_emb::rope(&k.contiguous()?, &cos, &sin)?;
        Ok((q_embed, k_embed))
    }
}

/// candle-transformers' `utils::repeat_kv`: each key/value head repeated
/// for the `n_rep` query heads of its group.
fn repeat_kv(xs: Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        Ok(xs)
    } else {
        let (b_sz, n_kv_head, seq_len, head_dim) = xs.dims4()?;
        Tensor::cat(&vec![&xs; n_rep], 2)?.reshape((b_sz, n_kv_head * n_rep, seq_len, head_dim))
    }
}

/// The SwiGLU MLP.
#[derive(Debug, Clone)]
#[allow(clippy::upper_case_acronyms)]
pub struct MLP {
    /// `(intermediate, hidden)`.
    pub gate_proj: Linear,
    /// `(intermediate, hidden)`.
    pub up_proj: Linear,
    /// `(hidden, intermediate)`.
    pub down_proj: Linear,
    /// The gate's activation.
    pub act_fn: Activation,
}

impl MLP {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let hidden_sz = cfg.hidden_size;
        let intermediate_sz = cfg.intermediate_size;
        let gate_proj = linear_no_bias(hidden_sz, intermediate_sz, vb.pp("gate_proj"))?;
        let up_proj = linear_no_bias(hidden_sz, intermediate_sz, vb.pp("up_proj"))?;
        let down_proj = linear_no_bias(intermediate_sz, hidden_sz, vb.pp("down_proj"))?;
        Ok(Self {
            gate_proj,
            up_proj,
            down_proj,
            act_fn: cfg.hidden_act,
        })
    }
}

impl MLP {
    /// `xs + mlp(norm(xs))` as one [`nn::swiglu_mlp`] node, which keeps
    /// the gate's and the up projection's outputs for its backward only.
    /// SwiGLU only: another `hidden_act` is an error.
    pub fn forward_fused(&self, xs: &Tensor, norm: &RmsNorm) -> Result<Tensor> {
        if !matches!(self.act_fn, Activation::Silu) {
            candle_core::bail!(
                "qwen2: the fused MLP is SwiGLU (hidden_act \"silu\"), this model's is {:?}: \
                 run the layers with --ops composed",
                self.act_fn
            );
        }
        let norm = nn::PreNorm::Rms {
            gain: norm.weight(),
            eps: norm.eps(),
        };
        nn::swiglu_mlp(
            xs,
            Some(norm),
            self.gate_proj.weight(),
            self.up_proj.weight(),
            self.down_proj.weight(),
            Some(xs),
        )
    }
}

/// Grouped-query self-attention.
#[derive(Debug, Clone)]
pub struct Attention {
    /// `(heads * head_dim, hidden)`, with a bias.
    pub q_proj: Linear,
    /// `(kv_heads * head_dim, hidden)`, with a bias.
    pub k_proj: Linear,
    /// `(kv_heads * head_dim, hidden)`, with a bias.
    pub v_proj: Linear,
    /// `(hidden, heads * head_dim)`, no bias.
    pub o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    num_kv_groups: usize,
    head_dim: usize,
    hidden_size: usize,
    rotary_emb: Arc<RotaryEmbedding>,
}

impl Attention {
    fn new(rotary_emb: Arc<RotaryEmbedding>, cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let hidden_sz = cfg.hidden_size;
        let num_heads = cfg.num_attention_heads;
        let num_kv_heads = cfg.num_key_value_heads;
        let num_kv_groups = num_heads / num_kv_heads;
        let head_dim = hidden_sz / num_heads;
        let q_proj = linear(hidden_sz, num_heads * head_dim, vb.pp("q_proj"))?;
        let k_proj = linear(hidden_sz, num_kv_heads * head_dim, vb.pp("k_proj"))?;
        let v_proj = linear(hidden_sz, num_kv_heads * head_dim, vb.pp("v_proj"))?;
        let o_proj = linear_no_bias(num_heads * head_dim, hidden_sz, vb.pp("o_proj"))?;
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            num_heads,
            num_kv_heads,
            num_kv_groups,
            head_dim,
            hidden_size: hidden_sz,
            rotary_emb,
        })
    }

    /// candle-transformers' `Attention::forward` between the projections
    /// and `o_proj` (which [`DecoderLayer::forward`] runs as statements of their
    /// own): heads, rotary embedding, the key/value heads repeated, softmax
    /// attention, heads merged. `(B, T, ...)` in, `(B, T, hidden)` out.
    pub fn attend(
        &self,
        query_states: &Tensor,
        key_states: &Tensor,
        value_states: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b_sz, q_len, _) = query_states.dims3()?;

        let query_states = query_states
            .reshape((b_sz, q_len, self.num_heads, self.head_dim))?
            .transpose(1, 2)?;
        let key_states = key_states
            .reshape((b_sz, q_len, self.num_kv_heads, self.head_dim))?
            .transpose(1, 2)?;
        let value_states = value_states
            .reshape((b_sz, q_len, self.num_kv_heads, self.head_dim))?
            .transpose(1, 2)?;

        let (query_states, key_states) = self
            .rotary_emb
            .apply_rotary_emb_qkv(&query_states, &key_states)?;

        let key_states = repeat_kv(key_states, self.num_kv_groups)?.contiguous()?;
        let value_states = repeat_kv(value_states, self.num_kv_groups)?.contiguous()?;

        let attn_output = {
            let scale = 1f64 / f64::sqrt(self.head_dim as f64);
            let attn_weights = (query_states.matmul(&key_states.transpose(2, 3)?)? * scale)?;

            let attn_weights = match attention_mask {
                None => attn_weights,
                Some(mask) => attn_weights.broadcast_add(mask)?,
            };
            let attn_weights = ops::softmax_last_dim(&attn_weights)?;
            attn_weights.matmul(&value_states)?
        };
        attn_output
            .transpose(1, 2)?
            .reshape((b_sz, q_len, self.hidden_size))
    }
}

impl Attention {
    /// [`attend`](Self::attend) with the softmax attention as one
    /// [`nn::attention`] node: the same heads, rotations and mask, the
    /// key/value heads read by their groups of query heads (no
    /// `repeat_kv`), and no `(B, H, T, T)` scores or probabilities kept
    /// for the backward.
    pub fn attend_fused(
        &self,
        query_states: &Tensor,
        key_states: &Tensor,
        value_states: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b_sz, q_len, _) = query_states.dims3()?;
        let heads =
            |x: &Tensor, n: usize| x.reshape((b_sz, q_len, n, self.head_dim))?.transpose(1, 2);
        let (q, k) = self.rotary_emb.apply_rotary_emb_qkv(
            &heads(query_states, self.num_heads)?,
            &heads(key_states, self.num_kv_heads)?,
        )?;
        let v = heads(value_states, self.num_kv_heads)?;
        nn::attention(&q, &k, &v, false, attention_mask)?
            .transpose(1, 2)?
            .reshape((b_sz, q_len, self.hidden_size))
    }
}

/// One decoder layer's parameters.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// Attention.
    pub self_attn: Attention,
    /// The MLP.
    pub mlp: MLP,
    /// The norm before attention.
    pub input_layernorm: RmsNorm,
    /// The norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    fn new(rotary_emb: Arc<RotaryEmbedding>, cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let self_attn = Attention::new(rotary_emb, cfg, vb.pp("self_attn"))?;
        let mlp = MLP::new(cfg, vb.pp("mlp"))?;
        let input_layernorm =
            rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("input_layernorm"))?;
        let post_attention_layernorm = rms_norm(
            cfg.hidden_size,
            cfg.rms_norm_eps,
            vb.pp("post_attention_layernorm"),
        )?;
        Ok(Self {
            self_attn,
            mlp,
            input_layernorm,
            post_attention_layernorm,
        })
    }
}

impl DecoderLayer {
    remat! {
        /// Pre-norm attention and MLP, each added to the residual stream.
        /// Each `let` is a statement a plan saves or recomputes by its name
        /// (`h`, `q`, `k`, `v`, `attn`, `o`, `xs`, `h#2`, `gate`, `up`,
        /// `mlp`, `down`); the region is `DecoderLayer::forward`.
        pub fn forward(&self, xs: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
            let h = self.input_layernorm.forward(xs)?;
            let q = self.self_attn.q_proj.forward(&h)?;
            let k = self.self_attn.k_proj.forward(&h)?;
            let v = self.self_attn.v_proj.forward(&h)?;
            let attn = self.self_attn.attend(&q, &k, &v, attention_mask)?;
            let o = self.self_attn.o_proj.forward(&attn)?;
            let xs = (xs + o)?;
            let h = self.post_attention_layernorm.forward(&xs)?;
            let gate = self.mlp.gate_proj.forward(&h)?;
            let up = self.mlp.up_proj.forward(&h)?;
            let mlp = (gate.apply(&self.mlp.act_fn)? * up)?;
            let down = self.mlp.down_proj.forward(&mlp)?;
            Ok((xs + down)?)
        }
    }
}

impl DecoderLayer {
    remat! {
        /// [`forward`](Self::forward) with remat's fused ops where
        /// candle-transformers composes candle's: the attention as one
        /// [`nn::attention`] node, `o_proj` and its residual add as
        /// [`nn::linear_add`], and the MLP with its norm and residual as
        /// [`nn::swiglu_mlp`]. The same function of the same parameters;
        /// its statements are `h`, `q`, `k`, `v`, `attn`, `xs` and `out`
        /// (region `DecoderLayer::forward_fused`).
        pub fn forward_fused(&self, xs: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
            let h = self.input_layernorm.forward(xs)?;
            let q = self.self_attn.q_proj.forward(&h)?;
            let k = self.self_attn.k_proj.forward(&h)?;
            let v = self.self_attn.v_proj.forward(&h)?;
            let attn = self.self_attn.attend_fused(&q, &k, &v, attention_mask)?;
            let xs = nn::linear_add(&attn, self.self_attn.o_proj.weight(), None, xs)?;
            let out = self.mlp.forward_fused(&xs, &self.post_attention_layernorm)?;
            Ok(out)
        }
    }
}

remat! {
    /// The output head and the mean cross-entropy of `targets` (in f32
    /// whatever the model's dtype): the `(B * T, vocab)` logits, the
    /// largest tensor of a real vocabulary, are recomputed in the backward
    /// unless the plan saves `logits`.
    pub fn head_loss(xs: &Tensor, lm_head: &Linear, targets: &Tensor) -> Result<Tensor> {
        let logits = lm_head.forward(xs)?.to_dtype(DType::F32)?;
        let loss = nn::cross_entropy(&logits.flatten_to(1)?, &targets.flatten_all()?)?;
        Ok(loss)
    }
}

/// The final norm, the output head and the mean cross-entropy of `targets`
/// as one node, chunk by chunk over the tokens
/// ([`nn::linear_cross_entropy`]): no `(B * T, vocab)` logits, at any time.
pub fn fused_head_loss(
    xs: &Tensor,
    norm: &RmsNorm,
    lm_head: &Linear,
    targets: &Tensor,
) -> Result<Tensor> {
    let o = nn::LinearCrossEntropy {
        norm: Some(nn::PreNorm::Rms {
            gain: norm.weight(),
            eps: norm.eps(),
        }),
        bias: lm_head.bias(),
        ..Default::default()
    };
    nn::linear_cross_entropy(xs, lm_head.weight(), targets, &o)
}

/// The statements the `selective` policy saves: the outputs of the matrix
/// products (PyTorch's "save the matmuls"); norms, rotations, attention
/// scores and the MLP's activation are recomputed.
pub const SELECTIVE: &[&str] = &["q", "k", "v", "o", "gate", "up", "down"];

/// What `selective` saves in [`DecoderLayer::forward_fused`]: the
/// projections' outputs and the attention sublayer's (`o_proj` and the
/// residual add); the fused MLP keeps its own products for its backward.
pub const SELECTIVE_FUSED: &[&str] = &["q", "k", "v", "xs"];

/// The plan of `policy` for this model: `selective` and `offload` name
/// [`SELECTIVE`].
pub fn plan(policy: Checkpointing) -> Plan {
    match policy {
        Checkpointing::Selective => Plan::save_only(SELECTIVE.iter().copied()),
        Checkpointing::Offload => {
            Plan::save_and_offload_only(Vec::<&str>::new(), SELECTIVE.iter().copied())
        }
        other => other.plan(),
    }
}

/// [`plan`] for layers that run [`DecoderLayer::forward_fused`]
/// (`fused_ops`): `selective` and `offload` name [`SELECTIVE_FUSED`].
pub fn plan_for(policy: Checkpointing, fused_ops: bool) -> Plan {
    match policy {
        Checkpointing::Selective if fused_ops => Plan::save_only(SELECTIVE_FUSED.iter().copied()),
        Checkpointing::Offload if fused_ops => {
            Plan::save_and_offload_only(Vec::<&str>::new(), SELECTIVE_FUSED.iter().copied())
        }
        other => plan(other),
    }
}

/// The decoder: embeddings, layers, final norm.
#[derive(Debug, Clone)]
pub struct Model {
    /// `model.embed_tokens`.
    pub embed_tokens: Embedding,
    /// `model.layers.N`.
    pub layers: Vec<DecoderLayer>,
    /// `model.norm`.
    pub norm: RmsNorm,
    /// Whether each layer runs [`DecoderLayer::forward`] (`false`, the
    /// default: candle-transformers' composed ops) or
    /// [`DecoderLayer::forward_fused`] (remat's fused ops).
    pub fused_ops: bool,
    device: Device,
    dtype: DType,
}

impl Model {
    /// The decoder's parameters from `vb`, under `model.`.
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        cfg.check()?;
        let vb_m = vb.pp("model");
        let embed_tokens =
            candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, vb_m.pp("embed_tokens"))?;
        let rotary_emb = Arc::new(RotaryEmbedding::new(vb.dtype(), cfg, vb_m.device())?);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let vb_l = vb_m.pp("layers");
        for layer_idx in 0..cfg.num_hidden_layers {
            let layer = DecoderLayer::new(rotary_emb.clone(), cfg, vb_l.pp(layer_idx))?;
            layers.push(layer)
        }
        let norm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb_m.pp("norm"))?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            fused_ops: false,
            device: vb.device().clone(),
            dtype: vb.dtype(),
        })
    }

    /// The additive causal mask `(T, T)`: 0 on and below the diagonal,
    /// -inf above.
    fn causal_mask(&self, tgt_len: usize) -> Result<Tensor> {
        let mask: Vec<_> = (0..tgt_len)
            .flat_map(|i| (0..tgt_len).map(move |j| if i < j { f32::NEG_INFINITY } else { 0. }))
            .collect();
        Tensor::from_slice(&mask, (tgt_len, tgt_len), &self.device)?.to_dtype(self.dtype)
    }

    /// The normalized hidden states `(B, T, hidden)` of token ids `(B, T)`,
    /// each decoder layer one `remat!` region under the current plan.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.hidden(input_ids)?.apply(&self.norm)
    }

    /// The hidden states before the final norm.
    pub fn hidden(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_b_size, seq_len) = input_ids.dims2()?;
        let attention_mask = self.causal_mask(seq_len)?;
        let mut xs = self.embed_tokens.forward(input_ids)?;
        if self.fused_ops {
            for layer in self.layers.iter() {
                xs = layer.forward_fused(&xs, Some(&attention_mask))?
            }
            return Ok(xs);
        }
        for layer in self.layers.iter() {
            xs = layer.forward(&xs, Some(&attention_mask))?
        }
        Ok(xs)
    }
}

/// The decoder and its output head.
#[derive(Debug, Clone)]
pub struct ModelForCausalLM {
    /// The decoder.
    pub base_model: Model,
    /// `lm_head`, or `model.embed_tokens` when the embeddings are tied.
    pub lm_head: Linear,
    /// The configuration it was built from.
    pub config: Config,
    /// Whether [`loss`](Self::loss) runs the final norm, the head and the
    /// loss as one chunked node ([`fused_head_loss`], the default) or as
    /// candle's composed ops ([`head_loss`]).
    pub fused_head: bool,
}

impl ModelForCausalLM {
    /// The model's parameters from `vb`. The head is tied when
    /// `cfg.tie_word_embeddings` (candle-transformers asks the builder
    /// whether `lm_head.weight` exists; a `VarMap`'s builder, empty until
    /// the model is built, cannot say).
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let base_model = Model::new(cfg, vb.clone())?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(base_model.embed_tokens.embeddings().clone(), None)
        } else {
            linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?
        };
        Ok(Self {
            base_model,
            lm_head,
            config: cfg.clone(),
            fused_head: true,
        })
    }

    /// The mean cross-entropy (nats per token) of predicting `targets` from
    /// `input_ids`, both `(B, T)`, under the current `Plan`.
    pub fn loss(&self, input_ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        if self.fused_head {
            let hidden = self.base_model.hidden(input_ids)?;
            fused_head_loss(&hidden, &self.base_model.norm, &self.lm_head, targets)
        } else {
            head_loss(&self.base_model.forward(input_ids)?, &self.lm_head, targets)
        }
    }

    /// The logits `(B, T, vocab)` in f32.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.base_model
            .forward(input_ids)?
            .apply(&self.lm_head)?
            .to_dtype(DType::F32)
    }
}

/// The file names of a checkpoint directory in Hugging Face's layout.
pub const CONFIG_FILE: &str = "config.json";
/// The weights, in one file.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of sharded weights.
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";
/// The tokenizer.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// An error about the file `path`.
fn file_error(path: &Path, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {e}", path.display()))
}

/// The `config.json` of the checkpoint in `dir`.
pub fn read_config(dir: &Path) -> Result<Config> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| file_error(&path, e))?;
    let config: Config = serde_json::from_str(&text).map_err(|e| file_error(&path, e))?;
    config.check().map_err(|e| file_error(&path, e))?;
    Ok(config)
}

/// The safetensors files of the checkpoint in `dir`: `model.safetensors`,
/// or the shards its `model.safetensors.index.json` names.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join(WEIGHTS_FILE);
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join(WEIGHTS_INDEX_FILE);
    let text = std::fs::read_to_string(&index).map_err(|e| {
        candle_core::Error::Msg(format!(
            "{}: no {WEIGHTS_FILE} and no {WEIGHTS_INDEX_FILE} ({e})",
            dir.display()
        ))
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| file_error(&index, e))?;
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(file_error(&index, "no weight_map"));
    };
    let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
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

/// A checkpoint loaded for fine-tuning.
pub struct Loaded {
    /// Its configuration.
    pub config: Config,
    /// Every parameter, a `Var` under the checkpoint's name.
    pub varmap: VarMap,
    /// The model on those `Var`s.
    pub model: ModelForCausalLM,
    /// Tensors of the files the model does not use (an `lm_head.weight`
    /// beside tied embeddings, buffers of other libraries).
    pub unused: Vec<String>,
}

/// Loads the checkpoint in `dir` for fine-tuning in `dtype` on `dev`: the
/// model is built on a [`VarMap`] (so that every parameter is a `Var` that
/// trains), then each `Var` is set from the weights read with
/// [`VarBuilder::from_mmaped_safetensors`] (which checks the shape and
/// converts the dtype). A missing tensor or a wrong shape is an error
/// naming the tensor.
pub fn load(dir: &Path, dtype: DType, dev: &Device) -> Result<Loaded> {
    let config = read_config(dir)?;
    let varmap = VarMap::new();
    let model = ModelForCausalLM::new(&config, VarBuilder::from_varmap(&varmap, dtype, dev))?;
    let files = weight_files(dir)?;
    // Safety: the files are not modified while they are mapped (candle's
    // own loaders make the same assumption).
    let weights = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, dev)? };
    let named = named_vars(&varmap)?;
    for (name, var) in &named {
        let value = weights
            .get(var.shape(), name)
            .map_err(|e| candle_core::Error::Msg(format!("{}: {name}: {e}", dir.display())))?;
        var.set(&value)?;
    }
    let used: BTreeSet<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
    let mut unused = Vec::new();
    for file in &files {
        // Safety: as above.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(file)? };
        unused.extend(
            st.tensors()
                .into_iter()
                .map(|(n, _)| n)
                .filter(|n| !used.contains(n.as_str())),
        );
    }
    unused.sort();
    Ok(Loaded {
        config,
        varmap,
        model,
        unused,
    })
}

/// Writes a checkpoint in Hugging Face's layout into `dir`: `config.json`
/// (the config, with Qwen2's `architectures` and `model_type`),
/// `model.safetensors` (the `Var`s of `varmap` under their names, in their
/// dtype) and `tokenizer.json` (a copy of `tokenizer`).
pub fn save(dir: &Path, config: &Config, varmap: &VarMap, tokenizer: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| file_error(dir, e))?;
    let dtype = named_vars(varmap)?
        .first()
        .map_or(DType::F32, |(_, v)| v.dtype());
    let mut json = serde_json::to_value(config).map_err(|e| file_error(dir, e))?;
    if let Some(fields) = json.as_object_mut() {
        fields.insert(
            "architectures".into(),
            serde_json::json!(["Qwen2ForCausalLM"]),
        );
        fields.insert("model_type".into(), "qwen2".into());
        let torch_dtype = match dtype {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            _ => "float32",
        };
        fields.insert("torch_dtype".into(), torch_dtype.into());
    }
    let path = dir.join(CONFIG_FILE);
    let text = serde_json::to_string_pretty(&json).map_err(|e| file_error(&path, e))?;
    std::fs::write(&path, text).map_err(|e| file_error(&path, e))?;
    varmap.save(dir.join(WEIGHTS_FILE))?;
    let to = dir.join(TOKENIZER_FILE);
    // Saving into the directory the tokenizer comes from: nothing to copy
    // (a copy onto itself would truncate it).
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if !same(tokenizer, &to) {
        std::fs::copy(tokenizer, &to).map_err(|e| file_error(tokenizer, e))?;
    }
    Ok(())
}

/// Reads the `tokenizer.json` of the checkpoint in `dir`.
pub fn read_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer> {
    let path = dir.join(TOKENIZER_FILE);
    tokenizers::Tokenizer::from_file(&path).map_err(|e| file_error(&path, e))
}

/// The token ids of `text`.
pub fn encode(tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    let encoding = tokenizer
        .encode(text, false)
        .map_err(|e| candle_core::Error::Msg(format!("tokenizer: {e}")))?;
    Ok(encoding.get_ids().to_vec())
}

/// A tokenizer whose tokens are the characters of `text` (a byte-pair
/// encoding with no merges), for a tiny checkpoint.
pub fn char_tokenizer(text: &str) -> Result<tokenizers::Tokenizer> {
    let chars: BTreeSet<char> = text.chars().collect();
    let vocab: tokenizers::models::bpe::Vocab = chars
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let bpe = tokenizers::models::bpe::BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .map_err(|e| candle_core::Error::Msg(format!("tokenizer: {e}")))?;
    Ok(tokenizers::Tokenizer::new(bpe))
}

/// Draws every variable of `varmap` again from `rng`, in name order, as a
/// freshly initialized Qwen2: norm gains ones, biases zeros, other weights
/// normal with standard deviation 0.02 (`o_proj` and `down_proj`, which add
/// to the residual stream, scaled by `1/sqrt(2 layers)`, as GPT-2 does).
/// candle's CPU random generator cannot be seeded, so a run is
/// reproducible only with weights drawn here.
pub fn init_weights(varmap: &VarMap, layers: usize, rng: &mut Rng) -> Result<()> {
    for (name, var) in named_vars(varmap)? {
        let values = if name.ends_with("norm.weight") {
            Tensor::ones(var.shape(), DType::F32, var.device())?
        } else if name.ends_with(".bias") {
            Tensor::zeros(var.shape(), DType::F32, var.device())?
        } else {
            let std = if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                0.02 / (2.0 * layers as f64).sqrt()
            } else {
                0.02
            };
            Tensor::from_vec(rng.normal(var.elem_count(), std), var.shape(), var.device())?
        };
        var.set(&values.to_dtype(var.dtype())?)?;
    }
    Ok(())
}

/// Writes a freshly initialized checkpoint of `config` into `dir`, in
/// Hugging Face's layout and, as Hub checkpoints are, in bf16, with `tokenizer`
/// as its `tokenizer.json`.
pub fn write_tiny_checkpoint(
    dir: &Path,
    config: &Config,
    tokenizer: &tokenizers::Tokenizer,
    rng: &mut Rng,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| file_error(dir, e))?;
    let varmap = VarMap::new();
    ModelForCausalLM::new(
        config,
        VarBuilder::from_varmap(&varmap, DType::BF16, &Device::Cpu),
    )?;
    init_weights(&varmap, config.num_hidden_layers, rng)?;
    let path = dir.join(TOKENIZER_FILE);
    tokenizer
        .save(&path, false)
        .map_err(|e| file_error(&path, e))?;
    save(dir, config, &varmap, &path)
}

/// The tensors of a safetensors file, by name (for tests and checks).
pub fn read_tensors(path: &Path) -> Result<HashMap<String, Tensor>> {
    candle_core::safetensors::load(path, &Device::Cpu)
}

/// Token ids split as [`Corpus`] splits characters: every tenth piece of
/// 1000 tokens (of a tenth of the tokens, for fewer than 10 000) held out.
/// The corpus's `vocab` stays empty: the tokenizer is the vocabulary.
pub fn split(tokens: &[u32]) -> Corpus {
    Corpus::split(tokens, Vec::new())
}
