//! The TinyLm of `train.rs` under burn-train's `Learner`, at any precision, with the
//! `TrainStep` a Burn user already has (`loss.backward()`, nothing of burn-amp in it).
//!
//! ```sh
//! cargo run --release --example learner                                  # Flex, bf16
//! cargo run --release --example learner -- --precision f16 --inject-nan-at 40,41
//! cargo run --release --example learner -- --backend wgpu               # f16 (no bf16 in WGSL)
//! cargo run --release --example learner -- --devices 2                   # two workers
//! cargo run --release --example learner -- --devices 2 --sharded
//! cargo run --release --example learner -- --accum 2 --micro-batch 32 --epochs 4
//! cargo run --release --example learner -- --epochs 4 --resume-epoch 3   # from a checkpoint
//! cargo run --release --example learner -- --ema 0.98                    # + a weight average
//! cargo run --release --example learner -- --ema 0.98 --validate-average # validated on it
//! cargo run --release --example learner -- --clip 1.0                    # + global-norm clipping
//! cargo run --release --example learner -- --grad-norm                   # the norm, unclipped
//! ```
//!
//! What differs from a plain burn-train program:
//! - the backend type, `Amp<Autodiff<Flex>>` (or `Wgpu`): autocast;
//! - the optimizer, wrapped once: `AmpOptimizer::new(GradientAccumulationConfig::new(N)
//!   .with_max_grad_norm(clip).with_track_grad_norm(norm).init(adam)?,
//!   GradScalerConfig::new())`. At f16 `backward` scales the loss and the step unscales,
//!   checks and skips on the device; at bf16/f32 it passes through. The accumulation window
//!   steps Adam once per N micro-batches on their mean (`Learner`'s own `grads_accumulation`
//!   would sum, and hold a second copy);
//! - `WindowedLrScheduler` around the cosine: `Learner` steps its scheduler per micro-batch,
//!   the wrapper advances the cosine once per window, so the schedule counts optimizer steps;
//! - two more metrics, the loss scale and the skipped steps;
//! - with `--ema`, `EmaOptimizer` around it all: a weight average in f32 after each Adam step
//!   (not after a micro-batch, not after a skipped step), in the checkpoints with the
//!   optimizer's state, evaluated on the held-out batch beside the trained weights; with
//!   `--validate-average` the model is `Averaged`: `Learner` validates the average and
//!   returns it (the held-out figures of both are then the average's).
//!
//! `--devices N` lists the same device N times (what one CPU or one lavapipe can do): the
//! workers are burn-train's threads, so the precision is set process-wide
//! (`set_default_precision`) rather than with a guard on this thread.
//!
//! burn-train's metrics read the loss and outputs of every micro-batch back to the host
//! (that is how `Learner` works); `train.rs` shows a loop that reads every k steps only.

// The shared model: each example uses part of its methods.
#[allow(dead_code)]
#[path = "../tests/common/tiny_lm.rs"]
mod tiny_lm;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::{AccuracyMetric, LearningRateMetric, LossMetric, MetricDefinition};
use burn::train::metric::{MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::{
    ClassificationOutput, ExecutionStrategy, InferenceStep, Learner, MultiDeviceOptim,
    SupervisedTraining, TrainOutput, TrainStep,
};
use burn_amp::accumulate::WindowedLrScheduler;
use burn_amp::amp_optimizer::{
    ActivationMemoryMetric, GradNormMetric, LossScaleMetric, SkippedStepsMetric, StepMemoryMetric,
};
use burn_amp::ema::{Averaged, EmaConfig, EmaOptimizer};
use burn_amp::kernels::AmpKernels;
use burn_amp::memory::DeviceMemory;
use burn_amp::scaler::GradScalerConfig;
use burn_amp::{Amp, AmpOptimizer, GradientAccumulationConfig, Precision, set_default_precision};
use clap::Parser;
use tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};

