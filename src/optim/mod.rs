//! Fused optimizers: unscale, skip-on-overflow and the update of a parameter in one kernel,
//! reading the loss scaler's device tensors there, so a scaled step makes no host read.
//!
//! Built the way burn-optim builds its own: the per-tensor math is a Burn
//! [`SimpleOptimizer`] with a typed per-parameter state ([`FusedAdamW`], [`FusedSgd`]), and one
//! adaptor ([`ScaledAdaptor`]) does the traversal, the devices, gradient clipping and the
//! records (Burn's `AdaptorRecord`), handing each parameter the step's scale signals. Both
//! optimizers also work inside Burn's own `OptimizerAdaptor`, unscaled.
//!
//! State is f32 whatever the parameter's dtype (or, for AdamW, 8-bit block-wise codes:
//! [`MomentStorage::Int8`], see [`quantized`]), and every parameter keeps its own step count
//! (a device scalar: skipped steps do not count), as PyTorch and Burn do. The update is
//! computed in f32 and rounded once to the parameter's dtype: a half-precision parameter has
//! **no f32 master copy**, so updates under half its rounding step are lost when it rounds to
//! nearest. Keep trainable parameters in f32 (what `Amp<B>` does: it casts per op), or let
//! AdamW round stochastically ([`WeightRounding::Stochastic`], see [`rounding`]); the
//! [`MemorySaving`] preset does the latter with 8-bit moments: about 6 bytes per parameter.
//!
//! Options per parameter group go by module path ([`groups`]: a learning-rate scale and a
//! weight decay, PyTorch's `param_groups`), resolved by the adaptor for each parameter.

mod adamw;
mod adaptor;
pub mod from_burn;
pub mod groups;
pub mod kernels;
mod memory_saving;
pub mod quantized;
pub mod rounding;
mod sgd;

use std::borrow::Cow;

use burn::optim::LearningRate;
use burn::optim::SimpleOptimizer;
use burn::prelude::*;
use burn_backend::tensor::FloatTensor;
use thiserror::Error;

pub use adamw::{
    AdamWMomentState, F32Moments, FusedAdamW, FusedAdamWConfig, FusedAdamWState, Int8Moments,
    MomentStorage,
};
pub use adaptor::ScaledAdaptor;
pub use from_burn::fused_record;
pub use groups::ParamGroup;
pub use kernels::{OptimKernels, QuantizedMoments, Scaling};
pub use memory_saving::MemorySaving;
pub use quantized::{QuantMap, QuantizedTensor};
pub use rounding::WeightRounding;
pub use sgd::{FusedSgd, FusedSgdConfig, FusedSgdState};

/// A [`SimpleOptimizer`] whose step also takes the loss scaler's device signals: the
/// gradient is multiplied by `inv_scale` inside, and nothing changes when `found_inf` is set.
pub trait ScaledSimpleOptimizer<B: Backend>: SimpleOptimizer<B> {
    /// One parameter's step. With `scaling` of `inv_scale = 1, found_inf = 0` this is
    /// [`SimpleOptimizer::step`].
    fn step_scaled<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
        scaling: Scaling<FloatTensor<B>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>);

    /// Bytes held by one parameter's state.
    fn state_bytes<const D: usize>(state: &Self::State<D>) -> u64;

    /// Whether it ascends the gradient (PyTorch's `maximize`): the adaptor then hands it an
    /// `inv_scale` of the opposite sign, so the gradient is negated where it is unscaled,
    /// before any weight decay, as PyTorch negates it first.
    fn maximize(&self) -> bool {
        false
    }

    /// Its parameter groups ([`ParamGroup`]), from its configuration; none by default.
    fn param_groups(&self) -> &[ParamGroup] {
        &[]
    }

    /// The optimizer for the module's `index`-th float parameter (in visiting order, which a
    /// resumed run and another run of the same model share), in `group` when one of its
    /// [`param_groups`](Self::param_groups) matches the parameter: where it takes the group's
    /// weight decay (the adaptor scales the learning rate) and, when it draws random bits per
    /// parameter, their stream. [`ScaledAdaptor`] asks before each parameter's step.
    fn for_parameter(&self, index: usize, group: Option<&ParamGroup>) -> Cow<'_, Self>
    where
        Self: Clone,
    {
        let _ = (index, group);
        Cow::Borrowed(self)
    }
}

