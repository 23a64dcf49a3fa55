//! An exponential moving average of a model's weights (PyTorch's `AveragedModel` with
//! `get_ema_multi_avg_fn`, timm's `ModelEmaV3`, Lightning's `WeightAveraging`), kept in f32.
//!
//! `ema ← ema + (1 − decay) · (w − ema)` after each optimizer step, evaluated on the average
//! ([`ModelEma::module`]). Three things a mixed-precision run needs of it:
//! - **f32 whatever the weights' dtype.** At a decay of 0.999 a step adds a thousandth of
//!   the distance between the average and the weights; in bf16 (8 bits of mantissa) that is
//!   below half an ulp of the average wherever the weights are not near 0: an average kept
//!   in the weights' bf16 stays, in most of its values, where it started
//!   (`tests/amp_optimizer/ema.rs`: 80 of 128 values never moved in 60 updates).
//!   The average costs 4 bytes per trainable parameter.
//! - **An optimizer step that was not taken is not averaged.** [`ModelEma::update_after`]
//!   reads the optimizer's last step ([`ReportsLastStep`]: an
//!   [`AmpOptimizer`](crate::AmpOptimizer), Burn's optimizers, a window): a micro-step inside
//!   an accumulation window changed no weight and is passed over (PyTorch's loop calls the
//!   average once per optimizer step), and a step skipped on an overflow leaves the average
//!   and its count exactly as they were, on the device (no host read: the overflow flag
//!   multiplies the update by 0).
//! - **Tensors that are not trained** (frozen parameters, a batch norm's running statistics)
//!   are the model's own, taken at each update, in their dtype: nothing to average, and a
//!   frozen bf16 backbone is not widened.
//!
//! Optional warmup (TensorFlow's `ExponentialMovingAverage` with `num_updates`):
//! `decay_n = min(decay, (1 + n) / (10 + n))` at the `n`-th update (0.1 at the first, 0.99
//! from the 890th), so that the average forgets the first, random weights quickly.
//!
//! ## Where the average lives
//! [`EmaPlacement::Device`] (the default) keeps it beside the weights: 4 bytes per trained
//! parameter of device memory, an update is one pass over each tensor ([`EmaKernels`] on
//! the CubeCL backends) and no host read.
//! [`EmaPlacement::Host`] (timm's `ModelEmaV3(device="cpu")`) keeps it in host memory, for a
//! model whose f32 average does not fit beside it (a bf16 model's average is twice its
//! weights): the device holds a `[1; D]` placeholder per trained tensor, and an update reads
//! the weights to the host (in their dtype) and averages there, so it waits for the device.
//! With [`update_every`](EmaConfig::update_every) that cost is paid every n-th step:
//! a decay per update of `d` is a horizon of `n / (1 − d)` steps.
//!
//! ## Where the loop is not yours
//! [`EmaOptimizer`] wraps the optimizer and updates after each of its steps (burn-train's
//! `Learner` has no hook after the step); the average is in the optimizer's record, so
//! `Learner`'s checkpoints hold it, and [`SharedEma`] reads it during or after training.
//! [`Averaged`] around the model has `Learner` validate the average and return it.

use burn::config::Config;
use burn::module::{AutodiffModule, Module};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::grads::f32_scalar;
use crate::record::ExactTensor;

mod averaged;
pub mod kernels;
mod last_step;
mod optimizer;
mod tensors;

pub use averaged::Averaged;
pub use kernels::EmaKernels;
pub use last_step::{LastStep, ReportsLastStep};
pub use optimizer::{EmaOptimizer, EmaOptimizerRecord, SharedEma};
pub use tensors::HostTensor;
use tensors::{Average, Offload, Rate, Refresh, Trained, TrainedTensor, Upload, Widen};

/// Where a [`ModelEma`] keeps its average ([module docs](self#where-the-average-lives)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EmaPlacement {
    /// Beside each weight, on its device: no host read.
    Device,
    /// In host memory: no device memory, a read of the weights at each update.
    Host,
}

