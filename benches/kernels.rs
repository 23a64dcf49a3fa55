//! The fused `unscale_and_check` kernel against the same work composed from burn ops and
//! against one bare `mul_scalar` pass (the floor), on `Wgpu` (fusion over CubeCL; lavapipe
//! on a machine without a GPU). Then the fused gradient-accumulation kernel
//! (`AmpKernels::accumulate`) against its burn-op composition (`fallback::accumulate`).
//!
//! ```text
//! cargo bench --bench kernels                    # 25M f32 params, 7 timed runs per path
//! cargo bench --bench kernels -- --quick         # 2.5M params, 3 timed runs (or BURN_AMP_BENCH_QUICK=1)
//! cargo bench --bench kernels -- --count-launches  # also count the kernels each path runs
//! ```
//!
//! Each path runs on the same gradients, held by the caller (every path writes a fresh
//! output), 100 tensors or 1 tensor of the same total size. Every timing is one call over all
//! the tensors followed by `sync`; the median of the timed runs after two warm-up runs.
//!
//! Launch counts per call over T tensors, by reasoning (`--count-launches` checks them against
//! CubeCL's profiling log, which lists every kernel run; on lavapipe they agree):
//! - fused: T kernels, one `unscale_and_check_kernel` pass per tensor (the fusion custom op
//!   runs `CubeBackend`'s launches as they are; `found_inf` is raised in place since the
//!   caller hands it over, so no copy);
//! - composed (`fallback::unscale_and_check`): 8 burn ops per tensor (is_nan, is_inf, bool_or,
//!   bool_into_float, max, lower, mask_where, mul; the reshapes are metadata). Fusion runs
//!   the four bool ops unfused (4 kernels), the `max` reduction as 1 kernel, and fuses
//!   lower + mask_where + mul into 1 elementwise kernel: 6 kernels per tensor, reading the
//!   gradient 3 times (is_nan, is_inf, mul) and writing 4 full-size temporaries;
//! - floor: T `mul_scalar` ops; alone (T = 1) that is 1 kernel, but fusion merges runs of
//!   independent same-shape elementwise ops, so 100 of them ran as 8 kernels (a bound of T,
//!   not an exact count).
//!
//! Accumulation (`acc += grad × 0.25`, f32 sums of f32 or f16 gradients, 100 tensors): each
//! path keeps its own sums and hands them back to the next call, as a window does, so both
//! may work in place; the gradients are held by the caller. Fused: one
//! `accumulate_kernel` per tensor. Composed: `mul_scalar` (+ a cast for f16) + `add`, which
//! fusion may fuse into one elementwise kernel per tensor, or merge across tensors.

#[path = "common/report.rs"]
mod report;

use std::time::{Duration, Instant};

use burn::backend::Wgpu;
use burn::backend::wgpu::WgpuDevice;
use burn_amp::kernels::{AmpKernels, fallback};
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Distribution, Scalar, TensorData};
use burn_std::{FloatDType, Shape};

type B = Wgpu;

const INV_SCALE: f32 = 1.0 / 1024.0;
const LOG: &str = "/tmp/burn-amp-bench-kernels.log";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    Fused,
    Composed,
    Floor,
}

impl Path {
    const ALL: [Path; 3] = [Path::Fused, Path::Composed, Path::Floor];

    fn name(self) -> &'static str {
        match self {
            Path::Fused => "fused",
            Path::Composed => "composed",
            Path::Floor => "floor",
        }
    }

    /// Kernel launches per call over `t` tensors, by reasoning (see the module docs); the
    /// floor's is an upper bound (fusion may merge its ops).
    fn reasoned_launches(self, t: usize) -> usize {
        match self {
            Path::Fused => t,
            Path::Composed => 6 * t,
            Path::Floor => t,
        }
    }
}

fn scalar(v: f32, device: &WgpuDevice) -> FloatTensor<B> {
    B::float_from_data(TensorData::new(vec![v], [1]), device)
}

fn sync(device: &WgpuDevice) {
    B::sync(device).expect("the device failed (out of memory?)");
}

