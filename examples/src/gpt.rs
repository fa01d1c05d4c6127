//! A small GPT-2 style language model: token and position embeddings, `N`
//! transformer blocks written with `remat!`, a final layer norm and a linear
//! head. The block leaves every statement to the plan, so one model runs
//! under any checkpointing policy chosen at run time ([`Checkpointing`]).
//!
//! Two versions of the same blocks ([`Ops`]): remat's differentiable fused
//! ops ([`remat_runtime::nn`]: layer norm, linear, memory-efficient
//! attention, cross-entropy; the default), or candle's composed ops
//! (`candle_nn::ops::layer_norm_slow`, `ops::softmax`, matmuls), kept for
//! comparison. candle's own fused `candle_nn::LayerNorm` (on contiguous
//! inputs), `ops::layer_norm`, `ops::rms_norm` and `ops::softmax_last_dim`
//! have no backward in candle 0.11: gradients stop there silently.
//! [`remat_runtime::check_gradients`] finds the parameters that got none.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device, Result, Tensor, Var, D};
use remat_runtime::{nn, remat, Plan};

use crate::rng::Rng;

/// The model's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Config {
    /// Vocabulary size.
    pub vocab: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads (must divide `d_model`).
    pub heads: usize,
    /// Context length.
    pub seq: usize,
}

/// `x W + b` over the last dimension; `w` is `(in, out)`.
#[derive(Clone)]
pub struct Linear {
    /// Weight, `(in, out)`.
    pub w: Var,
    /// Bias, `(out)`.
    pub b: Var,
}

impl Linear {
    fn new(i: usize, o: usize, std: f64, rng: &mut Rng, dev: &Device) -> Result<Self> {
        Ok(Linear {
            w: Var::from_vec(rng.normal(i * o, std), (i, o), dev)?,
            b: Var::zeros(o, DType::F32, dev)?,
        })
    }

    /// Applies the layer to `(.., in)`, as one matrix product.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let i = dims[dims.len() - 1];
        let rows = x.elem_count() / i;
        let y = x
            .reshape((rows, i))?
            .matmul(&self.w)?
            .broadcast_add(&self.b)?;
        let mut out = dims;
        *out.last_mut().expect("rank >= 1") = self.w.dim(1)?;
        y.reshape(out)
    }

    /// `self.forward(layer_norm(x, n))` as one op
    /// ([`nn::layer_norm_linear`], which takes candle-nn's `(out, in)`
    /// weight: the transpose is a view; the graph keeps `x` and the norm's
    /// statistics, not the normalized input).
    pub fn after_norm(&self, x: &Tensor, n: &Norm) -> Result<Tensor> {
        nn::layer_norm_linear(x, &n.g, &n.b, 1e-5, &self.w.t()?, Some(&self.b))
    }

    /// `residual + self.forward(x)` as one op ([`nn::linear_add`]: the graph
    /// does not keep the product).
    pub fn fused_add(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        nn::linear_add(x, &self.w.t()?, Some(&self.b), residual)
    }

    /// `residual + self.forward(gelu(x))` as one op
    /// ([`nn::gelu_linear_add`]: the graph keeps neither `gelu(x)` nor the
    /// product; the backward recomputes `gelu(x)`).
    pub fn gelu_fused_add(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        nn::gelu_linear_add(x, &self.w.t()?, Some(&self.b), residual)
    }
}

/// Layer norm parameters.
#[derive(Clone)]
pub struct Norm {
    /// Gain.
    pub g: Var,
    /// Bias.
    pub b: Var,
}

impl Norm {
    fn new(c: usize, dev: &Device) -> Result<Self> {
        Ok(Norm {
            g: Var::ones(c, DType::F32, dev)?,
            b: Var::zeros(c, DType::F32, dev)?,
        })
    }
}

/// Layer norm over the last dimension, through candle's composed ops.
pub fn layer_norm(x: &Tensor, n: &Norm) -> Result<Tensor> {
    candle_nn::ops::layer_norm_slow(x, &n.g, &n.b, 1e-5)
}

/// Which ops the blocks are written with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ops {
    /// [`remat_runtime::nn`]'s differentiable fused ops, a sublayer per op
    /// ([`block`]).
    Fused,
    /// [`remat_runtime::nn`]'s differentiable fused ops, a layer per op
    /// ([`block_layers`]).
    Layers,
    /// candle's composed ops (`layer_norm_slow`, `softmax`, matmuls).
    Composed,
}

