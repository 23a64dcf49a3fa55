#!/usr/bin/env bash
# The GPU check, run ON the GPU machine (no Rust toolchain, no network): unpacks the
# gpu_check that scripts/gpu-build.sh packed into .gpu/, finds the CUDA libraries, runs its
# correctness part and then its speed part, runs the same models in PyTorch, and writes
# under $OUT (default gpu-check-out/):
#   gpu_check.jsonl  burn-amp's JSON lines      torch.jsonl  PyTorch's
#   numerics.jsonl   gpu_check's numerics part, run last in the time left
#   table.md         the side-by-side table     log.txt      what this script found and did
# Budget: under 8 minutes of wall time in all (time limits below), first compilations included.
#
#   scripts/gpu-check.sh                                   # on the GPU machine
#   GPU_CHECK_BACKEND=wgpu GPU_CHECK_ARGS=--quick scripts/gpu-check.sh   # CI, on lavapipe
#
# Environment: GPU_CHECK_BACKEND (cuda | wgpu), GPU_CHECK_ARGS (more gpu_check flags),
# TORCH_ARGS (more torch_reference.py flags), GPU_CHECK_TIMEOUT / TORCH_TIMEOUT (seconds),
# GPU_CHECK_TOTAL (the script's budget, 460 s) / GPU_CHECK_NUMERICS_SECONDS (the numerics cap),
# GPU_CHECK_LIBCUDA (a driver library to use instead of the one found).
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-gpu-check-out}"
mkdir -p "$out"
backend="${GPU_CHECK_BACKEND:-cuda}"
started=$(date +%s)
log() { echo "[gpu-check +$(($(date +%s) - started))s] $*" | tee -a "$out/log.txt" >&2; }

# .gpu/'s files are xz: with xz where the image has it, else with Python's lzma.
unxz_stdout() {
    if command -v xz >/dev/null; then
        xz -dc -- "$1"
    else
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer, 1 << 20)' "$1"
    fi
}

# 1. The binary.
if [[ ! -f .gpu/gpu_check.xz ]]; then
    log "error: .gpu/gpu_check.xz is missing: run scripts/gpu-build.sh on the build machine and carry .gpu/"
    exit 2
fi
cat .gpu/manifest.txt | tee -a "$out/log.txt" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unxz_stdout .gpu/gpu_check.xz > "$work/gpu_check"
chmod +x "$work/gpu_check"
want=$(sed -n 's/^sha256 (unpacked): //p' .gpu/manifest.txt)
have=$(sha256sum "$work/gpu_check" | cut -d' ' -f1)
if [[ -n "$want" && "$want" != "$have" ]]; then
    log "error: gpu_check's sha256 is $have, the manifest says $want (a stale or damaged .gpu/)"
    exit 2
fi

