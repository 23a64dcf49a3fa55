//! SGD (optional momentum, dampening, Nesterov, L2 weight decay) as one
//! [`OptimKernels::sgd_step`] per parameter.

use std::borrow::Cow;

use burn::config::Config;
use burn::module::AutodiffModule;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{LearningRate, SimpleOptimizer};
use burn::prelude::*;
use burn::record::Record;
use burn::tensor::backend::AutodiffBackend;

use super::groups::{self, ParamGroup};
use super::kernels::{OptimKernels, Scaling, Velocity, fallback};
use super::{
    OptimError, ScaledAdaptor, ScaledSimpleOptimizer, adaptor, as_f32, bytes, check_range,
    for_rank, simple_optimizer,
};
use crate::grads::{primitive, tensor};
use crate::record::ExactTensor;
use burn_backend::tensor::FloatTensor;

/// Configuration of [`FusedSgd`]. The defaults are PyTorch's `SGD` (Burn's `MomentumConfig`
/// defaults to a dampening of 0.1).
#[derive(Config, Debug)]
pub struct FusedSgdConfig {
    /// Momentum, ≥ 0 (0 for plain SGD: no state).
    #[config(default = 0.0)]
    pub momentum: f32,
    /// Dampening of the momentum, in [0, 1].
    #[config(default = 0.0)]
    pub dampening: f32,
    /// L2 weight decay, added to the gradient, ≥ 0.
    #[config(default = 0.0)]
    pub weight_decay: f32,
    /// Parameters of a lower rank get no weight decay: 0 (the default, PyTorch's) decays
    /// every parameter; 2 decays weight matrices and kernels only, not biases and norm scales
    /// (nanoGPT's rule; Hugging Face's Trainer leaves biases and LayerNorm weights out).
    #[config(default = 0)]
    pub weight_decay_min_rank: usize,
    /// Nesterov momentum: needs momentum > 0 and dampening 0, as in PyTorch.
    #[config(default = false)]
    pub nesterov: bool,
    /// Ascend the gradient instead (PyTorch's `maximize`): the gradient is negated before
    /// anything else, weight decay included.
    #[config(default = false)]
    pub maximize: bool,
    /// Gradient clipping, applied per parameter to unscaled gradients (Burn's semantics).
    pub grad_clipping: Option<GradientClippingConfig>,
    /// Options by module path: a learning-rate scale and a weight decay per group
    /// ([`ParamGroup`]; the first group that matches a parameter applies).
    #[config(default = "Vec::new()")]
    pub param_groups: Vec<ParamGroup>,
}

impl FusedSgdConfig {
    /// Checks the values; the error names the field and says what is allowed.
    pub fn validate(&self) -> Result<(), OptimError> {
        let name = "FusedSgd";
        groups::validate(name, &self.param_groups)?;
        check_range(
            name,
            "momentum",
            self.momentum,
            self.momentum >= 0.0,
            "a finite number >= 0",
        )?;
        check_range(
            name,
            "dampening",
            self.dampening,
            (0.0..=1.0).contains(&self.dampening),
            "a number in [0, 1]",
        )?;
        check_range(
            name,
            "weight_decay",
            self.weight_decay,
            self.weight_decay >= 0.0,
            "a finite number >= 0",
        )?;
        if self.nesterov {
            check_range(
                name,
                "momentum",
                self.momentum,
                self.momentum > 0.0,
                "> 0 with nesterov",
            )?;
            check_range(
                name,
                "dampening",
                self.dampening,
                self.dampening == 0.0,
                "0 with nesterov",
            )?;
        }
        Ok(())
    }

    /// One more parameter group ([`ParamGroup`]), after those there are.
    pub fn with_group(mut self, group: ParamGroup) -> Self {
        self.param_groups.push(group);
        self
    }

    /// The optimizer for module `M`, with empty state.
    pub fn init<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
    ) -> Result<ScaledAdaptor<FusedSgd, M, B>, OptimError>
    where
        B::InnerBackend: OptimKernels,
    {
        self.validate()?;
        let optim = FusedSgd {
            config: self.clone(),
        };
        Ok(adaptor(optim, &self.grad_clipping))
    }
}

/// SGD whose step is one fused kernel per parameter. See the [module docs](super).
#[derive(Clone, Debug)]
pub struct FusedSgd {
    config: FusedSgdConfig,
}

impl FusedSgd {
    /// The configuration.
    pub fn config(&self) -> &FusedSgdConfig {
        &self.config
    }
}

/// One parameter's [`FusedSgd`] state: only with momentum.
#[derive(Record, Clone, Debug)]
pub struct FusedSgdState<B: Backend, const D: usize> {
    /// The momentum buffer, f32.
    pub velocity: Tensor<B, D>,
    /// Steps applied to this parameter, f32 `[1]` on the device (0: the next step sets the
    /// velocity to the gradient; saved as it is, whatever the recorder's precision:
    /// [`ExactTensor`]).
    pub step: ExactTensor<B, 1>,
}

simple_optimizer!(FusedSgd, FusedSgdState { velocity, step });

impl<B: OptimKernels> ScaledSimpleOptimizer<B> for FusedSgd {
    fn step_scaled<const D: usize>(
        &self,
        lr: LearningRate,
        value: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
        scaling: Scaling<FloatTensor<B>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let param = primitive(value);
        let velocity = (self.config.momentum != 0.0).then(|| match state {
            Some(s) => Velocity {
                velocity: primitive(as_f32(s.velocity)),
                step: primitive(as_f32(s.step.into_tensor())),
            },
            None => Velocity {
                velocity: fallback::zeros_f32::<B>(&param),
                step: fallback::zero_count::<B>(&param),
            },
        });
        let config = for_rank(&self.config, D, self.config.weight_decay_min_rank, |c| {
            c.with_weight_decay(0.0)
        });
        let (param, velocity) = B::sgd_step(
            param,
            primitive(grad),
            velocity,
            scaling,
            lr as f32,
            &config,
        );
        let state = velocity.map(|v| FusedSgdState {
            velocity: tensor(v.velocity),
            step: ExactTensor(tensor(v.step)),
        });
        (tensor(param), state)
    }

    fn state_bytes<const D: usize>(state: &Self::State<D>) -> u64 {
        bytes(&state.velocity) + bytes(&state.step.0)
    }

    fn maximize(&self) -> bool {
        self.config.maximize
    }

    fn param_groups(&self) -> &[ParamGroup] {
        &self.config.param_groups
    }

    /// A group's weight decay in place of the config's.
    fn for_parameter(&self, _: usize, group: Option<&ParamGroup>) -> Cow<'_, Self> {
        match group.and_then(|g| g.weight_decay) {
            None => Cow::Borrowed(self),
            Some(decay) => {
                let mut optim = self.clone();
                (
                    optim.config.weight_decay,
                    optim.config.weight_decay_min_rank,
                ) = (decay, 0);
                Cow::Owned(optim)
            }
        }
    }
}
