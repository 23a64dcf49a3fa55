//! The loss scaler's gradient passes and the fused optimizer step, on `Wgpu` (fusion over
//! CubeCL; lavapipe on a machine without a GPU):
//!
//! 1. the fused `unscale_and_check` kernel against the same work composed from burn ops,
//!    against one bare `mul_scalar` pass (the floor), and the read-only `check_finite` pass
//!    that the fused optimizers now run instead of it (`ScalerKernels::check_finite`);
//! 2. a scaled AdamW step as the optimizer path now runs it (`check_finite` over all the
//!    gradients, then one `adamw_step` kernel per parameter with the real `inv_scale`: the
//!    kernel unscales in f32) against the old path (`unscale_and_check` into the gradients,
//!    then `adamw_step` with `inv_scale` 1);
//! 3. the fused gradient-accumulation kernel (`AccumKernels::accumulate`) against its burn-op
//!    composition (`accumulate::kernels::fallback::accumulate`).
//!
//! ```text
//! cargo bench --bench kernels                    # 25M params, 7 timed runs per path
//! cargo bench --bench kernels -- --quick         # 2.5M params, 3 timed runs (or BURN_AMP_BENCH_QUICK=1)
//! cargo bench --bench kernels -- --count-launches  # also count the kernels each path runs
//! ```
//!
//! Under `cargo test --all-targets` (no `--bench` argument) it runs as a quick smoke test.
//! Prints the tables, then one JSON line (also appended to `target/tmp/burn-amp-benches.jsonl`).
//!
//! Every table compares paths side by side: each timed round runs every path once, in an
//! order that rotates from round to round, so a drift of the machine (other builds on a shared
//! CPU, lavapipe's threads) hits all paths alike. A timing is one call over all the tensors
//! followed by `sync`; the median of the timed rounds after two warm-up rounds.
//!
//! Gradient passes (1): each path runs on the same gradients, held by the caller (the unscaling
//! paths write a fresh output), 100 tensors or 1 tensor of the same total size, f32 and f16.
//! Launch counts per call over T tensors, by reasoning (`--count-launches` checks them against
//! CubeCL's profiling log, which lists every kernel run; on lavapipe they agree):
//! - fused: T kernels, one `unscale_and_check_kernel` pass per tensor (the fusion custom op
//!   runs `CubeBackend`'s launches as they are; `found_inf` is raised in place since the
//!   caller hands it over, so no copy);
//! - composed (`scaler::kernels::fallback::unscale_and_check`): 8 burn ops per tensor (is_nan,
//!   is_inf, bool_or, bool_into_float, max, lower, mask_where, mul; the reshapes are metadata).
//!   Fusion runs the four bool ops unfused (4 kernels), the `max` reduction as 1 kernel, and
//!   fuses lower + mask_where + mul into 1 elementwise kernel: 6 kernels per tensor, reading
//!   the gradient 3 times and writing 4 full-size temporaries. f16 adds a cast to f32 first
//!   (its own kernel; the cast back fuses with the mul): 7 kernels per tensor;
//! - floor: T `mul_scalar` ops; alone (T = 1) that is 1 kernel, but fusion merges runs of
//!   independent same-shape elementwise ops, so 100 of them ran as 8 kernels (a bound of T,
//!   not an exact count);
//! - check: T kernels, one `check_finite_kernel` per tensor, reading the gradient once and
//!   writing nothing but the flag.
//!
//! Scaled step (2): f32 parameters (what `Amp<B>` trains) with f32 moments, f32 or f16
//! gradients; each path keeps its own parameters and moments and hands them back to the next
//! round (so its kernels work in place, as in training), and gets a fresh copy of the
//! gradients each round, made before the clock starts, that it owns (as the optimizer owns a
//! step's gradients, so the old path's unscale may write into them in place).
//!
//! Accumulation (3) (`acc += grad × 0.25`, f32 sums of f32 or f16 gradients, 100 tensors):
//! each path keeps its own sums and hands them back to the next call, as a window does, so
//! both may work in place; the gradients are held by the caller. Fused: one
//! `accumulate_kernel` per tensor. Composed: `mul_scalar` (+ a cast for f16) + `add`, which
//! fusion may fuse into one elementwise kernel per tensor, or merge across tensors.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "common/mode.rs"]
mod mode;
#[path = "common/report.rs"]
mod report;

use std::time::{Duration, Instant};

