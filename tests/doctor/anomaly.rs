use burn::backend::{Autodiff, Flex, Wgpu};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::doctor::{Cause, Phase};
use burn_amp::{Amp, AmpError, Precision, autocast, detect_anomaly, detect_nan};

use crate::common::wgpu_device;

type Above = Amp<Autodiff<Flex>>;
type Below = Autodiff<Amp<Flex>>;

fn tensor<B: Backend, const D: usize>(
    values: &[f32],
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::<B, 1>::from_floats(values, device).reshape(shape)
}

/// A matmul whose f16 result is 300 × 300 = 90000 > 65504, then ops that pass the inf on.
fn overflowing_matmul<B: Backend>(device: &B::Device) -> Tensor<B, 2> {
    let a = tensor::<B, 2>(&[300.0, 1.0, 2.0, 3.0], [2, 2], device);
    let b = tensor::<B, 2>(&[300.0, 0.0, 0.0, 1.0], [2, 2], device);
    let y = a.matmul(b); // the culprit
    (y.clone() + 1.0).mul_scalar(2.0) - y.exp().log() // passed on
}

#[test]
fn f16_matmul_overflow_is_named_with_its_dtype_and_the_callers_line() {
    let device = Default::default();
    let _amp = autocast(Precision::F16);
    let guard = detect_anomaly();
    let out = overflowing_matmul::<Above>(&device);
    let anomaly = guard.report().expect("the overflow is reported");
    assert_eq!(anomaly.op, "float_matmul");
    assert_eq!(anomaly.category, "lower");
    assert_eq!(anomaly.cause, Cause::Op);
    assert_eq!(anomaly.phase, Phase::Forward);
    assert_eq!(anomaly.output.dtype, "F16");
    assert_eq!(anomaly.output.shape, vec![2, 2]);
    assert!(anomaly.inputs.iter().all(|i| i.dtype == "F16"), "{anomaly}");
    assert_eq!(anomaly.values.pos_inf, 1, "{anomaly}");
    let frame = anomaly.user_frame().expect("a frame of the test's code");
    assert!(frame.function.contains("overflowing_matmul"), "{anomaly}");
    assert!(
        frame
            .location
            .as_deref()
            .is_some_and(|l| l.contains("tests/doctor/anomaly.rs")),
        "{anomaly}"
    );
    assert!(anomaly.advice().contains("bf16"), "{}", anomaly.advice());
    // The ops after it saw an inf input: passed on, not blamed.
    assert!(
        guard.ops_passing_it_on() >= 3,
        "{}",
        guard.ops_passing_it_on()
    );
    assert_eq!(guard.ops_creating_it(), 1);
    assert!(matches!(guard.check(), Err(AmpError::Anomaly(_))));
    let text = anomaly.to_string();
    assert!(
        text.contains("float_matmul") && text.contains("f16"),
        "{text}"
    );
    drop(out);
    // bf16 has f32's range: the same ops are healthy.
    let _bf16 = autocast(Precision::Bf16);
    guard.clear();
    let out = {
        let device = Default::default();
        let a = tensor::<Above, 2>(&[300.0, 1.0, 2.0, 3.0], [2, 2], &device);
        let b = tensor::<Above, 2>(&[300.0, 0.0, 0.0, 1.0], [2, 2], &device);
        a.matmul(b)
    };
    assert!(guard.report().is_none(), "{:?}", guard.report());
    drop(out);
}

#[test]
fn autocasts_cast_above_65504_is_the_cause() {
    let device = Default::default();
    let _amp = autocast(Precision::F16);
    let guard = detect_anomaly();
    let x = tensor::<Above, 2>(&[70000.0, 1.0], [1, 2], &device);
    let w = tensor::<Above, 2>(&[1.0, 1.0], [2, 1], &device);
    let _y = x.matmul(w);
    let anomaly = guard.finish().expect("reported");
    assert_eq!(anomaly.op, "float_matmul");
    assert_eq!(
        anomaly.cause,
        Cause::Cast {
            input: 0,
            from: "F32".into(),
            to: "F16".into()
        }
    );
    assert!(anomaly.advice().contains("range"), "{}", anomaly.advice());
}

