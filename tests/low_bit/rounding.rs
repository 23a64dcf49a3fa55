//! Stochastic rounding through the optimizer step itself (`OptimKernels::adamw_step` with f32
//! moments and `adamw8bit_step` with 8-bit ones): 65,536 copies of the value 1.0 take one
//! AdamW step of `lr = 0.3` spacings (the first AdamW step moves every value by `lr`). Rounded
//! to nearest, every copy stays at 1.0 (the update is lost). Stochastically, 30% of them move
//! down one spacing: the mean is `1 - lr` within 5 standard deviations of the binomial, and
//! ten such steps track the f32 trajectory. Same seed: same bits; another seed: other bits;
//! two parameters of one size: streams of their own.

use burn::backend::{Flex, Wgpu};
use burn::prelude::*;
use burn_amp::AmpKernels;
use burn_amp::optim::kernels::{AdamWMoments, QuantizedMoments, Scaling};
use burn_amp::optim::{FusedAdamWConfig, MomentStorage, WeightRounding};
use burn_backend::TensorMetadata;
use burn_backend::tensor::FloatTensor;
use burn_std::{FloatDType, IntDType, Shape};

use crate::common;

const N: usize = 65_536;

fn primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn floats<B: Backend>(t: FloatTensor<B>) -> Vec<f32> {
    crate::values(Tensor::<B, 1>::from_primitive(
        burn::tensor::TensorPrimitive::Float(t),
    ))
}

/// The spacing just below 1.0 in `dtype`.
fn spacing_below_one(dtype: FloatDType) -> f32 {
    match dtype {
        FloatDType::BF16 => 2f32.powi(-8),
        FloatDType::F16 => 2f32.powi(-11),
        _ => f32::EPSILON / 2.0,
    }
}

enum State<B: Backend> {
    F32(AdamWMoments<FloatTensor<B>>),
    Int8(QuantizedMoments<FloatTensor<B>, burn_backend::tensor::IntTensor<B>>),
}

/// `steps` AdamW steps on `N` copies of 1.0 stored in `dtype`, gradient 1 everywhere.
fn run<B: AmpKernels>(
    device: &B::Device,
    dtype: FloatDType,
    rounding: WeightRounding,
    int8: bool,
    seed: u64,
    lr: f32,
    steps: usize,
) -> (Vec<f32>, Vec<u8>) {
    let c = FusedAdamWConfig::new()
        .with_weight_decay(0.0)
        .with_weight_rounding(rounding)
        .with_seed(seed)
        .with_moments(MomentStorage::int8());
    let ones = Tensor::<B, 1>::ones([N], device);
    let mut p = primitive(ones.clone().cast(dtype));
    let zeros = || primitive(Tensor::<B, 1>::zeros([N], device));
    let count = || primitive(Tensor::<B, 1>::zeros([1], device));
    let mut state = if int8 {
        State::<B>::Int8(QuantizedMoments {
            exp_avg_codes: B::int_zeros(Shape::new([N / 4]), device, IntDType::I32),
            exp_avg_absmax: primitive(Tensor::<B, 1>::zeros([N / 256], device)),
            exp_avg_sq_codes: B::int_zeros(Shape::new([N / 4]), device, IntDType::I32),
            exp_avg_sq_absmax: primitive(Tensor::<B, 1>::zeros([N / 256], device)),
            step: count(),
            block: 256,
            map: burn_amp::optim::QuantMap::Dynamic,
        })
    } else {
        State::F32(AdamWMoments {
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            max_exp_avg_sq: None,
            step: count(),
        })
    };
    for _ in 0..steps {
        let grad = primitive(ones.clone());
        let scaling = Scaling {
            inv_scale: primitive(Tensor::<B, 1>::ones([1], device)),
            found_inf: count(),
        };
        (p, state) = match state {
            State::F32(s) => {
                let (p, s) = B::adamw_step(p, grad, s, scaling, lr, &c);
                (p, State::F32(s))
            }
            State::Int8(s) => {
                let (p, s) = B::adamw8bit_step(p, grad, s, scaling, lr, &c);
                (p, State::Int8(s))
            }
        };
    }
    assert_eq!(p.dtype(), dtype.into(), "the parameter keeps its dtype");
    let bytes = Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(p.clone()))
        .into_data()
        .as_bytes()
        .to_vec();
    (floats::<B>(p), bytes)
}

