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

/// The recurrent layer of the weight-cast cache's memory tests: an `Lstm` applies its eight
/// `Linear`s (four gates, input and hidden) at every one of `RNN_SEQ` timesteps.
pub const RNN_HIDDEN: usize = 128;
pub const RNN_SEQ: usize = 32;
pub const RNN_BATCH: usize = 4;
/// What one timestep saves of the weights, cast per use: a half copy of the four hidden
/// transforms' weights (a linear saves its weight for its input's gradient; the input
/// transforms' input is the data, which needs none, and the first step's hidden state is zeros).
pub const RNN_SAVED_WEIGHTS_HALF: u64 = (4 * RNN_HIDDEN * RNN_HIDDEN * 2) as u64;
/// The cache's own copies: all eight weights and biases in half.
pub const RNN_CACHED_HALF: u64 = (8 * (RNN_HIDDEN * RNN_HIDDEN + RNN_HIDDEN) * 2) as u64;

/// What the cache saves in one forward, by hand: cast per use, steps 2..=RNN_SEQ each save a
/// copy; cached, only the cache's copies are held.
pub const RNN_CACHE_SAVES: u64 = (RNN_SEQ as u64 - 1) * RNN_SAVED_WEIGHTS_HALF - RNN_CACHED_HALF;

/// The bytes the cache saved (`lstm_forward_keeps` cast per use less cached) are the hand
/// count, within 5%.
pub fn assert_cache_saves(per_use: u64, cached: u64) {
    let (saved, expected) = (per_use - cached, RNN_CACHE_SAVES);
    assert!(
        saved.abs_diff(expected) < expected / 20,
        "{saved} bytes saved by the cache, hand count {expected}"
    );
}

/// The bytes an `Lstm` forward keeps until its backward (after a first unmeasured step),
/// with the parameter casts cached or not, under the caller's autocast setting.
pub fn lstm_forward_keeps<B: AutodiffBackend>(
    device: &B::Device,
    cache: bool,
    in_use: impl Fn() -> u64,
) -> u64 {
    use burn::nn::LstmConfig;
    use burn_amp::backend::cast_cache;
    let lstm = LstmConfig::new(RNN_HIDDEN, RNN_HIDDEN, true).init::<B>(device);
    let _ = parameter_bytes::<B, _>(&lstm); // materialise the lazy parameters first
    let x = Tensor::<B, 3>::ones([RNN_BATCH, RNN_SEQ, RNN_HIDDEN], device);
    let previous = cast_cache::set_enabled(cache);
    // Parameters alone (the hand counts above); shared activation casts: `autocast_numerics`.
    let activations = cast_cache::set_activations_enabled(false);
    let _ = lstm.forward(x.clone(), None).0.mean().backward();
    let before = in_use();
    let loss = lstm.forward(x, None).0.mean();
    let kept = in_use() - before;
    let _ = loss.backward();
    cast_cache::set_enabled(previous);
    cast_cache::set_activations_enabled(activations);
    kept
}
