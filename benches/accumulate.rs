//! Gradient accumulation and frozen modules: what they cost and what they save.
//!
//! 1. One optimizer step of `TinyLm` at batch N·b against N micro-batches of b through
//!    `GradientAccumulation`: time (median) and peak memory.
//!    - `Autodiff<Flex>`: Flex has no allocator counter, so each configuration runs in a
//!      fresh child process and the figure is the **process peak RSS** (`VmHWM`) during the
//!      timed steps, above the RSS just before them (after a warm-up step, so parameters and
//!      optimizer state are in the base). glibc is told to `mmap` every block over 128 KiB
//!      (`MALLOC_MMAP_THRESHOLD_`), so freed tensors go back to the OS: a measurement of the
//!      process, not of tensors alone.
//!    - `Autodiff<Wgpu>` (lavapipe or a GPU; skipped with `--no-wgpu`, or without a Vulkan
//!      adapter except where `CI` is set, where a missing adapter fails): the allocator's
//!      `bytes_in_use`, read after `sync` on the model's thread, sampled after each forward,
//!      backward and step; the peak of the samples.
//!    - `micro+norm`: the same with the window's gradient norm tracked; its time over
//!      `micro`'s is the cost of `with_track_grad_norm` (`norm_tracking_ratio_*`).
//! 2. Bytes per parameter of parameters, gradients, Adam state and accumulation buffers for
//!    a two-half model (two `DeepMlp`s) with none frozen, half frozen in f32, and half frozen
//!    in bf16 (counted from the live tensors' shapes and dtypes).
//!
//! Prints a table, then one JSON line. `cargo bench --bench accumulate [-- --no-wgpu]`.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "common/report.rs"]
mod report;

use std::process::Command;
use std::time::Instant;

use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
use burn::backend::{Autodiff, Flex, Wgpu};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{Adam, AdamConfig, AdamState, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::FloatDType;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::accumulate::{GradientAccumulation, GradientAccumulationConfig};
use burn_amp::frozen::{Frozen, param_bytes};
use burn_amp::grads::gradient_bytes;
use burn_amp::{Amp, Precision, autocast};
use common::models::DeepMlp;
use common::tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};

/// Micro-batches per optimizer step.
const N: usize = 4;
/// Micro-batch size.
const MICRO: usize = 16;
const WARMUP: usize = 2;
const TIMED: usize = 5;
const LR: f64 = 1e-3;

fn model_config() -> TinyLmConfig {
    TinyLmConfig::new()
        .with_vocab(64)
        .with_seq_len(64)
        .with_d_model(128)
        .with_n_heads(4)
        .with_n_layers(2)
        .with_d_ff(512)
        .with_dropout(0.0)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// One batch of N·b.
    Big,
    /// N micro-batches of b through the wrapper.
    Micro,
    /// The same, the window's gradient norm tracked (`with_track_grad_norm`).
    Tracked,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Big => "big",
            Mode::Micro => "micro",
            Mode::Tracked => "micro+norm",
        }
    }

    fn all() -> [Mode; 3] {
        [Mode::Big, Mode::Micro, Mode::Tracked]
    }
}

type Adaptor<B> = OptimizerAdaptor<Adam, TinyLm<B>, B>;

/// The state of one training run: the model, both optimizers, the data.
struct Run<B: AutodiffBackend> {
    model: TinyLm<B>,
    big: Adaptor<B>,
    micro: GradientAccumulation<Adaptor<B>, B>,
    tracked: GradientAccumulation<Adaptor<B>, B>,
    task: ReversalTask,
    device: B::Device,
}

impl<B: AutodiffBackend> Run<B> {
    fn new(device: B::Device) -> Self {
        B::seed(&device, 1);
        let config = model_config();
        Self {
            model: config.init(&device),
            big: AdamConfig::new().init(),
            micro: GradientAccumulation::new(AdamConfig::new().init(), N).unwrap(),
            tracked: GradientAccumulationConfig::new(N)
                .with_track_grad_norm(true)
                .init(AdamConfig::new().init())
                .unwrap(),
            task: ReversalTask::new(config.vocab, config.seq_len, 3),
            device,
        }
    }

