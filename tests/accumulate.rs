//! Gradient accumulation: N micro-batches give the update of one batch of N·b; sum is
//! Burn's sum; missing and frozen parameters; the scaler skips an overflowing window once;
//! misuse is a typed error; a run stopped mid-window resumes bit for bit.

mod common;

use std::collections::HashSet;

use burn::backend::{Autodiff, Flex};
use burn::lr_scheduler::LrScheduler;
use burn::lr_scheduler::exponential::ExponentialLrSchedulerConfig;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsAccumulator, GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, FloatDType};
use burn::train::{InferenceStep, Learner, TrainOutput, TrainStep};
use burn_amp::accumulate::{
    AccumulationError, GradientAccumulation, GradientAccumulationConfig, Reduction,
    WindowedLrScheduler,
};
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::scaler::{
    GradScaler, GradScalerConfig, GradScalerRecord, ScaledStep, ScalerError, Stage,
};
use burn_amp::{Amp, Precision, autocast};
use common::big_stack;
use common::models::Mlp;

type F = Autodiff<Flex>;
type A = Amp<Autodiff<Flex>>;

const FEATURES: usize = 8;
const CLASSES: usize = 4;

/// The loss of one `(x, y)` batch. The shared `Mlp` is a plain chain with batch-independent
/// layers (no tensor feeding several consumers, so autodiff's order of accumulation is
/// fixed), and its loss is mean-reduced.
trait BatchLoss<B: Backend> {
    fn batch_loss(&self, batch: (Tensor<B, 2>, Tensor<B, 1, Int>)) -> Tensor<B, 1>;
}

impl<B: Backend> BatchLoss<B> for Mlp<B> {
    fn batch_loss(&self, (x, y): (Tensor<B, 2>, Tensor<B, 1, Int>)) -> Tensor<B, 1> {
        self.loss(x, y)
    }
}

fn mlp<B: Backend>(device: &B::Device) -> Mlp<B> {
    Mlp::new(FEATURES, 32, CLASSES, device)
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

fn to_tensors<B: Backend>(
    (x, y): (Vec<f32>, Vec<i64>),
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let rows = y.len();
    (
        Tensor::from_data(TensorData::new(x, [rows, FEATURES]), device),
        Tensor::from_data(TensorData::new(y, [rows]), device),
    )
}

/// Micro-batch `i` of optimizer step `step`.
fn micro<B: Backend>(
    step: usize,
    i: usize,
    b: usize,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    to_tensors(host_batch((step * 1000 + i) as u64, b), device)
}

/// The `n` micro-batches of `step`, concatenated: one batch of `n·b`.
fn big<B: Backend>(
    step: usize,
    n: usize,
    b: usize,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for i in 0..n {
        let (xi, yi) = host_batch((step * 1000 + i) as u64, b);
        x.extend(xi);
        y.extend(yi);
    }
    to_tensors((x, y), device)
}

fn params<B: Backend, M: Module<B>>(module: &M) -> Vec<f32> {
    struct Values(Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().cast(FloatDType::F32).into_data();
            self.0.extend(data.to_vec::<f32>().unwrap());
        }
    }
    let mut v = Values(Vec::new());
    module.visit(&mut v);
    v.0
}

fn bits<B: Backend, M: Module<B>>(module: &M) -> Vec<u32> {
    params(module).into_iter().map(f32::to_bits).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn ids<B: Backend, M: Module<B>>(module: &M) -> HashSet<ParamId> {
    struct Ids(HashSet<ParamId>);
    impl<B: Backend> ModuleVisitor<B> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.insert(param.id);
        }
    }
    let mut v = Ids(HashSet::new());
    module.visit(&mut v);
    v.0
}

const N: usize = 4;
const MICRO: usize = 8;

/// Three optimizer steps, once on batches of N·b, once as N micro-batches of b through the
/// wrapper: the parameters agree within `tol`.
fn equivalence<B, O>(make: impl Fn() -> O, lr: f64, tol: f32) -> f32
where
    B: AutodiffBackend,
    O: Optimizer<Mlp<B>, B>,
{
    let device = Default::default();
    B::seed(&device, 7);
    let init = mlp::<B>(&device);

    let mut optim = make();
    let mut one = init.clone();
    for step in 0..3 {
        let grads =
            GradientsParams::from_grads(one.batch_loss(big(step, N, MICRO, &device)).backward(), &one);
        one = optim.step(lr, one, grads);
    }

    let mut accum = GradientAccumulation::new(make(), N).unwrap();
    let mut many = init.clone();
    for step in 0..3 {
        for i in 0..N {
            let grads = GradientsParams::from_grads(
                many.batch_loss(micro(step, i, MICRO, &device)).backward(),
                &many,
            );
            many = accum.step(lr, many, grads);
        }
    }
    assert_eq!(accum.optimizer_steps(), 3);
    let (a, b) = (params(&one), params(&many));
    let moved = max_abs_diff(&a, &params(&init));
    let err = max_abs_diff(&a, &b);
    assert!(moved > 10.0 * tol, "the run barely moved: {moved}");
    eprintln!("moved {moved:.3e}, N micro-batches vs one batch: {err:.3e}");
    assert!(
        err < tol,
        "N micro-batches differ from one batch of N·b by {err} (tol {tol})"
    );
    err
}

