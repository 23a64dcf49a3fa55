//! Where the memory of a TinyLm training step goes, on wgpu (lavapipe) with allocator
//! figures: f32, f16 AMP, f16 AMP with half the parameters frozen, and f16 AMP with
//! activation checkpointing, ratios against f32; a validation epoch run on the autodiff model
//! against one on `model.valid()`, with what `GrowthWatch` says of it; then one JSON line.
//!
//! `cargo bench --bench memory` (`cargo test` runs it small, as a smoke test).

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "common/mode.rs"]
mod mode;
#[path = "common/report.rs"]
mod report;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Wgpu};
use burn::module::{AutodiffModule, ModuleMapper, Param};
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::kernels::AmpKernels;
use burn_amp::memory::{DeviceMemory, GrowthWatch, MemoryReport, StepMemory};
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::{Amp, Precision, autocast};
use common::mib;
use common::tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};

/// Freezes the first half of the parameters, in visiting order (the embeddings and the
/// first blocks): no gradients, no optimizer state for them.
struct FreezeHalf {
    seen: usize,
    half: usize,
}

impl<B: Backend> ModuleMapper<B> for FreezeHalf {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        self.seen += 1;
        if self.seen <= self.half {
            param.set_require_grad(false)
        } else {
            param
        }
    }
}

fn report<B>(
    precision: Precision,
    freeze_half: bool,
    config: TinyLmConfig,
    batch: usize,
) -> MemoryReport
where
    B: AutodiffBackend + DeviceMemory,
    B::InnerBackend: AmpKernels,
{
    let device = Default::default();
    let _g = autocast(precision);
    B::seed(&device, 1);
    let mut model = config.init::<B>(&device);
    if freeze_half {
        let n = num_param_tensors::<B, _>(&model);
        model = model.map(&mut FreezeHalf {
            seen: 0,
            half: n / 2,
        });
    }
    let mut optim = FusedAdamWConfig::new()
        .init::<B, TinyLm<B>>()
        .expect("the default config is valid");
    let mut task = ReversalTask::new(config.vocab, config.seq_len, 1);
    let mut last = MemoryReport::default();
    // The second step is measured: parameters materialised, optimizer state allocated.
    for _ in 0..2 {
        let (x, y) = task.batch::<B>(batch, &device);
        let mut memory = StepMemory::begin::<B>(&device);
        let loss = model.loss(x, y);
        memory.after_forward::<B>(&device);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        memory.after::<B>(&device);
        last = memory.report::<B, _>(&model, Some(&grads), optim.state_bytes(&model));
        model = optim.step(1e-3, model, grads);
        memory.after::<B>(&device);
    }
    let _ = model.valid();
    last
}

/// A validation epoch after a training step (f16 AMP), run on the autodiff model or on
/// `model.valid()`.
struct ValidationEpoch {
    /// Bytes in use above the epoch's start, at the highest sample (one after each batch).
    added: u64,
    /// The batch after which the `GrowthWatch` reported, and the rate it reported.
    reported: Option<(usize, u64)>,
    /// The activations of the training step before it, for scale.
    step_activations: u64,
}