# 2. The CUDA libraries: cudarc dlopens libcuda (the driver's) and libnvrtc (CubeCL compiles its
# kernels at run time) by name. nvrtc comes from the toolkit or from PyTorch's
# nvidia-cuda-nvrtc wheel; plain names are linked in a folder of our own, put first.
find_lib() { # name pattern -> the first file found
    local pattern=$1 dir
    local dirs=(/usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64
        /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
    for dir in /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/x86_64-linux/lib; do
        [[ -d $dir ]] && dirs+=("$dir")
    done
    local site
    site=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null)
    [[ -n "$site" ]] && while IFS= read -r dir; do dirs+=("$dir"); done \
        < <(find "$site/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null)
    for dir in "${dirs[@]}"; do
        local hit
        hit=$(ls "$dir"/$pattern 2>/dev/null | sort -V | tail -1)
        [[ -n "$hit" ]] && { echo "$hit"; return 0; }
    done
    ldconfig -p 2>/dev/null | awk -v p="${pattern%%\**}" '$1 ~ "^"p {print $NF; exit}'
}
if [[ "$backend" == cuda ]]; then
    mkdir -p "$work/lib"
    # GPU_CHECK_LIBCUDA: another driver library (scripts/cuda-compile-check.sh's stand-in).
    cuda=${GPU_CHECK_LIBCUDA:-$(find_lib 'libcuda.so*')}
    nvrtc=$(find_lib 'libnvrtc.so*')
    log "libcuda: ${cuda:-NOT FOUND}"
    log "libnvrtc: ${nvrtc:-NOT FOUND}"
    for lib in "$cuda" "$nvrtc"; do
        [[ -z "$lib" ]] && continue
        base=$(basename "$lib"); base=${base%%.so*}
        for name in "$base.so" "$base.so.1" "$base.so.13"; do
            [[ -e "$(dirname "$lib")/$name" ]] || ln -sf "$lib" "$work/lib/$name"
        done
    done
    export LD_LIBRARY_PATH="$work/lib:$(dirname "${nvrtc:-/}"):$(dirname "${cuda:-/}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    # CubeCL hands nvrtc `--include-path=$CUDA_PATH/include` (and include/cccl) for the
    # cuda_runtime.h, cuda_fp16.h and cuda_bf16.h its kernels include, and panics when it finds
    # no toolkit (it looks only at CUDA_PATH, /usr/local/cuda, /opt/cuda, /usr/bin/nvcc). So
    # name the first folder whose include/ has those headers: the toolkit's, nvcc's, or the
    # pip wheels' (nvidia/cu13, with the nvrtc that came from there).
    cuda_root=""
    candidates=("${CUDA_PATH:-}" "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-* /opt/cuda)
    nvcc=$(command -v nvcc 2>/dev/null) && candidates+=("$(dirname "$(dirname "$(readlink -f "$nvcc")")")")
    [[ -n "$nvrtc" ]] && candidates+=("$(dirname "$(dirname "$nvrtc")")")
    # First a toolkit with CCCL (cuda/barrier, cuda/pipeline: Hopper's matmul kernels), then any.
    for want_cccl in 1 0; do
        for dir in "${candidates[@]}"; do
            [[ -n "$dir" && -f "$dir/include/cuda_runtime.h" && -f "$dir/include/cuda_bf16.h" ]] || continue
            (( want_cccl )) && [[ ! -d "$dir/include/cccl" ]] && continue
            cuda_root=$dir
            break 2
        done
    done
    if [[ -n "$cuda_root" ]]; then
        export CUDA_PATH="$cuda_root"
        log "CUDA_PATH=$CUDA_PATH (headers for nvrtc$([[ -d $cuda_root/include/cccl ]] && echo ', with cccl'))"
    else
        missing="no CUDA headers found (include/cuda_runtime.h and cuda_bf16.h under CUDA_PATH, CUDA_HOME, /usr/local/cuda*, /opt/cuda, nvcc's folder or nvrtc's): CubeCL cannot compile its kernels; set CUDA_PATH"
    fi
    [[ -z "$cuda" ]] && missing="libcuda not found: is this a machine with an NVIDIA driver?"
    [[ -z "$nvrtc" ]] && missing="libnvrtc not found (CUDA toolkit or the nvidia-cuda-nvrtc wheel): CubeCL cannot compile its kernels"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
        --format=csv,noheader 2>&1 | tee -a "$out/log.txt" >&2
fi

# The kernels compiled ahead (scripts/cuda-compile-check.sh): only if made for this binary, or
# from the same kernel sources (CubeCL finds a cached kernel by its type and configuration,
# not its code: scripts/gpu-build.sh says what the sources are). A kernel the cache lacks
# compiles here.
if [[ "$backend" == cuda && -f .gpu/kernel-cache.tar.xz ]]; then
    made_for=$(sed -n 's/^for binary sha256: //p' .gpu/kernel-cache.txt 2>/dev/null)
    sources_made=$(sed -n 's/^for kernel sources sha256: //p' .gpu/kernel-cache.txt 2>/dev/null)
    sources_have=$(sed -n 's/^kernel sources sha256: //p' .gpu/manifest.txt)
    fits=""
    if [[ "$made_for" == "$have" ]]; then
        fits="made for this binary"
    elif [[ -n "$sources_made" && "$sources_made" == "$sources_have" ]]; then
        fits="made for the build of $(sed -n 's/^for commit: //p' .gpu/kernel-cache.txt), from the same kernel sources"
    fi
    if [[ -n "$fits" ]] && unxz_stdout .gpu/kernel-cache.tar.xz | tar -C "$work" -xf -; then
        GPU_CHECK_ARGS="--kernel-cache $work/kernel-cache ${GPU_CHECK_ARGS:-}"
        log "kernel cache: $(sed -n 's/^kernels: //p' .gpu/kernel-cache.txt) kernels compiled ahead for $(sed -n 's/^parts: //p' .gpu/kernel-cache.txt) ($(sed -n 's/^made: //p' .gpu/kernel-cache.txt); $fits), unpacked"
    else
        log "kernel cache not used: made for another gpu_check from other kernel sources (or unreadable); every kernel compiles here"
    fi
fi

# gpu_check with $1 as its JSON lines and its stderr in $out/$2.stderr, for $3 seconds in all,
# with the flags after those. When a case ended the device's stream (a kernel that failed to
# compile or launch: CubeCL keeps the error, and the reads after it fail) gpu_check exits with 3
# after a device_lost line saying where to go on; a new process, with a new device, resumes
# there while time is left (examples/gpu_check/device_lost.rs). Each process writes its own
# file, appended to $1. With GPU_CHECK_NUMERICS set, each is given the seconds left, less a
# minute (a case may run past the budget: it checks the time before it starts). Returns the
# last process's status.
run_gpu_check() {
    local jsonl=$1 name=$2 seconds=$3; shift 3
    local until=$(($(date +%s) + seconds)) part=0 status left resume=() budget=()
    : > "$jsonl"
    : > "$out/$name.stderr"
    while :; do
        left=$((until - $(date +%s)))
        [[ -n "${GPU_CHECK_NUMERICS:-}" ]] && budget=(--numerics-seconds $((left - 60)))
        log "gpu_check --backend $backend $* ${budget[*]} ${resume[*]}"
        timeout "$left" "$work/gpu_check" --backend "$backend" --out "$jsonl.$part" "$@" \
            "${budget[@]}" "${resume[@]}" > /dev/null 2> >(tee -a "$out/$name.stderr" >&2)
        status=$?
        cat "$jsonl.$part" >> "$jsonl" 2>/dev/null
        rm -f "$jsonl.$part"
        log "gpu_check exited with $status"
        (( status == 3 )) || return "$status"
        local next
        next=$(grep -E '"kind": ?"device_lost"' "$jsonl" | tail -1 |
            sed -En 's/.*"resume": ?"([^"]*)".*/\1/p')
        left=$((until - $(date +%s)))
        if [[ -z "$next" ]] || (( left < 80 )); then
            log "the device's stream ended; not resumed (${left} s left, resume at '${next}')"
            return "$status"
        fi
        log "the device's stream ended; a new process resumes at $next"
        resume=(--resume "$next")
        part=$((part + 1))
    done
}

# 3. burn-amp: correctness, then speed (skipped by gpu_check itself if a case failed). Without
# what CUDA needs it is not started (it would only panic in a CubeCL thread); PyTorch still runs.
if [[ -n "${missing:-}" ]]; then
    log "error: $missing; gpu_check not run"
    printf '{"kind": "error", "impl": "burn-amp", "what": "libraries", "error": "gpu_check not run: %s"}\n' \
        "${missing//\"/\'}" > "$out/gpu_check.jsonl"
    burn_status=2
else
    # shellcheck disable=SC2086
    run_gpu_check "$out/gpu_check.jsonl" gpu_check "${GPU_CHECK_TIMEOUT:-330}" ${GPU_CHECK_ARGS:-}
    burn_status=$?
    # A run that did not end by itself: say so in its JSON, so that the table shows it.
    why=""
    (( burn_status == 124 )) && why="ran past its ${GPU_CHECK_TIMEOUT:-330} s limit (GPU_CHECK_TIMEOUT) and was stopped; the lines before this one are what it finished"
    (( burn_status > 128 )) && why="was killed by signal $((burn_status - 128)) (see gpu_check.stderr); the lines before this one are what it finished"
    [[ -n "$why" ]] && printf '{"kind": "error", "impl": "burn-amp", "what": "process", "error": "gpu_check %s"}\n' \
        "$why" >> "$out/gpu_check.jsonl"
fi

# 4. PyTorch, the same models (CUDA only).
if [[ "$backend" == cuda ]] && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    log "torch_reference.py ${TORCH_ARGS:-}"
    # shellcheck disable=SC2086
    timeout "${TORCH_TIMEOUT:-120}" python3 scripts/torch_reference.py ${TORCH_ARGS:-} \
        > "$out/torch.jsonl" 2> >(tee "$out/torch.stderr" >&2)
    log "torch_reference.py exited with $?"
else
    log "PyTorch with CUDA not found (or backend $backend): no PyTorch columns"
    rm -f "$out/torch.jsonl"
fi

# 5. gpu_check's numerics part, last, in the time left (the figures above come first): the
# checks of tests/autocast_numerics at f16 and bf16 on this backend, the Burn defects Amp
# works around, random graphs while time lasts. GPU_CHECK_TOTAL is the whole script's budget
# (the device call's limit less a margin); GPU_CHECK_NUMERICS_SECONDS caps the part (CI).
total="${GPU_CHECK_TOTAL:-460}"
left=$(( total - ($(date +%s) - started) - 15 ))
cap="${GPU_CHECK_NUMERICS_SECONDS:-$left}"
(( cap < left )) && left=$cap
rm -f "$out/numerics.jsonl"
if [[ -n "${missing:-}" ]]; then
    log "numerics part not run: $missing"
elif (( left < 20 )); then
    log "numerics part not run: ${left} s left of GPU_CHECK_TOTAL=${total} s"
    printf '{"kind": "skipped", "impl": "burn-amp", "what": "numerics part", "why": "%s s left of the check'"'"'s %s s (GPU_CHECK_TOTAL)"}\n' \
        "$left" "$total" > "$out/numerics.jsonl"
else
    # A case may run past the budget (it checks the time before it starts): 60 s more.
    # shellcheck disable=SC2086
    GPU_CHECK_NUMERICS=1 run_gpu_check "$out/numerics.jsonl" numerics $((left + 60)) \
        --only numerics ${GPU_CHECK_ARGS:-}
    numerics_status=$?
    if (( numerics_status == 124 || numerics_status > 128 )); then
        printf '{"kind": "error", "impl": "burn-amp", "what": "numerics process", "error": "gpu_check --only numerics was stopped (status %s, see numerics.stderr); the lines before this one are what it finished"}\n' \
            "$numerics_status" >> "$out/numerics.jsonl"
    fi
    (( numerics_status != 0 && burn_status == 0 )) && burn_status=$numerics_status
fi

# 6. The table.
python3 scripts/gpu_table.py "$out"
table_status=$?
log "done in $(($(date +%s) - started)) s"
if (( burn_status != 0 )); then exit "$burn_status"; fi
exit "$table_status"
