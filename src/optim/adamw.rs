//! AdamW (and Adam, its L2-penalty form) as one [`OptimKernels::adamw_step`] per parameter.

use std::borrow::Cow;

use burn::config::Config;
use burn::module::AutodiffModule;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{LearningRate, SimpleOptimizer};
use burn::prelude::*;
use burn::record::Record;
use burn::tensor::backend::AutodiffBackend;

use serde::{Deserialize, Serialize};

use super::groups::{self, ParamGroup};
use super::kernels::{AdamWMoments, OptimKernels, QuantizedMoments, Scaling, fallback};
use super::quantized::{QuantMap, QuantizedTensor};
use super::rounding::WeightRounding;
use super::{
    OptimError, ScaledAdaptor, ScaledSimpleOptimizer, adaptor, as_f32, bytes, check_range,
    for_rank, simple_optimizer,
};
use crate::grads::{primitive, tensor};
use crate::record::ExactTensor;
use burn_backend::tensor::FloatTensor;

/// How [`FusedAdamW`] stores its two moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MomentStorage {
    /// f32: 8 bytes per parameter.
    F32,
    /// 8-bit block-wise codes (see [`quantized`](super::quantized)): about 2 bytes per
    /// parameter (`2 + 8 / block`). Tensors of fewer than `min_numel` values stay f32, as in
    /// bitsandbytes: their state is small and they are often the sensitive ones (norms,
    /// biases).
    Int8 {
        /// Values per block: 256, 512, 1024 or 2048.
        block: usize,
        /// The code map of both moments.
        map: QuantMap,
        /// Smallest tensor that is quantized.
        min_numel: usize,
    },
}

impl MomentStorage {
    /// 8-bit moments with bitsandbytes' defaults where they are measured to train as well:
    /// blocks of 256, the dynamic map, tensors under 4096 values in f32.
    pub fn int8() -> Self {
        Self::Int8 {
            block: 256,
            map: QuantMap::Dynamic,
            min_numel: 4096,
        }
    }

