//! Exact memory figures on Flex through the counting allocator this binary installs: the
//! activations of a known step against the hand count, the peak with and without
//! checkpointing, rows that add up to the peak, advice that follows what the step already does.
//!
//! The allocator counts the whole process: the tests take turns ([`serial`]), and nothing here
//! runs wgpu (lavapipe's device memory is process heap too).

mod common;

use std::sync::{Mutex, MutexGuard};

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::FloatDType;
use burn_amp::memory::{
    CountingAlloc, GrowthCause, GrowthWatch, MemoryGrowth, MemoryReport, MemorySource, StepMemory,
};
use burn_amp::scaler::GradScalerConfig;
use burn_amp::{Amp, AmpOptimizer, Frozen, Precision, autocast, freeze};
use common::memory::{
    BATCH, DEPTH, SAVED, WIDTH, assert_cache_saves, assert_measured, lstm_forward_keeps,
    step_report,
};
use common::models::DeepMlp;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn flex_activations_are_exact_with_the_counting_allocator() {
    let _s = serial();
    assert!(CountingAlloc::is_installed());
    let report = step_report::<Autodiff<Flex>>();
    assert_measured(&report, MemorySource::CountingAllocator);
    // The true peak: at least everything live after forward (parameters, input, activations).
    assert!(report.to_string().contains("CountingAlloc"));
}

#[test]
fn the_rows_add_up_to_the_peak() {
    let _s = serial();
    let report = step_report::<Autodiff<Flex>>();
    let rows = report.parameters
        + report.frozen_parameters
        + report.gradients
        + report.optimizer_state
        + report.activations.unwrap()
        + report.other_in_use.unwrap();
    let unexplained = report.unexplained().expect("a peak");
    assert_eq!(
        rows as i64 + unexplained,
        report.peak_in_use.unwrap() as i64
    );
    // What is left is the step's own temporaries (backward's intermediates): positive, and
    // its own row, beside what the process held before the step.
    assert!(unexplained > 0, "{report}");
    assert!(report.other_in_use.unwrap() > 0, "{report}");
    let text = report.to_string();
    assert!(
        text.contains("workspace / temporaries") && text.contains("= peak in use"),
        "{text}"
    );
}

#[test]
fn checkpointing_lowers_the_peak_and_is_not_advised_again() {
    let _s = serial();
    let plain = step_report::<Autodiff<Flex>>();
    let checkpointed = step_report::<Autodiff<Flex, BalancedCheckpointing>>();
    let (a, b) = (
        plain.activations.unwrap(),
        checkpointed.activations.unwrap(),
    );
    eprintln!(
        "activations plain {a}, checkpointed {b}; peak {} / {}",
        plain.peak_in_use.unwrap(),
        checkpointed.peak_in_use.unwrap()
    );
    assert!(b < a, "checkpointing kept more: {b} >= {a}");
    assert!(checkpointed.peak_in_use < plain.peak_in_use);
    let mentions = |r: &MemoryReport| {
        r.advice()
            .iter()
            .any(|a| a.action.contains("checkpointing"))
    };
    assert!(mentions(&plain), "{plain}");
    assert!(!mentions(&checkpointed), "{checkpointed}");
    assert!(checkpointed.settings.checkpointing);
}

/// A large frozen layer (stored in `storage`) before a small trainable one: parameters are
/// the largest category.
#[derive(Module, Debug)]
struct FrozenBig<B: Backend> {
    backbone: Frozen<Linear<B>>,
    head: Linear<B>,
}

fn frozen_report(storage: FloatDType) -> MemoryReport {
    // Under `Amp`: a bf16 frozen layer takes the f32 input through autocast's promotion.
    type B = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let model = FrozenBig::<B> {
        backbone: freeze(LinearConfig::new(2048, 2048).init(&device)).with_storage::<B>(storage),
        head: LinearConfig::new(2048, 2).init(&device),
    };
    // The exact rows only (no measurement): parameters are the largest of them.
    StepMemory::default().report::<B, _>(&model, None, 0)
}

#[test]
fn half_frozen_storage_is_never_advised_twice() {
    let _s = serial();
    let f32_frozen = frozen_report(FloatDType::F32);
    let half_frozen = frozen_report(FloatDType::BF16);
    for r in [&f32_frozen, &half_frozen] {
        assert_eq!(r.largest().0, "parameters", "{r}");
    }
    let advises = |r: &MemoryReport| {
        r.advice()
            .iter()
            .find(|a| a.action.contains("Frozen::with_storage"))
            .map(|a| a.saving)
    };
    // f32 frozen: store it in half, saving half its bytes.
    assert_eq!(
        advises(&f32_frozen),
        Some(Some(f32_frozen.frozen_parameters / 2))
    );
    assert!(!half_frozen.settings.frozen_storage_half || advises(&half_frozen).is_none());
    assert!(half_frozen.settings.frozen_storage_half);
    assert_eq!(advises(&half_frozen), None, "{half_frozen}");
}

