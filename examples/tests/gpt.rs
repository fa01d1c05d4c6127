//! The example GPT end to end: training learns, every policy gives plain
//! candle's gradients, and `--dump` writes a step another program can check.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use examples::data::{default_text, Corpus};
use examples::gpt::{Checkpointing, Config, Gpt, Ops};
use examples::rng::Rng;
use examples::train::{train, Options};

fn tiny() -> Options {
    Options {
        layers: 2,
        d_model: 32,
        heads: 2,
        seq: 16,
        batch: 8,
        steps: 80,
        lr: 1e-2,
        sample: 20,
        progress: false,
        ..Options::default()
    }
}

/// A fixed text (the default corpus follows the docs, which change).
const TEXT: &str = "\
Activation checkpointing trades compute for memory. During the forward pass, \
a checkpointed block keeps only its inputs; during the backward pass, it runs \
the block again to rebuild the activations it needs. Saving a statement keeps \
its residuals instead, so the backward does not run it again. The best plan \
saves what is expensive to recompute and cheap to keep, such as the outputs \
of matrix products, and recomputes what is cheap, such as norms and \
activations. A memory budget turns this into a choice for every statement. \
The tape holds the saved residuals under stable names, and the replay checks \
that it runs the same statements in the same order as the forward did. ";

#[test]
fn training_smoke_loss_falls_and_every_parameter_trains() {
    let corpus = Corpus::new(&TEXT.repeat(8));
    // `train` fails (naming them) if a parameter gets no gradient.
    let report = train(&corpus, &tiny(), &Device::Cpu, None).unwrap();
    let first = report.losses[0];
    let last5 = report.losses[report.losses.len() - 5..].iter().sum::<f32>() / 5.0;
    println!(
        "loss {first} -> {last5}, held-out {} -> {}, unigram {}",
        report.held_out_before, report.held_out_after, report.unigram
    );
    // Random init predicts ~uniformly: ln(vocab) ~ 4.5 nats. 80 steps of a
    // tiny model must at least beat the unigram entropy (3.3 nats).
    assert!((first - (corpus.vocab_size() as f32).ln()).abs() < 0.1);
    assert!(last5 < report.unigram as f32, "{last5}");
    assert!(report.held_out_after < report.held_out_before - 0.8);
    assert_eq!(report.sample.chars().count(), 20);
    // The tape of the first step was reported by statement name.
    let names: Vec<&str> = report
        .first_report
        .entries
        .iter()
        .filter(|e| e.region == "block" && e.call == 0)
        .map(|e| e.statement.as_str())
        .collect();
    assert_eq!(names, ["(inputs)", "att", "proj", "mlp"]);
}

/// `--dtype bf16`: the model computes in bf16 from f32 master weights and
/// learns as the f32 run does (the same bar: below the unigram entropy,
/// held-out down by 0.8 nats).
#[test]
fn bf16_training_with_f32_master_weights_learns() {
    let corpus = Corpus::new(&TEXT.repeat(8));
    let opts = Options {
        dtype: DType::BF16,
        ..tiny()
    };
    let report = train(&corpus, &opts, &Device::Cpu, None).unwrap();
    let first = report.losses[0];
    let last5 = report.losses[report.losses.len() - 5..].iter().sum::<f32>() / 5.0;
    println!(
        "bf16: loss {first} -> {last5}, held-out {} -> {}",
        report.held_out_before, report.held_out_after
    );
    assert!((first - (corpus.vocab_size() as f32).ln()).abs() < 0.1);
    assert!(last5 < report.unigram as f32, "{last5}");
    assert!(report.held_out_after < report.held_out_before - 0.8);
}