#[test]
fn mean_of_micro_batches_is_one_big_batch_sgd() {
    equivalence::<F, _>(|| SgdConfig::new().init::<F, Mlp<F>>(), 0.5, 1e-6);
}

#[test]
fn mean_of_micro_batches_is_one_big_batch_adam() {
    equivalence::<F, _>(|| AdamConfig::new().init::<F, Mlp<F>>(), 1e-2, 1e-5);
}

#[test]
fn mean_of_micro_batches_is_one_big_batch_under_amp() {
    big_stack(|| {
        // f32 autocast: the same arithmetic as Flex.
        let _g = autocast(Precision::F32);
        equivalence::<A, _>(|| SgdConfig::new().init::<A, Mlp<A>>(), 0.5, 1e-6);
        equivalence::<A, _>(|| AdamConfig::new().init::<A, Mlp<A>>(), 1e-2, 1e-5);
        // bf16 autocast: the weight gradient of a batch of N·b is one bf16 matmul, that of
        // N micro-batches N matmuls summed in f32: equal up to bf16 rounding.
        let _g = autocast(Precision::Bf16);
        equivalence::<A, _>(|| SgdConfig::new().init::<A, Mlp<A>>(), 0.5, 2e-3);
    });
}

#[test]
fn sum_reduction_is_burns_gradients_accumulator() {
    let device = Default::default();
    F::seed(&device, 8);
    let init = mlp::<F>(&device);

    let mut reference = init.clone();
    let mut optim = SgdConfig::new().init::<F, Mlp<F>>();
    for step in 0..2 {
        let mut acc = GradientsAccumulator::new();
        for i in 0..N {
            let grads = GradientsParams::from_grads(
                reference.batch_loss(micro(step, i, MICRO, &device)).backward(),
                &reference,
            );
            acc.accumulate(&reference, grads);
        }
        reference = optim.step(0.1, reference, acc.grads());
    }

    let mut accum = GradientAccumulationConfig::new(N)
        .with_reduction(Reduction::Sum)
        .init(SgdConfig::new().init::<F, Mlp<F>>())
        .unwrap();
    let mut model = init.clone();
    for step in 0..2 {
        for i in 0..N {
            let grads = GradientsParams::from_grads(
                model.batch_loss(micro(step, i, MICRO, &device)).backward(),
                &model,
            );
            model = accum.step(0.1, model, grads);
        }
    }
    assert_eq!(
        bits(&model),
        bits(&reference),
        "sum differs from Burn's accumulator"
    );
}

#[test]
fn zero_micro_batches_and_bad_clipping_are_errors() {
    let sgd = || SgdConfig::new().init::<F, Mlp<F>>();
    assert!(matches!(
        GradientAccumulationConfig::new(0).init::<F, _>(sgd()),
        Err(AccumulationError::ZeroMicroBatches)
    ));
    assert!(matches!(
        GradientAccumulation::<_, F>::new(sgd(), 0),
        Err(AccumulationError::ZeroMicroBatches)
    ));
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(
            GradientAccumulationConfig::new(2)
                .with_max_grad_norm(Some(bad))
                .init::<F, _>(sgd()),
            Err(AccumulationError::InvalidMaxGradNorm(_))
        ));
    }
    let scheduler = ExponentialLrSchedulerConfig::new(1.0, 0.5).init().unwrap();
    assert!(matches!(
        WindowedLrScheduler::new(scheduler, 0),
        Err(AccumulationError::ZeroMicroBatches)
    ));
    let msg = AccumulationError::ZeroMicroBatches.to_string();
    assert!(msg.contains("micro_batches >= 1"), "{msg}");
}