fn mean(v: &[f32]) -> f64 {
    v.iter().map(|x| *x as f64).sum::<f64>() / v.len() as f64
}

fn check<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let spacing = spacing_below_one(dtype);
    let lr = 0.3 * spacing;
    for int8 in [false, true] {
        let what = format!("{dtype:?} int8 moments {int8}");
        // Rounded to nearest, the update is lost.
        let (nearest, _) = run::<B>(device, dtype, WeightRounding::Nearest, int8, 1, lr, 1);
        assert!(
            nearest.iter().all(|v| *v == 1.0),
            "{what}: nearest keeps 1.0"
        );

        let (sr, bytes) = run::<B>(device, dtype, WeightRounding::Stochastic, int8, 1, lr, 1);
        let below = 1.0 - spacing;
        assert!(
            sr.iter().all(|v| *v == 1.0 || *v == below),
            "{what}: every value is one of the two neighbours"
        );
        let down = sr.iter().filter(|v| **v == below).count() as f64 / N as f64;
        let sigma = (0.3f64 * 0.7 / N as f64).sqrt();
        assert!(
            (down - 0.3).abs() < 5.0 * sigma,
            "{what}: {down:.4} of the values rounded down, expected 0.3 ± {:.4}",
            5.0 * sigma
        );
        let m = mean(&sr);
        let want = 1.0 - lr as f64;
        assert!(
            (m - want).abs() < 5.0 * sigma * spacing as f64,
            "{what}: mean {m} vs {want}: stochastic rounding must be unbiased"
        );

        // Reproducible: the same seed gives the same bits, another seed others.
        let (_, again) = run::<B>(device, dtype, WeightRounding::Stochastic, int8, 1, lr, 1);
        assert_eq!(bytes, again, "{what}: same seed, same bits");
        let (_, other) = run::<B>(device, dtype, WeightRounding::Stochastic, int8, 2, lr, 1);
        assert_ne!(bytes, other, "{what}: another seed, other bits");

        // Ten steps: nearest never moves; stochastic tracks the f32 parameter's path.
        let steps = 10;
        let (f32_path, _) = run::<B>(
            device,
            FloatDType::F32,
            WeightRounding::Nearest,
            int8,
            1,
            lr,
            steps,
        );
        let (sr, _) = run::<B>(
            device,
            dtype,
            WeightRounding::Stochastic,
            int8,
            1,
            lr,
            steps,
        );
        let (nearest, _) = run::<B>(device, dtype, WeightRounding::Nearest, int8, 1, lr, steps);
        assert!(
            nearest.iter().all(|v| *v == 1.0),
            "{what}: nearest stalls for ten steps"
        );
        let (m, want) = (mean(&sr), mean(&f32_path));
        assert!(
            want < 1.0 - 2.0 * spacing as f64,
            "{what}: the f32 path moved more than two spacings ({want})"
        );
        // Each step adds at most one spacing of variance per value.
        let tol = 5.0 * spacing as f64 * (steps as f64 / (4.0 * N as f64)).sqrt();
        assert!(
            (m - want).abs() < tol,
            "{what}: after {steps} steps mean {m} vs the f32 path {want} (tolerance {tol:e})"
        );
    }
}

#[test]
fn stochastic_rounding_is_unbiased_on_flex_bf16() {
    common::big_stack(|| check::<Flex>(&Default::default(), FloatDType::BF16));
}

#[test]
fn stochastic_rounding_is_unbiased_on_flex_f16() {
    common::big_stack(|| check::<Flex>(&Default::default(), FloatDType::F16));
}

#[test]
fn stochastic_rounding_is_unbiased_on_wgpu_f16() {
    if let Some(device) = common::wgpu_device() {
        common::big_stack(move || check::<Wgpu>(&device, FloatDType::F16));
    }
}

