//! The GPU check: one binary that proves burn-amp on a GPU in one short call.
//!
//! Correctness first, on the backend as users run it (fusion) and, for the kernels, on the
//! bare CubeCL backend too:
//! - the autocast policy suite of `tests/autocast_ops.rs` (every op's output dtype and values
//!   against f32), at f16 and bf16;
//! - every `AmpKernels` kernel against its burn-op fallback (the checks of `tests/kernels`),
//!   in f32, f16 and, where the device has it, bf16;
//! - a scaled f16 training step with no host read, and a skipped overflowing step;
//! - gradient accumulation: 4 micro-batches of b against one batch of 4b.
//!
//! Then speed, unless a check failed: a training step (fused AdamW, the loss scaler at f16)
//! of a transformer and of a deep MLP at f32, bf16 and f16, the median of timed steps after a
//! warm-up, with the peak memory from CubeCL's allocator; and the fused unscale + inf/NaN
//! check's bandwidth. `scripts/torch_reference.py` runs the same models in PyTorch and
//! `scripts/gpu_table.py` puts both in one table.
//!
//! Apart (`--only numerics`, within `--numerics-seconds`; `gpu-check.sh` runs it last, in the
//! time left), the numerics part (`numerics.rs`): the checks of `tests/autocast_numerics` at
//! f16 and bf16 on this backend, the Burn 0.21 defects `Amp` works around, and random graphs
//! while time is left.
//!
//! Every result is one JSON line on stdout (and in `--out`), log text on stderr. A case that
//! ends the device's stream (a kernel that fails to compile or launch) stops the process with
//! status 3 and a `device_lost` line; `gpu-check.sh` starts it again after that case
//! (`--resume`, `device_lost.rs`).
//!
//! ```text
//! scripts/gpu-build.sh                 # here: release build with CUDA, packed into .gpu/
//! scripts/gpu-check.sh                 # there: runs .gpu/gpu_check and PyTorch, writes $OUT
//! cargo run --example gpu_check -- --backend wgpu --quick   # the same code on lavapipe
//! ```

#[path = "../../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;
mod correctness;
mod device_lost;
#[allow(dead_code, unused_imports, clippy::all)]
mod kernel_cases;
// `cargo test --all-targets` builds this example as a test harness too, where the included
// tests' own `#[test]`s would run a second time: that build leaves the numerics part out
// (its checks are the test targets themselves, run there).
#[cfg(not(test))]
mod numerics;
mod report;
mod speed;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::backend::Autodiff;
use burn::backend::wgpu::WgpuRuntime;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::memory::DeviceMemory;
use burn_amp::{Amp, AmpKernels, Precision};
use burn_cubecl::CubeBackend;
use clap::{Parser, ValueEnum};
use serde_json::json;

use device_lost::{DEVICE_LOST, DeviceLost, Resume, Steps};
use report::Report;