/// One call of `path` over all the gradients; the outputs are dropped after the sync.
fn run(path: Path, grads: &[FloatTensor<B>], device: &WgpuDevice) -> Duration {
    // The small inputs are ready before the clock starts.
    let inv = scalar(INV_SCALE, device);
    let found = scalar(0.0, device);
    sync(device);
    let start = Instant::now();
    let outputs = match path {
        Path::Fused => {
            let (out, found) = B::unscale_and_check(grads.to_vec(), inv, found);
            (out, Some(found))
        }
        Path::Composed => {
            let (out, found) = fallback::unscale_and_check::<B>(grads.to_vec(), inv, found);
            (out, Some(found))
        }
        Path::Floor => {
            let out = grads
                .iter()
                .map(|g| B::float_mul_scalar(g.clone(), Scalar::Float(INV_SCALE as f64)))
                .collect();
            (out, None)
        }
    };
    sync(device);
    let elapsed = start.elapsed();
    drop(outputs);
    sync(device);
    elapsed
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
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
    let inv = scalar(INV_SCALE, device);
    let found = scalar(0.0, device);
    sync(device);
    settle();
    let start = profiled_kernels();
    let out = match path {
        Path::Fused => B::unscale_and_check(grads.to_vec(), inv, found).0,
        Path::Composed => fallback::unscale_and_check::<B>(grads.to_vec(), inv, found).0,
        Path::Floor => grads
            .iter()
            .map(|g| B::float_mul_scalar(g.clone(), Scalar::Float(INV_SCALE as f64)))
            .collect(),
    };
    sync(device);
    settle();
    let end = profiled_kernels();
    drop(out);
    end - start
}

