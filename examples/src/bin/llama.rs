//! Trains (or fine-tunes) a LLaMA-style decoder built with candle-nn's
//! `VarMap` and `VarBuilder`, each decoder layer a `remat!` function, on
//! this project's docs (or `--data PATH`), character by character.
//!
//! ```text
//! cargo run --release -p examples --bin llama -- --steps 200   # saves target/llama.safetensors
//! cargo run --release -p examples --bin llama -- --init target/llama.safetensors --steps 100
//! ```

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Var};
use candle_nn::{VarBuilder, VarMap};
use examples::cli::{device, Flags};
use examples::data::{text, Corpus};
use examples::gpt::Checkpointing;
use examples::llama::{init_weights, named_vars, Config, Llama, SELECTIVE};
use examples::rng::Rng;
use examples::train::{evaluate, Optim, Options};
use remat_runtime::inspect::CountingAlloc;
use remat_runtime::{check_gradients, Plan};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

const USAGE: &str = "\
llama: train or fine-tune a LLaMA-style decoder (VarBuilder, candle_nn::Linear,
grouped-query attention, RoPE, SwiGLU) whose layers are remat! blocks

usage: cargo run --release -p examples --bin llama -- [flags]

  --policy none|full|selective|save-all|budget=F
                  checkpointing [selective]: selective saves the outputs of
                  the matrix products (q, k, v, o, gate_up, down)
  --layers N      decoder layers [4]
  --hidden N      residual width [128]
  --heads N       query heads [4]
  --kv-heads N    key/value heads (grouped-query attention) [2]
  --seq N         context length [64]
  --batch N       sequences per batch [16]
  --steps N       optimizer steps [200]
  --lr X          AdamW peak learning rate [0.002]
  --lr-warmup N   steps of linear warmup, then cosine decay to lr/10 [20]
  --clip X        clip gradients to this global norm, 0 = off [1.0]
  --dtype f32|bf16                        [f32]
  --seed N        seed of the initial weights and the batches [0]
  --device cpu|cuda                       [cpu]
  --data PATH     UTF-8 text to train on [this project's README and docs]
  --init PATH     start from these weights (safetensors, VarMap::load) and
                  the vocabulary beside them (PATH with extension .vocab)
  --save PATH     write the weights at the end (safetensors, VarMap::save),
                  and the vocabulary beside them [target/llama.safetensors]
";

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

struct Args {
    opts: Options,
    kv_heads: usize,
    dtype: DType,
    device: String,
    data: Option<PathBuf>,
    init: Option<PathBuf>,
    save: PathBuf,
}

fn args() -> Result<Args, String> {
    let mut flags = Flags::from_env(USAGE)?;
    let policy = flags.get::<Checkpointing>("policy", Checkpointing::Selective)?;
    if policy == Checkpointing::Offload {
        return Err(
            "--policy offload: use train_gpt for offload (this example keeps to the CPU policies)"
                .into(),
        );
    }
    let opts = Options {
        policy,
        layers: flags.get("layers", 4)?,
        d_model: flags.get("hidden", 128)?,
        heads: flags.get("heads", 4)?,
        seq: flags.get("seq", 64)?,
        batch: flags.get("batch", 16)?,
        steps: flags.get("steps", 200)?,
        lr: flags.get("lr", 2e-3)?,
        lr_warmup: flags.get("lr-warmup", 20)?,
        clip: flags.get("clip", 1.0)?,
        seed: flags.get("seed", 0)?,
        progress: false,
        ..Options::default()
    };
    let dtype = match flags.get("dtype", "f32".to_string())?.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => return Err(format!("--dtype {other}: expected f32 or bf16")),
    };
    let args = Args {
        opts,
        kv_heads: flags.get("kv-heads", 2)?,
        dtype,
        device: flags.get("device", "cpu".to_string())?,
        data: flags.opt("data")?,
        init: flags.opt("init")?,
        save: flags.get("save", PathBuf::from("target/llama.safetensors"))?,
    };
    flags.finish()?;
    Ok(args)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let Args {
        opts,
        kv_heads,
        dtype,
        device: dev,
        data,
        init,
        save,
    } = args()?;
    let dev = device(&dev)?;
    let text = text(data.as_deref())?;
    // A checkpoint's embedding rows are its vocabulary's characters: keep
    // them, so that the rows mean what they meant.
    let corpus = match &init {
        Some(path) => {
            let file = vocab_path(path);
            let vocab = std::fs::read_to_string(&file).map_err(|e| {
                format!(
                    "--init {}: its vocabulary {} ({e}); llama --save writes both",
                    path.display(),
                    file.display()
                )
            })?;
            Corpus::with_vocab(&text, vocab.chars().collect())
        }
        None => Corpus::new(&text),
    };
    let config = Config {
        layers: opts.layers,
        hidden: opts.d_model,
        heads: opts.heads,
        kv_heads,
        intermediate: (8 * opts.d_model / 3).next_multiple_of(32),
        ..Config::small(corpus.vocab_size(), opts.seq)
    };

    // The candle way: a VarMap owns the parameters, a VarBuilder names them.
    let mut varmap = VarMap::new();
    let model = Llama::new(config, VarBuilder::from_varmap(&varmap, dtype, &dev))?;
    init_weights(&varmap, config.layers, &mut Rng::new(opts.seed))?;
    if let Some(path) = &init {
        varmap.load(path).map_err(|e| init_error(path, e))?;
        println!("weights loaded from {}", path.display());
    }
    // In name order: the order of the gradient norm's sum, so runs repeat
    // bit for bit.
    let named = named_vars(&varmap)?;
    let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
    let plan = match opts.policy {
        Checkpointing::Selective => Plan::save_only(SELECTIVE.iter().copied()),
        other => other.plan(),
    };
    println!(
        "model: {} layers, hidden {}, {} heads ({} key/value), SwiGLU {}, {:?}; {} parameters; policy {} ({})",
        config.layers,
        config.hidden,
        config.heads,
        config.kv_heads,
        config.intermediate,
        dtype,
        vars.iter().map(|v| v.elem_count()).sum::<usize>(),
        opts.policy,
        plan,
    );
    let eval = |m: &Llama| evaluate(|x, y| m.loss(x, y), &corpus, &opts, &dev);
    println!("held-out loss before: {:.3} nats/char", eval(&model)?);
    let mut optim = Optim::new(vars, &opts)?;
    let mut rng = Rng::new(opts.seed ^ 0xBA7C);
    let started = Instant::now();
    for step in 0..opts.steps {
        let (x, y) = Corpus::batch(&corpus.train, opts.batch, opts.seq, &mut rng, &dev)?;
        let before = ALLOC.live();
        ALLOC.reset_peak();
        let loss = plan.scope(|| model.loss(&x, &y))?;
        let held = ALLOC.live().saturating_sub(before);
        let mut grads = loss.backward()?;
        if step == 0 {
            // Names the parameters that got no gradient, if any.
            check_gradients(&grads, named.iter().map(|(n, v)| (n.as_str(), v)))?;
            if dev.is_cpu() {
                println!(
                    "first step: {:.1} MiB held after the forward, {:.1} MiB peak of forward + backward \
                     (host memory, counting allocator)",
                    held as f64 / (1 << 20) as f64,
                    ALLOC.peak().saturating_sub(before) as f64 / (1 << 20) as f64
                );
            }
        }
        let norm = optim.step(step, &mut grads)?;
        if step % 20 == 0 || step + 1 == opts.steps {
            println!(
                "step {step:4}: loss {:.3}, gradient norm {norm:.2}, {:.1} s",
                loss.to_dtype(DType::F32)?.to_scalar::<f32>()?,
                started.elapsed().as_secs_f64()
            );
        }
    }
    println!("held-out loss after: {:.3} nats/char", eval(&model)?);
    if let Some(dir) = save.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("--save {}: {e}", save.display()))?;
    }
    varmap.save(&save)?;
    let vocab: String = corpus.vocab.iter().collect();
    std::fs::write(vocab_path(&save), vocab)
        .map_err(|e| format!("--save {}: {e}", save.display()))?;
    println!(
        "weights saved to {0}; continue training from them with --init {0}",
        save.display()
    );
    Ok(())
}

/// Where the vocabulary of the checkpoint at `path` is written: beside it,
/// `.vocab` for its extension (its characters, in order, as UTF-8).
fn vocab_path(path: &std::path::Path) -> PathBuf {
    path.with_extension("vocab")
}

/// What a failed `--init` says: candle's error, and what has to match.
fn init_error(path: &std::path::Path, e: candle_core::Error) -> String {
    format!(
        "--init {}: {e} (a checkpoint loads into the model shape and --dtype it was saved with)",
        path.display()
    )
}
