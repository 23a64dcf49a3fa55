//! f16 under burn-train's `Learner` with an unmodified `TrainStep`: only the backend type
//! (`Amp<Autodiff<..>>`) and the optimizer (`AmpOptimizer::new(adam, ..)`) change.
//!
//! - f16 trains like f32 on Flex and on Wgpu, parameters stay f32, and the scaler adds no
//!   host read to the training thread;
//! - poisoned batches (NaN inputs) are exactly the skipped steps, shown by the metrics; with
//!   accumulation of 4 the window is skipped once;
//! - Learner's own checkpointer saves and restores the scaler;
//! - several devices (the same device listed twice: what this machine can open), both
//!   `MultiDeviceOptim` variants: one skip decision for every worker;
//! - a weight average kept by the optimizer (`EmaOptimizer`): the skipped steps passed over,
//!   saved and restored by the checkpointer with the optimizer's state.
//!
//! Layout: `user_code.rs` is a plain burn-train program (no burn-amp in it), `harness.rs`
//! runs it under `Learner` and records the metrics; the tests are here.

#[path = "../common/mod.rs"]
mod common;
mod harness;
mod user_code;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, Optimizer};
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::{LossMetric, MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::{
    ClassificationOutput, ExecutionStrategy, InferenceStep, Learner, MultiDeviceOptim,
    SupervisedTraining, TrainOutput, TrainStep,
};
use burn_amp::amp_optimizer::{
    ActivationMemoryMetric, GradNormMetric, LossScaleMetric, ScalerMonitor, SkippedStepsMetric,
    StepMemoryMetric,
};
use burn_amp::ema::{Averaged, EmaConfig, EmaOptimizer};
use burn_amp::memory::DeviceMemory;
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::scaler::{GradScalerConfig, ScaledStep};
use burn_amp::{
    Amp, AmpOptimizer, GradientAccumulation, GradientAccumulationConfig, Precision, autocast,
    host_reads, set_default_precision,
};
use common::models::Mlp;

const D_IN: usize = 8;
const CLASSES: usize = 4;
const BATCH: usize = 32;
const SAMPLES: usize = 512; // 16 iterations per epoch

static SERIAL: Mutex<()> = Mutex::new(());

/// One test at a time: an `AmpOptimizer` installs itself for the process.
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

use harness::*;
use user_code::*;

/// The same program at f32 and f16: the f16 loss curve ends near the f32 one.
fn f16_trains_like_f32<IB>(device: IB::Device, name: &str)
where
    IB: Backend,
    Amp<Autodiff<IB>>: AutodiffBackend<Device = IB::Device> + DeviceMemory,
    <Amp<Autodiff<IB>> as AutodiffBackend>::InnerBackend: burn_amp::scaler::ScalerKernels,
{
    type T<IB> = Amp<Autodiff<IB>>;
    let run = |precision: Precision| {
        let _g = autocast(precision);
        // Memory sampled every 4th iteration (allocator figures on wgpu; none on Flex).
        let optim = wrapped(adam::<T<IB>>()).track_memory(4);
        let monitor = optim.monitor();
        let mut run = Run::<T<IB>>::new(name, device.clone());
        run.monitor = Some(monitor.clone());
        let outcome = fit(run, optim);
        (outcome, monitor.snapshot(), monitor.step_memory())
    };
    let (f32_run, f32_scaler, f32_memory) = run(Precision::F32);
    let (f16_run, f16_scaler, f16_memory) = run(Precision::F16);
    match (f32_memory, f16_memory) {
        (Some(m32), Some(m16)) => {
            let activations = |m: burn_amp::amp_optimizer::StepMemoryFigures| {
                m.activation_bytes.expect("a second sample") as f64
            };
            eprintln!(
                "{name}: step memory peak f16/f32 {:.3} ({} / {} bytes), activations {:.3}",
                m16.peak_bytes as f64 / m32.peak_bytes as f64,
                m16.peak_bytes,
                m32.peak_bytes,
                activations(m16) / activations(m32)
            );
            assert!(activations(m16) < activations(m32), "{m16:?} vs {m32:?}");
            let shown = f16_run.metrics.series("Activation Memory (MiB)");
            assert!(shown.iter().any(|v| v.is_finite() && *v > 0.0), "{shown:?}");
        }
        (m32, m16) => {
            // Flex has no allocator figures: nothing is invented.
            assert!(
                m32.is_none() && m16.is_none() && name == "flex",
                "{name}: {m32:?} {m16:?}"
            );
        }
    }
    let (l32, l16) = (
        f32_run.metrics.series("Loss"),
        f16_run.metrics.series("Loss"),
    );
    assert_eq!(l16.len(), 2 * SAMPLES / BATCH, "one loss per iteration");
    let (end32, end16) = (mean_tail(&l32, 4), mean_tail(&l16, 4));
    eprintln!(
        "{name}: loss {:.4} -> f32 {end32:.4}, f16 {end16:.4}; scaler {f16_scaler:?}",
        l16[0]
    );
    assert!(
        end32 < 0.5 * l32[0],
        "f32 did not train: {} -> {end32}",
        l32[0]
    );
    assert!(
        (end16 - end32).abs() < 0.05 + 0.1 * end32,
        "f16 ends at {end16}, f32 at {end32}"
    );
    assert_eq!(f16_run.param_dtypes, [DType::F32, DType::F32]);
    // f16 was scaled (65536, no overflow), f32 passed through.
    assert_eq!(f16_scaler.scale, 65536.0);
    assert_eq!(f16_scaler.skipped_steps, 0);
    assert_eq!(f16_scaler.optimizer_steps, l16.len() as u64);
    assert_eq!(f32_scaler.scale, 1.0);
    assert_eq!(f16_run.metrics.series("Loss Scale").last(), Some(&65536.0));
    assert!(f16_run.params.iter().all(|p| p.is_finite()));
}

// -------------------------------------------------------------------------- tests

#[test]
fn f16_under_learner_trains_like_f32_on_flex() {
    let _s = serial();
    f16_trains_like_f32::<Flex>(Default::default(), "flex");
}

#[test]
fn f16_under_learner_trains_like_f32_on_wgpu() {
    let _s = serial();
    let Some(device) = common::wgpu_device() else {
        return;
    };
    f16_trains_like_f32::<Wgpu>(device, "wgpu");
}

type F = Amp<Autodiff<Flex>>;

#[test]
fn the_scaler_adds_no_host_read_to_the_training_thread() {
    let _s = serial();
    let fused = || FusedAdamWConfig::new().init::<F, Classifier<F>>().unwrap();
    let reads = |precision| {
        let _g = autocast(precision);
        fit(Run::<F>::new("reads", Default::default()), wrapped(fused())).host_reads
    };
    let (f32_reads, f16_reads) = (reads(Precision::F32), reads(Precision::F16));
    eprintln!("training-thread host reads over 32 iterations: f32 {f32_reads}, f16 {f16_reads}");
    assert_eq!(f16_reads, f32_reads, "the f16 scaler read from the device");
}

/// `MemorySaving` under `Learner`, behind the same `AmpOptimizer`: bf16 weights, 8-bit moments
/// (every tensor of this small model), stochastic rounding. It trains like f32 weights with
/// the f32 fused AdamW, and the weights stay bf16.
#[test]
fn memory_saving_under_learner_trains_like_f32() {
    use burn_amp::optim::{MomentStorage, QuantMap};
    let _s = serial();
    let f32_run = {
        let _g = autocast(Precision::F32);
        let adamw = FusedAdamWConfig::new().init::<F, Classifier<F>>().unwrap();
        fit(
            Run::<F>::new("saving-f32", Default::default()),
            wrapped(adamw),
        )
    };
    let saving = burn_amp::MemorySaving::new().with_optimizer(
        FusedAdamWConfig::memory_saving().with_moments(MomentStorage::Int8 {
            block: 256,
            map: QuantMap::Dynamic,
            min_numel: 64,
        }),
    );
    let saved = {
        let _g = autocast(Precision::Bf16);
        let mut run = Run::<F>::new("saving", Default::default());
        run.weights = Some(saving.weights);
        fit(
            run,
            wrapped(saving.optimizer::<F, Classifier<F>>().unwrap()),
        )
    };
    let (l32, l8) = (f32_run.metrics.series("Loss"), saved.metrics.series("Loss"));
    let (end32, end8) = (mean_tail(&l32, 4), mean_tail(&l8, 4));
    eprintln!(
        "Learner: loss {:.4} -> f32 AdamW {end32:.4}, MemorySaving {end8:.4}",
        l8[0]
    );
    assert!(end32 < 0.5 * l32[0], "f32 did not train");
    assert!(
        (end8 - end32).abs() < 0.05 + 0.1 * end32,
        "MemorySaving ends at {end8}, f32 AdamW at {end32}"
    );
    assert_eq!(saved.param_dtypes, [DType::BF16, DType::BF16]);
    assert!(saved.params.iter().all(|p| p.is_finite()));
}

#[test]
fn poisoned_batches_are_exactly_the_skipped_steps() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let optim = wrapped(adam::<F>());
    let monitor = optim.monitor();
    let mut run = Run::<F>::new("poison", Default::default());
    run.epochs = 1;
    run.poison = &[3, 9];
    run.monitor = Some(monitor.clone());
    let outcome = fit(run, optim);
    // burn-train processes metrics on another thread, so a metric shows the scaler as it is
    // when its item is processed: possibly a step ahead of that item. The exact per-step
    // trajectory is checked in `tests/amp_optimizer.rs`; here: what the dashboard shows.
    let skipped = outcome.metrics.series("Skipped Steps");
    let scale = outcome.metrics.series("Loss Scale");
    assert_eq!(skipped.len(), 16);
    assert!(skipped.windows(2).all(|w| w[0] <= w[1]), "{skipped:?}");
    assert_eq!(skipped.first(), Some(&0.0), "{skipped:?}");
    assert_eq!(skipped.last(), Some(&2.0), "{skipped:?}");
    assert_eq!(scale.first(), Some(&65536.0), "{scale:?}");
    assert_eq!(scale.last(), Some(&16384.0), "{scale:?}");
    // The loss is NaN exactly at the poisoned batches, and only two steps were skipped:
    // those two.
    let loss = outcome.metrics.series("Loss");
    let nan: Vec<usize> = (0..loss.len()).filter(|&i| loss[i].is_nan()).collect();
    assert_eq!(nan, [3, 9]);
    assert!(
        outcome.params.iter().all(|p| p.is_finite()),
        "a NaN step was applied"
    );
    assert_eq!(monitor.snapshot().skipped_steps, 2);
}

