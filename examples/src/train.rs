//! The training loop of `train_gpt`, as a library function so that the test
//! suite runs it too.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{Device, Result, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use indicatif::{ProgressBar, ProgressStyle};
use remat_runtime::inspect::CountingAlloc;
use remat_runtime::{check_gradients, MemoryReport};

use crate::data::Corpus;
use crate::gpt::{Checkpointing, Config, Gpt};
use crate::rng::Rng;

/// What to train and how.
#[derive(Debug, Clone)]
pub struct Options {
    /// Checkpointing of the blocks.
    pub policy: Checkpointing,
    /// Transformer blocks.
    pub layers: usize,
    /// Residual width.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Context length.
    pub seq: usize,
    /// Sequences per batch.
    pub batch: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// Seed of weights, batches and samples.
    pub seed: u64,
    /// Write the first step here (see [`crate::dump`]).
    pub dump: Option<PathBuf>,
    /// Characters to sample after training.
    pub sample: usize,
    /// Show a progress bar.
    pub progress: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            policy: Checkpointing::Selective,
            layers: 4,
            d_model: 128,
            heads: 4,
            seq: 64,
            batch: 16,
            steps: 400,
            lr: 2e-3,
            seed: 0,
            dump: None,
            sample: 300,
            progress: true,
        }
    }
}

/// What a training run found.
#[derive(Debug, Clone)]
pub struct Report {
    /// The model's shape.
    pub config: Config,
    /// Scalar parameters.
    pub parameters: usize,
    /// Training loss per step (nats per token).
    pub losses: Vec<f32>,
    /// Held-out loss before and after training.
    pub valid_before: f32,
    /// Held-out loss after training.
    pub valid_after: f32,
    /// The unigram entropy of the training text (nats).
    pub unigram: f64,
    /// The tapes after the first forward, by region and statement.
    pub first_report: MemoryReport,
    /// Bytes the allocator counted live after the first forward, above what
    /// was live before it (when a counting allocator was given).
    pub held_after_forward: Option<usize>,
    /// What a budget plan chose, per region.
    pub solutions: Vec<remat_runtime::plan::Solution>,
    /// Tokens per second over the steps after the first.
    pub tokens_per_second: f64,
    /// A sample from the trained model.
    pub sample: String,
}

/// Mean loss over `n` fixed held-out batches, without checkpointing.
fn evaluate(model: &Gpt, corpus: &Corpus, opts: &Options, dev: &Device) -> Result<f32> {
    let mut rng = Rng::new(opts.seed ^ 0xE7A1);
    let tokens = if corpus.valid.len() > opts.seq + 1 {
        &corpus.valid
    } else {
        &corpus.train
    };
    let n = 4;
    let mut total = 0.0;
    remat_runtime::Plan::off().scope(|| {
        for _ in 0..n {
            let (x, y) = Corpus::batch(tokens, opts.batch, opts.seq, &mut rng, dev)?;
            total += model.loss(&x, &y)?.detach().to_scalar::<f32>()?;
        }
        Ok(total / n as f32)
    })
}

/// Trains a fresh model on `corpus` under `opts`. `alloc`: the program's
/// counting allocator, to report the bytes held after the first forward.
pub fn train(
    corpus: &Corpus,
    opts: &Options,
    dev: &Device,
    alloc: Option<&CountingAlloc>,
) -> Result<Report> {
    let config = Config {
        vocab: corpus.vocab_size(),
        layers: opts.layers,
        d_model: opts.d_model,
        heads: opts.heads,
        seq: opts.seq,
    };
    let mut rng = Rng::new(opts.seed);
    let model = Gpt::new(config, &mut rng, dev)?;
    let named = model.named_vars();
    let mut optimizer = AdamW::new(
        model.vars(),
        ParamsAdamW {
            lr: opts.lr,
            weight_decay: 0.01,
            ..Default::default()
        },
    )?;
    let plan = opts.policy.plan();
    let valid_before = evaluate(&model, corpus, opts, dev)?;
    let bar = if opts.progress {
        let bar = ProgressBar::new(opts.steps as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed}<{eta}] {msg}")
                .map_err(candle_core::Error::wrap)?,
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let mut losses = Vec::with_capacity(opts.steps);
    let mut first_report = MemoryReport::default();
    let mut held_after_forward = None;
    let mut started = Instant::now();
    for step in 0..opts.steps {
        let (x, y) = Corpus::batch(&corpus.train, opts.batch, opts.seq, &mut rng, dev)?;
        let before = alloc.map(|a| a.live());
        let weights: Vec<(String, Tensor)> = match (step, &opts.dump) {
            (0, Some(_)) => named
                .iter()
                .map(|(n, v)| Ok((n.clone(), v.as_tensor().copy()?)))
                .collect::<Result<_>>()?,
            _ => Vec::new(),
        };
        let loss = plan.scope(|| model.loss(&x, &y))?;
        if step == 0 {
            first_report = MemoryReport::capture();
            held_after_forward = alloc.zip(before).map(|(a, b)| a.live().saturating_sub(b));
        }
        let grads = loss.backward()?;
        let value = loss.to_scalar::<f32>()?;
        if step == 0 {
            // Fails, naming them, if some parameters got no gradient.
            check_gradients(&grads, named.iter().map(|(n, v)| (n.as_str(), v)))?;
            if let Some(dir) = &opts.dump {
                crate::dump::dump(
                    dir,
                    &model,
                    &weights,
                    &corpus.vocab,
                    &opts.policy.to_string(),
                    &x,
                    &y,
                    value,
                    &grads,
                )?;
            }
            started = Instant::now();
        }
        optimizer.step(&grads)?;
        losses.push(value);
        let done = step.max(1) as f64;
        let tps = (done * (opts.batch * opts.seq) as f64) / started.elapsed().as_secs_f64();
        bar.set_message(format!("loss {value:.3} | {tps:.0} tok/s"));
        bar.inc(1);
    }
    bar.finish();
    let measured = opts.steps.saturating_sub(1).max(1) as f64;
    let tokens_per_second =
        measured * (opts.batch * opts.seq) as f64 / started.elapsed().as_secs_f64();
    let valid_after = evaluate(&model, corpus, opts, dev)?;
    // Start from a newline, or from the text's first character when the
    // text has no newline.
    let mut prompt = corpus.encode("\n");
    if prompt.is_empty() {
        prompt = corpus.train.iter().take(1).copied().collect();
    }
    let sample = model.sample(&prompt, opts.sample, 0.8, &mut rng)?;
    Ok(Report {
        config,
        parameters: model.parameter_count(),
        losses,
        valid_before,
        valid_after,
        unigram: corpus.unigram_entropy(),
        first_report,
        held_after_forward,
        solutions: plan.solutions(),
        tokens_per_second,
        sample: corpus.decode(&sample),
    })
}
