#!/usr/bin/env python3
"""PyTorch reference for the GPU check: the models of examples/gpu_check, trained the PyTorch way.

Mirrors the two models the Rust `gpu_check` times:
  - transformer: TinyLm of tests/common/tiny_lm.rs (dropout 0) on the sequence-reversal task;
  - mlp: DeepMlp of tests/common/models.rs (`depth` Linear(width, width) + GELU), loss mean(out^2).
Each is trained with fused AdamW at f32 (no autocast), bf16 (torch.autocast, no scaler) and f16
(torch.autocast + GradScaler). f32 matmuls run in TF32, as burn's do on CUDA: cubek-matmul 0.2
takes f32 operands as TF32 in its accelerated (tensor core) kernels wherever the device has TF32
(cubecl-cuda registers it on every CUDA device), and Burn's autotune picks those at these sizes.
`f32-ieee` is PyTorch with TF32 off, for what true f32 costs (burn-amp has no such row).

Prints one JSON line per (model, precision) to stdout, with the fields of gpu_check's speed lines
(kind "speed", impl "pytorch"); a failing run prints a kind "error" line and the next one goes on.
scripts/gpu_table.py puts both side by side. `--device cpu --quick` is a smoke run without a GPU.
"""
import argparse
import gc
import json
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads, d_ff):
        super().__init__()
        self.norm_attn, self.norm_ff = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.0, batch_first=True)
        self.ff_in, self.ff_out = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x):
        h = self.norm_attn(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff_out(F.gelu(self.ff_in(self.norm_ff(x))))


class TinyLm(nn.Module):
    def __init__(self, vocab, seq, d, heads, layers, d_ff):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        # burn's Conv2d 3x3 with PaddingConfig2d::Same over (position, feature).
        self.conv = nn.Conv2d(1, 1, 3, padding=1)
        self.blocks = nn.ModuleList([Block(d, heads, d_ff) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, t):
        b, s = t.shape
        x = self.tokens(t) + self.positions(torch.arange(s, device=t.device))[None]
        x = x + self.conv(x[:, None]).squeeze(1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class DeepMlp(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


def build(args, name, dev, gen):
    """(model, next_batch, loss_of, tokens_per_step, sizes) for one model."""
    if name == "transformer":
        sizes = {"vocab": args.vocab, "seq": args.seq, "d_model": args.d_model,
                 "heads": args.heads, "layers": args.layers, "d_ff": args.d_ff,
                 "batch": args.batch}
        model = TinyLm(args.vocab, args.seq, args.d_model, args.heads, args.layers, args.d_ff)

        def next_batch():
            # Made on the device so data loading costs nothing here; reversal targets.
            x = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev, generator=gen)
            return x, x.flip(1)

        def loss_of(x, y):
            return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

        return model.to(dev), next_batch, loss_of, args.batch * args.seq, sizes
    if name == "mlp":
        sizes = {"width": args.mlp_width, "depth": args.mlp_depth, "batch": args.mlp_batch}
        model = DeepMlp(args.mlp_width, args.mlp_depth)
        x = torch.rand(args.mlp_batch, args.mlp_width, device=dev, generator=gen)

        def loss_of(x):
            # Autocast runs pow in f32 anyway; the cast just says so.
            return (model(x).float() ** 2).mean()

        return model.to(dev), lambda: (x,), loss_of, args.mlp_batch, sizes
    raise ValueError(f"unknown model {name!r} (transformer, mlp)")


def set_tf32(on):
    """TF32 on or off for matmuls and cuDNN convolutions; returns whether it is on now."""
    # PyTorch >= 2.9 has per-backend fp32_precision and raises when the legacy flags are read
    # after it was used ("mix of the legacy and new APIs"): use one family only.
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(cudnn, "conv"):
        mode = "tf32" if on else "ieee"
        matmul.fp32_precision = mode
        cudnn.conv.fp32_precision = mode
        cudnn.rnn.fp32_precision = mode
        return matmul.fp32_precision == "tf32"
    matmul.allow_tf32 = on
    cudnn.allow_tf32 = on
    return bool(matmul.allow_tf32)


def percentile(sorted_values, q):
    """The nearest rank, rounded half up: the same pick as gpu_check's (speed.rs)."""
    return sorted_values[int((len(sorted_values) - 1) * q + 0.5)]


def run(args, name, precision, dev, meta):
    cuda = dev.type == "cuda"
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    model, next_batch, loss_of, tokens_per_step, sizes = build(args, name, dev, gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=cuda)
    if precision not in ("f32", "f32-ieee", "bf16", "f16"):
        raise ValueError(f"unknown precision {precision!r} (f32, f32-ieee, bf16, f16)")
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    amp_dtype = torch.bfloat16 if dtype is None else dtype  # autocast wants one even when off
    scaler = torch.amp.GradScaler(dev.type, enabled=precision == "f16")
    # Scale after each step, kept on the device (a clone of the scaler's tensor) so that
    # counting skipped steps adds no host sync inside the timed loop.
    scales = [torch.tensor(scaler.get_scale(), device=dev)] if precision == "f16" else []

    def step():
        with torch.autocast(dev.type, dtype=amp_dtype, enabled=dtype is not None):
            loss = loss_of(*batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if scales:
            current = getattr(scaler, "_scale", None)
            scales.append(current.clone() if current is not None
                          else torch.tensor(scaler.get_scale(), device=dev))
        return loss.detach()

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(args.warmup):
        batch = next_batch()
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - started

    # Timed as gpu_check times burn-amp: host wall time from the step's start until the device
    # has finished it (a sync per step), the batch made outside the window.
    times_ms = []
    for _ in range(args.steps):
        batch = next_batch()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        times_ms.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() if cuda else None

    values = torch.stack(scales).tolist() if scales else []
    skipped = sum(after < before for before, after in zip(values, values[1:]))
    times_ms.sort()
    ms = percentile(times_ms, 0.5)
    return {
        "kind": "speed", "impl": "pytorch", "model": name, "precision": precision, **meta,
        "ms_per_step": round(ms, 4),
        "ms_p10": round(percentile(times_ms, 0.1), 4),
        "ms_p90": round(percentile(times_ms, 0.9), 4),
        "steps": args.steps, "warmup_s": round(warmup_s, 3),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": round(tokens_per_step / (ms / 1e3), 1),
        "peak_bytes": peak, "peak_kind": "torch.cuda.max_memory_allocated" if cuda else None,
        "final_loss": loss.float().item(),
        "skipped_steps": skipped, "sizes": sizes,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="transformer,mlp")
    p.add_argument("--precisions", default="f32,bf16,f16,f32-ieee")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--mlp-width", type=int, default=4096)
    p.add_argument("--mlp-depth", type=int, default=8)
    p.add_argument("--mlp-batch", type=int, default=2048)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny sizes and steps (overrides them)")
    args = p.parse_args()
    if args.quick:  # gpu_check's Sizes::quick()
        args.vocab, args.seq, args.d_model, args.heads, args.layers, args.d_ff, args.batch = \
            16, 16, 64, 4, 2, 128, 4
        args.mlp_width, args.mlp_depth, args.mlp_batch = 64, 2, 32
        args.steps, args.warmup = 3, 1
    if args.steps < 1:
        p.error("--steps must be at least 1")

    dev = torch.device(args.device)
    meta = {"device": "cpu", "torch": torch.__version__, "tf32": False}
    if dev.type == "cuda":
        meta["device"] = torch.cuda.get_device_name()

    for name in filter(None, args.models.split(",")):
        for precision in filter(None, args.precisions.split(",")):
            head = {"impl": "pytorch", "model": name, "precision": precision}
            if dev.type == "cpu" and precision == "f16":
                line = {"kind": "skipped", "impl": "pytorch", "what": f"{name} {precision}",
                        "why": "f16 autocast is not run on the CPU"}
            else:
                try:
                    # TF32 for f32 matmuls as burn's (the half precisions do not use it);
                    # `f32-ieee` without. Each line says which it ran with.
                    tf32 = precision != "f32-ieee"
                    if dev.type == "cuda":
                        try:
                            tf32 = set_tf32(tf32)
                        except Exception as e:  # unknown: say so in the line rather than stop
                            print(f"could not set TF32: {e}", file=sys.stderr)
                            tf32 = None
                    line = run(args, name, precision, dev, {**meta, "tf32": tf32})
                except Exception as e:  # an OOM or the like: report it, go on with the next
                    line = {"kind": "error", **head, "error": f"{type(e).__name__}: {e}"[:2000]}
            print(json.dumps(line), flush=True)
            # The failed or finished run's model and optimizer are gone with run()'s frame.
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
