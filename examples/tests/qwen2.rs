//! The Qwen2 example: a tiny checkpoint in Hugging Face's layout loads
//! into trainable `Var`s and fine-tunes (every parameter gets a gradient,
//! the loss falls), saves and reloads bit for bit, each decoder layer
//! computes what candle's composed ops compute, every policy gives plain
//! candle's gradients, the program runs from the README's command, and the
//! guide's code is this example's.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor, D};
use examples::data::Corpus;
use examples::gpt::Checkpointing;
use examples::qwen2::{self, named_vars, Config, DecoderLayer, Loaded, SELECTIVE};
use examples::rng::Rng;
use examples::train::{Optim, Options};
use remat_runtime::Plan;

const TEXT: &str = "\
Activation checkpointing trades compute for memory. During the forward pass, \
a checkpointed block keeps only its inputs; during the backward pass, it runs \
the block again to rebuild the activations it needs. ";

/// A fresh directory under the system's temporary one, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("remat-qwen2-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tiny_config(vocab_size: usize, tied: bool) -> Config {
    Config {
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 32,
        tie_word_embeddings: tied,
        ..Config::tiny(vocab_size)
    }
}

/// Writes a tiny checkpoint of [`TEXT`]'s characters into `dir`.
fn write_checkpoint(dir: &Path, tied: bool, seed: u64) -> Config {
    let tokenizer = qwen2::char_tokenizer(TEXT).unwrap();
    let config = tiny_config(tokenizer.get_vocab_size(true), tied);
    qwen2::write_tiny_checkpoint(dir, &config, &tokenizer, &mut Rng::new(seed)).unwrap();
    config
}

fn corpus(dir: &Path) -> Corpus {
    let tokenizer = qwen2::read_tokenizer(dir).unwrap();
    qwen2::split(&qwen2::encode(&tokenizer, &TEXT.repeat(4)).unwrap())
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Largest |a - b| / largest |b|; the shapes must be equal and every
/// value finite.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (values(a), values(b));
    assert!(
        a.iter().chain(&b).all(|x| x.is_finite()),
        "a value is not finite"
    );
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
fn a_tiny_checkpoint_is_in_hugging_face_s_layout() {
    for tied in [true, false] {
        let dir = TempDir::new(&format!("layout-{tied}"));
        let config = write_checkpoint(&dir.0, tied, 1);
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.0.join("config.json")).unwrap())
                .unwrap();
        for key in [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "rope_theta",
            "rms_norm_eps",
            "tie_word_embeddings",
            "hidden_act",
        ] {
            assert!(json.get(key).is_some(), "config.json has no {key}");
        }
        assert_eq!(json["model_type"], "qwen2");
        assert_eq!(json["hidden_act"], "silu");
        assert_eq!(json["torch_dtype"], "bfloat16");
        assert_eq!(qwen2::read_config(&dir.0).unwrap(), config);
        let tensors = qwen2::read_tensors(&dir.0.join("model.safetensors")).unwrap();
        let mut names: Vec<&str> = tensors.keys().map(String::as_str).collect();
        names.sort();
        let mut want = vec!["model.embed_tokens.weight", "model.norm.weight"];
        let per_layer = [
            "input_layernorm.weight",
            "mlp.down_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "post_attention_layernorm.weight",
            "self_attn.k_proj.bias",
            "self_attn.k_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_proj.bias",
            "self_attn.q_proj.weight",
            "self_attn.v_proj.bias",
            "self_attn.v_proj.weight",
        ];
        let layers: Vec<String> = (0..2)
            .flat_map(|i| per_layer.map(|p| format!("model.layers.{i}.{p}")))
            .collect();
        want.extend(layers.iter().map(String::as_str));
        if !tied {
            want.push("lm_head.weight");
        }
        want.sort();
        assert_eq!(names, want);
        assert!(tensors.values().all(|t| t.dtype() == DType::BF16));
        assert_eq!(
            tensors["model.layers.1.self_attn.k_proj.weight"].dims(),
            [2 * 8, 32],
            "2 key/value heads of 8"
        );
        // One token per character.
        let tokenizer = qwen2::read_tokenizer(&dir.0).unwrap();
        assert_eq!(
            qwen2::encode(&tokenizer, TEXT).unwrap().len(),
            TEXT.chars().count()
        );
    }
}

