#!/usr/bin/env bash
# CUDA without a GPU: runs the packed CUDA gpu_check (scripts/gpu-build.sh) through
# scripts/gpu-check.sh, as the GPU machine would, but against a stand-in driver
# (scripts/fake-cuda/fake_cuda.c: answers as an H200, runs no kernel) and the real nvrtc 13.0 of
# the pip wheels that machine's PyTorch uses; then assembles every PTX module the run made with
# ptxas for sm_90a.
#
# What a pass shows: the CUDA build starts a device, gpu-check.sh finds libcuda, libnvrtc and
# the headers in a pip-only layout, and every kernel the check needs (correctness and speed
# parts, f32/f16/bf16, CubeCL's and burn-amp's) compiles with nvrtc and assembles with ptxas
# for the H200; then the numerics part's kernels, as far as its checks get (each stops at its
# first value assertion, which fails here); and that no launch or TMA descriptor is one the
# driver refuses (the stand-in refuses what the real one does: refused.txt). What it cannot
# show: any value or time. No kernel runs, so the correctness cases fail by design and their
# values are not read here.
#
#   scripts/gpu-build.sh && scripts/cuda-compile-check.sh [--quick]
#   scripts/cuda-compile-check.sh --packed          # the GPU run as it will go, with .gpu/'s cache
#   scripts/cuda-compile-check.sh --stand-in-only   # CI: the stand-in builds (-Werror) and its
#                                                   # refusals are checked (selftest.c), no run
#
# --quick runs the speed part at the tiny sizes (the full sizes compile the kernels the GPU
# run will, and need a few GB of host memory). --packed runs .gpu/ as the GPU machine will,
# kernel cache and all (one gpu-check.sh call, the numerics part given
# GPU_CHECK_NUMERICS_SECONDS, 300 s), checks it the same way, and packs nothing: about 11
# minutes, to check a .gpu/ before a GPU call. Needs python3 with pip (PyPI), gcc. Writes
# target/cuda-compile-check/ (the wheels' venv, the stand-in, out/, ptx/, ptxas.log,
# refused.txt; assembled-sm_90a-V*.sha256: the modules ptxas passed, kept between runs).
set -euo pipefail
cd "$(dirname "$0")/.."

dir=target/cuda-compile-check
venv=$dir/venv
args="--speed-anyway"
mode=run
case "${1:-}" in
    "") ;;
    --quick) args="$args --quick" ;;
    --packed) mode=packed ;;
    --stand-in-only) mode=stand-in ;;
    *) echo "usage: $0 [--quick | --packed | --stand-in-only]" >&2; exit 2 ;;
esac

if [[ $mode != stand-in ]] && { [[ ! -f .gpu/gpu_check.xz ]] || ! grep -q 'features cuda' .gpu/manifest.txt; }; then
    echo "error: .gpu/ holds no CUDA build: run scripts/gpu-build.sh first" >&2
    exit 2
fi
# The rule gpu-check.sh follows: a cache made for this binary, or from its kernels' sources.
cache_fits() {
    local field made_for
    for field in "binary sha256:sha256 (unpacked)" "kernel sources sha256:kernel sources sha256"; do
        made_for=$(sed -n "s/^for ${field%%:*}: //p" .gpu/kernel-cache.txt 2>/dev/null)
        [[ -n $made_for && $made_for == $(sed -n "s/^${field#*:}: //p" .gpu/manifest.txt) ]] && return 0
    done
    return 1
}
if [[ $mode == packed ]] && { [[ ! -f .gpu/kernel-cache.tar.xz ]] || ! cache_fits; }; then
    echo "error: .gpu/ has no kernel cache made for its binary or from its kernels' sources: run scripts/cuda-compile-check.sh without --packed" >&2
    exit 2
fi