/// Two parameters of one size (two layers' projections) in one module.
#[derive(burn::module::Module, Debug)]
struct Pair<B: Backend> {
    a: burn::module::Param<Tensor<B, 1>>,
    b: burn::module::Param<Tensor<B, 1>>,
}

/// Parameters of one size get random streams of their own: one AdamW step of 0.3 spacings
/// from the same bf16 values with the same gradient rounds each down for 30% of its elements,
/// and the two apart about as often as two independent roundings would (2 · 0.3 · 0.7 =
/// 42%). With the seed mixed with the size alone they got the same bits: rounded alike at
/// every element, their rounding errors added up instead of averaging out.
#[test]
fn parameters_of_one_size_round_independently() {
    use burn::backend::Autodiff;
    use burn::optim::{GradientsParams, Optimizer};
    type B = burn_amp::Amp<Autodiff<Flex>>;
    type IB = <B as burn::tensor::backend::AutodiffBackend>::InnerBackend;
    let device = Default::default();
    let p = || {
        burn::module::Param::from_tensor(Tensor::ones([N], (&device, burn::tensor::DType::BF16)))
    };
    let model = Pair::<B> { a: p(), b: p() };
    let mut optim = FusedAdamWConfig::new()
        .with_weight_decay(0.0)
        .with_weight_rounding(WeightRounding::Stochastic)
        .init::<B, Pair<B>>()
        .unwrap();
    let mut grads = GradientsParams::new();
    for id in [model.a.id, model.b.id] {
        grads.register::<IB, 1>(id, Tensor::ones([N], &device));
    }
    let lr = 0.3 * spacing_below_one(FloatDType::BF16);
    let model = optim.step(lr as f64, model, grads);
    let (a, b) = (crate::values(model.a.val()), crate::values(model.b.val()));
    let share = |n: usize| n as f64 / N as f64;
    for (name, v) in [("a", &a), ("b", &b)] {
        let down = share(v.iter().filter(|&&x| x < 1.0).count());
        // 5 standard deviations of the binomial: 0.009.
        assert!((down - 0.3).abs() < 0.01, "{name}: {down} rounded down");
    }
    let apart = share(a.iter().zip(&b).filter(|(x, y)| x != y).count());
    assert!((apart - 0.42).abs() < 0.01, "rounded apart: {apart}");
}

/// An f16 parameter stepped past f16's range is inf with stochastic rounding as with
/// rounding to nearest (and as the kernels give): the burn-op fallback made it NaN (`0 · inf`
/// from the format's binade, which overflows there), a different failure from the kernels'.
#[test]
fn an_f16_parameter_stepped_past_its_range_is_inf_not_nan() {
    use burn::backend::Autodiff;
    use burn::optim::{GradientsParams, Optimizer};
    type B = burn_amp::Amp<Autodiff<Flex>>;
    type IB = <B as burn::tensor::backend::AutodiffBackend>::InnerBackend;
    let device = Default::default();
    for rounding in [WeightRounding::Nearest, WeightRounding::Stochastic] {
        let p = || {
            burn::module::Param::from_tensor(Tensor::full(
                [4],
                60_000.0,
                (&device, burn::tensor::DType::F16),
            ))
        };
        let model = Pair::<B> { a: p(), b: p() };
        let mut optim = FusedAdamWConfig::new()
            .with_weight_decay(0.0)
            .with_weight_rounding(rounding)
            .init::<B, Pair<B>>()
            .unwrap();
        let mut grads = GradientsParams::new();
        for id in [model.a.id, model.b.id] {
            grads.register::<IB, 1>(id, Tensor::full([4], -1.0, &device));
        }
        // AdamW's first step moves by lr: 60,000 + 10,000 is past 65,504.
        let model = optim.step(10_000.0, model, grads);
        let a = crate::values(model.a.val());
        assert!(a.iter().all(|v| *v == f32::INFINITY), "{rounding:?}: {a:?}");
    }
}
