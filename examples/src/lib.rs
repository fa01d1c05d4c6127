//! The models and data the example programs share: a small GPT-2 style
//! language model whose blocks are `remat!` regions, a character-level corpus,
//! a seeded random number generator, and the `--dump` writer.

pub mod cli;
pub mod data;
pub mod dump;
pub mod gpt;
pub mod peak;
pub mod rng;
pub mod soak;
pub mod train;
