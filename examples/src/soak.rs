//! Many training steps in a row, measuring the bytes live after each: a
//! checkpointing runtime that leaks a tape, a seed or a cache per step shows
//! here as a rising line.

use candle_core::{Device, Result};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use remat_runtime::inspect::CountingAlloc;

use crate::data::Corpus;
use crate::gpt::{Checkpointing, Config, Gpt};
use crate::rng::Rng;

/// The model and batch shape of a soak run.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Transformer blocks.
    pub layers: usize,
    /// Residual width.
    pub d_model: usize,
    /// Heads.
    pub heads: usize,
    /// Context.
    pub seq: usize,
    /// Batch.
    pub batch: usize,
}

/// Trains a fresh model for `steps` steps under `policy` and returns the
/// bytes `alloc` counts live after each step (batch, loss and gradients
/// dropped; weights and optimizer state kept).
pub fn soak(
    corpus: &Corpus,
    shape: Shape,
    policy: Checkpointing,
    steps: usize,
    alloc: &CountingAlloc,
) -> Result<Vec<usize>> {
    let dev = Device::Cpu;
    let config = Config {
        vocab: corpus.vocab_size(),
        layers: shape.layers,
        d_model: shape.d_model,
        heads: shape.heads,
        seq: shape.seq,
    };
    let mut rng = Rng::new(1);
    let model = Gpt::new(config, &mut rng, &dev)?;
    let mut opt = AdamW::new(
        model.vars(),
        ParamsAdamW {
            lr: 1e-3,
            ..Default::default()
        },
    )?;
    let plan = policy.plan();
    let mut live = Vec::with_capacity(steps);
    for _ in 0..steps {
        {
            let (x, y) = Corpus::batch(&corpus.train, shape.batch, shape.seq, &mut rng, &dev)?;
            let loss = plan.scope(|| model.loss(&x, &y))?;
            let grads = loss.backward()?;
            opt.step(&grads)?;
        }
        live.push(alloc.live());
    }
    Ok(live)
}