fn validation_epoch(
    config: TinyLmConfig,
    batch: usize,
    batches: usize,
    on_valid: bool,
) -> ValidationEpoch {
    type B = Amp<Autodiff<Wgpu>>;
    let device = Default::default();
    let _g = autocast(Precision::F16);
    B::seed(&device, 1);
    let mut model = config.init::<B>(&device);
    let mut optim = FusedAdamWConfig::new()
        .init::<B, TinyLm<B>>()
        .expect("the default config is valid");
    let mut task = ReversalTask::new(config.vocab, config.seq_len, 1);
    let (x, y) = task.batch::<B>(batch, &device);
    let mut memory = StepMemory::begin::<B>(&device);
    let loss = model.loss(x, y);
    memory.after_forward::<B>(&device);
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let report = memory.report::<B, _>(&model, Some(&grads), 0);
    model = optim.step(1e-3, model, grads);
    let in_use = || B::memory_snapshot(&device).map_or(0, |s| s.bytes_in_use);

    let mut watch = GrowthWatch::default();
    watch.set_report(report);
    let start = in_use();
    let (mut added, mut reported) = (0, None);
    let valid = model.valid();
    for b in 0..batches {
        let (x, y) = task.batch::<B>(batch, &device);
        // The loss read or not, the graph is what stays.
        if on_valid {
            drop(valid.loss(x.inner(), y.inner()));
        } else {
            drop(model.loss(x, y));
        }
        added = added.max(in_use().saturating_sub(start));
        if let Err(growth) = watch.sample::<B>(&device) {
            reported.get_or_insert((b + 1, growth.bytes_per_step));
        }
    }
    ValidationEpoch {
        added,
        reported,
        step_activations: report.activations.unwrap_or(0),
    }
}

/// Number of float parameter tensors of `module`.
fn num_param_tensors<B: Backend, M: burn::module::Module<B>>(module: &M) -> usize {
    struct Count(usize);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<B, D>>) {
            self.0 += 1;
        }
    }
    let mut c = Count(0);
    module.visit(&mut c);
    c.0
}

fn main() {
    mode::ensure_runtime_dir();
    let quick = mode::quick();
    let (config, batch) = if quick {
        (TinyLmConfig::new().with_d_model(32).with_d_ff(64), 8)
    } else {
        (
            TinyLmConfig::new()
                .with_d_model(128)
                .with_d_ff(512)
                .with_seq_len(64)
                .with_n_layers(4)
                .with_dropout(0.0),
            32,
        )
    };
    // Each on a thread of its own: CubeCL counts memory per stream, per thread.
    let run = |name: &'static str, f: fn(TinyLmConfig, usize) -> MemoryReport| {
        let config = config.clone();
        (
            name,
            std::thread::spawn(move || f(config, batch)).join().unwrap(),
        )
    };
    let rows = [
        run("f32", |c, b| {
            report::<Autodiff<Wgpu>>(Precision::F32, false, c, b)
        }),
        run("f16 AMP", |c, b| {
            report::<Amp<Autodiff<Wgpu>>>(Precision::F16, false, c, b)
        }),
        run("f16 AMP, half frozen", |c, b| {
            report::<Amp<Autodiff<Wgpu>>>(Precision::F16, true, c, b)
        }),
        run("f16 AMP, checkpointing", |c, b| {
            report::<Amp<Autodiff<Wgpu, BalancedCheckpointing>>>(Precision::F16, false, c, b)
        }),
    ];
    let base = rows[0].1;
    println!(
        "TinyLm d_model {} seq {} layers {} batch {batch}, Wgpu (lavapipe), second training step, MiB",
        config.d_model, config.seq_len, config.n_layers
    );
    println!(
        "| config | params | frozen | grads | AdamW state | activations | peak in use | peak / f32 | activations / f32 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut json = Vec::new();
    for (name, r) in &rows {
        let ratio = |a: u64, b: u64| {
            if b == 0 {
                f64::NAN
            } else {
                a as f64 / b as f64
            }
        };
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} |",
            mib(r.parameters),
            mib(r.frozen_parameters),
            mib(r.gradients),
            mib(r.optimizer_state),
            mib(r.activations.unwrap_or(0)),
            mib(r.peak_in_use.unwrap_or(0)),
            ratio(r.peak_in_use.unwrap_or(0), base.peak_in_use.unwrap_or(0)),
            ratio(r.activations.unwrap_or(0), base.activations.unwrap_or(0)),
        );
        json.push(format!(
            "{{\"config\":\"{name}\",\"report\":{}}}",
            serde_json_line(r)
        ));
    }
    let (system_ns, counting_ns) = allocator_cost(if quick { 200_000 } else { 2_000_000 });
    println!();
    println!("| allocator, one 4 KiB alloc + free | ns | / System |");
    println!("|---|---|---|");
    println!("| System | {system_ns:.1} | 1.000 |");
    println!(
        "| CountingAlloc | {counting_ns:.1} | {:.3} |",
        counting_ns / system_ns
    );
    // A validation epoch on the training model against one on `model.valid()`.
    let batches = if quick { 12 } else { 20 };
    let epoch = |on_valid: bool| {
        let config = config.clone();
        std::thread::spawn(move || validation_epoch(config, batch, batches, on_valid))
            .join()
            .unwrap()
    };
    let (graphs, valid) = (epoch(false), epoch(true));
    println!();
    println!(
        "| validation epoch of {batches} batches after a step (f16 AMP) | MiB added at its highest | / the step's activations | GrowthWatch reported after batch | its rate / the step's activations |"
    );
    println!("|---|---|---|---|---|");
    for (name, e) in [
        ("on the autodiff model", &graphs),
        ("on model.valid()", &valid),
    ] {
        println!(
            "| {name} | {:.2} | {:.2} | {} | {} |",
            mib(e.added),
            e.added as f64 / e.step_activations.max(1) as f64,
            e.reported.map_or("none".into(), |(b, _)| b.to_string()),
            e.reported.map_or("-".into(), |(_, rate)| format!(
                "{:.3}",
                rate as f64 / e.step_activations.max(1) as f64
            )),
        );
    }
    let epoch_json = |e: &ValidationEpoch| {
        format!(
            "{{\"added\":{},\"reported_after\":{},\"rate\":{},\"step_activations\":{}}}",
            e.added,
            json_opt(e.reported.map(|(b, _)| b as u64)),
            json_opt(e.reported.map(|(_, r)| r)),
            e.step_activations
        )
    };
    report::emit(&format!(
        "{{\"bench\":\"memory\",\"rows\":[{}],\"alloc_ns_system\":{system_ns:.2},\"alloc_ns_counting\":{counting_ns:.2},\"counting_overhead\":{:.4},\"validation_batches\":{batches},\"validation_on_autodiff\":{},\"validation_on_valid\":{}}}",
        json.join(","),
        counting_ns / system_ns,
        epoch_json(&graphs),
        epoch_json(&valid)
    ));
}

