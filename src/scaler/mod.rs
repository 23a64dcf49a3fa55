//! A dynamic loss scaler with PyTorch `GradScaler` semantics, whose skip decision and scale
//! update stay on the device.
//!
//! f16 flushes gradients below 6e-8 to zero, so the loss is multiplied by a large scale
//! before backward and the gradients divided by it afterwards; a step whose gradients
//! overflowed is skipped and the scale backs off. bf16 has f32's range: at `Precision::Bf16`
//! or `F32` the scaler is a pass-through, so one training loop serves every precision.
//!
//! One call takes a step, whatever the optimizer ([`ScaledStep`]):
//!
//! ```ignore
//! let grads = GradientsParams::from_grads(scaler.scale(loss).backward(), &model);
//! let (model, report) = scaler.step(&mut optim, lr, model, grads)?; // skips on inf/NaN
//! scaler.update()?;                                                  // on the device
//! ```
//!
//! Each module's step walks an explicit state machine, like `torch/amp/grad_scaler.py`
//! (which keeps it per optimizer; here it is per module, the thing whose gradients are
//! unscaled and stepped):
//!
//! ```text
//!  Ready --unscale--> Unscaled --step--> Stepped --update--> Ready
//!    \____________________step____________/
//! ```
//! Several modules (a GAN's generator and discriminator) may each step once before one
//! `update`, which backs off if any of them overflowed. Misuse is a named [`ScalerError`].
//!
//! Host reads: with a [fused optimizer](crate::optim) a scaled step makes **none**:
//! `found_inf`, the scale and the step counts are device tensors and the kernels read them
//! there. With any other Burn optimizer, `step` reads `found_inf` once per step to decide the
//! skip, exactly as PyTorch does for non-fused optimizers.

mod config;
pub mod kernels;
mod record;
mod step;

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::{GradientsParams, LearningRate};
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use thiserror::Error;

pub use config::GradScalerConfig;
pub use kernels::{ScaleRule, ScaleState, ScalerKernels};
pub use record::GradScalerRecord;
pub use step::{ScaleSignals, ScaledStep, StepOutcome, Unfused};

use crate::Precision;
use crate::accumulate::AccumulationError;
use crate::grads::{GradList, f32_scalar, primitive, tensor};
use record::state_tensor;

/// Where a module is within one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Ready for `unscale` or `step`.
    Ready,
    /// Gradients were unscaled (and checked); `step` comes next.
    Unscaled,
    /// The optimizer step ran (or was skipped, or accumulated); `update` comes next.
    Stepped,
}

/// Misuse of the scaler, or a configuration it cannot run.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ScalerError {
    /// `unscale` was called twice for one module in one step.
    #[error(
        "unscale() was already called for this module since the last update(): gradients would be divided by the scale twice"
    )]
    UnscaleTwice,
    /// `unscale` after `step`.
    #[error("unscale() after step() for this module: call update() to finish the step first")]
    UnscaleAfterStep,
    /// `step` twice for one module without `update` in between.
    #[error(
        "step() was already called for this module since the last update(): call update() once per step"
    )]
    StepTwice,
    /// `update` before any `step`.
    #[error("update() before step(): the scale can only be updated after an optimizer step")]
    UpdateBeforeStep,
    /// A configuration value out of range.
    #[error("invalid GradScalerConfig: {field} = {value}, expected {expected}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
        /// What is allowed.
        expected: &'static str,
    },
    /// The run keeps overflowing with the scale at its floor.
    #[error(
        "the loss scale is stuck at min_scale = {min_scale} after {overflows} overflowing steps in a row: \
         the gradients overflow even unscaled. Look for a diverged run (lower the learning rate), \
         a bug producing inf/NaN, or train in Precision::Bf16, which needs no loss scaling"
    )]
    StuckAtMinScale {
        /// The floor.
        min_scale: f32,
        /// Overflows in a row at the floor.
        overflows: u32,
    },
    /// An accumulation window refused the step.
    #[error(transparent)]
    Accumulation(#[from] AccumulationError),
}

/// What a [`GradScaler::step`] did: the optimizer's [`StepOutcome`]. `found_inf` stays on the
/// device until asked for.
#[derive(Debug, Clone)]
pub struct StepReport<B: Backend> {
    outcome: StepOutcome<B>,
}

