//! The TinyLm of `train.rs` under burn-train's `Learner`: mixed precision by the backend
//! type alone, gradient accumulation as a drop-in optimizer around Adam, and a learning-rate
//! schedule that counts optimizer steps.
//!
//! ```sh
//! cargo run --release --example learner
//! cargo run --release --example learner -- --accum 2 --micro-batch 32 --epochs 4
//! cargo run --release --example learner -- --epochs 4 --resume-epoch 3   # from a checkpoint
//! ```
//!
//! - `Amp<Autodiff<Flex>>` is the backend: autocast at bf16, nothing else changes.
//! - `GradientAccumulation::new(adam, N)` is the optimizer: `Learner` calls it once per
//!   micro-batch, and it steps Adam once per N on their mean. `Learner`'s own
//!   `grads_accumulation` stays unset (it would sum, and hold a second copy).
//! - `WindowedLrScheduler` wraps the cosine schedule: `Learner` steps its scheduler once per
//!   micro-batch, the wrapper advances the cosine once per window, so the schedule is written
//!   in optimizer steps.
//! - f16 is not offered here: it needs a `GradScaler`, which `Learner` has no place for; see
//!   `train.rs` for the hand-written loop with the scaler.
//!
//! burn-train's metrics read the loss and outputs of every micro-batch back to the host
//! (that is how `Learner` works); `train.rs` shows a loop that reads every k steps only.

// The shared model: each example uses part of its methods.
#[allow(dead_code)]
#[path = "../tests/common/tiny_lm.rs"]
mod tiny_lm;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
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
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_amp::accumulate::WindowedLrScheduler;
use burn_amp::{Amp, GradientAccumulation, Precision, autocast};
use clap::Parser;
use tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};

/// The training backend: mixed precision by type.
type B = Amp<Autodiff<Flex>>;

#[derive(Parser, Debug)]
#[command(about = "Train TinyLm under burn-train's Learner with burn-amp")]
struct Args {
    /// bf16 or f32 (f16 needs a loss scaler: see the train example).
    #[arg(long, default_value = "bf16")]
    precision: Precision,
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
}

#[derive(Debug, Clone, Default)]
struct ReversalBatcher;

impl<B: Backend> Batcher<B, ReversalSample, ReversalBatch<B>> for ReversalBatcher {
    fn batch(&self, items: Vec<ReversalSample>, device: &B::Device) -> ReversalBatch<B> {
        let (batch, seq) = (items.len(), items.first().map_or(0, |s| s.tokens.len()));
        let (mut tokens, mut targets) = (Vec::new(), Vec::new());
        for item in items {
            tokens.extend(item.tokens);
            targets.extend(item.targets);
        }
        ReversalBatch {
            tokens: Tensor::from_data(TensorData::new(tokens, [batch, seq]), device),
            targets: Tensor::from_data(TensorData::new(targets, [batch, seq]), device),
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
        let logits = logits.reshape([b * s, vocab]).cast(DType::F32);
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
    if args.precision == Precision::F16 {
        return Err(
            "f16 needs a loss scaler, which Learner has no place for: use \
                    --precision bf16 here, or the train example for f16"
                .into(),
        );
    }
    if args.micro_batch == 0 || args.accum == 0 {
        return Err("--micro-batch and --accum must be at least 1".into());
    }
    let device = Default::default();
    // Autocast is per thread: `Learner` trains on this one (single device).
    let _amp = autocast(args.precision);
    B::seed(&device, args.seed);

    let config = TinyLmConfig::new()
        .with_d_model(args.d_model)
        .with_d_ff(args.d_model * 2)
        .with_dropout(0.0);
    let train = ReversalDataset::generate(args.train_size, config.vocab, config.seq_len, args.seed);
    let valid =
        ReversalDataset::generate(args.valid_size, config.vocab, config.seq_len, args.seed + 1);
    let micro_steps_per_epoch = train.len().div_ceil(args.micro_batch);
    let micro_steps = micro_steps_per_epoch * args.epochs;
    let optimizer_steps = micro_steps / args.accum;
    let train_loader = DataLoaderBuilder::<B, _, _>::new(ReversalBatcher)
        .batch_size(args.micro_batch)
        .shuffle(args.seed)
        .build(train);
    let valid_loader =
        DataLoaderBuilder::<<B as AutodiffBackend>::InnerBackend, _, _>::new(ReversalBatcher)
            .batch_size(64)
            .build(valid);

    let model = Reverser {
        lm: config.init::<B>(&device),
    };
    // Adam, stepped once per `accum` micro-batches on their mean.
    let optim = GradientAccumulation::new(AdamConfig::new().init::<B, Reverser<B>>(), args.accum)?;
    // The cosine runs over optimizer steps; `Learner` steps it per micro-batch, the wrapper
    // once per window.
    let cosine = CosineAnnealingLrSchedulerConfig::new(args.lr, optimizer_steps.max(1))
        .with_min_lr(args.lr * 0.05)
        .init()?;
    let scheduler = WindowedLrScheduler::new(cosine, args.accum)?;

    eprintln!(
        "{} epochs × {micro_steps_per_epoch} micro-batches of {} = {micro_steps} Learner \
         iterations, {optimizer_steps} Adam steps on batches of {} ({})",
        args.epochs,
        args.micro_batch,
        args.micro_batch * args.accum,
        args.precision
    );
    let mut training = SupervisedTraining::new(&args.artifacts, train_loader, valid_loader)
        .metrics((LossMetric::new(), AccuracyMetric::new()))
        .metric_train_numeric(LearningRateMetric::new())
        .with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new())
        .num_epochs(args.epochs)
        .renderer(LineRenderer::new(args.print_every))
        .summary();
    if let Some(epoch) = args.resume_epoch {
        // Restores the model, the accumulation window with Adam's moments, and the windowed
        // schedule's position.
        training = training.checkpoint(epoch);
    }
    let start = Instant::now();
    let result = training.launch(Learner::new(model, optim, scheduler));
    let wall = start.elapsed().as_secs_f64();

    // A fresh held-out batch, on the inference model `Learner` returns (`Amp<Flex>`).
    let (x, y) = ReversalTask::new(config.vocab, config.seq_len, args.seed + 2)
        .batch::<<B as AutodiffBackend>::InnerBackend>(256, &device);
    let accuracy = result.model.lm.accuracy(x, y);
    println!(
        "{{\"example\":\"learner\",\"backend\":\"flex\",\"precision\":\"{}\",\"epochs\":{},\"micro_batch\":{},\"accum\":{},\"learner_iterations\":{micro_steps},\"optimizer_steps\":{optimizer_steps},\"heldout_accuracy\":{accuracy},\"wall_s\":{wall:.3}}}",
        args.precision, args.epochs, args.micro_batch, args.accum
    );
    Ok(())
}