fn exp_in_f16<B: Backend>(device: &B::Device) -> Tensor<B, 1> {
    // The model computes in f16 itself; autocast is off, so `exp` runs in f16: e^12 > 65504.
    let x = tensor::<B, 1>(&[1.0, 12.0, 2.0], [3], device).cast(burn::tensor::FloatDType::F16);
    x.mul_scalar(1.0).exp().sum()
}

#[test]
fn exp_of_large_activations_in_f16_is_named() {
    let device = Default::default();
    let _off = autocast(Precision::F32);
    let guard = detect_anomaly();
    let _ = exp_in_f16::<Above>(&device);
    let anomaly = guard.finish().expect("reported");
    assert_eq!(anomaly.op, "float_exp");
    assert_eq!(anomaly.output.dtype, "F16");
    assert_eq!(anomaly.values.pos_inf, 1);
    assert!(
        anomaly
            .user_frame()
            .unwrap()
            .function
            .contains("exp_in_f16"),
        "{anomaly}"
    );
}

#[test]
fn log_of_a_negative_is_named_as_not_a_precision_problem() {
    let device = Default::default();
    let _amp = autocast(Precision::Bf16);
    let guard = detect_nan();
    let x = tensor::<Above, 1>(&[1.0, -2.0, 0.0], [3], &device);
    // log(0) = -inf passes under `detect_nan`; log(-2) = NaN is named.
    let _y = x.log().sum();
    let anomaly = guard.finish().expect("reported");
    assert_eq!(anomaly.op, "float_log");
    assert_eq!(anomaly.category, "f32");
    assert_eq!(anomaly.output.dtype, "F32");
    assert_eq!((anomaly.values.nan, anomaly.values.neg_inf), (1, 1));
    assert!(
        anomaly.advice().contains("not a precision problem"),
        "{}",
        anomaly.advice()
    );
}

#[test]
fn a_minus_inf_mask_is_not_an_anomaly_and_a_nan_scalar_is() {
    let device = Default::default();
    let _amp = autocast(Precision::F16);
    let guard = detect_anomaly();
    let scores = tensor::<Above, 2>(&[0.5, 1.0, 2.0, 3.0], [2, 2], &device);
    let mask = scores.clone().lower_elem(0.9);
    let masked = scores.mask_fill(mask, f32::NEG_INFINITY);
    let p = burn::tensor::activation::softmax(masked, 1);
    assert!(guard.report().is_none(), "{:?}", guard.report());
    let _ = p.mul_scalar(f32::NAN);
    let anomaly = guard.finish().expect("reported");
    assert_eq!(anomaly.op, "float_mul_scalar");
    assert_eq!(anomaly.cause, Cause::Scalar);
}

/// 1/x is finite at 1e-20 (1e20), and its gradient -1/x² (-1e40) is not, in f32 too.
fn recip_step<B: AutodiffBackend>(device: &B::Device) -> B::Gradients {
    let x = tensor::<B, 1>(&[1e-20, 1.0, 4.0], [3], device).require_grad();
    x.recip().sum().backward()
}

#[test]
fn a_gradient_overflow_is_named_in_the_backward_pass_below_autodiff() {
    let device = Default::default();
    let _amp = autocast(Precision::Bf16);
    let guard = detect_anomaly();
    let _grads = recip_step::<Below>(&device);
    let anomaly = guard.finish().expect("reported");
    match &anomaly.phase {
        Phase::Backward { of } => assert_eq!(of.as_deref(), Some("float_recip"), "{anomaly}"),
        other => panic!("expected the backward pass, got {other:?}: {anomaly}"),
    }
    assert_eq!(
        anomaly.values.pos_inf + anomaly.values.neg_inf,
        1,
        "{anomaly}"
    );
    // The step that called backward is among the frames.
    assert!(
        anomaly
            .backtrace
            .iter()
            .any(|f| f.function.contains("recip_step")),
        "{anomaly}"
    );
    // The forward pass alone is healthy: above autodiff, `Amp` sees only forward ops.
    let guard = detect_anomaly();
    let _grads = recip_step::<Above>(&device);
    assert!(guard.report().is_none(), "{:?}", guard.report());
}