impl<B: Backend> StepReport<B> {
    /// Whether the step was skipped because the gradients held inf or NaN.
    /// Reads one value from the device.
    pub fn skipped(&self) -> bool {
        self.found_inf()
            .is_some_and(|f| f.into_scalar().elem::<f32>() != 0.0)
    }

    /// The overflow flag as a device tensor (`[1]`, 0 or 1): no read. `None` when nothing was
    /// checked (a pass-through scaler, or a micro-step inside an accumulation window).
    pub fn found_inf(&self) -> Option<Tensor<B, 1>> {
        match &self.outcome {
            StepOutcome::Stepped { found_inf } => found_inf.clone(),
            StepOutcome::Accumulated => None,
        }
    }

    /// Whether the gradients went into an accumulation window without an optimizer step
    /// (a micro-step before the window's boundary). No read.
    pub fn accumulated(&self) -> bool {
        matches!(self.outcome, StepOutcome::Accumulated)
    }
}

/// One module's progress through the current step.
#[derive(Debug, Clone)]
struct ModuleStep<B: Backend> {
    key: u64,
    stage: Stage,
    found_inf: Option<Tensor<B, 1>>,
}

/// The dynamic loss scaler. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct GradScaler<B: AutodiffBackend>
where
    B::InnerBackend: ScalerKernels,
{
    config: GradScalerConfig,
    rule: ScaleRule,
    enabled: bool,
    /// f32 `[4]`: see [`ScaleState`].
    state: Tensor<B::InnerBackend, 1>,
    /// The modules seen since the last `update`.
    modules: Vec<ModuleStep<B::InnerBackend>>,
    /// The overflow flags of steps whose update was put off ([`defer_update`](Self::defer_update)),
    /// for the next `update`.
    deferred: Option<Tensor<B::InnerBackend, 1>>,
    /// Times the scale may have changed: each `update` that ran and each `load_record`.
    generation: u64,
}

impl GradScalerConfig {
    /// A scaler on `device` for training at `precision`: active only for `Precision::F16`.
    pub fn init<B: AutodiffBackend>(
        &self,
        device: &B::Device,
        precision: Precision,
    ) -> Result<GradScaler<B>, ScalerError>
    where
        B::InnerBackend: ScalerKernels,
    {
        let rule = self.rule()?;
        let record = GradScalerRecord {
            scale: self.init_scale,
            growth_tracker: 0.0,
            hysteresis_left: self.hysteresis as f32,
            floor_overflows: 0.0,
            deferred_found_inf: None,
        };
        Ok(GradScaler {
            config: self.clone(),
            rule,
            enabled: self.enabled && precision.needs_loss_scaling(),
            state: state_tensor(&record, device),
            modules: Vec::new(),
            deferred: None,
            generation: 0,
        })
    }
}

/// A module's identity across steps: its first parameter's id (0 without parameters).
fn module_key<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> u64 {
    struct First(Option<u64>);
    impl<B: Backend> ModuleVisitor<B> for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.get_or_insert(param.id.val());
        }
    }
    let mut first = First(None);
    module.visit(&mut first);
    first.0.unwrap_or(0)
}