/// Mixed precision keeps updates smaller than a bf16 ulp: ten AdamW steps
/// of at most 1e-4 each move the f32 master of a weight at 1.0 by their
/// learning rates' sum, which the bf16 copy (2^-8 apart below 1.0) does
/// not show yet; the copy is always the master rounded to bf16. A bf16
/// optimizer alone loses them all.
#[test]
fn master_weights_keep_updates_below_a_bf16_ulp() {
    use candle_core::Var;
    use candle_nn::{Optimizer, ParamsAdamW};
    use examples::train::Optim;
    use remat_runtime::candle_nn::AdamW;
    let dev = Device::Cpu;
    let opts = Options {
        lr: 1e-4,
        lr_warmup: 0,
        steps: 10,
        clip: 0.0,
        ..tiny()
    };
    let compute = Var::ones(4, DType::BF16, &dev).unwrap();
    let alone = Var::ones(4, DType::BF16, &dev).unwrap();
    let mut mixed = Optim::new(vec![compute.clone()], &opts).unwrap();
    let mut pure = AdamW::new(
        vec![alone.clone()],
        ParamsAdamW {
            lr: opts.lr,
            weight_decay: 0.01,
            ..Default::default()
        },
    )
    .unwrap();
    let master = mixed.master(&compute).unwrap().clone();
    assert_eq!(master.dtype(), DType::F32);
    for step in 0..10 {
        let mut grads = compute.as_tensor().sum_all().unwrap().backward().unwrap();
        mixed.step(step, &mut grads).unwrap();
        pure.set_learning_rate(examples::train::learning_rate(&opts, step));
        let grads = alone.as_tensor().sum_all().unwrap().backward().unwrap();
        pure.step(&grads).unwrap();
        let rounded = master.as_tensor().to_dtype(DType::BF16).unwrap();
        assert_eq!(f32s(compute.as_tensor()), f32s(&rounded));
    }
    // Each step moves it by its learning rate (AdamW's normalised step of a
    // constant gradient is 1) and decays it by 1% of that.
    let moved: f64 = (0..10)
        .map(|s| examples::train::learning_rate(&opts, s))
        .sum();
    let m = f32s(master.as_tensor());
    let expected = (1.0 - 1.01 * moved) as f32;
    assert!(moved > 5e-4);
    assert!(
        m.iter().all(|&w| (w - expected).abs() < 1e-5),
        "{m:?} {expected}"
    );
    assert_eq!(f32s(compute.as_tensor()), vec![1.0; 4]);
    assert_eq!(f32s(alone.as_tensor()), vec![1.0; 4]);
    // Ten larger steps take the master across a bf16 step: the copy
    // follows it, rounded.
    let faster = Options { lr: 1e-3, ..opts };
    let mut mixed = Optim::new(vec![compute.clone()], &faster).unwrap();
    let master = mixed.master(&compute).unwrap().clone();
    for step in 0..10 {
        let mut grads = compute.as_tensor().sum_all().unwrap().backward().unwrap();
        mixed.step(step, &mut grads).unwrap();
    }
    let rounded = master.as_tensor().to_dtype(DType::BF16).unwrap();
    assert_eq!(f32s(compute.as_tensor()), f32s(&rounded));
    assert!(f32s(compute.as_tensor()).iter().all(|&w| w < 1.0));
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().to_vec1().unwrap()
}

/// Largest |a - b| / largest |b|.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap();
    let s = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
    let d = d.to_scalar::<f32>().unwrap() as f64;
    if d == 0.0 {
        0.0
    } else {
        d / s.to_scalar::<f32>().unwrap() as f64
    }
}

