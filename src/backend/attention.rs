//! Scaled dot-product attention composed from `Amp`'s own ops, where the backend would
//! compose it in the low dtype (`ModuleOps::attention` of `Amp` says when).
//!
//! Burn 0.21's composition (`attention_fallback`: what burn-autodiff runs, and CubeCL without
//! its flash kernel) scales the scores after the first matmul: the raw products `q·k` are
//! rounded to the half dtype before `scale` brings them down, so in f16 they overflow once a
//! score passes `65504 · scale` (8188 at head dim 64 with the default scale, 1024 with muP's
//! `1/d` at d = 64): inf, then NaN after the softmax, in every step, which a loss scaler
//! takes for an overflow of its own and backs off for ever. Here `q` and `k` are each
//! multiplied by `√scale` first (PyTorch's math attention does the same), so that the
//! matmul's output is the scores themselves; the rest is Burn's composition through `Amp`'s
//! ops (softmax in f32, a row masked whole gives weights 0).

use burn_backend::Backend;
use burn_backend::TensorMetadata;
use burn_backend::ops::AttentionModuleOptions;
use burn_backend::ops::attention::attention_fallback;
use burn_backend::tensor::{BoolTensor, FloatTensor};

use crate::backend::workarounds::on_flex;

/// Whether `B` would compose attention in the input's dtype, so that `Amp` composes it
/// instead: under autodiff (Burn 0.21's `Autodiff` runs `attention_fallback` through its own
/// ops), and outside Flex with a bias, a softcap or an explicit scale (Burn 0.21's CubeCL has a
/// flash kernel, f32 accumulators, only without them; Flex's kernel computes in f32).
pub(crate) fn composed_in_half<B: Backend>(
    device: &B::Device,
    has_bias: bool,
    options: &AttentionModuleOptions,
) -> bool {
    let falls_back = has_bias || options.softcap.is_some() || options.scale.is_some();
    B::ad_enabled(device) || (falls_back && !on_flex::<B>())
}

/// `softmax(q kᵀ · scale) v`, with a softcap, masks and a bias as Burn applies them, through
/// `X`'s ops, the scale applied to `q` and `k` before their matmul.
pub(crate) fn attention<X: Backend>(
    query: FloatTensor<X>,
    key: FloatTensor<X>,
    value: FloatTensor<X>,
    mask: Option<BoolTensor<X>>,
    attn_bias: Option<FloatTensor<X>>,
    options: AttentionModuleOptions,
) -> FloatTensor<X> {
    let head_dim = query.shape().dims::<4>()[3];
    let scale = options
        .scale
        .unwrap_or_else(|| 1.0 / (head_dim as f64).sqrt());
    let root = scale.sqrt();
    let (query, key) = if root == 1.0 {
        (query, key)
    } else {
        (
            X::float_mul_scalar(query, root.into()),
            X::float_mul_scalar(key, root.into()),
        )
    };
    let options = AttentionModuleOptions {
        scale: Some(1.0),
        ..options
    };
    attention_fallback::<X>(query, key, value, mask, attn_bias, options)
}
