//! Blocks of the architectures people train, composed of burn-nn layers and tensor ops as
//! their Burn ports write them: the op sequences between layers (a channel-last norm, a
//! patch flatten, a skip concatenation, a window roll, a causal scan's cumulative sums) are
//! where a half value meets an f32 one, and depthwise, patchifying and dilated convolutions
//! take other kernels than the plain ones in `cases.rs`.

use burn::nn::attention::{MhaInput, MultiHeadAttentionConfig};
use burn::nn::conv::{Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig};
use burn::nn::{GroupNormConfig, LayerNormConfig, LinearConfig, PaddingConfig1d, PaddingConfig2d};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::PadMode;
use burn::tensor::{Tensor, activation};

use super::{BATCH, Case, D};

/// Channels of the convolutional blocks.
const C: usize = 8;

/// `[B, H, W, D]` as `[B · (H/2) · (W/2), 4, D]`: windows of 2 × 2 tokens.
fn windows<B: AutodiffBackend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [b, h, w, d] = x.dims();
    x.reshape([b, h / 2, 2, w / 2, 2, d])
        .swap_dims(2, 3)
        .reshape([b * (h / 2) * (w / 2), 4, d])
}

fn unwindows<B: AutodiffBackend>(x: Tensor<B, 3>, [b, h, w]: [usize; 3]) -> Tensor<B, 4> {
    let d = x.dims()[2];
    x.reshape([b, h / 2, w / 2, 2, 2, d])
        .swap_dims(2, 3)
        .reshape([b, h, w, d])
}