/// How the average is taken.
#[derive(Config, Debug, PartialEq)]
pub struct EmaConfig {
    /// The weight of the average at each update, in `[0, 1)` (timm's default).
    #[config(default = 0.9999)]
    pub decay: f64,
    /// `min(decay, (1 + n) / (10 + n))` at the `n`-th update.
    #[config(default = false)]
    pub warmup: bool,
    /// Average every n-th optimizer step (taken or skipped on an overflow; the steps between
    /// are not looked at), as ema-pytorch's `update_every`. The decay is per update.
    #[config(default = 1)]
    pub update_every: usize,
    /// Where the average lives.
    #[config(default = "EmaPlacement::Device")]
    pub placement: EmaPlacement,
}

impl EmaConfig {
    /// Checks the decay and `update_every`.
    pub fn validate(&self) -> Result<(), EmaError> {
        if !(0.0..1.0).contains(&self.decay) {
            return Err(EmaError::InvalidDecay(self.decay));
        }
        if self.update_every == 0 {
            return Err(EmaError::InvalidUpdateEvery);
        }
        Ok(())
    }
}

/// What went wrong with a [`ModelEma`].
#[derive(Debug, Clone, PartialEq, Error)]
pub enum EmaError {
    /// The decay is outside `[0, 1)`.
    #[error(
        "EMA decay {0} is outside [0, 1): 1 would never move the average and a negative one \
         is not an average; typical values are 0.999 to 0.9999"
    )]
    InvalidDecay(f64),
    /// `update_every` is 0.
    #[error(
        "EMA update_every is 0: it is the number of optimizer steps per update, 1 to average \
         after every step"
    )]
    InvalidUpdateEvery,
    /// A record loaded into the average is not of the model the average was made from.
    #[error(
        "the record's float tensor {index} has shape {found:?} where this average's model has \
         {expected:?} (of {count} tensors): load a record saved from the same model"
    )]
    RecordMismatch {
        /// The tensor's position in the module's traversal.
        index: usize,
        /// Its shape in this average's model (empty when it has no tensor there).
        expected: Vec<usize>,
        /// Its shape in the record (empty when the record has no tensor there).
        found: Vec<usize>,
        /// How many float tensors the average holds.
        count: usize,
    },
    /// The model passed to `update` does not have the float tensors the average was made
    /// from.
    #[error(
        "the model's float tensor {index} has shape {found:?} where the average has {expected:?} \
         (of {count} tensors averaged): update the average with the model it was made from"
    )]
    ModelMismatch {
        /// The tensor's position in the module's traversal.
        index: usize,
        /// Its shape in the average (empty when the average has no tensor there).
        expected: Vec<usize>,
        /// Its shape in the model (empty when the model has no tensor there).
        found: Vec<usize>,
        /// How many float tensors the average holds.
        count: usize,
    },
}

/// An exponential moving average of a model's weights. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct ModelEma<B: AutodiffBackend, M: AutodiffModule<B>> {
    config: EmaConfig,
    /// `M`'s inner module: the average, its trained tensors in f32 (on the device), or its
    /// structure with a placeholder for each trained tensor (in host memory: `host`). Taken
    /// out during an update, so that each tensor is its only owner and the update frees it
    /// as it goes (a clone held meanwhile would keep a second average alive until the end).
    module: Option<M::InnerModule>,
    /// In host memory: the average of each float tensor that is trained, in traversal order.
    host: Vec<Option<HostTensor>>,
    /// The model's float tensors' shapes, in traversal order.
    shapes: Vec<Vec<usize>>,
    /// Updates averaged so far; `None` for a model without float tensors.
    updates: Option<Updates<B::InnerBackend>>,
    /// Calls to update (optimizer steps), for `update_every`.
    calls: u64,
}

/// The count of updates, on the host until an update comes with an overflow flag to a device
/// average, then f32 `[1]` on the first tensor's device (a skipped step leaves it there,
/// without a read). Counted on the host, the rate is a host scalar: no `[1]` tensor ops per
/// update, and [`ModelEma::updates`] without a read. (Composed from burn ops, an update with
/// a device rate took 1.7 times as long on lavapipe; the [`EmaKernels`] take either at the
/// same speed.)
#[derive(Debug, Clone)]
enum Updates<B: Backend> {
    Host { count: u64, device: B::Device },
    Device(Tensor<B, 1>),
}

/// Only a panic inside an update (a backend's) leaves the average taken out.
const LOST: &str = "burn-amp: the weight average was lost to a panic during an update";