/// Loads `dir`, trains `steps` steps under `plan` on `corpus` and returns
/// the losses; fails unless every parameter gets a gradient.
fn fine_tune(loaded: &Loaded, corpus: &Corpus, plan: &Plan, steps: usize) -> Vec<f32> {
    let opts = Options {
        seq: 16,
        batch: 4,
        steps,
        lr: 1e-2,
        lr_warmup: 2,
        ..Options::default()
    };
    let named = named_vars(&loaded.varmap).unwrap();
    let mut optim = Optim::new(named.iter().map(|(_, v)| v.clone()).collect(), &opts).unwrap();
    let mut rng = Rng::new(2);
    let mut losses = Vec::new();
    for step in 0..steps {
        let (x, y) = Corpus::batch(&corpus.train, 4, 16, &mut rng, &Device::Cpu).unwrap();
        let loss = plan.scope(|| loaded.model.loss(&x, &y)).unwrap();
        let mut grads = loss.backward().unwrap();
        remat_runtime::check_gradients(&grads, named.iter().map(|(n, v)| (n.as_str(), v))).unwrap();
        losses.push(
            loss.to_dtype(DType::F32)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
        );
        optim.step(step, &mut grads).unwrap();
    }
    losses
}

#[test]
fn fine_tuning_a_checkpoint_trains_every_parameter_and_the_loss_falls() {
    for tied in [true, false] {
        let dir = TempDir::new(&format!("fine-tune-{tied}"));
        write_checkpoint(&dir.0, tied, 3);
        let loaded = qwen2::load(&dir.0, DType::F32, &Device::Cpu).unwrap();
        assert!(loaded.unused.is_empty(), "{:?}", loaded.unused);
        // 2 layers x 12 tensors, the embeddings, the final norm, and the
        // head unless it is the embeddings.
        let n = named_vars(&loaded.varmap).unwrap().len();
        assert_eq!(n, if tied { 26 } else { 27 });
        let losses = fine_tune(
            &loaded,
            &corpus(&dir.0),
            &qwen2::plan(Checkpointing::Selective),
            20,
        );
        let last: f32 = losses[17..].iter().sum::<f32>() / 3.0;
        assert!(last < losses[0] - 0.3, "tied {tied}: {losses:?}");
    }
}