#[test]
fn mid_window_steps_leave_the_module_untouched_and_counters_follow() {
    let device = Default::default();
    let mut model = mlp::<F>(&device);
    let mut accum = GradientAccumulation::new(SgdConfig::new().init::<F, Mlp<F>>(), 3).unwrap();
    let mut seen = Vec::new();
    for step in 0..2 {
        for i in 0..3 {
            let before = bits(&model);
            seen.push((
                accum.micro_step(),
                accum.is_boundary(),
                accum.optimizer_steps(),
            ));
            let grads = GradientsParams::from_grads(
                model.batch_loss(micro(step, i, MICRO, &device)).backward(),
                &model,
            );
            model = accum.step(0.1, model, grads);
            if i < 2 {
                assert_eq!(bits(&model), before, "a mid-window call changed the module");
                assert!(accum.buffer_bytes() > 0);
            } else {
                assert_ne!(bits(&model), before, "the boundary did not step");
                assert_eq!(accum.buffer_bytes(), 0);
            }
        }
    }
    assert_eq!(
        seen,
        [
            (0, false, 0),
            (1, false, 0),
            (2, true, 0),
            (0, false, 1),
            (1, false, 1),
            (2, true, 1),
        ]
    );
    assert_eq!(accum.optimizer_steps(), 2);
}

/// Two heads on one trunk; head `b` takes part in some micro-batches only.
#[derive(Module, Debug)]
struct TwoHeads<B: Backend> {
    trunk: Linear<B>,
    a: Linear<B>,
    b: Linear<B>,
}

impl<B: Backend> TwoHeads<B> {
    fn loss(&self, x: Tensor<B, 2>, use_b: bool) -> Tensor<B, 1> {
        let h = self.trunk.forward(x).tanh();
        let mut out = self.a.forward(h.clone()).powi_scalar(2).mean();
        if use_b {
            out = out + self.b.forward(h).powi_scalar(2).mean();
        }
        out
    }
}

#[test]
fn a_param_missing_a_grad_in_some_micro_steps_is_still_divided_by_n() {
    let device = Default::default();
    F::seed(&device, 9);
    let model = TwoHeads::<F> {
        trunk: LinearConfig::new(FEATURES, 16).init(&device),
        a: LinearConfig::new(16, 4).init(&device),
        b: LinearConfig::new(16, 4).init(&device),
    };
    let record = model.clone().into_record();
    let mut model = model.load_record(record);
    let before = model.clone();
    let uses_b = [true, false, true, false];
    let lr = 0.5;

    // The expected update of head b's weight: -lr × (g0 + g2) / N, computed by hand.
    let mut expected_b = Tensor::<Flex, 2>::zeros(model.b.weight.dims(), &device);
    let mut accum =
        GradientAccumulation::new(SgdConfig::new().init::<F, TwoHeads<F>>(), N).unwrap();
    for (i, &use_b) in uses_b.iter().enumerate() {
        let (x, _) = micro::<F>(0, i, MICRO, &device);
        let grads = GradientsParams::from_grads(model.loss(x, use_b).backward(), &model);
        match grads.get::<Flex, 2>(model.b.weight.id) {
            Some(g) => {
                assert!(use_b);
                expected_b = expected_b + g;
            }
            None => assert!(!use_b, "head b got a gradient without taking part"),
        }
        model = accum.step(lr, model, grads);
    }
    let expected_b = before.b.weight.val().inner() - expected_b.mul_scalar(lr / N as f64);
    let got = model
        .b
        .weight
        .val()
        .inner()
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let expected = expected_b.into_data().to_vec::<f32>().unwrap();
    let err = max_abs_diff(&got, &expected);
    assert!(err < 1e-6, "head b: {err}");
    assert_ne!(bits(&model.a), bits(&before.a));
}

/// Casts every float parameter to f16, trainable.
struct ToF16;

impl<B: Backend> ModuleMapper<B> for ToF16 {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor = tensor
            .set_require_grad(false)
            .cast(FloatDType::F16)
            .require_grad();
        Param::from_mapped_value(id, tensor, mapper)
    }
}

