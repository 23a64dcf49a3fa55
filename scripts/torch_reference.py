#!/usr/bin/env python3
"""The TinyLm of burn-amp's tests/common/tiny_lm.rs in PyTorch, trained on the same task with
torch.autocast + GradScaler (fused AdamW), for a side-by-side speed comparison on one GPU.
Prints one JSON line per precision, with the fields of `cargo run --example train`."""
import argparse, json, time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads, d_ff):
        super().__init__()
        self.norm_attn, self.norm_ff = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ff_in, self.ff_out = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x):
        h = self.norm_attn(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff_out(F.gelu(self.ff_in(self.norm_ff(x))))


class TinyLm(nn.Module):
    def __init__(self, vocab, seq, d, heads, layers, d_ff):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(seq, d)
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


def run(args, precision):
    torch.manual_seed(args.seed)
    dev = "cuda"
    model = TinyLm(16, 8, args.d_model, 4, args.layers, 2 * args.d_model).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, fused=True)
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler(enabled=precision == "f16")
    torch.cuda.reset_peak_memory_stats()
    losses, start = [], None
    for step in range(args.steps + 5):
        if step == 5:  # warm-up excluded
            torch.cuda.synchronize()
            start = time.perf_counter()
        x = torch.randint(0, 16, (args.batch, 8), device=dev)
        y = x.flip(1)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    final = torch.stack(losses[-20:]).float().mean().item()
    print(json.dumps({
        "precision": precision, "backend": "torch-cuda", "steps": args.steps,
        "final_loss": final, "skipped_steps": None,
        "final_scale": scaler.get_scale() if precision == "f16" else 1.0,
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "tokens_per_s": args.steps * args.batch * 8 / wall, "wall_s": wall,
    }), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    for precision in ["f32", "bf16", "f16"]:
        run(args, precision)
