//! burn-nn's activation layers, each through `ActivationConfig` (the wrapper a Transformer's
//! feed-forward takes). A smooth one runs on a `Linear`'s half output: what CubeCL computes in
//! half step by step, and each composition's backward (`softplus`' `log(exp(x) + 1)`). One
//! with a kink runs on a half input kept off its kinks ([`Cx::half_input`]): after a
//! `Linear`, a value within a rounding step of a kink took the other side in one run of
//! three (Relu on wgpu f16, Selu on Flex bf16: that element's gradient, 3e-2 to 1.3e-1 in
//! the parameters' gradients), AMP's cost and PyTorch's, not the op's.
//!
//! Left out: `HardShrink`, `Shrink` and `ThresholdedRelu` jump at their threshold, so the
//! same holds of their values.

use burn::nn::activation::ActivationConfig;
use burn::nn::{
    CeluConfig, EluConfig, HardSigmoidConfig, LeakyReluConfig, LinearConfig, SoftShrinkConfig,
    SoftplusConfig,
};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::{BATCH, Case, Cx, D, SEQ};

/// A `Linear` on inputs in [-3, 3), then `config`'s activation, projected.
fn after_linear<B: AutodiffBackend>(cx: &mut Cx<B>, config: ActivationConfig) -> Tensor<B, 1> {
    let lin = cx.module(LinearConfig::new(D, D).init(&cx.device));
    let act = cx.module(config.init(&cx.device));
    let x = cx.input("x", [BATCH, SEQ, D], -3.0, 3.0);
    let out = act.forward(lin.forward(x));
    cx.project(out)
}

/// `config`'s activation of a half input in [-4, 4), at least `margin` from each of `kinks`.
fn off_kinks<B: AutodiffBackend>(
    cx: &mut Cx<B>,
    config: ActivationConfig,
    kinks: &[f32],
    margin: f32,
) -> Tensor<B, 1> {
    let act = cx.module(config.init(&cx.device));
    let x = cx.half_input("x", [BATCH, SEQ, D], -4.0, 4.0, kinks, margin);
    let out = act.forward(x);
    cx.project(out)
}

pub(super) fn cases<B: AutodiffBackend>() -> Vec<(&'static str, Case<B>)> {
    vec![
        ("Gelu", |cx| after_linear(cx, ActivationConfig::Gelu)),
        ("Gelu, tanh approximation", |cx| {
            after_linear(cx, ActivationConfig::GeluApproximate)
        }),
        ("Relu", |cx| {
            off_kinks(cx, ActivationConfig::Relu, &[0.0], 0.01)
        }),
        ("LeakyRelu, slope 0.1", |cx| {
            let config = LeakyReluConfig::new().with_negative_slope(0.1);
            off_kinks(cx, ActivationConfig::LeakyRelu(config), &[0.0], 0.01)
        }),
        ("Sigmoid", |cx| after_linear(cx, ActivationConfig::Sigmoid)),
        ("Tanh", |cx| after_linear(cx, ActivationConfig::Tanh)),
        ("HardSigmoid", |cx| {
            let config = ActivationConfig::HardSigmoid(HardSigmoidConfig::new());
            off_kinks(cx, config, &[-2.5, 2.5], 0.1)
        }),
        ("HardSwish", |cx| {
            off_kinks(cx, ActivationConfig::HardSwish, &[-3.0, 3.0], 0.1)
        }),
        ("Softplus, beta 2", |cx| {
            let config = SoftplusConfig::new().with_beta(2.0);
            after_linear(cx, ActivationConfig::Softplus(config))
        }),
        ("Softsign", |cx| {
            after_linear(cx, ActivationConfig::Softsign)
        }),
        ("Selu", |cx| {
            off_kinks(cx, ActivationConfig::Selu, &[0.0], 0.01)
        }),
        ("Elu, alpha 0.5", |cx| {
            let config = EluConfig::new().with_alpha(0.5);
            off_kinks(cx, ActivationConfig::Elu(config), &[0.0], 0.01)
        }),
        ("Celu, alpha 2", |cx| {
            let config = CeluConfig::new().with_alpha(2.0);
            after_linear(cx, ActivationConfig::Celu(config))
        }),
        ("SoftShrink", |cx| {
            let config = ActivationConfig::SoftShrink(SoftShrinkConfig::new());
            off_kinks(cx, config, &[-0.5, 0.5], 0.05)
        }),
    ]
}