#[test]
fn with_accumulation_of_4_a_poisoned_window_is_skipped_once() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let accum = GradientAccumulation::new(adam::<F>(), 4).unwrap();
    let optim = wrapped(accum);
    let monitor = optim.monitor();
    let mut run = Run::<F>::new("accum", Default::default());
    run.epochs = 1;
    run.poison = &[5];
    run.monitor = Some(monitor.clone());
    let outcome = fit(run, optim);
    let snapshot = monitor.snapshot();
    assert_eq!((snapshot.optimizer_steps, snapshot.skipped_steps), (4, 1));
    assert_eq!(snapshot.scale, 32768.0);
    // The poisoned micro-batch is in the second window: the scale halves once, at a window
    // boundary (the metrics may show it a step early: see above).
    let scale = outcome.metrics.series("Loss Scale");
    assert_eq!(scale.first(), Some(&65536.0));
    assert_eq!(scale.last(), Some(&32768.0));
    // No clipping, no norm computed: the metric shows NaN.
    let norms = outcome.metrics.series("Gradient Norm");
    assert!(
        norms.len() == 16 && norms.iter().all(|n| n.is_nan()),
        "{norms:?}"
    );
    assert!(
        scale.iter().all(|s| *s == 65536.0 || *s == 32768.0),
        "{scale:?}"
    );
}

