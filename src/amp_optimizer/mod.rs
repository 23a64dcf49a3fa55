//! [`AmpOptimizer`]: the front door. Wrap the optimizer you already have, once; the loss is
//! scaled inside `backward`, the gradients unscaled, checked and the step skipped on inf/NaN
//! inside `step`, the scale updated on the device. Nothing else in the training code changes,
//! so it works where the loop is not yours: burn-train's `Learner` calls `loss.backward()` in
//! the user's `TrainStep` and `Optimizer::step` after it.
//!
//! ```ignore
//! type B = Amp<Autodiff<Wgpu>>;                 // autocast by type (f16 on wgpu)
//! let optim = AmpOptimizer::new(AdamConfig::new().init::<B, Model<B>>(), GradScalerConfig::new())?;
//! // a hand-written loop, unchanged:
//! let grads = GradientsParams::from_grads(loss.backward(), &model);
//! model = optim.step(lr, model, grads);
//! // or burn-train: Learner::new(model, optim, scheduler)
//! ```
//!
//! ## What happens, per precision
//! - **f16**: while the optimizer lives, `Amp<B>`'s `backward` multiplies the loss (in f32)
//!   by the current scale of its device (kept per backend type and device, `registry.rs`).
//!   `step` divides the gradients by it, checks them for inf/NaN and steps or skips on the
//!   device (no host read with burn-amp's fused optimizers, one with Burn's own:
//!   [`ScaledStep`]), then updates the scale on the device and hands it to the next backward
//!   of every device.
//! - **bf16, f32** (or a `GradScalerConfig` with `enabled = false`): no backward is scaled,
//!   and `step` is the wrapped optimizer's step. One program serves every precision.
//!
//! ## Gradients between `backward` and `step`
//! At f16 the gradients that `backward` returns are *scaled* (× the loss scale, 65536 at
//! first), as with PyTorch's `scaler.scale(loss).backward()`. Code that reads them before the
//! step (logging a norm, clipping by hand) sees scaled values; clip with the wrapped
//! optimizer's own `GradientClipping` (it runs on unscaled gradients) or divide by
//! [`AmpOptimizer::scale`]. Summing gradients of several backwards before one step (burn-train's
//! `grads_accumulation`) is correct: the scale only changes at a step.
//!
//! ## Gradient accumulation
//! Compose, `AmpOptimizer::new(GradientAccumulation::new(adam, 4)?, ..)`: the window adds the
//! still-scaled gradients; at its boundary they are unscaled and checked once, the whole window
//! is stepped or skipped once, and the scale changes only there.
//!
//! ## Several optimizers
//! Two models with two optimizers (a GAN's generator and discriminator, PyTorch's "multiple
//! models, losses and optimizers"): make the second from the first, which shares its scale.
//!
//! ```ignore
//! let mut g_optim = AmpOptimizer::new(g_adam, GradScalerConfig::new())?;
//! let mut d_optim = g_optim.share_scaler(d_adam);
//! // d_loss.backward(), d_optim.step(..), g_loss.backward(), g_optim.step(..); or both
//! // backwards, then both steps
//! ```
//!
//! Each skips on its own gradients; the scale is updated once after their steps, backing off
//! if any of them overflowed, at the next backward (so that each step unscales with the scale
//! its backward used, whether both backwards come before both steps or not). One update per
//! backward that follows steps: a GAN's loop (a backward and a step, twice) updates twice per
//! iteration, as Accelerate does; PyTorch's loop for several losses (both backwards, then both
//! steps) once, as its `scaler.update()` does. So each optimizer steps before the first
//! backward that follows another's step: in `backward A, backward B, step B, backward C,
//! step A`, A would unscale with the scale updated at C (nothing tells whose backward C is).
//!
//! One of them in a [`GradientAccumulation`](crate::GradientAccumulation) window holds the
//! scale until the window's boundary (the window's sums carry it): the others skip on their
//! overflows at once, and the scale backs off for them after the boundary.
//!
//! ## Several devices
//! One scale for all devices: a worker's first backward after a step copies the scale to its
//! device. With burn-train's `MultiDeviceOptim::OptimMainDevice` the gradients of all devices
//! are summed on the main device before the check, so an overflow on any device (inf or NaN
//! survives the sum) makes the one step skip; with `OptimSharded` each parameter's gradients
//! are summed on one device and all of them are checked together before any is stepped: one
//! decision for all devices either way.

