//! Unscaled accumulation: N micro-batches are one batch of N·b, sum is Burn's sum, misuse
//! is a typed error, mid-window steps, missing, frozen and half-precision parameters,
//! clipping, the windowed scheduler.

use burn::lr_scheduler::LrScheduler;
use burn::lr_scheduler::exponential::ExponentialLrSchedulerConfig;
use burn::module::ModuleMapper;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsAccumulator, GradientsParams, Optimizer, SgdConfig};
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::accumulate::{
    AccumulationError, GradientAccumulation, GradientAccumulationConfig, Reduction,
    WindowedLrScheduler,
};
use burn_amp::{Precision, autocast};

use super::common::big_stack;
use super::*;

/// Three optimizer steps, once on batches of N·b, once as N micro-batches of b through the
/// wrapper: the parameters agree within `tol`.
fn equivalence<B, O>(make: impl Fn() -> O, lr: f64, tol: f32) -> f32
where
    B: AutodiffBackend,
    O: Optimizer<Mlp<B>, B>,
{
    let device = Default::default();
    let init = seeded_mlp::<B>(7, &device);

    let mut optim = make();
    let mut one = init.clone();
    for step in 0..3 {
        let grads = GradientsParams::from_grads(
            one.batch_loss(big(step, N, MICRO, &device)).backward(),
            &one,
        );
        one = optim.step(lr, one, grads);
    }

    let mut accum = GradientAccumulation::new(make(), N).unwrap();
    let mut many = init.clone();
    for step in 0..3 {
        for i in 0..N {
            let grads = micro_grads(&many, step, i, &device);
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
    let init = seeded_mlp::<F>(8, &device);

    let mut reference = init.clone();
    let mut optim = SgdConfig::new().init::<F, Mlp<F>>();
    for step in 0..2 {
        let mut acc = GradientsAccumulator::new();
        for i in 0..N {
            let grads = micro_grads(&reference, step, i, &device);
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
            let grads = micro_grads(&model, step, i, &device);
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
            let grads = micro_grads(&model, step, i, &device);
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
    let init = seeded_mlp::<F>(10, &device);

    // Reference: nothing frozen.
    let mut reference = init.clone();
    let mut accum = adam_accumulation::<F>();
    for i in 0..N {
        let grads = micro_grads(&reference, 0, i, &device);
        reference = accum.step(1e-2, reference, grads);
    }

    // l1 frozen after two micro-steps.
    let mut model = init.clone();
    let mut accum = adam_accumulation::<F>();
    for i in 0..N {
        if i == 2 {
            model.l1 = model.l1.no_grad();
        }
        let grads = micro_grads(&model, 0, i, &device);
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
    let l2: HashSet<ParamId> = ids(&model.l2).into_iter().collect();
    assert_eq!(state, l2, "optimizer state only for l2");
}

#[test]
fn clipping_bounds_the_global_norm_of_the_window() {
    let device = Default::default();
    let init = seeded_mlp::<F>(11, &device);
    let max_norm = 0.01;
    let mut accum = GradientAccumulationConfig::new(N)
        .with_max_grad_norm(Some(max_norm))
        .init(SgdConfig::new().init::<F, Mlp<F>>())
        .unwrap();
    let mut model = init.clone();
    for i in 0..N {
        let grads = micro_grads(&model, 0, i, &device);
        model = accum.step(1.0, model, grads);
    }
    // SGD with lr 1: the update is the clipped gradient.
    let norm = update_norm(&model, &init);
    assert!((norm - max_norm as f64).abs() < 1e-5, "update norm {norm}");

    // The norm before clipping, as `clip_grad_norm_` returns it: the update of the same
    // window unclipped.
    let reported = accum.last_grad_norm().unwrap().into_scalar().elem::<f32>() as f64;
    let mut unclipped = GradientAccumulation::new(SgdConfig::new().init::<F, Mlp<F>>(), N).unwrap();
    let mut model = init.clone();
    for i in 0..N {
        let grads = micro_grads(&model, 0, i, &device);
        model = unclipped.step(1.0, model, grads);
    }
    let want = update_norm(&model, &init);
    assert_norm_before_clipping(reported, want, max_norm, 1e-5);
    assert!(
        unclipped.last_grad_norm().is_none(),
        "a norm without clipping"
    );
}

#[test]
fn a_tracked_norm_is_the_clippings_and_changes_nothing() {
    let device = Default::default();
    let init = seeded_mlp::<F>(11, &device);
    let run = |config: GradientAccumulationConfig| {
        let mut accum = config.init(SgdConfig::new().init::<F, Mlp<F>>()).unwrap();
        let mut model = init.clone();
        for i in 0..N {
            let grads = micro_grads(&model, 0, i, &device);
            model = accum.step(1.0, model, grads);
        }
        let norm = accum
            .last_grad_norm()
            .map(|n| n.into_scalar().elem::<f32>());
        (model, norm)
    };
    let (plain, none) = run(GradientAccumulationConfig::new(N));
    let (tracked, norm) = run(GradientAccumulationConfig::new(N).with_track_grad_norm(true));
    let (_, clipped) = run(GradientAccumulationConfig::new(N).with_max_grad_norm(Some(0.01)));
    assert_eq!(none, None, "a norm nobody asked for");
    assert_eq!(bits(&tracked), bits(&plain), "tracking changed the step");
    let norm = norm.expect("a tracked norm");
    assert_eq!(
        norm.to_bits(),
        clipped.unwrap().to_bits(),
        "not the clipping's norm"
    );
    // SGD with lr 1: the update is the window's gradient.
    let want = update_norm(&plain, &init);
    assert!(
        (norm as f64 - want).abs() < 1e-5 * want,
        "norm {norm}, want {want}"
    );
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
