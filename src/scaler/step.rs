//! [`ScaledStep`]: the one step path of the loss scaler.

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{LearningRate, MultiGradientsParams, Optimizer, SimpleOptimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

use super::{ScalerError, ScalerKernels};
use crate::grads::{GradList, f32_scalar};

/// The loss scale of one step, as the scaler hands it to a [`ScaledStep`]: device tensors,
/// f32 `[1]` each, so that nothing needs a host read.
#[derive(Debug, Clone)]
pub struct ScaleSignals<B: Backend> {
    /// The loss scale the gradients were multiplied by.
    pub scale: Tensor<B, 1>,
    /// What to multiply the gradients by to unscale them; `None` when they are already
    /// unscaled (the user called [`GradScaler::unscale`](super::GradScaler::unscale)).
    pub inv_scale: Option<Tensor<B, 1>>,
    /// 1 if the gradients hold inf or NaN, else 0; `None` while they are unchecked.
    pub found_inf: Option<Tensor<B, 1>>,
    /// The scaler's [`scale_generation`](super::GradScaler::scale_generation): equal values
    /// mean an equal scale.
    pub generation: u64,
}

impl<B: Backend> ScaleSignals<B> {
    /// An f32 `[1]` zero on the scale's device: a fresh `found_inf`.
    pub fn zero(&self) -> Tensor<B, 1> {
        f32_scalar(0.0, &self.scale.device())
    }

    /// An f32 `[1]` one on the scale's device: the neutral `inv_scale`.
    pub fn one(&self) -> Tensor<B, 1> {
        f32_scalar(1.0, &self.scale.device())
    }
}

/// What a [`ScaledStep`] did.
#[derive(Debug, Clone)]
pub enum StepOutcome<B: Backend> {
    /// The optimizer step ran, or was skipped on the device when `found_inf` is 1 (`None`
    /// when nothing was scaled, hence nothing checked).
    Stepped {
        /// The overflow flag the step was decided on.
        found_inf: Option<Tensor<B, 1>>,
    },
    /// The gradients were added to an accumulation window; the window's check and step come
    /// at its boundary.
    Accumulated,
}

/// An optimizer the loss scaler can step.
///
/// The one step path: [`GradScaler::step`](super::GradScaler::step) hands the gradients and
/// the step's [`ScaleSignals`] to anything that is a [`ScaledStep`]:
///
/// - burn-amp's fused optimizers ([`ScaledAdaptor`](crate::optim::ScaledAdaptor)): the check
///   and the skip happen on the device, no host read;
/// - any Burn optimizer: Burn's own `OptimizerAdaptor` (Adam, AdamW, SGD, RMSProp, ...) as it
///   is, any other [`Optimizer`] wrapped in [`Unfused`]: the gradients are unscaled and cast to
///   their parameters' dtypes, and `found_inf` is read once to decide the skip (PyTorch's
///   non-fused path does the same);
/// - [`GradientAccumulation`](crate::GradientAccumulation) around either: mid-window it adds
///   the still-scaled gradients and reports [`StepOutcome::Accumulated`].
pub trait ScaledStep<M: AutodiffModule<B>, B: AutodiffBackend> {
    /// One step on `module`'s gradients. `scale` is `None` when they are not scaled (bf16,
    /// f32, or a disabled scaler): then this is a plain optimizer step, with each gradient in
    /// its parameter's dtype.
    fn step_scaled(
        &mut self,
        lr: LearningRate,
        module: M,
        grads: GradList<B::InnerBackend>,
        scale: Option<&ScaleSignals<B::InnerBackend>>,
    ) -> Result<(M, StepOutcome<B::InnerBackend>), ScalerError>;

    /// Whether it holds gradients still multiplied by the loss scale for a later step (an
    /// accumulation window begun under a scale): until it steps them, the scale must not
    /// change. Optimizers that share a scaler consult it before the scale's update
    /// ([`AmpOptimizer::share_scaler`](crate::AmpOptimizer::share_scaler)).
    fn holds_scaled_gradients(&self) -> bool {
        false
    }

    /// The global L2 norm of the last step's gradients (unscaled, before clipping), f32 `[1]`
    /// on the device, where the optimizer computes it (a
    /// [`GradientAccumulation`](crate::GradientAccumulation) that clips); `None` elsewhere.
    /// What [`GradNormMetric`](crate::amp_optimizer::GradNormMetric) shows.
    fn last_grad_norm(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        None
    }
}

/// Any Burn [`Optimizer`] as a [`ScaledStep`]: one host read of `found_inf` per step. Burn's
/// own `OptimizerAdaptor` (what `AdamConfig::init` and the like return) needs no wrapper.
#[derive(Debug, Clone)]
pub struct Unfused<O>(pub O);

impl<M, B, O> Optimizer<M, B> for Unfused<O>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    O: Optimizer<M, B>,
{
    type Record = O::Record;

    fn step(&mut self, lr: LearningRate, module: M, grads: burn::optim::GradientsParams) -> M {
        self.0.step(lr, module, grads)
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        self.0.step_multi(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.0.to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        Self(self.0.load_record(record))
    }
}

/// The host-checked step of a Burn optimizer: unscale and check in one pass, read
/// `found_inf`, and step unless it is set, each gradient cast to its parameter's dtype.
fn host_checked_step<M, B, O>(
    optim: &mut O,
    lr: LearningRate,
    module: M,
    grads: GradList<B::InnerBackend>,
    scale: Option<&ScaleSignals<B::InnerBackend>>,
) -> (M, StepOutcome<B::InnerBackend>)
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    B::InnerBackend: ScalerKernels,
    O: Optimizer<M, B>,
{
    // Widened first, so that f16 gradients of f32 parameters are unscaled in f32, and f32
    // gradients of f16 parameters are cast to f16 once unscaled, not before.
    let grads = grads.widened();
    let Some(scale) = scale else {
        let grads = grads.to_param_dtypes().into_params::<B, M>(&module);
        return (
            optim.step(lr, module, grads),
            StepOutcome::Stepped { found_inf: None },
        );
    };
    let (grads, found_inf) = match (&scale.inv_scale, &scale.found_inf) {
        (None, Some(found)) => (grads, found.clone()),
        (None, None) => {
            let found = grads.check_finite(scale.zero());
            (grads, found)
        }
        (Some(inv), found) => {
            grads.unscale_and_check(inv.clone(), found.clone().unwrap_or_else(|| scale.zero()))
        }
    };
    let skipped = found_inf.clone().into_scalar().elem::<f32>() != 0.0;
    let outcome = StepOutcome::Stepped {
        found_inf: Some(found_inf),
    };
    if skipped {
        return (module, outcome);
    }
    let grads = grads.to_param_dtypes().into_params::<B, M>(&module);
    (optim.step(lr, module, grads), outcome)
}

impl<M, B, O> ScaledStep<M, B> for Unfused<O>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    B::InnerBackend: ScalerKernels,
    O: Optimizer<M, B>,
{
    fn step_scaled(
        &mut self,
        lr: LearningRate,
        module: M,
        grads: GradList<B::InnerBackend>,
        scale: Option<&ScaleSignals<B::InnerBackend>>,
    ) -> Result<(M, StepOutcome<B::InnerBackend>), ScalerError> {
        Ok(host_checked_step(&mut self.0, lr, module, grads, scale))
    }
}

impl<M, B, O> ScaledStep<M, B> for OptimizerAdaptor<O, M, B>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    B::InnerBackend: ScalerKernels,
    O: SimpleOptimizer<B::InnerBackend>,
{
    fn step_scaled(
        &mut self,
        lr: LearningRate,
        module: M,
        grads: GradList<B::InnerBackend>,
        scale: Option<&ScaleSignals<B::InnerBackend>>,
    ) -> Result<(M, StepOutcome<B::InnerBackend>), ScalerError> {
        Ok(host_checked_step(self, lr, module, grads, scale))
    }
}