pub mod metrics;
pub(crate) mod registry;
mod shared;

use std::sync::Arc;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::DeviceOps;
use thiserror::Error;

pub use metrics::{
    ActivationMemoryMetric, GradNormMetric, LossScaleMetric, ScalerMonitor, ScalerSnapshot,
    SkippedStepsMetric, StepCounts, StepMemoryFigures, StepMemoryMetric,
};

use metrics::{MemoryProbe, SamplePoint};
use shared::{MemberToken, ScalerCell, ScalerSlot};

use crate::Precision;
use crate::grads::{GradList, f32_scalar, primitive};
use crate::memory::DeviceMemory;
use crate::scaler::{
    GradScalerConfig, GradScalerRecord, ScaledStep, ScalerError, ScalerKernels, StepOutcome,
};

/// What can go wrong when making or stepping an [`AmpOptimizer`].
#[derive(Debug, Clone, PartialEq, Error)]
pub enum AmpOptimizerError {
    /// A second `AmpOptimizer::new` for a backend that already has a live one (several
    /// optimizers: [`AmpOptimizer::share_scaler`]).
    #[error(
        "an AmpOptimizer is already installed for backend {backend}, and backward scales the \
         loss by its scale. Wrap the optimizer once (one AmpOptimizer around the whole model), \
         or drop the first before making another. For several optimizers, each over its own \
         module (a GAN's generator and discriminator), make the others from the first, which \
         share its scale: `let d_optim = g_optim.share_scaler(d_adam)`"
    )]
    AlreadyInstalled {
        /// The training backend's type name.
        backend: &'static str,
    },
    /// The scaler refused (configuration, or an accumulation window).
    #[error(transparent)]
    Scaler(#[from] ScalerError),
}

/// Uninstalls the backward hook when the optimizer's last clone is dropped.
#[derive(Debug)]
struct Installation(u64);

impl Drop for Installation {
    fn drop(&mut self) {
        registry::uninstall(self.0);
    }
}

/// An optimizer with automatic loss scaling. See the [module docs](self).
#[derive(Clone)]
pub struct AmpOptimizer<O, B: AutodiffBackend>
where
    B::InnerBackend: ScalerKernels,
{
    inner: O,
    config: GradScalerConfig,
    /// The scaler, its own or shared ([`share_scaler`](Self::share_scaler)).
    slot: ScalerSlot<B>,
    /// This optimizer among those sharing the scaler (0: the one that installed it).
    member: usize,
    /// Alive while this optimizer (any clone) is: a window it held stops holding the shared
    /// scale once it is dropped.
    token: MemberToken,
    /// Skipped steps so far, f32 `[1]` on the scaler's device (no read to count them).
    skipped: Option<Tensor<B::InnerBackend, 1>>,
    /// Skipped steps of a loaded record, where the count starts when the scaler is made.
    loaded_skipped: u64,
    /// The overflow flag of the last step, when it checked one.
    last_found_inf: Option<Tensor<B::InnerBackend, 1>>,
    /// Whether the last call took (or skipped) an optimizer step, not only accumulated.
    last_step_taken: bool,
    installation: Option<Arc<Installation>>,
    monitor: ScalerMonitor,
}

impl<O, B> core::fmt::Debug for AmpOptimizer<O, B>
where
    B: AutodiffBackend,
    B::InnerBackend: ScalerKernels,
{
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("AmpOptimizer")
            .field("config", &self.config)
            .field("installed", &self.installation.is_some())
            .finish_non_exhaustive()
    }
}