    /// Whether a tensor of `numel` values gets 8-bit moments: `(block, map)` if so.
    fn quantizes(self, numel: usize) -> Option<(usize, QuantMap)> {
        match self {
            Self::Int8 {
                block,
                map,
                min_numel,
            } if numel >= min_numel.max(1) => Some((block, map)),
            _ => None,
        }
    }
}

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
    /// Weight decay, ≥ 0: decoupled (AdamW) unless `decoupled_weight_decay` is false.
    #[config(default = 0.01)]
    pub weight_decay: f32,
    /// Whether the weight decay is AdamW's, applied to the value (`p *= 1 - lr * wd`), or
    /// Adam's L2 penalty, added to the gradient before the moments (`g += wd * p`: Burn's
    /// `AdamConfig` with a `WeightDecayConfig`, PyTorch's `Adam`). PyTorch's name;
    /// [`adam`](Self::adam) sets it false.
    #[config(default = true)]
    pub decoupled_weight_decay: bool,
    /// Parameters of a lower rank get no weight decay: 0 (the default, PyTorch's) decays
    /// every parameter; 2 decays weight matrices and kernels only, not biases and norm scales
    /// (nanoGPT's rule; Hugging Face's Trainer leaves biases and LayerNorm weights out).
    #[config(default = 0)]
    pub weight_decay_min_rank: usize,
    /// Cautious weight decay ([Chen et al., 2025](https://arxiv.org/abs/2510.12402), Burn's
    /// `cautious_weight_decay`): decay only the elements whose update moves them the way the
    /// decay would (update and parameter of one sign; a zero counts as either, as the paper's
    /// `u·x ≥ 0`: a negative value with a first moment of exactly 0 decays here, not in Burn's).
    #[config(default = false)]
    pub cautious_weight_decay: bool,
    /// Ascend the gradient instead (PyTorch's `maximize`): the gradient is negated before
    /// anything else, weight decay included.
    #[config(default = false)]
    pub maximize: bool,
    /// AMSGrad (PyTorch's and Burn's `amsgrad`): the denominator uses the largest second
    /// moment seen so far, kept as a third f32 state tensor (4 more bytes per parameter).
    /// f32 moments only.
    #[config(default = false)]
    pub amsgrad: bool,
    /// Gradient clipping, applied per parameter to unscaled gradients (Burn's semantics).
    pub grad_clipping: Option<GradientClippingConfig>,
    /// How the moments are stored (f32, or 8-bit blocks).
    #[config(default = "MomentStorage::F32")]
    pub moments: MomentStorage,
    /// How an update is rounded into a bf16 or f16 parameter (f32 parameters are exact).
    #[config(default = "WeightRounding::Nearest")]
    pub weight_rounding: WeightRounding,
    /// Seed of the stochastic rounding's streams, one per parameter (mixed with its place in
    /// the module and its size): with the parameters' step counts (in the record) it makes a
    /// resumed run replay bit for bit.
    #[config(default = 0)]
    pub seed: u64,
    /// Options by module path: a learning-rate scale and a weight decay per group
    /// ([`ParamGroup`]; the first group that matches a parameter applies).
    #[config(default = "Vec::new()")]
    pub param_groups: Vec<ParamGroup>,
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
        )?;
        groups::validate(name, &self.param_groups)?;
        if self.cautious_weight_decay && !self.decoupled_weight_decay {
            return Err(OptimError::Unsupported {
                optimizer: name,
                what: "cautious weight decay with an L2 penalty (decoupled_weight_decay = false)",
                instead: "cautious decay masks AdamW's decoupled decay: set decoupled_weight_decay to true, or cautious_weight_decay to false",
            });
        }
        if let MomentStorage::Int8 { block, .. } = self.moments {
            if self.amsgrad {
                return Err(OptimError::Unsupported {
                    optimizer: name,
                    what: "amsgrad with 8-bit moments (MomentStorage::Int8)",
                    instead: "keep f32 moments (MomentStorage::F32) for AMSGrad, or set amsgrad to false",
                });
            }
            check_range(
                name,
                "moments.block",
                block as f32,
                [256, 512, 1024, 2048].contains(&block),
                "256, 512, 1024 or 2048",
            )?;
        }
        Ok(())
    }

    /// One more parameter group ([`ParamGroup`]), after those there are.
    pub fn with_group(mut self, group: ParamGroup) -> Self {
        self.param_groups.push(group);
        self
    }

    /// Adam, as PyTorch's `Adam` (weight decay 0; a weight decay set later is an L2 penalty
    /// on the gradient). Burn's `AdamConfig` has epsilon 1e-5 where PyTorch has 1e-8.
    pub fn adam() -> Self {
        Self::new()
            .with_weight_decay(0.0)
            .with_decoupled_weight_decay(false)
    }

    /// The memory-saving AdamW: 8-bit moments and stochastic rounding into half-precision
    /// parameters. With bf16 parameters (see [`MemorySaving`](crate::MemorySaving)) a step
    /// holds about 6 bytes per parameter instead of 16.
    pub fn memory_saving() -> Self {
        Self::new()
            .with_moments(MomentStorage::int8())
            .with_weight_rounding(WeightRounding::Stochastic)
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
    /// The two moments.
    pub moments: AdamWMomentState<B, D>,
    /// Steps applied to this parameter, f32 `[1]` on the device (saved as it is, whatever the
    /// recorder's precision: [`ExactTensor`]).
    pub step: ExactTensor<B, 1>,
}

/// [`FusedAdamW`]'s moments of one parameter, as [`MomentStorage`] chose them when the state
/// was created.
#[derive(Record, Clone, Debug)]
pub enum AdamWMomentState<B: Backend, const D: usize> {
    /// f32 moments.
    F32(F32Moments<B, D>),
    /// 8-bit moments.
    Int8(Int8Moments<B>),
}