#[test]
fn half_precision_gradients_are_summed_in_f32() {
    let device = Default::default();
    F::seed(&device, 17);
    let layer = LinearConfig::new(FEATURES, CLASSES).init::<F>(&device);
    let record = layer.clone().into_record();
    let layer = layer.load_record(record).map(&mut ToF16);
    let loss = |l: &Linear<F>, i: usize| {
        let (x, _) = micro::<F>(0, i, MICRO, &device);
        l.forward(x.cast(FloatDType::F16)).powi_scalar(2).mean()
    };
    let (w, b) = (layer.weight.id, layer.bias.as_ref().unwrap().id);

    let mut accum = GradientAccumulation::new(SgdConfig::new().init::<F, Linear<F>>(), N).unwrap();
    let (mut sum_w, mut sum_b): (Option<Tensor<Flex, 2>>, Option<Tensor<Flex, 1>>) = (None, None);
    let mut model = layer.clone();
    for i in 0..N {
        let grads = GradientsParams::from_grads(loss(&model, i).backward(), &model);
        let (gw, gb) = (
            grads.get::<Flex, 2>(w).unwrap(),
            grads.get::<Flex, 1>(b).unwrap(),
        );
        assert_eq!(gw.dtype(), DType::F16);
        // The reference, in the wrapper's order: acc + g·(1/N), in f32.
        let g = gw.cast(FloatDType::F32).mul_scalar(1.0 / N as f32);
        sum_w = Some(sum_w.map_or(g.clone(), |a| a + g));
        let g = gb.cast(FloatDType::F32).mul_scalar(1.0 / N as f32);
        sum_b = Some(sum_b.map_or(g.clone(), |a| a + g));
        model = accum.step(0.5, model, grads);
        if i == 0 {
            assert_eq!(
                accum.buffer_bytes(),
                4 * model.num_params(),
                "the buffers are f32, whatever the gradients"
            );
        }
    }
    let mut reference_grads = GradientsParams::new();
    reference_grads.register::<Flex, 2>(w, sum_w.unwrap().cast(FloatDType::F16));
    reference_grads.register::<Flex, 1>(b, sum_b.unwrap().cast(FloatDType::F16));
    let reference =
        SgdConfig::new()
            .init::<F, Linear<F>>()
            .step(0.5, layer.clone(), reference_grads);
    assert_eq!(model.weight.dtype(), DType::F16);
    assert_eq!(bits(&model), bits(&reference));
    assert_ne!(bits(&model), bits(&layer));
}

#[test]
fn a_param_frozen_mid_window_drops_its_partial_sum() {
    let device = Default::default();
    F::seed(&device, 10);
    let init = mlp::<F>(&device);

    // Reference: nothing frozen.
    let mut reference = init.clone();
    let mut accum = GradientAccumulation::new(AdamConfig::new().init::<F, Mlp<F>>(), N).unwrap();
    for i in 0..N {
        let grads = GradientsParams::from_grads(
            reference.batch_loss(micro(0, i, MICRO, &device)).backward(),
            &reference,
        );
        reference = accum.step(1e-2, reference, grads);
    }

    // l1 frozen after two micro-steps.
    let mut model = init.clone();
    let mut accum = GradientAccumulation::new(AdamConfig::new().init::<F, Mlp<F>>(), N).unwrap();
    for i in 0..N {
        if i == 2 {
            model.l1 = model.l1.no_grad();
        }
        let grads =
            GradientsParams::from_grads(model.batch_loss(micro(0, i, MICRO, &device)).backward(), &model);
        model = accum.step(1e-2, model, grads);
    }
    assert_eq!(
        bits(&model.l1),
        bits(&init.l1),
        "a frozen layer was updated"
    );
    assert_eq!(
        bits(&model.l2),
        bits(&reference.l2),
        "the trainable layer differs"
    );
    let state: HashSet<ParamId> = accum.inner().to_record().keys().copied().collect();
    assert_eq!(state, ids(&model.l2), "optimizer state only for l2");
}

#[test]
fn clipping_bounds_the_global_norm_of_the_window() {
    let device = Default::default();
    F::seed(&device, 11);
    let init = mlp::<F>(&device);
    let max_norm = 0.01;
    let mut accum = GradientAccumulationConfig::new(N)
        .with_max_grad_norm(Some(max_norm))
        .init(SgdConfig::new().init::<F, Mlp<F>>())
        .unwrap();
    let mut model = init.clone();
    for i in 0..N {
        let grads =
            GradientsParams::from_grads(model.batch_loss(micro(0, i, MICRO, &device)).backward(), &model);
        model = accum.step(1.0, model, grads);
    }
    // SGD with lr 1: the update is the clipped gradient.
    let norm = params(&model)
        .iter()
        .zip(params(&init))
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!((norm - max_norm as f64).abs() < 1e-5, "update norm {norm}");
}

