#!/usr/bin/env python3
"""PyTorch on the bench's GPT, for docs/performance.md: plain, full activation
checkpointing and selective checkpointing, measured the way the bench measures
remat (held after the forward, peak of forward + backward, median step time of
interleaved steps).

    pip install torch  # the CPU wheel is enough
    MALLOC_MMAP_THRESHOLD_=65536 python3 scripts/torch_reference.py --out docs/bench/torch
    MALLOC_MMAP_THRESHOLD_=65536 python3 scripts/torch_reference.py --out docs/bench/torch --with-update

The architecture is examples/src/gpt.rs's: token + position embedding, pre-norm
blocks (layer norm, qkv linear, explicit causal attention, projection, layer
norm, 4x MLP with tanh GELU), final layer norm, linear head, mean
cross-entropy; GPT-2 initialisation. Full AC wraps each block in
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`; SAC saves the
matmuls (`mm`, `addmm`, `bmm`) through `create_selective_checkpoint_contexts`
and recomputes the rest. `--attention sdpa` runs `F.scaled_dot_product_attention`
(causal) in place of the explicit attention.

Memory on a CPU: held = bytes in use by malloc (`mallinfo2`: `uordblks +
hblkhd`) after the forward minus before it; peak = the process's peak resident
set (`VmHWM`, reset through /proc/self/clear_refs before each step) minus the
resident set before the step. With MALLOC_MMAP_THRESHOLD_=65536 every tensor
of 64 KiB or more is its own mapping, returned when freed, so the resident set
follows the live tensors. On CUDA: `torch.cuda.memory_allocated` and
`max_memory_allocated`.
"""

import argparse
import ctypes
import functools
import math
import os
import statistics
import time

import torch
import torch.nn as tnn
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)


class Block(tnn.Module):
    def __init__(self, c, heads, layers, attention="eager"):
        super().__init__()
        self.heads = heads
        self.attention = attention
        self.ln1 = tnn.LayerNorm(c)
        self.attn = tnn.Linear(c, 3 * c)
        self.proj = tnn.Linear(c, c)
        self.ln2 = tnn.LayerNorm(c)
        self.fc = tnn.Linear(c, 4 * c)
        self.out = tnn.Linear(4 * c, c)
        for lin, std in [(self.attn, 0.02), (self.proj, 0.02 / math.sqrt(2 * layers)),
                         (self.fc, 0.02), (self.out, 0.02 / math.sqrt(2 * layers))]:
            tnn.init.normal_(lin.weight, std=std)
            tnn.init.zeros_(lin.bias)

    def forward(self, x, mask):
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = self.attn(h).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.attention == "sdpa":
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads) + mask
            att = scores.softmax(dim=-1) @ v
        att = att.transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(tnn.Module):
    def __init__(self, vocab, layers, c, heads, seq, attention="eager"):
        super().__init__()
        self.wte = tnn.Parameter(torch.randn(vocab, c) * 0.02)
        self.wpe = tnn.Parameter(torch.randn(seq, c) * 0.02)
        self.blocks = tnn.ModuleList(Block(c, heads, layers, attention) for _ in range(layers))
        self.ln_f = tnn.LayerNorm(c)
        self.head = tnn.Linear(c, vocab)
        tnn.init.normal_(self.head.weight, std=0.02)
        tnn.init.zeros_(self.head.bias)

    def forward(self, ids, targets, policy):
        t = ids.shape[1]
        mask = torch.full((t, t), float("-inf"), device=ids.device, dtype=self.wte.dtype).triu(1)
        x = self.wte[ids] + self.wpe[:t]
        for blk in self.blocks:
            if policy == "full":
                x = checkpoint(blk, x, mask, use_reentrant=False)
            elif policy == "selective":
                x = checkpoint(blk, x, mask, use_reentrant=False,
                               context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls))
            else:
                x = blk(x, mask)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = Mallinfo2


def malloc_in_use():
    m = LIBC.mallinfo2()
    return m.uordblks + m.hblkhd


