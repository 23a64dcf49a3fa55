//! The memory test step, shared by `tests/memory.rs` (wgpu: CubeCL's allocator) and
//! `tests/memory_counting.rs` (Flex: the counting allocator).

use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::memory::{DeviceMemory, MemoryReport, MemorySource, StepMemory, parameter_bytes};
use burn_amp::optim::FusedAdamWConfig;

use super::models::DeepMlp;

pub const WIDTH: usize = 128;
pub const DEPTH: usize = 3;
pub const BATCH: usize = 512;

/// f32 weights and biases of the `DeepMlp` of `DEPTH` layers `WIDTH -> WIDTH`.
pub const PARAM_BYTES: u64 = (DEPTH * (WIDTH * WIDTH + WIDTH) * 4) as u64;
/// Parameter tensors: a weight and a bias per layer.
pub const PARAM_TENSORS: u64 = (2 * DEPTH) as u64;

pub fn step_report<B: AutodiffBackend + DeviceMemory>() -> MemoryReport
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
    // A first step unmeasured: one-time allocations (per-thread matmul buffers, kernels)
    // are not part of a step's memory.
    let _ = model.forward(x.clone()).mean().backward();
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

/// Saved for backward: each linear's output (the GELU's input) and each GELU's output but the
/// last (the next linear's input); the first linear's input is the model input, live before
/// the step. f32 [BATCH, WIDTH] each, plus a few bytes for the loss.
pub const SAVED: u64 = ((2 * DEPTH - 1) * BATCH * WIDTH * 4) as u64;

pub fn assert_measured(report: &MemoryReport, source: MemorySource) {
    assert_eq!(report.source, Some(source));
    assert_eq!(report.parameters, PARAM_BYTES);
    assert_eq!(report.frozen_parameters, 0);
    assert_eq!(
        report.gradients, PARAM_BYTES,
        "one f32 gradient per parameter"
    );
    let activations = report.activations.expect("measured");
    assert!(
        (SAVED..=SAVED + SAVED / 10).contains(&activations),
        "{source:?}: activations {activations} not within [1, 1.1] x {SAVED}"
    );
    // Everything live after forward was in use at once.
    let peak = report.peak_in_use.expect("measured");
    assert!(peak >= activations + PARAM_BYTES, "{report:?}");
}