/// Windows of 4 clipped at a norm they never reach, micro-batch 5 poisoned: the metric shows
/// each window's norm before clipping (one value per window, the overflowing window's not
/// finite), the last one the monitor's.
#[test]
fn the_gradient_norm_of_a_clipped_window_is_a_metric() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let fit_with = |name: &str, config: GradientAccumulationConfig| {
        let optim = wrapped(config.init(adam::<F>()).unwrap());
        let monitor = optim.monitor();
        let mut run = Run::<F>::new(name, Default::default());
        run.epochs = 1;
        run.poison = &[5];
        run.monitor = Some(monitor.clone());
        (fit(run, optim), monitor)
    };
    // Clipped at a bound it never reaches (the gradients unchanged), and only measured: the
    // same norms, the same training (the tracked norm is the scaled sums' times 1/scale).
    let config = GradientAccumulationConfig::new(4);
    let (outcome, monitor) = fit_with("grad-norm", config.clone().with_max_grad_norm(Some(1e3)));
    let (tracked, _) = fit_with("grad-norm-tracked", config.with_track_grad_norm(true));
    assert_eq!(
        tracked.params, outcome.params,
        "tracking changed the training"
    );
    let (a, b) = (
        tracked.metrics.series("Gradient Norm"),
        outcome.metrics.series("Gradient Norm"),
    );
    // burn-train's metric events may show a window's norm a step early or late: the
    // distinct values, in order, bit for bit.
    let values = |series: &[f64]| {
        let mut bits: Vec<u64> = series
            .iter()
            .filter(|n| n.is_finite())
            .map(|n| n.to_bits())
            .collect();
        bits.dedup();
        bits
    };
    assert!(values(&a).len() >= 2, "{a:?}");
    assert_eq!(values(&a), values(&b), "{a:?} against {b:?}");
    let last = monitor.grad_norm().expect("a norm after 4 windows");
    assert!(last.is_finite() && last > 0.0, "{last}");
    let norms = outcome.metrics.series("Gradient Norm");
    eprintln!("gradient norms: {norms:?}");
    assert_eq!(norms.len(), 16);
    assert_eq!(norms.last(), Some(&f64::from(last)));
    let mut finite: Vec<f64> = norms.iter().copied().filter(|n| n.is_finite()).collect();
    assert!(finite.iter().all(|n| *n > 0.0 && *n < 1e3), "{norms:?}");
    finite.dedup();
    // Three clean windows (a metric may show a window's norm a step early or late).
    assert!((2..=3).contains(&finite.len()), "{norms:?}");
}