/// Samples `watch` after each of `n` runs of `step`; the reports, with the sample they came at.
fn watch_over<B: burn_amp::memory::DeviceMemory>(
    watch: &mut GrowthWatch,
    n: usize,
    mut step: impl FnMut(),
) -> Vec<(usize, MemoryGrowth)> {
    let device = Default::default();
    (0..n)
        .filter_map(|i| {
            step();
            watch.sample::<B>(&device).err().map(|g| (i, g))
        })
        .collect()
}

/// A validation loop run on the autodiff model: autodiff keeps every forward's graph, with
/// the activations it saved, until the next backward. The watch names that cause, at the rate
/// of one forward's saved activations (the hand count `SAVED`); a backward frees them all;
/// `model.valid()` keeps nothing.
#[test]
fn a_validation_loop_on_the_autodiff_model_is_reported_as_graphs_kept_without_backward() {
    let _s = serial();
    type B = Amp<Autodiff<Flex>>;
    let _f32 = autocast(Precision::F32); // the hand count is f32
    let device = Default::default();
    let model = DeepMlp::<B>::new(WIDTH, DEPTH, &device);
    let x = Tensor::<B, 2>::ones([BATCH, WIDTH], &device);
    let _ = model.forward(x.clone()).mean().backward(); // one-time allocations
    let mut watch = GrowthWatch::default();
    watch.set_report(step_report::<B>());

    let before = CountingAlloc::bytes_in_use().unwrap();
    let reports = watch_over::<B>(&mut watch, 10, || drop(model.forward(x.clone())));
    // 2 samples skipped, then a window of 8: the 10th sample reports.
    assert_eq!(reports.len(), 1, "{reports:?}");
    let (at, growth) = &reports[0];
    eprintln!("{growth}");
    assert_eq!(*at, 9);
    assert_eq!(growth.cause, GrowthCause::GraphsWithoutBackward);
    assert_eq!(growth.backward_passes, Some(0));
    assert!(
        (SAVED..=SAVED + SAVED / 10).contains(&growth.bytes_per_step),
        "{} bytes a step, saved activations {SAVED}",
        growth.bytes_per_step
    );
    assert_eq!(growth.matches.map(|m| m.0), Some("one step's activations"));
    assert!(growth.to_string().contains("model.valid()"), "{growth}");

    // The next backward frees every kept graph (burn-autodiff 0.21's cleanup).
    let held = CountingAlloc::bytes_in_use().unwrap();
    assert!(
        held >= before + 9 * SAVED,
        "{held} < {before} + 9 x {SAVED}"
    );
    let _ = model.forward(x.clone()).mean().backward();
    let after = CountingAlloc::bytes_in_use().unwrap();
    assert!(
        after < before + SAVED / 2,
        "{after} vs {before} before the loop"
    );

    // On the inner backend no graph is built: flat, no report.
    let valid = model.valid();
    let x = x.inner();
    let mut watch = GrowthWatch::default();
    let mut bytes = Vec::new();
    let reports = watch_over::<B>(&mut watch, 20, || {
        drop(valid.forward(x.clone()));
        bytes.push(CountingAlloc::bytes_in_use().unwrap());
    });
    assert!(reports.is_empty(), "{reports:?}");
    let spread = bytes[2..].iter().max().unwrap() - bytes[2..].iter().min().unwrap();
    eprintln!("valid(): {spread} bytes between the highest and lowest of 18 samples");
    assert!(
        spread < 4096,
        "valid() forwards moved memory by {spread} bytes"
    );
}

/// Without `Amp` nothing counts backward passes: the report names both causes.
#[test]
fn a_plain_autodiff_backend_gets_both_causes() {
    let _s = serial();
    type B = Autodiff<Flex>;
    let device = Default::default();
    let model = DeepMlp::<B>::new(WIDTH, DEPTH, &device);
    let x = Tensor::<B, 2>::ones([BATCH, WIDTH], &device);
    let _ = model.forward(x.clone()).mean().backward();
    let reports = watch_over::<B>(&mut GrowthWatch::default(), 10, || {
        drop(model.forward(x.clone()))
    });
    let growth = &reports.first().expect("a report").1;
    assert_eq!(
        (growth.cause, growth.backward_passes),
        (GrowthCause::Unknown, None)
    );
    // Freed for the tests after this one.
    let _ = model.forward(x).mean().backward();
}

