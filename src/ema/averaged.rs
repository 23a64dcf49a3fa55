//! [`Averaged`]: a model whose inference form is its weight average, so that burn-train's
//! `Learner` validates the average each epoch and returns it at the end (Lightning's
//! `WeightAveraging` swaps the average in for validation, and into the model when training
//! ends). Training, gradients, the optimizer and the checkpoints see the trained weights.

use core::fmt;

use burn::module::{AutodiffModule, Devices, Module, ModuleMapper, ModuleVisitor};
use burn::tensor::backend::AutodiffBackend;
use burn::train::{TrainOutput, TrainStep};

use super::{EmaConfig, SharedEma};

/// `M`, trained as it is, whose [`valid`](AutodiffModule::valid) is the average that an
/// [`EmaOptimizer`](super::EmaOptimizer) keeps (the trained weights' own until its first
/// step). Its record is `M`'s: a checkpoint holds the trained weights, the average is in the
/// optimizer's.
///
/// ```ignore
/// let optim = EmaOptimizer::new(amp, EmaConfig::new().with_decay(0.999))?;
/// let model = Averaged::new(model, &optim.average());
/// let result = training.launch(Learner::new(model, optim, scheduler)); // result.model: the average
/// ```
pub struct Averaged<B: AutodiffBackend, M: AutodiffModule<B>> {
    model: M,
    average: SharedEma<B, M>,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Averaged<B, M> {
    /// `model`, validated as `average`.
    pub fn new(model: M, average: &SharedEma<B, M>) -> Self {
        Self {
            model,
            average: average.clone(),
        }
    }

    /// The trained model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The trained model, and the average's handle.
    pub fn into_parts(self) -> (M, SharedEma<B, M>) {
        (self.model, self.average)
    }

    /// The trained model changed by `f`, the same average.
    pub(super) fn map_model(self, f: impl FnOnce(M) -> M) -> Self {
        Self {
            model: f(self.model),
            average: self.average,
        }
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Clone for Averaged<B, M> {
    fn clone(&self) -> Self {
        Self::new(self.model.clone(), &self.average)
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> fmt::Debug for Averaged<B, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Averaged")
            .field("model", &self.model)
            .field("average", &self.average)
            .finish()
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B> + fmt::Display> fmt::Display for Averaged<B, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Averaged({})", self.model)
    }
}

/// Every tensor is the trained model's.
impl<B: AutodiffBackend, M: AutodiffModule<B>> Module<B> for Averaged<B, M> {
    type Record = M::Record;

    fn collect_devices(&self, devices: Devices<B>) -> Devices<B> {
        self.model.collect_devices(devices)
    }

    fn fork(self, device: &B::Device) -> Self {
        self.map_model(|m| m.fork(device))
    }

    fn to_device(self, device: &B::Device) -> Self {
        self.map_model(|m| m.to_device(device))
    }

    fn visit<V: ModuleVisitor<B>>(&self, visitor: &mut V) {
        self.model.visit(visitor)
    }

    fn map<Mp: ModuleMapper<B>>(self, mapper: &mut Mp) -> Self {
        self.map_model(|m| m.map(mapper))
    }

    fn load_record(self, record: Self::Record) -> Self {
        self.map_model(|m| m.load_record(record))
    }

    fn into_record(self) -> Self::Record {
        self.model.into_record()
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> AutodiffModule<B> for Averaged<B, M> {
    type InnerModule = M::InnerModule;

    /// The average, or the trained weights before the optimizer's first step. On the model's
    /// (first) device: under DDP the average is made by whichever worker's clone steps first,
    /// and the main worker validates.
    fn valid(&self) -> M::InnerModule {
        match (self.average.module(), self.model.devices().first()) {
            (Some(average), Some(device)) => average.to_device(device),
            (Some(average), None) => average,
            (None, _) => self.model.valid(),
        }
    }

    /// Trained weights without an average (no optimizer keeps one for them).
    fn from_inner(module: M::InnerModule) -> Self {
        Self {
            model: M::from_inner(module),
            average: SharedEma::new(EmaConfig::new()),
        }
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B> + TrainStep> TrainStep for Averaged<B, M> {
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: M::Input) -> TrainOutput<M::Output> {
        self.model.step(item)
    }
}
