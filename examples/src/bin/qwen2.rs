//! Fine-tunes a Qwen2-family checkpoint in Hugging Face's layout (a
//! directory of `config.json`, `model.safetensors` and `tokenizer.json`)
//! with a model file in candle-transformers' style whose decoder layers are
//! `remat!` blocks, on this project's docs (or `--data PATH`). Without a
//! checkpoint at hand (no network here), it writes a tiny random one first.
//!
//! ```text
//! cargo run --release -p examples --bin qwen2                  # tiny checkpoint, then fine-tunes it
//! cargo run --release -p examples --bin qwen2 -- --init target/qwen2-finetuned --steps 100
//! cargo run --release -p examples --bin qwen2 -- --compare none,full,selective --steps 20
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Var};
use candle_nn::ParamsAdamW;
use examples::cli::{device, Flags};
use examples::data::{text, Corpus};
use examples::gpt::Checkpointing;
use examples::qwen2::{self, named_vars, Config, Loaded};
use examples::rng::Rng;
use examples::train::{evaluate, learning_rate, Optim, Options};
use indicatif::{ProgressBar, ProgressStyle};
use remat_runtime::candle_nn::{AdamW, MasterWeights};
use remat_runtime::inspect::{
    device_memory_in_use, device_memory_peak, reset_device_memory_peak, CountingAlloc,
};
use remat_runtime::{check_gradients, MemoryReport, OptimizerInBackward, Plan};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

const USAGE: &str = "\
qwen2: fine-tune a Qwen2-family checkpoint (Hugging Face's layout: config.json,
model.safetensors, tokenizer.json) with a candle-transformers-style model file
whose decoder layers are remat! blocks

