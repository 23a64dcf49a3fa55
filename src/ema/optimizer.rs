//! [`EmaOptimizer`]: the weight average kept by the optimizer, for loops that are not yours.

use std::sync::{Arc, Mutex, MutexGuard};

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, PrecisionSettings, Record};
use burn::tensor::backend::AutodiffBackend;

use super::last_step::ReportsLastStep;
use super::{Averaged, EmaConfig, EmaError, ModelEma, ModelEmaRecord};

/// An optimizer that averages the weights after each step it takes, for loops that are not
/// yours: burn-train's `Learner` calls `Optimizer::step` and nothing after it (Lightning's
/// `WeightAveraging` is a callback there). Wrapping the optimizer puts the update after each
/// step and the average in the optimizer's record, which `Learner`'s checkpointer saves and
/// restores.
///
/// ```ignore
/// let amp = AmpOptimizer::new(adam, GradScalerConfig::new())?;
/// let optim = EmaOptimizer::new(amp, EmaConfig::new())?;
/// let average = optim.average();                 // a handle: clones share the average
/// let result = training.launch(Learner::new(model, optim, scheduler));
/// let ema_model = average.module().expect("trained at least one step");
/// ```
///
/// The average is made at the first step, from the weights that step starts from, on their
/// devices (where `Learner` has put the model). Its clones share one average and each
/// optimizer step is averaged once: burn-train clones the optimizer for each worker of a DDP
/// run, whose clones step the same all-reduced weights, and for loading a checkpoint.
pub struct EmaOptimizer<O, B: AutodiffBackend, M: AutodiffModule<B>> {
    inner: O,
    average: SharedEma<B, M>,
    /// Calls to `step` of this clone.
    steps: u64,
}

impl<O: Clone, B: AutodiffBackend, M: AutodiffModule<B>> Clone for EmaOptimizer<O, B, M> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            average: self.average.clone(),
            steps: self.steps,
        }
    }
}

impl<O, B: AutodiffBackend, M: AutodiffModule<B>> core::fmt::Debug for EmaOptimizer<O, B, M> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("EmaOptimizer")
            .field("steps", &self.steps)
            .field("average", &self.average)
            .finish_non_exhaustive()
    }
}

/// The average an [`EmaOptimizer`] keeps: a handle, for evaluating it during or after
/// training.
pub struct SharedEma<B: AutodiffBackend, M: AutodiffModule<B>>(Arc<Mutex<EmaState<B, M>>>);

impl<B: AutodiffBackend, M: AutodiffModule<B>> Clone for SharedEma<B, M> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> core::fmt::Debug for SharedEma<B, M> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let state = self.lock();
        f.debug_struct("SharedEma")
            .field("config", &state.config)
            .field("made", &state.ema.is_some())
            .field("pending", &state.pending.is_some())
            .finish()
    }
}

struct EmaState<B: AutodiffBackend, M: AutodiffModule<B>> {
    config: EmaConfig,
    /// Made at the first step.
    ema: Option<ModelEma<B, M>>,
    /// A record loaded before the first step: loaded into the average when the step makes it.
    pending: Option<ModelEmaRecord<B, M>>,
    /// Optimizer steps seen: a clone's call with a number not above it was averaged by
    /// another clone.
    steps: u64,
}

/// What an [`EmaOptimizer`] saves beside its optimizer's record: the average's record (`None`
/// before the first step) and the optimizer steps counted.
pub struct EmaOptimizerRecord<B: AutodiffBackend, M: AutodiffModule<B>> {
    average: Option<ModelEmaRecord<B, M>>,
    steps: u64,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Record<B> for EmaOptimizerRecord<B, M> {
    type Item<S: PrecisionSettings> = (
        Option<<ModelEmaRecord<B, M> as Record<B::InnerBackend>>::Item<S>>,
        u64,
    );

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        (self.average.map(Record::into_item), self.steps)
    }

    fn from_item<S: PrecisionSettings>(
        (average, steps): Self::Item<S>,
        device: &B::Device,
    ) -> Self {
        Self {
            // The inner backend's device is the autodiff backend's.
            average: average.map(|item| Record::from_item(item, device)),
            steps,
        }
    }
}

impl<O, B: AutodiffBackend, M: AutodiffModule<B>> EmaOptimizer<O, B, M> {
    /// Wraps `optimizer` (anything that tells what its step did, [`ReportsLastStep`]: an
    /// [`AmpOptimizer`](crate::AmpOptimizer), Burn's optimizers, a
    /// [`GradientAccumulation`](crate::GradientAccumulation)).
    pub fn new(optimizer: O, config: EmaConfig) -> Result<Self, EmaError> {
        config.validate()?;
        Ok(Self {
            inner: optimizer,
            average: SharedEma::new(config),
            steps: 0,
        })
    }

