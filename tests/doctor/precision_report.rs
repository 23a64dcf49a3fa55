use burn::backend::{Autodiff, Flex, Wgpu};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::doctor::{OpPrecision, Suggestion};
use burn_amp::{Amp, AmpError, AmpOptimizer, Precision, PrecisionReport};

use crate::common::tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};
use crate::common::wgpu_device;
use crate::serial;

fn tiny_lm<B: AutodiffBackend>(
    device: &B::Device,
) -> (TinyLm<B>, Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    B::seed(device, 7);
    let config = TinyLmConfig::new();
    let model = config.init::<B>(device);
    let (x, y) = ReversalTask::new(config.vocab, config.seq_len, 7).batch::<B>(8, device);
    (model, x, y)
}

/// A matmul of nearly equal large values against (1, -1): 1000.1 − 1000 = 0.1 in f32 and 0
/// in f16 (its spacing at 1000 is 0.5). Catastrophic cancellation: a relative error of 1.
fn planted_cancellation<B: Backend>(device: &B::Device) -> Tensor<B, 1> {
    let a = Tensor::<B, 1>::from_floats([1000.1, 1000.0, 2000.3, 2000.0], device).reshape([2, 2]);
    let b = Tensor::<B, 1>::from_floats([1.0, -1.0], device).reshape([2, 1]);
    a.matmul(b).mean()
}

fn assert_ranked(worst: &[&OpPrecision]) {
    let key = |o: &OpPrecision| o.overflow + o.underflow + o.own_error.unwrap_or(0.0);
    for pair in worst.windows(2) {
        assert!(key(pair[0]) >= key(pair[1]), "{pair:?}");
    }
}

#[test]
fn tiny_lm_ops_are_ranked_and_a_planted_cancellation_is_the_worst() {
    let _turn = serial();
    type B = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let (model, x, y) = tiny_lm::<B>(&device);
    let report = PrecisionReport::measure(&model, Precision::F16, 1024.0, |m: &TinyLm<B>| {
        m.loss(x.clone(), y.clone()) + planted_cancellation::<B>(&device).mul_scalar(1e-3)
    })
    .unwrap();
    assert_eq!(report.diverged_at, None, "{}", report.table(10));
    assert!(report.ops.len() > 50, "{}", report.ops.len());
    // The loss moves by f16's rounding, not more.
    let rel = ((report.loss - report.loss_f32) / report.loss_f32).abs();
    assert!(rel < 1e-2, "{rel}");
    let worst = report.worst(5);
    assert_ranked(&worst);
    let top = worst[0];
    assert_eq!(
        (top.op, top.dtype.as_str(), top.shape.as_slice()),
        ("float_matmul", "F16", &[2, 1][..]),
        "{}",
        report.table(10)
    );
    assert!(top.own_error.unwrap() > 0.5, "{top:?}");
    assert_eq!(top.suggestion, Suggestion::KeepInF32);
    // The model's own lowered ops lose about f16's rounding (2^-11 relative) each.
    let linears: Vec<&OpPrecision> = report.ops.iter().filter(|o| o.op == "linear").collect();
    assert!(!linears.is_empty());
    for o in &linears {
        let own = o.own_error.expect("linear runs in f16");
        assert!(own > 0.0 && own < 5e-3, "{o:?}");
        assert_eq!(o.suggestion, Suggestion::Fine, "{o:?}");
    }
    // f32 ops ran in f32: nothing of their own to lose, and their error is inherited.
    let softmax = report
        .ops
        .iter()
        .find(|o| o.op == "softmax")
        .expect("attention's softmax");
    assert_eq!((softmax.dtype.as_str(), softmax.own_error), ("F32", None));
    assert!(softmax.error.unwrap() < 1e-2, "{softmax:?}");
    // Every trainable parameter's gradient, named by its path.
    assert_eq!(
        report.gradients.len(),
        burn::module::Module::num_params(&model).min(report.gradients.len())
    );
    assert!(
        report
            .gradients
            .iter()
            .any(|g| g.parameter == "head.weight"),
        "{:?}",
        report
            .gradients
            .iter()
            .map(|g| &g.parameter)
            .collect::<Vec<_>>()
    );
    // Against the f32 gradients, where they are not ~0 (LayerNorm cancels the conv's bias:
    // its gradient is rounding noise in both runs).
    let largest = report.gradients.iter().map(|g| g.norm).fold(0.0, f64::max);
    for g in report.gradients.iter().filter(|g| g.norm > 1e-4 * largest) {
        assert!(g.error < 2e-2, "{g:?}");
    }
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    assert_eq!(json["precision"], "F16");
    assert_eq!(json["ops"].as_array().unwrap().len(), report.ops.len());
    let table = report.table(5);
    assert!(
        table.contains("| float_matmul (lower) | 9") && table.contains("| gradient |"),
        "{table}"
    );
}

