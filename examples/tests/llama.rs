//! The LLaMA example: weights saved with `VarMap::save` reload bit for bit,
//! every policy gives plain candle's gradients, and the guide's walk-through
//! is this example's code.

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use examples::data::Corpus;
use examples::gpt::Checkpointing;
use examples::llama::{
    decoder_layer, init_weights, named_vars, Config, DecoderLayer, Llama, SELECTIVE,
};
use examples::rng::Rng;
use examples::train::{Optim, Options};
use remat_runtime::Plan;

const TEXT: &str = "\
Activation checkpointing trades compute for memory. During the forward pass, \
a checkpointed block keeps only its inputs; during the backward pass, it runs \
the block again to rebuild the activations it needs. ";

fn tiny(corpus: &Corpus) -> Config {
    Config {
        hidden: 32,
        intermediate: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        ..Config::small(corpus.vocab_size(), 16)
    }
}

fn model(config: Config, dtype: DType, seed: u64) -> (VarMap, Llama) {
    let varmap = VarMap::new();
    let model = Llama::new(
        config,
        VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu),
    )
    .unwrap();
    init_weights(&varmap, config.layers, &mut Rng::new(seed)).unwrap();
    (varmap, model)
}

fn selective() -> Plan {
    Plan::save_only(SELECTIVE.iter().copied())
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn saved_weights_reload_bit_identically() {
    let corpus = Corpus::new(&TEXT.repeat(4));
    let config = tiny(&corpus);
    let opts = Options {
        seq: 16,
        batch: 4,
        steps: 3,
        lr_warmup: 1,
        ..Options::default()
    };
    let (varmap, trained) = model(config, DType::F32, 1);
    let mut optim = Optim::new(varmap.all_vars(), &opts).unwrap();
    let mut rng = Rng::new(2);
    let mut losses = Vec::new();
    for step in 0..opts.steps {
        let (x, y) = Corpus::batch(&corpus.train, 4, 16, &mut rng, &Device::Cpu).unwrap();
        let loss = selective().scope(|| trained.loss(&x, &y)).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        optim.step(step, &mut loss.backward().unwrap()).unwrap();
    }
    assert!(losses[2] < losses[0], "training moved nothing: {losses:?}");
    let path = std::env::temp_dir().join(format!("remat-llama-{}.safetensors", std::process::id()));
    varmap.save(&path).unwrap();

    // A fresh model with other weights, then the checkpoint loaded into it.
    let (mut fresh_map, fresh) = model(config, DType::F32, 99);
    let (x, y) = Corpus::batch(&corpus.train, 4, 16, &mut Rng::new(5), &Device::Cpu).unwrap();
    let before = Plan::off().scope(|| fresh.loss(&x, &y)).unwrap();
    fresh_map.load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let weights = |map: &VarMap| {
        named_vars(map)
            .unwrap()
            .into_iter()
            .map(|(n, v)| (n, values(v.as_tensor())))
            .collect::<Vec<_>>()
    };
    assert!(
        weights(&fresh_map) == weights(&varmap),
        "the loaded weights differ"
    );
    for plan in [Plan::off(), selective(), Plan::recompute_all()] {
        let want = plan.scope(|| trained.loss(&x, &y)).unwrap();
        let got = plan.scope(|| fresh.loss(&x, &y)).unwrap();
        assert_eq!(values(&got), values(&want), "{plan}");
        assert_ne!(
            values(&before),
            values(&want),
            "the fresh model already had the weights"
        );
    }
}

/// One decoder layer composed from candle's own ops, independently of the
/// example: `rms_norm_slow`, `rope_slow` over tables computed here in f64,
/// candle-transformers' `repeat_kv` (a `cat` of the heads), softmax
/// attention, `silu(gate) * up`.
fn reference_layer(x: &Tensor, p: &DecoderLayer, c: &Config, mask: &Tensor) -> Tensor {
    let (b, t, _) = x.dims3().unwrap();
    let d = c.hidden / c.heads;
    let eps = c.eps as f32;
    let rms = |x: &Tensor, w: &Tensor| candle_nn::ops::rms_norm_slow(x, w, eps).unwrap();
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for pos in 0..t {
        for i in 0..d / 2 {
            let angle = pos as f64 / c.rope_theta.powf(2.0 * i as f64 / d as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let cos = Tensor::from_vec(cos, (t, d / 2), &Device::Cpu).unwrap();
    let sin = Tensor::from_vec(sin, (t, d / 2), &Device::Cpu).unwrap();
    let heads = |x: Tensor, n: usize| {
        x.reshape((b, t, n, d))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let repeat = |x: Tensor| {
        let n = c.heads / c.kv_heads;
        Tensor::cat(&vec![&x; n], 2)
            .unwrap()
            .reshape((b, c.heads, t, d))
            .unwrap()
    };
    let a = &p.self_attn;
    let h = rms(x, &p.input_layernorm.weight);
    let rope = |x: Tensor| candle_nn::rotary_emb::rope_slow(&x, &cos, &sin).unwrap();
    let q = rope(heads(a.q_proj.forward(&h).unwrap(), c.heads));
    let k = repeat(rope(heads(a.k_proj.forward(&h).unwrap(), c.kv_heads)));
    let v = repeat(heads(a.v_proj.forward(&h).unwrap(), c.kv_heads));
    let scores = (q.matmul(&k.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
    let probs = candle_nn::ops::softmax(&scores.broadcast_add(mask).unwrap(), D::Minus1).unwrap();
    let att = probs
        .matmul(&v)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((b, t, c.hidden))
        .unwrap();
    let x = (x + a.o_proj.forward(&att).unwrap()).unwrap();
    let h = rms(&x, &p.post_attention_layernorm.weight);
    let gate = candle_nn::ops::silu(&p.mlp.gate_proj.forward(&h).unwrap()).unwrap();
    let mlp = (gate * p.mlp.up_proj.forward(&h).unwrap()).unwrap();
    (x + p.mlp.down_proj.forward(&mlp).unwrap()).unwrap()
}

#[test]
fn a_decoder_layer_computes_what_candle_s_composed_ops_compute() {
    let corpus = Corpus::new(&TEXT.repeat(4));
    let config = tiny(&corpus);
    let (_, llama) = model(config, DType::F32, 7);
    let x = Tensor::randn(0f32, 1.0, (2, 16, config.hidden), &Device::Cpu).unwrap();
    let mask = examples::gpt::causal_mask(16, &Device::Cpu).unwrap();
    let layer = &llama.layers[1];
    let got = Plan::off()
        .scope(|| decoder_layer(&x, layer, &llama.rotary, Some(&mask)))
        .unwrap();
    let want = reference_layer(&x, layer, &config, &mask);
    // The fused ops against the composed ones: 1e-5 relative, as each op in
    // remat-runtime/tests/it/nn.rs.
    let r = rel(&got, &want);
    assert!(r <= 1e-5, "{r}");
}

#[test]
fn selective_saves_the_outputs_of_the_matrix_products() {
    let corpus = Corpus::new(&TEXT.repeat(4));
    let (_, llama) = model(tiny(&corpus), DType::F32, 8);
    let (x, y) = Corpus::batch(&corpus.train, 2, 16, &mut Rng::new(1), &Device::Cpu).unwrap();
    let loss = selective().scope(|| llama.loss(&x, &y)).unwrap();
    let report = remat_runtime::MemoryReport::capture();
    let saved: Vec<&str> = report
        .entries
        .iter()
        .filter(|e| e.region == "decoder_layer" && e.call == 0 && e.bytes > 0)
        .map(|e| e.statement.as_str())
        .filter(|s| !s.starts_with('('))
        .collect();
    assert_eq!(saved, SELECTIVE);
    loss.backward().unwrap();
}

/// Largest |a - b| / largest |b|.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (values(a), values(b));
    let d = a
        .iter()
        .zip(&b)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let s = b.iter().map(|b| b.abs()).fold(0f32, f32::max);
    if d == 0.0 {
        0.0
    } else {
        (d / s) as f64
    }
}

#[test]
fn every_policy_gives_plain_candle_gradients() {
    for dtype in [DType::F32, DType::BF16] {
        policies_against_plain(dtype);
    }
}

fn policies_against_plain(dtype: DType) {
    let corpus = Corpus::new(&TEXT.repeat(4));
    let config = tiny(&corpus);
    let (x, y) = Corpus::batch(&corpus.train, 4, 16, &mut Rng::new(4), &Device::Cpu).unwrap();
    let (varmap, llama) = model(config, dtype, 3);
    let named = named_vars(&varmap).unwrap();
    let run = |plan: Plan| {
        let loss = plan.scope(|| llama.loss(&x, &y)).unwrap();
        let grads = loss.backward().unwrap();
        remat_runtime::check_gradients(&grads, named.iter().map(|(n, v)| (n.as_str(), v))).unwrap();
        let g: Vec<Tensor> = named
            .iter()
            .map(|(_, v)| grads.get(v).unwrap().clone())
            .collect();
        (loss.to_scalar::<f32>().unwrap(), g)
    };
    let (loss0, g0) = run(Plan::off());
    // Sums of gradient contributions are reordered across units: 1e-6
    // relative in f32, as in remat-runtime's gradient tests; in bf16 (8
    // bits of mantissa) one unit in the last place, 2^-8.
    let tolerance = if dtype == DType::F32 {
        1e-6
    } else {
        2f64.powi(-8)
    };
    for (name, plan) in [
        ("full", Plan::recompute_all()),
        ("selective", selective()),
        ("save-all", Plan::save_all()),
        ("budget=0.5", Checkpointing::Budget(0.5).plan()),
    ] {
        let (loss, g) = run(plan);
        assert_eq!(
            loss, loss0,
            "{dtype:?} {name}: the forward is the same computation"
        );
        for ((n, _), (a, b)) in named.iter().zip(g.iter().zip(&g0)) {
            let r = rel(a, b);
            assert!(r <= tolerance, "{dtype:?} {name}, {n}: {r}");
        }
    }
}

/// Every code block of the guide's "From `VarBuilder` to `remat!`" section,
/// and of README's "Use it in your model", is a piece of `examples/src/llama.rs` or of the `llama` program (which
/// compile, and are tested above): its lines, blank lines and indentation aside, appear there in
/// the same order, each run between `// ...` lines contiguously.
#[test]
fn the_guide_walks_through_this_example() {
    let guide = include_str!("../../docs/guide.md");
    let source: Vec<&str> = include_str!("../src/llama.rs")
        .lines()
        .chain(include_str!("../src/bin/llama.rs").lines())
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let readme = include_str!("../../README.md");
    let section = |doc: &'static str, title: &str| {
        doc.split("\n## ")
            .find(|s| s.starts_with(title))
            .unwrap_or_else(|| panic!("no section {title}"))
    };
    let blocks: Vec<&str> = [
        section(guide, "From `VarBuilder` to `remat!`"),
        section(readme, "Use it in your model"),
    ]
    .iter()
    .flat_map(|s| s.split("```rust").skip(1))
    .map(|b| b.split_once('\n').unwrap().1.split("```").next().unwrap())
    .collect();
    assert!(blocks.len() >= 6, "{} blocks", blocks.len());
    for block in blocks {
        let mut at = 0;
        for (i, run) in block.split("// ...").enumerate() {
            // What follows `// ...` on its line is a comment to the reader.
            let run = match i {
                0 => run,
                _ => run.split_once('\n').map_or("", |(_, rest)| rest),
            };
            assert!(!run.trim().is_empty(), "an empty excerpt in:\n{block}");
            let run: Vec<&str> = run
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            let found = (at..=source.len().saturating_sub(run.len()))
                .find(|&p| source[p..p + run.len()] == run[..]);
            let p = found.unwrap_or_else(|| {
                panic!(
                    "not in the llama example, in this order:\n{}",
                    run.join("\n")
                )
            });
            at = p + run.len();
        }
    }
}