/// f32 moments of the parameter's shape.
#[derive(Record, Clone, Debug)]
pub struct F32Moments<B: Backend, const D: usize> {
    /// First moment.
    pub exp_avg: Tensor<B, D>,
    /// Second moment.
    pub exp_avg_sq: Tensor<B, D>,
    /// AMSGrad's running maximum of the second moment (only with `amsgrad`).
    pub max_exp_avg_sq: Option<Tensor<B, D>>,
}

/// 8-bit moments: the first, and the square root of the second.
#[derive(Record, Clone, Debug)]
pub struct Int8Moments<B: Backend> {
    /// First moment, signed map.
    pub exp_avg: QuantizedTensor<B>,
    /// Square root of the second moment, unsigned map.
    pub exp_avg_sq_sqrt: QuantizedTensor<B>,
}

impl<B: Backend, const D: usize> AdamWMomentState<B, D> {
    /// The moments on `device`.
    pub fn to_device(self, device: &B::Device) -> Self {
        match self {
            Self::F32(m) => Self::F32(F32Moments {
                exp_avg: m.exp_avg.to_device(device),
                exp_avg_sq: m.exp_avg_sq.to_device(device),
                max_exp_avg_sq: m.max_exp_avg_sq.map(|t| t.to_device(device)),
            }),
            Self::Int8(m) => Self::Int8(Int8Moments {
                exp_avg: m.exp_avg.to_device(device),
                exp_avg_sq_sqrt: m.exp_avg_sq_sqrt.to_device(device),
            }),
        }
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> u64 {
        match self {
            Self::F32(m) => {
                bytes(&m.exp_avg)
                    + bytes(&m.exp_avg_sq)
                    + m.max_exp_avg_sq.as_ref().map_or(0, bytes)
            }
            Self::Int8(m) => m.exp_avg.bytes() + m.exp_avg_sq_sqrt.bytes(),
        }
    }
}

simple_optimizer!(FusedAdamW, FusedAdamWState { moments, step });

/// A fresh 8-bit state for `numel` values: codes 0 and maxima 0 (every value decodes to 0).
fn zero_quantized<B: Backend>(
    like: &FloatTensor<B>,
    numel: usize,
    block: usize,
    map: QuantMap,
) -> QuantizedTensor<B> {
    let device = B::float_device(like);
    let blocks = numel.div_ceil(block);
    QuantizedTensor {
        codes: Tensor::zeros([blocks * block / 4], (&device, burn::tensor::DType::I32)),
        absmax: Tensor::zeros([blocks], (&device, burn::tensor::DType::F32)),
        block,
        map,
    }
}

impl<B: OptimKernels> ScaledSimpleOptimizer<B> for FusedAdamW {
    fn step_scaled<const D: usize>(
        &self,
        lr: LearningRate,
        value: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
        scaling: Scaling<FloatTensor<B>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let numel = value.shape().num_elements();
        let param = primitive(value);
        let (moments, step) = match state {
            Some(s) => (s.moments, as_f32(s.step.into_tensor())),
            None => {
                let step = tensor(fallback::zero_count::<B>(&param));
                let moments = match self.config.moments.quantizes(numel) {
                    Some((block, map)) => AdamWMomentState::Int8(Int8Moments {
                        exp_avg: zero_quantized::<B>(&param, numel, block, map),
                        exp_avg_sq_sqrt: zero_quantized::<B>(&param, numel, block, map),
                    }),
                    None => AdamWMomentState::F32(F32Moments {
                        exp_avg: tensor(fallback::zeros_f32::<B>(&param)),
                        exp_avg_sq: tensor(fallback::zeros_f32::<B>(&param)),
                        max_exp_avg_sq: None,
                    }),
                };
                (moments, step)
            }
        };
        let grad = primitive(grad);
        let lr = lr as f32;
        let config = for_rank(&self.config, D, self.config.weight_decay_min_rank, |c| {
            c.with_weight_decay(0.0)
        });
        let (param, state) = match moments {
            AdamWMomentState::F32(m) => {
                // AMSGrad's maximum starts at zero (a state saved without it, or a parameter's
                // first step: max(0, v) = v, as PyTorch's and Burn's first step); without
                // AMSGrad a saved maximum is dropped.
                let max_exp_avg_sq = self.config.amsgrad.then(|| match m.max_exp_avg_sq {
                    Some(max) => primitive(as_f32(max)),
                    None => fallback::zeros_f32::<B>(&param),
                });
                let moments = AdamWMoments {
                    exp_avg: primitive(as_f32(m.exp_avg)),
                    exp_avg_sq: primitive(as_f32(m.exp_avg_sq)),
                    max_exp_avg_sq,
                    step: primitive(step),
                };
                let (param, m) = B::adamw_step(param, grad, moments, scaling, lr, &config);
                let state = FusedAdamWState {
                    moments: AdamWMomentState::F32(F32Moments {
                        exp_avg: tensor(m.exp_avg),
                        exp_avg_sq: tensor(m.exp_avg_sq),
                        max_exp_avg_sq: m.max_exp_avg_sq.map(tensor),
                    }),
                    step: ExactTensor(tensor(m.step)),
                };
                (param, state)
            }
            AdamWMomentState::Int8(q) => {
                let (block, map) = (q.exp_avg.block, q.exp_avg.map);
                let moments = QuantizedMoments {
                    exp_avg_codes: q.exp_avg.codes.into_primitive(),
                    exp_avg_absmax: primitive(q.exp_avg.absmax),
                    exp_avg_sq_codes: q.exp_avg_sq_sqrt.codes.into_primitive(),
                    exp_avg_sq_absmax: primitive(q.exp_avg_sq_sqrt.absmax),
                    step: primitive(step),
                    block,
                    map,
                };
                let (param, m) = B::adamw8bit_step(param, grad, moments, scaling, lr, &config);
                let quantized = |codes, absmax| QuantizedTensor {
                    codes: Tensor::from_primitive(codes),
                    absmax: tensor(absmax),
                    block,
                    map,
                };
                let state = FusedAdamWState {
                    moments: AdamWMomentState::Int8(Int8Moments {
                        exp_avg: quantized(m.exp_avg_codes, m.exp_avg_absmax),
                        exp_avg_sq_sqrt: quantized(m.exp_avg_sq_codes, m.exp_avg_sq_absmax),
                    }),
                    step: ExactTensor(tensor(m.step)),
                };
                (param, state)
            }
        };
        (tensor(param), Some(state))
    }

    fn state_bytes<const D: usize>(state: &Self::State<D>) -> u64 {
        state.moments.bytes() + bytes(&state.step.0)
    }

    fn maximize(&self) -> bool {
        self.config.maximize
    }

    fn param_groups(&self) -> &[ParamGroup] {
        &self.config.param_groups
    }

    /// A group's weight decay in place of the config's. With stochastic rounding, each
    /// parameter its own stream: the seed alone (mixed with the size) gave every parameter of
    /// one size (each layer's q, k, v and o projections) the same random bits at each
    /// element, rounding them all up or down together.
    fn for_parameter(&self, index: usize, group: Option<&ParamGroup>) -> Cow<'_, Self> {
        let decay = group.and_then(|g| g.weight_decay);
        let stochastic = self.config.weight_rounding == WeightRounding::Stochastic;
        if decay.is_none() && !stochastic {
            return Cow::Borrowed(self);
        }
        let mut optim = self.clone();
        if let Some(decay) = decay {
            (
                optim.config.weight_decay,
                optim.config.weight_decay_min_rank,
            ) = (decay, 0);
        }
        if stochastic {
            let salt = (index as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            optim.config.seed ^= salt.rotate_left(29);
        }
        Cow::Owned(optim)
    }
}
