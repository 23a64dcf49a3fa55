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
//!   reads the [`AmpOptimizer`]'s last step: a micro-step inside an accumulation window
//!   changed no weight and is passed over (PyTorch's loop calls the average once per
//!   optimizer step), and a step skipped on an overflow leaves the average and its count
//!   exactly as they were, on the device (no host read: the overflow flag multiplies the
//!   update by 0).
//! - **Tensors that are not trained** (frozen parameters, a batch norm's running statistics)
//!   are the model's own, taken at each update, in their dtype: nothing to average, and a
//!   frozen bf16 backbone is not widened.
//!
//! Optional warmup (TensorFlow's `ExponentialMovingAverage` with `num_updates`):
//! `decay_n = min(decay, (1 + n) / (10 + n))` at the `n`-th update (0.1 at the first, 0.99
//! from the 890th), so that the average forgets the first, random weights quickly.

use burn::config::Config;
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use burn_backend::tensor::FloatTensor;
use burn_std::FloatDType;
use thiserror::Error;

use crate::AmpOptimizer;
use crate::grads::{f32_scalar, primitive, tensor};
use crate::record::ExactTensor;
use crate::scaler::ScalerKernels;

/// How the average is taken.
#[derive(Config, Debug, PartialEq)]
pub struct EmaConfig {
    /// The weight of the average at each update, in `[0, 1)` (timm's default).
    #[config(default = 0.9999)]
    pub decay: f64,
    /// `min(decay, (1 + n) / (10 + n))` at the `n`-th update.
    #[config(default = false)]
    pub warmup: bool,
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
    /// The average: `M`'s inner module, its trained tensors in f32. Taken out during an
    /// update, so that each tensor is its only owner and the update frees it as it goes (a
    /// clone held meanwhile would keep a second average alive until the end).
    module: Option<M::InnerModule>,
    /// Updates averaged so far, f32 `[1]` on the first tensor's device (a skipped step leaves
    /// it on the device, without a read).
    updates: Option<Tensor<B::InnerBackend, 1>>,
}

/// Only a panic inside an update (a backend's) leaves the average taken out.
const LOST: &str = "burn-amp: the weight average was lost to a panic during an update";

/// What a [`ModelEma`] saves: the average's record and the count of updates (exact, f32).
pub type ModelEmaRecord<B, M> = (
    <<M as AutodiffModule<B>>::InnerModule as Module<<B as AutodiffBackend>::InnerBackend>>::Record,
    Option<ExactTensor<<B as AutodiffBackend>::InnerBackend, 1>>,
);