impl<B: AutodiffBackend> GradScaler<B>
where
    B::InnerBackend: ScalerKernels,
{
    /// Whether the scaler scales (f16 and enabled), or passes everything through.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The furthest stage any module reached since the last `update`.
    pub fn stage(&self) -> Stage {
        let reached = |s| self.modules.iter().any(|m| m.stage == s);
        if reached(Stage::Stepped) {
            Stage::Stepped
        } else if reached(Stage::Unscaled) {
            Stage::Unscaled
        } else {
            Stage::Ready
        }
    }

    /// `module`'s stage in the current step.
    pub fn stage_of<M: AutodiffModule<B>>(&self, module: &M) -> Stage {
        let key = module_key::<B, M>(module);
        self.modules
            .iter()
            .find(|m| m.key == key)
            .map_or(Stage::Ready, |m| m.stage)
    }

    /// The configuration.
    pub fn config(&self) -> &GradScalerConfig {
        &self.config
    }

    /// A counter of the events that may change the scale (each [`update`](Self::update) that
    /// updated it and each [`load_record`](Self::load_record)), read without touching the
    /// device. Equal values mean the scale did not change in between.
    pub fn scale_generation(&self) -> u64 {
        self.generation
    }

    /// The scale, f32 `[1]` on the device.
    pub(crate) fn scale_tensor(&self) -> Tensor<B::InnerBackend, 1> {
        self.state.clone().narrow(0, ScaleState::Scale as usize, 1)
    }

    /// The f32 `[4]` state ([`ScaleState`]), on the device.
    pub(crate) fn state(&self) -> Tensor<B::InnerBackend, 1> {
        self.state.clone()
    }

    /// `loss × scale`, for `backward`, in f32 (an f16 loss times 65536 would overflow). The
    /// scale is a device tensor: no read.
    pub fn scale<const D: usize>(&self, loss: Tensor<B, D>) -> Tensor<B, D> {
        if !self.enabled {
            return loss;
        }
        let scale = Tensor::<B, 1>::from_inner(self.scale_tensor()).reshape([1; D]);
        loss.cast(DType::F32) * scale
    }

    /// The entry of `module` in the current step, created at `Ready`.
    fn entry(&mut self, key: u64) -> &mut ModuleStep<B::InnerBackend> {
        let index = match self.modules.iter().position(|m| m.key == key) {
            Some(index) => index,
            None => {
                self.modules.push(ModuleStep {
                    key,
                    stage: Stage::Ready,
                    found_inf: None,
                });
                self.modules.len() - 1
            }
        };
        &mut self.modules[index]
    }

    /// Divides the gradients of `module` by the scale and records whether any is inf/NaN.
    /// Optional: call it before clipping or reading gradients yourself; [`step`](Self::step)
    /// does it otherwise. Each gradient is unscaled in the wider of its dtype and its
    /// parameter's, then cast to its parameter's.
    pub fn unscale<M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> Result<(), ScalerError> {
        let key = module_key::<B, M>(module);
        match self.entry(key).stage {
            Stage::Ready => {}
            Stage::Unscaled => return Err(ScalerError::UnscaleTwice),
            Stage::Stepped => return Err(ScalerError::UnscaleAfterStep),
        }
        let found_inf = if self.enabled {
            let inv_scale = self.scale_tensor().recip();
            let list = GradList::take::<B, M>(module, grads).widened();
            let (list, found_inf) = list.unscale_and_check(inv_scale, self.zero());
            list.to_param_dtypes().put::<B, M>(module, grads);
            Some(found_inf)
        } else {
            None
        };
        let entry = self.entry(key);
        entry.stage = Stage::Unscaled;
        entry.found_inf = found_inf;
        Ok(())
    }

    fn zero(&self) -> Tensor<B::InnerBackend, 1> {
        f32_scalar(0.0, &self.state.device())
    }

    /// Steps `optim` on `module`'s gradients, unless they overflowed: the one call for every
    /// optimizer ([`ScaledStep`]): burn-amp's fused ones (no host read), Burn's own, any
    /// other wrapped in [`Unfused`] (one read), and [`GradientAccumulation`](crate::GradientAccumulation)
    /// around them (mid-window it accumulates; the report says so).
    pub fn step<M, O>(
        &mut self,
        optim: &mut O,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<(M, StepReport<B::InnerBackend>), ScalerError>
    where
        M: AutodiffModule<B>,
        O: ScaledStep<M, B>,
    {
        let key = module_key::<B, M>(&module);
        let entry = self.entry(key);
        let (stage, checked) = (entry.stage, entry.found_inf.clone());
        let unscaled_before = checked.is_some();
        if stage == Stage::Stepped {
            return Err(ScalerError::StepTwice);
        }
        let signals = self.enabled.then(|| ScaleSignals {
            scale: self.scale_tensor(),
            inv_scale: (stage == Stage::Ready).then(|| self.scale_tensor().recip()),
            found_inf: checked,
            generation: self.generation,
        });
        let list = GradList::take::<B, M>(&module, &mut grads);
        // No gradient checked, no evidence: such a step neither grows nor backs off the scale
        // (PyTorch refuses it: "No inf checks were recorded for this optimizer"; a module all
        // frozen for a while is a plain case here).
        let evidence = !list.is_empty() || unscaled_before;
        let (module, outcome) = optim.step_scaled(lr, module, list, signals.as_ref())?;
        let report = StepReport { outcome };
        let entry = self.entry(key);
        entry.stage = Stage::Stepped;
        entry.found_inf = report.found_inf().filter(|_| evidence);
        Ok((module, report))
    }

    /// Updates the scale for the next step, on the device: back off after an overflow of any
    /// module, grow after `growth_interval` clean steps. After micro-steps that only
    /// accumulated, the scale stays: it changes at window boundaries only.
    pub fn update(&mut self) -> Result<(), ScalerError> {
        if !self.modules.iter().any(|m| m.stage == Stage::Stepped) {
            return Err(ScalerError::UpdateBeforeStep);
        }
        let found_inf = self.drain_found_inf();
        if let Some(found_inf) = found_inf.filter(|_| self.enabled) {
            self.state = tensor(B::InnerBackend::update_scale(
                primitive(self.state.clone()),
                primitive(found_inf),
                self.rule,
            ));
            self.generation += 1;
        }
        Ok(())
    }

    /// Finishes the step like [`update`](Self::update) (each module may step again) but leaves
    /// the scale as it is: the overflow flags wait for the next `update`, which backs off for
    /// them. For optimizers sharing the scaler while one of them holds gradients scaled by
    /// the current scale (an open accumulation window).
    pub(crate) fn defer_update(&mut self) -> Result<(), ScalerError> {
        if !self.modules.iter().any(|m| m.stage == Stage::Stepped) {
            return Err(ScalerError::UpdateBeforeStep);
        }
        self.deferred = self.drain_found_inf();
        Ok(())
    }

    /// The overflow flags of the steps since the last update (and of those put off), the
    /// modules' entries cleared.
    fn drain_found_inf(&mut self) -> Option<Tensor<B::InnerBackend, 1>> {
        self.modules
            .drain(..)
            .filter_map(|m| m.found_inf)
            .chain(self.deferred.take())
            .reduce(|a, b| a.max_pair(b))
    }

    /// The current scale (1 when the scaler passes through, as PyTorch's `get_scale`).
    /// Reads one value from the device.
    pub fn scale_value(&self) -> f32 {
        if self.enabled {
            self.record().scale
        } else {
            1.0
        }
    }

    /// Whether any module's gradients overflowed in this step (`None` before any was checked).
    /// Reads one value from the device.
    pub fn found_inf(&self) -> Option<bool> {
        self.modules
            .iter()
            .filter_map(|m| m.found_inf.clone())
            .reduce(|a, b| a.max_pair(b))
            .map(|f| f.into_scalar().elem::<f32>() != 0.0)
    }

    /// Fails when the run keeps overflowing at `min_scale`. Reads the state from the device:
    /// call it every few hundred steps, not every step.
    pub fn check(&self) -> Result<(), ScalerError> {
        let record = self.record();
        if record.floor_overflows >= self.config.max_floor_overflows as f32 {
            return Err(ScalerError::StuckAtMinScale {
                min_scale: self.config.min_scale,
                overflows: record.floor_overflows as u32,
            });
        }
        Ok(())
    }

    /// The state as a record. Reads the state from the device (and the overflow flag of an
    /// update put off, when one was).
    pub fn record(&self) -> GradScalerRecord {
        let values = self.state.clone().into_data().to_vec::<f32>().unwrap();
        let deferred_found_inf = self
            .deferred
            .as_ref()
            .map(|flag| flag.clone().into_scalar().elem::<f32>() != 0.0);
        GradScalerRecord {
            scale: values[ScaleState::Scale as usize],
            growth_tracker: values[ScaleState::GrowthTracker as usize],
            hysteresis_left: values[ScaleState::HysteresisLeft as usize],
            floor_overflows: values[ScaleState::FloorOverflows as usize],
            deferred_found_inf,
        }
    }

    /// Restores a saved state; the next step continues the saved trajectory (the flags of an
    /// update put off included: the next `update` counts them).
    pub fn load_record(mut self, record: GradScalerRecord) -> Self {
        let device = self.state.device();
        self.state = state_tensor(&record, &device);
        self.modules.clear();
        self.deferred = record
            .deferred_found_inf
            .map(|found| f32_scalar(if found { 1.0 } else { 0.0 }, &device));
        self.generation += 1;
        self
    }
}
