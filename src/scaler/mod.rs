//! A dynamic loss scaler with PyTorch `GradScaler` semantics, whose skip decision and scale
//! update stay on the device.
//!
//! f16 flushes gradients below 6e-8 to zero, so the loss is multiplied by a large scale
//! before backward and the gradients divided by it afterwards; a step whose gradients
//! overflowed is skipped and the scale backs off. bf16 has f32's range: at `Precision::Bf16`
//! or `F32` the scaler is a pass-through, so one training loop serves every precision.
//!
//! Each step walks an explicit state machine, like `torch/amp/grad_scaler.py`:
//!
//! ```text
//!  Ready --unscale--> Unscaled --step--> Stepped --update--> Ready
//!    \____________________step____________/
//! ```
//! Misuse is a named [`ScalerError`], never a silent double unscale.
//!
//! Host reads: with a [fused optimizer](fused) a scaled step makes **none**: `found_inf`,
//! the scale and the step count are device tensors and the kernels read them there. With any
//! other Burn optimizer, [`GradScaler::step`] reads `found_inf` once per step to decide the
//! skip, exactly as PyTorch does for non-fused optimizers.

mod config;
pub mod fused;
mod grads;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, LearningRate, Optimizer};
use burn::prelude::*;
use burn::record::Record;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use thiserror::Error;

pub use config::GradScalerConfig;
pub use fused::{FusedAdamW, FusedAdamWConfig, FusedOptimizer, FusedSgd, FusedSgdConfig};

use crate::Precision;
use crate::kernels::{AmpKernels, ScaleRule, ScaleState};

/// Where a scaler is within one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Ready for `unscale` or `step`.
    Ready,
    /// Gradients were unscaled (and checked); `step` comes next.
    Unscaled,
    /// The optimizer step ran (or was skipped); `update` comes next.
    Stepped,
}

/// Misuse of the scaler, or a configuration it cannot run.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ScalerError {
    /// `unscale` was called twice in one step.
    #[error(
        "unscale() was already called since the last update(): gradients would be divided by the scale twice"
    )]
    UnscaleTwice,
    /// `unscale` after `step`.
    #[error("unscale() after step(): call update() to finish the step first")]
    UnscaleAfterStep,
    /// `step` twice without `update` in between.
    #[error("step() was already called since the last update(): call update() once per step")]
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
}

/// What a [`GradScaler::step`] did. `found_inf` stays on the device until asked for.
#[derive(Debug, Clone)]
pub struct StepReport<B: Backend> {
    found_inf: Option<Tensor<B, 1>>,
}

impl<B: Backend> StepReport<B> {
    /// Whether the step was skipped because the gradients held inf or NaN.
    /// Reads one value from the device.
    pub fn skipped(&self) -> bool {
        self.found_inf
            .as_ref()
            .is_some_and(|f| f.clone().into_scalar().elem::<f32>() != 0.0)
    }

    /// The overflow flag as a device tensor (`[1]`, 0 or 1): no read.
    pub fn found_inf(&self) -> Option<Tensor<B, 1>> {
        self.found_inf.clone()
    }
}

/// The scaler's state as plain numbers, a Burn [`Record`]: save it beside the model and
/// optimizer records, load it to continue the same scale trajectory.
#[derive(Record, Debug, Clone, PartialEq)]
pub struct GradScalerRecord {
    /// The loss scale.
    pub scale: f32,
    /// Clean steps since the last growth or overflow.
    pub growth_tracker: f32,
    /// Overflows still tolerated before backing off.
    pub hysteresis_left: f32,
    /// Overflows in a row at the floor.
    pub floor_overflows: f32,
}

/// The dynamic loss scaler. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct GradScaler<B: AutodiffBackend>
where
    B::InnerBackend: AmpKernels,
{
    config: GradScalerConfig,
    rule: ScaleRule,
    enabled: bool,
    stage: Stage,
    /// f32 `[4]`: see [`ScaleState`].
    state: Tensor<B::InnerBackend, 1>,
    /// f32 `[1]` of this step, from `unscale`.
    found_inf: Option<Tensor<B::InnerBackend, 1>>,
    inv_scale: Option<Tensor<B::InnerBackend, 1>>,
    /// Times the scale may have changed: each `update` and `load_record`.
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
        B::InnerBackend: AmpKernels,
    {
        let rule = self.validate()?;
        let state =
            Tensor::from_floats([self.init_scale, 0.0, self.hysteresis as f32, 0.0], device);
        Ok(GradScaler {
            config: self.clone(),
            rule,
            enabled: self.enabled && precision.needs_loss_scaling(),
            stage: Stage::Ready,
            state,
            found_inf: None,
            inv_scale: None,
            generation: 0,
        })
    }
}

fn primitive<B: Backend>(t: Tensor<B, 1>) -> burn_backend::tensor::FloatTensor<B> {
    t.into_primitive().tensor()
}

fn tensor<B: Backend>(t: burn_backend::tensor::FloatTensor<B>) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

