//! The same layers with their configs off the default path: a `Linear` without bias, the
//! transposed convolutions' groups, dilation and output padding, asymmetric padding (which
//! burn-nn applies as a separate pad), pools with ceil mode, dilation and padding, the 1-d
//! pools and interpolations, batch norm of a sequence, a post-norm encoder with quiet
//! softmax, attention over another sequence, an LSTM from a given state.

use burn::nn::activation::ActivationConfig;
use burn::nn::attention::{MhaInput, MultiHeadAttentionConfig};
use burn::nn::conv::{
    Conv1dConfig, Conv2dConfig, ConvTranspose1dConfig, ConvTranspose2dConfig, ConvTranspose3dConfig,
};
use burn::nn::interpolate::{Interpolate1dConfig, Interpolate2dConfig, InterpolateMode};
use burn::nn::pool::{
    AdaptiveAvgPool1dConfig, AvgPool1dConfig, AvgPool2dConfig, MaxPool1dConfig, MaxPool2dConfig,
};
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderInput};
use burn::nn::{
    BatchNormConfig, LinearConfig, LstmConfig, LstmState, PaddingConfig1d, PaddingConfig2d,
};
use burn::tensor::backend::AutodiffBackend;

use super::{BATCH, Case, D, SEQ};

pub(super) fn cases<B: AutodiffBackend>() -> Vec<(&'static str, Case<B>)> {
    vec![
        // `LinearLayout::Col` is left out: on an autodiff device Burn 0.21 makes its weight
        // a transposed copy of the tracked leaf, which panics ("Can't convert a non leaf
        // tensor into a tracked tensor") or gets no gradient, with or without `Amp`
        // (tracel-ai/burn#5705, after 0.21).
        ("Linear, no bias", |cx| {
            let config = LinearConfig::new(D, 2 * D).with_bias(false);
            let m = cx.module(config.init(&cx.device));
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("Conv1d, stride 2, asymmetric padding", |cx| {
            let config = Conv1dConfig::new(4, 6, 4)
                .with_stride(2)
                .with_padding(PaddingConfig1d::Explicit(2, 1));
            let m = cx.module(config.init(&cx.device));
            let x = cx.input("x", [BATCH, 4, 13], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("Conv2d, even kernel, same padding", |cx| {
            let config = Conv2dConfig::new([3, 4], [2, 4]).with_padding(PaddingConfig2d::Same);
            let m = cx.module(config.init(&cx.device));
            let x = cx.input("x", [BATCH, 3, 7, 6], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("Conv2d, stride 2, asymmetric padding", |cx| {
            let config = Conv2dConfig::new([3, 4], [3, 3])
                .with_stride([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 0, 2, 1));
            let m = cx.module(config.init(&cx.device));
            let x = cx.input("x", [BATCH, 3, 8, 9], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("ConvTranspose1d, groups, dilation, output padding", |cx| {
            let config = ConvTranspose1dConfig::new([4, 6], 3)
                .with_groups(2)
                .with_dilation(2)
                .with_stride(2)
                .with_padding(1)
                .with_padding_out(1);
            let m = cx.module(config.init(&cx.device));
            let x = cx.input("x", [BATCH, 4, 7], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("ConvTranspose2d, groups, dilation, padding", |cx| {
            let config = ConvTranspose2dConfig::new([4, 6], [3, 2])
                .with_groups(2)
                .with_dilation([1, 2])
                .with_stride([2, 1])
                .with_padding([1, 1]);
            let m = cx.module(config.init(&cx.device));
            let x = cx.input("x", [BATCH, 4, 5, 6], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("ConvTranspose3d", |cx| {
            let config = ConvTranspose3dConfig::new([3, 4], [2, 3, 2]).with_stride([2, 1, 2]);
            let m = cx.module(config.init(&cx.device));
            let x = cx.input("x", [BATCH, 3, 3, 4, 3], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        (
            "MaxPool1d, dilation, ceil mode; AvgPool1d; AdaptiveAvgPool1d",
            |cx| {
                // Max pools on distinct f32 values (see the 2-d case in `cases.rs`).
                let conv = cx.module(Conv1dConfig::new(3, 4, 3).init(&cx.device));
                let x = cx.distinct_input("x", [BATCH, 3, 31], -1.0, 1.0);
                let y = MaxPool1dConfig::new(3)
                    .with_stride(2)
                    .with_dilation(2)
                    .with_padding(PaddingConfig1d::Explicit(1, 1))
                    .with_ceil_mode(true)
                    .init()
                    .forward(x);
                let y = AvgPool1dConfig::new(3)
                    .with_stride(2)
                    .with_padding(PaddingConfig1d::Explicit(1, 1))
                    .with_ceil_mode(true)
                    .init()
                    .forward(conv.forward(y));
                let out = AdaptiveAvgPool1dConfig::new(5).init().forward(y);
                cx.project(out)
            },
        ),
        (
            "MaxPool2d, padding, dilation, ceil mode; AvgPool2d, ceil mode",
            |cx| {
                let conv = cx.module(Conv2dConfig::new([3, 4], [3, 3]).init(&cx.device));
                let x = cx.distinct_input("x", [BATCH, 3, 17, 16], -1.0, 1.0);
                let y = MaxPool2dConfig::new([3, 2])
                    .with_strides([2, 2])
                    .with_dilation([1, 2])
                    .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                    .with_ceil_mode(true)
                    .init()
                    .forward(x);
                let out = AvgPool2dConfig::new([2, 2])
                    .with_strides([2, 2])
                    .with_ceil_mode(true)
                    .init()
                    .forward(conv.forward(y));
                cx.project(out)
            },
        ),
        ("Interpolate1d, linear then cubic", |cx| {
            let conv = cx.module(Conv1dConfig::new(3, 4, 3).init(&cx.device));
            let x = cx.input("x", [BATCH, 3, 12], -1.0, 1.0);
            let y = Interpolate1dConfig::new()
                .with_output_size(Some(17))
                .with_mode(InterpolateMode::Linear)
                .init()
                .forward(conv.forward(x));
            let out = Interpolate1dConfig::new()
                .with_output_size(Some(9))
                .with_mode(InterpolateMode::Cubic)
                .init()
                .forward(y);
            cx.project(out)
        }),
        ("Interpolate2d, cubic, then nearest", |cx| {
            let conv = cx.module(Conv2dConfig::new([3, 4], [3, 3]).init(&cx.device));
            let x = cx.input("x", [BATCH, 3, 8, 8], -1.0, 1.0);
            let y = Interpolate2dConfig::new()
                .with_output_size(Some([11, 7]))
                .with_mode(InterpolateMode::Cubic)
                .init()
                .forward(conv.forward(x));
            let out = Interpolate2dConfig::new()
                .with_scale_factor(Some([2.0, 2.0]))
                .with_mode(InterpolateMode::Nearest)
                .init()
                .forward(y);
            cx.project(out)
        }),
        (
            "BatchNorm of a Conv1d (a sequence), with its running statistics",
            |cx| {
                let conv = cx.module(Conv1dConfig::new(3, 4, 3).init(&cx.device));
                let norm = cx.module(BatchNormConfig::new(4).with_momentum(0.3).init(&cx.device));
                let x = cx.input("x", [BATCH, 3, 20], 0.0, 2.0);
                let out = norm.forward(conv.forward(x));
                cx.state("running mean", norm.running_mean.value());
                cx.state("running variance", norm.running_var.value());
                cx.project(out)
            },
        ),
        (
            "TransformerEncoder, post-norm, quiet softmax, tanh GELU",
            |cx| {
                let config = TransformerEncoderConfig::new(D, 2 * D, 4, 2)
                    .with_quiet_softmax(true)
                    .with_activation(ActivationConfig::GeluApproximate)
                    .with_dropout(0.0);
                let m = cx.module(config.init(&cx.device));
                let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
                let out = m.forward(TransformerEncoderInput::new(x));
                cx.project(out)
            },
        ),
        (
            "MultiHeadAttention over another sequence, quiet softmax",
            |cx| {
                let m = cx.module(
                    MultiHeadAttentionConfig::new(D, 2)
                        .with_quiet_softmax(true)
                        .with_dropout(0.0)
                        .init(&cx.device),
                );
                let q = cx.input("query", [BATCH, SEQ, D], -1.0, 1.0);
                let kv = cx.input("memory", [BATCH, SEQ + 3, D], -1.0, 1.0);
                let out = m.forward(MhaInput::new(q, kv.clone(), kv)).context;
                cx.project(out)
            },
        ),
        ("Lstm from a given state, batch second", |cx| {
            let m = cx.module(
                LstmConfig::new(D, D, true)
                    .with_batch_first(false)
                    .init(&cx.device),
            );
            let x = cx.input("x", [SEQ, BATCH, D], -1.0, 1.0);
            let cell = cx.input("cell", [BATCH, D], -1.0, 1.0);
            let hidden = cx.input("hidden", [BATCH, D], -1.0, 1.0);
            let (out, state) = m.forward(x, Some(LstmState::new(cell, hidden)));
            let out = cx.project(out);
            out + cx.project(state.hidden)
        }),
    ]
}