#[test]
fn loaded_weights_are_the_file_s_and_a_saved_checkpoint_reloads_bit_for_bit() {
    let dir = TempDir::new("reload");
    write_checkpoint(&dir.0, true, 4);
    let file = qwen2::read_tensors(&dir.0.join("model.safetensors")).unwrap();
    let loaded = qwen2::load(&dir.0, DType::F32, &Device::Cpu).unwrap();
    for (name, var) in named_vars(&loaded.varmap).unwrap() {
        // bf16 to f32 is exact.
        assert_eq!(var.dtype(), DType::F32);
        assert_eq!(values(var.as_tensor()), values(&file[&name]), "{name}");
    }
    let corpus = corpus(&dir.0);
    fine_tune(&loaded, &corpus, &Plan::recompute_all(), 3);
    let saved = TempDir::new("reload-saved");
    qwen2::save(
        &saved.0,
        &loaded.config,
        &loaded.varmap,
        &dir.0.join("tokenizer.json"),
    )
    .unwrap();
    let again = qwen2::load(&saved.0, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(again.config, loaded.config);
    let weights = |l: &Loaded| {
        named_vars(&l.varmap)
            .unwrap()
            .into_iter()
            .map(|(n, v)| (n, values(v.as_tensor())))
            .collect::<Vec<_>>()
    };
    assert!(
        weights(&again) == weights(&loaded),
        "the reloaded weights differ"
    );
    assert!(
        weights(&again) != weights(&qwen2::load(&dir.0, DType::F32, &Device::Cpu).unwrap()),
        "training changed nothing"
    );
    let (x, y) = Corpus::batch(&corpus.train, 4, 16, &mut Rng::new(5), &Device::Cpu).unwrap();
    for plan in [
        Plan::off(),
        qwen2::plan(Checkpointing::Selective),
        Plan::recompute_all(),
    ] {
        let want = plan.scope(|| loaded.model.loss(&x, &y)).unwrap();
        let got = plan.scope(|| again.model.loss(&x, &y)).unwrap();
        assert_eq!(values(&got), values(&want), "{plan}");
    }
    // Saved again into its own directory, under another spelling of it:
    // the tokenizer is not copied onto itself (which would empty it).
    qwen2::save(
        &saved.0.join("."),
        &again.config,
        &again.varmap,
        &saved.0.join("tokenizer.json"),
    )
    .unwrap();
    assert!(qwen2::read_tokenizer(&saved.0).is_ok());
    // In bf16, the same weights rounded.
    let bf16 = qwen2::load(&saved.0, DType::BF16, &Device::Cpu).unwrap();
    assert!(named_vars(&bf16.varmap)
        .unwrap()
        .iter()
        .all(|(_, v)| v.dtype() == DType::BF16));
}

#[test]
fn a_broken_checkpoint_is_an_error_naming_what_is_wrong() {
    let dir = TempDir::new("broken");
    write_checkpoint(&dir.0, true, 5);
    let weights = dir.0.join("model.safetensors");
    let mut tensors = qwen2::read_tensors(&weights).unwrap();
    let name = "model.layers.1.self_attn.v_proj.bias";
    let bias = tensors.remove(name).unwrap();
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    let error = |dir: &Path| match qwen2::load(dir, DType::F32, &Device::Cpu) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.to_string(),
    };
    let e = error(&dir.0);
    assert!(e.contains(name), "{e}");
    tensors.insert(name.to_string(), Tensor::cat(&[&bias, &bias], 0).unwrap());
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    let e = error(&dir.0);
    assert!(e.contains(name) && e.contains("shape"), "{e}");
    let config = dir.0.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
    )
    .unwrap();
    let e = error(&dir.0);
    assert!(
        e.contains("config.json") && e.contains("num_key_value_heads 3"),
        "{e}"
    );
    std::fs::remove_file(&weights).unwrap();
    std::fs::write(&config, text).unwrap();
    let e = error(&dir.0);
    assert!(e.contains("model.safetensors.index.json"), "{e}");
}