#[test]
fn the_windowed_scheduler_advances_once_per_window() {
    let inner = ExponentialLrSchedulerConfig::new(1.0, 0.5).init().unwrap();
    let mut scheduler = WindowedLrScheduler::new(inner, 3).unwrap();
    let lrs: Vec<f64> = (0..9).map(|_| scheduler.step()).collect();
    assert_eq!(lrs, [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25]);

    // Saved mid-window, it resumes in step.
    let mut a = WindowedLrScheduler::new(
        ExponentialLrSchedulerConfig::new(1.0, 0.5).init().unwrap(),
        3,
    )
    .unwrap();
    a.step();
    a.step();
    let record = a.to_record::<Flex>();
    let mut b = WindowedLrScheduler::new(
        ExponentialLrSchedulerConfig::new(1.0, 0.5).init().unwrap(),
        3,
    )
    .unwrap()
    .load_record::<Flex>(record);
    let rest_a: Vec<f64> = (0..4).map(|_| a.step()).collect();
    let rest_b: Vec<f64> = (0..4).map(|_| b.step()).collect();
    assert_eq!(rest_a, rest_b);
    assert_eq!(rest_a, [1.0, 0.5, 0.5, 0.5]);
}

// ---------------------------------------------------------------- loss scaling (f16)

type Inner = <A as AutodiffBackend>::InnerBackend;

fn scaler(init_scale: f32, growth_interval: u32) -> GradScaler<A> {
    GradScalerConfig::new()
        .with_init_scale(init_scale)
        .with_growth_interval(growth_interval)
        .init::<A>(&Default::default(), Precision::F16)
        .unwrap()
}

/// The scaled gradients of micro-batch `(step, i)`, with NaN in l2's weight when `poison`.
fn scaled_grads(
    model: &Mlp<A>,
    scaler: &GradScaler<A>,
    step: usize,
    i: usize,
    poison: bool,
) -> GradientsParams {
    let loss = model.batch_loss(micro(step, i, MICRO, &Default::default()));
    let mut grads = GradientsParams::from_grads(scaler.scale(loss).backward(), model);
    if poison {
        let id = model.l2.weight.id;
        let g = grads.remove::<Inner, 2>(id).unwrap();
        grads.register::<Inner, 2>(id, g.mul_scalar(f32::NAN));
    }
    grads
}

/// Three windows of N; micro-step 2 of window 1 overflows.
fn overflow_skips_the_window_once(fused: bool) {
    big_stack(move || {
        let device = Default::default();
        let _g = autocast(Precision::F16);
        A::seed(&device, 12);
        let mut model = mlp::<A>(&device);
        let mut scaler = scaler(1024.0, 1000);
        let fused_adamw = FusedAdamWConfig::new().init::<A, Mlp<A>>().unwrap();
        let mut accum_fused = GradientAccumulation::new(fused_adamw, N).unwrap();
        let mut accum =
            GradientAccumulation::new(AdamConfig::new().init::<A, Mlp<A>>(), N).unwrap();
        let mut skipped = Vec::new();
        let mut scales = Vec::new();
        for window in 0..3 {
            let before = bits(&model);
            for i in 0..N {
                let grads = scaled_grads(&model, &scaler, window, i, window == 1 && i == 2);
                let (m, report) = if fused {
                    scaler.step(&mut accum_fused, 1e-2, model, grads).unwrap()
                } else {
                    scaler.step(&mut accum, 1e-2, model, grads).unwrap()
                };
                model = m;
                scaler.update().unwrap();
                assert_eq!(
                    !report.accumulated(),
                    i == N - 1,
                    "an optimizer step only at the boundary"
                );
                assert_eq!(scaler.stage(), Stage::Ready);
                if !report.accumulated() && report.skipped() {
                    skipped.push(window);
                }
            }
            scales.push(scaler.scale_value());
            if window == 1 {
                assert_eq!(
                    bits(&model),
                    before,
                    "the overflowing window changed the model"
                );
            } else {
                assert_ne!(bits(&model), before, "a clean window did not step");
            }
        }
        assert_eq!(skipped, [1], "exactly the overflowing window is skipped");
        assert_eq!(scales, [1024.0, 512.0, 512.0], "one back-off, once");
    });
}

#[test]
fn an_overflow_in_one_micro_step_skips_the_whole_window_once() {
    overflow_skips_the_window_once(false);
}

#[test]
fn an_overflow_in_one_micro_step_skips_the_whole_window_once_fused() {
    overflow_skips_the_window_once(true);
}