#[derive(Parser, Debug)]
#[command(about = "Train TinyLm under burn-train's Learner with burn-amp")]
struct Args {
    /// flex (CPU) or wgpu.
    #[arg(long, default_value = "flex")]
    backend: String,
    /// f32, f16 or bf16; the default is the device's best (bf16 on Flex, f16 on wgpu).
    #[arg(long)]
    precision: Option<Precision>,
    /// Train on this many workers (the default device listed N times).
    #[arg(long, default_value_t = 1)]
    devices: usize,
    /// With --devices: shard the optimizer step across the workers (`OptimSharded`) instead
    /// of stepping on the first (`OptimMainDevice`).
    #[arg(long)]
    sharded: bool,
    /// Learner iterations (1-based, counted over all epochs) whose batch gets a NaN, to show
    /// the loss scaler skipping them (f16 only).
    #[arg(long, value_delimiter = ',')]
    inject_nan_at: Vec<usize>,
    /// On wgpu, sample the step's memory (allocator figures) every this many iterations for
    /// the memory metrics; each sample waits for the device.
    #[arg(long, default_value_t = 32)]
    memory_every: usize,
    /// Epochs over the training set.
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// Training sequences.
    #[arg(long, default_value_t = 2048)]
    train_size: usize,
    /// Validation sequences.
    #[arg(long, default_value_t = 256)]
    valid_size: usize,
    /// Sequences per micro-batch (one `Learner` iteration).
    #[arg(long, default_value_t = 16)]
    micro_batch: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 4)]
    accum: usize,
    /// Peak learning rate of the cosine schedule.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    d_model: usize,
    /// Seed of the model and the data.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Print the metrics every this many iterations (micro-batches).
    #[arg(long, default_value_t = 32)]
    print_every: usize,
    /// Where `Learner` writes its logs and checkpoints.
    #[arg(long, default_value = "target/learner-example")]
    artifacts: PathBuf,
    /// Resume from the checkpoint of this epoch (in --artifacts).
    #[arg(long)]
    resume_epoch: Option<usize>,
    /// Clip each optimizer step's gradients to this global norm (and show the norm as a
    /// metric).
    #[arg(long)]
    clip: Option<f32>,
    /// Show each optimizer step's gradient norm as a metric, without clipping.
    #[arg(long)]
    grad_norm: bool,
    /// Keep a weight average of this decay (with warmup), evaluated beside the model.
    #[arg(long)]
    ema: Option<f64>,
    /// With --ema: `Learner` validates the average each epoch and returns it (`Averaged`).
    #[arg(long, requires = "ema")]
    validate_average: bool,
}

// ------------------------------------------------------------------------ data

/// One reversal sequence and its target.
#[derive(Debug, Clone)]
struct ReversalSample {
    tokens: Vec<i64>,
    targets: Vec<i64>,
}

/// A fixed set of reversal samples, made from [`ReversalTask`]'s seeded generator.
struct ReversalDataset {
    samples: Vec<ReversalSample>,
}

impl ReversalDataset {
    fn generate(size: usize, vocab: usize, seq_len: usize, seed: u64) -> Self {
        let (tokens, targets) =
            ReversalTask::new(vocab, seq_len, seed).batch::<Flex>(size, &Default::default());
        let rows = |t: Tensor<Flex, 2, Int>| -> Vec<Vec<i64>> {
            let values: Vec<i64> = t.into_data().iter::<i64>().collect();
            values.chunks(seq_len).map(<[i64]>::to_vec).collect()
        };
        let samples = rows(tokens)
            .into_iter()
            .zip(rows(targets))
            .map(|(tokens, targets)| ReversalSample { tokens, targets })
            .collect();
        Self { samples }
    }
}

impl Dataset<ReversalSample> for ReversalDataset {
    fn get(&self, index: usize) -> Option<ReversalSample> {
        self.samples.get(index).cloned()
    }

    fn len(&self) -> usize {
        self.samples.len()
    }
}

/// A batch of `[batch, seq_len]` tokens and targets.
#[derive(Debug, Clone)]
struct ReversalBatch<B: Backend> {
    tokens: Tensor<B, 2, Int>,
    targets: Tensor<B, 2, Int>,
    /// `--inject-nan-at` picked this batch: its logits become NaN.
    poisoned: bool,
}

/// Makes the batches; counts them, to poison those that `--inject-nan-at` names.
#[derive(Debug, Clone, Default)]
struct ReversalBatcher {
    made: Arc<AtomicUsize>,
    poison: Arc<Vec<usize>>,
}

impl<B: Backend> Batcher<B, ReversalSample, ReversalBatch<B>> for ReversalBatcher {
    fn batch(&self, items: Vec<ReversalSample>, device: &B::Device) -> ReversalBatch<B> {
        let (batch, seq) = (items.len(), items.first().map_or(0, |s| s.tokens.len()));
        let (mut tokens, mut targets) = (Vec::new(), Vec::new());
        for item in items {
            tokens.extend(item.tokens);
            targets.extend(item.targets);
        }
        let index = self.made.fetch_add(1, Ordering::Relaxed) + 1;
        ReversalBatch {
            tokens: Tensor::from_data(TensorData::new(tokens, [batch, seq]), device),
            targets: Tensor::from_data(TensorData::new(targets, [batch, seq]), device),
            poisoned: self.poison.contains(&index),
        }
    }
}

