//! `OptimKernels`: the helpers of the optimizer steps, and empty parameters. The steps
//! themselves: `adamw.rs`, `sgd.rs`, and `scaled.rs` (a real loss scale).

// Paths spelled out and the modules visible to the parent: `examples/gpu_check` loads this
// file by `#[path]` and collects each module's cases.
#[path = "optim/adamw.rs"]
pub(crate) mod adamw;
#[path = "optim/quantized.rs"]
pub(crate) mod quantized;
#[path = "optim/scaled.rs"]
pub(crate) mod scaled;
#[path = "optim/sgd.rs"]
pub(crate) mod sgd;

use super::*;
use burn_amp::optim::kernels::{AdamWMoments, Scaling, Velocity};
use burn_amp::optim::{FusedAdamWConfig, FusedSgdConfig};

const STEP_SHAPES: &[&[usize]] = &[&[1], &[3], &[1023], &[4097], &[16, 24]];

pub(super) fn adamw_config(
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
) -> FusedAdamWConfig {
    FusedAdamWConfig::new()
        .with_beta_1(beta_1)
        .with_beta_2(beta_2)
        .with_epsilon(epsilon)
        .with_weight_decay(weight_decay)
}

fn sgd_config(momentum: f32, dampening: f32, weight_decay: f32, nesterov: bool) -> FusedSgdConfig {
    FusedSgdConfig::new()
        .with_momentum(momentum)
        .with_dampening(dampening)
        .with_weight_decay(weight_decay)
        .with_nesterov(nesterov)
}

pub(super) fn scaling<B: Backend>(
    inv_scale: f32,
    found_inf: f32,
    device: &B::Device,
) -> Scaling<FloatTensor<B>> {
    Scaling {
        inv_scale: scalar::<B>(inv_scale, device),
        found_inf: scalar::<B>(found_inf, device),
    }
}

/// Zero moments of `shape` and a step count of `count` (steps applied before the next one).
pub(super) fn zero_moments<B: Backend>(
    shape: &[usize],
    count: f32,
    device: &B::Device,
) -> AdamWMoments<FloatTensor<B>> {
    let n: usize = shape.iter().product();
    let zeros = || tensor::<B>(vec![0.0; n], shape, FloatDType::F32, device);
    AdamWMoments {
        exp_avg: zeros(),
        exp_avg_sq: zeros(),
        max_exp_avg_sq: None,
        step: scalar::<B>(count, device),
    }
}

/// A velocity holding `values`, with a step count of 0 (no step applied yet).
pub(super) fn fresh_velocity<B: Backend>(
    values: Vec<f32>,
    shape: &[usize],
    device: &B::Device,
) -> Velocity<FloatTensor<B>> {
    Velocity {
        velocity: tensor::<B>(values, shape, FloatDType::F32, device),
        step: scalar::<B>(0.0, device),
    }
}

/// One AdamW step, by the kernel or by the fallback.
pub(super) fn adamw<B: AmpKernels>(
    kernel: bool,
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    state: AdamWMoments<FloatTensor<B>>,
    scaling: Scaling<FloatTensor<B>>,
    lr: f32,
    c: &FusedAdamWConfig,
) -> (FloatTensor<B>, AdamWMoments<FloatTensor<B>>) {
    if kernel {
        B::adamw_step(param, grad, state, scaling, lr, c)
    } else {
        fallback::adamw_step::<B>(param, grad, state, scaling, lr, c)
    }
}

/// One SGD step, by the kernel or by the fallback.
fn sgd<B: AmpKernels>(
    kernel: bool,
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    velocity: Option<Velocity<FloatTensor<B>>>,
    scaling: Scaling<FloatTensor<B>>,
    lr: f32,
    c: &FusedSgdConfig,
) -> (FloatTensor<B>, Option<Velocity<FloatTensor<B>>>) {
    if kernel {
        B::sgd_step(param, grad, velocity, scaling, lr, c)
    } else {
        fallback::sgd_step::<B>(param, grad, velocity, scaling, lr, c)
    }
}

/// A step count: an f32 `[1]` tensor.
#[track_caller]
pub(super) fn count<B: Backend>(t: FloatTensor<B>) -> f32 {
    assert_eq!(t.dtype(), DType::F32, "a step count is f32");
    let v = values::<B>(t);
    assert_eq!(v.len(), 1, "a step count is [1]");
    v[0]
}

struct AdamState<B: Backend> {
    p: FloatTensor<B>,
    s: AdamWMoments<FloatTensor<B>>,
}

/// The raw bytes of a parameter and its AdamW state (AMSGrad's maximum last, if any), to
/// compare across a skipped step.
fn adam_bytes<B: Backend>(a: &AdamState<B>) -> Vec<Vec<u8>> {
    let mut bytes = vec![
        read::<B>(a.p.clone()).1,
        read::<B>(a.s.exp_avg.clone()).1,
        read::<B>(a.s.exp_avg_sq.clone()).1,
        read::<B>(a.s.step.clone()).1,
    ];
    bytes.extend(a.s.max_exp_avg_sq.clone().map(|t| read::<B>(t).1));
    bytes
}

/// Empty parameters come back as they are, with their state. (An empty parameter's count
/// comes back unchanged too, in the kernels and the fallbacks alike: asserted equal here.)
fn check_empty_steps<B: AmpKernels>(device: &B::Device) {
    let e = || tensor::<B>(vec![], &[0, 3], FloatDType::F32, device);
    let c = adamw_config(0.9, 0.999, 1e-8, 0.0);
    let mut counts = Vec::new();
    for kernel in [true, false] {
        let (p, s) = adamw::<B>(
            kernel,
            e(),
            e(),
            zero_moments::<B>(&[0, 3], 0.0, device),
            scaling::<B>(1.0, 0.0, device),
            1e-3,
            &c,
        );
        for t in [p, s.exp_avg, s.exp_avg_sq] {
            assert_eq!(t.shape(), Shape::new([0, 3]));
        }
        counts.push(count::<B>(s.step));
    }
    let c = sgd_config(0.9, 0.0, 0.0, false);
    for kernel in [true, false] {
        let (p, b) = sgd::<B>(
            kernel,
            e(),
            e(),
            Some(fresh_velocity::<B>(vec![], &[0, 3], device)),
            scaling::<B>(1.0, 0.0, device),
            0.1,
            &c,
        );
        assert_eq!(p.shape(), Shape::new([0, 3]));
        let b = b.expect("a velocity");
        assert_eq!(b.velocity.shape(), Shape::new([0, 3]));
        counts.push(count::<B>(b.step));
    }
    assert_eq!(counts[0], counts[1], "adamw: kernel's count vs fallback's");
    assert_eq!(counts[2], counts[3], "sgd: kernel's count vs fallback's");
}

// ---------------------------------------------------------------------------------------
// The tests: every check on Wgpu (fusion) and on the bare CubeBackend.
// ---------------------------------------------------------------------------------------

on_both! {
    empty_steps: check_empty_steps();
}
