//! AdamW as one [`OptimKernels::adamw_step`] per parameter.

use burn::config::Config;
use burn::module::AutodiffModule;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{LearningRate, SimpleOptimizer};
use burn::prelude::*;
use burn::record::Record;
use burn::tensor::backend::AutodiffBackend;

use super::kernels::{AdamWMoments, OptimKernels, Scaling, fallback};
use super::{
    OptimError, ScaledAdaptor, ScaledSimpleOptimizer, adaptor, as_f32, bytes, check_range,
    simple_optimizer,
};
use crate::grads::{primitive, tensor};
use burn_backend::tensor::FloatTensor;

/// Configuration of [`FusedAdamW`]. The defaults are PyTorch's `AdamW` (Burn's `AdamWConfig`
/// has eps 1e-5 and weight decay 1e-4); the field names are Burn's.
#[derive(Config, Debug)]
pub struct FusedAdamWConfig {
    /// First moment decay, in [0, 1).
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// Second moment decay, in [0, 1).
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// Denominator epsilon, ≥ 0.
    #[config(default = 1e-8)]
    pub epsilon: f32,
    /// Decoupled weight decay, ≥ 0.
    #[config(default = 0.01)]
    pub weight_decay: f32,
    /// Gradient clipping, applied per parameter to unscaled gradients (Burn's semantics).
    pub grad_clipping: Option<GradientClippingConfig>,
}

impl FusedAdamWConfig {
    /// Checks the values; the error names the field and says what is allowed.
    pub fn validate(&self) -> Result<(), OptimError> {
        let name = "FusedAdamW";
        check_range(
            name,
            "beta_1",
            self.beta_1,
            (0.0..1.0).contains(&self.beta_1),
            "a number in [0, 1)",
        )?;
        check_range(
            name,
            "beta_2",
            self.beta_2,
            (0.0..1.0).contains(&self.beta_2),
            "a number in [0, 1)",
        )?;
        check_range(
            name,
            "epsilon",
            self.epsilon,
            self.epsilon >= 0.0,
            "a finite number >= 0",
        )?;
        check_range(
            name,
            "weight_decay",
            self.weight_decay,
            self.weight_decay >= 0.0,
            "a finite number >= 0",
        )
    }

    /// The optimizer for module `M`, with empty state.
    pub fn init<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
    ) -> Result<ScaledAdaptor<FusedAdamW, M, B>, OptimError>
    where
        B::InnerBackend: OptimKernels,
    {
        self.validate()?;
        let optim = FusedAdamW {
            config: self.clone(),
        };
        Ok(adaptor(optim, &self.grad_clipping))
    }
}

/// AdamW whose step is one fused kernel per parameter. See the [module docs](super).
#[derive(Clone, Debug)]
pub struct FusedAdamW {
    config: FusedAdamWConfig,
}

impl FusedAdamW {
    /// The configuration.
    pub fn config(&self) -> &FusedAdamWConfig {
        &self.config
    }
}

/// One parameter's [`FusedAdamW`] state.
#[derive(Record, Clone, Debug)]
pub struct FusedAdamWState<B: Backend, const D: usize> {
    /// First moment, f32.
    pub exp_avg: Tensor<B, D>,
    /// Second moment, f32.
    pub exp_avg_sq: Tensor<B, D>,
    /// Steps applied to this parameter, f32 `[1]` on the device.
    pub step: Tensor<B, 1>,
}

simple_optimizer!(
    FusedAdamW,
    FusedAdamWState {
        exp_avg,
        exp_avg_sq,
        step
    }
);

impl<B: OptimKernels> ScaledSimpleOptimizer<B> for FusedAdamW {
    fn step_scaled<const D: usize>(
        &self,
        lr: LearningRate,
        value: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
        scaling: Scaling<FloatTensor<B>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let param = primitive(value);
        let moments = match state {
            Some(s) => AdamWMoments {
                exp_avg: primitive(as_f32(s.exp_avg)),
                exp_avg_sq: primitive(as_f32(s.exp_avg_sq)),
                step: primitive(as_f32(s.step)),
            },
            None => AdamWMoments {
                exp_avg: fallback::zeros_f32::<B>(&param),
                exp_avg_sq: fallback::zeros_f32::<B>(&param),
                step: fallback::zero_count::<B>(&param),
            },
        };
        let (param, m) = B::adamw_step(
            param,
            primitive(grad),
            moments,
            scaling,
            lr as f32,
            &self.config,
        );
        let state = FusedAdamWState {
            exp_avg: tensor(m.exp_avg),
            exp_avg_sq: tensor(m.exp_avg_sq),
            step: tensor(m.step),
        };
        (tensor(param), Some(state))
    }

    fn state_bytes<const D: usize>(state: &Self::State<D>) -> u64 {
        bytes(&state.exp_avg) + bytes(&state.exp_avg_sq) + bytes(&state.step)
    }
}