/// Under `AmpOptimizer::track_memory` the bytes after each step are watched: a loop that
/// keeps each step's output (detached: the graph is freed, the values are not) is reported at
/// the output's size a step, as tensors kept across steps; the same loop without it is not.
#[test]
fn a_training_loop_keeping_its_outputs_is_reported_by_the_optimizer_monitor() {
    let _s = serial();
    type B = Amp<Autodiff<Flex>>;
    let _f32 = autocast(Precision::F32);
    let device = Default::default();
    let run = |keep: bool| {
        let mut model = DeepMlp::<B>::new(WIDTH, DEPTH, &device);
        let x = Tensor::<B, 2>::ones([BATCH, WIDTH], &device);
        let sgd = SgdConfig::new().init::<B, DeepMlp<B>>();
        let mut optim = AmpOptimizer::new(sgd, GradScalerConfig::new())
            .expect("one optimizer at a time")
            .track_memory(1);
        let monitor = optim.monitor();
        let mut kept = Vec::with_capacity(16);
        for _ in 0..12 {
            let y = model.forward(x.clone());
            let grads = GradientsParams::from_grads(y.clone().mean().backward(), &model);
            model = optim.step(1e-3, model, grads);
            if keep {
                kept.push(y.detach());
            }
        }
        monitor.memory_growth()
    };
    assert_eq!(run(false), None);
    let growth = run(true).expect("a report");
    eprintln!("{growth}");
    assert_eq!(growth.cause, GrowthCause::KeptAcrossSteps);
    assert_eq!(growth.backward_passes, Some(7));
    let output = (BATCH * WIDTH * 4) as u64;
    assert!(
        growth.bytes_per_step.abs_diff(output) < output / 20,
        "{} bytes a step, the output is {output}",
        growth.bytes_per_step
    );
    assert!(growth.to_string().contains("into_data"), "{growth}");
}

/// Burn's `Lstm` applies its gates' `Linear`s at every timestep. Cast per use, each use's f16
/// copy of the weights is saved for backward: `RNN_SEQ` copies. The weight-cast cache keeps
/// one, as PyTorch's does.
#[test]
fn a_recurrent_layer_keeps_one_half_copy_of_its_weights() {
    let _s = serial();
    type B = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let in_use = || CountingAlloc::bytes_in_use().unwrap();
    let f32 = {
        let _f32 = autocast(Precision::F32);
        lstm_forward_keeps::<B>(&device, true, in_use)
    };
    let _f16 = autocast(Precision::F16);
    let cached = lstm_forward_keeps::<B>(&device, true, in_use);
    let per_use = lstm_forward_keeps::<B>(&device, false, in_use);
    eprintln!("forward keeps: f32 {f32}, f16 cached {cached}, f16 cast per use {per_use}");
    assert_cache_saves(per_use, cached);
    assert!(per_use > 2 * cached, "per use {per_use}, cached {cached}");
}

/// A weight average's update replaces it tensor by tensor: at its peak it holds the average
/// and a few temporaries of one tensor, not a second average (a clone of the module kept
/// during the update would hold both until the end).
#[test]
fn an_ema_update_holds_one_average() {
    use burn::module::{ModuleMapper, Param};
    use burn_amp::{EmaConfig, ModelEma};
    type A = Autodiff<Flex>;

    /// Every weight plus 0.01, as an optimizer step makes new tensors.
    struct Step;
    impl ModuleMapper<A> for Step {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<A, D>>) -> Param<Tensor<A, D>> {
            let (id, value, mapper) = param.consume();
            let value = Tensor::from_inner(value.inner() + 0.01).require_grad();
            Param::from_mapped_value(id, value, mapper)
        }
    }

    let _s = serial();
    let device = Default::default();
    let layers = 8;
    let mut model: Vec<Linear<A>> = (0..layers)
        .map(|_| LinearConfig::new(256, 256).with_bias(false).init(&device))
        .collect();
    let tensor_bytes = 256 * 256 * 4;
    let mut ema = ModelEma::<A, _>::new(&model, EmaConfig::new().with_decay(0.9)).unwrap();
    // Two updates first: the average owns its tensors (at first it shares the model's).
    for _ in 0..2 {
        model = model.map(&mut Step);
        ema.update(&model).unwrap();
    }
    model = model.map(&mut Step);
    let before = CountingAlloc::bytes_in_use().unwrap();
    CountingAlloc::reset_peak();
    ema.update(&model).unwrap();
    let peak = CountingAlloc::peak().unwrap() - before;
    let after = CountingAlloc::bytes_in_use().unwrap() as i64 - before as i64;
    eprintln!(
        "EMA update of {layers} tensors of {tensor_bytes} B: peak {peak} B above the step's start, \
         {after} B left"
    );
    assert!(
        peak < 4 * tensor_bytes,
        "the update's peak {peak} B holds more than one tensor's temporaries ({tensor_bytes} B \
         each; the average is {} B)",
        layers * tensor_bytes
    );
    assert!(
        after.unsigned_abs() < tensor_bytes / 8,
        "{after} B left behind"
    );
}