/// What a [`ModelEma`] saves: the module (the average, or with a host average its structure
/// and untrained tensors), the count of updates (exact), the host average, and the calls
/// counted for `update_every`. Either placement loads the other's.
pub type ModelEmaRecord<B, M> = (
    <<M as AutodiffModule<B>>::InnerModule as Module<<B as AutodiffBackend>::InnerBackend>>::Record,
    Option<ExactTensor<<B as AutodiffBackend>::InnerBackend, 1>>,
    Vec<Option<HostTensor>>,
    u64,
);

impl<B: AutodiffBackend, M: AutodiffModule<B>> ModelEma<B, M> {
    /// The average of `model`, starting at its current weights.
    pub fn new(model: &M, config: EmaConfig) -> Result<Self, EmaError> {
        config.validate()?;
        let trained = Trained::<B>::of(model);
        let flags = trained.flags();
        let (module, host) = match config.placement {
            EmaPlacement::Device => {
                let mut widen = Widen {
                    trained: &flags,
                    index: 0,
                };
                (model.valid().map(&mut widen), Vec::new())
            }
            EmaPlacement::Host => offload(model.valid(), &flags),
        };
        let shapes = trained.shapes();
        let updates = trained.zero.map(|zero| Updates::Host {
            count: 0,
            device: zero.device(),
        });
        Ok(Self {
            config,
            module: Some(module),
            host,
            shapes,
            updates,
            calls: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EmaConfig {
        &self.config
    }

    /// The average, for evaluation: `M`'s inner module with its trained tensors in f32 (an
    /// `Amp` backend lowers them under autocast as it does the model's). A host average is
    /// copied to the devices of the weights (the average's bytes in device memory while the
    /// module lives).
    pub fn module(&self) -> M::InnerModule {
        self.whole(self.module.clone().expect(LOST))
    }

    /// The average, taken out.
    pub fn into_module(mut self) -> M::InnerModule {
        let module = self.module.take().expect(LOST);
        self.whole(module)
    }

    /// The module with the average in it (a host average's placeholders filled).
    fn whole(&self, module: M::InnerModule) -> M::InnerModule {
        match self.config.placement {
            EmaPlacement::Device => module,
            EmaPlacement::Host => upload(module, &self.host),
        }
    }

    /// Updates averaged so far. Reads one value from the device (a device average).
    pub fn updates(&self) -> u64 {
        match &self.updates {
            None => 0,
            Some(Updates::Device(n)) => n.clone().into_scalar().elem::<f32>() as u64,
            Some(Updates::Host { count, .. }) => *count,
        }
    }

    /// Averages `model`'s current weights in: call it after each optimizer step. With an
    /// [`AmpOptimizer`](crate::AmpOptimizer), [`update_after`](Self::update_after) passes over
    /// the steps that were not taken.
    pub fn update(&mut self, model: &M) -> Result<(), EmaError> {
        self.update_unless(model, None)
    }

    /// Averages `model`'s weights in if `optim`'s last call took an optimizer step: nothing
    /// after a micro-step inside an accumulation window; after a step skipped on an
    /// overflow, the average and its count stay as they were (on the device, no read).
    /// `optim`: an [`AmpOptimizer`](crate::AmpOptimizer), Burn's optimizers, anything
    /// [`ReportsLastStep`].
    pub fn update_after<O: ReportsLastStep<B>>(
        &mut self,
        model: &M,
        optim: &O,
    ) -> Result<(), EmaError> {
        match optim.last_step() {
            LastStep::Accumulated => Ok(()),
            LastStep::Taken => self.update_unless(model, None),
            LastStep::Checked(found_inf) => self.update_unless(model, Some(found_inf)),
        }
    }

    /// Averages `model`'s weights in unless `found_inf` (f32 `[1]`, 0 or 1, on the device) is
    /// 1: `ema += (w − ema) · (1 − decay_n) · (1 − found_inf)`, the count raised by
    /// `1 − found_inf`, no read (a host average reads the flag). For a loop with a
    /// [`GradScaler`](crate::scaler::GradScaler) by hand: `report.found_inf()` of its step
    /// (and no call after a step that only accumulated, `report.accumulated()`). Checked
    /// whole before anything changes.
    pub fn update_unless(
        &mut self,
        model: &M,
        found_inf: Option<Tensor<B::InnerBackend, 1>>,
    ) -> Result<(), EmaError> {
        let trained = Trained::<B>::of(model);
        self.check_shapes(&trained.tensors)?;
        self.calls += 1;
        if !self.calls.is_multiple_of(self.config.update_every as u64) {
            return Ok(());
        }
        match (self.updates.take(), self.config.placement) {
            (None, _) => Ok(()), // no float tensor: nothing to average
            (Some(Updates::Host { count, device }), EmaPlacement::Device)
                if found_inf.is_none() =>
            {
                let rate = Rate::Host(1.0 - self.decay(count as f32));
                self.average_on_device(&trained.tensors, rate);
                self.updates = Some(Updates::Host {
                    count: count + 1,
                    device,
                });
                Ok(())
            }
            (Some(Updates::Host { count, device }), EmaPlacement::Device) => {
                let updates = f32_scalar(count as f32, &device);
                self.update_on_device(&trained.tensors, updates, found_inf);
                Ok(())
            }
            (Some(Updates::Device(updates)), _) => {
                self.update_on_device(&trained.tensors, updates, found_inf);
                Ok(())
            }
            (Some(Updates::Host { count, device }), EmaPlacement::Host) => {
                let skipped = found_inf.is_some_and(|f| f.into_scalar().elem::<f32>() != 0.0);
                let count = if skipped {
                    count
                } else {
                    self.update_on_host(&trained.tensors, count);
                    count + 1
                };
                self.updates = Some(Updates::Host { count, device });
                Ok(())
            }
        }
    }

    fn decay(&self, updates: f32) -> f32 {
        let decay = self.config.decay as f32;
        if self.config.warmup {
            ((updates + 1.0) / (updates + 10.0)).min(decay)
        } else {
            decay
        }
    }

    fn update_on_device(
        &mut self,
        model: &[TrainedTensor<B::InnerBackend>],
        updates: Tensor<B::InnerBackend, 1>,
        found_inf: Option<Tensor<B::InnerBackend, 1>>,
    ) {
        let device = updates.device();
        let decay = if self.config.warmup {
            ((updates.clone() + 1.0) / (updates.clone() + 10.0)).clamp_max(self.config.decay)
        } else {
            f32_scalar(self.config.decay as f32, &device)
        };
        let mut rate = decay * -1.0 + 1.0;
        let mut counted = updates.clone() + 1.0;
        if let Some(found) = found_inf {
            let taken = found.to_device(&device) * -1.0 + 1.0;
            rate = rate * taken.clone();
            counted = updates + taken;
        }
        self.updates = Some(Updates::Device(counted));
        self.average_on_device(model, Rate::Device(rate));
    }

    fn average_on_device(
        &mut self,
        model: &[TrainedTensor<B::InnerBackend>],
        rate: Rate<B::InnerBackend>,
    ) {
        let mut average = Average {
            model,
            rate,
            index: 0,
        };
        let module = self.module.take().expect(LOST);
        self.module = Some(module.map(&mut average));
    }

    /// Tensor by tensor: one of the model's tensors in host memory at a time.
    fn update_on_host(&mut self, model: &[TrainedTensor<B::InnerBackend>], updates: u64) {
        // The device's arithmetic in f32 (`decay · −1 + 1` there, the same rounding).
        let rate = 1.0 - self.decay(updates as f32);
        for (average, w) in self.host.iter_mut().zip(model) {
            match (average, w.trained) {
                (Some(average), true) => average.lerp::<B::InnerBackend>(w.tensor.clone(), rate),
                // Trained since the average was made: averaged from its weights now.
                (average @ None, true) => {
                    *average = Some(HostTensor::read::<B::InnerBackend>(w.tensor.clone()))
                }
                (_, false) => {}
            }
        }
        let mut refresh = Refresh {
            model,
            host: &self.host,
            index: 0,
        };
        let module = self.module.take().expect(LOST);
        self.module = Some(module.map(&mut refresh));
    }

    /// The model's float tensors against the average's, shape by shape.
    fn check_shapes(&self, model: &[TrainedTensor<B::InnerBackend>]) -> Result<(), EmaError> {
        let theirs: Vec<Vec<usize>> = model.iter().map(|t| t.shape.clone()).collect();
        match first_difference(&self.shapes, &theirs) {
            None => Ok(()),
            Some((index, expected, found)) => Err(EmaError::ModelMismatch {
                index,
                expected,
                found,
                count: self.shapes.len(),
            }),
        }
    }

    /// The average's state as a record (a host average stays in host memory).
    pub fn to_record(&self) -> ModelEmaRecord<B, M> {
        let updates = self.updates.as_ref().map(|updates| match updates {
            Updates::Device(n) => ExactTensor(n.clone()),
            Updates::Host { count, device } => ExactTensor(f32_scalar(*count as f32, device)),
        });
        (
            self.module.clone().expect(LOST).into_record(),
            updates,
            self.host.clone(),
            self.calls,
        )
    }

    /// Loads a saved average, its count and its phase of `update_every`, saved with either
    /// placement.
    ///
    /// # Panics
    /// When the record is of another model ([`try_load_record`](Self::try_load_record) returns
    /// the error).
    pub fn load_record(mut self, record: ModelEmaRecord<B, M>) -> Self {
        self.try_load_record(record)
            .unwrap_or_else(|e| panic!("burn-amp: ModelEma::load_record: {e}"));
        self
    }

    /// As [`load_record`](Self::load_record), the average unchanged when the record is of
    /// another model (Burn's `load_record` takes any shapes; the next update would fail inside
    /// Burn).
    pub fn try_load_record(
        &mut self,
        (module, updates, host, calls): ModelEmaRecord<B, M>,
    ) -> Result<(), EmaError> {
        let module = self.module.clone().expect(LOST).load_record(module);
        let mut shapes = tensors::FloatShapes::default();
        module.visit(&mut shapes);
        // A host average's trained tensors are placeholders in the module: their shapes are
        // the host tensors'.
        let saved: Vec<Vec<usize>> = shapes
            .0
            .into_iter()
            .enumerate()
            .map(|(i, shape)| match host.get(i) {
                Some(Some(t)) => t.shape().to_vec(),
                _ => shape,
            })
            .collect();
        if let Some((index, expected, found)) = first_difference(&self.shapes, &saved) {
            return Err(EmaError::RecordMismatch {
                index,
                expected,
                found,
                count: self.shapes.len(),
            });
        }
        let saved_on_host = host.iter().any(Option::is_some);
        self.calls = calls;
        let module = match (self.config.placement, saved_on_host) {
            (EmaPlacement::Device, false) => module,
            (EmaPlacement::Device, true) => upload(module, &host),
            (EmaPlacement::Host, true) => {
                self.host = host;
                module
            }
            (EmaPlacement::Host, false) => {
                // Which tensors were averaged: those this average holds on the host.
                let flags: Vec<bool> = self.host.iter().map(Option::is_some).collect();
                let (module, host) = offload(module, &flags);
                self.host = host;
                module
            }
        };
        self.module = Some(module);
        if let (Some(current), Some(loaded)) = (self.updates.take(), updates) {
            let device = match current {
                Updates::Device(n) => n.device(),
                Updates::Host { device, .. } => device,
            };
            self.updates = Some(Updates::Host {
                count: loaded.into_tensor().into_scalar().elem::<f32>() as u64,
                device,
            });
        }
        Ok(())
    }
}

/// The first index where two lists of shapes differ (a missing shape as empty), with both.
fn first_difference(
    ours: &[Vec<usize>],
    theirs: &[Vec<usize>],
) -> Option<(usize, Vec<usize>, Vec<usize>)> {
    let index = (0..ours.len().max(theirs.len())).find(|&i| ours.get(i) != theirs.get(i))?;
    let shape = |list: &[Vec<usize>]| list.get(index).cloned().unwrap_or_default();
    Some((index, shape(ours), shape(theirs)))
}

/// A module whose tensors flagged in `trained` moved to host memory (f32), placeholders left.
fn offload<B: Backend, M: Module<B>>(module: M, trained: &[bool]) -> (M, Vec<Option<HostTensor>>) {
    let mut offload = Offload {
        trained,
        host: Vec::new(),
    };
    let module = module.map(&mut offload);
    (module, offload.host)
}

/// The module with its host averages in place of their placeholders.
fn upload<B: Backend, M: Module<B>>(module: M, host: &[Option<HostTensor>]) -> M {
    module.map(&mut Upload { host, index: 0 })
}