#[test]
fn a_healthy_step_reports_nothing_and_counts_its_ops() {
    let device = Default::default();
    let _amp = autocast(Precision::F16);
    let guard = detect_anomaly();
    let x = tensor::<Above, 2>(&[0.5, -1.0, 2.0, 3.0], [2, 2], &device).require_grad();
    let y = burn::tensor::activation::gelu(x.clone().matmul(x.clone())).mean();
    let _ = y.backward();
    assert!(guard.report().is_none());
    assert!(guard.ops_checked() >= 3, "{}", guard.ops_checked());
    drop(guard);
    // Off: the ops run unchecked (nothing installed on this thread).
    let _ = overflowing_matmul::<Above>(&device);
}

#[test]
fn wgpu_f16_matmul_overflow_is_named() {
    let Some(device) = wgpu_device() else { return };
    let _amp = autocast(Precision::F16);
    let guard = detect_anomaly();
    let _ = overflowing_matmul::<Amp<Autodiff<Wgpu>>>(&device);
    let anomaly = guard.finish().expect("reported");
    assert_eq!(anomaly.op, "float_matmul");
    assert_eq!(anomaly.output.dtype, "F16");
    assert!(
        anomaly
            .user_frame()
            .unwrap()
            .function
            .contains("overflowing_matmul"),
        "{anomaly}"
    );
    let guard = detect_anomaly();
    let _grads = recip_step::<Autodiff<Amp<Wgpu>>>(&device);
    let anomaly = guard.finish().expect("reported");
    assert!(matches!(anomaly.phase, Phase::Backward { .. }), "{anomaly}");
}

/// A batch read from host data with a NaN in it.
fn batch_with_a_nan<B: Backend>(device: &B::Device) -> Tensor<B, 2> {
    let values = vec![1.0, 2.0, f32::NAN, 4.0, 5.0, 6.0];
    Tensor::from_data(TensorData::new(values, [2, 3]), device)
}

fn weights<B: Backend>(device: &B::Device) -> Tensor<B, 2> {
    Tensor::from_data(TensorData::new(vec![0.5f32; 6], [3, 2]), device)
}

/// Host data holding a NaN, or an additive mask's `-inf`, is nobody's op: not blamed (until
/// 2026-12-05, `float_from_data` was named as having created it), told as where the value
/// came in.
#[test]
fn host_data_holding_nan_or_a_mask_is_entered_not_blamed() {
    let device = Default::default();
    let _amp = autocast(Precision::F16);
    let guard = detect_anomaly();
    let y = batch_with_a_nan::<Above>(&device)
        .matmul(weights(&device))
        .exp();
    assert!(guard.report().is_none(), "{:?}", guard.report());
    assert!(guard.check().is_ok());
    assert_eq!(guard.ops_creating_it(), 0);
    let entered = guard.entered().expect("the NaN's way in is told");
    assert_eq!((entered.op, entered.input), ("float_from_data", None));
    assert_eq!(entered.tensor.shape, vec![2, 3]);
    assert_eq!((entered.values.nan, entered.values.total), (1, 6));
    assert_eq!((entered.step, &entered.phase), (0, &Phase::Forward));
    let frame = entered.user_frame().expect("a frame of the test's code");
    assert!(frame.function.contains("batch_with_a_nan"), "{entered}");
    let text = entered.to_string();
    assert!(text.contains("from host data"), "{text}");
    assert!(entered.advice().contains("batch"), "{}", entered.advice());
    drop(y);

    guard.clear();
    let scores = tensor::<Above, 2>(&[0.5, 1.0, 2.0, 3.0], [2, 2], &device);
    let mask = Tensor::<Above, 2>::from_data(
        TensorData::new(vec![0.0, f32::NEG_INFINITY, 0.0, 0.0], [2, 2]),
        &device,
    );
    let p = burn::tensor::activation::softmax(scores + mask, 1);
    assert_eq!(p.into_data().to_vec::<f32>().unwrap()[1], 0.0);
    assert!(guard.report().is_none(), "{:?}", guard.report());
    let entered = guard.entered().expect("the mask's way in");
    assert_eq!((entered.op, entered.values.neg_inf), ("float_from_data", 1));
}

