//! The cases: each builds its modules and inputs in a [`Cx`] and returns the loss.

use burn::nn::attention::{CrossAttentionConfig, MhaInput, MultiHeadAttentionConfig};
use burn::nn::conv::{
    Conv1dConfig, Conv2dConfig, Conv3dConfig, ConvTranspose2dConfig, DeformConv2dConfig,
};
use burn::nn::interpolate::{Interpolate2dConfig, InterpolateMode};
use burn::nn::loss::{
    BinaryCrossEntropyLossConfig, CTCLossConfig, CosineEmbeddingLossConfig, CrossEntropyLossConfig,
    HuberLossConfig, KLDivLossConfig, LpLossConfig, MseLoss, PoissonNllLossConfig, RNNTLossConfig,
    Reduction, SmoothL1LossConfig,
};
use burn::nn::pool::{AdaptiveAvgPool2dConfig, AvgPool2dConfig, MaxPool2dConfig};
use burn::nn::transformer::{
    PositionWiseFeedForwardConfig, TransformerDecoderConfig, TransformerDecoderInput,
    TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{
    BatchNormConfig, BiGruConfig, BiLstmConfig, EmbeddingConfig, GroupNormConfig, GruConfig,
    InstanceNormConfig, LayerNormConfig, LinearConfig, LocalResponseNormConfig, LstmConfig,
    PReluConfig, PaddingConfig2d, PositionalEncodingConfig, RmsNormConfig, RnnConfig,
    RotaryEncodingConfig, SwiGluConfig, Unfold4dConfig,
};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, activation};

use super::{Case, Cx};

pub(super) const D: usize = 16;
pub(super) const SEQ: usize = 6;
pub(super) const BATCH: usize = 2;