usage: cargo run --release -p examples --bin qwen2 -- [flags]

  --init DIR      the checkpoint to fine-tune (a Hub download, or a --save)
  --tiny-checkpoint DIR
                  first write a small random checkpoint into DIR (its
                  tokenizer: the text's characters), then fine-tune it
                  [without --init: target/qwen2-tiny]
    --layers N    its decoder layers [4]
    --hidden N    its residual width [128]
    --heads N     its query heads [4]
    --kv-heads N  its key/value heads (grouped-query attention) [2]
    --untied      `--untied true`: its own lm_head instead of the tied
                  embeddings [false]
    --preset qwen2.5-0.5b  a real model's dimensions and vocabulary (151,936;
                  the text's characters are its first tokens) instead; the
                  shape flags above override it
  --policy none|full|selective|offload|save-all|budget=F
                  checkpointing [selective]: selective saves the outputs of
                  the matrix products (q, k, v, o, gate, up, down)
  --compare P,P,...
                  train under each policy from the same weights and batches,
                  steps interleaved, and print held / peak / time per step
                  side by side (nothing saved)
  --seq N         context length [64]
  --batch N       sequences per batch [16]
  --steps N       optimizer steps [200]
  --lr X          AdamW peak learning rate [0.002]
  --lr-warmup N   steps of linear warmup, then cosine decay to lr/10 [20]
  --clip X        clip gradients to this global norm, 0 = off [1.0]
  --update after|in-backward
                  AdamW after the backward, or each parameter inside it as
                  soon as its gradient is complete (OptimizerInBackward: a
                  lower peak; needs --clip 0) [after]
  --dtype f32|bf16  the dtype the model computes in; bf16 keeps f32 master
                  weights that AdamW updates (MasterWeights) [f32]
  --ops composed|fused  the decoder layers as candle-transformers writes them
                  (`forward`: scores and probabilities (B, H, T, T), the MLP's
                  products kept) or with remat's fused ops (`forward_fused`:
                  `nn::attention`, `nn::linear_add`, `nn::swiglu_mlp`)
                  [composed]
  --head fused|composed  the final norm, lm_head and loss as one chunked node
                  (`nn::linear_cross_entropy`: no (tokens, vocabulary) logits)
                  or candle's composed ops [fused]
  --peaks P,P,... instead of training: one forward + backward of one batch
                  under each policy, with the composed and the fused head,
                  on one model without an optimizer: held, peak and largest
                  allocation (exact host bytes), time; with --update
                  in-backward (and --clip 0), the second of two steps with
                  the update inside the backward
  --seed N        seed of the tiny checkpoint and of the batches [0]
  --device cpu|cuda                       [cpu]
  --data PATH     UTF-8 text to train on [this project's README and docs]
  --save DIR      write the fine-tuned checkpoint here, in the same layout
                  [target/qwen2-finetuned]
";

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

struct Args {
    opts: Options,
    checkpoint: PathBuf,
    /// The shape of the tiny checkpoint to write first, if any.
    tiny: Option<Config>,
    compare: Vec<Checkpointing>,
    /// `--head fused` (the default) or `composed`.
    fused_head: bool,
    /// `--ops fused` (or `composed`, the default).
    fused_ops: bool,
    /// `--peaks`: the policies to measure one step of, each with both heads.
    peaks: Vec<Checkpointing>,
    dtype: DType,
    device: String,
    data: Option<PathBuf>,
    save: PathBuf,
    /// `--update in-backward`.
    in_backward: bool,
}

fn args() -> Result<Args, String> {
    let mut flags = Flags::from_env(USAGE)?;
    let opts = Options {
        policy: flags.get::<Checkpointing>("policy", Checkpointing::Selective)?,
        seq: flags.get("seq", 64)?,
        batch: flags.get("batch", 16)?,
        steps: flags.get("steps", 200)?,
        lr: flags.get("lr", 2e-3)?,
        lr_warmup: flags.get("lr-warmup", 20)?,
        clip: flags.get("clip", 1.0)?,
        seed: flags.get("seed", 0)?,
        progress: true,
        ..Options::default()
    };
    if opts.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    let in_backward = match flags.get("update", "after".to_string())?.as_str() {
        "after" => false,
        "in-backward" if opts.clip != 0.0 => {
            return Err(
                "--update in-backward cannot clip by the global norm, which needs every \
                 gradient at once: add --clip 0"
                    .into(),
            )
        }
        "in-backward" => true,
        other => return Err(format!("--update {other}: expected after or in-backward")),
    };
    let init: Option<PathBuf> = flags.opt("init")?;
    let tiny_dir: Option<PathBuf> = flags.opt("tiny-checkpoint")?;
    let shape = [
        ("layers", flags.opt::<usize>("layers")?),
        ("hidden", flags.opt("hidden")?),
        ("heads", flags.opt("heads")?),
        ("kv-heads", flags.opt("kv-heads")?),
    ];
    let untied: Option<bool> = flags.opt("untied")?;
    let preset: Option<String> = flags.opt("preset")?;
    let (checkpoint, tiny) = match (init, tiny_dir) {
        (Some(_), Some(_)) => {
            return Err(
                "--init and --tiny-checkpoint: give one (--tiny-checkpoint writes the \
                        checkpoint it fine-tunes)"
                    .into(),
            )
        }
        (Some(dir), None) => {
            if let Some((flag, _)) = shape.iter().find(|(_, v)| v.is_some()) {
                return Err(format!(
                    "--{flag} shapes a --tiny-checkpoint; the shape of --init {} is its config.json",
                    dir.display()
                ));
            }
            if untied.is_some() {
                return Err("--untied shapes a --tiny-checkpoint, not --init".into());
            }
            (dir, None)
        }
        (None, dir) => {
            let [layers, hidden, heads, kv_heads] = shape.map(|(_, v)| v);
            // The vocabulary is the text's characters, known once it is
            // read (a preset's is its own, at least that).
            let mut config = match &preset {
                None => Config::tiny(0),
                Some(name) => Config::preset(name)
                    .ok_or_else(|| format!("--preset {name}: expected qwen2.5-0.5b"))?,
            };
            config.num_hidden_layers = layers.unwrap_or(config.num_hidden_layers);
            config.hidden_size = hidden.unwrap_or(config.hidden_size);
            config.num_attention_heads = heads.unwrap_or(config.num_attention_heads);
            config.num_key_value_heads = kv_heads.unwrap_or(config.num_key_value_heads);
            if preset.is_none() || hidden.is_some() {
                config.intermediate_size = (8 * config.hidden_size / 3).next_multiple_of(32);
            }
            config.tie_word_embeddings = !untied.unwrap_or(!config.tie_word_embeddings);
            (
                dir.unwrap_or_else(|| PathBuf::from("target/qwen2-tiny")),
                Some(config),
            )
        }
    };
    // A comma-separated list of policies (none when the flag is absent).
    let mut policies = |flag: &str| -> Result<Vec<Checkpointing>, String> {
        match flags.opt::<String>(flag)? {
            None => Ok(Vec::new()),
            Some(list) => list
                .split(',')
                .map(|p| p.trim().parse::<Checkpointing>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("--{flag}: {e}")),
        }
    };
    let compare = policies("compare")?;
    let peaks = policies("peaks")?;
    let fused_head = match flags.get("head", "fused".to_string())?.as_str() {
        "fused" => true,
        "composed" => false,
        other => return Err(format!("--head {other}: expected fused or composed")),
    };
    let fused_ops = match flags.get("ops", "composed".to_string())?.as_str() {
        "fused" => true,
        "composed" => false,
        other => return Err(format!("--ops {other}: expected composed or fused")),
    };
    let dtype = match flags.get("dtype", "f32".to_string())?.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => return Err(format!("--dtype {other}: expected f32 or bf16")),
    };
    let args = Args {
        opts,
        checkpoint,
        tiny,
        compare,
        fused_head,
        fused_ops,
        peaks,
        dtype,
        device: flags.get("device", "cpu".to_string())?,
        data: flags.opt("data")?,
        save: flags.get("save", PathBuf::from("target/qwen2-finetuned"))?,
        in_backward,
    };
    flags.finish()?;
    Ok(args)
}

