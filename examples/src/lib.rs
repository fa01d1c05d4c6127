//! The models and data the example programs share: a small GPT-2 style
//! language model whose blocks are `remat!` regions, a LLaMA-style decoder
//! built with candle-nn's `VarBuilder`, a character-level corpus, the
//! training loop's pieces, a seeded random number generator, and the
//! `--dump` writer.

pub mod cli;
pub mod curves;
pub mod data;
pub mod dump;
pub mod gpt;
pub mod llama;
pub mod peak;
pub mod rng;
pub mod soak;
pub mod train;
