// A small decoder written as candle-transformers writes its models (the
// structure and names of its qwen2.rs, Qwen3's per-head query and key
// norms, a BERT-style layer norm of the embeddings), with every op this
// crate replaces. `dropin.rs` includes this file three times, under three
// sets of `use` lines for `ops`, `rotary_emb`, `rms_norm`, `layer_norm`,
// `RmsNorm` and `LayerNorm`: candle-nn's, remat's drop-ins, and candle's
// composed `*_slow` versions. Nothing else differs.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{embedding, linear, linear_no_bias, Embedding, Linear, VarBuilder};

#[derive(Debug, Clone)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
}

#[derive(Debug, Clone)]
struct RotaryEmbedding {
    sin: Tensor,
    cos: Tensor,
}

impl RotaryEmbedding {
    fn new(dtype: DType, cfg: &Config, dev: &Device) -> Result<Self> {
        let dim = cfg.hidden_size / cfg.num_attention_heads;
        let max_seq_len = cfg.max_position_embeddings;
        let inv_freq: Vec<_> = (0..dim)
            .step_by(2)
            .map(|i| 1f32 / cfg.rope_theta.powf(i as f64 / dim as f64) as f32)
            .collect();
        let inv_freq_len = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq, (1, inv_freq_len), dev)?.to_dtype(dtype)?;
        let t = Tensor::arange(0u32, max_seq_len as u32, dev)?
            .to_dtype(dtype)?
            .reshape((max_seq_len, 1))?;
        let freqs = t.matmul(&inv_freq)?;
        Ok(Self {
            sin: freqs.sin()?,
            cos: freqs.cos()?,
        })
    }

    /// Layer `layer_idx` rotates with `rope`, `rope_i` or `rope_thd` in turn.
    fn apply_rotary_emb_qkv(
        &self,
        q: &Tensor,
        k: &Tensor,
        layer_idx: usize,
    ) -> Result<(Tensor, Tensor)> {
        let (_b_sz, _h, seq_len, _n_embd) = q.dims4()?;
        let cos = self.cos.narrow(0, 0, seq_len)?;
        let sin = self.sin.narrow(0, 0, seq_len)?;
        let rotate = |x: &Tensor| match layer_idx % 3 {
            0 => rotary_emb::rope(&x.contiguous()?, &cos, &sin),
            1 => rotary_emb::rope_i(&x.contiguous()?, &cos, &sin),
            _ => rotary_emb::rope_thd(&x.transpose(1, 2)?.contiguous()?, &cos, &sin)?
                .transpose(1, 2)?
                .contiguous(),
        };
        Ok((rotate(q)?, rotate(k)?))
    }
}

#[derive(Debug, Clone)]
#[allow(clippy::upper_case_acronyms)]
struct MLP {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl MLP {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_proj: linear_no_bias(h, i, vb.pp("gate_proj"))?,
            up_proj: linear_no_bias(h, i, vb.pp("up_proj"))?,
            down_proj: linear_no_bias(i, h, vb.pp("down_proj"))?,
        })
    }
}

impl Module for MLP {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let lhs = xs.apply(&self.gate_proj)?.silu()?;
        let rhs = xs.apply(&self.up_proj)?;
        (lhs * rhs)?.apply(&self.down_proj)
    }
}

#[derive(Debug, Clone)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    num_heads: usize,
    head_dim: usize,
    hidden_size: usize,
    rotary_emb: RotaryEmbedding,
    layer_idx: usize,
}

impl Attention {
    fn new(
        rotary_emb: RotaryEmbedding,
        cfg: &Config,
        layer_idx: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        let hidden_sz = cfg.hidden_size;
        let num_heads = cfg.num_attention_heads;
        let head_dim = hidden_sz / num_heads;
        Ok(Self {
            q_proj: linear(hidden_sz, hidden_sz, vb.pp("q_proj"))?,
            k_proj: linear(hidden_sz, hidden_sz, vb.pp("k_proj"))?,
            v_proj: linear(hidden_sz, hidden_sz, vb.pp("v_proj"))?,
            o_proj: linear_no_bias(hidden_sz, hidden_sz, vb.pp("o_proj"))?,
            q_norm: rms_norm(head_dim, cfg.rms_norm_eps, vb.pp("q_norm"))?,
            k_norm: rms_norm(head_dim, cfg.rms_norm_eps, vb.pp("k_norm"))?,
            num_heads,
            head_dim,
            hidden_size: hidden_sz,
            rotary_emb,
            layer_idx,
        })
    }