#[test]
fn every_policy_gives_plain_candle_gradients() {
    let corpus = Corpus::new(&default_text());
    let config = Config {
        vocab: corpus.vocab_size(),
        layers: 2,
        d_model: 32,
        heads: 4,
        seq: 16,
    };
    let (x, y) = Corpus::batch(&corpus.train, 4, 16, &mut Rng::new(4), &Device::Cpu).unwrap();
    let mut plain = Vec::new();
    for ops in [Ops::Fused, Ops::Composed] {
        let mut model = Gpt::new(config, &mut Rng::new(3), &Device::Cpu).unwrap();
        model.ops = ops;
        let run = |c: Checkpointing| {
            let loss = c.plan().scope(|| model.loss(&x, &y)).unwrap();
            let grads = loss.backward().unwrap();
            let g: Vec<Tensor> = model
                .vars()
                .iter()
                .map(|v| grads.get(v).unwrap().clone())
                .collect();
            (loss.to_scalar::<f32>().unwrap(), g)
        };
        let (loss0, g0) = run(Checkpointing::None);
        let policies = [
            Checkpointing::Full,
            Checkpointing::Selective,
            Checkpointing::Offload,
            Checkpointing::SaveAll,
        ];
        // Offload twice: kept as saved on this CPU, then moved to the tape's
        // host store and back as on a GPU.
        let moved = || remat_runtime::offload::swap_on_cpu(|| run(Checkpointing::Offload));
        for (c, (loss, g)) in policies
            .iter()
            .map(|&c| (c, run(c)))
            .chain([(Checkpointing::Offload, moved())])
        {
            assert_eq!(
                loss, loss0,
                "{ops}, {c}: the forward is the same computation"
            );
            // f32 sums of gradient contributions are reordered across units:
            // 1e-6 relative, as in remat-runtime's gradient tests.
            let worst = g
                .iter()
                .zip(&g0)
                .map(|(a, b)| rel(a, b))
                .fold(0.0, f64::max);
            assert!(worst <= 1e-6, "{ops}, {c}: {worst}");
        }
        plain.push((loss0, g0));
    }
    // The fused ops compute the composed ops' formulas, reassociated (a
    // blocked softmax, fused sums): the same loss and gradients to f32
    // rounding, 1e-5 relative (remat-runtime/tests/it/nn.rs, per op).
    let ((fused_loss, fused), (composed_loss, composed)) = (&plain[0], &plain[1]);
    assert!((fused_loss - composed_loss).abs() <= 1e-5 * composed_loss.abs());
    let worst = fused
        .iter()
        .zip(composed)
        .map(|(a, b)| rel(a, b))
        .fold(0.0, f64::max);
    assert!(worst <= 1e-5, "fused against composed: {worst}");
}

#[test]
fn dump_writes_a_step_that_plain_candle_reproduces() {
    let dir = std::env::temp_dir().join(format!("remat-dump-{}", std::process::id()));
    let corpus = Corpus::new(&default_text());
    let opts = Options {
        steps: 1,
        sample: 0,
        dump: Some(dir.clone()),
        policy: Checkpointing::Full,
        ..tiny()
    };
    train(&corpus, &opts, &Device::Cpu, None).unwrap();
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let load = |f: &str| -> HashMap<String, Tensor> {
        candle_core::safetensors::load(dir.join(f), &Device::Cpu).unwrap()
    };
    let (weights, batch, grads) = (
        load("weights.safetensors"),
        load("batch.safetensors"),
        load("grads.safetensors"),
    );
    assert_eq!(manifest["config"]["layers"], 2);
    assert_eq!(manifest["policy"], "full");
    assert_eq!(manifest["weights"].as_array().unwrap().len(), weights.len());
    assert_eq!(weights.len(), grads.len());
    // Rebuild the model from the dumped weights and recompute the step with
    // plain candle: same loss, same gradients.
    let config = Config {
        vocab: corpus.vocab_size(),
        layers: 2,
        d_model: 32,
        heads: 2,
        seq: 16,
    };
    let model = Gpt::new(config, &mut Rng::new(99), &Device::Cpu).unwrap();
    for (name, var) in model.named_vars() {
        var.set(&weights[&name]).unwrap();
    }
    let loss = remat_runtime::Plan::off()
        .scope(|| model.loss(&batch["ids"], &batch["targets"]))
        .unwrap();
    let dumped_loss = manifest["loss"].as_f64().unwrap() as f32;
    assert_eq!(loss.to_scalar::<f32>().unwrap(), dumped_loss);
    let g = loss.backward().unwrap();
    for (name, var) in model.named_vars() {
        let d = rel(g.get(&var).unwrap(), &grads[&name]);
        assert!(d <= 1e-6, "{name}: {d}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