#[derive(Parser, Debug)]
#[command(about = "burn-amp's GPU check: correctness, then speed, as JSON lines")]
struct Args {
    /// cuda (needs --features cuda) or wgpu (the same checks on any Vulkan device).
    #[arg(long, value_enum, default_value_t = BackendArg::Cuda)]
    backend: BackendArg,
    /// Run one part only. Without it: correctness, then speed; the numerics part runs only
    /// when asked (gpu-check.sh runs it last, in the time left).
    #[arg(long, value_enum)]
    only: Option<Part>,
    /// Tiny speed sizes and few steps: a smoke run of the speed code (CI, lavapipe).
    #[arg(long)]
    quick: bool,
    /// Timed steps per model and precision (the median is reported).
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Untimed steps first: kernel compilation (JIT) and autotune.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Seconds for the numerics part (`--only numerics`): the checks of
    /// tests/autocast_numerics, then random graphs while time is left.
    #[arg(long, default_value_t = 60)]
    numerics_seconds: u64,
    /// At most this many random-graph seeds (0, 1, ...) in the numerics part; without it, seed
    /// after seed while time lasts. scripts/cuda-compile-check.sh compiles the first few
    /// ahead, for the kernel cache.
    #[arg(long)]
    numerics_seeds: Option<u64>,
    /// Measure speed even when a correctness check failed.
    #[arg(long)]
    speed_anyway: bool,
    /// Also write the JSON lines to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Reuse and keep compiled kernels in this folder (CubeCL's compilation cache, PTX on
    /// CUDA): one filled by scripts/cuda-compile-check.sh, without a GPU, spares the GPU run
    /// most of its kernel compilation. Autotune results are not kept here.
    #[arg(long)]
    kernel_cache: Option<PathBuf>,
    /// Go on where a process stopped on a lost device: `speed`, or `numerics:<step>` (its
    /// `device_lost` line's `resume`; gpu-check.sh passes it).
    #[arg(long)]
    resume: Option<Resume>,
    /// Count the device as lost after this step of the numerics part (CI's check of
    /// `--resume`, on a device that cannot be made to lose its stream).
    #[arg(long, hide = true)]
    simulate_device_lost_at: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    Cuda,
    Wgpu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Part {
    Correctness,
    Speed,
    Numerics,
}

/// What the check needs of a backend: `Fused` is the backend users train on (fusion over
/// CubeCL), `Bare` the CubeCL backend under it (the kernels have a path for each).
pub trait Target {
    /// (`FusedBackend`: the numerics part's custom op, implemented for every CubeCL backend;
    /// the test-harness build has no numerics part, see `mod numerics`.)
    #[cfg(not(test))]
    type Fused: AmpKernels + DeviceMemory + numerics::custom_op::FusedBackend;
    #[cfg(test)]
    type Fused: AmpKernels + DeviceMemory;
    type Bare: AmpKernels<Device = Device<Self>>;
    /// Autocast over autodiff over `Fused`, as the examples train (the bounds are spelled
    /// here, proven once per target, so that generic code sees one device type).
    type Train: AutodiffBackend<Device = Device<Self>, InnerBackend: AmpKernels>;
    const NAME: &'static str;
    /// Whether f32 matmuls may run in TF32 (cubek-matmul's accelerated kernels on CUDA take
    /// f32 operands as TF32 where the device has it; autotune picks them at large sizes).
    const TF32: bool;
}

/// The training backend of a target.
pub type Train<T> = <T as Target>::Train;
/// The device of a target.
pub type Device<T> = burn::tensor::Device<<T as Target>::Fused>;

struct WgpuTarget;
impl Target for WgpuTarget {
    type Fused = burn::backend::Wgpu;
    type Bare = CubeBackend<WgpuRuntime, f32, i32, u32>;
    type Train = Amp<Autodiff<Self::Fused>>;
    const NAME: &'static str = "wgpu";
    const TF32: bool = false;
}

#[cfg(feature = "cuda")]
struct CudaTarget;
#[cfg(feature = "cuda")]
impl Target for CudaTarget {
    type Fused = burn_cuda::Cuda;
    type Bare = CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
    type Train = Amp<Autodiff<Self::Fused>>;
    const NAME: &'static str = "cuda";
    const TF32: bool = true;
}

fn main() {
    let args = Args::parse();
    let mut report = match Report::new(args.out.as_deref()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gpu_check: {e}");
            std::process::exit(2);
        }
    };
    if let Some(dir) = &args.kernel_cache {
        use_kernel_cache(dir);
    }
    // Debug builds of deep burn calls need a large stack (CI runs this unoptimized).
    let outcome = std::thread::Builder::new()
        .stack_size(256 << 20)
        .spawn(move || {
            // A panic here is outside any case (each catches its own): the device did not
            // start, most often. Say so in the JSON too, for the table.
            let ok =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match args.backend {
                    BackendArg::Wgpu => run::<WgpuTarget>(&args, &mut report),
                    #[cfg(feature = "cuda")]
                    BackendArg::Cuda => run::<CudaTarget>(&args, &mut report),
                    #[cfg(not(feature = "cuda"))]
                    BackendArg::Cuda => {
                        report.emit(
                            json!({"kind": "error", "impl": "burn-amp", "what": "backend",
                        "error": "--backend cuda needs a build with `--features cuda` \
                                  (scripts/gpu-build.sh); --backend wgpu runs without"}),
                        );
                        Ok(false)
                    }
                }))
                .unwrap_or_else(|panic| {
                    let error = correctness::panic_message(panic);
                    report.emit(
                        json!({"kind": "error", "impl": "burn-amp", "what": "device",
                    "error": format!("the run stopped outside any case (did the device start? \
                                      see the log): {error}")}),
                    );
                    Ok(false)
                });
            report.flush();
            ok
        })
        .expect("a thread for the check")
        .join();
    match outcome {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => std::process::exit(1),
        Ok(Err(DeviceLost)) => std::process::exit(DEVICE_LOST),
        Err(_) => std::process::exit(101),
    }
}