#[test]
fn scaled_windows_unscale_before_clipping() {
    big_stack(|| {
        let device = Default::default();
        let _g = autocast(Precision::F16);
        A::seed(&device, 13);
        let init = mlp::<A>(&device);
        let mut model = init.clone();
        let mut scaler = scaler(1024.0, 1000);
        let max_norm = 0.01;
        let mut accum = GradientAccumulationConfig::new(N)
            .with_max_grad_norm(Some(max_norm))
            .init(SgdConfig::new().init::<A, Mlp<A>>())
            .unwrap();
        for i in 0..N {
            let grads = scaled_grads(&model, &scaler, 0, i, false);
            model = scaler.step(&mut accum, 1.0, model, grads).unwrap().0;
            scaler.update().unwrap();
        }
        let norm = params(&model)
            .iter()
            .zip(params(&init))
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        // Clipping the still-scaled sum would give max_norm / 1024.
        assert!((norm - max_norm as f64).abs() < 1e-4, "update norm {norm}");
    });
}

#[test]
fn touching_the_scaler_mid_window_is_a_typed_error() {
    big_stack(|| {
        let device = Default::default();
        let _g = autocast(Precision::F16);
        let mut model = mlp::<A>(&device);
        let mut scaler = scaler(1024.0, 1000);
        let mut accum =
            GradientAccumulation::new(AdamConfig::new().init::<A, Mlp<A>>(), N).unwrap();

        let grads = scaled_grads(&model, &scaler, 0, 0, false);
        model = scaler.step(&mut accum, 1e-2, model, grads).unwrap().0;
        scaler.update().unwrap();

        // unscale() mid-window.
        let mut grads = scaled_grads(&model, &scaler, 0, 1, false);
        let mut probe = scaler.clone();
        probe.unscale(&model, &mut grads).unwrap();
        let err = probe
            .step(&mut accum, 1e-2, model.clone(), grads)
            .map(|_| ())
            .unwrap_err();
        assert_eq!(
            err,
            ScalerError::Accumulation(AccumulationError::ScalerNotReady {
                stage: Stage::Unscaled
            })
        );

        // A whole step + update elsewhere mid-window: the scale may have changed.
        let mut probe = scaler.clone();
        let mut other = AdamConfig::new().init::<A, Mlp<A>>();
        let grads = scaled_grads(&model, &probe, 0, 1, false);
        let (m, _) = probe.step(&mut other, 1e-2, model.clone(), grads).unwrap();
        probe.update().unwrap();
        let grads = scaled_grads(&m, &probe, 0, 1, false);
        let err = probe
            .step(&mut accum, 1e-2, model.clone(), grads)
            .map(|_| ())
            .unwrap_err();
        assert_eq!(
            err,
            ScalerError::Accumulation(AccumulationError::ScaleChangedMidWindow { micro_step: 1 })
        );
        assert!(err.to_string().contains("discard_window"));

        // An unscaled step in a scaled window.
        let grads = scaled_grads(&model, &scaler, 0, 1, false);
        let err = accum
            .try_step(1e-2, model.clone(), grads)
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(err, AccumulationError::MixedScaling { .. }),
            "{err:?}"
        );

        // The window is intact: it finishes normally with the untouched scaler.
        assert_eq!(accum.micro_step(), 1);
        for i in 1..N {
            let grads = scaled_grads(&model, &scaler, 0, i, false);
            let (m, report) = scaler.step(&mut accum, 1e-2, model, grads).unwrap();
            model = m;
            scaler.update().unwrap();
            assert_eq!(!report.accumulated(), i == N - 1);
        }
        assert_eq!(accum.optimizer_steps(), 1);

        // And a discarded window starts over.
        let grads = scaled_grads(&model, &scaler, 1, 0, false);
        model = scaler.step(&mut accum, 1e-2, model, grads).unwrap().0;
        scaler.update().unwrap();
        accum.discard_window();
        assert_eq!((accum.micro_step(), accum.buffer_bytes()), (0, 0));
        let grads = scaled_grads(&model, &scaler, 1, 0, false);
        assert!(accum.try_step(1e-2, model, grads).is_ok());
    });
}

// ---------------------------------------------------------------- save and resume

const WINDOWS: usize = 3;

/// Micro-steps `range` (numbered over the whole run) of unscaled training.
fn run_plain(
    mut model: Mlp<F>,
    accum: &mut GradientAccumulation<impl Optimizer<Mlp<F>, F>, F>,
    range: std::ops::Range<usize>,
) -> Mlp<F> {
    let device = Default::default();
    for k in range {
        let grads = GradientsParams::from_grads(
            model.batch_loss(micro(k / N, k % N, MICRO, &device)).backward(),
            &model,
        );
        model = accum.step(1e-2, model, grads);
    }
    model
}

