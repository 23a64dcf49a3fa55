#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU and no network (CUDA driver installed,
# PyTorch installed for the side-by-side comparison). Finishes in a few minutes:
#   1. builds with --features cuda (release);
#   2. runs the autocast policy suite on Cuda in f16 and bf16, and the kernel tests;
#   3. times f32 against AMP on the transformer, burn-amp and PyTorch side by side.
# Output: a table per step, and JSON lines under $OUT (or ./gpu-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
export CARGO_TERM_COLOR=never

step() { echo; echo "=== $* ==="; }

step "build (release, cuda)"
time cargo build --release --features cuda --examples --tests 2>&1 | tail -3

step "autocast policy on Cuda (f16, bf16) and kernels"
cargo test --release --features cuda --test autocast_ops cuda -- --test-threads 1 2>&1 | tee "$out/policy.log" | tail -15
cargo test --release --features cuda --test kernels 2>&1 | tee "$out/kernels.log" | tail -15

step "transformer: f32 vs bf16 vs f16 (burn-amp, Cuda)"
for p in f32 bf16 f16; do
    cargo run -q --release --features cuda --example train -- \
        --backend cuda --precision "$p" --steps 200 --batch 256 --d-model 512 --layers 4 \
        2>/dev/null | tail -1 | tee -a "$out/burn_amp.jsonl"
done

step "transformer: the same model in PyTorch (torch.autocast + GradScaler)"
if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    python3 scripts/torch_reference.py --steps 200 --batch 256 --d-model 512 --layers 4 \
        | tee "$out/torch.jsonl"
else
    echo "PyTorch with CUDA not found: skipped"
fi

step "ratios"
python3 - "$out" <<'PY'
import json, sys, os
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    return [json.loads(l) for l in open(path) if l.startswith("{")] if os.path.exists(path) else []
burn = {r["precision"]: r for r in load("burn_amp.jsonl")}
torch = {r["precision"]: r for r in load("torch.jsonl")}
print("| precision | burn-amp tokens/s | torch tokens/s | burn/torch | burn AMP speed-up over f32 |")
print("|---|---|---|---|---|")
for p in ["f32", "bf16", "f16"]:
    b, t = burn.get(p), torch.get(p)
    speedup = b["tokens_per_s"] / burn["f32"]["tokens_per_s"] if b and "f32" in burn else float("nan")
    ratio = b["tokens_per_s"] / t["tokens_per_s"] if b and t else float("nan")
    print(f"| {p} | {b and b['tokens_per_s']} | {t and t['tokens_per_s']} | {ratio:.2f} | {speedup:.2f} |")
PY