pub(super) fn cases<B: AutodiffBackend>() -> Vec<(&'static str, Case<B>)> {
    vec![
        (
            "ConvNeXt block: depthwise 7×7, channel-last LayerNorm, MLP, layer scale",
            |cx| {
                let dw = Conv2dConfig::new([C, C], [7, 7])
                    .with_groups(C)
                    .with_padding(PaddingConfig2d::Same);
                let dw = cx.module(dw.init(&cx.device));
                let norm = cx.module(LayerNormConfig::new(C).init(&cx.device));
                let up = cx.module(LinearConfig::new(C, 4 * C).init(&cx.device));
                let down = cx.module(LinearConfig::new(4 * C, C).init(&cx.device));
                let x = cx.input("x", [BATCH, C, 9, 9], -1.0, 1.0);
                let scale = cx.input("layer scale", [C], 0.1, 0.5);
                let y = dw.forward(x.clone()).permute([0, 2, 3, 1]);
                let y = down.forward(activation::gelu(up.forward(norm.forward(y))));
                let y = (y * scale.reshape([1, 1, 1, C])).permute([0, 3, 1, 2]);
                let out = x + y;
                cx.project(out)
            },
        ),
        (
            "ViT embedding: 4×4 patches, class token, position embedding, LayerNorm",
            |cx| {
                let patch = Conv2dConfig::new([3, D], [4, 4]).with_stride([4, 4]);
                let patch = cx.module(patch.init(&cx.device));
                let norm = cx.module(LayerNormConfig::new(D).init(&cx.device));
                let x = cx.input("x", [BATCH, 3, 16, 16], -1.0, 1.0);
                let class = cx.input("class token", [1, 1, D], -0.5, 0.5);
                let position = cx.input("position embedding", [1, 17, D], -0.5, 0.5);
                let tokens = patch.forward(x).flatten::<3>(2, 3).swap_dims(1, 2);
                let tokens = Tensor::cat(vec![class.expand([BATCH, 1, D]), tokens], 1);
                let out = norm.forward(tokens + position);
                cx.project(out)
            },
        ),
        (
            "U-Net up block: transposed conv, skip concatenation, conv, GroupNorm, SiLU",
            |cx| {
                let up = ConvTranspose2dConfig::new([2 * C, C], [2, 2]).with_stride([2, 2]);
                let up = cx.module(up.init(&cx.device));
                let conv =
                    Conv2dConfig::new([2 * C, C], [3, 3]).with_padding(PaddingConfig2d::Same);
                let conv = cx.module(conv.init(&cx.device));
                let norm = cx.module(GroupNormConfig::new(2, C).init(&cx.device));
                let low = cx.input("x", [BATCH, 2 * C, 4, 4], -1.0, 1.0);
                let skip = cx.input("skip", [BATCH, C, 8, 8], -1.0, 1.0);
                let y = Tensor::cat(vec![up.forward(low), skip], 1);
                let out = activation::silu(norm.forward(conv.forward(y)));
                cx.project(out)
            },
        ),
        (
            "Diffusion ResBlock: GroupNorm, SiLU, conv, sinusoidal timestep embedding",
            |cx| {
                let norm = cx.module(GroupNormConfig::new(2, C).init(&cx.device));
                let conv = Conv2dConfig::new([C, C], [3, 3]).with_padding(PaddingConfig2d::Same);
                let conv = cx.module(conv.init(&cx.device));
                let time = cx.module(LinearConfig::new(D, C).init(&cx.device));
                let x = cx.input("x", [BATCH, C, 6, 6], -1.0, 1.0);
                // Timesteps up to 999: their sines must be taken in f32 (f16 holds 999 to
                // within 0.5, a phase error of radians at the highest frequency).
                let t = cx.data([BATCH, 1], 0.0, 999.0);
                let freqs =
                    Tensor::<B, 1, burn::tensor::Int>::arange(0..(D / 2) as i64, &cx.device)
                        .float()
                        .mul_scalar(-(10000f64.ln()) / (D / 2) as f64)
                        .exp()
                        .reshape([1, D / 2]);
                let phase = t * freqs;
                let embedding = Tensor::cat(vec![phase.clone().sin(), phase.cos()], 1);
                let h = conv.forward(activation::silu(norm.forward(x.clone())));
                let h = h + time.forward(embedding).reshape([BATCH, C, 1, 1]);
                let out = x + h;
                cx.project(out)
            },
        ),
        (
            "Selective scan (Mamba): causal depthwise conv1d, softplus step, cumsum decay",
            |cx| {
                const L: usize = 10;
                let input = cx.module(LinearConfig::new(C, 2 * C).init(&cx.device));
                let conv = Conv1dConfig::new(C, C, 4)
                    .with_groups(C)
                    .with_padding(PaddingConfig1d::Explicit(3, 0));
                let conv = cx.module(conv.init(&cx.device));
                let step = cx.module(LinearConfig::new(C, C).init(&cx.device));
                let output = cx.module(LinearConfig::new(C, C).init(&cx.device));
                let x = cx.input("x", [BATCH, L, C], -1.0, 1.0);
                let log_a = cx.input("log A", [C], -1.0, 1.0);
                let [u, z] = input.forward(x).chunk(2, 2).try_into().expect("two halves");
                let u = activation::silu(conv.forward(u.swap_dims(1, 2)).swap_dims(1, 2));
                let dt = activation::softplus(step.forward(u.clone()), 1.0);
                // h_t = Σ_{s ≤ t} exp(Σ_{s < r ≤ t} dt_r · A) dt_s u_s, as the [L, L] decay
                // matrix of the cumulative sums.
                let decay = (dt.clone() * log_a.exp().neg().reshape([1, 1, C])).cumsum(1);
                let decay = decay.swap_dims(1, 2); // [B, C, L]
                let gap = decay.clone().unsqueeze_dim::<4>(3) - decay.unsqueeze_dim::<4>(2);
                let causal = Tensor::<B, 2, burn::tensor::Bool>::tril_mask([L, L], 0, &cx.device)
                    .reshape([1, 1, L, L]);
                let weights = gap.mask_fill(causal, f32::NEG_INFINITY).exp();
                let drive = (dt * u).swap_dims(1, 2).unsqueeze_dim::<4>(3); // [B, C, L, 1]
                let h = weights.matmul(drive).squeeze_dim::<3>(3).swap_dims(1, 2);
                let out = output.forward(h * activation::silu(z));
                cx.project(out)
            },
        ),
        (
            "Swin block: shifted windows (roll), window attention, reverse",
            |cx| {
                let norm = cx.module(LayerNormConfig::new(D).init(&cx.device));
                let attention = cx.module(
                    MultiHeadAttentionConfig::new(D, 2)
                        .with_dropout(0.0)
                        .init(&cx.device),
                );
                let x = cx.input("x", [BATCH, 4, 4, D], -1.0, 1.0);
                let shifted = norm.forward(x.clone()).roll(&[-1, -1], &[1, 2]);
                let y = windows(shifted);
                let y = attention.forward(MhaInput::self_attn(y)).context;
                let y = unwindows(y, [BATCH, 4, 4]).roll(&[1, 1], &[1, 2]);
                let out = x + y;
                cx.project(out)
            },
        ),
        (
            "WaveNet layer: reflect padding, dilated causal conv1d, tanh × sigmoid gate",
            |cx| {
                let dilated = Conv1dConfig::new(C, 2 * C, 3).with_dilation(2);
                let dilated = cx.module(dilated.init(&cx.device));
                let residual = cx.module(Conv1dConfig::new(C, C, 1).init(&cx.device));
                let x = cx.input("x", [BATCH, C, 16], -1.0, 1.0);
                let padded = x.clone().pad([(4, 0)], PadMode::Reflect);
                let [a, b] = dilated
                    .forward(padded)
                    .chunk(2, 1)
                    .try_into()
                    .expect("two halves");
                let gated = a.tanh() * activation::sigmoid(b);
                let out = x + residual.forward(gated);
                cx.project(out)
            },
        ),
    ]
}