    fn forward(&self, xs: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        let (b_sz, q_len, _) = xs.dims3()?;
        let heads = |x: Tensor| {
            x.reshape((b_sz, q_len, self.num_heads, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let query_states = self.q_norm.forward(&heads(self.q_proj.forward(xs)?)?)?;
        let key_states = self.k_norm.forward(&heads(self.k_proj.forward(xs)?)?)?;
        let value_states = heads(self.v_proj.forward(xs)?)?;
        let (query_states, key_states) =
            self.rotary_emb
                .apply_rotary_emb_qkv(&query_states, &key_states, self.layer_idx)?;
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
            .reshape((b_sz, q_len, self.hidden_size))?
            .apply(&self.o_proj)
    }
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    self_attn: Attention,
    mlp: MLP,
    input_layernorm: RmsNorm,
    post_attention_layernorm: LayerNorm,
}

impl DecoderLayer {
    fn new(
        rotary_emb: RotaryEmbedding,
        cfg: &Config,
        layer_idx: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            self_attn: Attention::new(rotary_emb, cfg, layer_idx, vb.pp("self_attn"))?,
            mlp: MLP::new(cfg, vb.pp("mlp"))?,
            input_layernorm: rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("input_layernorm"))?,
            post_attention_layernorm: layer_norm(
                cfg.hidden_size,
                1e-5,
                vb.pp("post_attention_layernorm"),
            )?,
        })
    }

    fn forward(&self, xs: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        let residual = xs;
        let xs = self.input_layernorm.forward(xs)?;
        let xs = self.self_attn.forward(&xs, attention_mask)?;
        let xs = (xs + residual)?;
        let residual = &xs;
        let xs = xs.apply(&self.post_attention_layernorm)?.apply(&self.mlp)?;
        residual + xs
    }
}

#[derive(Debug, Clone)]
pub struct Model {
    embed_tokens: Embedding,
    embed_norm_weight: Tensor,
    embed_norm_bias: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
}

impl Model {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let vb_m = vb.pp("model");
        let rotary_emb = RotaryEmbedding::new(vb.dtype(), cfg, vb.device())?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::new(rotary_emb.clone(), cfg, i, vb_m.pp("layers").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embed_tokens: embedding(cfg.vocab_size, cfg.hidden_size, vb_m.pp("embed_tokens"))?,
            embed_norm_weight: vb_m.pp("embed_norm").get(cfg.hidden_size, "weight")?,
            embed_norm_bias: vb_m.pp("embed_norm").get(cfg.hidden_size, "bias")?,
            layers,
            norm: rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb_m.pp("norm"))?,
            lm_head: linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?,
        })
    }

    /// Logits `(B, T, vocab)` of token ids `(B, T)`, causally masked.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_, seq_len) = input_ids.dims2()?;
        let mask: Vec<f32> = (0..seq_len)
            .flat_map(|i| (0..seq_len).map(move |j| if j > i { f32::NEG_INFINITY } else { 0. }))
            .collect();
        let mask = Tensor::from_slice(&mask, (seq_len, seq_len), input_ids.device())?
            .to_dtype(self.embed_norm_weight.dtype())?;
        let xs = self.embed_tokens.forward(input_ids)?;
        let mut xs = ops::layer_norm(&xs, &self.embed_norm_weight, &self.embed_norm_bias, 1e-5)?;
        for layer in self.layers.iter() {
            xs = layer.forward(&xs, Some(&mask))?
        }
        let xs = ops::rms_norm(&xs, self.norm.weight(), self.norm.eps() as f32)?;
        xs.apply(&self.lm_head)
    }

    /// The mean cross-entropy of predicting `targets` `(B, T)`.
    pub fn loss(&self, input_ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = self.forward(input_ids)?;
        candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &targets.flatten_all()?)
    }
}
