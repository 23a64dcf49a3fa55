//! Memory figures against hand-computed byte counts.

mod common;

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::memory::{DeviceMemory, MemorySource, StepMemory, parameter_bytes};
use burn_amp::scaler::{FusedAdamWConfig, FusedOptimizer};

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    layers: Vec<Linear<B>>,
}

const WIDTH: usize = 128;
const DEPTH: usize = 3;
const BATCH: usize = 512;

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            layers: (0..DEPTH)
                .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
                .collect(),
        }
    }

    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for layer in &self.layers {
            x = burn::tensor::activation::gelu(layer.forward(x));
        }
        x
    }
}

/// f32 weights and biases.
const PARAM_BYTES: u64 = (DEPTH * (WIDTH * WIDTH + WIDTH) * 4) as u64;

fn step_report<B: AutodiffBackend + DeviceMemory>() -> burn_amp::memory::MemoryReport
where
    B::InnerBackend: burn_amp::kernels::AmpKernels,
{
    let device = Default::default();
    let model = Mlp::<B>::new(&device);
    let _ = parameter_bytes::<B, _>(&model); // materialise the lazy parameters first
    let x = Tensor::<B, 2>::ones([BATCH, WIDTH], &device);
    let mut optim = FusedAdamWConfig::new().init::<B>();
    let mut memory = StepMemory::begin::<B>(&device);
    let loss = model.forward(x).mean();
    memory.after_forward::<B>(&device);
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    memory.after::<B>(&device);
    let report = memory.report::<B, _>(&model, Some(&grads), 0);
    let model = optim.step_scaled(1e-3, model, grads, None, None);
    assert_eq!(
        optim.state_bytes(),
        2 * PARAM_BYTES,
        "AdamW: two f32 moments per parameter"
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
    // Flex has no allocator counters: no activation figure, and the report says so.
    assert_eq!(report.source, None);
    assert_eq!(report.activations, 0);
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