    /// One optimizer step; `probe(stage)` after each forward, backward and step.
    fn step(&mut self, mode: Mode, probe: &mut dyn FnMut(&B::Device)) {
        let model = self.model.clone();
        self.model = match mode {
            Mode::Big => {
                let (x, y) = self.task.batch::<B>(N * MICRO, &self.device);
                let loss = model.loss(x, y);
                probe(&self.device);
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                probe(&self.device);
                let model = self.big.step(LR, model, grads);
                probe(&self.device);
                model
            }
            Mode::Micro | Mode::Tracked => {
                let accum = if mode == Mode::Tracked {
                    &mut self.tracked
                } else {
                    &mut self.micro
                };
                let mut model = model;
                for _ in 0..N {
                    let (x, y) = self.task.batch::<B>(MICRO, &self.device);
                    let loss = model.loss(x, y);
                    probe(&self.device);
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    probe(&self.device);
                    model = accum.step(LR, model, grads);
                    probe(&self.device);
                }
                model
            }
        };
    }

    /// Median milliseconds per optimizer step.
    fn time(&mut self, mode: Mode) -> f64 {
        let mut none = |_: &B::Device| {};
        for _ in 0..WARMUP {
            self.step(mode, &mut none);
        }
        B::sync(&self.device).unwrap();
        let mut times: Vec<f64> = (0..TIMED)
            .map(|_| {
                let start = Instant::now();
                self.step(mode, &mut none);
                B::sync(&self.device).unwrap();
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        times.sort_by(f64::total_cmp);
        times[TIMED / 2]
    }
}

// ------------------------------------------------------------------ Flex: child processes

fn proc_status_kb(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Runs in a fresh process: warm up, reset the RSS high-water mark, time the steps.
fn child(mode: Mode) {
    let mut run = Run::<Autodiff<Flex>>::new(Default::default());
    let mut none = |_: &_| {};
    run.step(mode, &mut none);
    // Writing 5 to clear_refs resets VmHWM to the current RSS.
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let base = proc_status_kb("VmRSS:");
    let ms = run.time(mode);
    let peak = proc_status_kb("VmHWM:");
    println!(
        "CHILD {} {ms:.3} {base} {peak} {}",
        mode.name(),
        if reset { 1 } else { 0 }
    );
}

struct FlexResult {
    ms: f64,
    base_kb: u64,
    peak_kb: u64,
}

fn flex(mode: Mode) -> Option<FlexResult> {
    let exe = std::env::current_exe().ok()?;
    let out = Command::new(exe)
        .args(["--child", mode.name()])
        .env("MALLOC_MMAP_THRESHOLD_", "131072")
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("CHILD"))?;
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.get(5) != Some(&"1") {
        eprintln!("could not reset VmHWM: the Flex peak would include the set-up");
        return None;
    }
    Some(FlexResult {
        ms: f[2].parse().ok()?,
        base_kb: f[3].parse().ok()?,
        peak_kb: f[4].parse().ok()?,
    })
}

// ------------------------------------------------------------------ Wgpu: allocator

struct WgpuResult {
    ms: f64,
    /// Peak `bytes_in_use` over the samples of one step.
    peak: u64,
    /// `bytes_in_use` before the step (parameters, optimizer state).
    before: u64,
}

fn wgpu_in_use(device: &WgpuDevice) -> u64 {
    use cubecl::Runtime;
    <Autodiff<Wgpu> as Backend>::sync(device).expect("wgpu sync (out of memory?)");
    WgpuRuntime::client(device)
        .memory_usage()
        .map(|u| u.bytes_in_use)
        .unwrap_or(0)
}

fn wgpu(mode: Mode, device: &WgpuDevice) -> WgpuResult {
    let mut run = Run::<Autodiff<Wgpu>>::new(device.clone());
    let ms = run.time(mode);
    let before = wgpu_in_use(device);
    let mut peak = before;
    let mut probe = |d: &WgpuDevice| peak = peak.max(wgpu_in_use(d));
    run.step(mode, &mut probe);
    WgpuResult { ms, peak, before }
}

// ------------------------------------------------------------------ state bytes

/// Two halves of equal size; `L` is the lower half, frozen or not.
#[derive(Module, Debug)]
struct Halves<B: Backend, L> {
    lower: L,
    upper: DeepMlp<B>,
}

const WIDTH: usize = 256;
const DEPTH: usize = 4;

/// One half: `DEPTH` layers `WIDTH -> WIDTH`.
fn stack<B: Backend>(device: &B::Device) -> DeepMlp<B> {
    DeepMlp::new(WIDTH, DEPTH, device)
}

trait Lower<B: Backend>: Module<B> {
    fn run(&self, x: Tensor<B, 2>) -> Tensor<B, 2>;
}

impl<B: Backend> Lower<B> for DeepMlp<B> {
    fn run(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.forward(x)
    }
}

impl<B: Backend> Lower<B> for Frozen<DeepMlp<B>> {
    fn run(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.forward(x)
    }
}

#[derive(Debug, Clone, Copy)]
struct StateBytes {
    params: usize,
    param_bytes: usize,
    grad_bytes: usize,
    adam_bytes: usize,
    accum_bytes: usize,
}

fn adam_bytes<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    optim: &OptimizerAdaptor<Adam, M, B>,
) -> usize {
    struct Count<B: AutodiffBackend>(hashbrown::HashMap<ParamId, AdaptorRecord<Adam, B>>, usize);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Count<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(record) = self.0.get(&param.id) {
                let state: AdamState<B::InnerBackend, D> = record.clone().into_state();
                let m = state.momentum;
                for t in [m.moment_1, m.moment_2] {
                    self.1 += t.shape().num_elements() * t.dtype().size();
                }
            }
        }
    }
    let mut count = Count::<B>(optim.to_record(), 0);
    module.visit(&mut count);
    count.1
}