    /// The average (shared with this optimizer and its clones).
    pub fn average(&self) -> SharedEma<B, M> {
        self.average.clone()
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The wrapped optimizer, to load its state or tune it between steps.
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// The average made from `module` if this is the first step, then the step, then the
    /// update (unless another clone has averaged this step).
    fn step_with(&mut self, module: M, step: impl FnOnce(&mut O, M) -> M) -> M
    where
        O: ReportsLastStep<B>,
    {
        self.steps += 1;
        self.average.lock().make(&module);
        let module = step(&mut self.inner, module);
        let mut state = self.average.lock();
        if self.steps > state.steps {
            state.steps = self.steps;
            let ema = state.ema.as_mut().expect("made before the step");
            ema.update_after(&module, &self.inner)
                .unwrap_or_else(|e| panic!("burn-amp: EmaOptimizer's update refused: {e}"));
        }
        module
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> SharedEma<B, M> {
    /// An average not made yet (config validated by the caller).
    pub(super) fn new(config: EmaConfig) -> Self {
        Self(Arc::new(Mutex::new(EmaState {
            config,
            ema: None,
            pending: None,
            steps: 0,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, EmaState<B, M>> {
        // A panic in another worker's update poisons the lock; the average it left is whole
        // or absent (`ModelEma` takes it out while it updates), so go on.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The average, for evaluation (`M`'s inner module, trained tensors in f32); `None`
    /// before the first step.
    pub fn module(&self) -> Option<M::InnerModule> {
        self.lock().ema.as_ref().map(ModelEma::module)
    }

    /// Updates averaged so far (reads one value from the device after an f16 run's update).
    pub fn updates(&self) -> u64 {
        let state = self.lock();
        match (&state.ema, &state.pending) {
            (Some(ema), _) => ema.updates(),
            (None, Some((_, Some(count), _, _))) => {
                count.0.clone().into_scalar().elem::<f32>() as u64
            }
            (None, _) => 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> EmaConfig {
        self.lock().config.clone()
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> EmaState<B, M> {
    fn make(&mut self, module: &M) {
        if self.ema.is_some() {
            return;
        }
        let ema = ModelEma::new(module, self.config.clone()).expect("config validated");
        self.ema = Some(match self.pending.take() {
            Some(record) => ema.load_record(record),
            None => ema,
        });
    }

    /// The average's record; a pending one is copied (through its item: records are not
    /// `Clone`), exactly.
    fn record(&mut self) -> Option<ModelEmaRecord<B, M>> {
        if let Some(ema) = &self.ema {
            return Some(ema.to_record());
        }
        let pending = self.pending.take()?;
        let device = pending
            .1
            .as_ref()
            .map(|count| count.0.device())
            .unwrap_or_default();
        let item = pending.into_item::<FullPrecisionSettings>();
        self.pending = Some(Record::from_item(item.clone(), &device));
        Some(Record::from_item(item, &device))
    }

    fn load(&mut self, record: Option<ModelEmaRecord<B, M>>, steps: u64) {
        self.steps = steps;
        self.pending = None;
        let Some(record) = record else {
            // Saved before the first step: an average made from the next step's weights.
            self.ema = None;
            return;
        };
        match self.ema.take() {
            Some(ema) => self.ema = Some(ema.load_record(record)),
            None => self.pending = Some(record),
        }
    }
}

impl<M, B, O> Optimizer<M, B> for EmaOptimizer<O, B, M>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    O: Optimizer<M, B> + ReportsLastStep<B>,
{
    /// The wrapped optimizer's record and the average's.
    type Record = (O::Record, EmaOptimizerRecord<B, M>);

    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        self.step_with(module, |inner, module| inner.step(lr, module, grads))
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        self.step_with(module, |inner, module| inner.step_multi(lr, module, grads))
    }

    fn to_record(&self) -> Self::Record {
        let average = self.average.lock().record();
        (
            self.inner.to_record(),
            EmaOptimizerRecord {
                average,
                steps: self.steps,
            },
        )
    }

    fn load_record(mut self, (inner, average): Self::Record) -> Self {
        self.inner = self.inner.load_record(inner);
        self.steps = average.steps;
        self.average.lock().load(average.average, average.steps);
        self
    }
}

/// The record methods of `Optimizer<M, B>`, by name: with the impl for [`Averaged`] beside it,
/// `optim.to_record()` would need the module type spelled out.
impl<O, B, M> EmaOptimizer<O, B, M>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    O: Optimizer<M, B> + ReportsLastStep<B>,
{
    /// [`Optimizer::to_record`].
    pub fn to_record(&self) -> (O::Record, EmaOptimizerRecord<B, M>) {
        Optimizer::<M, B>::to_record(self)
    }

    /// [`Optimizer::load_record`].
    pub fn load_record(self, record: (O::Record, EmaOptimizerRecord<B, M>)) -> Self {
        Optimizer::<M, B>::load_record(self, record)
    }
}

/// The same optimizer for the model wrapped in [`Averaged`] (validated as the average): the
/// wrapped optimizer steps `M`, the record is the same.
impl<M, B, O> Optimizer<Averaged<B, M>, B> for EmaOptimizer<O, B, M>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    O: Optimizer<M, B> + ReportsLastStep<B>,
{
    type Record = (O::Record, EmaOptimizerRecord<B, M>);

    fn step(
        &mut self,
        lr: LearningRate,
        module: Averaged<B, M>,
        grads: GradientsParams,
    ) -> Averaged<B, M> {
        module.map_model(|m| Optimizer::<M, B>::step(self, lr, m, grads))
    }

    fn step_multi(
        &mut self,
        lr: LearningRate,
        module: Averaged<B, M>,
        grads: MultiGradientsParams,
    ) -> Averaged<B, M> {
        module.map_model(|m| Optimizer::<M, B>::step_multi(self, lr, m, grads))
    }

    fn to_record(&self) -> Self::Record {
        Optimizer::<M, B>::to_record(self)
    }

    fn load_record(self, record: Self::Record) -> Self {
        Optimizer::<M, B>::load_record(self, record)
    }
}