#[test]
fn learners_checkpointer_saves_and_restores_the_scaler() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    // The scale grows every 3 clean steps, so that it moves within an epoch.
    let config = || {
        GradScalerConfig::new()
            .with_init_scale(4.0)
            .with_growth_interval(3)
    };
    let make = || AmpOptimizer::new(adam::<F>(), config()).unwrap();

    let optim = make();
    let monitor = optim.monitor();
    let mut run = Run::<F>::new("resume-full", Default::default());
    (run.epochs, run.poison) = (3, &[4]);
    let uninterrupted = fit(run, optim);
    let expected = monitor.snapshot();

    let optim = make();
    let mut run = Run::<F>::new("resume", Default::default());
    (run.epochs, run.poison, run.checkpoint) = (1, &[4], true);
    fit(run, optim);
    let optim = make();
    let monitor = optim.monitor();
    let mut run = Run::<F>::new("resume", Default::default());
    (run.epochs, run.poison, run.checkpoint, run.resume) = (3, &[4], true, Some(1));
    // The second process would start here: the artifacts of epoch 1 are kept.
    let resumed = fit_keep(run, optim);
    let got = monitor.snapshot();
    assert_eq!(got.scale, expected.scale, "resumed scale differs");
    assert!(
        expected.scale > 4.0,
        "the scale should have grown: {expected:?}"
    );
    // The metrics count on from the checkpoint: steps and skips of epoch 1 included.
    assert_eq!(
        (got.optimizer_steps, got.skipped_steps),
        (expected.optimizer_steps, expected.skipped_steps),
        "resumed counts differ"
    );
    assert!(expected.skipped_steps > 0, "a poisoned step: {expected:?}");
    let diff = resumed
        .params
        .iter()
        .zip(&uninterrupted.params)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff < 1e-6, "resumed parameters differ by {diff}");
}