# The wheels of the GPU machine's torch 2.11.0+cu130: the runtime's headers (cuda.h for the
# stand-in, the rest for nvrtc), nvrtc; and ptxas. The stand-in alone needs only the first.
wheels=(nvidia-cuda-runtime==13.0.96)
[[ $mode != stand-in ]] && wheels+=(nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88)
[[ -x $venv/bin/python3 ]] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "${wheels[@]}"
cu13=$("$venv/bin/python3" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')

mkdir -p "$dir/fake"
gcc -shared -fPIC -O1 -Wall -Wextra -Werror -I"$cu13/include" \
    -o "$dir/fake/libcuda.so.1" scripts/fake-cuda/fake_cuda.c scripts/fake-cuda/launch.c
if [[ $mode == stand-in ]]; then
    echo "stand-in driver built: $dir/fake/libcuda.so.1 ($(nm -D --defined-only "$dir/fake/libcuda.so.1" | grep -c ' T cu') entry points)"
    # Its refusals against cuda.h's rules: what it takes and what it refuses.
    gcc -O1 -Wall -Wextra -Werror -I"$cu13/include" -o "$dir/fake/selftest" scripts/fake-cuda/selftest.c \
        -L"$dir/fake" -l:libcuda.so.1 -Wl,-rpath,"$PWD/$dir/fake"
    selftest_dir=$(mktemp -d)
    mkdir -p "$selftest_dir/ptx"
    FAKE_CUDA_DIR="$selftest_dir" "$dir/fake/selftest" 2> "$selftest_dir/stderr" ||
        { cat "$selftest_dir/stderr" >&2; exit 1; }
    echo "  (refused.txt: $(wc -l < "$selftest_dir/refused.txt") lines)"
    rm -rf "$selftest_dir"
    exit 0
fi
# A fresh kernel cache, so that nvrtc compiles every kernel; packed for the GPU run below.
# And no autotune results of CUDA (CubeCL keeps them in target/autotune/): with them, autotune
# would skip its candidates here, which the GPU, tuning afresh, compiles. This run's are
# meaningless (no kernel runs): they go too.
forget_cuda_tuning() { rm -rf target/autotune/*/device-*-cuda; }
forget_cuda_tuning
trap forget_cuda_tuning EXIT
rm -rf "$dir/out" "$dir/out-numerics" "$dir/ptx" "$dir/kernel-cache" "$dir/correctness-speed" \
    "$dir/counts.txt" "$dir/refused.txt"
mkdir -p "$dir/ptx"

# gpu-check.sh as on the GPU machine; the venv's python3 first on PATH, so it finds the
# wheels' nvrtc and headers (and no torch: the PyTorch part is skipped). Its limit is an hour:
# compiling every kernel took 1610 s alone on a 2-core machine, and 2487 s beside a cargo
# build (1800 s, the old limit, stopped it there and no cache was packed).
# The numerics part runs apart, below, as on the GPU (a second gpu_check process).
started=$(date +%s)
stand_in() {
    FAKE_CUDA_DIR="$dir" PATH="$venv/bin:$PATH" GPU_CHECK_LIBCUDA="$PWD/$dir/fake/libcuda.so.1" \
        GPU_CHECK_TIMEOUT="${GPU_CHECK_TIMEOUT:-3600}" GPU_CHECK_TOTAL=100000 "$@"
}
status=0
# --packed as on the GPU: gpu-check.sh unpacks .gpu/'s cache itself, and runs the numerics
# part after the others, in one call. Otherwise into a fresh cache, the numerics part apart.
cache_args="--kernel-cache $PWD/$dir/kernel-cache" numerics_seconds=0
[[ $mode == packed ]] && cache_args="" numerics_seconds="${GPU_CHECK_NUMERICS_SECONDS:-300}"
OUT="$dir/out" GPU_CHECK_ARGS="$args $cache_args ${GPU_CHECK_ARGS:-}" \
    GPU_CHECK_NUMERICS_SECONDS="$numerics_seconds" \
    stand_in scripts/gpu-check.sh > "$dir/gpu-check.log" 2>&1 || status=$?
# What correctness and speed compiled, kept apart: packed instead of the whole cache (below)
# if the whole one does not fit in what the device tool carries.
kernels_in() { cat "$1"/*/*/*/toc.json.log 2>/dev/null | wc -l; }
if [[ $mode == run && " $args " != *" --quick "* ]]; then
    mkdir -p "$dir/correctness-speed"
    cp -a "$dir/kernel-cache" "$dir/correctness-speed/"
fi

# The numerics part: its fixed checks and the first GPU_CHECK_NUMERICS_SEEDS random graphs
# (4), into the same cache. Its kernels are mostly matmul autotune candidates (up to 7 MiB of
# PTX each, for every new shape bucket and dtype): 815 MiB of cache with them against 311
# without, but PTX repeats itself, and xz packs the whole in 36 MiB (gzip: 83; 2026-12-03).
# Here each of its checks stops at its first value assertion (no kernel runs), so on the GPU
# the part still compiles what comes after, in the time left. GPU_CHECK_NUMERICS_SEEDS=none
# leaves the part out.
numerics_seeds="${GPU_CHECK_NUMERICS_SEEDS:-4}"
numerics_jsonl=""
if [[ $mode == packed ]]; then
    numerics_jsonl=$dir/out/numerics.jsonl
elif [[ $numerics_seeds != none ]]; then
    numerics_jsonl=$dir/out-numerics/gpu_check.jsonl
    OUT="$dir/out-numerics" GPU_CHECK_ARGS="--only numerics --numerics-seconds 3600 --numerics-seeds $numerics_seeds --kernel-cache $PWD/$dir/kernel-cache" \
        GPU_CHECK_NUMERICS_SECONDS=0 stand_in scripts/gpu-check.sh > "$dir/gpu-check-numerics.log" 2>&1 || true
fi
seconds=$(($(date +%s) - started))

# 1. The run itself: it must have started the device and reached the end of each part.
problems=0
jsonl=$dir/out/gpu_check.jsonl
if [[ ! -s $jsonl ]]; then
    echo "FAIL: gpu_check wrote nothing (gpu-check.sh exited $status); $dir/gpu-check.log:" >&2
    tail -20 "$dir/gpu-check.log" >&2
    exit 1
fi
python3 - "$jsonl" "$numerics_jsonl" <<'EOF' || problems=$((problems + 1))
import json, os, sys
def read(path):
    return [json.loads(l) for l in open(path) if l.strip().startswith("{")] if os.path.isfile(path) else []
lines = read(sys.argv[1])
numerics = [l for l in read(sys.argv[2]) if l["kind"] != "env"]
# Stopped by its time limit (status 124): on this machine the part tunes every shape afresh and
# may not reach its random graphs in the --packed run's 300 s (the f16 module case alone took
# longer on 2 cores). Told, not failed: what it reached compiled; on the GPU it gets the time
# the other parts leave. Stopped otherwise, or ended before its random graphs: a failure.
timed_out = [l for l in numerics if l.get("what") == "numerics process"
             and "was stopped (status 124" in (l.get("error") or "")]
if timed_out:
    timed_out[0]["ok"] = True
    done = [c for c in numerics if c.get("kind") == "correctness"]
    print(f"  TIME: the numerics part stopped at its time limit after {len(done)} cases, the last it "
          f"finished: {done[-1]['case'] + ' ' + done[-1]['dtype'] if done else 'none'}; "
          "the cases after it were not compiled here")
if sys.argv[2] and not timed_out and not any(l.get("suite") == "random graphs" for l in numerics):
    numerics.append({"kind": "error", "error": "the numerics part did not reach its random graphs "
                     "(stopped outside any case?): see gpu-check-numerics.log"})
lines += numerics
kinds = {}
for l in lines:
    kinds[l["kind"]] = kinds.get(l["kind"], 0) + 1
print("gpu_check lines:", ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
env = [l for l in lines if l["kind"] == "env"]
print("device:", env[0]["device"] if env else "NONE")
# No kernel runs, so values are meaningless and value checks fail by design. What must not
# happen is anything else: a compilation error, a panic, a server error, an unsupported copy.
STRUCTURAL = ("compil", "panicked", "invalid state", "Io(", "Unsupported",
              "not supported", "LaunchError", "out of memory", "stopped outside any case")
def text(l):
    return json.dumps(l.get("error") or "") + json.dumps(l.get("detail") or "")
# Known, and Burn's: a fused matmul's autotune winner that cannot compile once a bool joins
# its block (README, Defects: "CUDA: a fused matmul's autotuned kernel fails to compile").
# An autotune race (it comes in some runs), listed, not failed: the GPU run goes on past it.
KNOWN = ("Invalid vector size. Got 16 which should not be >8",)
failed = [l for l in lines if l["kind"] in ("correctness", "error") and not l.get("ok")]
known = [l for l in failed if any(k in text(l) for k in KNOWN)]
structural = [l for l in failed if l not in known and any(k in text(l) for k in STRUCTURAL)]
for l in known[:4]:
    print("  KNOWN (Burn 0.21, README Defects):", json.dumps(l)[:300])
for l in structural[:8]:
    print("  STRUCTURAL:", json.dumps(l)[:700])
speed = [l for l in lines if l["kind"] == "speed"]
print(f"structural failures: {len(structural)} (and {len(known)} known); value checks failed "
      f"(expected, no kernel runs): {len(failed) - len(structural) - len(known)}; speed lines: "
      f"{len(speed)} of 6; numerics lines: {len(numerics)}")
sys.exit(1 if not env or structural or len(speed) < 6 else 0)
EOF

# 2. Every module nvrtc made, through ptxas for the H200. A module ptxas passed before (the
# same bytes, the same ptxas: listed by sha256 in $assembled) is not assembled again: with the
# packed cache most modules are byte for byte those of the run that made it.
ptxas=$cu13/bin/ptxas
assembled=$dir/assembled-sm_90a-$("$ptxas" --version | grep -o 'V[0-9][0-9.]*' | head -1).sha256
touch "$assembled"
(cd "$dir/ptx" && find . -name '*.ptx' -print0 | xargs -0 -r sha256sum) | sed 's|  \./| |' > "$dir/ptx.sha256"
modules=$(wc -l < "$dir/ptx.sha256")
awk 'FILENAME == ARGV[1] { known[$1] = 1; next } !($1 in known) { print $2 }' "$assembled" "$dir/ptx.sha256" |
    sort > "$dir/ptx-new.txt"
: > "$dir/ptxas.log"
sed "s|^|$dir/ptx/|" "$dir/ptx-new.txt" | tr '\n' '\0' | xargs -0 -r -P "$(nproc)" -I{} sh -c \
    '"$1" -arch=sm_90a -o /dev/null "$2" 2>&1 | sed "s|^|$2: |"' _ "$ptxas" {} >> "$dir/ptxas.log"
ptx_failed=$(grep -c 'error' "$dir/ptxas.log" || true)
if (( ptx_failed == 0 )); then
    cut -d' ' -f1 "$dir/ptx.sha256" | sort -u - "$assembled" -o "$assembled"
fi
echo "PTX modules: $modules ($(wc -l < "$dir/ptx-new.txt") through ptxas, the rest passed before), ptxas sm_90a errors: $ptx_failed ($dir/ptxas.log)"
[[ -f $dir/counts.txt ]] && cat "$dir/counts.txt"
(( modules == 0 || ptx_failed > 0 )) && problems=$((problems + 1))

# 3. What the driver would have refused: a launch outside the H200's limits or the kernel's
# own (.maxntid), shared memory not allowed, a TMA descriptor against cuda.h's rules. Each
# would fail on the GPU alone. A refused launch fails the check: CubeCL keeps the error, and
# every later read on that stream fails ("the server is in an invalid state"). A refused
# descriptor is matmul autotune trying a TMA candidate that cannot take the shape: autotune
# drops it and the run goes on, as on the GPU, so it is listed, and fails the check only
# with a structural failure above (it may be the cause).
refused_launches=$(grep -vc 'cuTensorMapEncode' "$dir/refused.txt" 2>/dev/null || true)
refused_maps=$(grep -c 'cuTensorMapEncode' "$dir/refused.txt" 2>/dev/null || true)
echo "refused by the driver: ${refused_launches:-0} launches, ${refused_maps:-0} TMA descriptors ($dir/refused.txt)"
if [[ -s $dir/refused.txt ]]; then
    sed 's/^process [0-9]*: [0-9-]*\.ptx //; s/^process [0-9]*: //' "$dir/refused.txt" | sort | uniq -c |
        sort -rn | head -8 | sed 's/^/  /'
fi
if (( ${refused_launches:-0} > 0 )); then
    echo "FAIL: launches the CUDA driver refuses" >&2
    problems=$((problems + 1))
elif (( ${refused_maps:-0} > 0 && problems > 0 )); then
    echo "(TMA descriptors refused, and the run failed: they may be why)" >&2
fi

echo "cuda-compile-check: ${seconds} s; $([[ $problems == 0 ]] && echo PASS || echo FAIL)"
(( problems > 0 )) && exit 1

# 4. The kernels, compiled, for the GPU run: gpu-check.sh hands them to gpu_check there, which
# then compiles only what this run did not (autotune still measures on the GPU). Only for the
# full sizes: --quick compiles other kernels than the GPU run needs.
if [[ " $args " == *" --quick "* ]]; then
    echo "(--quick: no kernel cache packed; run without --quick to pack one for the GPU)"
    exit 0
fi
if [[ $mode == packed ]]; then
    echo "(--packed: .gpu/ checked as it is; nothing packed)"
    exit 0
fi
rm -f .gpu/kernel-cache.*
limit_mib="${GPU_PACK_LIMIT_MIB:-56}"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
# The whole cache if .gpu/ can carry it, else what correctness and speed compiled.
parts="correctness, speed"
[[ -n $numerics_jsonl ]] && parts="$parts, numerics (its first $numerics_seeds random graphs; each check as far as it got)"
for from in "$dir" "$dir/correctness-speed"; do
    tar -C "$from" -cf - kernel-cache | xz -9 -T0 > .gpu/kernel-cache.tar.xz
    packed=$(du -sb .gpu | cut -f1)
    (( packed <= limit_mib * 1048576 )) && break
    echo "the whole kernel cache makes .gpu/ $(mib "$packed") MiB, over $limit_mib: packing correctness and speed's alone"
    parts="correctness, speed"
done
binary_sha=$(sed -n 's/^sha256 (unpacked): //p' .gpu/manifest.txt)
kernel_sources=$(sed -n 's/^kernel sources sha256: //p' .gpu/manifest.txt)
cat > .gpu/kernel-cache.txt <<EOF
kernel cache: kernel-cache.tar.xz (CubeCL's compilation cache, PTX for sm_90a)
for binary sha256: $binary_sha
for kernel sources sha256: $kernel_sources
for commit: $(sed -n 's/^commit: //p' .gpu/manifest.txt)
made: $(date -u +%Y-%m-%dT%H:%M:%SZ) by scripts/cuda-compile-check.sh (nvrtc 13.0.88, no GPU)
parts: $parts
kernels: $(kernels_in "$from/kernel-cache")
bytes packed: $(stat -c %s .gpu/kernel-cache.tar.xz)
bytes unpacked: $(du -sb "$from/kernel-cache" | cut -f1)
EOF
cat .gpu/kernel-cache.txt
echo ".gpu/: $(mib "$packed") MiB with the kernel cache (limit $limit_mib MiB)"
if (( packed > limit_mib * 1048576 )); then
    rm -f .gpu/kernel-cache.*
    echo "error: .gpu/ is over $limit_mib MiB even with correctness and speed's kernels alone: the device tool cannot carry it; no kernel cache packed" >&2
    exit 1
fi