type S = Amp<Autodiff<Flex>>;

fn state_bytes<L: Lower<S> + AutodiffModule<S>>(model: Halves<S, L>) -> StateBytes
where
    Halves<S, L>: AutodiffModule<S>,
{
    let device = Default::default();
    let _g = autocast(Precision::F32);
    let loss = |m: &Halves<S, L>| {
        let x = Tensor::<S, 2>::random([32, WIDTH], burn::tensor::Distribution::Default, &device);
        m.upper.forward(m.lower.run(x)).powi_scalar(2).mean()
    };
    let params = model.num_params();
    let param_bytes = param_bytes(&model);
    let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
    let grad_bytes = gradient_bytes(&model, &grads) as usize;
    let mut adam: OptimizerAdaptor<Adam, Halves<S, L>, S> = AdamConfig::new().init();
    let model = adam.step(LR, model, grads);
    let adam_bytes = adam_bytes(&model, &adam);
    let mut accum =
        GradientAccumulation::new(AdamConfig::new().init::<S, Halves<S, L>>(), N).unwrap();
    let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
    let _ = accum.step(LR, model, grads);
    StateBytes {
        params,
        param_bytes,
        grad_bytes,
        adam_bytes,
        accum_bytes: accum.buffer_bytes(),
    }
}

// ------------------------------------------------------------------ report

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        let mode = Mode::all().into_iter().find(|m| m.name() == args[i + 1]);
        child(mode.expect("a mode's name"));
        return;
    }
    // Under `cargo test --all-targets` (no `--bench` argument) this runs as a smoke test:
    // Flex only.
    let no_wgpu = args.iter().any(|a| a == "--no-wgpu") || !args.iter().any(|a| a == "--bench");
    let config = model_config();
    let probe_params = config.init::<Flex>(&Default::default()).num_params();
    println!(
        "TinyLm: {probe_params} parameters, seq {} d_model {}; N = {N} micro-batches of b = {MICRO} against one batch of N·b = {}; Adam; median of {TIMED} steps",
        config.seq_len,
        config.d_model,
        N * MICRO
    );

    let mut json = Vec::new();
    // (backend, mode, ms) for the tracking ratio.
    let mut times: Vec<(&str, Mode, f64)> = Vec::new();
    println!(
        "\n| backend | mode | ms / optimizer step | peak memory above steady state | memory source |"
    );
    println!("|---|---|---|---|---|");
    for mode in Mode::all() {
        match flex(mode) {
            Some(r) => {
                times.push(("flex", mode, r.ms));
                let extra = r.peak_kb.saturating_sub(r.base_kb) * 1024;
                println!(
                    "| Autodiff<Flex> | {} | {:.1} | {:.1} MiB (RSS {:.1} → peak {:.1} MiB) | process peak RSS (VmHWM), fresh process |",
                    mode.name(),
                    r.ms,
                    extra as f64 / 1048576.0,
                    r.base_kb as f64 / 1024.0,
                    r.peak_kb as f64 / 1024.0
                );
                json.push(format!(
                    r#"{{"backend":"flex","mode":"{}","ms":{:.3},"peak_extra_bytes":{extra},"rss_base_bytes":{},"rss_peak_bytes":{},"memory_source":"peak_rss"}}"#,
                    mode.name(),
                    r.ms,
                    r.base_kb * 1024,
                    r.peak_kb * 1024
                ));
            }
            None => println!("| Autodiff<Flex> | {} | failed | | |", mode.name()),
        }
    }
    let device = if no_wgpu { None } else { common::wgpu_device() };
    match &device {
        Some(device) => {
            for mode in Mode::all() {
                let r = wgpu(mode, device);
                times.push(("wgpu", mode, r.ms));
                let extra = r.peak.saturating_sub(r.before);
                println!(
                    "| Autodiff<Wgpu> | {} | {:.1} | {:.1} MiB (in use {:.1} → peak {:.1} MiB) | allocator bytes_in_use after sync |",
                    mode.name(),
                    r.ms,
                    extra as f64 / 1048576.0,
                    r.before as f64 / 1048576.0,
                    r.peak as f64 / 1048576.0
                );
                json.push(format!(
                    r#"{{"backend":"wgpu","mode":"{}","ms":{:.3},"peak_extra_bytes":{extra},"in_use_before_bytes":{},"peak_in_use_bytes":{},"memory_source":"allocator"}}"#,
                    mode.name(),
                    r.ms,
                    r.before,
                    r.peak
                ));
            }
        }
        None => println!("| Autodiff<Wgpu> | skipped (no adapter or --no-wgpu) | | | |"),
    }

    // What tracking the norm costs: one reduction over the window's sums per optimizer step.
    let ms = |backend: &str, mode: Mode| {
        times
            .iter()
            .find(|(b, m, _)| *b == backend && *m == mode)
            .map(|t| t.2)
    };
    let mut ratios = Vec::new();
    for backend in ["flex", "wgpu"] {
        if let (Some(tracked), Some(micro)) = (ms(backend, Mode::Tracked), ms(backend, Mode::Micro))
        {
            let ratio = tracked / micro;
            println!("{backend}: micro+norm / micro time per optimizer step = {ratio:.3}");
            ratios.push(format!(r#""norm_tracking_ratio_{backend}":{ratio:.4}"#));
        }
    }

    let device = Default::default();
    S::seed(&device, 2);
    let rows = [
        (
            "none frozen",
            state_bytes(Halves {
                lower: stack::<S>(&device),
                upper: stack(&device),
            }),
        ),
        (
            "half frozen, f32 storage",
            state_bytes(Halves {
                lower: Frozen::new(stack::<S>(&device)),
                upper: stack(&device),
            }),
        ),
        (
            "half frozen, bf16 storage",
            state_bytes(Halves {
                lower: Frozen::new(stack::<S>(&device)).with_storage(FloatDType::BF16),
                upper: stack(&device),
            }),
        ),
    ];
    println!(
        "\nTwo halves of {DEPTH} Linear({WIDTH}, {WIDTH}) each; bytes per parameter (of all parameters), from live tensors:"
    );
    println!(
        "| model | params | weights | gradients | Adam state | accumulation buffers | total |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut state_json = Vec::new();
    for (name, s) in rows {
        let per = |b: usize| b as f64 / s.params as f64;
        let total = s.param_bytes + s.grad_bytes + s.adam_bytes + s.accum_bytes;
        println!(
            "| {name} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            s.params,
            per(s.param_bytes),
            per(s.grad_bytes),
            per(s.adam_bytes),
            per(s.accum_bytes),
            per(total)
        );
        state_json.push(format!(
            r#"{{"model":"{name}","params":{},"weight_bytes":{},"grad_bytes":{},"adam_bytes":{},"accum_bytes":{},"bytes_per_param":{:.3}}}"#,
            s.params, s.param_bytes, s.grad_bytes, s.adam_bytes, s.accum_bytes, per(total)
        ));
    }
    report::emit(&format!(
        r#"{{"bench":"accumulate","n":{N},"micro_batch":{MICRO},{}"steps":[{}],"state":[{}]}}"#,
        ratios.iter().map(|r| format!("{r},")).collect::<String>(),
        json.join(","),
        state_json.join(",")
    ));
}