const MIB: f64 = (1 << 20) as f64;

/// Where a run's AdamW update runs.
enum Update {
    /// After the backward, with clipping (`--update after`).
    After(Box<Optim>),
    /// Inside the backward, parameter by parameter (`--update in-backward`),
    /// from `f32` master weights of `bf16` parameters.
    Inside(OptimizerInBackward<MasterWeights<AdamW>>),
}

/// One fine-tuning run: a model loaded from the checkpoint, its optimizer,
/// its plan, and what its steps measured.
struct Run {
    policy: Checkpointing,
    plan: Plan,
    loaded: Loaded,
    named: Vec<(String, Var)>,
    update: Update,
    rng: Rng,
    losses: Vec<f32>,
    /// Host bytes held after the forward, and the peak of forward and
    /// backward, of the first step (counting allocator).
    held: usize,
    peak: usize,
    /// The same step's device bytes on a GPU (the memory pool's: in use
    /// after the forward, high-water mark over forward and backward).
    device: Option<(usize, usize)>,
    /// The first step's tapes.
    report: MemoryReport,
    /// Seconds per step (forward, backward, optimizer).
    times: Vec<f64>,
}

impl Run {
    fn new(
        policy: Checkpointing,
        dir: &Path,
        dtype: DType,
        dev: &Device,
        opts: &Options,
        in_backward: bool,
        fused_ops: bool,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let mut loaded = qwen2::load(dir, dtype, dev)?;
        loaded.model.base_model.fused_ops = fused_ops;
        // In name order: the order of the gradient norm's sum, so that runs
        // repeat bit for bit.
        let named = named_vars(&loaded.varmap)?;
        let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
        let update = if in_backward {
            let params = ParamsAdamW {
                lr: opts.lr,
                weight_decay: 0.01,
                ..Default::default()
            };
            Update::Inside(OptimizerInBackward::from_varmap(&loaded.varmap, params)?)
        } else {
            // bf16 parameters get f32 master weights: a fine-tuning step is
            // often below a bf16 ulp of the weight it changes.
            Update::After(Box::new(Optim::new(vars, opts)?))
        };
        Ok(Run {
            policy,
            plan: qwen2::plan_for(policy, fused_ops),
            loaded,
            named,
            update,
            rng: Rng::new(opts.seed ^ 0xBA7C),
            losses: Vec::new(),
            held: 0,
            peak: 0,
            device: None,
            report: MemoryReport::default(),
            times: Vec::new(),
        })
    }

