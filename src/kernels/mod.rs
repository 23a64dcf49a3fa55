//! The hot paths of loss scaling, the fused optimizers and gradient accumulation, as one
//! extension trait.
//!
//! Every method has a default built from plain burn ops ([`fallback`]), so any backend can
//! implement [`AmpKernels`] with an empty `impl`. CubeCL backends (`CubeBackend`, and the
//! `Fusion<CubeBackend>` that burn-wgpu and burn-cuda use by default) override them with
//! the kernels in `cubecl_kernels/`.
//!
//! All state stays on the device, so nothing here ever reads back to the host:
//! - `inv_scale`: f32 `[1]`, the reciprocal of the loss scale;
//! - `found_inf`: f32 `[1]`, `0.0` or `1.0`; only ever raised;
//! - the scaler state: f32 `[4]`, see [`ScaleState`];
//! - `step`: f32 `[1]`, the optimizer steps actually applied (skipped ones not counted).

pub mod fallback;

mod cube;
#[path = "../../cubecl_kernels/mod.rs"]
mod cubecl_kernels;
mod fusion;

use burn_backend::Backend;
use burn_backend::tensor::FloatTensor;

/// Index of each field in the f32 `[4]` scaler state tensor. One tensor, so that the whole
/// update is one single-thread kernel with one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleState {
    /// The loss scale.
    Scale = 0,
    /// Clean steps since the last growth or overflow.
    GrowthTracker = 1,
    /// Overflows still tolerated before the next back-off.
    HysteresisLeft = 2,
    /// Consecutive overflows seen while the scale sat at `min_scale`.
    FloorOverflows = 3,
}

/// Constants of the scale update (the validated `GradScalerConfig`, as plain numbers).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleRule {
    /// Multiplier after `growth_interval` clean steps (> 1).
    pub growth_factor: f32,
    /// Multiplier on overflow, in (0, 1).
    pub backoff_factor: f32,
    /// Clean steps before growth (≥ 1).
    pub growth_interval: u32,
    /// Overflows tolerated before backing off (≥ 1; 1 is PyTorch's behaviour).
    pub hysteresis: u32,
    /// Floor of the scale.
    pub min_scale: f32,
    /// Ceiling of the scale.
    pub max_scale: f32,
}

/// Hyper-parameters of one fused AdamW step (host values: they cost no read).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    /// Learning rate.
    pub lr: f32,
    /// First moment decay.
    pub beta1: f32,
    /// Second moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub epsilon: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

/// Hyper-parameters of one fused SGD step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdHyper {
    /// Learning rate.
    pub lr: f32,
    /// Momentum (0 disables the buffer).
    pub momentum: f32,
    /// Dampening of the momentum.
    pub dampening: f32,
    /// L2 weight decay, added to the gradient.
    pub weight_decay: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// Loss-scaling and fused-optimizer kernels. See the [module docs](self).
pub trait AmpKernels: Backend {
    /// Multiplies each gradient by `inv_scale[0]` (in its own dtype, computed in f32) and
    /// raises `found_inf` to 1 if any element of any gradient is NaN or ±inf. Shapes and
    /// dtypes are kept; empty tensors are allowed.
    fn unscale_and_check(
        grads: Vec<FloatTensor<Self>>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
    ) -> (Vec<FloatTensor<Self>>, FloatTensor<Self>) {
        fallback::unscale_and_check::<Self>(grads, inv_scale, found_inf)
    }

    /// The dynamic loss-scale update for one optimizer step; see [`fallback::update_scale`]
    /// for the exact rule. Returns the new f32 `[4]` state.
    fn update_scale(
        state: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        rule: ScaleRule,
    ) -> FloatTensor<Self> {
        fallback::update_scale::<Self>(state, found_inf, rule)
    }

    /// One AdamW step on one parameter, skipped bit for bit when `found_inf[0] != 0`.
    ///
    /// `grad` is still scaled: it is multiplied by `inv_scale[0]` inside. `exp_avg` and
    /// `exp_avg_sq` are f32 whatever the parameter's dtype; the math is f32 and only the
    /// result is rounded to the parameter's dtype. `step` counts this step already.
    #[allow(clippy::too_many_arguments)]
    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        exp_avg: FloatTensor<Self>,
        exp_avg_sq: FloatTensor<Self>,
        step: FloatTensor<Self>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        hyper: AdamWHyper,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        fallback::adamw_step::<Self>(
            param, grad, exp_avg, exp_avg_sq, step, inv_scale, found_inf, hyper,
        )
    }

    /// One SGD step (optional momentum buffer, f32), skipped bit for bit on overflow.
    fn sgd_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        momentum: Option<FloatTensor<Self>>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        hyper: SgdHyper,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        fallback::sgd_step::<Self>(param, grad, momentum, inv_scale, found_inf, hyper)
    }

    /// One micro-step of gradient accumulation: `acc + grad × weight`, in f32 whatever the
    /// gradient's dtype (f64 for f64 gradients). `None` starts a window: the result is then
    /// `grad × weight` alone. A weight of 1 costs no multiplication, so the first micro-step
    /// of a one-step window is the gradient bit for bit.
    ///
    /// `acc` (f32, or f64 for f64 gradients) has the gradient's shape. It is consumed: the
    /// kernels write the sum into its buffer when nothing else holds it, so a clone the
    /// caller keeps never changes.
    fn accumulate(
        acc: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        weight: f32,
    ) -> FloatTensor<Self> {
        fallback::accumulate::<Self>(acc, grad, weight)
    }
}

impl AmpKernels for burn::backend::Flex {}

impl<B: AmpKernels> AmpKernels for crate::Amp<B> {
    fn unscale_and_check(
        grads: Vec<FloatTensor<Self>>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
    ) -> (Vec<FloatTensor<Self>>, FloatTensor<Self>) {
        B::unscale_and_check(grads, inv_scale, found_inf)
    }

    fn update_scale(
        state: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        rule: ScaleRule,
    ) -> FloatTensor<Self> {
        B::update_scale(state, found_inf, rule)
    }

    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        exp_avg: FloatTensor<Self>,
        exp_avg_sq: FloatTensor<Self>,
        step: FloatTensor<Self>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        hyper: AdamWHyper,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        B::adamw_step(
            param, grad, exp_avg, exp_avg_sq, step, inv_scale, found_inf, hyper,
        )
    }

    fn sgd_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        momentum: Option<FloatTensor<Self>>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        hyper: SgdHyper,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        B::sgd_step(param, grad, momentum, inv_scale, found_inf, hyper)
    }

    fn accumulate(
        acc: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        weight: f32,
    ) -> FloatTensor<Self> {
        B::accumulate(acc, grad, weight)
    }
}
