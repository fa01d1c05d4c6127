//! The training loop of `train_gpt`, as a library function so that the test
//! suite runs it too.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
use indicatif::{ProgressBar, ProgressStyle};
use remat_runtime::candle_nn::{AdamW, MasterWeights};
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
    /// AdamW's peak learning rate, reached after `lr_warmup` steps and
    /// decayed along a cosine to a tenth of it at the last step.
    pub lr: f64,
    /// Steps of linear learning-rate warmup (at most half the steps).
    pub lr_warmup: usize,
    /// Gradients are scaled down to this global norm when above it (0: no
    /// clipping).
    pub clip: f64,
    /// Seed of weights, batches and samples.
    pub seed: u64,
    /// Write the first step here (see [`crate::dump`]).
    pub dump: Option<PathBuf>,
    /// Characters to sample after training.
    pub sample: usize,
    /// Show a progress bar.
    pub progress: bool,
    /// The dtype the model computes in: `F32`, or `BF16` with `F32` master
    /// weights (the optimizer updates an `F32` copy of every parameter and
    /// writes it back rounded; the loss in `F32`).
    pub dtype: DType,
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
            steps: 750,
            lr: 4e-3,
            lr_warmup: 40,
            clip: 1.0,
            seed: 0,
            dump: None,
            sample: 300,
            progress: true,
            dtype: DType::F32,
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
    /// Held-out loss before training.
    pub held_out_before: f32,
    /// Held-out loss after training.
    pub held_out_after: f32,
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
    /// The start of [`Report::sample`].
    pub prompt: String,
    /// A sample from the trained model, after `prompt` (temperature 0.8).
    pub sample: String,
}

/// The learning rate at `step` (from 0): a linear warmup that reaches
/// `opts.lr` at step `w`, then a cosine down to a tenth of it at the last
/// step, where `w` is `opts.lr_warmup` or half the steps if fewer.
pub fn learning_rate(opts: &Options, step: usize) -> f64 {
    let w = opts.lr_warmup.min(opts.steps.saturating_sub(1) / 2);
    if step < w {
        return opts.lr * (step + 1) as f64 / (w + 1) as f64;
    }
    let span = opts.steps.saturating_sub(w + 1);
    if span == 0 {
        return opts.lr;
    }
    let done = ((step - w) as f64 / span as f64).min(1.0);
    let min = opts.lr / 10.0;
    min + (opts.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * done).cos())
}

/// Scales the gradients of `vars` in `grads` so that their global norm (the
/// norm of all of them as one vector) is at most `max_norm` (no clipping
/// when `max_norm` is 0), as PyTorch's `clip_grad_norm_` does, and returns
/// the norm before clipping. Variables without a gradient are skipped.
///
/// ```
/// use candle_core::{Device, Var};
/// let (a, b) = (Var::new(&[3f32], &Device::Cpu)?, Var::new(&[4f32], &Device::Cpu)?);
/// let mut grads = (a.as_tensor() + b.as_tensor())?.sum_all()?.backward()?; // both gradients 1
/// let norm = examples::train::clip_grad_norm(&mut grads, &[a.clone(), b], 0.5)?;
/// assert!((norm - 2f64.sqrt()).abs() < 1e-6);
/// let g = grads.get(&a).unwrap().to_vec1::<f32>()?[0];
/// assert!((g - 0.5 / 2f32.sqrt()).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn clip_grad_norm(grads: &mut GradStore, vars: &[Var], max_norm: f64) -> Result<f64> {
    let mut squares = 0.0;
    for v in vars {
        if let Some(g) = grads.get(v) {
            // In f32 whatever the gradient's dtype: a bf16 sum of squares
            // loses most of its digits.
            let g = g.to_dtype(candle_core::DType::F32)?;
            squares += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
    }
    let norm = squares.sqrt();
    if max_norm > 0.0 && norm > max_norm {
        let scale = max_norm / (norm + 1e-6);
        for v in vars {
            if let Some(g) = grads.remove(v) {
                grads.insert(v, (g * scale)?);
            }
        }
    }
    Ok(norm)
}

/// AdamW (weight decay 0.01) with [`learning_rate`]'s schedule and
/// [`clip_grad_norm`], as `train_gpt` and `qwen2` use it: remat's drop-in
/// for candle-nn's (the same updates, a step whose temporaries are those
/// of a block of each parameter's rows, not of the whole parameter),
/// updating `f32` master weights of `bf16` and `f16` parameters
/// ([`MasterWeights`]; `f32` parameters are their own).
pub struct Optim {
    adamw: MasterWeights<AdamW>,
    vars: Vec<Var>,
    opts: Options,
}

impl Optim {
    /// An optimizer of `vars` under `opts`' learning rate, warmup, steps
    /// and clipping.
    pub fn new(vars: Vec<Var>, opts: &Options) -> Result<Self> {
        let adamw = MasterWeights::new(
            vars.clone(),
            ParamsAdamW {
                lr: opts.lr,
                weight_decay: 0.01,
                ..Default::default()
            },
        )?;
        Ok(Optim {
            adamw,
            vars,
            opts: opts.clone(),
        })
    }

    /// The `f32` master weight of a `bf16` or `f16` parameter.
    pub fn master(&self, var: &Var) -> Option<&Var> {
        self.adamw.master(var)
    }

