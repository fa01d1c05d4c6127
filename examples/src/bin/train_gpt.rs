//! Trains a small character-level GPT whose blocks are `remat!` regions,
//! with candle-nn's AdamW, on this project's own docs (or `--data PATH`).
//!
//! ```text
//! cargo run --release -p examples --bin train_gpt [-- --policy full --steps 200]
//! ```

use std::path::PathBuf;

use examples::cli::{device, Flags};
use examples::data::{text, Corpus};
use examples::gpt::Checkpointing;
use examples::train::{train, Options};
use remat_runtime::inspect::CountingAlloc;
use remat_runtime::MemoryReport;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

const USAGE: &str = "\
train_gpt: train a character-level GPT with checkpointed (remat!) blocks

usage: cargo run --release -p examples --bin train_gpt -- [flags]

  --policy none|full|selective|offload|save-all|budget=F
                  checkpointing [selective]; offload keeps selective's statements
                  in host memory (GPU); budget=F plans each region to hold
                  F of the way from full recompute (0) to save-all (1)
  --layers N      transformer blocks [4]
  --d-model N     residual width [128]
  --heads N       attention heads [4]
  --seq N         context length [64]
  --batch N       sequences per batch [16]
  --steps N       optimizer steps [750]
  --lr X          AdamW peak learning rate [0.004]
  --lr-warmup N   steps of linear warmup, then cosine decay to lr/10 [40]
  --clip X        clip gradients to this global norm, 0 = off [1.0]
  --seed N        seed of weights, batches and sampling [0]
  --device cpu|cuda                       [cpu]
  --dtype f32|bf16  the dtype the model computes in; bf16 keeps f32 master
                  weights that the optimizer updates [f32]
  --data PATH     UTF-8 text to train on [this project's README and docs]
  --dump DIR      write weights, batch, loss and gradients of step 1 (safetensors + manifest.json)
  --sample N      characters to sample at the end [300]
  --plot PATH     train once per policy of --compare from the same seed and
                  draw their loss curves, overlaid, into this SVG
  --compare LIST  the policies of --plot [none,full,selective,save-all]
";

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// What `--plot` asks for: the SVG's path and the policies to compare.
type Plot = Option<(PathBuf, Vec<Checkpointing>)>;

fn options() -> Result<(Options, String, Option<PathBuf>, Plot), String> {
    let mut flags = Flags::from_env(USAGE)?;
    let d = Options::default();
    let opts = Options {
        policy: flags.get::<Checkpointing>("policy", d.policy)?,
        layers: flags.get("layers", d.layers)?,
        d_model: flags.get("d-model", d.d_model)?,
        heads: flags.get("heads", d.heads)?,
        seq: flags.get("seq", d.seq)?,
        batch: flags.get("batch", d.batch)?,
        steps: flags.get("steps", d.steps)?,
        lr: flags.get("lr", d.lr)?,
        lr_warmup: flags.get("lr-warmup", d.lr_warmup)?,
        clip: flags.get("clip", d.clip)?,
        seed: flags.get("seed", d.seed)?,
        dump: flags.opt("dump")?,
        sample: flags.get("sample", d.sample)?,
        progress: true,
        dtype: match flags.get("dtype", "f32".to_string())?.as_str() {
            "f32" => candle_core::DType::F32,
            "bf16" => candle_core::DType::BF16,
            other => return Err(format!("--dtype {other}: f32 or bf16")),
        },
    };
    let dev = flags.get("device", "cpu".to_string())?;
    let data = flags.opt("data")?;
    let plot: Option<PathBuf> = flags.opt("plot")?;
    let compare: Option<String> = flags.opt("compare")?;
    if compare.is_some() && plot.is_none() {
        return Err("--compare chooses the policies of --plot: give --plot FILE.svg too".into());
    }
    let compare = compare
        .as_deref()
        .unwrap_or("none,full,selective,save-all")
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<Checkpointing>, _>>()?;
    flags.finish()?;
    Ok((opts, dev, data, plot.map(|p| (p, compare))))
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (opts, dev, data, plot) = options()?;
    let dev = device(&dev)?;
    let corpus = Corpus::new(&text(data.as_deref())?);
    println!(
        "corpus: {} ({} characters, vocabulary {}); unigram entropy {:.3} nats/char",
        data.as_ref()
            .map_or("this project's README and docs".to_string(), |p| p
                .display()
                .to_string()),
        corpus.train.len() + corpus.held_out.len(),
        corpus.vocab_size(),
        corpus.unigram_entropy()
    );
    println!(
        "model: {} layers, d_model {}, {} heads, seq {}, batch {}; policy {} ({})",
        opts.layers,
        opts.d_model,
        opts.heads,
        opts.seq,
        opts.batch,
        opts.policy,
        opts.policy.plan()
    );
    if let Some((path, policies)) = plot {
        return compare(&corpus, &opts, &dev, &path, &policies);
    }
    let report = train(&corpus, &opts, &dev, Some(&ALLOC))?;
    println!("parameters: {}", report.parameters);
    print_memory(&report.first_report, report.held_after_forward);
    for solution in &report.solutions {
        println!("{solution}");
    }
    let first = report.losses.first().copied().unwrap_or(f32::NAN);
    let tail = &report.losses[report.losses.len().saturating_sub(20)..];
    let last = tail.iter().sum::<f32>() / tail.len().max(1) as f32;
    println!(
        "training loss {first:.3} -> {last:.3} (mean of the last {} steps); held-out {:.3} -> {:.3}; \
         unigram entropy {:.3}",
        tail.len(),
        report.held_out_before,
        report.held_out_after,
        report.unigram
    );
    println!("{:.0} tokens/s", report.tokens_per_second);
    if let Some(dir) = &opts.dump {
        println!("step 1 written to {}", dir.display());
    }
    println!(
        "--- sample ---{}{}\n--------------",
        report.prompt, report.sample
    );
    Ok(())
}

/// Trains once per policy from the same seed, prints how far each run's
/// losses stray from the first run's, and draws the curves into `path`.
fn compare(
    corpus: &Corpus,
    opts: &Options,
    dev: &candle_core::Device,
    path: &std::path::Path,
    policies: &[Checkpointing],
) -> Result<(), Box<dyn std::error::Error>> {
    let mut runs: Vec<(String, Vec<f32>)> = Vec::new();
    for &policy in policies {
        let o = Options {
            policy,
            sample: 0,
            ..opts.clone()
        };
        let report = train(corpus, &o, dev, None)?;
        println!(
            "{policy}: held-out {:.3} -> {:.3}, {:.0} tokens/s",
            report.held_out_before, report.held_out_after, report.tokens_per_second
        );
        runs.push((policy.to_string(), report.losses));
    }
    let (first, base) = &runs[0];
    for (name, losses) in &runs[1..] {
        let diffs: Vec<f32> = losses
            .iter()
            .zip(base)
            .map(|(a, b)| (a - b).abs())
            .collect();
        let apart = diffs.iter().position(|&d| d > 1e-3);
        println!(
            "{name} against {first}: largest loss difference {:.2e}; {}",
            diffs.iter().copied().fold(0f32, f32::max),
            apart.map_or("never more than 1e-3 apart".to_string(), |s| format!(
                "first more than 1e-3 apart at step {s}"
            ))
        );
    }
    let title = format!(
        "train_gpt: {} layers, d_model {}, seed {}; one curve per policy",
        opts.layers, opts.d_model, opts.seed
    );
    let runs: Vec<(String, Vec<f64>)> = runs
        .into_iter()
        .map(|(name, l)| (name, l.into_iter().map(f64::from).collect()))
        .collect();
    let finite = || {
        runs.iter()
            .flat_map(|(_, l)| l.iter().copied())
            .filter(|v| v.is_finite())
    };
    let top = finite().fold(0.0, f64::max) * 1.05;
    let bottom = finite().fold(f64::MAX, f64::min).min(top) * 0.95;
    examples::curves::plot_steps(
        path,
        &title,
        "training loss (nats/char)",
        bottom..top.max(bottom + 1e-3),
        &runs,
    )?;
    println!("loss curves written to {}", path.display());
    Ok(())
}

/// The first block's tape by statement name, and the totals.
fn print_memory(report: &MemoryReport, held: Option<usize>) {
    let first = MemoryReport {
        entries: report
            .entries
            .iter()
            .filter(|e| e.call == 0)
            .cloned()
            .collect(),
    };
    if first.entries.is_empty() {
        println!("memory: no tapes (policy none: plain candle keeps its own graph)");
    } else {
        println!("memory held by the tape of the first block after the first forward:\n{first}");
        println!(
            "all {} block calls: {} bytes on tapes",
            report.entries.iter().map(|e| e.call).max().unwrap_or(0) + 1,
            report.total_bytes()
        );
    }
    if let Some(held) = held {
        println!("bytes held after the first forward (counting allocator): {held}");
    }
}