    fn step(
        &mut self,
        step: usize,
        corpus: &Corpus,
        opts: &Options,
        dev: &Device,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let (x, y) = Corpus::batch(&corpus.train, opts.batch, opts.seq, &mut self.rng, dev)?;
        let started = Instant::now();
        let before = ALLOC.live();
        ALLOC.reset_peak();
        let device_before = device_memory_in_use(dev)?;
        reset_device_memory_peak(dev)?;
        let model = &self.loaded.model;
        let loss = self.plan.scope(|| model.loss(&x, &y))?;
        let held = ALLOC.live().saturating_sub(before);
        let device_held = match (device_before, device_memory_in_use(dev)?) {
            (Some(b), Some(a)) => Some((b, a.saturating_sub(b))),
            _ => None,
        };
        // The device's bytes over what was in use before the step.
        let device = || -> candle_core::Result<Option<(usize, usize)>> {
            Ok(match (device_held, device_memory_peak(dev)?) {
                (Some((b, held)), Some(peak)) => Some((held, peak.saturating_sub(b))),
                _ => None,
            })
        };
        if step == 0 {
            self.report = MemoryReport::capture();
        }
        match &mut self.update {
            Update::After(optim) => {
                let mut grads = loss.backward()?;
                if step == 0 {
                    self.held = held;
                    self.peak = ALLOC.peak().saturating_sub(before);
                    self.device = device()?;
                    // Names the parameters that got no gradient, if any.
                    check_gradients(&grads, self.named.iter().map(|(n, v)| (n.as_str(), v)))?;
                }
                optim.step(step, &mut grads)?;
                drop(grads);
            }
            Update::Inside(opt) => {
                opt.set_learning_rate(learning_rate(opts, step));
                opt.backward_step(&loss)?;
                let missing = opt.without_gradient();
                if !missing.is_empty() {
                    return Err(format!("no gradient reached: {}", missing.join(", ")).into());
                }
                // The first step updates every parameter after the
                // backward (it finds those read outside the regions): the
                // second shows the peak of the update inside it.
                if step == 1.min(opts.steps - 1) {
                    self.held = held;
                    self.peak = ALLOC.peak().saturating_sub(before);
                    self.device = device()?;
                }
            }
        }
        self.times.push(started.elapsed().as_secs_f64());
        self.losses
            .push(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?);
        Ok(())
    }