/// A tensor made where no session runs (a data loader's thread) is met first by the op that
/// reads it: that op, the input and the line are told. Made by a watched op earlier in the
/// step, a value is that op's report, and nothing is told as entered.
#[test]
fn a_value_from_another_thread_is_entered_at_the_op_that_reads_it() {
    let device = Default::default();
    let _amp = autocast(Precision::F16);
    let loaded = || {
        std::thread::spawn(|| batch_with_a_nan::<Above>(&Default::default()))
            .join()
            .unwrap()
    };
    let guard = detect_anomaly();
    let y = loaded().matmul(weights(&device));
    assert!(guard.report().is_none(), "{:?}", guard.report());
    let entered = guard.entered().expect("told");
    assert_eq!((entered.op, entered.input), ("float_matmul", Some(0)));
    assert_eq!(entered.tensor.dtype, "F32", "before autocast's cast");
    assert_eq!(entered.values.nan, 1);
    let frame = entered.user_frame().expect("a frame of the test's code");
    assert!(
        frame.function.contains("a_value_from_another_thread"),
        "{entered}"
    );
    assert!(entered.to_string().contains("in its input 0"), "{entered}");
    drop(y);

    guard.clear();
    let made = tensor::<Above, 1>(&[-1.0, 4.0], [2], &device).log();
    let y = loaded().matmul(weights(&device));
    assert_eq!(guard.report().expect("log of -1").op, "float_log");
    assert!(guard.entered().is_none(), "{:?}", guard.entered());
    drop((made, y));
}

/// A `-inf` mask placed by a watched op, and passed on, does not hide what comes in later in
/// the same step (a transformer masks its scores in every layer): the watched ops' non-finite
/// outputs are told apart by dtype, shape and counts. Until 2026-12-05 evening, a step stopped
/// being traced at its first non-finite value, and this NaN was told nowhere.
fn told_after_a_mask<B: AutodiffBackend>(device: &B::Device) {
    let _amp = autocast(Precision::F16);
    let guard = detect_anomaly();
    let scores = tensor::<B, 2>(&[0.5, 1.0, 2.0, 3.0], [2, 2], device);
    let mask = Tensor::<B, 2, Bool>::from_data(
        TensorData::new(vec![false, true, false, false], [2, 2]),
        device,
    );
    let masked = scores.mask_fill(mask, f32::NEG_INFINITY);
    // Passed on twice (the mask's -inf, then the same -inf shifted): both are the mask's.
    let shifted = (masked + 1.0).mul_scalar(0.5);
    let p = burn::tensor::activation::softmax(shifted, 1);
    assert_eq!(p.clone().into_data().to_vec::<f32>().unwrap()[1], 0.0);
    assert!(guard.entered().is_none(), "{:?}", guard.entered());
    assert!(
        guard.ops_passing_it_on() >= 3,
        "{}",
        guard.ops_passing_it_on()
    );
    let on = device.clone();
    let loaded = std::thread::spawn(move || batch_with_a_nan::<B>(&on))
        .join()
        .unwrap();
    let y = loaded.matmul(weights(device)).sum() + p.sum();
    assert!(guard.report().is_none(), "{:?}", guard.report());
    let entered = guard.entered().expect("the loader's NaN, after the mask");
    assert_eq!(
        (entered.op, entered.input, entered.step),
        ("float_matmul", Some(0), 0),
        "{entered}"
    );
    assert_eq!(
        (entered.values.nan, entered.tensor.shape.as_slice()),
        (1, &[2, 3][..])
    );
    drop(y);
}