// ----------------------------------------------------------------------- model

/// TinyLm wrapped for `Learner` (the step traits are burn-train's, the model the shared
/// `tests/common/tiny_lm.rs`: a wrapper holds the impls). Every position is one
/// classification.
#[derive(Module, Debug)]
struct Reverser<B: Backend> {
    lm: TinyLm<B>,
}

impl<B: Backend> Reverser<B> {
    fn forward_classification(&self, batch: ReversalBatch<B>) -> ClassificationOutput<B> {
        let logits = self.lm.forward(batch.tokens);
        let [b, s, vocab] = logits.dims();
        // The logits come out of autocast in bf16; the metrics get f32.
        let mut logits = logits.reshape([b * s, vocab]).cast(DType::F32);
        if batch.poisoned {
            // The demo's overflow: NaN logits, hence NaN loss and gradients.
            logits = logits.mul_scalar(f32::NAN);
        }
        let targets = batch.targets.reshape([b * s]);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), targets.clone());
        ClassificationOutput::new(loss, logits, targets)
    }
}

impl<B: AutodiffBackend> TrainStep for Reverser<B> {
    type Input = ReversalBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: ReversalBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.forward_classification(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Reverser<B> {
    type Input = ReversalBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: ReversalBatch<B>) -> ClassificationOutput<B> {
        self.forward_classification(batch)
    }
}

// -------------------------------------------------------------------- renderer

/// A headless renderer: one line on stderr every `every` training iterations and at the end
/// of each validation pass. (burn-train's `CliMetricsRenderer` prints every item; its TUI
/// needs a terminal and the `tui` feature, which burn-amp does not enable.)
struct LineRenderer {
    every: usize,
    names: HashMap<MetricId, String>,
    train: Vec<(String, f64)>,
    valid: Vec<(String, f64)>,
    valid_items: usize,
}

impl LineRenderer {
    fn new(every: usize) -> Self {
        Self {
            every: every.max(1),
            names: HashMap::new(),
            train: Vec::new(),
            valid: Vec::new(),
            valid_items: 0,
        }
    }

    fn store(&self, into: &mut Vec<(String, f64)>, state: MetricState) {
        if let MetricState::Numeric(entry, value) = state {
            let name = self
                .names
                .get(&entry.metric_id)
                .cloned()
                .unwrap_or_else(|| "?".into());
            let value = match value {
                NumericEntry::Value(v) => v,
                NumericEntry::Aggregated {
                    aggregated_value, ..
                } => aggregated_value,
            };
            match into.iter_mut().find(|(n, _)| *n == name) {
                Some(slot) => slot.1 = value,
                None => into.push((name, value)),
            }
        }
    }

    fn line(values: &[(String, f64)]) -> String {
        values
            .iter()
            .map(|(name, v)| {
                if *v == 0.0 || (0.01..1e4).contains(&v.abs()) {
                    format!("{name} {v:.4}")
                } else {
                    format!("{name} {v:.3e}")
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
    }
}

impl MetricsRendererTraining for LineRenderer {
    fn update_train(&mut self, state: MetricState) {
        let mut train = std::mem::take(&mut self.train);
        self.store(&mut train, state);
        self.train = train;
    }

    fn update_valid(&mut self, state: MetricState) {
        let mut valid = std::mem::take(&mut self.valid);
        self.store(&mut valid, state);
        self.valid = valid;
    }

    fn render_train(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        self.valid_items = 0;
        let iteration = item.iteration.unwrap_or(0);
        let last = item
            .progress
            .as_ref()
            .is_some_and(|p| p.items_processed >= p.items_total);
        if iteration.is_multiple_of(self.every) || last {
            eprintln!(
                "epoch {}/{}  iteration {iteration:>4}  {}",
                item.global_progress.items_processed,
                item.global_progress.items_total,
                Self::line(&self.train)
            );
        }
    }

    fn render_valid(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        self.valid_items += 1;
        if item
            .progress
            .as_ref()
            .is_some_and(|p| p.items_processed >= p.items_total)
        {
            eprintln!(
                "epoch {}/{}  validation      {}",
                item.global_progress.items_processed,
                item.global_progress.items_total,
                Self::line(&self.valid)
            );
        }
    }
}

impl MetricsRendererEvaluation for LineRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}

    fn render_test(&mut self, _item: EvaluationProgress, _: Vec<ProgressType>) {}
}

impl MetricsRenderer for LineRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names.insert(definition.metric_id, definition.name);
    }
}