/// Nanoseconds per 4 KiB allocation and free through `System` and through `CountingAlloc`
/// (called directly, side by side, alternating, median of 7 rounds): the counting
/// allocator's cost where a binary installs it.
fn allocator_cost(n: usize) -> (f64, f64) {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::time::Instant;
    fn time<A: GlobalAlloc>(alloc: &A, n: usize) -> f64 {
        let layout = Layout::from_size_align(4096, 16).unwrap();
        let start = Instant::now();
        for _ in 0..n {
            // SAFETY: a valid layout; the block is freed with the same layout.
            unsafe {
                let p = alloc.alloc(layout);
                std::hint::black_box(p);
                alloc.dealloc(p, layout);
            }
        }
        start.elapsed().as_nanos() as f64 / n as f64
    }
    let counting = burn_amp::memory::CountingAlloc::new();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        a.push(time(&System, n));
        b.push(time(&counting, n));
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(a), median(b))
}

/// The report as JSON (its serde form, written by hand to keep the bench dependency-free).
fn serde_json_line(r: &MemoryReport) -> String {
    format!(
        "{{\"parameters\":{},\"frozen_parameters\":{},\"gradients\":{},\"optimizer_state\":{},\"activations\":{},\"peak_in_use\":{},\"reserve_and_fragmentation\":{}}}",
        r.parameters,
        r.frozen_parameters,
        r.gradients,
        r.optimizer_state,
        json_opt(r.activations),
        json_opt(r.peak_in_use),
        json_opt(r.reserve_and_fragmentation)
    )
}

/// A measured figure, `null` where nothing measured it.
fn json_opt(v: Option<u64>) -> String {
    v.map_or("null".into(), |v| v.to_string())
}
