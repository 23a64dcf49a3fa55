//! Fine-tuning with a frozen backbone: a TinyLm trained on sequence reversal is frozen and
//! stored in bf16 (f16 on wgpu), and a small trainable head on top of it learns a new task
//! (reverse, then add 1 to each token), under `Amp<Autodiff<B>>`.
//!
//! ```sh
//! cargo run --release --example finetune_frozen                  # Flex (CPU)
//! cargo run --release --example finetune_frozen -- --backend wgpu # allocator figures
//! ```
//!
//! Prints the memory of one fine-tuning step by category (`StepMemory`), and what each
//! parameter costs: a frozen one only its storage (2 bytes in bf16: no gradient, no optimizer
//! state, no f32 master copy), a trainable one 16 (f32 weight, f32 gradient, two f32 AdamW
//! moments). Then one JSON line on stdout.

// The shared model: each example uses part of its methods.
#[allow(dead_code)]
#[path = "../tests/common/tiny_lm.rs"]
mod tiny_lm;

/// Exact memory figures on Flex: the heap, counted (a CubeCL backend has its allocator's).
#[global_allocator]
static ALLOC: burn_amp::memory::CountingAlloc = burn_amp::memory::CountingAlloc::new();

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::module::{AutodiffModule, Module};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Gelu, Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::FloatDType;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::kernels::AmpKernels;
use burn_amp::memory::{DeviceMemory, MemoryReport, MemorySource, StepMemory, parameter_bytes};
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::scaler::GradScalerConfig;
use burn_amp::{Amp, AmpOptimizer, Frozen, Precision, autocast};
use clap::Parser;
use tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};

#[derive(Parser, Debug)]
#[command(about = "Fine-tune a head on a frozen, bf16-stored backbone with burn-amp")]
struct Args {
    /// flex (CPU) or wgpu.
    #[arg(long, default_value = "flex")]
    backend: String,
    /// Autocast precision [default: the device's best: bf16, else f16].
    #[arg(long)]
    precision: Option<Precision>,
    /// Storage of the frozen backbone, bf16, f16 or f32 [default: bf16 where supported,
    /// else f16].
    #[arg(long)]
    storage: Option<Precision>,
    /// Steps training the backbone on reversal, before it is frozen.
    #[arg(long, default_value_t = 80)]
    pretrain_steps: usize,
    /// Fine-tuning steps of the head.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Backbone width.
    #[arg(long, default_value_t = 64)]
    d_model: usize,
    /// Seed of the model and the data.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// The trainable part: an MLP from the backbone's logits to the new task's.
#[derive(Module, Debug)]
struct Head<B: Backend> {
    hidden: Linear<B>,
    act: Gelu,
    out: Linear<B>,
}

/// The frozen backbone and the trainable head.
#[derive(Module, Debug)]
struct Finetune<B: Backend> {
    backbone: Frozen<TinyLm<B>>,
    head: Head<B>,
}

impl<B: Backend> Finetune<B> {
    fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        // `Frozen` derefs to the module: its own `forward`, with parameters that take no
        // gradient.
        let features = self.backbone.forward(tokens);
        let h = self.head.act.forward(self.head.hidden.forward(features));
        self.head.out.forward(h)
    }

    fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let logits = self.forward(tokens);
        let [b, s, v] = logits.dims();
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.reshape([b * s, v]), targets.reshape([b * s]))
    }

    fn accuracy(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> f32 {
        let [b, s] = targets.dims();
        let predicted = self.forward(tokens).argmax(2).squeeze_dim::<2>(2);
        let right = predicted
            .equal(targets)
            .int()
            .sum()
            .into_scalar()
            .elem::<f32>();
        right / (b * s) as f32
    }
}

/// The new task: the reversed sequence, each token plus one (mod vocab).
fn shifted<B: Backend>(targets: Tensor<B, 2, Int>, vocab: usize) -> Tensor<B, 2, Int> {
    targets.add_scalar(1).remainder_scalar(vocab as i64)
}

