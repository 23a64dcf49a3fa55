//! Memory figures against hand-computed byte counts.

mod common;

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::memory::{DeviceMemory, MemorySource, StepMemory, parameter_bytes};
use burn_amp::optim::FusedAdamWConfig;
use common::models::DeepMlp;

const WIDTH: usize = 128;
const DEPTH: usize = 3;
const BATCH: usize = 512;

/// f32 weights and biases of the `DeepMlp` of `DEPTH` layers `WIDTH -> WIDTH`.
const PARAM_BYTES: u64 = (DEPTH * (WIDTH * WIDTH + WIDTH) * 4) as u64;
/// Parameter tensors: a weight and a bias per layer.
const PARAM_TENSORS: u64 = (2 * DEPTH) as u64;

fn step_report<B: AutodiffBackend + DeviceMemory>() -> burn_amp::memory::MemoryReport
where
    B::InnerBackend: burn_amp::kernels::AmpKernels,
{
    let device = Default::default();
    let model = DeepMlp::<B>::new(WIDTH, DEPTH, &device);
    let _ = parameter_bytes::<B, _>(&model); // materialise the lazy parameters first
    let x = Tensor::<B, 2>::ones([BATCH, WIDTH], &device);
    let mut optim = FusedAdamWConfig::new()
        .init::<B, DeepMlp<B>>()
        .expect("the default config is valid");
    let mut memory = StepMemory::begin::<B>(&device);
    let loss = model.forward(x).mean();
    memory.after_forward::<B>(&device);
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    memory.after::<B>(&device);
    let report = memory.report::<B, _>(&model, Some(&grads), 0);
    let model = optim.step(1e-3, model, grads);
    assert_eq!(
        optim.state_bytes(&model),
        2 * PARAM_BYTES + 4 * PARAM_TENSORS,
        "AdamW: two f32 moments per parameter, and an f32 step count per parameter tensor"
    );
    let _ = model;
    report
}

#[test]
fn parameters_and_gradients_are_exact() {
    let report = step_report::<Autodiff<Flex>>();
    assert_eq!(report.parameters, PARAM_BYTES);
    assert_eq!(report.frozen_parameters, 0);
    assert_eq!(
        report.gradients, PARAM_BYTES,
        "one f32 gradient per parameter"
    );
    // Flex has no allocator counters: activations and peak are an estimate from the
    // process's resident memory, and the report says so.
    assert_eq!(report.source, Some(MemorySource::Estimate));
    assert!(report.to_string().contains("estimate"));
}

#[test]
fn activations_are_measured_on_wgpu() {
    if common::wgpu_device().is_none() {
        return;
    }
    // Memory is counted per thread: measure on a thread of its own.
    let report = std::thread::spawn(step_report::<Autodiff<Wgpu>>)
        .join()
        .unwrap();
    assert_eq!(report.source, Some(MemorySource::Allocator));
    assert_eq!(report.parameters, PARAM_BYTES);
    assert_eq!(report.gradients, PARAM_BYTES);
    // Saved for backward: each linear's output (the GELU's input) and each GELU's output
    // but the last (the next linear's input); the first linear's input is the model input,
    // live before the step. f32 [BATCH, WIDTH] each, plus a few bytes for the loss.
    let saved = ((2 * DEPTH - 1) * BATCH * WIDTH * 4) as u64;
    assert!(
        report.activations >= saved && report.activations <= saved + saved / 10,
        "activations {} not within [1, 1.1] x {saved}",
        report.activations
    );
    assert!(report.peak_in_use >= report.activations);
    let text = report.to_string();
    assert!(
        text.contains("activations") && text.contains("largest: activations"),
        "{text}"
    );
}

use burn_amp::memory::{FinderError, GuardError, MemoryGuard, find_micro_batch};

