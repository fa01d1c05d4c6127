//! The models and data the example programs share: a small GPT-2 style
//! language model whose blocks are `remat!` regions, a Qwen2 decoder in
//! candle-transformers' style that fine-tunes Hugging Face checkpoints, a
//! character-level corpus, the training loop's pieces, a seeded random
//! number generator, and the `--dump` writer.

pub mod cli;
pub mod curves;
pub mod data;
pub mod dump;
pub mod gpt;
pub mod peak;
pub mod profile;
pub mod qwen2;
pub mod rng;
pub mod soak;
pub mod train;
