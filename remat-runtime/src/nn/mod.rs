//! Differentiable fused ops with small residuals, usable inside and outside
//! `remat!` (a plain candle training loop gets their backward too).
//!
//! candle's graph keeps every input of every op until the backward, and its
//! fused ops (`ops::layer_norm`, `ops::rms_norm`, `softmax_last_dim`,
//! `rotary_emb::rope*`, `sdpa`) have no backward at all. Each op here is one
//! node of candle's graph (a `CustomOp`) whose forward runs outside the graph
//! and whose backward is written out, so the graph keeps only the op's
//! inputs and what its backward needs:
//!
//! | op | kept for the backward (besides its inputs) | candle's composed version keeps |
//! |---|---|---|
//! | [`linear`] | nothing | also the product before the bias |
//! | [`linear_add`] (`residual + x W^T + b`) | nothing | also the product, and the sum before the bias |
//! | [`gelu_linear_add`] (`residual + gelu(x) W^T + b`) | nothing (`gelu(x)` is recomputed) | also `gelu(x)` (four times the residual stream in a GPT MLP) and the product |
//! | [`gelu_mlp`] (`residual + gelu(n W1^T + b1) W2^T + b2`, `n` = [`PreNorm`] of `x` or `x`) | `n W1^T + b1`, released by its backward as soon as read; the norm's statistics (`n` is recomputed) | `x W1^T + b1`, `gelu` of it and the product, all held until the whole backward returns |
//! | [`swiglu_mlp`] (`residual + (silu(n Wg^T) * n Wu^T) Wd^T`) | `n Wg^T` and `n Wu^T`, released by its backward as soon as read; the norm's statistics | those two, `silu` of the gate and their product, all held until the whole backward returns |
//! | [`layer_norm`] | mean and 1/std per row | about eight full-size tensors |
//! | [`layer_norm_linear`] (`layer_norm(x) W^T + b`) | mean and 1/std per row (the normalized input is recomputed) | the norm's eight tensors, its output and the product |
//! | [`rms_norm`] | 1/rms per row | about five full-size tensors |
//! | [`softmax_last_dim`] | its output | (no backward in candle) |
//! | [`attention`] | output, one normalizer (1 / sum of exponentials) per row | scores and probabilities, `(B, H, T, T)` each |
//! | [`attention_qkv`] (over the packed `(B, T, 3C)` projection) | output, one normalizer (1 / sum of exponentials) per row | the same, and its backward builds a zero-padded `(B, T, 3C)` gradient for each of q, k, v |
//! | [`qkv_attention`] (`attention_qkv(n W^T + b)`) | the projection, released by its backward as soon as copied; one normalizer per row; the norm's statistics | the projection and its gradient's zero-padded copies, all held until the whole backward returns |
//! | [`cross_entropy`] | log-sum-exp per row | log-probabilities and more, `(N, V)` each |
//! | [`linear_cross_entropy`] (`cross_entropy(norm(x) W^T + b)`, chunk by chunk over the tokens) | the gradients of `x` and the parameters, computed in the forward; never a `(N, V)` tensor, at any time | the logits, the log-probabilities and more, `(N, V)` each, and their gradients |
//! | [`rope`], [`rope_i`] | nothing (the rotation's tables) | (no backward in candle) |
//! | [`swiglu`] | nothing | `silu(a)` and the sigmoid |
//! | [`dropout`] | nothing (the backward draws the mask again) | the mask and the scaled mask |
//! | [`gelu`] | nothing (its backward: one temporary, not eighteen) | nothing, but a backward that holds about eighteen input-sized temporaries |
//!
//! The forward of each runs candle's tensor ops (candle's fused kernels
//! where they exist), on any device; the result is copied once into the
//! node (candle's public API gives no way to hand it over).
//!
//! The backwards of [`linear`], [`linear_add`], [`gelu_linear_add`],
//! [`gelu_mlp`] and [`swiglu_mlp`] read their inputs, never their output:
//! in a region's replay, when such an op's output is the whole value of
//! the region's last recomputed statement and no later statement reads it,
//! it is not computed again (see "unread outputs" in `docs/semantics.md`).

mod activation;
mod attach;
mod attention;
mod bundle;
mod dropout;
mod gelu;
mod kernels;
mod linear;
mod linear_loss;
mod loss;
mod mlp;
mod norm;
mod norm_linear;
mod norm_pass;
mod prenorm;
mod product_sum;
mod qkv_attention;
mod rope;
mod softmax;
mod unchanged;

pub use activation::swiglu;
pub use attention::{attention, attention_qkv};
pub use dropout::dropout;
pub use gelu::gelu;
pub use linear::{gelu_linear_add, linear, linear_add};
pub use linear_loss::{linear_cross_entropy, LinearCrossEntropy};
pub use loss::cross_entropy;
pub use mlp::{gelu_mlp, swiglu_mlp};
pub use norm::{layer_norm, rms_norm};
pub use norm_linear::layer_norm_linear;
pub use prenorm::PreNorm;
pub use qkv_attention::qkv_attention;
pub use rope::{rope, rope_i};
pub use softmax::softmax_last_dim;

/// Whether `nn`'s ops run on remat's fused CUDA kernels where they have
/// them: [`attention`], [`attention_qkv`] and [`qkv_attention`]
/// (FlashAttention-2's way: no `(T, S)` tensor, the rows' statistics kept
/// for the backward; f32, f16 or bf16, head sizes up to 128, a mask that
/// needs no gradient) and the backward of the GELU in [`gelu`],
/// [`gelu_linear_add`] and [`gelu_mlp`] (one pass). On by default;
/// `cuda_kernels(false)` (or the environment variable
/// `REMAT_NN_KERNELS=0`) runs candle's kernels composed instead; no effect
/// on the CPU. A node's backward takes the path its forward took, so the
/// switch may change at any time.
///
/// ```
/// remat_runtime::nn::cuda_kernels(false);
/// remat_runtime::nn::cuda_kernels(true);
/// ```
pub fn cuda_kernels(on: bool) {
    kernels::use_kernels(on);
}