/// `EmaOptimizer` around `AmpOptimizer` under `Learner`, a poisoned batch in each epoch: 3 epochs
/// in one go, and 1 epoch then a resume from its checkpoint to 3, give the same average and
/// count (the average is in the optimizer's record), and the skipped step is not averaged.
#[test]
fn learners_checkpointer_saves_and_restores_the_average() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let make = || {
        let config = EmaConfig::new().with_decay(0.95).with_warmup(true);
        EmaOptimizer::new(wrapped(adam::<F>()), config).unwrap()
    };
    let average_of = |optim: &EmaOptimizer<_, F, Classifier<F>>| optim.average();

    let optim = make();
    let average = average_of(&optim);
    let mut run = Run::<F>::new("ema-full", Default::default());
    (run.epochs, run.poison) = (3, &[4]);
    let uninterrupted = fit(run, optim);
    let expected = common::models::params(&average.module().unwrap().mlp);
    // 16 iterations an epoch, the poisoned batch skipped in each.
    assert_eq!(average.updates(), 45);

    let mut run = Run::<F>::new("ema-resume", Default::default());
    (run.epochs, run.poison, run.checkpoint) = (1, &[4], true);
    fit(run, make());
    let optim = make();
    let average = average_of(&optim);
    let mut run = Run::<F>::new("ema-resume", Default::default());
    (run.epochs, run.poison, run.checkpoint, run.resume) = (3, &[4], true, Some(1));
    fit_keep(run, optim);
    assert_eq!(average.updates(), 45, "resumed count");
    let got = common::models::params(&average.module().unwrap().mlp);
    let diff = got
        .iter()
        .zip(&expected)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff < 1e-6, "resumed average differs by {diff}");
    let from_weights = expected
        .iter()
        .zip(&uninterrupted.params)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        from_weights > 1e-3,
        "the average is the weights: {from_weights}"
    );
}

/// `Averaged` around the model: `Learner` validates the average each epoch and returns it,
/// while training is the same step for step (the same training losses as without it).
#[test]
fn an_averaged_model_is_validated_and_returned_as_its_average() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let make = || {
        let config = EmaConfig::new().with_decay(0.9).with_warmup(true);
        EmaOptimizer::new(wrapped(adam::<F>()), config).unwrap()
    };
    let optim = make();
    let average = optim.average();
    let mut run = Run::<F>::new("averaged", Default::default());
    run.epochs = 3;
    let averaged = fit_as(run, optim, |model| Averaged::new(model, &average));
    let mut run = Run::<F>::new("trained", Default::default());
    run.epochs = 3;
    let trained = fit(run, make());

    let series = |o: &harness::Outcome, name: &str| o.metrics.series(name);
    assert_eq!(
        series(&averaged, "Loss"),
        series(&trained, "Loss"),
        "training differs"
    );
    let want = common::models::params(&average.module().unwrap().mlp);
    assert_eq!(averaged.params, want, "the result is not the average");
    assert_ne!(averaged.params, trained.params);
    let (valid_averaged, valid_trained) = (
        series(&averaged, "valid Loss"),
        series(&trained, "valid Loss"),
    );
    eprintln!("validation loss, average {valid_averaged:?}, weights {valid_trained:?}");
    assert_eq!(valid_averaged.len(), valid_trained.len());
    assert!(!valid_averaged.is_empty());
    for (a, t) in valid_averaged.iter().zip(&valid_trained) {
        assert!(a.is_finite() && a != t, "validated on the weights: {a} {t}");
    }
}