use burn::backend::Wgpu;
use burn::backend::wgpu::WgpuDevice;
use burn_amp::accumulate::AccumKernels;
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::optim::OptimKernels;
use burn_amp::optim::kernels::{AdamWMoments, Scaling};
use burn_amp::scaler::ScalerKernels;
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Distribution, Scalar, TensorData};
use burn_std::{FloatDType, Shape};
use common::median;

type B = Wgpu;

const INV_SCALE: f32 = 1.0 / 1024.0;
const LOG: &str = "/tmp/burn-amp-bench-kernels.log";

mod fallback {
    pub use burn_amp::accumulate::kernels::fallback::accumulate;
    pub use burn_amp::scaler::kernels::fallback::unscale_and_check;
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    Fused,
    Composed,
    Floor,
    Check,
}

impl Path {
    const ALL: [Path; 4] = [Path::Fused, Path::Composed, Path::Floor, Path::Check];

    fn name(self) -> &'static str {
        match self {
            Path::Fused => "fused",
            Path::Composed => "composed",
            Path::Floor => "floor",
            Path::Check => "check",
        }
    }

    /// Kernel launches per call over `t` tensors, by reasoning (see the module docs); the
    /// floor's is an upper bound (fusion may merge its ops).
    fn reasoned_launches(self, t: usize, dtype: FloatDType) -> usize {
        match self {
            Path::Fused => t,
            Path::Composed if dtype == FloatDType::F32 => 6 * t,
            Path::Composed => 7 * t,
            Path::Floor => t,
            Path::Check => t,
        }
    }

    /// Bytes each element costs this path: a read, plus a write of the same size except for
    /// the read-only check.
    fn bytes_per_element(self, dtype: FloatDType) -> usize {
        match self {
            Path::Check => dtype_size(dtype),
            _ => 2 * dtype_size(dtype),
        }
    }
}

fn scalar(v: f32, device: &WgpuDevice) -> FloatTensor<B> {
    B::float_from_data(TensorData::new(vec![v], [1]), device)
}

fn sync(device: &WgpuDevice) {
    B::sync(device).expect("the device failed (out of memory?)");
}

/// The tensors one call of `path` leaves (dropped after the sync).
fn call(path: Path, grads: &[FloatTensor<B>], device: &WgpuDevice) -> Vec<FloatTensor<B>> {
    let inv = scalar(INV_SCALE, device);
    let found = scalar(0.0, device);
    match path {
        Path::Fused => {
            let (mut out, found) = B::unscale_and_check(grads.to_vec(), inv, found);
            out.push(found);
            out
        }
        Path::Composed => {
            let (mut out, found) = fallback::unscale_and_check::<B>(grads.to_vec(), inv, found);
            out.push(found);
            out
        }
        Path::Floor => grads
            .iter()
            .map(|g| B::float_mul_scalar(g.clone(), Scalar::Float(INV_SCALE as f64)))
            .collect(),
        Path::Check => vec![B::check_finite(grads.to_vec(), found)],
    }
}

/// One call of `path` over all the gradients; the outputs are dropped after the sync.
fn run(path: Path, grads: &[FloatTensor<B>], device: &WgpuDevice) -> Duration {
    // The small inputs are made inside `call`, but cost nothing next to the passes; the
    // device is idle when the clock starts.
    sync(device);
    let start = Instant::now();
    let outputs = call(path, grads, device);
    sync(device);
    let elapsed = start.elapsed();
    drop(outputs);
    sync(device);
    elapsed
}

/// Medians of `paths`, measured side by side: every round runs each path once, starting from
/// a different one each round.
fn side_by_side<P: Copy>(
    paths: &[P],
    warmup: usize,
    timed: usize,
    mut run: impl FnMut(P) -> Duration,
) -> Vec<Duration> {
    let mut times = vec![Vec::new(); paths.len()];
    for round in 0..warmup + timed {
        for k in 0..paths.len() {
            let i = (round + k) % paths.len();
            let t = run(paths[i]);
            if round >= warmup {
                times[i].push(t);
            }
        }
    }
    times.into_iter().map(median).collect()
}

fn profiled_kernels() -> usize {
    std::fs::read_to_string(LOG)
        .map(|s| {
            // One `| <duration> | <kernel>` line per kernel run; the summary tables that
            // follow start with a name instead.
            s.lines()
                .filter(|l| {
                    l.strip_prefix("| ")
                        .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
                })
                .count()
        })
        .unwrap_or(0)
}

