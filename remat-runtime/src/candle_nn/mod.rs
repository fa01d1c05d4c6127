//! Drop-in replacements for candle-nn's fused ops that have no backward:
//! the same names, the same signatures, and a backward.
//!
//! In candle 0.11, `candle_nn::ops::{rms_norm, layer_norm,
//! softmax_last_dim}`, `candle_nn::rotary_emb::{rope, rope_i, rope_thd}`,
//! and `candle_nn::RmsNorm` / `LayerNorm` (which call the fused norms on
//! contiguous inputs) have no backward: a model written with them, as
//! candle-transformers' models are, trains only the parameters after the
//! last of them (often only `lm_head`), silently. Switching a model file's
//! `use` lines to this module makes it train:
//!
//! ```text
//! use candle_nn::{ops, rotary_emb, rms_norm, RmsNorm};             // before
//! use remat_runtime::candle_nn::{ops, rotary_emb, rms_norm, RmsNorm}; // after
//! ```
//!
//! (`candle_nn::{Linear, Embedding, VarBuilder, Activation, ...}` stay:
//! they have a backward.) Each op here is the [`crate::nn`] op of the same
//! name, which keeps only what its backward needs (see that module's
//! table): the norms keep one or two numbers per row, softmax its output,
//! the rotations nothing but their tables. They work inside and outside
//! `remat!` blocks.
//!
//! [`AdamW`] is candle-nn's optimizer with the same arithmetic (the same
//! bits) and a step that updates each parameter a block of rows at a time:
//! candle-nn's holds up to fifteen temporaries the size of each parameter,
//! which for a real vocabulary's embedding outweighs the rest of the step.
//! [`MasterWeights`] wraps any candle-nn optimizer to train `bf16` or `f16`
//! parameters from `f32` master weights (not in candle-nn). [`BatchNorm`]
//! is candle-nn's, whose running statistics a replay would update a second
//! time in each step; this one updates them once.
//!
//! What a drop-in computes, against candle's fused op:
//!
//! * **values**: softmax and the rotations run candle's own fused kernels,
//!   so their outputs are candle's, bit for bit. The norms compute the same
//!   formulas in another order: within a few units in the last place in
//!   f32, within two in bf16 and f16 (in f64, which candle's fused norms
//!   refuse, they match its composed `*_slow` versions to rounding).
//! * **dtypes**: in bf16 and f16 the norms compute in f32 and round once,
//!   as candle's kernels and its composed `*_slow` versions compute their
//!   statistics in f32 (the graph keeps the bf16 input and f32 row
//!   statistics). f64 works too (candle's fused norms refuse it).
//! * **layouts**: any layout is accepted (candle's fused ops refuse
//!   non-contiguous inputs); [`rotary_emb::rope_thd`] returns a contiguous
//!   tensor as candle's does.
//! * **errors**: a shape or dtype that does not fit is an error naming the
//!   op and the shapes, as candle's.
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor, Var};
//! use candle_nn::{VarBuilder, VarMap};
//! use remat_runtime::candle_nn::{ops, rms_norm};
//!
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let norm = rms_norm(4, 1e-6, vb.pp("norm"))?; // a Var named "norm.weight"
//! let x = Var::randn(0f32, 1.0, (2, 3, 4), &Device::Cpu)?;
//! let y = ops::softmax_last_dim(&norm.forward(&x)?)?;
//! let grads = y.sqr()?.sum_all()?.backward()?;
//! // candle_nn's RmsNorm and softmax_last_dim would give neither gradient.
//! assert!(grads.get(&x).is_some());
//! assert!(grads.get(&varmap.all_vars()[0]).is_some());
//! # Ok::<(), candle_core::Error>(())
//! ```

mod adamw;
mod batch_norm;
pub mod layer_norm;
mod master_weights;
pub mod ops;
pub mod rotary_emb;

pub use adamw::AdamW;
pub use batch_norm::{batch_norm, BatchNorm};
pub use layer_norm::{
    layer_norm, layer_norm_no_bias, rms_norm, LayerNorm, LayerNormConfig, RmsNorm,
};
pub use master_weights::MasterWeights;