#[test]
fn gradient_underflow_follows_the_loss_scale() {
    let _turn = serial();
    type B = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let (model, x, y) = tiny_lm::<B>(&device);
    let loss = |m: &TinyLm<B>| m.loss(x.clone(), y.clone()).mul_scalar(1e-4);
    let unscaled = PrecisionReport::measure(&model, Precision::F16, 1.0, loss).unwrap();
    let scaled = PrecisionReport::measure(&model, Precision::F16, 65536.0, loss).unwrap();
    let under = |r: &PrecisionReport| {
        r.gradients
            .iter()
            .map(|g| g.underflow_at_scale)
            .sum::<f64>()
    };
    let measured = |r: &PrecisionReport| r.gradients.iter().map(|g| g.underflow).sum::<f64>();
    assert!(under(&unscaled) > 0.0, "{}", unscaled.table(20));
    assert!(
        under(&scaled) < under(&unscaled) / 10.0,
        "{} vs {}",
        under(&scaled),
        under(&unscaled)
    );
    assert!(
        measured(&scaled) <= measured(&unscaled),
        "{} vs {}",
        measured(&scaled),
        measured(&unscaled)
    );
    assert!(
        unscaled
            .gradients
            .iter()
            .any(|g| g.suggestion == Suggestion::RaiseLossScale),
        "{}",
        unscaled.table(20)
    );
    // bf16 has f32's range: nothing underflows at scale 1.
    let bf16 = PrecisionReport::measure(&model, Precision::Bf16, 1.0, loss).unwrap();
    assert_eq!(bf16.loss_scale, 1.0);
    assert_eq!(under(&bf16), 0.0);
}

#[test]
fn below_autodiff_the_backward_ops_are_compared_too() {
    let _turn = serial();
    let device = Default::default();
    let above = {
        type B = Amp<Autodiff<Flex>>;
        let (model, x, y) = tiny_lm::<B>(&device);
        PrecisionReport::measure(&model, Precision::Bf16, 1.0, |m: &TinyLm<B>| {
            m.loss(x.clone(), y.clone())
        })
        .unwrap()
    };
    type B = Autodiff<Amp<Flex>>;
    let (model, x, y) = tiny_lm::<B>(&device);
    let below = PrecisionReport::measure(&model, Precision::Bf16, 1.0, |m: &TinyLm<B>| {
        m.loss(x.clone(), y.clone())
    })
    .unwrap();
    assert_eq!(below.diverged_at, None);
    assert!(
        below.ops.len() > above.ops.len() + 20,
        "{} vs {}",
        below.ops.len(),
        above.ops.len()
    );
    assert!(
        below.ops.iter().any(|o| o.op.ends_with("_backward")),
        "{}",
        below.table(10)
    );
    assert_ranked(&below.worst(10));
    let rel = ((below.loss - above.loss) / above.loss).abs();
    assert!(rel < 1e-2, "{} vs {}", below.loss, above.loss);
}

#[test]
fn an_installed_amp_optimizer_is_refused() {
    let _turn = serial();
    type B = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let (model, x, y) = tiny_lm::<B>(&device);
    let optim = AmpOptimizer::<_, B>::new(
        burn_amp::optim::FusedAdamWConfig::new()
            .init::<B, TinyLm<B>>()
            .unwrap(),
        burn_amp::scaler::GradScalerConfig::new(),
    )
    .unwrap();
    let refused = PrecisionReport::measure(&model, Precision::F16, 1.0, |m: &TinyLm<B>| {
        m.loss(x.clone(), y.clone())
    });
    assert_eq!(refused.unwrap_err(), AmpError::ReportUnderOptimizer);
    drop(optim);
}

#[test]
fn wgpu_f16_report_names_the_planted_matmul() {
    let Some(device) = wgpu_device() else { return };
    let _turn = serial();
    type B = Amp<Autodiff<Wgpu>>;
    let (model, x, y) = tiny_lm::<B>(&device);
    let report = PrecisionReport::measure(&model, Precision::F16, 1024.0, |m: &TinyLm<B>| {
        m.loss(x.clone(), y.clone()) + planted_cancellation::<B>(&device).mul_scalar(1e-3)
    })
    .unwrap();
    let top = report.worst(1)[0];
    assert_eq!(
        (top.op, top.dtype.as_str()),
        ("float_matmul", "F16"),
        "{}",
        report.table(10)
    );
    assert!(top.own_error.unwrap() > 0.5);
    let rel = ((report.loss - report.loss_f32) / report.loss_f32).abs();
    assert!(rel < 1e-2, "{rel}");
}