/// Kernels one call of `path` runs, read from CubeCL's profiling log (after a warm-up
/// call, so compilation and autotune trials are not counted).
fn count_launches(path: Path, grads: &[FloatTensor<B>], device: &WgpuDevice) -> usize {
    run(path, grads, device);
    let settle = || std::thread::sleep(Duration::from_millis(500));
    settle();
    sync(device);
    settle();
    let start = profiled_kernels();
    let out = call(path, grads, device);
    sync(device);
    settle();
    let end = profiled_kernels();
    drop(out);
    end - start
}

fn random(n: usize, range: f64, dtype: FloatDType, device: &WgpuDevice) -> FloatTensor<B> {
    let g = B::float_random(
        Shape::new([n]),
        Distribution::Uniform(-range, range),
        device,
        FloatDType::F32,
    );
    if dtype == FloatDType::F32 {
        g
    } else {
        B::float_cast(g, dtype)
    }
}

/// The gradient passes (1): one table row per dtype, layout and path; one JSON object per
/// dtype and layout.
fn bench_passes(
    total: usize,
    timed: usize,
    warmup: usize,
    count: bool,
    quick: bool,
    device: &WgpuDevice,
) -> Vec<String> {
    println!(
        "unscale_and_check / check_finite on Wgpu ({}): {total} params, median of {timed} rounds after {warmup} warm-ups",
        if quick { "quick" } else { "full" }
    );
    println!(
        "| grads | layout        | path     | median ms | GB/s (r+w) | vs fused | kernels (reasoned{}) |",
        if count { " / measured" } else { "" }
    );
    println!(
        "|-------|---------------|----------|-----------|------------|----------|----------------------|"
    );
    let mut json = Vec::new();
    for dtype in [FloatDType::F32, FloatDType::F16] {
        for tensors in [100usize, 1] {
            let each = total / tensors;
            let grads: Vec<FloatTensor<B>> = (0..tensors)
                .map(|_| random(each, 1000.0, dtype, device))
                .collect();
            sync(device);

            let medians = side_by_side(&Path::ALL, warmup, timed, |p| run(p, &grads, device));
            let measured: Vec<Option<usize>> = Path::ALL
                .iter()
                .map(|&p| count.then(|| count_launches(p, &grads, device)))
                .collect();

            let s =
                |p: Path| medians[Path::ALL.iter().position(|&q| q == p).unwrap()].as_secs_f64();
            let fused = s(Path::Fused);
            let layout = format!("{tensors} x {each}");
            for (i, path) in Path::ALL.iter().enumerate() {
                let secs = medians[i].as_secs_f64();
                let gbps = (total * path.bytes_per_element(dtype)) as f64 / secs / 1e9;
                let kernels = match measured[i] {
                    Some(m) => format!("{} / {m}", path.reasoned_launches(tensors, dtype)),
                    None => format!("{}", path.reasoned_launches(tensors, dtype)),
                };
                println!(
                    "| {:<5} | {layout:<13} | {:<8} | {:>9.1} | {gbps:>10.2} | {:>7.2}x | {kernels:>20} |",
                    format!("{dtype:?}"),
                    path.name(),
                    secs * 1e3,
                    secs / fused,
                );
            }
            let launches = |p: Path| {
                let i = Path::ALL.iter().position(|&q| q == p).unwrap();
                match measured[i] {
                    Some(m) => format!(
                        "{{\"reasoned\":{},\"measured\":{m}}}",
                        p.reasoned_launches(tensors, dtype)
                    ),
                    None => format!("{{\"reasoned\":{}}}", p.reasoned_launches(tensors, dtype)),
                }
            };
            let (composed, floor, check) = (s(Path::Composed), s(Path::Floor), s(Path::Check));
            json.push(format!(
                "{{\"grad_dtype\":\"{dtype:?}\",\"tensors\":{tensors},\"elements_each\":{each},\"fused_ms\":{:.2},\"composed_ms\":{:.2},\"floor_ms\":{:.2},\"check_ms\":{:.2},\"speedup_fused_vs_composed\":{:.3},\"fused_over_floor\":{:.3},\"check_over_unscale\":{:.3},\"launches\":{{\"fused\":{},\"composed\":{},\"floor\":{},\"check\":{}}}}}",
                fused * 1e3,
                composed * 1e3,
                floor * 1e3,
                check * 1e3,
                composed / fused,
                fused / floor,
                check / fused,
                launches(Path::Fused),
                launches(Path::Composed),
                launches(Path::Floor),
                launches(Path::Check),
            ));
        }
    }
    json
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum StepPath {
    /// `unscale_and_check` into the gradients, then AdamW with `inv_scale` 1.
    Old,
    /// `check_finite`, then AdamW with the real `inv_scale` (unscaled in f32 in the kernel).
    New,
}

/// One path's parameters and AdamW state.
struct StepState {
    params: Vec<FloatTensor<B>>,
    moments: Vec<AdamWMoments<FloatTensor<B>>>,
}

impl StepState {
    fn new(tensors: usize, each: usize, device: &WgpuDevice) -> Self {
        let zeros = || B::float_zeros(Shape::new([each]), device, FloatDType::F32);
        Self {
            params: (0..tensors)
                .map(|_| random(each, 1.0, FloatDType::F32, device))
                .collect(),
            moments: (0..tensors)
                .map(|_| AdamWMoments {
                    exp_avg: zeros(),
                    exp_avg_sq: zeros(),
                    max_exp_avg_sq: None,
                    step: B::float_zeros(Shape::new([1]), device, FloatDType::F32),
                })
                .collect(),
        }
    }
}

/// One scaled AdamW step over every parameter by `path`, on `grads` (owned).
fn scaled_step(
    path: StepPath,
    state: &mut StepState,
    grads: Vec<FloatTensor<B>>,
    config: &FusedAdamWConfig,
    device: &WgpuDevice,
) {
    let zero = scalar(0.0, device);
    let (grads, found, inv) = match path {
        StepPath::Old => {
            let (grads, found) = B::unscale_and_check(grads, scalar(INV_SCALE, device), zero);
            (grads, found, scalar(1.0, device))
        }
        StepPath::New => {
            let found = B::check_finite(grads.clone(), zero);
            (grads, found, scalar(INV_SCALE, device))
        }
    };
    let params = std::mem::take(&mut state.params);
    let moments = std::mem::take(&mut state.moments);
    for ((p, m), g) in params.into_iter().zip(moments).zip(grads) {
        let scaling = Scaling {
            inv_scale: inv.clone(),
            found_inf: found.clone(),
        };
        let (p, m) = B::adamw_step(p, g, m, scaling, 1e-3, config);
        state.params.push(p);
        state.moments.push(m);
    }
}

/// The scaled step (2): old path against new, per gradient dtype and layout.
fn bench_scaled_step(
    total: usize,
    timed: usize,
    warmup: usize,
    device: &WgpuDevice,
) -> Vec<String> {
    let config = FusedAdamWConfig::new();
    println!();
    println!(
        "scaled AdamW step on Wgpu: {total} f32 params, f32 moments; old = unscale_and_check + adamw(inv_scale 1), new = check_finite + adamw(inv_scale); median of {timed} rounds after {warmup} warm-ups"
    );
    println!("| grads | layout        | path | median ms | new / old |");
    println!("|-------|---------------|------|-----------|-----------|");
    let mut json = Vec::new();
    for dtype in [FloatDType::F32, FloatDType::F16] {
        for tensors in [100usize, 1] {
            let each = total / tensors;
            let grads: Vec<FloatTensor<B>> = (0..tensors)
                .map(|_| random(each, 1000.0, dtype, device))
                .collect();
            let mut old = StepState::new(tensors, each, device);
            let mut new = StepState::new(tensors, each, device);
            sync(device);
            let medians = side_by_side(&[StepPath::Old, StepPath::New], warmup, timed, |path| {
                // A copy the path owns, made before the clock starts.
                let owned: Vec<FloatTensor<B>> = grads
                    .iter()
                    .map(|g| B::float_mul_scalar(g.clone(), Scalar::Float(1.0)))
                    .collect();
                sync(device);
                let state = match path {
                    StepPath::Old => &mut old,
                    StepPath::New => &mut new,
                };
                let start = Instant::now();
                scaled_step(path, state, owned, &config, device);
                sync(device);
                start.elapsed()
            });
            let (o, n) = (medians[0].as_secs_f64(), medians[1].as_secs_f64());
            let layout = format!("{tensors} x {each}");
            for (name, s) in [("old", o), ("new", n)] {
                println!(
                    "| {:<5} | {layout:<13} | {name:<4} | {:>9.1} | {:>8.3}x |",
                    format!("{dtype:?}"),
                    s * 1e3,
                    s / o,
                );
            }
            json.push(format!(
                "{{\"grad_dtype\":\"{dtype:?}\",\"tensors\":{tensors},\"elements_each\":{each},\"old_ms\":{:.2},\"new_ms\":{:.2},\"new_over_old\":{:.3}}}",
                o * 1e3,
                n * 1e3,
                n / o,
            ));
        }
    }
    json
}

/// Fused accumulation against the burn-op composition; one row per gradient dtype.
fn bench_accumulate(total: usize, timed: usize, warmup: usize, device: &WgpuDevice) -> String {
    const WEIGHT: f32 = 0.25;
    let tensors = 100;
    let each = total / tensors;
    println!();
    println!(
        "accumulate (acc += grad x {WEIGHT}) on Wgpu: {tensors} x {each}, median of {timed} rounds after {warmup} warm-ups"
    );
    println!("| grad dtype | path     | median ms | GB/s (r+w) | vs fused |");
    println!("|------------|----------|-----------|------------|----------|");
    let mut json = Vec::new();
    for dtype in [FloatDType::F32, FloatDType::F16] {
        let grads: Vec<FloatTensor<B>> = (0..tensors)
            .map(|_| random(each, 1.0, dtype, device))
            .collect();
        let new_sums = || -> Vec<FloatTensor<B>> {
            (0..tensors)
                .map(|_| B::float_zeros(Shape::new([each]), device, FloatDType::F32))
                .collect()
        };
        let mut sums = [new_sums(), new_sums()];
        let medians = side_by_side(&[true, false], warmup, timed, |fused| {
            let accs = std::mem::take(&mut sums[usize::from(!fused)]);
            sync(device);
            let start = Instant::now();
            let accs: Vec<FloatTensor<B>> = accs
                .into_iter()
                .zip(&grads)
                .map(|(acc, g)| {
                    if fused {
                        B::accumulate(Some(acc), g.clone(), WEIGHT)
                    } else {
                        fallback::accumulate::<B>(Some(acc), g.clone(), WEIGHT)
                    }
                })
                .collect();
            sync(device);
            let elapsed = start.elapsed();
            sums[usize::from(!fused)] = accs;
            elapsed
        });
        let (fused, composed) = (medians[0].as_secs_f64(), medians[1].as_secs_f64());
        // Reads the sum and the gradient, writes the sum.
        let bytes = total * (4 + 4 + dtype_size(dtype));
        for (name, s) in [("fused", fused), ("composed", composed)] {
            println!(
                "| {:<10} | {name:<8} | {:>9.1} | {:>10.2} | {:>7.2}x |",
                format!("{dtype:?}"),
                s * 1e3,
                bytes as f64 / s / 1e9,
                s / fused,
            );
        }
        json.push(format!(
            "{{\"grad_dtype\":\"{dtype:?}\",\"fused_ms\":{:.2},\"composed_ms\":{:.2},\"speedup_fused_vs_composed\":{:.3}}}",
            fused * 1e3,
            composed * 1e3,
            composed / fused,
        ));
    }
    format!("{{\"tensors\":{tensors},\"rows\":[{}]}}", json.join(","))
}

fn dtype_size(dtype: FloatDType) -> usize {
    match dtype {
        FloatDType::F64 => 8,
        FloatDType::F16 | FloatDType::BF16 => 2,
        FloatDType::F32 | FloatDType::Flex32 => 4,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = mode::quick() || std::env::var_os("BURN_AMP_BENCH_QUICK").is_some_and(|v| v != "0");
    let count = args.iter().any(|a| a == "--count-launches");
    if count {
        let _ = std::fs::remove_file(LOG);
        // SAFETY: single-threaded here, before any device exists; CubeCL reads its logging
        // configuration once, at first use.
        unsafe { std::env::set_var("CUBECL_DEBUG_LOG", LOG) };
    }
    let Some(device) = common::wgpu_device() else {
        println!("kernels bench skipped: no wgpu (Vulkan) adapter");
        return;
    };

    let total: usize = if quick { 2_500_000 } else { 25_000_000 };
    let timed = if quick { 3 } else { 7 };
    let warmup = 2;

    let passes = bench_passes(total, timed, warmup, count, quick, &device);
    let steps = bench_scaled_step(total, timed, warmup, &device);
    let accumulate = bench_accumulate(total, timed, warmup, &device);
    report::emit(&format!(
        "{{\"bench\":\"kernels\",\"backend\":\"Wgpu\",\"quick\":{quick},\"total_params\":{total},\"timed_runs\":{timed},\"layouts\":[{}],\"scaled_step\":[{}],\"accumulate\":{accumulate}}}",
        passes.join(","),
        steps.join(","),
    ));
}