impl fmt::Display for Ops {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ops::Fused => "fused",
            Ops::Layers => "layers",
            Ops::Composed => "composed",
        })
    }
}

impl FromStr for Ops {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "fused" => Ok(Ops::Fused),
            "layers" => Ok(Ops::Layers),
            "composed" => Ok(Ops::Composed),
            other => Err(format!(
                "unknown ops `{other}`: expected fused, layers or composed"
            )),
        }
    }
}

/// The parameters of one block.
#[derive(Clone)]
pub struct BlockParams {
    /// Norm before attention.
    pub ln1: Norm,
    /// Query, key, value projection `(C, 3C)`.
    pub attn: Linear,
    /// Attention output projection `(C, C)`.
    pub proj: Linear,
    /// Norm before the MLP.
    pub ln2: Norm,
    /// MLP expansion `(C, 4C)`.
    pub fc: Linear,
    /// MLP contraction `(4C, C)`.
    pub out: Linear,
    /// Attention heads.
    pub heads: usize,
}

impl BlockParams {
    /// The attention from the block's input, before its output projection:
    /// the first norm, the query-key-value projection and causal attention
    /// as one op ([`nn::qkv_attention`]: the graph keeps `x`; the op keeps
    /// the projection and releases it in its backward).
    pub fn attention(&self, x: &Tensor) -> Result<Tensor> {
        let ln = nn::PreNorm::Layer {
            gain: &self.ln1.g,
            bias: &self.ln1.b,
            eps: 1e-5,
        };
        let qkv = &self.attn;
        nn::qkv_attention(
            x,
            Some(ln),
            &qkv.w.t()?,
            Some(&qkv.b),
            self.heads,
            true,
            None,
        )
    }

    /// `x + gelu(ln2(x) W1 + b1) W2 + b2`, the second norm, the MLP and its
    /// residual add as one op ([`nn::gelu_mlp`]: the graph keeps `x`; the
    /// op keeps `ln2(x) W1 + b1` and releases it in its backward).
    pub fn mlp(&self, x: &Tensor) -> Result<Tensor> {
        let ln = nn::PreNorm::Layer {
            gain: &self.ln2.g,
            bias: &self.ln2.b,
            eps: 1e-5,
        };
        let (fc, out) = (&self.fc, &self.out);
        nn::gelu_mlp(
            x,
            Some(ln),
            &fc.w.t()?,
            Some(&fc.b),
            &out.w.t()?,
            Some(&out.b),
            Some(x),
        )
    }
}

/// `(B, T, 3C)` into queries, keys and values of shape `(B, H, T, C/H)`.
pub fn split_heads(qkv: &Tensor, heads: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, c3) = qkv.dims3()?;
    let c = c3 / 3;
    let part = |i: usize| {
        qkv.narrow(2, i * c, c)?
            .reshape((b, t, heads, c / heads))?
            .transpose(1, 2)?
            .contiguous()
    };
    Ok((part(0)?, part(1)?, part(2)?))
}

/// `(B, H, T, D)` back to `(B, T, H*D)`.
pub fn merge_heads(y: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = y.dims4()?;
    y.transpose(1, 2)?.reshape((b, t, h * d))
}

