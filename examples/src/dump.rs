//! `--dump DIR`: everything another framework needs to reproduce one
//! training step exactly, as safetensors files and a JSON manifest.

use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor};
use serde::Serialize;

use crate::gpt::{Config, Gpt};

#[derive(Serialize)]
struct Entry {
    name: String,
    shape: Vec<usize>,
    dtype: String,
}

#[derive(Serialize)]
struct Manifest<'a> {
    format: &'static str,
    model: &'static str,
    config: Config,
    policy: String,
    vocab: String,
    loss: f32,
    files: [&'static str; 3],
    weights: Vec<Entry>,
    batch: Vec<Entry>,
    grads: Vec<Entry>,
    notes: &'a str,
}

const NOTES: &str = "GPT-2 style, pre-norm. Linear weights are (in, out): y = x @ w + b. \
LayerNorm eps 1e-5 (biased variance), GELU tanh approximation, causal softmax attention \
scaled by 1/sqrt(head_dim), heads split from qkv as [q | k | v] along the last dim. \
logits = ln_f(x) @ head.w + head.b; loss = mean cross-entropy over all B*T tokens (nats). \
Token ids index `vocab` (a string of the characters, in id order). Gradients are of that loss.";

fn entries(tensors: &[(String, Tensor)]) -> Vec<Entry> {
    tensors
        .iter()
        .map(|(n, t)| Entry {
            name: n.clone(),
            shape: t.dims().to_vec(),
            dtype: format!("{:?}", t.dtype()),
        })
        .collect()
}

fn save(tensors: &[(String, Tensor)], path: &Path) -> Result<()> {
    let map: HashMap<String, Tensor> = tensors.iter().cloned().collect();
    candle_core::safetensors::save(&map, path)
}

/// Writes `weights.safetensors` (the weights before the step),
/// `batch.safetensors` (`ids`, `targets`), `grads.safetensors` (the gradient
/// of every weight, same names) and `manifest.json` into `dir`.
#[allow(clippy::too_many_arguments)]
pub fn dump(
    dir: &Path,
    model: &Gpt,
    weights: &[(String, Tensor)],
    vocab: &[char],
    policy: &str,
    ids: &Tensor,
    targets: &Tensor,
    loss: f32,
    grads: &GradStore,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let batch = vec![
        ("ids".to_string(), ids.clone()),
        ("targets".to_string(), targets.clone()),
    ];
    let grads = model
        .named_vars()
        .into_iter()
        .map(|(n, v)| {
            let g = grads.get(&v).cloned().ok_or_else(|| {
                candle_core::Error::Msg(format!("parameter `{n}` received no gradient"))
            })?;
            Ok((n, g))
        })
        .collect::<Result<Vec<_>>>()?;
    save(weights, &dir.join("weights.safetensors"))?;
    save(&batch, &dir.join("batch.safetensors"))?;
    save(&grads, &dir.join("grads.safetensors"))?;
    let manifest = Manifest {
        format: "remat train_gpt dump v1",
        model: "gpt2-char",
        config: model.config,
        policy: policy.to_string(),
        vocab: vocab.iter().collect(),
        loss,
        files: [
            "weights.safetensors",
            "batch.safetensors",
            "grads.safetensors",
        ],
        weights: entries(weights),
        batch: entries(&batch),
        grads: entries(&grads),
        notes: NOTES,
    };
    let json = serde_json::to_string_pretty(&manifest).map_err(candle_core::Error::wrap)?;
    std::fs::write(dir.join("manifest.json"), json)?;
    Ok(())
}
