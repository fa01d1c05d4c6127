#!/usr/bin/env python3
"""Reproduces a `train_gpt --dump DIR` step in JAX and compares.

Reads DIR/manifest.json, weights.safetensors, batch.safetensors and
grads.safetensors, rebuilds the model from the manifest's notes in
jax.numpy, computes the loss and the gradient of every weight with
jax.grad, in float32 and in float64, and prints the largest relative
difference to candle's numbers per tensor. Exits 1 if the float32 loss or
any float32 gradient differs by more than --tol (relative to the largest
magnitude of the tensor).

    python3 -m venv .venv && .venv/bin/pip install "jax[cpu]" safetensors numpy
    cargo run --release -p examples --bin train_gpt -- --steps 1 --dump /tmp/step
    .venv/bin/python scripts/check_dump.py /tmp/step
"""

import argparse
import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402


def layer_norm(x, g, b):
    mean = x.mean(-1, keepdims=True)
    x = x - mean
    var = (x * x).mean(-1, keepdims=True)
    return x / jnp.sqrt(var + 1e-5) * g + b


def linear(x, p, name):
    return x @ p[name + ".w"] + p[name + ".b"]


def gelu(x):
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def loss_fn(p, ids, targets, cfg):
    b, t = ids.shape
    c, h = cfg["d_model"], cfg["heads"]
    d = c // h
    x = p["wte"][ids] + p["wpe"][:t]
    mask = jnp.where(jnp.arange(t)[None, :] > jnp.arange(t)[:, None], -jnp.inf, 0.0).astype(x.dtype)
    for i in range(cfg["layers"]):
        n = f"h.{i}"
        ln1 = layer_norm(x, p[n + ".ln1.g"], p[n + ".ln1.b"])
        qkv = linear(ln1, p, n + ".attn")
        q, k, v = (qkv[..., j * c:(j + 1) * c].reshape(b, t, h, d).transpose(0, 2, 1, 3) for j in range(3))
        scores = q @ k.transpose(0, 1, 3, 2) * (1.0 / math.sqrt(d)) + mask
        probs = jax.nn.softmax(scores, axis=-1)
        att = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
        x = x + linear(att, p, n + ".proj")
        ln2 = layer_norm(x, p[n + ".ln2.g"], p[n + ".ln2.b"])
        x = x + linear(gelu(linear(ln2, p, n + ".fc")), p, n + ".out")
    logits = linear(layer_norm(x, p["ln_f.g"], p["ln_f.b"]), p, "head")
    logp = jax.nn.log_softmax(logits.reshape(b * t, -1), axis=-1)
    return -jnp.take_along_axis(logp, targets.reshape(-1, 1), axis=1).mean()


def rel(a, b):
    scale = np.abs(b).max()
    return float(np.abs(a - b).max() / scale) if scale > 0 else float(np.abs(a - b).max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    manifest = json.loads((args.dir / "manifest.json").read_text())
    cfg = manifest["config"]
    weights = load_file(args.dir / "weights.safetensors")
    batch = load_file(args.dir / "batch.safetensors")
    grads = load_file(args.dir / "grads.safetensors")
    ids = jnp.asarray(batch["ids"].astype(np.int32))
    targets = jnp.asarray(batch["targets"].astype(np.int32))
    print(f"{manifest['model']} {cfg}, policy {manifest['policy']}, candle loss {manifest['loss']:.7f}")
    worst = {}
    for dtype in (jnp.float32, jnp.float64):
        p = {k: jnp.asarray(v, dtype=dtype) for k, v in weights.items()}
        loss, g = jax.value_and_grad(loss_fn)(p, ids, targets, cfg)
        name = jnp.dtype(dtype).name
        loss_rel = abs(float(loss) - manifest["loss"]) / abs(float(loss))
        per = {k: rel(grads[k].astype(np.float64), np.asarray(g[k], dtype=np.float64)) for k in weights}
        k_max = max(per, key=per.get)
        worst[name] = (loss_rel, per[k_max])
        print(f"JAX {name}: loss {float(loss):.7f} (rel. diff {loss_rel:.1e}); "
              f"largest gradient rel. diff {per[k_max]:.1e} ({k_max}) over {len(per)} tensors")
    ok = worst["float32"][0] <= args.tol and worst["float32"][1] <= args.tol
    print("OK" if ok else f"FAILED: above --tol {args.tol}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