/// Scaled attention scores with the causal mask added.
pub fn scores(q: &Tensor, k: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let d = q.dim(D::Minus1)?;
    (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?.broadcast_add(mask)
}

remat! {
    /// [`block`] with candle's composed ops (the attention core is three
    /// statements: `scores`, `probs`, `att`).
    pub fn block_composed(x: &Tensor, p: &BlockParams, mask: &Tensor) -> Result<Tensor> {
        let ln1 = layer_norm(x, &p.ln1)?;
        let qkv = p.attn.forward(&ln1)?;
        let (q, k, v) = split_heads(&qkv, p.heads)?;
        let scores = scores(&q, &k, mask)?;
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let att = merge_heads(&probs.matmul(&v)?)?;
        let proj = p.proj.forward(&att)?;
        let x = (x + proj)?;
        let ln2 = layer_norm(&x, &p.ln2)?;
        let fc = p.fc.forward(&ln2)?;
        let act = fc.gelu()?;
        let mlp = p.out.forward(&act)?;
        Ok((x + mlp)?)
    }
}

remat! {
    /// [`block`] with [`remat_runtime::nn`]'s ops a layer at a time: the
    /// graph holds the `(B, T, 3C)` projection and the MLP's `(B, T, 4C)`
    /// hidden until the backward returns.
    pub fn block_layers(x: &Tensor, p: &BlockParams) -> Result<Tensor> {
        // The first norm and the query-key-value projection.
        let qkv = p.attn.after_norm(x, &p.ln1)?;
        let att = nn::attention_qkv(&qkv, p.heads, true, None)?;
        // The residual stream after the attention: `x + att W + b`.
        let proj = p.proj.fused_add(&att, x)?;
        // The second norm and the MLP's expansion.
        let fc = p.fc.after_norm(&proj, &p.ln2)?;
        // The block's output: `proj + gelu(fc) W + b`.
        let mlp = p.out.gelu_fused_add(&fc, &proj)?;
        Ok(mlp)
    }
}

remat! {
    /// One pre-norm transformer block with [`remat_runtime::nn`]'s ops. No
    /// statement is annotated: the plan decides, by the names below, what
    /// is saved.
    pub fn block(x: &Tensor, p: &BlockParams) -> Result<Tensor> {
        // The first norm, the query-key-value projection and the attention.
        let att = p.attention(x)?;
        // The residual stream after the attention: `x + att W + b`.
        let proj = p.proj.fused_add(&att, x)?;
        // The second norm, the MLP and its residual add.
        let mlp = p.mlp(&proj)?;
        Ok(mlp)
    }
}

remat! {
    /// Token plus position embedding.
    pub fn embed(ids: &Tensor, wte: &Var, wpe: &Var) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let tok = wte.as_tensor().index_select(&ids.flatten_all()?, 0)?.reshape((b, t, ()))?;
        let x = tok.broadcast_add(&wpe.as_tensor().narrow(0, 0, t)?)?;
        Ok(x)
    }

    /// [`head_loss`] with candle's composed ops.
    pub fn head_loss_composed(x: &Tensor, ln_f: &Norm, head: &Linear, targets: &Tensor) -> Result<Tensor> {
        let h = layer_norm(x, ln_f)?;
        let logits = head.forward(&h)?.to_dtype(DType::F32)?;
        let loss = candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &targets.flatten_all()?)?;
        Ok(loss)
    }

    /// Final norm, output head and mean cross-entropy, with
    /// [`remat_runtime::nn`]'s ops.
    pub fn head_loss(x: &Tensor, ln_f: &Norm, head: &Linear, targets: &Tensor) -> Result<Tensor> {
        let logits = head.after_norm(x, ln_f)?.to_dtype(DType::F32)?;
        let loss = nn::cross_entropy(&logits.flatten_to(1)?, &targets.flatten_all()?)?;
        Ok(loss)
    }
}

/// The statements the selective policy saves: the wide linear layers of a
/// block (`qkv` and `fc`, each with the norm before it, and `mlp`, which
/// holds the MLP's GELU). The attention core and the `C x C` projection
/// (`proj`) are recomputed, close to Megatron-LM's selective
/// recomputation. Saving `proj` too would cost more bytes than it saves
/// time: a saved statement keeps a copy of each recomputed value it reads
/// (`att`, and `proj`'s output for `mlp`'s residual add), about 3 MiB per
/// block on the bench's shape for one `C x C` matrix product. Saving the
/// attention matmuls too (PyTorch's "save every matmul") would keep the
/// `(B, H, T, T)` scores.
pub const SELECTIVE: &[&str] = &["att", "mlp"];

/// How the blocks are checkpointed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Checkpointing {
    /// Plain candle: no regions.
    None,
    /// Every statement recomputed.
    Full,
    /// The statements in [`SELECTIVE`] saved, the rest recomputed.
    Selective,
    /// The statements in [`SELECTIVE`] offloaded to host memory (on a GPU;
    /// saved on a CPU), the rest recomputed.
    Offload,
    /// Every statement saved (the tape without recomputation).
    SaveAll,
    /// The budget planner, between full (0) and save-all (1).
    Budget(f64),
}

impl Checkpointing {
    /// The plan that implements this policy.
    pub fn plan(self) -> Plan {
        match self {
            Checkpointing::None => Plan::off(),
            Checkpointing::Full => Plan::recompute_all(),
            Checkpointing::Selective => Plan::save_only(SELECTIVE.iter().copied()),
            Checkpointing::Offload => {
                Plan::save_and_offload_only(Vec::<&str>::new(), SELECTIVE.iter().copied())
            }
            Checkpointing::SaveAll => Plan::save_all(),
            Checkpointing::Budget(f) => Plan::budget(f),
        }
    }
}