pub(super) fn cases<B: AutodiffBackend>() -> Vec<(&'static str, Case<B>)> {
    vec![
        ("Linear", |cx| {
            let m = cx.module(LinearConfig::new(D, D).init(&cx.device));
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("Conv1d", |cx| {
            let m = cx.module(Conv1dConfig::new(4, 6, 3).init(&cx.device));
            let x = cx.input("x", [BATCH, 4, 12], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("Conv2d, groups and dilation", |cx| {
            let conv = Conv2dConfig::new([4, 6], [3, 3])
                .with_groups(2)
                .with_dilation([2, 1])
                .with_padding(PaddingConfig2d::Same);
            let m = cx.module(conv.init(&cx.device));
            let x = cx.input("x", [BATCH, 4, 8, 8], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("Conv3d", |cx| {
            let m = cx.module(Conv3dConfig::new([3, 4], [2, 2, 2]).init(&cx.device));
            let x = cx.input("x", [BATCH, 3, 4, 4, 4], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("ConvTranspose2d", |cx| {
            let conv = ConvTranspose2dConfig::new([4, 3], [3, 3]).with_stride([2, 2]);
            let m = cx.module(conv.init(&cx.device));
            let x = cx.input("x", [BATCH, 4, 5, 5], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("DeformConv2d", |cx| {
            let m = cx.module(DeformConv2dConfig::new([3, 4], [3, 3]).init(&cx.device));
            let x = cx.input("x", [BATCH, 3, 6, 6], -1.0, 1.0);
            let offset = cx.input("offset", [BATCH, 18, 4, 4], -0.7, 0.7);
            let out = m.forward(x, offset, None);
            cx.project(out)
        }),
        ("Embedding, then Linear", |cx| {
            let emb = cx.module(EmbeddingConfig::new(20, D).init(&cx.device));
            let lin = cx.module(LinearConfig::new(D, D).init(&cx.device));
            let ids = cx.ints([BATCH, SEQ], 20);
            let out = lin.forward(emb.forward(ids));
            cx.project(out)
        }),
        ("LayerNorm of a Linear", |cx| {
            let lin = cx.module(LinearConfig::new(D, D).init(&cx.device));
            let norm = cx.module(LayerNormConfig::new(D).init(&cx.device));
            let x = cx.input("x", [BATCH, SEQ, D], 2.0, 4.0);
            let out = norm.forward(lin.forward(x));
            cx.project(out)
        }),
        ("RmsNorm of a Linear", |cx| {
            let lin = cx.module(LinearConfig::new(D, D).init(&cx.device));
            let norm = cx.module(RmsNormConfig::new(D).init(&cx.device));
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let out = norm.forward(lin.forward(x));
            cx.project(out)
        }),
        ("GroupNorm of a Conv2d", |cx| {
            // No convolution bias: the norm makes the biases' gradients sum to 0 within each
            // group, a cancellation that the activation's half gradient (AMP's, PyTorch's
            // too) leaves at 6e-3 relative on Flex f16, 12 times the weights'.
            let conv = Conv2dConfig::new([3, 4], [3, 3]).with_bias(false);
            let conv = cx.module(conv.init(&cx.device));
            let norm = cx.module(GroupNormConfig::new(2, 4).init(&cx.device));
            let x = cx.input("x", [BATCH, 3, 7, 7], -1.0, 1.0);
            let out = norm.forward(conv.forward(x));
            cx.project(out)
        }),
        ("InstanceNorm of a Conv2d", |cx| {
            let conv = cx.module(Conv2dConfig::new([3, 4], [3, 3]).init(&cx.device));
            let norm = cx.module(InstanceNormConfig::new(4).init(&cx.device));
            let x = cx.input("x", [BATCH, 3, 7, 7], -1.0, 1.0);
            let out = norm.forward(conv.forward(x));
            cx.project(out)
        }),
        ("LocalResponseNorm of a Conv2d", |cx| {
            let conv = cx.module(Conv2dConfig::new([3, 6], [3, 3]).init(&cx.device));
            let x = cx.input("x", [BATCH, 3, 7, 7], -1.0, 1.0);
            let out = LocalResponseNormConfig::new(3)
                .with_alpha(0.5)
                .init()
                .forward(conv.forward(x));
            cx.project(out)
        }),
        ("BatchNorm of a Conv2d, with its running statistics", |cx| {
            let conv = cx.module(Conv2dConfig::new([3, 4], [3, 3]).init(&cx.device));
            let norm = cx.module(BatchNormConfig::new(4).init(&cx.device));
            let x = cx.input("x", [BATCH, 3, 6, 6], 0.0, 2.0);
            let out = norm.forward(conv.forward(x));
            cx.state("running mean", norm.running_mean.value());
            cx.state("running variance", norm.running_var.value());
            cx.project(out)
        }),
        ("PRelu", |cx| {
            // On a half input off its kink (see `activations.rs`).
            let act = cx.module(PReluConfig::new().with_num_parameters(D).init(&cx.device));
            let x = cx.half_input("x", [BATCH, D, SEQ], -1.0, 1.0, &[0.0], 0.01);
            let out = act.forward(x);
            cx.project(out)
        }),
        ("SwiGlu", |cx| {
            let m = cx.module(SwiGluConfig::new(D, D).with_bias(true).init(&cx.device));
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("PositionWiseFeedForward", |cx| {
            let m = cx.module(
                PositionWiseFeedForwardConfig::new(D, 2 * D)
                    .with_dropout(0.0)
                    .init(&cx.device),
            );
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let out = m.forward(x);
            cx.project(out)
        }),
        ("Lstm", |cx| {
            let m = cx.module(LstmConfig::new(D, D, true).init(&cx.device));
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let (out, state) = m.forward(x, None);
            let out = cx.project(out);
            out + cx.project(state.cell)
        }),
        ("BiLstm", |cx| {
            let m = cx.module(BiLstmConfig::new(D, D, true).init(&cx.device));
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let (out, _) = m.forward(x, None);
            cx.project(out)
        }),
        ("Gru", |cx| {
            let m = cx.module(GruConfig::new(D, D, true).init(&cx.device));
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let out = m.forward(x, None);
            cx.project(out)
        }),
        ("Rnn, reversed", |cx| {
            let m = cx.module(
                RnnConfig::new(D, D, true)
                    .with_reverse(true)
                    .init(&cx.device),
            );
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let (out, _) = m.forward(x, None);
            cx.project(out)
        }),
        ("BiGru", |cx| {
            let m = cx.module(BiGruConfig::new(D, D, true).init(&cx.device));
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let (out, _) = m.forward(x, None);
            cx.project(out)
        }),
        ("MultiHeadAttention, padding mask", |cx| {
            let m = cx.module(
                MultiHeadAttentionConfig::new(D, 4)
                    .with_dropout(0.0)
                    .init(&cx.device),
            );
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let pad = Tensor::<B, 1, Int>::arange(0..SEQ as i64, &cx.device)
                .reshape([1, SEQ])
                .repeat_dim(0, BATCH)
                .greater_equal_elem(SEQ as i64 - 2);
            let out = m.forward(MhaInput::self_attn(x).mask_pad(pad)).context;
            cx.project(out)
        }),
        ("CrossAttention", |cx| {
            let m = cx.module(
                CrossAttentionConfig::new(D, 8, 4, 2, 4)
                    .with_dropout(0.0)
                    .init(&cx.device),
            );
            let q = cx.input("query", [BATCH, SEQ, D], -1.0, 1.0);
            let c = cx.input("context", [BATCH, SEQ + 3, 8], -1.0, 1.0);
            let out = m.forward(q, c, None);
            cx.project(out)
        }),
        ("TransformerEncoder, norm first, causal", |cx| {
            let config = TransformerEncoderConfig::new(D, 2 * D, 4, 2)
                .with_norm_first(true)
                .with_dropout(0.0);
            let m = cx.module(config.init(&cx.device));
            let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
            let mask = burn::nn::attention::generate_autoregressive_mask(BATCH, SEQ, &cx.device);
            let out = m.forward(TransformerEncoderInput::new(x).mask_attn(mask));
            cx.project(out)
        }),
        ("TransformerDecoder", |cx| {
            let config = TransformerDecoderConfig::new(D, 2 * D, 4, 1).with_dropout(0.0);
            let m = cx.module(config.init(&cx.device));
            let target = cx.input("target", [BATCH, SEQ, D], -1.0, 1.0);
            let memory = cx.input("memory", [BATCH, SEQ + 2, D], -1.0, 1.0);
            let out = m.forward(TransformerDecoderInput::new(target, memory));
            cx.project(out)
        }),
        ("RotaryEncoding of a Linear", |cx| {
            let lin = cx.module(LinearConfig::new(D, D).init(&cx.device));
            let rope = RotaryEncodingConfig::new(64, D).init::<B>(&cx.device);
            let x = cx.input("x", [BATCH, 40, D], -1.0, 1.0);
            let out = rope.forward(lin.forward(x).slice([0..BATCH, 8..40]));
            cx.project(out)
        }),
        ("PositionalEncoding", |cx| {
            let lin = cx.module(LinearConfig::new(D, D).init(&cx.device));
            let pe = PositionalEncodingConfig::new(D).init::<B>(&cx.device);
            let x = cx.input("x", [BATCH, 40, D], -1.0, 1.0);
            let out = pe.forward(lin.forward(x));
            cx.project(out)
        }),
        ("MaxPool2d, a Conv2d, AdaptiveAvgPool2d", |cx| {
            // The max pool first, on distinct f32 values: of a half input (a lowered conv's
            // output) it picks among values rounding made equal, a different element than
            // f32's where two are within a rounding step (AMP's, PyTorch's too: bf16 moved
            // the picks' gradients 0.3 relative, from one run to the next as Flex's
            // threads summed the convolution in another order).
            let conv = cx.module(Conv2dConfig::new([3, 4], [3, 3]).init(&cx.device));
            let x = cx.distinct_input("x", [BATCH, 3, 18, 18], -1.0, 1.0);
            let y = conv.forward(MaxPool2dConfig::new([2, 2]).init().forward(x));
            let out = AdaptiveAvgPool2dConfig::new([2, 2]).init().forward(y);
            cx.project(out)
        }),
        (
            "AvgPool2d without padding counted, Unfold4d, Interpolate2d",
            |cx| {
                let conv = cx.module(Conv2dConfig::new([3, 4], [3, 3]).init(&cx.device));
                let x = cx.input("x", [BATCH, 3, 8, 8], -1.0, 1.0);
                let pool = AvgPool2dConfig::new([3, 3])
                    .with_strides([1, 1])
                    .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                    .with_count_include_pad(false)
                    .init();
                let y = pool.forward(conv.forward(x));
                let y = Interpolate2dConfig::new()
                    .with_output_size(Some([9, 9]))
                    .with_mode(InterpolateMode::Linear)
                    .init()
                    .forward(y);
                let out = Unfold4dConfig::new([3, 3]).init().forward(y);
                cx.project(out)
            },
        ),
        ("CrossEntropy, label smoothing", |cx| {
            let lin = cx.module(LinearConfig::new(D, 10).init(&cx.device));
            let x = cx.input("x", [8, D], -2.0, 2.0);
            let y = cx.ints([8], 10);
            let loss = CrossEntropyLossConfig::new()
                .with_smoothing(Some(0.1))
                .init(&cx.device);
            loss.forward(lin.forward(x), y)
        }),
        ("BinaryCrossEntropy of logits", |cx| {
            let lin = cx.module(LinearConfig::new(D, 3).init(&cx.device));
            let x = cx.input("x", [8, D], -2.0, 2.0);
            let y = cx.ints([8, 3], 2);
            let loss = BinaryCrossEntropyLossConfig::new()
                .with_logits(true)
                .init(&cx.device);
            loss.forward(lin.forward(x), y)
        }),
        ("Mse", |cx| {
            let (prediction, y) = regression(cx);
            MseLoss::new().forward(prediction, y, Reduction::Mean)
        }),
        ("Huber", |cx| {
            let (prediction, y) = regression(cx);
            HuberLossConfig::new(0.5)
                .init()
                .forward(prediction, y, Reduction::Mean)
        }),
        ("SmoothL1", |cx| {
            let (prediction, y) = regression(cx);
            SmoothL1LossConfig::new()
                .init()
                .forward_with_reduction(prediction, y, Reduction::Sum)
        }),
        ("KLDiv of log-softmax", |cx| {
            let lin = cx.module(LinearConfig::new(D, 10).init(&cx.device));
            let x = cx.input("x", [8, D], -2.0, 2.0);
            let target = activation::softmax(cx.data([8, 10], -2.0, 2.0), 1);
            let log_p = activation::log_softmax(lin.forward(x), 1);
            KLDivLossConfig::new()
                .init()
                .forward(log_p, target, Reduction::BatchMean)
        }),
        ("PoissonNll of log rates", |cx| {
            let lin = cx.module(LinearConfig::new(D, 4).init(&cx.device));
            let x = cx.input("x", [8, D], -1.0, 1.0);
            let y = cx.data([8, 4], 0.0, 5.0);
            PoissonNllLossConfig::new()
                .init()
                .forward(lin.forward(x), y, Reduction::Mean)
        }),
        ("CosineEmbedding", |cx| {
            let lin = cx.module(LinearConfig::new(D, D).init(&cx.device));
            let a = cx.input("a", [8, D], -1.0, 1.0);
            let b = cx.data([8, D], -1.0, 1.0);
            let y = cx.ints([8], 2).mul_scalar(2).sub_scalar(1);
            CosineEmbeddingLossConfig::new()
                .init()
                .forward(lin.forward(a), b, y)
        }),
        ("Lp, p = 3", |cx| {
            let (prediction, y) = regression(cx);
            LpLossConfig::new(3.0)
                .init()
                .forward(prediction, y, Reduction::Mean)
        }),
        ("RNN-T of logits", |cx| {
            let lin = cx.module(LinearConfig::new(D, 5).init(&cx.device));
            let x = cx.input("x", [BATCH, 12, 4, D], -1.0, 1.0);
            let targets = cx.ints([BATCH, 3], 4).add_scalar(1);
            let lengths = |v: [i64; BATCH], device| Tensor::<B, 1, Int>::from_data(v, device);
            RNNTLossConfig::new()
                .with_logits(true)
                .init()
                .forward_with_reduction(
                    lin.forward(x),
                    targets,
                    lengths([12, 9], &cx.device),
                    lengths([3, 2], &cx.device),
                    Reduction::Mean,
                )
        }),
        ("CTC of log-softmax", |cx| {
            let lin = cx.module(LinearConfig::new(D, 5).init(&cx.device));
            let x = cx.input("x", [30, BATCH, D], -1.0, 1.0);
            let log_p = activation::log_softmax(lin.forward(x), 2);
            let targets = cx.ints([BATCH, 8], 4).add_scalar(1);
            let lengths = |v: [i64; BATCH], device| Tensor::<B, 1, Int>::from_data(v, device);
            CTCLossConfig::new().init().forward_with_reduction(
                log_p,
                targets,
                lengths([30, 24], &cx.device),
                lengths([8, 6], &cx.device),
                Reduction::Mean,
            )
        }),
    ]
}

/// A regression loss's inputs: a `Linear`'s prediction of 8 rows, and fixed targets.
fn regression<B: AutodiffBackend>(cx: &mut Cx<B>) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let lin = cx.module(LinearConfig::new(D, D).init(&cx.device));
    let x = cx.input("x", [8, D], -2.0, 2.0);
    let y = cx.data([8, D], -1.0, 1.0);
    (lin.forward(x), y)
}