def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_start(cuda):
    """Starts a peak measurement; returns its baseline."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    base = rss("VmRSS")
    reset_peak_rss()
    return base


def peak_since(cuda, base):
    """The peak since `peak_start` returned `base`, over it."""
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return rss("VmHWM") - base


def measure_update(model, ids, targets, cuda):
    """Peak of forward + backward + AdamW update, the update after the
    backward (`torch.optim.AdamW`) or in it (torchtune's optimizer in
    backward: one AdamW per parameter, stepped by a post-accumulate-grad
    hook), in the third step (the optimizer state exists)."""
    rows = []
    for policy in ["none", "full"]:
        for where in ["after", "in"]:
            hooks = []
            if where == "after":
                opt = torch.optim.AdamW(model.parameters())
            else:
                opts = {p: torch.optim.AdamW([p]) for p in model.parameters()}

                def step(p):
                    opts[p].step()
                    opts[p].zero_grad(set_to_none=True)

                hooks = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                base = peak_start(cuda)
                loss = model(ids, targets, policy)
                loss.backward()
                if where == "after":
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                del loss
                peak = peak_since(cuda, base)
            for h in hooks:
                h.remove()
            rows.append((policy, where, peak))
    return rows


def profile(model, ids, targets, a, cuda):
    """The ops (self time on the device, or on the CPU) that take the most of
    a step under none and full, from torch.profiler, in ms per step."""
    from torch.profiler import ProfilerActivity, profile as prof
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = [f"PyTorch {torch.__version__} profiler, GPT {a.layers} layers, d_model {a.d_model}, "
           f"{a.heads} heads, T {a.seq}, B {a.batch}, {a.dtype}, {a.attention} attention, {a.device}; "
           f"{a.warmup} warm-up + {a.steps} profiled steps each, ms per step"]
    for policy in ["none", "full"]:
        def step():
            model.zero_grad(set_to_none=True)
            model(ids, targets, policy).backward()
        for _ in range(a.warmup):
            step()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with prof(activities=activities) as p:
            for _ in range(a.steps):
                step()
            if cuda:
                torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / a.steps
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        events = p.key_averages()
        if cuda:
            # The device's own events (kernels, copies): an aten op's
            # "self" device time repeats its kernels'.
            from torch.autograd import DeviceType
            events = [e for e in events if e.device_type != DeviceType.CPU]
        ops = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)
        total = sum(getattr(e, key, 0) for e in ops) / 1e3 / a.steps
        out += ["", f"**{policy}**: step {wall:.1f} ms (profiled), {total:.1f} ms of "
                f"{'device' if cuda else 'CPU'} self time", "",
                "| op or kernel | calls per step | ms per step | share |", "|---|---:|---:|---:|"]
        for e in ops[:25]:
            ms = getattr(e, key, 0) / 1e3 / a.steps
            if ms <= 0:
                break
            out.append(f"| `{e.key[:90]}` | {e.count / a.steps:.0f} | {ms:.2f} | {100 * ms / total:.1f}% |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile.md"), "w") as f:
        f.write("\n".join(out) + "\n")
    print("\n".join(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=89)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/bench/torch")
    ap.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32",
                    help="the parameters' and activations' dtype (the loss in f32), as bench --dtype")
    ap.add_argument("--attention", choices=["eager", "sdpa"], default="eager",
                    help="explicit causal attention (the bench's) or F.scaled_dot_product_attention")
    ap.add_argument("--profile", action="store_true",
                    help="instead: torch.profiler over --steps steps of none and full, the ops and "
                         "device kernels that take the most time per step (profile.md), beside "
                         "bench --profile")
    ap.add_argument("--with-update", action="store_true",
                    help="instead: the peak of a step with its AdamW update, after or in the backward")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    model = Gpt(a.vocab, a.layers, a.d_model, a.heads, a.seq, a.attention).to(dev, dtype)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
    targets = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
    if a.with_update:
        rows = ["| policy | update | peak fwd+bwd+update (MiB) |", "|---|---|---:|"]
        for policy, where, peak in measure_update(model, ids, targets, cuda):
            update = "after the backward" if where == "after" else "in the backward (per-parameter hooks)"
            rows.append(f"| {policy} | {update} | {peak / (1 << 20):.1f} |")
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "update.md"), "w") as f:
            f.write(f"PyTorch {torch.__version__}, same shape, AdamW\n\n" + "\n".join(rows) + "\n")
        print("\n".join(rows))
        return
    if a.profile:
        profile(model, ids, targets, a, cuda)
        return
    policies = ["none", "full", "selective"]
    res = {p: {"times": [], "held": 0, "peak": 0} for p in policies}
    for step in range(a.warmup + a.steps):
        for i in range(len(policies)):
            p = policies[(step + i) % len(policies)]
            model.zero_grad(set_to_none=True)
            base = peak_start(cuda)
            before = base if cuda else malloc_in_use()
            start = time.perf_counter()
            loss = model(ids, targets, p)
            if cuda:
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated() - before
            else:
                held = malloc_in_use() - before
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            del loss
            peak = peak_since(cuda, base)
            if step >= a.warmup:
                res[p]["times"].append(elapsed)
                res[p]["held"] = held
                res[p]["peak"] = peak
    t0 = statistics.median(res["none"]["times"])
    os.makedirs(a.out, exist_ok=True)
    header = (f"PyTorch {torch.__version__}, GPT {a.layers} layers, d_model {a.d_model}, {a.heads} heads, "
              f"T {a.seq}, B {a.batch}, {a.dtype}, {a.attention} attention, {a.device} ({a.threads} threads); {a.warmup} warm-up + "
              f"{a.steps} measured steps per policy, interleaved; "
              f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'default')}")
    mib = 1 << 20
    rows = ["| policy | step (ms, median) | time vs plain | held after forward (MiB) | peak fwd+bwd (MiB) |",
            "|---|---:|---:|---:|---:|"]
    csv = ["policy,median_step_s,time_ratio,held_bytes,peak_bytes"]
    for p in policies:
        t = statistics.median(res[p]["times"])
        rows.append(f"| {p} | {t * 1e3:.1f} | {t / t0:.2f}x | {res[p]['held'] / mib:.1f} | {res[p]['peak'] / mib:.1f} |")
        csv.append(f"{p},{t:.6f},{t / t0:.4f},{res[p]['held']},{res[p]['peak']}")
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(header + "\n\n" + "\n".join(rows) + "\n")
    with open(os.path.join(a.out, "results.csv"), "w") as f:
        f.write("\n".join(csv) + "\n")
    print(header)
    print("\n".join(rows))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