impl fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpointing::None => f.write_str("none"),
            Checkpointing::Full => f.write_str("full"),
            Checkpointing::Selective => f.write_str("selective"),
            Checkpointing::Offload => f.write_str("offload"),
            Checkpointing::SaveAll => f.write_str("save-all"),
            Checkpointing::Budget(x) => write!(f, "budget={x}"),
        }
    }
}

impl FromStr for Checkpointing {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(Checkpointing::None),
            "full" => Ok(Checkpointing::Full),
            "selective" => Ok(Checkpointing::Selective),
            "offload" => Ok(Checkpointing::Offload),
            "save-all" => Ok(Checkpointing::SaveAll),
            other => match other.strip_prefix("budget=").map(str::parse::<f64>) {
                Some(Ok(x)) if (0.0..=1.0).contains(&x) => Ok(Checkpointing::Budget(x)),
                _ => Err(format!(
                    "unknown policy `{other}`: expected none, full, selective, offload, save-all \
                     or budget=<fraction between 0 and 1>"
                )),
            },
        }
    }
}

/// The whole model.
#[derive(Clone)]
pub struct Gpt {
    /// Its shape.
    pub config: Config,
    /// Token embedding `(V, C)`.
    pub wte: Var,
    /// Position embedding `(T, C)`.
    pub wpe: Var,
    /// The blocks.
    pub blocks: Vec<BlockParams>,
    /// Final norm.
    pub ln_f: Norm,
    /// Output head `(C, V)`.
    pub head: Linear,
    /// Which ops the blocks run ([`Ops::Fused`] unless changed).
    pub ops: Ops,
}

/// `(t, t)` additive causal mask: 0 on and below the diagonal, -inf above.
pub fn causal_mask(t: usize, dev: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(v, (t, t), dev)
}