/// A fused optimizer's configuration that cannot run.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum OptimError {
    /// A value out of range.
    #[error("invalid {optimizer} config: {field} = {value}, expected {expected}")]
    InvalidConfig {
        /// The optimizer.
        optimizer: &'static str,
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
        /// What is allowed.
        expected: &'static str,
    },
    /// Options that are each valid but do not run together.
    #[error("{optimizer} does not support {what}: {instead}")]
    Unsupported {
        /// The optimizer.
        optimizer: &'static str,
        /// The combination.
        what: &'static str,
        /// What to do instead.
        instead: &'static str,
    },
    /// A parameter group that cannot be used.
    #[error("invalid {optimizer} parameter group {index} (`{path}`): {what}")]
    InvalidParamGroup {
        /// The optimizer.
        optimizer: &'static str,
        /// The group's place in `param_groups`.
        index: usize,
        /// Its path pattern.
        path: String,
        /// What is wrong with it.
        what: String,
    },
}

/// Burn's [`SimpleOptimizer`] for a [`ScaledSimpleOptimizer`]: the unscaled step is the scaled
/// one with neutral signals, and moving a state moves each of its tensors.
macro_rules! simple_optimizer {
    ($optim:ident, $state:ident { $($field:ident),* $(,)? }) => {
        impl<B: OptimKernels> SimpleOptimizer<B> for $optim {
            type State<const D: usize> = $state<B, D>;

            fn step<const D: usize>(
                &self,
                lr: LearningRate,
                value: Tensor<B, D>,
                grad: Tensor<B, D>,
                state: Option<Self::State<D>>,
            ) -> (Tensor<B, D>, Option<Self::State<D>>) {
                let maximize = <Self as ScaledSimpleOptimizer<B>>::maximize(self);
                super::groups::warn_unplaced(<Self as ScaledSimpleOptimizer<B>>::param_groups(self));
                let scaling = super::unscaled::<B>(&value.device(), maximize);
                self.step_scaled(lr, value, grad, state, scaling)
            }

            fn to_device<const D: usize>(
                state: Self::State<D>,
                device: &B::Device,
            ) -> Self::State<D> {
                $state {
                    $($field: state.$field.to_device(device),)*
                }
            }
        }
    };
}

pub(crate) use simple_optimizer;

/// The adaptor of a fused optimizer built from its validated config.
pub(crate) fn adaptor<O, M, B>(
    optim: O,
    clipping: &Option<burn::optim::grad_clipping::GradientClippingConfig>,
) -> ScaledAdaptor<O, M, B>
where
    O: ScaledSimpleOptimizer<B::InnerBackend>,
    M: burn::module::AutodiffModule<B>,
    B: burn::tensor::backend::AutodiffBackend,
{
    ScaledAdaptor::new(optim).with_grad_clipping(clipping.as_ref().map(|c| c.init()))
}

/// The neutral signals on `device`: `found_inf = 0`, and `inv_scale = 1`, or -1 to
/// `maximize` (the gradient negated, as PyTorch's flag does first).
pub(crate) fn unscaled<B: Backend>(device: &B::Device, maximize: bool) -> Scaling<FloatTensor<B>> {
    use crate::grads::{f32_scalar, primitive};
    let sign = if maximize { -1.0 } else { 1.0 };
    Scaling::new(
        primitive(f32_scalar::<B>(sign, device)),
        primitive(f32_scalar::<B>(0.0, device)),
    )
}

/// The config a parameter of rank `rank` steps with: `config` itself, or a copy without weight
/// decay (`no_decay`) when the rank is under `min_rank` (with 2: biases and norm scales).
pub(crate) fn for_rank<C: Clone>(
    config: &C,
    rank: usize,
    min_rank: usize,
    no_decay: impl FnOnce(C) -> C,
) -> Cow<'_, C> {
    if rank < min_rank {
        Cow::Owned(no_decay(config.clone()))
    } else {
        Cow::Borrowed(config)
    }
}

/// Checks that `value` lies in `range`, naming the field otherwise.
pub(crate) fn check_range(
    optimizer: &'static str,
    field: &'static str,
    value: f32,
    ok: bool,
    expected: &'static str,
) -> Result<(), OptimError> {
    if ok && value.is_finite() {
        Ok(())
    } else {
        Err(OptimError::InvalidConfig {
            optimizer,
            field,
            value: value as f64,
            expected,
        })
    }
}

fn bytes<B: Backend, const D: usize>(t: &Tensor<B, D>) -> u64 {
    (t.shape().num_elements() * t.dtype().size()) as u64
}

/// `t` as f32 (a record loaded on a device whose default float is not f32 comes back in it).
fn as_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    if t.dtype() == burn::tensor::DType::F32 {
        t
    } else {
        t.cast(burn::tensor::DType::F32)
    }
}