#[test]
fn finder_doubles_then_bisects() {
    // A step at micro-batch b peaks at 1000 + 100 b bytes; the budget is 5000: b <= 40.
    let mut tried = Vec::new();
    let mut guard = MemoryGuard::new(Some(5000));
    let plan = find_micro_batch(100, |b| {
        tried.push(b);
        let peak = 1000 + 100 * b as u64;
        if peak > 5000 {
            // What the guard reports for a step over the budget.
            Err(GuardError::Device(format!("{peak} > 5000")))
        } else {
            guard.set_report(Default::default());
            Ok(Some(peak))
        }
    })
    .unwrap();
    assert_eq!(plan.micro_batch, 40);
    assert_eq!(plan.micro_batches, 3, "ceil(100 / 40)");
    assert_eq!(plan.last_micro_batch, 20, "40 + 40 + 20 = 100");
    assert_eq!(plan.peak_bytes, Some(5000));
    assert_eq!(&tried[..7], &[1, 2, 4, 8, 16, 32, 64], "doubling first");
    assert!(tried.len() <= 14, "O(log target) steps: {tried:?}");

    // Everything fits: one window of the target itself.
    let plan = find_micro_batch(30, |b| Ok(Some(b as u64))).unwrap();
    assert_eq!(
        (plan.micro_batch, plan.micro_batches, plan.last_micro_batch),
        (30, 1, 30)
    );
    assert_eq!(
        find_micro_batch(0, |_| Ok(None)),
        Err(FinderError::TargetTooSmall)
    );
    let nothing = find_micro_batch(8, |_| Err(GuardError::Device("no".into())));
    assert!(matches!(nothing, Err(FinderError::NothingFits(_))));
}

type W = Autodiff<Wgpu>;

/// One guarded training step of the MLP at `batch`; the model is cloned in, so a failure
/// leaves the caller's model as it was.
fn guarded_step(
    guard: &mut MemoryGuard,
    model: &DeepMlp<W>,
    batch: usize,
) -> Result<Option<u64>, GuardError> {
    let device = Default::default();
    let model = model.clone();
    guard
        .run::<W, _>(&device, |peak| {
            let x = Tensor::<W, 2>::ones([batch, WIDTH], &device);
            let loss = model.forward(x).mean();
            peak.sample::<W>(&device);
            let grads = loss.backward();
            peak.sample::<W>(&device);
            drop(grads);
        })
        .map(|_| guard.last_peak())
}

#[test]
fn out_of_memory_under_a_cap_is_typed_and_training_continues_smaller() {
    if common::wgpu_device().is_none() {
        return;
    }
    std::thread::spawn(|| {
        let device = Default::default();
        let model = DeepMlp::<W>::new(WIDTH, DEPTH, &device);
        let _ = parameter_bytes::<W, _>(&model);
        let before: Vec<f32> = model.layers[0].weight.val().into_data().to_vec().unwrap();

        // Measure the step at 512 and at 64 without a cap.
        let mut free = MemoryGuard::new(None);
        let big = guarded_step(&mut free, &model, 512).unwrap().unwrap();
        let small = guarded_step(&mut free, &model, 64).unwrap().unwrap();
        assert!(small < big);

        // A cap between the two: 512 fails with a typed error, 64 still trains.
        let cap = (small + big) / 2;
        let mut guard = MemoryGuard::new(Some(cap));
        guard.set_report(step_report::<W>());
        match guarded_step(&mut guard, &model, 512) {
            Err(GuardError::OutOfMemory(oom)) => {
                assert_eq!(oom.needed, Some(big));
                assert_eq!(oom.budget, Some(cap));
                assert_eq!(oom.dominant, "activations");
                assert!(
                    oom.advice[0].contains("Precision::Bf16"),
                    "{:?}",
                    oom.advice
                );
                assert!(oom.to_string().contains("out of memory"));
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        assert!(
            guarded_step(&mut guard, &model, 64).is_ok(),
            "a smaller micro-batch fits"
        );
        let after: Vec<f32> = model.layers[0].weight.val().into_data().to_vec().unwrap();
        assert_eq!(before, after, "the failed step changed nothing");

        // The finder picks, under several caps, the largest batch whose measured peak fits.
        for cap in [small, (small + big) / 2, big] {
            let mut guard = MemoryGuard::new(Some(cap));
            let mut peaks = std::collections::BTreeMap::new();
            let plan = find_micro_batch(512, |b| {
                let r = guarded_step(&mut guard, &model, b);
                peaks.insert(b, guard.last_peak());
                r
            })
            .unwrap();
            let fit = plan.peak_bytes.unwrap();
            assert!(
                fit <= cap,
                "cap {cap}: chosen {} peaks at {fit}",
                plan.micro_batch
            );
            if plan.micro_batch < 512 {
                let next = peaks.get(&(plan.micro_batch + 1)).copied().flatten();
                assert!(
                    next.is_some_and(|p| p > cap),
                    "cap {cap}: {} + 1 would fit too",
                    plan.micro_batch
                );
            }
            assert_eq!(plan.micro_batches, 512usize.div_ceil(plan.micro_batch));
        }
    })
    .join()
    .unwrap();
}
