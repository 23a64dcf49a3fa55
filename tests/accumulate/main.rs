//! Gradient accumulation: N micro-batches give the update of one batch of N·b; sum is
//! Burn's sum; missing and frozen parameters; the scaler skips an overflowing window once;
//! misuse is a typed error; a run stopped mid-window resumes bit for bit.
//!
//! Layout: this file holds the fixtures (batches, `BatchLoss`, parameter readers, sizes);
//! `plain.rs` the unscaled accumulation, `scaled.rs` loss scaling, `resume.rs` save and
//! resume, `learner.rs` burn-train's `Learner`.

#[path = "../common/mod.rs"]
mod common;

mod learner;
mod plain;
mod resume;
mod scaled;

use std::collections::HashSet;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{Adam, AdamConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::FloatDType;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::Amp;
use burn_amp::accumulate::GradientAccumulation;
use common::models::{Mlp, bits, ids, params};

type F = Autodiff<Flex>;
type A = Amp<Autodiff<Flex>>;

const FEATURES: usize = 8;
const CLASSES: usize = 4;

/// Features `[rows, FEATURES]` and classes `[rows]`.
type Batch<B> = (Tensor<B, 2>, Tensor<B, 1, Int>);

/// The loss of one `(x, y)` batch. The shared `Mlp` is a plain chain with batch-independent
/// layers (no tensor feeding several consumers, so autodiff's order of accumulation is
/// fixed), and its loss is mean-reduced.
trait BatchLoss<B: Backend> {
    fn batch_loss(&self, batch: Batch<B>) -> Tensor<B, 1>;
}

impl<B: Backend> BatchLoss<B> for Mlp<B> {
    fn batch_loss(&self, (x, y): Batch<B>) -> Tensor<B, 1> {
        self.loss(x, y)
    }
}

fn mlp<B: Backend>(device: &B::Device) -> Mlp<B> {
    Mlp::new(FEATURES, 32, CLASSES, device)
}

/// [`mlp`], after seeding the backend with `seed`.
fn seeded_mlp<B: Backend>(seed: u64, device: &B::Device) -> Mlp<B> {
    B::seed(device, seed);
    mlp(device)
}

/// Adam behind a window of `N` micro-batches.
fn adam_accumulation<B: AutodiffBackend>()
-> GradientAccumulation<OptimizerAdaptor<Adam, Mlp<B>, B>, B> {
    GradientAccumulation::new(AdamConfig::new().init::<B, Mlp<B>>(), N).unwrap()
}

/// Host data, fixed by `(seed, rows)`: features in [-1, 1), the class is the argmax of the
/// first `CLASSES` features.
fn host_batch(seed: u64, rows: usize) -> (Vec<f32>, Vec<i64>) {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let x: Vec<f32> = (0..rows * FEATURES).map(|_| next()).collect();
    let y = (0..rows)
        .map(|r| {
            let row = &x[r * FEATURES..r * FEATURES + CLASSES];
            (0..CLASSES)
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap() as i64
        })
        .collect();
    (x, y)
}

fn to_tensors<B: Backend>((x, y): (Vec<f32>, Vec<i64>), device: &B::Device) -> Batch<B> {
    let rows = y.len();
    (
        Tensor::from_data(TensorData::new(x, [rows, FEATURES]), device),
        Tensor::from_data(TensorData::new(y, [rows]), device),
    )
}

/// Micro-batch `i` of optimizer step `step`.
fn micro<B: Backend>(step: usize, i: usize, b: usize, device: &B::Device) -> Batch<B> {
    to_tensors(host_batch((step * 1000 + i) as u64, b), device)
}

/// The gradients of `model`'s loss on micro-batch `i` (of `MICRO` rows) of step `step`.
fn micro_grads<B: AutodiffBackend>(
    model: &Mlp<B>,
    step: usize,
    i: usize,
    device: &B::Device,
) -> GradientsParams {
    let loss = model.batch_loss(micro(step, i, MICRO, device));
    GradientsParams::from_grads(loss.backward(), model)
}

/// The `n` micro-batches of `step`, concatenated: one batch of `n·b`.
fn big<B: Backend>(step: usize, n: usize, b: usize, device: &B::Device) -> Batch<B> {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for i in 0..n {
        let (xi, yi) = host_batch((step * 1000 + i) as u64, b);
        x.extend(xi);
        y.extend(yi);
    }
    to_tensors((x, y), device)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// The L2 norm of the update from `init` to `model`, over every parameter.
fn update_norm<B: Backend>(model: &Mlp<B>, init: &Mlp<B>) -> f64 {
    params(model)
        .iter()
        .zip(params(init))
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// The norm a clipping window reported against `want`, its unclipped update's (SGD, lr 1),
/// within `rel`; `want` well above `max_norm`, so that the window was clipped.
fn assert_norm_before_clipping(reported: f64, want: f64, max_norm: f32, rel: f64) {
    assert!(want > 10.0 * max_norm as f64, "not clipped: {want}");
    assert!(
        (reported - want).abs() < rel * want,
        "norm {reported}, want {want}"
    );
}

const N: usize = 4;
const MICRO: usize = 8;