/// Fused accumulation against the burn-op composition; one row per gradient dtype.
fn bench_accumulate(total: usize, timed: usize, warmup: usize, device: &WgpuDevice) -> String {
    const WEIGHT: f32 = 0.25;
    let tensors = 100;
    let each = total / tensors;
    println!();
    println!(
        "accumulate (acc += grad x {WEIGHT}) on Wgpu: {tensors} x {each}, median of {timed} runs after {warmup} warm-ups"
    );
    println!("| grad dtype | path     | median ms | GB/s (r+w) | vs fused |");
    println!("|------------|----------|-----------|------------|----------|");
    let mut json = Vec::new();
    for dtype in [FloatDType::F32, FloatDType::F16] {
        let grads: Vec<FloatTensor<B>> = (0..tensors)
            .map(|_| {
                let g = B::float_random(
                    Shape::new([each]),
                    Distribution::Uniform(-1.0, 1.0),
                    device,
                    FloatDType::F32,
                );
                if dtype == FloatDType::F32 {
                    g
                } else {
                    B::float_cast(g, dtype)
                }
            })
            .collect();
        let mut medians = Vec::new();
        for fused in [true, false] {
            let mut accs: Vec<FloatTensor<B>> = (0..tensors)
                .map(|_| B::float_zeros(Shape::new([each]), device, FloatDType::F32))
                .collect();
            let mut times = Vec::new();
            for i in 0..warmup + timed {
                sync(device);
                let start = Instant::now();
                accs = accs
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
                if i >= warmup {
                    times.push(start.elapsed());
                }
            }
            medians.push(median(times));
        }
        let (fused, composed) = (medians[0].as_secs_f64(), medians[1].as_secs_f64());
        // Reads the sum and the gradient, writes the sum.
        let bytes = total * (4 + 4 + dtype_size(dtype));
        for (name, s) in [("fused", fused), ("composed", composed)] {
            report::emit(&format!(
                "| {:<10} | {name:<8} | {:>9.1} | {:>10.2} | {:>7.2}x |",
                format!("{dtype:?}"),
                s * 1e3,
                bytes as f64 / s / 1e9,
                s / fused,
            ));
        }
        json.push(format!(
            "{{\"grad_dtype\":\"{dtype:?}\",\"fused_ms\":{:.2},\"composed_ms\":{:.2},\"speedup_fused_vs_composed\":{:.3}}}",
            fused * 1e3,
            composed * 1e3,
            composed / fused,
        ));
    }
    format!(
        "{{\"bench\":\"accumulate\",\"backend\":\"Wgpu\",\"total_params\":{total},\"tensors\":{tensors},\"timed_runs\":{timed},\"rows\":[{}]}}",
        json.join(",")
    )
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
    // `cargo bench` passes `--bench`; under `cargo test --all-targets` this is a quick smoke run.
    let quick = args.iter().any(|a| a == "--quick")
        || !args.iter().any(|a| a == "--bench")
        || std::env::var_os("BURN_AMP_BENCH_QUICK").is_some_and(|v| v != "0");
    let count = args.iter().any(|a| a == "--count-launches");
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        let dir = std::env::temp_dir().join("burn-amp-xdg");
        let _ = std::fs::create_dir_all(&dir);
        // SAFETY: single-threaded here, before any device exists.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", dir) };
    }
    if count {
        let _ = std::fs::remove_file(LOG);
        // SAFETY: as above; CubeCL reads its logging configuration once, at first use.
        unsafe { std::env::set_var("CUBECL_DEBUG_LOG", LOG) };
    }

    let total: usize = if quick { 2_500_000 } else { 25_000_000 };
    let timed = if quick { 3 } else { 7 };
    let warmup = 2;
    let device = WgpuDevice::default();

    println!(
        "unscale_and_check on Wgpu ({}): {total} f32 params, median of {timed} runs after {warmup} warm-ups",
        if quick { "quick" } else { "full" }
    );
    println!(
        "| layout        | path     | median ms | GB/s (r+w) | vs fused | kernels (reasoned{}) |",
        if count { " / measured" } else { "" }
    );
    println!(
        "|---------------|----------|-----------|------------|----------|----------------------|"
    );

    let mut json_layouts = Vec::new();
    for tensors in [100usize, 1] {
        let each = total / tensors;
        let grads: Vec<FloatTensor<B>> = (0..tensors)
            .map(|_| {
                B::float_random(
                    Shape::new([each]),
                    Distribution::Uniform(-1000.0, 1000.0),
                    &device,
                    FloatDType::F32,
                )
            })
            .collect();
        sync(&device);

        let mut medians = Vec::new();
        for path in Path::ALL {
            for _ in 0..warmup {
                run(path, &grads, &device);
            }
            let times: Vec<Duration> = (0..timed).map(|_| run(path, &grads, &device)).collect();
            medians.push(median(times));
        }
        let measured: Vec<Option<usize>> = Path::ALL
            .iter()
            .map(|&p| count.then(|| count_launches(p, &grads, &device)))
            .collect();

        let fused = medians[0].as_secs_f64();
        let layout = format!("{tensors} x {each}");
        for (i, path) in Path::ALL.iter().enumerate() {
            let s = medians[i].as_secs_f64();
            // Each path reads the grads once and writes an output of the same size.
            let gbps = (2 * total * 4) as f64 / s / 1e9;
            let kernels = match measured[i] {
                Some(m) => format!("{} / {m}", path.reasoned_launches(tensors)),
                None => format!("{}", path.reasoned_launches(tensors)),
            };
            println!(
                "| {layout:<13} | {:<8} | {:>9.1} | {gbps:>10.2} | {:>7.2}x | {kernels:>20} |",
                path.name(),
                s * 1e3,
                s / fused,
            );
        }
        let (composed, floor) = (medians[1].as_secs_f64(), medians[2].as_secs_f64());
        let launches = |i: usize, p: Path| match measured[i] {
            Some(m) => format!(
                "{{\"reasoned\":{},\"measured\":{m}}}",
                p.reasoned_launches(tensors)
            ),
            None => format!("{{\"reasoned\":{}}}", p.reasoned_launches(tensors)),
        };
        json_layouts.push(format!(
            "{{\"tensors\":{tensors},\"elements_each\":{each},\"fused_ms\":{:.2},\"composed_ms\":{:.2},\"floor_ms\":{:.2},\"speedup_fused_vs_composed\":{:.3},\"fused_over_floor\":{:.3},\"launches\":{{\"fused\":{},\"composed\":{},\"floor\":{}}}}}",
            fused * 1e3,
            composed * 1e3,
            floor * 1e3,
            composed / fused,
            fused / floor,
            launches(0, Path::Fused),
            launches(1, Path::Composed),
            launches(2, Path::Floor),
        ));
    }
    let accumulate_json = bench_accumulate(total, timed, warmup, &device);
    report::emit(&format!(
        "{{\"bench\":\"unscale_and_check\",\"backend\":\"Wgpu\",\"quick\":{quick},\"total_params\":{total},\"timed_runs\":{timed},\"layouts\":[{}]}}",
        json_layouts.join(",")
    ));
    println!("{accumulate_json}");
}