impl<B: AutodiffBackend, M: AutodiffModule<B>> ModelEma<B, M> {
    /// The average of `model`, starting at its current weights.
    pub fn new(model: &M, config: EmaConfig) -> Result<Self, EmaError> {
        if !(0.0..1.0).contains(&config.decay) {
            return Err(EmaError::InvalidDecay(config.decay));
        }
        let trained = Trained::<B>::of(model);
        let mut widen = Widen {
            trained: &trained.tensors,
            index: 0,
        };
        let module = model.valid().map(&mut widen);
        let updates = trained.zero;
        Ok(Self {
            config,
            module: Some(module),
            updates,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EmaConfig {
        &self.config
    }

    /// The average, for evaluation: `M`'s inner module with its trained tensors in f32 (an
    /// `Amp` backend lowers them under autocast as it does the model's).
    pub fn module(&self) -> &M::InnerModule {
        self.module.as_ref().expect(LOST)
    }

    /// The average, taken out.
    pub fn into_module(self) -> M::InnerModule {
        self.module.expect(LOST)
    }

    /// Updates averaged so far. Reads one value from the device.
    pub fn updates(&self) -> u64 {
        self.updates
            .as_ref()
            .map_or(0, |n| n.clone().into_scalar().elem::<f32>() as u64)
    }

    /// Averages `model`'s current weights in: call it after each optimizer step. With an
    /// [`AmpOptimizer`], [`update_after`](Self::update_after) passes over the steps that were
    /// not taken.
    pub fn update(&mut self, model: &M) -> Result<(), EmaError> {
        self.update_unless(model, None)
    }

    /// Averages `model`'s weights in if `optim`'s last call took an optimizer step: nothing
    /// after a micro-step inside an accumulation window; after a step skipped on an
    /// overflow, the average and its count stay as they were (on the device, no read).
    pub fn update_after<O>(&mut self, model: &M, optim: &AmpOptimizer<O, B>) -> Result<(), EmaError>
    where
        B::InnerBackend: ScalerKernels,
    {
        if !optim.last_step_taken() {
            return Ok(());
        }
        self.update_unless(model, optim.last_found_inf())
    }

    /// Averages `model`'s weights in unless `found_inf` (f32 `[1]`, 0 or 1, on the device) is
    /// 1: `ema += (w − ema) · (1 − decay_n) · (1 − found_inf)`, the count raised by
    /// `1 − found_inf`, no read. For a loop with a [`GradScaler`](crate::scaler::GradScaler)
    /// by hand: `report.found_inf()` of its step (and no call after a step that only
    /// accumulated, `report.accumulated()`). Checked whole before anything changes.
    pub fn update_unless(
        &mut self,
        model: &M,
        found_inf: Option<Tensor<B::InnerBackend, 1>>,
    ) -> Result<(), EmaError> {
        let trained = Trained::<B>::of(model);
        self.check_shapes(&trained.tensors)?;
        let Some(updates) = self.updates.take() else {
            return Ok(()); // no float tensor: nothing to average
        };
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
        self.updates = Some(counted);
        let mut average = Average {
            model: &trained.tensors,
            rate,
            index: 0,
        };
        let module = self.module.take().expect(LOST);
        self.module = Some(module.map(&mut average));
        Ok(())
    }

    /// The model's float tensors against the average's, shape by shape.
    fn check_shapes(&self, model: &[TrainedTensor<B::InnerBackend>]) -> Result<(), EmaError> {
        let mut shapes = Shapes(Vec::new());
        self.module().visit(&mut shapes);
        let ours = shapes.0;
        let count = ours.len();
        let theirs = |i: usize| model.get(i).map(|t| &t.shape);
        match (0..count.max(model.len())).find(|&i| ours.get(i) != theirs(i)) {
            None => Ok(()),
            Some(index) => Err(EmaError::ModelMismatch {
                index,
                expected: ours.get(index).cloned().unwrap_or_default(),
                found: theirs(index).cloned().unwrap_or_default(),
                count,
            }),
        }
    }

    /// The average's state as a record.
    pub fn to_record(&self) -> ModelEmaRecord<B, M> {
        (
            self.module().clone().into_record(),
            self.updates.clone().map(ExactTensor),
        )
    }

    /// Loads a saved average and its count.
    pub fn load_record(mut self, (module, updates): ModelEmaRecord<B, M>) -> Self {
        self.module = Some(self.module.take().expect(LOST).load_record(module));
        if let (Some(current), Some(loaded)) = (&self.updates, updates) {
            self.updates = Some(loaded.to_device(&current.device()).into_tensor());
        }
        self
    }
}

/// One float tensor of the model, in traversal order.
struct TrainedTensor<B: Backend> {
    tensor: FloatTensor<B>,
    shape: Vec<usize>,
    /// Requires a gradient: averaged. Otherwise taken as it is.
    trained: bool,
}

/// The model's float tensors (inner backend), in traversal order.
struct Trained<B: AutodiffBackend> {
    tensors: Vec<TrainedTensor<B::InnerBackend>>,
    /// f32 0 on the first tensor's device: where the count of updates lives.
    zero: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> Trained<B> {
    fn of<M: AutodiffModule<B>>(model: &M) -> Self {
        let mut trained = Self {
            tensors: Vec::new(),
            zero: None,
        };
        model.visit(&mut trained);
        trained
    }
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Trained<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        self.zero
            .get_or_insert_with(|| f32_scalar(0.0, &value.device()));
        self.tensors.push(TrainedTensor {
            shape: value.dims().to_vec(),
            trained: value.is_require_grad(),
            tensor: primitive(value.inner()),
        });
    }
}

/// The model's inner module with its trained tensors in f32.
struct Widen<'a, B: Backend> {
    trained: &'a [TrainedTensor<B>],
    index: usize,
}

impl<B: Backend> ModuleMapper<B> for Widen<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let trained = self.trained.get(self.index).is_some_and(|t| t.trained);
        self.index += 1;
        let (id, value, mapper) = param.consume();
        let value = if trained && value.dtype() != DType::F32 {
            value.cast(FloatDType::F32)
        } else {
            value
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

/// The shapes of a module's float tensors, in traversal order.
struct Shapes(Vec<Vec<usize>>);

impl<B: Backend> ModuleVisitor<B> for Shapes {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.val().dims().to_vec());
    }
}

/// One update of the average, tensor by tensor against the model's (shapes checked).
struct Average<'a, B: Backend> {
    model: &'a [TrainedTensor<B>],
    /// `(1 − decay_n) · (1 − found_inf)`, f32 `[1]`.
    rate: Tensor<B, 1>,
    index: usize,
}

impl<B: Backend> ModuleMapper<B> for Average<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let w = &self.model[self.index];
        self.index += 1;
        let (id, average, mapper) = param.consume();
        let weights = tensor::<B, D>(w.tensor.clone());
        let value = if w.trained {
            // On the tensor's device (a model over several devices); the difference first,
            // so that the average is unique when it is added to (in place where the backend
            // can).
            let rate = self
                .rate
                .clone()
                .to_device(&average.device())
                .reshape([1; D]);
            let step = (weights.cast(FloatDType::F32) - average.clone()) * rate;
            average + step
        } else {
            weights
        };
        Param::from_mapped_value(id, value, mapper)
    }
}