/// `Averaged` on wgpu (f16, lavapipe): the returned model is the average, on the device,
/// bit for bit, and validation ran on it.
#[test]
fn an_averaged_model_on_wgpu_is_returned_as_its_average() {
    let _s = serial();
    let Some(device) = common::wgpu_device() else {
        return;
    };
    type W = Amp<Autodiff<Wgpu>>;
    let _g = autocast(Precision::F16);
    let config = EmaConfig::new().with_decay(0.9).with_warmup(true);
    let optim = EmaOptimizer::new(wrapped(adam::<W>()), config).unwrap();
    let average = optim.average();
    let run = Run::<W>::new("averaged-wgpu", device);
    let outcome = fit_as(run, optim, |model| Averaged::new(model, &average));
    assert_eq!(average.updates(), 32);
    let want = common::models::params(&average.module().unwrap().mlp);
    assert_eq!(outcome.params, want, "the result is not the average");
    let valid = outcome.metrics.series("valid Loss");
    assert!(
        valid.len() == 2 && valid.iter().all(|l| l.is_finite()),
        "{valid:?}"
    );
}

fn multi_device(strategy: MultiDeviceOptim, name: &str) {
    // The workers are burn-train's threads: the process-wide precision reaches them.
    let previous = set_default_precision(Some(Precision::F16));
    let device: burn::tensor::Device<F> = Default::default();
    let optim = wrapped(adam::<F>());
    let monitor = optim.monitor();
    // A weight average over it: `step_multi` goes through.
    let optim = EmaOptimizer::new(optim, EmaConfig::new().with_decay(0.9)).unwrap();
    let average = optim.average();
    let mut run = Run::<F>::new(name, device);
    run.epochs = 2;
    run.poison = &[6];
    run.monitor = Some(monitor.clone());
    run.strategy = Some(ExecutionStrategy::multi(vec![device, device], strategy));
    let outcome = fit(run, optim);
    set_default_precision(previous);
    let snapshot = monitor.snapshot();
    let loss = outcome.metrics.series("Loss");
    eprintln!("{name}: loss {:?}, {snapshot:?}", loss);
    // Two workers take one batch each per step: 8 steps an epoch; the poisoned batch lands on
    // one worker and the whole step is skipped, once per epoch.
    assert_eq!(snapshot.optimizer_steps, 16);
    assert_eq!(snapshot.skipped_steps, 2);
    assert_eq!(average.updates(), 14, "the skipped steps are not averaged");
    let averaged = common::models::params(&average.module().unwrap().mlp);
    assert!(averaged.iter().all(|p| p.is_finite()));
    assert_ne!(averaged, outcome.params, "the average is the weights");
    assert_eq!(snapshot.scale, 16384.0);
    let finite: Vec<f64> = loss.iter().copied().filter(|l| l.is_finite()).collect();
    assert_eq!(
        finite.len(),
        loss.len() - 2,
        "only the poisoned batches' losses are NaN"
    );
    assert!(
        mean_tail(&finite, 4) < 0.5 * finite[0],
        "did not train: {loss:?}"
    );
    assert!(outcome.params.iter().all(|p| p.is_finite()));
}

#[test]
fn two_workers_optimizing_on_the_main_device_skip_together() {
    let _s = serial();
    multi_device(MultiDeviceOptim::OptimMainDevice, "multi-main");
}

#[test]
fn two_workers_with_sharded_optimization_skip_together() {
    let _s = serial();
    multi_device(MultiDeviceOptim::OptimSharded, "multi-sharded");
}