#[test]
fn a_value_from_outside_is_told_after_a_mask_in_the_same_step() {
    told_after_a_mask::<Above>(&Default::default());
}

#[test]
fn a_value_from_outside_is_told_after_a_mask_in_the_same_step_wgpu() {
    let Some(device) = wgpu_device() else { return };
    told_after_a_mask::<Amp<Autodiff<Wgpu>>>(&device);
}

/// What was met in one step does not hide what comes in at the next: a `-inf` mask placed at
/// step 0, a NaN batch from a loader at step 1, told at step 1 (steps counted by
/// `AmpOptimizer`).
#[test]
fn each_step_tells_what_came_in() {
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{GradientsParams, Optimizer, SgdConfig};
    use burn_amp::AmpOptimizer;
    use burn_amp::scaler::GradScalerConfig;

    let _turn = crate::serial();
    let device = Default::default();
    let _amp = autocast(Precision::F16);
    let mut model: Linear<Above> = LinearConfig::new(3, 2).init(&device);
    let sgd = SgdConfig::new().init::<Above, Linear<Above>>();
    let mut optim = AmpOptimizer::new(sgd, GradScalerConfig::new()).expect("one optimizer");
    let guard = detect_anomaly();
    let clean = tensor::<Above, 2>(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], &device);
    let scores = model.forward(clean.clone());
    let mask = TensorData::new(vec![false, true, false, false], [2, 2]);
    let masked = scores.mask_fill(
        Tensor::<Above, 2, Bool>::from_data(mask, &device),
        f32::NEG_INFINITY,
    );
    let loss = burn::tensor::activation::softmax(masked, 1).sum() + model.forward(clean).sum();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    model = optim.step(1e-3, model, grads);
    assert!(guard.entered().is_none(), "{:?}", guard.entered());
    assert!(guard.ops_passing_it_on() >= 1, "the mask was met at step 0");

    let batch = std::thread::spawn(|| batch_with_a_nan::<Above>(&Default::default()))
        .join()
        .unwrap();
    let y = model.forward(batch);
    assert!(guard.report().is_none(), "{:?}", guard.report());
    let entered = guard.entered().expect("told at step 1");
    assert_eq!((entered.step, entered.input), (1, Some(0)), "{entered}");
    assert_eq!(entered.op, "linear");
    drop(y);
}

/// A parameter of its own, for a loss that differentiates to inf.
#[derive(burn::module::Module, Debug)]
struct Roots<B: Backend> {
    x: burn::module::Param<Tensor<B, 1>>,
}

/// Above autodiff the backward runs below `Amp`, unseen: `sqrt`'s gradient at 0 is inf, made
/// by no watched op. The forward is finite; a plain optimizer (no loss scaler to skip the
/// step) reads the gradient through watched ops: told as where it came in.
#[test]
fn an_inf_gradient_from_the_backward_above_amp_is_told_where_it_is_read() {
    use burn::optim::{GradientsParams, Optimizer, SgdConfig};

    let device = Default::default();
    let _amp = autocast(Precision::Bf16);
    let model = Roots {
        x: burn::module::Param::from_tensor(tensor::<Above, 1>(&[0.0, 1.0, 4.0], [3], &device)),
    };
    let mut sgd = SgdConfig::new().init::<Above, Roots<Above>>();
    let guard = detect_anomaly();
    let loss = model.x.val().sqrt().sum();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    assert!(guard.entered().is_none(), "the forward is finite");
    let model = sgd.step(1e-3, model, grads);
    assert!(guard.report().is_none(), "{:?}", guard.report());
    let entered = guard.entered().expect("the gradient's way in");
    eprintln!("{entered}");
    assert_eq!(entered.tensor.shape, vec![3], "{entered}");
    assert!(entered.input.is_some(), "{entered}");
    assert_eq!(entered.values.pos_inf, 1, "{entered}");
    assert_eq!(
        model.x.val().into_data().to_vec::<f32>().unwrap()[0],
        f32::NEG_INFINITY,
        "a plain optimizer applies the step"
    );
}
