//! The weight-cast cache on a recurrent layer: Burn's `Lstm` applies its gates' `Linear`s at
//! every timestep, so under autocast each timestep cast the weights again and autodiff saved
//! every copy. Measured side by side, per backend: what one forward keeps for its backward,
//! and the time of a forward and backward, in f32, in half precision cast per use, and in
//! half precision with the cache; then one JSON line.
//!
//! Flex: exact bytes (the counting allocator), bf16 (its default). Wgpu (lavapipe): CubeCL's
//! allocator, f16.

#[path = "common/report.rs"]
mod report;

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::nn::{Lstm, LstmConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::backend::cast_cache;
use burn_amp::memory::{CountingAlloc, DeviceMemory, parameter_bytes};
use burn_amp::{Amp, Precision, autocast};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

#[derive(Clone, Copy)]
struct Size {
    hidden: usize,
    seq: usize,
    batch: usize,
    iters: usize,
}

/// One configuration's figures: bytes kept by a forward, median time of a forward and backward.
#[derive(Clone, Copy)]
struct Figures {
    kept: u64,
    step: Duration,
}

fn measure<B: AutodiffBackend>(
    size: Size,
    precision: Precision,
    cache: bool,
    in_use: impl Fn(&B::Device) -> u64,
) -> Figures {
    let device = Default::default();
    let _autocast = autocast(precision);
    let previous = cast_cache::set_enabled(cache);
    let lstm: Lstm<B> = LstmConfig::new(size.hidden, size.hidden, true).init(&device);
    let _ = parameter_bytes::<B, _>(&lstm); // materialise the lazy parameters
    let x = Tensor::<B, 3>::random(
        [size.batch, size.seq, size.hidden],
        Distribution::Default,
        &device,
    );
    let step = || {
        let _ = lstm.forward(x.clone(), None).0.mean().backward();
        B::sync(&device).unwrap();
    };
    step(); // kernels, first allocations
    let before = in_use(&device);
    let loss = lstm.forward(x.clone(), None).0.mean();
    let kept = in_use(&device).saturating_sub(before);
    let _ = loss.backward();
    let mut times: Vec<Duration> = (0..size.iters)
        .map(|_| {
            let start = Instant::now();
            step();
            start.elapsed()
        })
        .collect();
    times.sort();
    cast_cache::set_enabled(previous);
    Figures {
        kept,
        step: times[times.len() / 2],
    }
}

/// f32, half cast per use, half cached; on a thread of its own each (CubeCL counts memory per
/// thread's stream; autocast is per thread).
fn backend<B: AutodiffBackend>(
    size: Size,
    half: Precision,
    in_use: fn(&B::Device) -> u64,
) -> [Figures; 3] {
    let run = move |precision, cache| {
        std::thread::spawn(move || measure::<B>(size, precision, cache, in_use))
            .join()
            .unwrap()
    };
    [run(Precision::F32, true), run(half, false), run(half, true)]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick") || !args.iter().any(|a| a == "--bench");
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // SAFETY: single-threaded here, before any device exists.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    let size = if quick {
        Size {
            hidden: 32,
            seq: 8,
            batch: 2,
            iters: 1,
        }
    } else {
        Size {
            hidden: 256,
            seq: 64,
            batch: 16,
            iters: 5,
        }
    };
    let flex = backend::<Amp<Autodiff<Flex>>>(size, Precision::Bf16, |_| {
        CountingAlloc::bytes_in_use().unwrap()
    });
    let wgpu = backend::<Amp<Autodiff<Wgpu>>>(size, Precision::F16, |device| {
        Amp::<Autodiff<Wgpu>>::memory_snapshot(device)
            .unwrap()
            .bytes_in_use
    });

    println!(
        "Lstm hidden {} seq {} batch {}: bytes one forward keeps for its backward, median of {} forward+backward",
        size.hidden, size.seq, size.batch, size.iters
    );
    println!(
        "| backend | f32 kept | half, cast per use | half, cached | cached / per use | cached / f32 | step f32 | step per use | step cached | cached / per use time |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut json = Vec::new();
    for (name, [f32, per_use, cached]) in [("Flex (bf16)", flex), ("Wgpu (f16)", wgpu)] {
        let memory = cached.kept as f64 / per_use.kept as f64;
        let versus_f32 = cached.kept as f64 / f32.kept as f64;
        let time = cached.step.as_secs_f64() / per_use.step.as_secs_f64();
        println!(
            "| {name} | {:.2} MiB | {:.2} MiB | {:.2} MiB | {memory:.3} | {versus_f32:.3} | {:.1} ms | {:.1} ms | {:.1} ms | {time:.3} |",
            mib(f32.kept),
            mib(per_use.kept),
            mib(cached.kept),
            ms(f32.step),
            ms(per_use.step),
            ms(cached.step),
        );
        let key = name.split(' ').next().unwrap().to_lowercase();
        json.push(format!(
            "\"{key}_kept_f32\":{},\"{key}_kept_per_use\":{},\"{key}_kept_cached\":{},\"{key}_kept_cached_over_per_use\":{memory:.4},\"{key}_kept_cached_over_f32\":{versus_f32:.4},\"{key}_step_cached_over_per_use\":{time:.4}",
            f32.kept, per_use.kept, cached.kept
        ));
    }
    report::emit(&format!(
        "{{\"bench\":\"cast_cache\",\"hidden\":{},\"seq\":{},\"batch\":{},\"iterations\":{},{}}}",
        size.hidden,
        size.seq,
        size.batch,
        size.iters,
        json.join(",")
    ));
}
