#!/usr/bin/env bash
# Ops on empty tensors through the stand-in CUDA driver (scripts/fake-cuda/, which refuses a
# launch over a zero grid as CUDA does) and the real nvrtc: plain Burn 0.21 (Autodiff<Cuda>)
# against Amp<Autodiff<Cuda>> at f16, one process per case and stack (a refused launch leaves
# the stream dead), see examples/empty_probe.rs. No kernel runs on the stand-in, so only what
# needs no value is probed: shapes, launches, panics. No GPU needed.
#
#   scripts/empty-probe.sh [CASE...]     # all cases when none is named
#
# Prints one line per case: each stack's outcome (ok, or the refused launches / the panic) and
# a summary; exits 1 when a case fails under Amp. Builds examples/empty_probe in release with
# CUDA (the release CUDA build scripts/gpu-build.sh makes, so minutes after it, a compile of
# the world without it). Writes target/empty-probe/ (a folder per run: log, refused.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

dir=target/cuda-compile-check
venv=$dir/venv
out=target/empty-probe
# The stand-in, and the wheels of the GPU machine's torch 2.11.0+cu130: the runtime's
# headers (for the stand-in and nvrtc) and nvrtc.
scripts/cuda-compile-check.sh --stand-in-only > /dev/null
"$venv/bin/pip" install -q --disable-pip-version-check nvidia-cuda-nvrtc==13.0.88
cu13=$("$venv/bin/python3" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')

CUDARC_CUDA_VERSION=13000 cargo build -q --release --features cuda --example empty_probe
bin=target/release/examples/empty_probe
cases=("$@")
[[ ${#cases[@]} -gt 0 ]] || mapfile -t cases < <("$bin" list)

rm -rf "$out"
mkdir -p "$out/lib"
for name in libnvrtc.so libnvrtc.so.13; do
    ln -sf "$(ls "$cu13"/lib/libnvrtc.so.13* | sort -V | tail -1)" "$out/lib/$name"
done
# One case on one stack: "ok", or what failed.
probe() {
    local stack=$1 name=$2 run="$out/$1-$2" status=0
    mkdir -p "$run/ptx"
    FAKE_CUDA_DIR="$run" CUDA_PATH="$cu13" EMPTY_PROBE_VALUES=0 \
        LD_LIBRARY_PATH="$PWD/$dir/fake:$PWD/$out/lib:$cu13/lib" \
        timeout 600 "$bin" "$stack" "$name" > "$run/log" 2>&1 || status=$?
    local refused=0
    [[ -f $run/refused.txt ]] && refused=$(wc -l < "$run/refused.txt")
    if [[ $status == 0 && $refused == 0 ]]; then
        echo ok
    elif [[ $refused -gt 0 ]]; then
        echo "$refused refused"
    else
        # The panic's message, first line.
        echo "panic: $(grep -A1 -m1 'panicked at' "$run/log" | tail -1 | cut -c1-70)"
    fi
}
plain_failed=0 amp_failed=0
printf '%-26s %-40s %s\n' case "plain Burn" Amp
for name in "${cases[@]}"; do
    plain=$(probe plain "$name")
    amp=$(probe amp "$name")
    [[ $plain == ok ]] || plain_failed=$((plain_failed + 1))
    [[ $amp == ok ]] || amp_failed=$((amp_failed + 1))
    printf '%-26s %-40s %s\n' "$name" "${plain:0:40}" "$amp"
done
refused_amp=$(cat "$out"/amp-*/refused.txt 2>/dev/null | wc -l || true)
echo "cases: ${#cases[@]}; plain Burn fails $plain_failed; Amp fails $amp_failed ($refused_amp refused launches); logs in $out/"
[[ $amp_failed == 0 ]]