fn main() {
    let args = Args::parse();
    let result = match args.backend.as_str() {
        "flex" => run::<Amp<Autodiff<Flex>>>(&args, "flex"),
        "wgpu" => run::<Amp<Autodiff<Wgpu>>>(&args, "wgpu"),
        other => Err(format!("unknown backend `{other}`: expected flex or wgpu").into()),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

/// The dtype a `--storage` choice keeps the frozen weights in (`f32`: f32).
fn storage_dtype(storage: Precision) -> FloatDType {
    storage.low_dtype().unwrap_or(FloatDType::F32)
}

fn per_param(bytes: u64, params: usize) -> f64 {
    bytes as f64 / params.max(1) as f64
}

fn run<B>(args: &Args, backend: &str) -> Result<(), Box<dyn std::error::Error>>
where
    B: AutodiffBackend + DeviceMemory,
    B::InnerBackend: AmpKernels,
{
    let device = B::Device::default();
    let best = Precision::default_for::<B>(&device);
    let precision = args.precision.unwrap_or(best);
    let storage = args.storage.unwrap_or(best);
    for (what, p) in [("precision", precision), ("storage", storage)] {
        if !p.is_supported::<B>(&device) {
            return Err(format!("{what} {p} is not supported on {backend}: try f16").into());
        }
    }
    let _amp = autocast(precision);
    B::seed(&device, args.seed);
    let config = TinyLmConfig::new()
        .with_d_model(args.d_model)
        .with_d_ff(args.d_model * 2)
        .with_dropout(0.0);
    let vocab = config.vocab;
    let mut task = ReversalTask::new(vocab, config.seq_len, args.seed);
    // 1. The backbone, trained briefly on reversal (every parameter trainable).
    let mut backbone: TinyLm<B> = config.init(&device);
    let mut loss = None;
    {
        // Loss scaling at f16, a pass-through otherwise. Dropped at the end of this block:
        // one `AmpOptimizer` per backend at a time, and the fine-tuning one comes next.
        let adamw = FusedAdamWConfig::new()
            .with_weight_decay(0.0)
            .init::<B, TinyLm<B>>()?;
        let mut optim = AmpOptimizer::new(adamw, GradScalerConfig::new())?;
        for _ in 0..args.pretrain_steps {
            let (x, y) = task.batch::<B>(args.batch, &device);
            let l = backbone.loss(x, y);
            let grads = GradientsParams::from_grads(l.clone().backward(), &backbone);
            backbone = optim.try_step(args.lr, backbone, grads)?;
            loss = Some(l);
        }
    }
    if let Some(l) = loss {
        eprintln!(
            "backbone: {} steps on reversal, loss {:.4}",
            args.pretrain_steps,
            l.into_scalar().elem::<f32>()
        );
    }

    // 2. Frozen and stored in half precision; a fresh trainable head.
    let hidden = 4 * vocab;
    let mut model = Finetune {
        backbone: Frozen::new(backbone).with_storage(storage_dtype(storage)),
        head: Head {
            hidden: LinearConfig::new(vocab, hidden).init(&device),
            act: Gelu::new(),
            out: LinearConfig::new(hidden, vocab).init(&device),
        },
    };
    let (x, y) = task.batch::<B::InnerBackend>(256, &device);
    let before = model.valid().accuracy(x, shifted(y, vocab));

    // 3. Fine-tuning: only the head has gradients and optimizer state.
    let adamw = FusedAdamWConfig::new()
        .with_weight_decay(0.0)
        .init::<B, Finetune<B>>()?;
    let mut optim = AmpOptimizer::new(adamw, GradScalerConfig::new())?;
    let mut report: Option<MemoryReport> = None;
    let mut losses = Vec::new();
    for step in 0..args.steps {
        let (x, y) = task.batch::<B>(args.batch, &device);
        let y = shifted(y, vocab);
        // The second step is measured: the optimizer state exists by then.
        let mut memory =
            (step == 1).then(|| StepMemory::begin::<B>(&device).with_micro_batch(args.batch));
        let l = model.loss(x, y);
        if let Some(m) = memory.as_mut() {
            m.after_forward::<B>(&device);
        }
        let grads = GradientsParams::from_grads(l.clone().backward(), &model);
        if let Some(m) = memory.as_mut() {
            m.after::<B>(&device);
            let state = optim.inner().state_bytes(&model);
            report = Some(m.report::<B, Finetune<B>>(&model, Some(&grads), state));
        }
        model = optim.try_step(args.lr, model, grads)?;
        // Kept on the device; read once at the end.
        losses.push(l.inner());
    }
    let losses: Vec<f32> = if losses.is_empty() {
        Vec::new()
    } else {
        Tensor::cat(losses, 0).into_data().iter::<f32>().collect()
    };
    let tail = &losses[losses.len().saturating_sub(10)..];
    let final_loss = tail.iter().sum::<f32>() / tail.len().max(1) as f32;
    let (x, y) = task.batch::<B::InnerBackend>(256, &device);
    let after = model.valid().accuracy(x, shifted(y, vocab));

    // 4. What each part costs.
    let frozen_params = model.backbone.num_params();
    let trainable_params = model.head.num_params();
    let (_, frozen_bytes) = parameter_bytes::<B, Frozen<TinyLm<B>>>(&model.backbone);
    let report = report.unwrap_or_default();
    let trainable_total = report.parameters + report.gradients + report.optimizer_state;
    let frozen_bpp = per_param(frozen_bytes, frozen_params);
    let trainable_bpp = per_param(trainable_total, trainable_params);

    eprintln!(
        "fine-tuning: {} steps, loss {final_loss:.4}; accuracy on the new task {:.1}% -> {:.1}%",
        args.steps,
        before * 100.0,
        after * 100.0
    );
    eprint!("{report}");
    eprintln!("bytes per parameter");
    eprintln!(
        "  frozen backbone  {frozen_params:>7} params  {frozen_bpp:>5.2} B/param  \
         ({storage} weights; no gradient, no optimizer state)"
    );
    eprintln!(
        "  trainable head   {trainable_params:>7} params  {trainable_bpp:>5.2} B/param  \
         (weights {:.2} + gradients {:.2} + AdamW state {:.2})",
        per_param(report.parameters, trainable_params),
        per_param(report.gradients, trainable_params),
        per_param(report.optimizer_state, trainable_params),
    );
    eprintln!(
        "  the backbone trained instead would take {:.1} KiB, frozen it takes {:.1} KiB",
        frozen_params as f64 * trainable_bpp / 1024.0,
        frozen_bytes as f64 / 1024.0
    );
    let source = match report.source {
        Some(MemorySource::Allocator) => "allocator",
        Some(MemorySource::CountingAllocator) => "counting_allocator",
        None => "tensor sizes",
    };
    let json = |v: Option<u64>| v.map_or("null".to_string(), |v| v.to_string());
    println!(
        "{{\"example\":\"finetune_frozen\",\"backend\":\"{backend}\",\"precision\":\"{precision}\",\"storage\":\"{storage}\",\"frozen_params\":{frozen_params},\"trainable_params\":{trainable_params},\"frozen_bytes_per_param\":{frozen_bpp:.3},\"trainable_bytes_per_param\":{trainable_bpp:.3},\"final_loss\":{final_loss},\"accuracy_before\":{before},\"accuracy_after\":{after},\"memory_source\":\"{source}\",\"parameters\":{},\"frozen_parameters\":{},\"gradients\":{},\"optimizer_state\":{},\"activations\":{},\"peak_in_use\":{},\"reserve_and_fragmentation\":{}}}",
        report.parameters,
        report.frozen_parameters,
        report.gradients,
        report.optimizer_state,
        json(report.activations),
        json(report.peak_in_use),
        json(report.reserve_and_fragmentation),
    );
    Ok(())
}