/// Turns CubeCL's compilation cache on, in `dir`, before any device starts (CubeCL reads its
/// configuration once; the rest of it still comes from cubecl.toml and CUBECL_* variables).
fn use_kernel_cache(dir: &Path) {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.compilation.cache = Some(CacheConfig::File(dir.to_path_buf()));
    CubeClRuntimeConfig::set(config);
}

/// Runs the parts asked for (after a lost device, those left: `--resume`); `false` when a
/// check failed or a part could not run, `Err` when a case ended the device's stream.
fn run<T: Target>(args: &Args, report: &mut Report) -> Result<bool, DeviceLost> {
    let device = Device::<T>::default();
    let (only, numerics_from) = match args.resume {
        None => (args.only, 0),
        Some(Resume::Speed) => (Some(Part::Speed), 0),
        Some(Resume::Numerics(step)) => (Some(Part::Numerics), step),
    };
    report.emit(json!({
        "kind": "env", "impl": "burn-amp", "backend": T::NAME,
        "device": <T::Fused as burn_backend::Backend>::name(&device),
        "burn": "0.21.0", "burn_amp": env!("CARGO_PKG_VERSION"),
        "profile": if cfg!(debug_assertions) { "debug" } else { "release" },
        "started": report::now_utc(),
        "kernel_cache": args.kernel_cache.as_ref().map(|d| d.display().to_string()),
        "resume": args.resume.map(|r| r.to_string()),
    }));
    let started = Instant::now();
    let mut ok = true;
    if only.is_none() || only == Some(Part::Correctness) {
        let failed = correctness::run::<T>(&device, report);
        report.emit(
            json!({"kind": "warmup", "what": "correctness (first compilation of every kernel)",
            "seconds": started.elapsed().as_secs_f64()}),
        );
        if failed > 0 {
            ok = false;
            eprintln!("gpu_check: {failed} correctness case(s) failed (see the JSON lines)");
            // The speed part, when it runs, runs on a device that still reads.
            let speed_next = only.is_none() && args.speed_anyway;
            if speed_next && !device_lost::device_reads::<T::Fused>(&device) {
                let after = "the correctness part";
                return Err(device_lost::lost(report, after, Resume::Speed, false));
            }
        }
    }
    if only.is_none() || only == Some(Part::Speed) {
        if ok || args.speed_anyway || args.resume == Some(Resume::Speed) {
            let sizes = if args.quick {
                speed::Sizes::quick()
            } else {
                speed::Sizes::full()
            };
            let (steps, warmup) = if args.quick {
                (args.steps.min(3), args.warmup.min(1))
            } else {
                (args.steps, args.warmup)
            };
            ok &= speed::run::<T>(&device, &sizes, steps, warmup, report);
        } else {
            report.emit(json!({"kind": "skipped", "what": "speed",
                "why": "a correctness check failed (--speed-anyway measures anyway)"}));
        }
    }
    if only == Some(Part::Numerics) {
        let lows = low_precisions::<T>(&device);
        let budget = Duration::from_secs(args.numerics_seconds);
        let mut steps = Steps::new(numerics_from, args.simulate_device_lost_at);
        #[cfg(not(test))]
        let failed = numerics::run::<T>(
            &device,
            &lows,
            budget,
            args.numerics_seeds,
            &mut steps,
            report,
        )?;
        // The harness build (see `mod numerics`), whose `main` never runs.
        #[cfg(test)]
        let failed = {
            let _ = (lows, budget, args.numerics_seeds, &mut steps);
            0
        };
        if failed > 0 {
            ok = false;
            eprintln!("gpu_check: {failed} numerics case(s) failed (see the JSON lines)");
        }
    }
    eprintln!(
        "gpu_check: done in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(ok)
}

/// The half precisions the target's device runs (bf16: not on WGSL).
pub fn low_precisions<T: Target>(device: &Device<T>) -> Vec<Precision> {
    [Precision::F16, Precision::Bf16]
        .into_iter()
        .filter(|p| p.is_supported::<T::Fused>(device))
        .collect()
}