/// A checkpoint split into shards, as large Hub models are, with an
/// index naming the shard of each tensor.
#[test]
fn sharded_weights_load_through_their_index() {
    let dir = TempDir::new("shards");
    write_checkpoint(&dir.0, false, 6);
    let weights = dir.0.join("model.safetensors");
    let tensors = qwen2::read_tensors(&weights).unwrap();
    std::fs::remove_file(&weights).unwrap();
    let mut shards = [
        std::collections::HashMap::new(),
        std::collections::HashMap::new(),
    ];
    let mut map = serde_json::Map::new();
    for (i, (name, t)) in tensors.iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i % 2 + 1);
        shards[i % 2].insert(name.clone(), t.clone());
        map.insert(name.clone(), file.into());
    }
    for (i, shard) in shards.iter().enumerate() {
        let file = dir
            .0
            .join(format!("model-0000{}-of-00002.safetensors", i + 1));
        candle_core::safetensors::save(shard, file).unwrap();
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(
        dir.0.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let loaded = qwen2::load(&dir.0, DType::F32, &Device::Cpu).unwrap();
    for (name, var) in named_vars(&loaded.varmap).unwrap() {
        assert_eq!(values(var.as_tensor()), values(&tensors[&name]), "{name}");
    }
}

/// One decoder layer composed from candle's own ops, independently of the
/// example: `rms_norm_slow`, `rope_slow` over tables computed here in f64,
/// repeated key/value heads, `softmax`, `silu(gate) * up`.
fn reference_layer(x: &Tensor, p: &DecoderLayer, c: &Config, mask: &Tensor) -> Tensor {
    let (b, t, _) = x.dims3().unwrap();
    let d = c.head_dim();
    let eps = c.rms_norm_eps as f32;
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
    let (h, kv) = (c.num_attention_heads, c.num_key_value_heads);
    // Query head j reads key/value head j / (h / kv).
    let repeat = |x: Tensor| {
        let groups: Vec<Tensor> = (0..h)
            .map(|j| x.narrow(1, j / (h / kv), 1).unwrap())
            .collect();
        Tensor::cat(&groups, 1).unwrap()
    };
    let a = &p.self_attn;
    let hs = rms(x, p.input_layernorm.weight());
    let rope = |x: Tensor| candle_nn::rotary_emb::rope_slow(&x, &cos, &sin).unwrap();
    let q = rope(heads(a.q_proj.forward(&hs).unwrap(), h));
    let k = repeat(rope(heads(a.k_proj.forward(&hs).unwrap(), kv)));
    let v = repeat(heads(a.v_proj.forward(&hs).unwrap(), kv));
    let scores = (q.matmul(&k.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
    let probs = candle_nn::ops::softmax(&scores.broadcast_add(mask).unwrap(), D::Minus1).unwrap();
    let att = probs
        .matmul(&v)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((b, t, c.hidden_size))
        .unwrap();
    let x = (x + a.o_proj.forward(&att).unwrap()).unwrap();
    let hs = rms(&x, p.post_attention_layernorm.weight());
    let gate = candle_nn::ops::silu(&p.mlp.gate_proj.forward(&hs).unwrap()).unwrap();
    let mlp = (gate * p.mlp.up_proj.forward(&hs).unwrap()).unwrap();
    (x + p.mlp.down_proj.forward(&mlp).unwrap()).unwrap()
}

#[test]
fn a_decoder_layer_computes_what_candle_s_composed_ops_compute() {
    let dir = TempDir::new("reference");
    write_checkpoint(&dir.0, true, 7);
    let loaded = qwen2::load(&dir.0, DType::F32, &Device::Cpu).unwrap();
    // Biases and gains other than the initial zeros and ones.
    for (i, (name, var)) in named_vars(&loaded.varmap).unwrap().into_iter().enumerate() {
        if name.ends_with("bias") || name.ends_with("norm.weight") {
            let noise = Tensor::from_vec(
                Rng::new(i as u64).normal(var.elem_count(), 0.3),
                var.shape(),
                &Device::Cpu,
            )
            .unwrap();
            let base = if name.ends_with("bias") { 0.0 } else { 1.0 };
            var.set(&(noise + base).unwrap()).unwrap();
        }
    }
    let x = Tensor::from_vec(
        Rng::new(1).normal(2 * 16 * 32, 1.0),
        (2, 16, 32),
        &Device::Cpu,
    )
    .unwrap();
    let mask = examples::gpt::causal_mask(16, &Device::Cpu).unwrap();
    let layer = &loaded.model.base_model.layers[1];
    for plan in [Plan::off(), Plan::recompute_all()] {
        let got = plan.scope(|| layer.forward(&x, Some(&mask))).unwrap();
        let want = reference_layer(&x, layer, &loaded.config, &mask);
        // The fused ops against the composed ones: 1e-5 relative, as each
        // op in remat-runtime/tests/it/nn.rs.
        let r = rel(&got, &want);
        assert!(r <= 1e-5, "{plan}: {r}");
    }
}

/// `forward_fused` (remat's fused attention, `linear_add` and
/// `swiglu_mlp`) is the same function of the same parameters as `forward`
/// (candle-transformers' composed ops): the output and every gradient, the
/// layer input's and each parameter's, under each plan.
#[test]
fn the_fused_layer_computes_the_composed_layer_and_its_gradients() {
    let dir = TempDir::new("fused-layer");
    write_checkpoint(&dir.0, true, 11);
    let loaded = qwen2::load(&dir.0, DType::F32, &Device::Cpu).unwrap();
    for (i, (name, var)) in named_vars(&loaded.varmap).unwrap().into_iter().enumerate() {
        if name.ends_with("bias") || name.ends_with("norm.weight") {
            let noise = Tensor::from_vec(
                Rng::new(100 + i as u64).normal(var.elem_count(), 0.3),
                var.shape(),
                &Device::Cpu,
            )
            .unwrap();
            let base = if name.ends_with("bias") { 0.0 } else { 1.0 };
            var.set(&(noise + base).unwrap()).unwrap();
        }
    }
    let named: Vec<_> = named_vars(&loaded.varmap)
        .unwrap()
        .into_iter()
        .filter(|(n, _)| n.contains("layers.1."))
        .collect();
    assert_eq!(named.len(), 12, "{named:?}");
    let x = candle_core::Var::from_vec(
        Rng::new(2).normal(2 * 16 * 32, 1.0),
        (2, 16, 32),
        &Device::Cpu,
    )
    .unwrap();
    let r = Tensor::from_vec(
        Rng::new(3).normal(2 * 16 * 32, 1.0),
        (2, 16, 32),
        &Device::Cpu,
    )
    .unwrap();
    let mask = examples::gpt::causal_mask(16, &Device::Cpu).unwrap();
    let layer = &loaded.model.base_model.layers[1];
    let run = |plan: Plan, fused: bool| {
        let y = plan
            .scope(|| {
                if fused {
                    layer.forward_fused(&x, Some(&mask))
                } else {
                    layer.forward(&x, Some(&mask))
                }
            })
            .unwrap();
        let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let mut g = vec![grads.get(&x).unwrap().clone()];
        g.extend(named.iter().map(|(n, v)| {
            grads
                .get(v)
                .unwrap_or_else(|| panic!("{n}: no gradient"))
                .clone()
        }));
        (y, g)
    };
    let (y0, g0) = run(Plan::off(), false);
    for plan in [
        Plan::off(),
        qwen2::plan_for(Checkpointing::Full, true),
        qwen2::plan_for(Checkpointing::Selective, true),
        Plan::save_all(),
    ] {
        let (y, g) = run(plan.clone(), true);
        // Fused ops against composed ones: 1e-5 relative, as each op in
        // remat-runtime/tests/it/nn.rs (other summation orders in f32).
        let ry = rel(&y, &y0);
        assert!(ry <= 1e-5, "{plan}: output {ry}");
        for (i, (a, b)) in g.iter().zip(&g0).enumerate() {
            let name = if i == 0 { "x" } else { named[i - 1].0.as_str() };
            let rg = rel(a, b);
            assert!(rg <= 1e-5, "{plan}, {name}: {rg}");
        }
    }
}

#[test]
fn selective_saves_the_outputs_of_the_matrix_products() {
    let dir = TempDir::new("selective");
    write_checkpoint(&dir.0, true, 8);
    let loaded = qwen2::load(&dir.0, DType::F32, &Device::Cpu).unwrap();
    let (x, y) =
        Corpus::batch(&corpus(&dir.0).train, 2, 16, &mut Rng::new(1), &Device::Cpu).unwrap();
    let loss = qwen2::plan(Checkpointing::Selective)
        .scope(|| loaded.model.loss(&x, &y))
        .unwrap();
    let report = remat_runtime::MemoryReport::capture();
    let saved: Vec<&str> = report
        .entries
        .iter()
        .filter(|e| e.region == "DecoderLayer::forward" && e.call == 0 && e.bytes > 0)
        .map(|e| e.statement.as_str())
        .filter(|s| !s.starts_with('('))
        .collect();
    assert_eq!(saved, SELECTIVE);
    loss.backward().unwrap();
}

#[test]
fn every_policy_gives_plain_candle_gradients() {
    let dir = TempDir::new("policies");
    write_checkpoint(&dir.0, false, 9);
    let corpus = corpus(&dir.0);
    let (x, y) = Corpus::batch(&corpus.train, 4, 16, &mut Rng::new(4), &Device::Cpu).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        // Sums of gradient contributions are reordered across units: 1e-6
        // relative in f32, as in remat-runtime's gradient tests; in bf16 (8
        // bits of mantissa) one unit in the last place, 2^-8.
        let tolerance = if dtype == DType::F32 {
            1e-6
        } else {
            2f64.powi(-8)
        };
        for fused_ops in [false, true] {
            let mut loaded = qwen2::load(&dir.0, dtype, &Device::Cpu).unwrap();
            loaded.model.base_model.fused_ops = fused_ops;
            let vars = named_vars(&loaded.varmap).unwrap();
            let run = |plan: Plan| {
                let loss = plan.scope(|| loaded.model.loss(&x, &y)).unwrap();
                let grads = loss.backward().unwrap();
                remat_runtime::check_gradients(&grads, vars.iter().map(|(n, v)| (n.as_str(), v)))
                    .unwrap();
                let g: Vec<Tensor> = vars
                    .iter()
                    .map(|(_, v)| grads.get(v).unwrap().clone())
                    .collect();
                (loss.to_scalar::<f32>().unwrap(), g)
            };
            // Each kind of layer against itself as plain candle.
            let (loss0, g0) = run(Plan::off());
            for policy in [
                Checkpointing::Full,
                Checkpointing::Selective,
                Checkpointing::SaveAll,
                Checkpointing::Budget(0.5),
            ] {
                let (loss, g) = run(qwen2::plan_for(policy, fused_ops));
                assert_eq!(
                    loss, loss0,
                    "{dtype:?} {policy} fused {fused_ops}: the forward is the same computation"
                );
                for ((n, _), (a, b)) in vars.iter().zip(g.iter().zip(&g0)) {
                    let r = rel(a, b);
                    assert!(
                        r <= tolerance,
                        "{dtype:?} {policy} fused {fused_ops}, {n}: {r}"
                    );
                }
            }
        }
    }
}

/// The program, run as the README runs it (smaller): it writes a tiny
/// checkpoint, fine-tunes it (every parameter with a gradient, the loss
/// falling) and saves it; `--init` continues from the save.
#[test]
fn the_program_fine_tunes_from_the_readme_command() {
    let tiny = TempDir::new("program-tiny");
    let saved = TempDir::new("program-saved");
    let program = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_qwen2"))
            .args(args)
            .args(["--batch", "4", "--seq", "16", "--lr", "0.01"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{args:?}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let (tiny_dir, saved_dir) = (tiny.0.to_str().unwrap(), saved.0.to_str().unwrap());
    let out = program(&[
        "--tiny-checkpoint",
        tiny_dir,
        "--layers",
        "1",
        "--hidden",
        "32",
        "--steps",
        "40",
        "--save",
        saved_dir,
    ]);
    assert!(out.contains("parameters have a gradient"), "{out}");
    let losses: Vec<f32> = out
        .lines()
        .find(|l| l.starts_with("training loss:"))
        .unwrap_or_else(|| panic!("{out}"))
        .split(' ')
        .filter_map(|w| w.trim_end_matches(',').parse().ok())
        .collect();
    assert!(losses[1] < losses[0] - 0.5, "{losses:?} in {out}");
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(saved.0.join(file).exists(), "{file}");
    }
    let out = program(&["--init", saved_dir, "--steps", "2", "--save", saved_dir]);
    assert!(out.contains("parameters have a gradient"), "{out}");
}

/// `--peaks`, as docs/performance.md runs it (smaller): a table row per
/// policy and head, the same loss for both heads, the fused head's largest
/// allocation below the composed head's (the logits); with `--update
/// in-backward`, the second step of each case.
#[test]
fn the_peaks_table_from_the_performance_commands() {
    let tiny = TempDir::new("peaks");
    let dir = tiny.0.to_str().unwrap();
    let shape = [
        "--layers", "1", "--hidden", "32", "--batch", "4", "--seq", "16",
    ];
    for extra in [&[][..], &["--update", "in-backward", "--clip", "0"][..]] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_qwen2"))
            .args([
                "--tiny-checkpoint",
                dir,
                "--peaks",
                "none,full",
                "--ops",
                "fused",
            ])
            .args(shape)
            .args(extra)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{extra:?}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // | policy | head | held | peak | largest | time | loss |
        let rows: Vec<Vec<String>> = stdout
            .lines()
            .filter(|l| l.starts_with("| none |") || l.starts_with("| full |"))
            .map(|l| l.split('|').map(|c| c.trim().to_string()).collect())
            .collect();
        assert_eq!(rows.len(), 4, "{stdout}");
        let inside = !extra.is_empty();
        assert_eq!(
            stdout.contains("With the update in the backward"),
            inside,
            "{stdout}"
        );
        let number = |row: &[String], i: usize| row[i].parse::<f64>().unwrap();
        for pair in rows.chunks(2) {
            assert_eq!(
                (pair[0][2].as_str(), pair[1][2].as_str()),
                ("composed", "fused")
            );
            // The same loss to the printed digits (after an update with
            // each head's own gradients: within 1e-3).
            let (a, b) = (number(&pair[0], 7), number(&pair[1], 7));
            assert!((a - b).abs() <= 1e-3, "{stdout}");
            assert!(number(&pair[0], 4) > 0.0 && number(&pair[1], 4) > 0.0);
            assert!(number(&pair[1], 5) <= number(&pair[0], 5), "{stdout}");
        }
    }
}

/// The model file takes candle-nn's backward-less ops from the drop-ins:
/// its `use` lines are candle-transformers', switched.
#[test]
fn the_model_file_uses_the_drop_ins() {
    let source = include_str!("../src/qwen2.rs");
    assert!(source.contains("use remat_runtime::candle_nn::{ops, rms_norm, rotary_emb, RmsNorm};"));
    for banned in [
        "candle_nn::ops::",
        "candle_nn::rotary_emb::",
        "candle_nn::RmsNorm",
        "candle_nn::rms_norm",
    ] {
        let uses: Vec<&str> = source
            .lines()
            .filter(|l| l.contains(banned) && !l.contains("remat_runtime::candle_nn"))
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect();
        assert!(uses.is_empty(), "{banned}: {uses:?}");
    }
}

/// Every code block of the guide's "From `VarBuilder` to `remat!`" and
/// "Checkpointing a candle-transformers model" sections, and of README's
/// "Use it in your model", is a piece of `examples/src/qwen2.rs` or of the
/// `qwen2` program (which compile, and are tested above): its lines, blank
/// lines and indentation aside, appear there in the same order, each run
/// between `// ...` lines contiguously.
#[test]
fn the_guide_walks_through_this_example() {
    let guide = include_str!("../../docs/guide.md");
    let source: Vec<&str> = include_str!("../src/qwen2.rs")
        .lines()
        .chain(include_str!("../src/bin/qwen2.rs").lines())
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
        section(guide, "Checkpointing a candle-transformers model"),
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
                    "not in the qwen2 example, in this order:\n{}",
                    run.join("\n")
                )
            });
            at = p + run.len();
        }
    }
}

