#!/usr/bin/env python3
"""Hugging Face transformers' Qwen2ForCausalLM at the qwen2 example's
`--preset qwen2.5-0.5b` shape, for docs/performance.md: one forward +
backward of one batch per (gradient checkpointing, head), measured the way
`qwen2 --peaks` measures remat (peak over what was in use before, the
parameters' gradients included).

    pip install torch transformers
    MALLOC_MMAP_THRESHOLD_=65536 python3 scripts/qwen_reference.py --batch 1 --seq 128
    MALLOC_MMAP_THRESHOLD_=65536 python3 scripts/qwen_reference.py --batch 4 --seq 512 \
        --checkpointing on --attempts 1

Heads: `plain` is the model's own loss (`labels=`: the `(B, T, V)` logits,
upcast to f32); `chunked` computes the loss from the final hidden states
over chunks of tokens, each chunk's logits recomputed in the backward
(`torch.utils.checkpoint` per chunk), the usual way to avoid the logits in
PyTorch without a fused kernel. Peak: the process's peak resident set
(`VmHWM`, reset through /proc/self/clear_refs) minus the resident set
before; with MALLOC_MMAP_THRESHOLD_=65536 every tensor of 64 KiB or more is
its own mapping, returned when freed, so the resident set follows the live
tensors.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import Qwen2Config, Qwen2ForCausalLM

from torch_reference import reset_peak_rss, rss  # scripts/, beside this one


def chunk_loss(hidden, weight, targets, start, end):
    logits = hidden[start:end] @ weight.t()
    return F.cross_entropy(logits.float(), targets[start:end], reduction="sum")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=64, help="tokens per chunk of the chunked head")
    ap.add_argument("--checkpointing", default="off,on", help="gradient checkpointing: off, on or both")
    ap.add_argument("--heads", default="plain,chunked", help="plain, chunked or both")
    ap.add_argument("--attempts", type=int, default=2,
                    help="runs of each, the last measured (the first warms the allocator)")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).float()
    model.train()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 94, (a.batch, a.seq))
    targets = torch.randint(0, 94, (a.batch, a.seq))
    mib = 1 << 20
    print(f"transformers Qwen2ForCausalLM, Qwen2.5-0.5B's config, {params} parameters, f32, "
          f"{config._attn_implementation} attention, batch {a.batch} x {a.seq} tokens, "
          f"torch {torch.__version__} ({a.threads} threads); logits (B, T, V) in f32 would be "
          f"{a.batch * a.seq * 151936 * 4 / mib:.1f} MiB\n")
    print("| gradient checkpointing | head | peak of forward + backward (MiB) | time (s) | loss |")
    print("|---|---|---:|---:|---:|")
    for gc in [g == "on" for g in a.checkpointing.split(",")]:
        if gc:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        for head in a.heads.split(","):
            for _ in range(a.attempts):
                model.zero_grad(set_to_none=True)
                base = rss("VmRSS")
                reset_peak_rss()
                start = time.perf_counter()
                if head == "plain":
                    # The model's labels are shifted inside; pass the next
                    # tokens as they are instead, through the same loss.
                    logits = model(input_ids=ids).logits
                    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                    del logits
                else:
                    hidden = model.model(input_ids=ids).last_hidden_state.flatten(0, 1)
                    flat = targets.flatten()
                    w = model.lm_head.weight
                    n = flat.numel()
                    loss = sum(checkpoint(chunk_loss, hidden, w, flat, s, min(s + a.chunk, n),
                                          use_reentrant=False)
                               for s in range(0, n, a.chunk)) / n
                loss.backward()
                seconds = time.perf_counter() - start
                value = loss.item()
                del loss
                peak = rss("VmHWM") - base
            print(f"| {'on' if gc else 'off'} | {head} | {peak / mib:.1f} | {seconds:.1f} | {value:.4f} |")


if __name__ == "__main__":
    main()