impl<O, B> AmpOptimizer<O, B>
where
    B: AutodiffBackend,
    B::InnerBackend: ScalerKernels,
{
    /// Wraps `optimizer` (any Burn optimizer; burn-amp's fused ones make no host read per
    /// step) and installs the loss scaling of `backward` on `B` (the module docs say how).
    pub fn new<M>(optimizer: O, config: GradScalerConfig) -> Result<Self, AmpOptimizerError>
    where
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        config.validate()?;
        let monitor = ScalerMonitor::default();
        let installation = if config.enabled {
            let owner =
                registry::install::<B>(config.init_scale, monitor.clone()).map_err(|()| {
                    AmpOptimizerError::AlreadyInstalled {
                        backend: core::any::type_name::<B>(),
                    }
                })?;
            Some(Arc::new(Installation(owner)))
        } else {
            None
        };
        Ok(Self {
            inner: optimizer,
            config,
            slot: ScalerSlot::Own(ScalerCell::default()),
            member: 0,
            token: MemberToken::default(),
            skipped: None,
            loaded_skipped: 0,
            last_found_inf: None,
            last_step_taken: false,
            installation,
            monitor,
        })
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The wrapped optimizer, to load its state or tune it between steps.
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// The scaler's configuration.
    pub fn config(&self) -> &GradScalerConfig {
        &self.config
    }

    /// What the loss-scale and skipped-steps metrics read ([`metrics`]).
    pub fn monitor(&self) -> ScalerMonitor {
        self.monitor.clone()
    }

    /// The loss scale the next f16 backward is multiplied by (the configured or loaded one
    /// before the first scaled step); 1 when the scaler is disabled. Backwards at bf16/f32 are
    /// not scaled whatever this says. Reads one value from the device.
    pub fn scale(&self) -> f32 {
        let installed = self.installation.is_some();
        self.slot
            .with_ref(|cell| match (cell.settled(), &cell.loaded) {
                (Some(scaler), _) => scaler.scale_value(),
                (None, Some(record)) => record.scale,
                (None, None) if installed => self.config.init_scale,
                (None, None) => 1.0,
            })
    }

    /// The scaler's state (1.0 scale and zeros before the first scaled step). Reads the state
    /// from the device.
    pub fn scaler_record(&self) -> Option<GradScalerRecord> {
        self.slot.with_ref(|cell| match cell.settled() {
            Some(scaler) => Some(scaler.record()),
            None => cell.loaded.clone(),
        })
    }

    /// Fails when the run keeps overflowing at `min_scale` (a bug or a diverged run, not a
    /// scale problem). Reads the state from the device: call it now and then.
    pub fn check(&self) -> Result<(), ScalerError> {
        self.slot
            .with_ref(|cell| cell.settled().map_or(Ok(()), |scaler| scaler.check()))
    }

    /// Whether the last step's gradients overflowed (so it was skipped), as an f32 `[1]` device
    /// tensor, 0 or 1: no read. `None` when the last step checked nothing (bf16/f32, or a
    /// micro-step inside an accumulation window).
    pub fn last_found_inf(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        self.last_found_inf.clone()
    }

    /// Whether the last [`try_step`](Self::try_step) took an optimizer step (or skipped one on
    /// an overflow: [`last_found_inf`](Self::last_found_inf) says which), rather than only
    /// adding the gradients to an accumulation window. What a weight average reads
    /// ([`ModelEma::update_after`](crate::ModelEma::update_after)).
    pub fn last_step_taken(&self) -> bool {
        self.last_step_taken
    }

    /// Restores the scaler's state (the scale trajectory continues from it); the wrapped
    /// optimizer's state is loaded separately ([`Optimizer::load_record`] loads both).
    pub fn load_scaler_record(&mut self, record: GradScalerRecord) {
        let owner = self.owner();
        self.slot.with(|cell| {
            // A loaded state replaces what the steps before it would have updated.
            cell.pending = false;
            let scale = record.scale;
            match cell.scaler.take() {
                Some(scaler) => {
                    let scaler = scaler.load_record(record);
                    if let Some(owner) = owner {
                        registry::publish::<B::InnerBackend>(
                            owner,
                            primitive(scaler.scale_tensor()),
                        );
                    }
                    cell.scaler = Some(scaler);
                }
                None => {
                    cell.loaded = Some(record);
                    if let Some(owner) = owner {
                        registry::reset(owner, scale);
                    }
                }
            }
        });
    }

    /// Optimizer steps taken or skipped, and skipped, since the start of training (a loaded
    /// record's included). Reads the skip count from the device.
    pub fn step_counts(&self) -> StepCounts {
        let snapshot = self.monitor.snapshot();
        StepCounts {
            optimizer_steps: snapshot.optimizer_steps,
            skipped_steps: snapshot.skipped_steps,
        }
    }

    /// Continues the counts of a record ([`Optimizer::load_record`] does it).
    fn load_step_counts(&mut self, counts: StepCounts, scale: Option<f32>) {
        self.loaded_skipped = counts.skipped_steps;
        if let Some(skipped) = &mut self.skipped {
            *skipped = f32_scalar(counts.skipped_steps as f32, &skipped.device());
        }
        self.monitor.resume(counts, scale);
    }

    fn owner(&self) -> Option<u64> {
        self.installation.as_ref().map(|i| i.0)
    }

    /// Another optimizer (over another module: a GAN's discriminator beside its generator,
    /// a second loss's model) with this one's loss scaling: one scale, which every backward
    /// multiplies by, updated once after the steps of both (backing off if either overflowed)
    /// at the next backward, so that each step unscales with the scale its backward used
    /// whether the loop runs both backwards before both steps or each before its step (and
    /// not while either holds an accumulation window: [module docs](self)). Each
    /// optimizer skips on its own gradients and counts its own steps; [`scale`](Self::scale)
    /// and the records of both say the one scale that the next backward will use (that update
    /// included: a checkpoint resumes the run). Call it on either for a third. With the scaler
    /// disabled, the new one is disabled too.
    pub fn share_scaler<O2>(&mut self, optimizer: O2) -> AmpOptimizer<O2, B>
    where
        B: 'static,
    {
        let (slot, member) = match self.owner() {
            Some(owner) => self.slot.share(owner),
            None => (ScalerSlot::Own(ScalerCell::default()), 0),
        };
        AmpOptimizer {
            inner: optimizer,
            config: self.config.clone(),
            slot,
            member,
            token: MemberToken::default(),
            skipped: None,
            loaded_skipped: 0,
            last_found_inf: None,
            last_step_taken: false,
            installation: self.installation.clone(),
            monitor: ScalerMonitor::default(),
        }
    }

    /// One step; the fallible form of [`Optimizer::step`].
    pub fn try_step<M>(
        &mut self,
        lr: LearningRate,
        module: M,
        grads: GradientsParams,
    ) -> Result<M, AmpOptimizerError>
    where
        M: AutodiffModule<B>,
        O: ScaledStep<M, B>,
    {
        self.last_step_taken = false;
        // The device of the module's first parameter: where the scaler lives.
        let Some(device) = module.devices().into_iter().next() else {
            return Ok(module);
        };
        self.monitor.sample(SamplePoint::StepStart, &device);
        let (module, stepped, figures) = self.step_on(&device, lr, module, grads)?;
        self.last_step_taken = stepped;
        self.monitor.sample(SamplePoint::StepEnd, &device);
        let grad_norm = stepped.then(|| self.inner.last_grad_norm()).flatten();
        self.monitor.record(stepped, figures, grad_norm);
        crate::doctor::step_boundary();
        Ok(module)
    }

    /// The step itself: the module, whether an optimizer step was taken or skipped (not only
    /// accumulated), and the scaler's state and skip count after a scaled one.
    #[allow(clippy::type_complexity)]
    fn step_on<M>(
        &mut self,
        device: &B::Device,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<
        (
            M,
            bool,
            Option<(Tensor<B::InnerBackend, 1>, Tensor<B::InnerBackend, 1>)>,
        ),
        AmpOptimizerError,
    >
    where
        M: AutodiffModule<B>,
        O: ScaledStep<M, B>,
    {
        let scaled = self.owner().map_or(0, |owner| {
            registry::take_scaled_backwards(owner, self.member, device.id())
        });
        self.last_found_inf = None;
        if scaled == 0 {
            // bf16, f32, or disabled: the wrapped optimizer's own step.
            let list = GradList::take::<B, M>(&module, &mut grads);
            let (module, outcome) = self.inner.step_scaled(lr, module, list, None)?;
            return Ok((module, matches!(outcome, StepOutcome::Stepped { .. }), None));
        }
        let (deferred, member) = (self.slot.deferred(), self.member);
        let (config, inner, token) = (&self.config, &mut self.inner, &self.token);
        let (result, scale, state) = self.slot.with(|cell| {
            let scaler = match cell.scaler.take() {
                Some(scaler) => scaler,
                None => {
                    let scaler = config.init::<B>(device, Precision::F16)?;
                    match cell.loaded.take() {
                        Some(record) => scaler.load_record(record),
                        None => scaler,
                    }
                }
            };
            let scaler = cell.scaler.insert(scaler);
            let stepped = scaler.step(inner, lr, module, grads);
            let result = if deferred {
                // Shared: the update waits for the next backward (`shared`).
                cell.pending |= stepped.is_ok();
                stepped
            } else {
                stepped.and_then(|(module, report)| scaler.update().map(|()| (module, report)))
            };
            let (scale, state) = (scaler.scale_tensor(), scaler.state());
            cell.set_holding(member, inner.holds_scaled_gradients(), token);
            // For the monitor, when the update waits: the state the next backward will find,
            // as `scale()` says (an update of a copy, on the device).
            let state = if deferred {
                cell.settled().map_or(state, |next| next.state())
            } else {
                state
            };
            Ok::<_, ScalerError>((result, scale, state))
        })?;
        let (module, report) = result?;
        let skipped = self
            .skipped
            .take()
            .unwrap_or_else(|| f32_scalar(self.loaded_skipped as f32, device));
        self.last_found_inf = report.found_inf();
        let skipped = match report.found_inf() {
            Some(found_inf) => {
                if let Some(owner) = self.owner().filter(|_| !deferred) {
                    registry::publish::<B::InnerBackend>(owner, primitive(scale));
                }
                skipped + found_inf
            }
            None => skipped, // mid-window: nothing checked, the scale stays
        };
        self.skipped = Some(skipped.clone());
        Ok((module, !report.accumulated(), Some((state, skipped))))
    }

    /// Samples the allocator's bytes in use every `every`-th micro-step, for
    /// [`StepMemoryMetric`] and [`ActivationMemoryMetric`] ([`metrics`]): at the start of
    /// backward, of the step, and after it. Each sample waits for the device: keep `every`
    /// in the hundreds for a real run. Backends without allocator figures (Flex) give none.
    /// The bytes after each sampled step are watched for a steady climb, a leak
    /// ([`ScalerMonitor::memory_growth`](metrics::ScalerMonitor::memory_growth), and a warning
    /// in the log).
    pub fn track_memory(self, every: usize) -> Self
    where
        B: DeviceMemory,
    {
        let probe: MemoryProbe = Arc::new(|device: &dyn core::any::Any| {
            let device = device.downcast_ref::<B::Device>()?;
            B::memory_snapshot(device).map(|s| (s.bytes_in_use, B::backward_passes(device)))
        });
        self.monitor.track_memory(probe, every as u64);
        self
    }
}

impl<M, B, O> Optimizer<M, B> for AmpOptimizer<O, B>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    B::InnerBackend: ScalerKernels,
    O: Optimizer<M, B> + ScaledStep<M, B>,
{
    /// The wrapped optimizer's record, the scaler's state and the step counts: a checkpoint
    /// resumes the same scale trajectory, and the metrics count on.
    type Record = (O::Record, Option<GradScalerRecord>, StepCounts);

    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        // `Optimizer::step` cannot fail; the errors here are an accumulation window's
        // (`try_step` returns them).
        self.try_step(lr, module, grads)
            .unwrap_or_else(|e| panic!("burn-amp: AmpOptimizer step refused: {e}"))
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, mut grads: MultiGradientsParams) -> M {
        // Each parameter's gradients summed on one device (as Burn's adaptor does), then one
        // check over all of them: one skip decision for every device.
        let grads = GradList::take_multi::<B, M>(&module, &mut grads).into_params::<B, M>(&module);
        self.step(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        (
            self.inner.to_record(),
            self.scaler_record(),
            self.step_counts(),
        )
    }

    fn load_record(mut self, (inner, scaler, counts): Self::Record) -> Self {
        self.inner = self.inner.load_record(inner);
        // A loaded accumulation window holds the saved scale: it must stay until the
        // window's boundary, whichever optimizer sharing it steps first.
        let (member, holds) = (self.member, self.inner.holds_scaled_gradients());
        let token = &self.token;
        self.slot
            .with(|cell| cell.set_holding(member, holds, token));
        let scale = scaler.as_ref().map(|record| record.scale);
        if let Some(record) = scaler {
            self.load_scaler_record(record);
        }
        self.load_step_counts(counts, scale);
        self
    }
}