// ------------------------------------------------------------------------ main

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    match args.backend.as_str() {
        "flex" => train::<Flex>(args, Default::default()),
        "wgpu" => train::<Wgpu>(args, Default::default()),
        other => Err(format!("unknown backend `{other}`: flex or wgpu").into()),
    }
}

fn train<IB>(args: &Args, device: IB::Device) -> Result<(), Box<dyn std::error::Error>>
where
    IB: Backend,
    Amp<IB>: AmpKernels,
    IB: DeviceMemory,
{
    type B<IB> = Amp<Autodiff<IB>>;
    if args.micro_batch == 0 || args.accum == 0 || args.devices == 0 {
        return Err("--micro-batch, --accum and --devices must be at least 1".into());
    }
    let precision = args
        .precision
        .unwrap_or_else(|| Precision::default_for::<B<IB>>(&device));
    if !precision.is_supported::<B<IB>>(&device) {
        return Err(format!("{precision} is not supported on {}", args.backend).into());
    }
    if !args.inject_nan_at.is_empty() && !precision.needs_loss_scaling() {
        return Err(format!(
            "--inject-nan-at shows the loss scaler skipping steps, and it only scales at f16 \
             (at {precision} a NaN would reach the weights): add --precision f16"
        )
        .into());
    }
    // Process-wide, not a guard: with --devices the forward and backward run on burn-train's
    // worker threads.
    set_default_precision(Some(precision));
    B::<IB>::seed(&device, args.seed);

    let config = TinyLmConfig::new()
        .with_d_model(args.d_model)
        .with_d_ff(args.d_model * 2)
        .with_dropout(0.0);
    let train = ReversalDataset::generate(args.train_size, config.vocab, config.seq_len, args.seed);
    let valid =
        ReversalDataset::generate(args.valid_size, config.vocab, config.seq_len, args.seed + 1);
    // `Learner` iterations: with N workers, each iteration takes N micro-batches.
    let micro_steps_per_epoch = train.len().div_ceil(args.micro_batch);
    let micro_steps = micro_steps_per_epoch * args.epochs;
    let optimizer_steps = micro_steps / args.devices / args.accum;
    let batcher = ReversalBatcher {
        made: Arc::default(),
        poison: Arc::new(args.inject_nan_at.clone()),
    };
    let train_loader = DataLoaderBuilder::<B<IB>, _, _>::new(batcher)
        .batch_size(args.micro_batch)
        .shuffle(args.seed)
        .build(train);
    let valid_loader = DataLoaderBuilder::<<B<IB> as AutodiffBackend>::InnerBackend, _, _>::new(
        ReversalBatcher::default(),
    )
    .batch_size(64)
    .build(valid);

    let model = Reverser {
        lm: config.init::<B<IB>>(&device),
    };
    // Adam, stepped once per `accum` micro-batches on their mean; the loss scaling around it
    // (a pass-through at bf16/f32).
    let adam = AdamConfig::new().init::<B<IB>, Reverser<B<IB>>>();
    let mut optim = AmpOptimizer::new(
        GradientAccumulationConfig::new(args.accum)
            .with_max_grad_norm(args.clip)
            .with_track_grad_norm(args.grad_norm)
            .init(adam)?,
        GradScalerConfig::new(),
    )?;
    // Allocator figures exist on wgpu (CubeCL), not on Flex.
    let track_memory = args.backend == "wgpu" && args.memory_every > 0;
    if track_memory {
        optim = optim.track_memory(args.memory_every);
    }
    let monitor = optim.monitor();
    // The cosine runs over optimizer steps; `Learner` steps it per iteration, the wrapper
    // once per window.
    let cosine = CosineAnnealingLrSchedulerConfig::new(args.lr, optimizer_steps.max(1))
        .with_min_lr(args.lr * 0.05)
        .init()?;
    let scheduler = WindowedLrScheduler::new(cosine, args.accum)?;

    eprintln!(
        "{} epochs × {micro_steps_per_epoch} micro-batches of {} on {} worker(s) = {} Learner \
         iterations, {optimizer_steps} Adam steps on batches of {} ({precision}, {})",
        args.epochs,
        args.micro_batch,
        args.devices,
        micro_steps / args.devices,
        args.micro_batch * args.accum * args.devices,
        args.backend,
    );
    // A macro, not a value: the builder's type names the optimizer's, which `--ema` changes.
    macro_rules! training {
        () => {{
            let mut training = SupervisedTraining::new(&args.artifacts, train_loader, valid_loader)
                .metrics((LossMetric::new(), AccuracyMetric::new()))
                .metric_train_numeric(LearningRateMetric::new())
                .metric_train_numeric(LossScaleMetric::new(&monitor))
                .metric_train_numeric(SkippedStepsMetric::new(&monitor))
                .with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new())
                .num_epochs(args.epochs)
                .renderer(LineRenderer::new(args.print_every))
                .summary();
            if args.clip.is_some() || args.grad_norm {
                training = training.metric_train_numeric(GradNormMetric::new(&monitor));
            }
            if track_memory {
                training = training
                    .metric_train_numeric(StepMemoryMetric::new(&monitor))
                    .metric_train_numeric(ActivationMemoryMetric::new(&monitor));
            }
            if args.devices > 1 {
                let strategy = if args.sharded {
                    MultiDeviceOptim::OptimSharded
                } else {
                    MultiDeviceOptim::OptimMainDevice
                };
                let devices = vec![device.clone(); args.devices];
                training = training
                    .with_training_strategy(ExecutionStrategy::multi(devices, strategy).into());
            }
            if let Some(epoch) = args.resume_epoch {
                // Restores the model, the scaler, the accumulation window with Adam's moments,
                // the windowed schedule's position, and with --ema the average.
                training = training.checkpoint(epoch);
            }
            training
        }};
    }
    let start = Instant::now();
    let (result, average) = match args.ema {
        Some(decay) => {
            let config = EmaConfig::new().with_decay(decay).with_warmup(true);
            let optim = EmaOptimizer::new(optim, config)?;
            let average = optim.average();
            let result = if args.validate_average {
                let model = Averaged::new(model, &average);
                training!().launch(Learner::new(model, optim, scheduler))
            } else {
                training!().launch(Learner::new(model, optim, scheduler))
            };
            (result, Some(average))
        }
        None => (
            training!().launch(Learner::new(model, optim, scheduler)),
            None,
        ),
    };
    let wall = start.elapsed().as_secs_f64();
    let scaler = monitor.snapshot();
    let memory = monitor.step_memory();
    // A steady climb of the bytes after the sampled steps (a leak): none expected here.
    let growth = monitor.memory_growth();
    if let Some(growth) = &growth {
        eprintln!("{growth}");
    }

    // A fresh held-out batch, on the inference model `Learner` returns (`Amp<IB>`).
    let (x, y) = ReversalTask::new(config.vocab, config.seq_len, args.seed + 2)
        .batch::<<B<IB> as AutodiffBackend>::InnerBackend>(256, &Default::default());
    let evaluate = |lm: &tiny_lm::TinyLm<_>| {
        let loss = lm.loss(x.clone(), y.clone()).into_scalar().elem::<f32>();
        (lm.accuracy(x.clone(), y.clone()), loss)
    };
    let (accuracy, loss) = evaluate(&result.model.lm);
    let (ema_accuracy, ema_loss) = average
        .and_then(|average| average.module())
        .map(|m| evaluate(&m.lm))
        .map_or(("null".into(), "null".into()), |(a, l)| {
            (a.to_string(), l.to_string())
        });
    println!(
        "{{\"example\":\"learner\",\"backend\":\"{}\",\"precision\":\"{precision}\",\"devices\":{},\"sharded\":{},\"epochs\":{},\"micro_batch\":{},\"accum\":{},\"learner_iterations\":{},\"optimizer_steps\":{},\"skipped_steps\":{},\"loss_scale\":{},\"heldout_accuracy\":{accuracy},\"heldout_loss\":{loss},\"ema_heldout_accuracy\":{ema_accuracy},\"ema_heldout_loss\":{ema_loss},\"validate_average\":{},\"step_peak_bytes\":{},\"activation_bytes\":{},\"memory_growth_watched\":{track_memory},\"memory_growth_bytes_per_step\":{},\"wall_s\":{wall:.3}}}",
        args.backend,
        args.devices,
        args.sharded,
        args.epochs,
        args.micro_batch,
        args.accum,
        micro_steps / args.devices,
        scaler.optimizer_steps,
        scaler.skipped_steps,
        scaler.scale,
        args.validate_average,
        memory.map_or("null".to_string(), |m| m.peak_bytes.to_string()),
        memory
            .and_then(|m| m.activation_bytes)
            .map_or("null".to_string(), |b| b.to_string()),
        growth.map_or("null".to_string(), |g| g.bytes_per_step.to_string()),
    );
    Ok(())
}
