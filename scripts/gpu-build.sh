#!/usr/bin/env bash
# Builds the GPU check here and packs it into .gpu/ (git-ignored), for a GPU machine that has
# no Rust toolchain and no network: the device tool carries .gpu/ with the working tree
# (`carry: [".gpu"]`, 64 MiB in all), and scripts/gpu-check.sh runs it there.
#
#   scripts/gpu-build.sh        release build with CUDA: what the GPU runs
#   scripts/gpu-build.sh --ci   CI: packs the wgpu debug build (with the README's test
#                               command's features, so its dependencies are already built),
#                               so that packing, manifest and size check run on every push;
#                               scripts/gpu-check.sh then runs it on lavapipe. .ci/run
#                               type-checks the CUDA build (no second compile of the world).
#
# .gpu/ holds gpu_check.xz (stripped; xz: 12 MiB against gzip's 19 for the release build, which
# leaves room for the kernel cache, scripts/cuda-compile-check.sh) and manifest.txt (what was
# built, from which commit, the binary's sha256, the newest glibc symbol it needs, and the
# sha256 of what its kernels are made from).
#
# A kernel cache already in .gpu/ is kept when the kernels' sources are those of the new build:
# CubeCL names a cached kernel by its type and configuration, not by its code, so a cache is
# only as good as the sources it was compiled from: cubecl_kernels/ (every #[cube] function of
# burn-amp lives there), Cargo.toml and Cargo.lock (CubeCL's, Burn's fusion and cudarc's code,
# pinned) and the build's features. A change elsewhere (the doctor, the examples, the README)
# needs only this build, not the hour of scripts/cuda-compile-check.sh again.
set -euo pipefail
cd "$(dirname "$0")/.."

dest=.gpu
# What the device tool carries in all is 64 MiB; the rest of the budget is the working tree.
limit_mib="${GPU_PACK_LIMIT_MIB:-56}"

case "${1:-}" in
    "")
        # CUDA 13.0 bindings: the driver there is CUDA 13.0 (580.x). Without nvcc here, cudarc
        # would otherwise bind the newest CUDA it knows.
        export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}"
        cargo build --release --features cuda --example gpu_check
        bin=target/release/examples/gpu_check
        build="release, --features cuda (CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION)"
        xz_level=-9
        ;;
    --ci)
        cargo build --no-default-features --example gpu_check
        bin=target/debug/examples/gpu_check
        build="debug, wgpu only, no autotune (CI packing check)"
        xz_level=-1 # the same format in a few seconds; its size is not what CI checks
        # A debug build is several times a release one; the limit that matters is the
        # release build's, checked where it is built.
        limit_mib="${GPU_PACK_LIMIT_MIB:-512}"
        ;;
    *)
        echo "usage: $0 [--ci]" >&2
        exit 2
        ;;
esac

# What the kernels are made from (see above); the CI build's differs by its features.
kernel_sources=$( { find cubecl_kernels -type f -print0 | sort -z | xargs -0 sha256sum
    sha256sum Cargo.toml Cargo.lock; echo "$build"; } | sha256sum | cut -d' ' -f1)
kept=$(mktemp -d)
trap 'rm -rf "$kept"' EXIT
if [[ -f $dest/kernel-cache.tar.xz ]] &&
    [[ $(sed -n 's/^for kernel sources sha256: //p' "$dest/kernel-cache.txt" 2>/dev/null) == "$kernel_sources" ]]; then
    mv "$dest"/kernel-cache.* "$kept/"
fi
rm -rf "$dest"
mkdir -p "$dest"
strip -o "$dest/gpu_check" "$bin"
sha=$(sha256sum "$dest/gpu_check" | cut -d' ' -f1)
stripped=$(stat -c %s "$dest/gpu_check")
glibc=$( (objdump -T "$dest/gpu_check" 2>/dev/null || true) | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
xz "$xz_level" -T0 -f "$dest/gpu_check"
packed=$(du -sb "$dest" | cut -f1)

cat > "$dest/manifest.txt" <<EOF
binary: gpu_check.xz (unxz to run)
build: $build
commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')
built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)
sha256 (unpacked): $sha
bytes unpacked: $stripped
newest glibc symbol: ${glibc:-none found}
kernel sources sha256: $kernel_sources
EOF
if [[ -f $kept/kernel-cache.tar.xz ]]; then
    mv "$kept"/kernel-cache.* "$dest/"
    packed=$(du -sb "$dest" | cut -f1)
    echo "kept .gpu/'s kernel cache: made from the same kernel sources ($(sed -n 's/^made: //p' "$dest/kernel-cache.txt"))"
fi

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "gpu_check: $(mib "$(stat -c %s "$bin")") MiB built, $(mib "$stripped") MiB stripped, $(mib "$packed") MiB packed in $dest/ (limit $limit_mib MiB)"
cat "$dest/manifest.txt"
if (( packed > limit_mib * 1048576 )); then
    echo "error: $dest/ is $(mib "$packed") MiB, over the $limit_mib MiB that the device tool can carry beside the tree" >&2
    exit 1
fi
