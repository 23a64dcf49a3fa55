//! What an optimizer's last call did, as a weight average needs it: a micro-step of an
//! accumulation window changed no weight (not averaged), a step checked for overflow may have
//! been skipped (averaged times `1 − found_inf`, on the device), any other step was taken.

use burn::module::AutodiffModule;
use burn::optim::SimpleOptimizer;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

use crate::optim::{ScaledAdaptor, ScaledSimpleOptimizer};
use crate::scaler::ScalerKernels;
use crate::{AmpOptimizer, GradientAccumulation};

/// What the last call to an optimizer's step did.
#[derive(Debug, Clone)]
pub enum LastStep<B: Backend> {
    /// The gradients went into an accumulation window: no weight changed.
    Accumulated,
    /// An optimizer step was taken.
    Taken,
    /// An optimizer step was taken unless this flag (f32 `[1]` on the device, 0 or 1) is 1:
    /// skipped on an overflow.
    Checked(Tensor<B, 1>),
}

/// An optimizer that tells what its last step did, for
/// [`ModelEma::update_after`](crate::ModelEma::update_after) and
/// [`EmaOptimizer`](crate::ema::EmaOptimizer). Burn's `OptimizerAdaptor` (what
/// `AdamConfig::init` and the others return) always steps; implement it for an optimizer of
/// your own that may not.
pub trait ReportsLastStep<B: AutodiffBackend> {
    /// What the last call to `step` did.
    fn last_step(&self) -> LastStep<B::InnerBackend>;
}

impl<O, B> ReportsLastStep<B> for AmpOptimizer<O, B>
where
    B: AutodiffBackend,
    B::InnerBackend: ScalerKernels,
{
    fn last_step(&self) -> LastStep<B::InnerBackend> {
        match (self.last_step_taken(), self.last_found_inf()) {
            (false, _) => LastStep::Accumulated,
            (true, Some(found_inf)) => LastStep::Checked(found_inf),
            (true, None) => LastStep::Taken,
        }
    }
}

impl<O, B: AutodiffBackend> ReportsLastStep<B> for GradientAccumulation<O, B> {
    /// A window that just closed stepped its optimizer (unscaled: a scaled one is inside an
    /// [`AmpOptimizer`], which reports the check).
    fn last_step(&self) -> LastStep<B::InnerBackend> {
        match self.micro_step() {
            0 => LastStep::Taken,
            _ => LastStep::Accumulated,
        }
    }
}

impl<O, M, B> ReportsLastStep<B> for OptimizerAdaptor<O, M, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    fn last_step(&self) -> LastStep<B::InnerBackend> {
        LastStep::Taken
    }
}

impl<O, M, B> ReportsLastStep<B> for ScaledAdaptor<O, M, B>
where
    O: ScaledSimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    /// Stepped as a Burn optimizer (not inside an [`AmpOptimizer`]): unscaled, always taken.
    fn last_step(&self) -> LastStep<B::InnerBackend> {
        LastStep::Taken
    }
}
