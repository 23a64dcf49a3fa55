//! Blocks of the architectures people train, composed of burn-nn layers and tensor ops as
//! their Burn ports write them: the op sequences between layers (a channel-last norm, a
//! patch flatten, a skip concatenation, a window roll, a causal scan's cumulative sums) are
//! where a half value meets an f32 one, and depthwise, patchifying and dilated convolutions
//! take other kernels than the plain ones in `cases.rs`.

use burn::nn::attention::{MhaInput, MultiHeadAttentionConfig};
use burn::nn::conv::{Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig};
use burn::nn::{
    GroupNormConfig, LayerNormConfig, LinearConfig, PaddingConfig1d, PaddingConfig2d,
    RmsNormConfig, RotaryEncodingConfig, SwiGluConfig,
};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::module;
use burn::tensor::ops::{AttentionModuleOptions, PadMode};
use burn::tensor::{Bool, Int, Tensor, activation};

use super::{BATCH, Case, D, SEQ};

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
                let freqs = Tensor::<B, 1, Int>::arange(0..(D / 2) as i64, &cx.device)
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
                let causal =
                    Tensor::<B, 2, Bool>::tril_mask([L, L], 0, &cx.device).reshape([1, 1, L, L]);
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
            "Llama block: RMSNorm, grouped-query RoPE attention (fused op, causal), SwiGLU",
            |cx| {
                const HEADS: usize = 4;
                const KV_HEADS: usize = 2;
                const HEAD: usize = D / HEADS;
                let attention_norm = cx.module(RmsNormConfig::new(D).init(&cx.device));
                let query = LinearConfig::new(D, D).with_bias(false);
                let query = cx.module(query.init(&cx.device));
                let key_value = LinearConfig::new(D, 2 * KV_HEADS * HEAD).with_bias(false);
                let key_value = cx.module(key_value.init(&cx.device));
                let output = LinearConfig::new(D, D).with_bias(false);
                let output = cx.module(output.init(&cx.device));
                let ffn_norm = cx.module(RmsNormConfig::new(D).init(&cx.device));
                let ffn = cx.module(SwiGluConfig::new(D, 2 * D).init(&cx.device));
                let ffn_out = LinearConfig::new(2 * D, D).with_bias(false);
                let ffn_out = cx.module(ffn_out.init(&cx.device));
                let rope = RotaryEncodingConfig::new(2 * SEQ, HEAD).init::<B>(&cx.device);
                let x = cx.input("x", [BATCH, SEQ, D], -1.0, 1.0);
                let heads =
                    |t: Tensor<B, 3>, n: usize| t.reshape([BATCH, SEQ, n, HEAD]).swap_dims(1, 2);
                let h = attention_norm.forward(x.clone());
                let q = rope.forward(heads(query.forward(h.clone()), HEADS));
                let [k, v] = key_value
                    .forward(h)
                    .chunk(2, 2)
                    .try_into()
                    .expect("keys and values");
                // Each key-value head serves HEADS / KV_HEADS query heads.
                let grouped = |t: Tensor<B, 4>| {
                    t.unsqueeze_dim::<5>(2)
                        .expand([BATCH, KV_HEADS, HEADS / KV_HEADS, SEQ, HEAD])
                        .reshape([BATCH, HEADS, SEQ, HEAD])
                };
                let k = grouped(rope.forward(heads(k, KV_HEADS)));
                let v = grouped(heads(v, KV_HEADS));
                let causal = AttentionModuleOptions {
                    is_causal: true,
                    ..Default::default()
                };
                let context = module::attention(q, k, v, None, None, causal);
                let context = context.swap_dims(1, 2).reshape([BATCH, SEQ, D]);
                let x = x + output.forward(context);
                let out = x.clone() + ffn_out.forward(ffn.forward(ffn_norm.forward(x)));
                cx.project(out)
            },
        ),
        (
            "Gemma-2 attention: fused op with a softcap, ALiBi bias and a padding mask",
            |cx| {
                const HEADS: usize = 2;
                const HEAD: usize = D / HEADS;
                let qkv = cx.module(LinearConfig::new(D, 3 * D).init(&cx.device));
                let x = cx.input("x", [BATCH, SEQ, D], -2.0, 2.0);
                let [q, k, v] = qkv
                    .forward(x)
                    .reshape([BATCH, SEQ, 3 * HEADS, HEAD])
                    .swap_dims(1, 2)
                    .chunk(3, 1)
                    .try_into()
                    .expect("queries, keys and values");
                // ALiBi: a head's slope times the distance to the key.
                let positions = Tensor::<B, 1, Int>::arange(0..SEQ as i64, &cx.device).float();
                let distance = (positions.clone().reshape([SEQ, 1]) - positions.reshape([1, SEQ]))
                    .abs()
                    .neg();
                let slopes = Tensor::<B, 1>::from_floats([0.5, 0.25], &cx.device);
                let bias = (distance.unsqueeze_dim::<3>(0) * slopes.reshape([HEADS, 1, 1]))
                    .unsqueeze_dim::<4>(0)
                    .expand([BATCH, HEADS, SEQ, SEQ]);
                // The last key padded out in every row.
                let padding = Tensor::<B, 1, Int>::arange(0..SEQ as i64, &cx.device)
                    .greater_equal_elem(SEQ as i64 - 1)
                    .reshape([1, 1, 1, SEQ])
                    .expand([BATCH, HEADS, SEQ, SEQ]);
                let options = AttentionModuleOptions {
                    softcap: Some(5.0),
                    ..Default::default()
                };
                let context = module::attention(q, k, v, Some(padding), Some(bias), options);
                let out = context.swap_dims(1, 2).reshape([BATCH, SEQ, D]);
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