    /// The median time of the steps after the first.
    fn step_time(&self) -> f64 {
        let mut t: Vec<f64> = self.times.iter().skip(1).copied().collect();
        if t.is_empty() {
            t = self.times.clone();
        }
        t.sort_by(f64::total_cmp);
        t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = args()?;
    let opts = &args.opts;
    let dev = device(&args.device)?;
    let text = text(args.data.as_deref())?;
    let dir = &args.checkpoint;
    if let Some(mut config) = args.tiny.clone() {
        let tokenizer = qwen2::char_tokenizer(&text)?;
        config.vocab_size = config.vocab_size.max(tokenizer.get_vocab_size(true));
        qwen2::write_tiny_checkpoint(dir, &config, &tokenizer, &mut Rng::new(opts.seed))?;
        println!(
            "wrote a tiny random checkpoint to {} (config.json, model.safetensors in bf16, \
             tokenizer.json over the text's {} characters; vocabulary {})",
            dir.display(),
            tokenizer.get_vocab_size(true),
            config.vocab_size
        );
    }
    if !args.peaks.is_empty() {
        return peaks(&args, &text, &dev);
    }
    let policies = if args.compare.is_empty() {
        vec![opts.policy]
    } else {
        args.compare.clone()
    };
    let mut runs = policies
        .iter()
        .map(|&p| {
            Run::new(
                p,
                dir,
                args.dtype,
                &dev,
                opts,
                args.in_backward,
                args.fused_ops,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    for r in runs.iter_mut() {
        r.loaded.model.fused_head = args.fused_head;
    }
    let tokenizer = qwen2::read_tokenizer(dir)?;
    let tokens = qwen2::encode(&tokenizer, &text)?;
    let vocab_size = runs[0].loaded.config.vocab_size;
    if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(format!(
            "{}: the tokenizer gives token {id}, beyond config.json's vocab_size {vocab_size}",
            dir.display()
        )
        .into());
    }
    let corpus = qwen2::split(&tokens);
    let first = &runs[0];
    let c = &first.loaded.config;
    println!(
        "checkpoint {}: Qwen2, {} layers, hidden {}, {} heads ({} key/value), MLP {}, vocabulary {}, \
         {} head; {} parameters in {} tensors, as {:?}",
        dir.display(),
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
        if c.tie_word_embeddings { "tied" } else { "untied" },
        first.named.iter().map(|(_, v)| v.elem_count()).sum::<usize>(),
        first.named.len(),
        args.dtype,
    );
    if !first.loaded.unused.is_empty() {
        println!("not used by the model: {}", first.loaded.unused.join(", "));
    }
    println!(
        "text: {} tokens for training, {} held out",
        corpus.train.len(),
        corpus.held_out.len()
    );
    if corpus.train.len() <= opts.seq + 1 {
        return Err(format!(
            "{} training tokens: too few for --seq {} (use a longer --data or a smaller --seq)",
            corpus.train.len(),
            opts.seq
        )
        .into());
    }
    let eval = |r: &Run| evaluate(|x, y| r.loaded.model.loss(x, y), &corpus, opts, &dev);
    let before = eval(first)?;
    println!("held-out loss before: {before:.3} nats/token");
    for r in &runs {
        println!("policy {}: {}", r.policy, r.plan);
    }
    let bar = ProgressBar::new(opts.steps as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} [{elapsed}<{eta}] {msg}",
    )?);
    for step in 0..opts.steps {
        // Interleaved, so that the machine's drift reaches every policy alike.
        for r in runs.iter_mut() {
            r.step(step, &corpus, opts, &dev)?;
        }
        if step == 0 && args.compare.is_empty() {
            print_first_step(&runs[0], &bar);
        }
        let r = &runs[0];
        bar.set_message(format!(
            "loss {:.3}, {:.0} ms/step",
            r.losses[step],
            r.times[step] * 1e3
        ));
        bar.inc(1);
    }
    bar.finish_and_clear();
    if !args.compare.is_empty() {
        print_comparison(&runs, opts, args.dtype, dev.is_cpu());
        return Ok(());
    }
    let r = &runs[0];
    let first_loss = r.losses[0];
    let tail = &r.losses[r.losses.len().saturating_sub(10)..];
    println!(
        "training loss: {first_loss:.3} at the first step, {:.3} over the last {} (nats/token); \
         {:.0} ms per step",
        tail.iter().sum::<f32>() / tail.len() as f32,
        tail.len(),
        r.step_time() * 1e3
    );
    println!("held-out loss after: {:.3} nats/token", eval(r)?);
    qwen2::save(
        &args.save,
        &r.loaded.config,
        &r.loaded.varmap,
        &dir.join(qwen2::TOKENIZER_FILE),
    )?;
    println!(
        "fine-tuned checkpoint saved to {0} (config.json, model.safetensors, tokenizer.json); \
         continue with --init {0}",
        args.save.display()
    );
    Ok(())
}

/// `--peaks`: one forward + backward of one batch per policy and head, on
/// one model (no optimizer), measured with the counting allocator.
fn peaks(args: &Args, text: &str, dev: &Device) -> Result<(), Box<dyn std::error::Error>> {
    let opts = &args.opts;
    let mut loaded = qwen2::load(&args.checkpoint, args.dtype, dev)?;
    loaded.model.base_model.fused_ops = args.fused_ops;
    let tokens = qwen2::encode(&qwen2::read_tokenizer(&args.checkpoint)?, text)?;
    let corpus = qwen2::split(&tokens);
    let (x, y) = Corpus::batch(
        &corpus.train,
        opts.batch,
        opts.seq,
        &mut Rng::new(opts.seed),
        dev,
    )?;
    let c = &loaded.config;
    let params: usize = loaded
        .varmap
        .all_vars()
        .iter()
        .map(|v| v.elem_count())
        .sum();
    println!(
        "Qwen2 {} layers, hidden {}, {} heads ({} key/value), MLP {}, vocabulary {}, {}; {params} \
         parameters, {:?}; layers with {} ops; batch {} x {} tokens; one forward + backward each{}, \
         exact host bytes over what was live before (parameters excluded, their gradients \
         included); logits (B, T, V) in f32 would be {:.1} MiB\n",
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
        if c.tie_word_embeddings {
            "tied head"
        } else {
            "untied head"
        },
        args.dtype,
        if args.fused_ops { "fused" } else { "composed" },
        opts.batch,
        opts.seq,
        if args.in_backward {
            " with the update inside the backward"
        } else {
            " (no optimizer)"
        },
        (opts.batch * opts.seq * c.vocab_size * 4) as f64 / MIB,
    );
    if args.in_backward {
        println!(
            "With the update in the backward (OptimizerInBackward, remat's AdamW, f32 master weights of bf16 parameters): each case \
             runs two steps on freshly loaded weights and measures the second (AdamW's state, \
             made by the first, excluded; each parameter's gradient freed where its last \
             region applies it; under `none` no region runs, so every parameter is updated \
             after the backward)\n"
        );
    }
    println!("| policy | head | held after the forward (MiB) | peak of forward + backward (MiB) | largest allocation (MiB) | time (s) | loss |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for &policy in &args.peaks {
        let plan = qwen2::plan_for(policy, args.fused_ops);
        for fused in [false, true] {
            let mut update = None;
            if args.in_backward {
                // A fresh copy of the weights, and the state of a first step.
                loaded = qwen2::load(&args.checkpoint, args.dtype, dev)?;
                loaded.model.base_model.fused_ops = args.fused_ops;
                loaded.model.fused_head = fused;
                let config = ParamsAdamW {
                    lr: opts.lr,
                    weight_decay: 0.01,
                    ..Default::default()
                };
                let mut opt = OptimizerInBackward::<MasterWeights<AdamW>>::from_varmap(
                    &loaded.varmap,
                    config,
                )?;
                let loss = plan.scope(|| loaded.model.loss(&x, &y))?;
                opt.backward_step(&loss)?;
                update = Some(opt);
            }
            loaded.model.fused_head = fused;
            let model = &loaded.model;
            let started = Instant::now();
            let before = ALLOC.live();
            ALLOC.reset_peak();
            let loss = plan.scope(|| model.loss(&x, &y))?;
            let held = ALLOC.live().saturating_sub(before);
            let grads = match update.as_mut() {
                Some(opt) => {
                    opt.backward_step(&loss)?;
                    None
                }
                None => Some(loss.backward()?),
            };
            let peak = ALLOC.peak().saturating_sub(before);
            let largest = ALLOC.largest();
            let seconds = started.elapsed().as_secs_f64();
            let value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
            drop((loss, grads, update));
            println!(
                "| {policy} | {} | {:.1} | {:.1} | {:.1} | {seconds:.1} | {value:.4} |",
                if fused { "fused" } else { "composed" },
                held as f64 / MIB,
                peak as f64 / MIB,
                largest as f64 / MIB,
            );
        }
    }
    Ok(())
}

/// The first step's memory: the first layer's tape by statement name, and
/// the host bytes.
fn print_first_step(r: &Run, bar: &ProgressBar) {
    let first = MemoryReport {
        entries: r
            .report
            .entries
            .iter()
            .filter(|e| e.region.starts_with("DecoderLayer::forward") && e.call == 0)
            .cloned()
            .collect(),
    };
    let mut lines = Vec::new();
    if first.entries.is_empty() {
        lines.push("memory: no tapes (policy none: plain candle keeps its own graph)".to_string());
    } else {
        lines.push(format!(
            "the first decoder layer's tape after the first forward:\n{first}"
        ));
        lines.push(format!(
            "all tapes: {:.2} MiB",
            r.report.total_bytes() as f64 / MIB
        ));
    }
    lines.push(format!(
        "first step: {:.1} MiB held after the forward, {:.1} MiB peak of forward + backward \
         (host memory, counting allocator); all {} parameters have a gradient",
        r.held as f64 / MIB,
        r.peak as f64 / MIB,
        r.named.len()
    ));
    bar.suspend(|| {
        for l in lines {
            println!("{l}");
        }
    });
}

/// The side-by-side table of `--compare`, in Markdown.
fn print_comparison(runs: &[Run], opts: &Options, dtype: DType, cpu: bool) {
    let plain = runs
        .iter()
        .find(|r| r.policy == Checkpointing::None)
        .map(Run::step_time);
    println!(
        "{} steps each, batch {} x {} tokens, {dtype:?}, steps interleaved; memory of the first \
         step{}{}, time the median step (forward, backward, AdamW)\n",
        opts.steps,
        opts.batch,
        opts.seq,
        if cpu {
            " (host bytes, counting allocator)"
        } else {
            " (host bytes, counting allocator; device bytes, the memory pool's)"
        },
        if runs.iter().any(|r| matches!(r.update, Update::Inside(_))) {
            " (with --update in-backward: of the second, the update inside its backward included)"
        } else {
            ""
        }
    );
    let device = if cpu {
        ""
    } else {
        " held on the device (MiB) | device peak (MiB) |"
    };
    println!("| policy | held after the forward (MiB) | peak of forward + backward (MiB) |{device} time per step (ms) | loss after the last step |");
    println!(
        "|---|---:|---:|{}---:|---:|",
        if cpu { "" } else { "---:|---:|" }
    );
    for r in runs {
        let time = r.step_time();
        let relative = plain.map_or(String::new(), |p| format!(" ({:.2}x)", time / p));
        let device = match (cpu, r.device) {
            (true, _) => String::new(),
            (false, Some((held, peak))) => {
                format!(" {:.1} | {:.1} |", held as f64 / MIB, peak as f64 / MIB)
            }
            (false, None) => " n/a | n/a |".to_string(),
        };
        println!(
            "| {} | {:.1} | {:.1} |{device} {:.0}{relative} | {:.3} |",
            r.policy,
            r.held as f64 / MIB,
            r.peak as f64 / MIB,
            time * 1e3,
            r.losses.last().copied().unwrap_or(f32::NAN),
        );
    }
}