#[test]
fn the_update_in_the_backward_trains_the_checkpoint_as_adamw_after_it() {
    use candle_nn::{AdamW, Optimizer, ParamsAdamW};
    use remat_runtime::OptimizerInBackward;
    let params = ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.01,
        ..Default::default()
    };
    for tied in [true, false] {
        let dir = TempDir::new(&format!("in-backward-{tied}"));
        write_checkpoint(&dir.0, tied, 5);
        let corpus = corpus(&dir.0);
        // Two copies of the same weights.
        let after = qwen2::load(&dir.0, DType::F32, &Device::Cpu).unwrap();
        let inside = qwen2::load(&dir.0, DType::F32, &Device::Cpu).unwrap();
        let mut adamw = AdamW::new(after.varmap.all_vars(), params.clone()).unwrap();
        let mut opt =
            OptimizerInBackward::<AdamW>::from_varmap(&inside.varmap, params.clone()).unwrap();
        let plan = qwen2::plan(Checkpointing::Full);
        let mut rng = Rng::new(4);
        for step in 0..4 {
            let (x, y) = Corpus::batch(&corpus.train, 4, 16, &mut rng, &Device::Cpu).unwrap();
            let a = plan.scope(|| after.model.loss(&x, &y)).unwrap();
            adamw.backward_step(&a).unwrap();
            let b = plan.scope(|| inside.model.loss(&x, &y)).unwrap();
            opt.backward_step(&b).unwrap();
            assert_eq!(values(&a), values(&b), "tied {tied}, step {step}");
            assert!(
                opt.without_gradient().is_empty(),
                "{:?}",
                opt.without_gradient()
            );
            // From the second step on, the layers' parameters are updated
            // inside the backward; a tied embedding, read by the plain head
            // too, after it.
            let layers = 2 * 12;
            let stepped = opt.stepped_in_backward();
            assert!(
                step == 0 || stepped >= layers,
                "tied {tied}, step {step}: {stepped}"
            );
            assert!(
                stepped < opt.len() || !tied,
                "tied {tied}: {stepped} of {}",
                opt.len()
            );
        }
        let weights = |l: &Loaded| {
            let mut w: Vec<(String, Vec<f32>)> = named_vars(&l.varmap)
                .unwrap()
                .into_iter()
                .map(|(n, v)| (n, values(v.as_tensor())))
                .collect();
            w.sort_by(|a, b| a.0.cmp(&b.0));
            w
        };
        assert!(weights(&after) == weights(&inside), "tied {tied}");
    }
}