#[test]
fn resume_after_micro_step_k_is_bit_identical() {
    let device = Default::default();
    F::seed(&device, 14);
    let init = mlp::<F>(&device);
    let make = || GradientAccumulation::new(AdamConfig::new().init::<F, Mlp<F>>(), N).unwrap();
    let total = WINDOWS * N;

    let mut accum = make();
    let straight = run_plain(init.clone(), &mut accum, 0..total);

    for stop in [1, N + 2, 2 * N - 1] {
        let mut accum = make();
        let half = run_plain(init.clone(), &mut accum, 0..stop);
        let model_bytes = common::save::<F, _>(half.into_record());
        let accum_bytes = common::save::<F, _>(Optimizer::<Mlp<F>, F>::to_record(&accum));

        let model = mlp::<F>(&device).load_record(common::load::<F, _>(model_bytes, &device));
        let mut accum = Optimizer::<Mlp<F>, F>::load_record(make(), common::load::<F, _>(accum_bytes, &device));
        assert_eq!(accum.micro_step(), stop % N);
        let resumed = run_plain(model, &mut accum, stop..total);
        assert_eq!(
            bits(&resumed),
            bits(&straight),
            "resumed after micro-step {stop}"
        );
        assert_eq!(accum.optimizer_steps(), WINDOWS as u64);
    }
}

/// Micro-steps `range` of f16 loss-scaled training; micro-step 5 (window 1) overflows.
fn run_scaled<O: ScaledStep<Mlp<A>, A>>(
    mut model: Mlp<A>,
    scaler: &mut GradScaler<A>,
    accum: &mut GradientAccumulation<O, A>,
    range: std::ops::Range<usize>,
) -> Mlp<A> {
    for k in range {
        let grads = scaled_grads(&model, scaler, k / N, k % N, k == 5);
        model = scaler.step(accum, 1e-2, model, grads).unwrap().0;
        scaler.update().unwrap();
    }
    model
}

#[test]
fn resume_after_micro_step_k_is_bit_identical_scaled() {
    big_stack(|| {
        let device = Default::default();
        let _g = autocast(Precision::F16);
        A::seed(&device, 15);
        let init = mlp::<A>(&device);
        let make = || GradientAccumulation::new(AdamConfig::new().init::<A, Mlp<A>>(), N).unwrap();
        let total = WINDOWS * N;

        let mut scaler_a = scaler(1024.0, 1);
        let mut accum = make();
        let straight = run_scaled(init.clone(), &mut scaler_a, &mut accum, 0..total);
        let straight_scaler = scaler_a.record();
        // The overflow and the growth moved the scale: the trajectory was exercised.
        assert_eq!(straight_scaler.scale, 1024.0 * 2.0 / 2.0 * 2.0);

        // Stopped inside the overflowing window, after the overflow, and in the last one.
        for stop in [6, 2 * N + 1] {
            let mut scaler_b = scaler(1024.0, 1);
            let mut accum = make();
            let half = run_scaled(init.clone(), &mut scaler_b, &mut accum, 0..stop);
            let model_bytes = common::save::<A, _>(half.into_record());
            let accum_bytes = common::save::<A, _>(Optimizer::<Mlp<A>, A>::to_record(&accum));
            let scaler_bytes = common::save::<A, _>(scaler_b.record());

            let model = mlp::<A>(&device).load_record(common::load::<A, _>(model_bytes, &device));
            let mut accum = Optimizer::<Mlp<A>, A>::load_record(make(), common::load::<A, _>(accum_bytes, &device));
            let scaler_record: GradScalerRecord = common::load::<A, _>(scaler_bytes, &device);
            let mut scaler_b = scaler(1024.0, 1).load_record(scaler_record);
            let resumed = run_scaled(model, &mut scaler_b, &mut accum, stop..total);
            assert_eq!(
                bits(&resumed),
                bits(&straight),
                "resumed after micro-step {stop}"
            );
            assert_eq!(scaler_b.record(), straight_scaler);
        }
    });
}