    /// Clips `grads` and takes optimizer step `step` (from 0); returns the
    /// gradients' global norm before clipping.
    pub fn step(&mut self, step: usize, grads: &mut GradStore) -> Result<f64> {
        // Low-precision gradients in f32 before they are clipped (the
        // masters take them in f32 anyway, one at a time when unclipped).
        for v in self.vars.iter().filter(|_| self.opts.clip > 0.0) {
            if matches!(v.dtype(), DType::BF16 | DType::F16) {
                if let Some(g) = grads.remove(v) {
                    grads.insert(v, g.to_dtype(DType::F32)?);
                }
            }
        }
        let norm = clip_grad_norm(grads, &self.vars, self.opts.clip)?;
        self.adamw
            .set_learning_rate(learning_rate(&self.opts, step));
        self.adamw.step(grads)?;
        Ok(norm)
    }
}

/// What the sample after training starts from.
const PROMPT: &str = "\n\nThe ";

/// Mean of `loss` over the held-out text of `corpus` (all of it, in windows
/// of `opts.seq`, at most 32 batches of `opts.batch`), without checkpointing.
/// Fails, saying what to change, when the held-out text is shorter than
/// one window.
pub fn evaluate(
    loss: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    corpus: &Corpus,
    opts: &Options,
    dev: &Device,
) -> Result<f32> {
    check_shape(corpus, opts)?;
    let tokens = &corpus.held_out;
    let windows: Vec<usize> = (0..tokens.len() - opts.seq).step_by(opts.seq).collect();
    let batches: Vec<&[usize]> = windows.chunks(opts.batch).take(32).collect();
    let mut total = 0.0;
    let mut count = 0;
    remat_runtime::Plan::off().scope(|| {
        for starts in &batches {
            let (x, y) = Corpus::windows(tokens, starts, opts.seq, dev)?;
            let n = starts.len() * opts.seq;
            let mean = loss(&x, &y)?.detach().to_dtype(candle_core::DType::F32)?;
            total += mean.to_scalar::<f32>()? as f64 * n as f64;
            count += n;
        }
        Ok((total / count as f64) as f32)
    })
}

/// Fails, naming the flag, when `opts` cannot train on `corpus`: no
/// sequence or batch, or a held-out text shorter than one window of
/// `seq + 1` characters.
pub fn check_shape(corpus: &Corpus, opts: &Options) -> Result<()> {
    if opts.seq == 0 || opts.batch == 0 {
        candle_core::bail!("--seq and --batch must be at least 1");
    }
    if corpus.held_out.len() <= opts.seq {
        candle_core::bail!(
            "the held-out tenth of the text has {} characters, fewer than --seq {} + 1: \
             use a longer text or a smaller --seq",
            corpus.held_out.len(),
            opts.seq
        );
    }
    Ok(())
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
    let model = match opts.dtype {
        DType::F32 => Gpt::new(config, &mut rng, dev)?,
        DType::BF16 => Gpt::new(config, &mut rng, dev)?.to_dtype(DType::BF16)?,
        other => candle_core::bail!(
            "--dtype {}: f32, or bf16 (with f32 master weights); f16 would need loss scaling",
            other.as_str()
        ),
    };
    if opts.dump.is_some() && opts.dtype != DType::F32 {
        candle_core::bail!(
            "--dump writes an f32 step (scripts/check_dump.py reads f32): use --dtype f32"
        );
    }
    let mut optimizer = Optim::new(model.vars(), opts)?;
    let named = model.named_vars();
    let plan = opts.policy.plan();
    let held_out_before = evaluate(|x, y| model.loss(x, y), corpus, opts, dev)?;
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
        let mut grads = loss.backward()?;
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
        optimizer.step(step, &mut grads)?;
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
    let held_out_after = evaluate(|x, y| model.loss(x, y), corpus, opts, dev)?;
    // Start a paragraph with "The", or from the text's first character
    // when the text lacks one of those characters.
    let mut prompt = corpus.encode(PROMPT);
    if prompt.len() != PROMPT.chars().count() {
        prompt = corpus.train.iter().take(1).copied().collect();
    }
    let sample = model.sample(&prompt, opts.sample, 0.8, &mut rng)?;
    Ok(Report {
        config,
        parameters: model.parameter_count(),
        losses,
        held_out_before,
        held_out_after,
        unigram: corpus.unigram_entropy(),
        first_report,
        held_after_forward,
        solutions: plan.solutions(),
        tokens_per_second,
        prompt: corpus.decode(&prompt),
        sample: corpus.decode(&sample),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_peaks_once_warm_and_ends_at_a_tenth() {
        for (steps, lr_warmup) in [
            (1, 40),
            (2, 40),
            (40, 40),
            (41, 40),
            (42, 40),
            (750, 40),
            (10, 0),
        ] {
            let opts = Options {
                steps,
                lr_warmup,
                lr: 1.0,
                ..Options::default()
            };
            let lrs: Vec<f64> = (0..steps).map(|s| learning_rate(&opts, s)).collect();
            let peak = lrs.iter().copied().fold(0.0, f64::max);
            assert_eq!(peak, 1.0, "{steps} steps, warmup {lr_warmup}: {lrs:?}");
            if steps > 1 {
                assert!((lrs[steps - 1] - 0.1).abs() < 1e-12, "{steps}: {lrs:?}");
            }
            assert!(lrs.iter().all(|&lr| lr > 0.0));
        }
    }
}