impl<B: AutodiffBackend> GradScaler<B>
where
    B::InnerBackend: AmpKernels,
{
    /// Whether the scaler scales (f16 and enabled), or passes everything through.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The step's stage.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The configuration.
    pub fn config(&self) -> &GradScalerConfig {
        &self.config
    }

    /// A counter of the events that may change the scale (each [`update`](Self::update) and
    /// [`load_record`](Self::load_record)), read without touching the device. Equal values
    /// mean the scale did not change in between: gradient accumulation uses it to check
    /// that every micro-batch of a window was scaled alike.
    pub fn scale_generation(&self) -> u64 {
        self.generation
    }

    fn scale_tensor(&self) -> Tensor<B::InnerBackend, 1> {
        self.state.clone().narrow(0, ScaleState::Scale as usize, 1)
    }

    /// `loss × scale`, for `backward`. The scale is a device tensor: no read.
    pub fn scale<const D: usize>(&self, loss: Tensor<B, D>) -> Tensor<B, D> {
        if !self.enabled {
            return loss;
        }
        let scale = Tensor::<B, 1>::from_inner(self.scale_tensor());
        let scale = scale.cast(loss.dtype()).reshape([1; D]);
        loss * scale
    }

    /// Divides the gradients of `module` by the scale and records whether any is inf/NaN.
    /// Optional: call it before gradient clipping; [`step`](Self::step) does it otherwise.
    pub fn unscale<M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> Result<(), ScalerError> {
        match self.stage {
            Stage::Ready => {}
            Stage::Unscaled => return Err(ScalerError::UnscaleTwice),
            Stage::Stepped => return Err(ScalerError::UnscaleAfterStep),
        }
        self.stage = Stage::Unscaled;
        if !self.enabled {
            return Ok(());
        }
        let inv_scale = self.scale_tensor().recip();
        let found_inf = Tensor::<B::InnerBackend, 1>::zeros([1], &inv_scale.device());
        let (ids, list): (Vec<_>, Vec<_>) = grads::take::<B, M>(module, grads).into_iter().unzip();
        let (list, found_inf) = B::InnerBackend::unscale_and_check(
            list,
            primitive(inv_scale.clone()),
            primitive(found_inf),
        );
        grads::put::<B, M>(module, grads, ids.into_iter().zip(list).collect());
        self.found_inf = Some(tensor(found_inf));
        // The gradients now hold true values: the optimizer must not divide again.
        self.inv_scale = Some(inv_scale.ones_like());
        Ok(())
    }

    fn begin_step(&mut self) -> Result<(), ScalerError> {
        match self.stage {
            Stage::Stepped => Err(ScalerError::StepTwice),
            Stage::Ready | Stage::Unscaled => Ok(()),
        }
    }

    /// Unscales if still needed, then runs `optim` unless the gradients overflowed.
    ///
    /// Works with any Burn optimizer, at the cost of one host read of `found_inf` per step
    /// (like PyTorch's non-fused path). [`step_fused`](Self::step_fused) makes none.
    pub fn step<M, O>(
        &mut self,
        optim: &mut O,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<(M, StepReport<B::InnerBackend>), ScalerError>
    where
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        self.begin_step()?;
        if self.stage == Stage::Ready {
            self.unscale(&module, &mut grads)?;
        }
        self.stage = Stage::Stepped;
        let report = StepReport {
            found_inf: self.found_inf.clone(),
        };
        if report.skipped() {
            return Ok((module, report));
        }
        Ok((optim.step(lr, module, grads), report))
    }

    /// Like [`step`](Self::step) with a [fused optimizer](fused): the unscale, the skip and
    /// the update happen in its kernels, with no host read.
    pub fn step_fused<M, O>(
        &mut self,
        optim: &mut O,
        lr: LearningRate,
        module: M,
        grads: GradientsParams,
    ) -> Result<(M, StepReport<B::InnerBackend>), ScalerError>
    where
        M: AutodiffModule<B>,
        O: FusedOptimizer<B>,
    {
        self.begin_step()?;
        let mut grads = grads;
        if self.stage == Stage::Ready {
            // One pass over every gradient: the skip must be decided for all parameters
            // before any of them is updated.
            self.unscale(&module, &mut grads)?;
        }
        let (inv_scale, found_inf) = (self.inv_scale.clone(), self.found_inf.clone());
        self.stage = Stage::Stepped;
        let module = optim.step_scaled(lr, module, grads, inv_scale, found_inf);
        Ok((
            module,
            StepReport {
                found_inf: self.found_inf.clone(),
            },
        ))
    }

    /// Updates the scale for the next step, on the device: back off after an overflow,
    /// grow after `growth_interval` clean steps.
    pub fn update(&mut self) -> Result<(), ScalerError> {
        if self.stage != Stage::Stepped {
            return Err(ScalerError::UpdateBeforeStep);
        }
        self.stage = Stage::Ready;
        self.inv_scale = None;
        self.generation += 1;
        let Some(found_inf) = self.found_inf.take() else {
            return Ok(());
        };
        self.state = tensor(B::InnerBackend::update_scale(
            primitive(self.state.clone()),
            primitive(found_inf),
            self.rule,
        ));
        Ok(())
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

    /// Whether this step's gradients overflowed (`None` before unscale/step).
    /// Reads one value from the device.
    pub fn found_inf(&self) -> Option<bool> {
        self.found_inf
            .as_ref()
            .map(|f| f.clone().into_scalar().elem::<f32>() != 0.0)
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

    /// The state as a record. Reads the state from the device.
    pub fn record(&self) -> GradScalerRecord {
        let values = self.state.clone().into_data().to_vec::<f32>().unwrap();
        GradScalerRecord {
            scale: values[ScaleState::Scale as usize],
            growth_tracker: values[ScaleState::GrowthTracker as usize],
            hysteresis_left: values[ScaleState::HysteresisLeft as usize],
            floor_overflows: values[ScaleState::FloorOverflows as usize],
        }
    }

    /// Restores a saved state; the next step continues the saved trajectory.
    pub fn load_record(mut self, record: GradScalerRecord) -> Self {
        let device = self.state.device();
        self.state = Tensor::from_floats(
            [
                record.scale,
                record.growth_tracker,
                record.hysteresis_left,
                record.floor_overflows,
            ],
            &device,
        );
        self.stage = Stage::Ready;
        self.found_inf = None;
        self.inv_scale = None;
        self.generation += 1;
        self
    }
}