/// A partial window remembers the loss scale its sums carry: resumed beside a scaler of
/// another scale it refuses the micro-step (nothing accumulated, nothing lost) instead of
/// summing gradients of two scales.
#[test]
fn a_resumed_window_refuses_another_scale() {
    big_stack(|| {
        let device = Default::default();
        let _g = autocast(Precision::F16);
        A::seed(&device, 18);
        let init = mlp::<A>(&device);
        let make = || GradientAccumulation::new(AdamConfig::new().init::<A, Mlp<A>>(), N).unwrap();
        let mut scaler_a = scaler(1024.0, 1000);
        let mut accum = make();
        let model = run_scaled(init, &mut scaler_a, &mut accum, 0..2);
        let record = Optimizer::<Mlp<A>, A>::to_record(&accum);
        assert_eq!(record.window_scale, Some(1024.0));
        let bytes = common::save::<A, _>(record);

        let mut resumed = Optimizer::<Mlp<A>, A>::load_record(make(), common::load::<A, _>(bytes, &device));
        let mut other = scaler(2048.0, 1000);
        let grads = scaled_grads(&model, &other, 0, 2, false);
        let err = other
            .step(&mut resumed, 1e-2, model.clone(), grads)
            .map(|_| ())
            .unwrap_err();
        assert_eq!(
            err,
            ScalerError::Accumulation(AccumulationError::WindowScaleMismatch {
                window_scale: 1024.0,
                scaler_scale: 2048.0
            })
        );
        assert_eq!(resumed.micro_step(), 2, "the refused micro-step added nothing");
        // With the scaler it was saved beside, the window goes on.
        let model = run_scaled(model, &mut scaler_a, &mut resumed, 2..N);
        assert_eq!(resumed.optimizer_steps(), 1);
        let _ = model;
    });
}

#[test]
fn a_record_of_another_window_size_is_refused() {
    let accum = GradientAccumulation::new(SgdConfig::new().init::<F, Mlp<F>>(), 4).unwrap();
    let record = Optimizer::<Mlp<F>, F>::to_record(&accum);
    let other = GradientAccumulation::new(SgdConfig::new().init::<F, Mlp<F>>(), 2).unwrap();
    let err = other
        .try_load_record::<Mlp<F>>(record)
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(
        err,
        AccumulationError::RecordMismatch {
            saved_micro_batches: 4,
            micro_batches: 2,
            ..
        }
    ));
}

// ---------------------------------------------------------------- burn-train's Learner

type Item<B> = (Tensor<B, 2>, Tensor<B, 1, Int>);

impl TrainStep for Mlp<F> {
    type Input = Item<F>;
    type Output = ();

    fn step(&self, item: Item<F>) -> TrainOutput<()> {
        TrainOutput::new(self, self.batch_loss(item).backward(), ())
    }
}

impl InferenceStep for Mlp<Flex> {
    type Input = Item<Flex>;
    type Output = ();

    fn step(&self, _item: Item<Flex>) {}
}

/// Runs `windows` windows through a `Learner` exactly as its training epoch does: per
/// micro-batch, `lr_step`, `train_step`, `optimizer_step`.
fn learner_run<LR: LrScheduler + 'static>(init: Mlp<F>, scheduler: LR, windows: usize) -> Mlp<F> {
    let device = Default::default();
    let accum = GradientAccumulation::new(SgdConfig::new().init::<F, Mlp<F>>(), N).unwrap();
    let mut learner = Learner::new(init, accum, scheduler);
    for step in 0..windows {
        for i in 0..N {
            learner.lr_step();
            let out = learner.train_step(micro(step, i, MICRO, &device));
            learner.optimizer_step(out.grads);
        }
    }
    learner.model()
}

#[test]
fn under_learner_the_windowed_scheduler_counts_optimizer_steps() {
    let device = Default::default();
    F::seed(&device, 16);
    let init = mlp::<F>(&device);
    let schedule = || ExponentialLrSchedulerConfig::new(0.5, 0.5).init().unwrap();

    // Reference: batches of N·b, the schedule stepped once per optimizer step.
    let mut reference = init.clone();
    let mut sgd = SgdConfig::new().init::<F, Mlp<F>>();
    let mut scheduler = schedule();
    for step in 0..3 {
        let grads = GradientsParams::from_grads(
            reference.batch_loss(big(step, N, MICRO, &device)).backward(),
            &reference,
        );
        reference = sgd.step(scheduler.step(), reference, grads);
    }

    let windowed = learner_run(
        init.clone(),
        WindowedLrScheduler::new(schedule(), N).unwrap(),
        3,
    );
    let err = max_abs_diff(&params(&windowed), &params(&reference));
    assert!(
        err < 1e-6,
        "Learner + windowed schedule vs big batches: {err}"
    );

    // The bare schedule advances per micro-batch: the boundary calls see lr × 0.5^(N-1)…
    let bare = learner_run(init, schedule(), 3);
    let off = max_abs_diff(&params(&bare), &params(&reference));
    assert!(off > 1e-3, "the bare schedule should drift: {off}");
}