impl Gpt {
    /// A model with GPT-2's initialisation (normal, std 0.02; residual
    /// projections scaled by `1/sqrt(2 layers)`), drawn from `rng`.
    pub fn new(config: Config, rng: &mut Rng, dev: &Device) -> Result<Self> {
        let Config {
            vocab,
            layers,
            d_model: c,
            heads,
            seq,
        } = config;
        if heads == 0 || c % heads != 0 {
            candle_core::bail!("--heads {heads} must divide --d-model {c}");
        }
        let std = 0.02;
        let resid = std / (2.0 * layers as f64).sqrt();
        let blocks = (0..layers)
            .map(|_| {
                Ok(BlockParams {
                    ln1: Norm::new(c, dev)?,
                    attn: Linear::new(c, 3 * c, std, rng, dev)?,
                    proj: Linear::new(c, c, resid, rng, dev)?,
                    ln2: Norm::new(c, dev)?,
                    fc: Linear::new(c, 4 * c, std, rng, dev)?,
                    out: Linear::new(4 * c, c, resid, rng, dev)?,
                    heads,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Gpt {
            config,
            wte: Var::from_vec(rng.normal(vocab * c, std), (vocab, c), dev)?,
            wpe: Var::from_vec(rng.normal(seq * c, std), (seq, c), dev)?,
            blocks,
            ln_f: Norm::new(c, dev)?,
            head: Linear::new(c, vocab, std, rng, dev)?,
            ops: Ops::Fused,
        })
    }

    /// The same model with every parameter converted to `dtype` (new
    /// `Var`s): a bf16 or f16 model; its loss is still computed in f32.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let var = |v: &Var| Var::from_tensor(&v.as_tensor().to_dtype(dtype)?);
        let lin = |l: &Linear| -> Result<Linear> {
            Ok(Linear {
                w: var(&l.w)?,
                b: var(&l.b)?,
            })
        };
        let norm = |n: &Norm| -> Result<Norm> {
            Ok(Norm {
                g: var(&n.g)?,
                b: var(&n.b)?,
            })
        };
        let blocks = self
            .blocks
            .iter()
            .map(|b| {
                Ok(BlockParams {
                    ln1: norm(&b.ln1)?,
                    attn: lin(&b.attn)?,
                    proj: lin(&b.proj)?,
                    ln2: norm(&b.ln2)?,
                    fc: lin(&b.fc)?,
                    out: lin(&b.out)?,
                    heads: b.heads,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Gpt {
            config: self.config,
            wte: var(&self.wte)?,
            wpe: var(&self.wpe)?,
            blocks,
            ln_f: norm(&self.ln_f)?,
            head: lin(&self.head)?,
            ops: self.ops,
        })
    }

    /// Every parameter with a stable, dotted name (`h.0.attn.w`), in a fixed
    /// order.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let mut v = vec![
            ("wte".to_string(), self.wte.clone()),
            ("wpe".to_string(), self.wpe.clone()),
        ];
        let lin = |v: &mut Vec<(String, Var)>, name: String, l: &Linear| {
            v.push((format!("{name}.w"), l.w.clone()));
            v.push((format!("{name}.b"), l.b.clone()));
        };
        let norm = |v: &mut Vec<(String, Var)>, name: String, n: &Norm| {
            v.push((format!("{name}.g"), n.g.clone()));
            v.push((format!("{name}.b"), n.b.clone()));
        };
        for (i, b) in self.blocks.iter().enumerate() {
            norm(&mut v, format!("h.{i}.ln1"), &b.ln1);
            lin(&mut v, format!("h.{i}.attn"), &b.attn);
            lin(&mut v, format!("h.{i}.proj"), &b.proj);
            norm(&mut v, format!("h.{i}.ln2"), &b.ln2);
            lin(&mut v, format!("h.{i}.fc"), &b.fc);
            lin(&mut v, format!("h.{i}.out"), &b.out);
        }
        norm(&mut v, "ln_f".to_string(), &self.ln_f);
        lin(&mut v, "head".to_string(), &self.head);
        v
    }

    /// The parameters, for an optimizer.
    pub fn vars(&self) -> Vec<Var> {
        self.named_vars().into_iter().map(|(_, v)| v).collect()
    }

    /// The number of scalar parameters.
    pub fn parameter_count(&self) -> usize {
        self.vars().iter().map(|v| v.elem_count()).sum()
    }

    /// The residual stream after the blocks, `(B, T, C)`.
    fn trunk(&self, ids: &Tensor) -> Result<Tensor> {
        let mut x = embed(ids, &self.wte, &self.wpe)?;
        match self.ops {
            Ops::Fused => {
                for p in &self.blocks {
                    x = block(&x, p)?;
                }
            }
            Ops::Layers => {
                for p in &self.blocks {
                    x = block_layers(&x, p)?;
                }
            }
            Ops::Composed => {
                let mask = causal_mask(ids.dim(1)?, ids.device())?.to_dtype(self.wte.dtype())?;
                for p in &self.blocks {
                    x = block_composed(&x, p, &mask)?;
                }
            }
        }
        Ok(x)
    }

    /// Logits `(B, T, V)` for token ids `(B, T)` (`T <= seq`), the head as
    /// plain candle code (for sampling).
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.head
            .forward(&layer_norm(&self.trunk(ids)?, &self.ln_f)?)
    }

    /// Mean cross-entropy (nats per token) of predicting `targets` from
    /// `ids`. Embedding, blocks and head all run as `remat!` regions under the
    /// current [`Plan`]: under full recomputation only the regions' inputs
    /// stay alive between forward and backward.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let x = self.trunk(ids)?;
        match self.ops {
            Ops::Fused | Ops::Layers => head_loss(&x, &self.ln_f, &self.head, targets),
            Ops::Composed => head_loss_composed(&x, &self.ln_f, &self.head, targets),
        }
    }

    /// Samples `n` tokens after `prompt` (temperature `temp`), without
    /// checkpointing and without a key-value cache (a short demo).
    pub fn sample(&self, prompt: &[u32], n: usize, temp: f64, rng: &mut Rng) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            candle_core::bail!("sampling needs a prompt of at least one token");
        }
        let dev = self.wte.device().clone();
        let mut tokens = prompt.to_vec();
        Plan::off().scope(|| {
            for _ in 0..n {
                let start = tokens.len().saturating_sub(self.config.seq);
                let ctx = Tensor::new(&tokens[start..], &dev)?.unsqueeze(0)?;
                let logits = self.forward(&ctx)?.detach();
                let last = logits
                    .get(0)?
                    .get(tokens.len() - start - 1)?
                    .to_dtype(DType::F32)?;
                let probs = candle_nn::ops::softmax(&(last / temp)?, 0)?.to_vec1::<f32>()?;
                let u = rng.uniform() as f32;
                let mut acc = 0.0;
                let next = probs
                    .iter()
                    .position(|&p| {
                        acc += p;
                        acc > u
                    })
                    .unwrap_or(probs.len() - 1);
                tokens.push(next as u32);
            }
            Ok(tokens[prompt.len()..].to_vec())
        })
    }
}
