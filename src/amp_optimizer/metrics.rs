//! The loss scaler in burn-train's dashboard and logs: [`LossScaleMetric`] and
//! [`SkippedStepsMetric`], numeric metrics like Burn's own `LearningRateMetric`; and the
//! memory of a step ([`StepMemoryMetric`], [`ActivationMemoryMetric`]) where the backend has
//! allocator figures (CubeCL: wgpu, cuda), sampled on the training thread.
//!
//! ```ignore
//! let optim = AmpOptimizer::new(adam, GradScalerConfig::new())?;
//! SupervisedTraining::new(dir, train, valid)
//!     .metric_train_numeric(LossScaleMetric::new(&optim.monitor()))
//!     .metric_train_numeric(SkippedStepsMetric::new(&optim.monitor()))
//! ```
//!
//! Memory, opt-in with [`AmpOptimizer::track_memory`](super::AmpOptimizer::track_memory): every
//! `every`-th micro-step, the allocator's bytes in use are read when `backward` starts (the
//! activations autodiff saved are all live), when the step starts (parameters, gradients,
//! optimizer state) and after it. Each read waits for the device (CubeCL keeps no peak and
//! counts per thread, so the training thread must read): sample every few hundred steps. The
//! bytes in use after each sampled step are watched for a steady climb (a leak:
//! [`ScalerMonitor::memory_growth`], and a warning in the log).
//!
//! burn-train updates metrics on a thread of its own, after the training loop handed it the
//! item: a metric shows the scaler as it is then, which may be a step or two past that item.
//!
//! The scale and the skip count live on the device. The optimizer makes no host read for
//! them; the metrics read both in one transfer when the dashboard asks, at most once per
//! optimizer step (the second metric of an iteration reuses the first's read). That read is
//! the metrics' cost, like Burn's `LossMetric` reading the loss.

use core::any::Any;
use std::sync::{Arc, Mutex};

use burn::prelude::*;
use burn::record::Record;
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes, NumericEntry,
    SerializedEntry,
};

use crate::memory::{GrowthWatch, MemoryGrowth, mib};

/// The scaler's figures at one point of training.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalerSnapshot {
    /// The loss scale of the next backward (1 while nothing was scaled, or the loaded scale
    /// after a resume).
    pub scale: f32,
    /// Optimizer steps skipped because the gradients overflowed, since the start of training
    /// (a resumed run continues the count of its record).
    pub skipped_steps: u64,
    /// Optimizer steps taken or skipped (accumulation micro-steps not counted), since the
    /// start of training, resumes included.
    pub optimizer_steps: u64,
}

/// The step counts of an [`AmpOptimizer`](super::AmpOptimizer)'s record: the metrics of a
/// resumed run continue from them rather than from 0.
#[derive(Record, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepCounts {
    /// Optimizer steps taken or skipped.
    pub optimizer_steps: u64,
    /// Of those, skipped on inf/NaN gradients.
    pub skipped_steps: u64,
}

/// The memory of one sampled micro-step, from the allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepMemoryFigures {
    /// The highest of the samples: at the start of backward and of the optimizer step.
    pub peak_bytes: u64,
    /// What backward found live beyond what the previous sampled step left: the saved
    /// activations (and the batch). `None` on the first sample.
    pub activation_bytes: Option<u64>,
    /// In use after the step: parameters and optimizer state (and accumulation buffers).
    pub after_step_bytes: u64,
}

type Reader = Box<dyn Fn() -> (f32, f32) + Send>;
type NormReader = Box<dyn Fn() -> f32 + Send>;

/// Reads the bytes in use on a device (`&B::Device` as `&dyn Any`), with the backward passes
/// so far where the backend counts them; `None` without figures.
pub(crate) type MemoryProbe = Arc<dyn Fn(&dyn Any) -> Option<(u64, Option<u64>)> + Send + Sync>;

/// Where in a micro-step a memory sample is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SamplePoint {
    Backward,
    StepStart,
    StepEnd,
}

struct MemoryTracking {
    probe: MemoryProbe,
    every: u64,
    at_backward: Option<u64>,
    at_step: Option<u64>,
    after_previous: Option<u64>,
    last: Option<StepMemoryFigures>,
    /// The bytes in use after each sampled step, watched for a steady climb.
    growth: GrowthWatch,
    climb: Option<MemoryGrowth>,
}

#[derive(Default)]
struct MonitorState {
    optimizer_steps: u64,
    micro_steps: u64,
    memory: Option<MemoryTracking>,
    /// Reads `(scale, skipped)` from the device: set after each scaled step.
    reader: Option<Reader>,
    /// `(scale, skipped)` before the first scaled step: `(1, 0)`, or a loaded record's.
    resting: Option<(f32, u64)>,
    /// The last read, and the step count it was made at.
    cached: Option<(u64, ScalerSnapshot)>,
    /// Reads the last optimizer step's gradient norm, where the optimizer computed one.
    grad_norm: Option<NormReader>,
    /// The last read of it, and the step count it was made at.
    cached_norm: Option<(u64, f32)>,
}

/// A shared view of an [`AmpOptimizer`](super::AmpOptimizer)'s scaler: clones see the same
/// optimizer, across threads.
#[derive(Clone, Default)]
pub struct ScalerMonitor {
    state: Arc<Mutex<MonitorState>>,
}

impl core::fmt::Debug for ScalerMonitor {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ScalerMonitor").finish_non_exhaustive()
    }
}

impl ScalerMonitor {
    fn lock(&self) -> std::sync::MutexGuard<'_, MonitorState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Called by the optimizer after each step: `stepped` when an optimizer step was taken or
    /// skipped (not a micro-step that only accumulated), with the device tensors to read (the
    /// scaler's f32 `[4]` state and the skip count) after a scaled one, and the global norm
    /// of a step's gradients where the optimizer computed one. Handing over tensor handles
    /// reads nothing.
    pub(crate) fn record<B: Backend>(
        &self,
        stepped: bool,
        device: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
        grad_norm: Option<Tensor<B, 1>>,
    ) {
        let mut state = self.lock();
        state.micro_steps += 1;
        if stepped {
            state.optimizer_steps += 1;
            state.cached_norm = None;
            state.grad_norm = grad_norm.map(|norm| -> NormReader {
                Box::new(move || norm.clone().into_scalar().elem::<f32>())
            });
        }
        if let Some((scaler_state, skipped)) = device {
            state.cached = None;
            state.reader = Some(Box::new(move || {
                let both = Tensor::cat(
                    vec![scaler_state.clone().narrow(0, 0, 1), skipped.clone()],
                    0,
                );
                let values = both.into_data().to_vec::<f32>().unwrap_or_default();
                (
                    values.first().copied().unwrap_or(f32::NAN),
                    values.get(1).copied().unwrap_or(0.0),
                )
            }));
        }
    }

    /// The global L2 norm of the last optimizer step's gradients, unscaled and before
    /// clipping (inf or NaN for a step skipped on an overflow): one read from the device per
    /// optimizer step. `None` before the first, or where no norm is computed (a
    /// `GradientAccumulation` computes it with `with_max_grad_norm` or
    /// `with_track_grad_norm(true)`).
    pub fn grad_norm(&self) -> Option<f32> {
        let mut state = self.lock();
        let steps = state.optimizer_steps;
        if let Some((at, norm)) = state.cached_norm
            && at == steps
        {
            return Some(norm);
        }
        let norm = state.grad_norm.as_ref()?();
        state.cached_norm = Some((steps, norm));
        Some(norm)
    }

    /// Turns memory sampling on: every `every`-th micro-step (at least 1) through `probe`.
    pub(crate) fn track_memory(&self, probe: MemoryProbe, every: u64) {
        self.lock().memory = Some(MemoryTracking {
            probe,
            every: every.max(1),
            at_backward: None,
            at_step: None,
            after_previous: None,
            last: None,
            growth: GrowthWatch::default(),
            climb: None,
        });
    }

    /// Samples the bytes in use at `point` of the current micro-step, if it is a sampled one.
    pub(crate) fn sample(&self, point: SamplePoint, device: &dyn Any) {
        let (probe, micro_step) = {
            let state = self.lock();
            match &state.memory {
                Some(m) if state.micro_steps.is_multiple_of(m.every) => {
                    (m.probe.clone(), state.micro_steps)
                }
                _ => return,
            }
        };
        // Outside the lock: the read waits for the device.
        let Some((bytes, backward_passes)) = probe(device) else {
            return;
        };
        let mut state = self.lock();
        let Some(m) = state.memory.as_mut() else {
            return;
        };
        match point {
            SamplePoint::Backward => m.at_backward = Some(bytes),
            SamplePoint::StepStart => m.at_step = Some(bytes),
            SamplePoint::StepEnd => {
                let (backward, step) = (m.at_backward.take(), m.at_step.take());
                let peak = backward.into_iter().chain(step).max().unwrap_or(bytes);
                m.last = Some(StepMemoryFigures {
                    peak_bytes: peak.max(bytes),
                    activation_bytes: backward
                        .zip(m.after_previous)
                        .map(|(b, before)| b.saturating_sub(before)),
                    after_step_bytes: bytes,
                });
                m.after_previous = Some(bytes);
                if let Err(climb) = m.growth.record(micro_step, bytes, backward_passes) {
                    log::warn!("burn-amp: {climb}");
                    m.climb = Some(climb);
                }
            }
        }
    }

    /// Continues from a record's counts and scale: the figures until the next scaled step.
    /// The device's skip count restarts from `counts.skipped_steps` (`AmpOptimizer` does that).
    pub(crate) fn resume(&self, counts: StepCounts, scale: Option<f32>) {
        let mut state = self.lock();
        state.optimizer_steps = counts.optimizer_steps;
        state.reader = None;
        state.cached = None;
        state.resting = Some((scale.unwrap_or(1.0), counts.skipped_steps));
    }

    /// The memory figures of the last sampled micro-step (`None` before one, without
    /// [`track_memory`](super::AmpOptimizer::track_memory), or without allocator figures).
    pub fn step_memory(&self) -> Option<StepMemoryFigures> {
        self.lock().memory.as_ref().and_then(|m| m.last)
    }

    /// The last steady climb of the memory in use after the sampled steps (a leak: see
    /// [`GrowthWatch`]), also logged as a warning when found; `None` while there is none, or
    /// without [`track_memory`](super::AmpOptimizer::track_memory).
    pub fn memory_growth(&self) -> Option<MemoryGrowth> {
        self.lock().memory.as_ref().and_then(|m| m.climb.clone())
    }

    /// The figures now: one read from the device, unless nothing changed since the last.
    pub fn snapshot(&self) -> ScalerSnapshot {
        let mut state = self.lock();
        let steps = state.optimizer_steps;
        if let Some((at, snapshot)) = state.cached
            && at == steps
        {
            return snapshot;
        }
        let (scale, skipped) = match &state.reader {
            Some(read) => {
                let (scale, skipped) = read();
                (scale, skipped as u64)
            }
            None => state.resting.unwrap_or((1.0, 0)),
        };
        let snapshot = ScalerSnapshot {
            scale,
            skipped_steps: skipped,
            optimizer_steps: steps,
        };
        state.cached = Some((steps, snapshot));
        snapshot
    }
}

/// Defines a numeric burn-train metric that shows one figure of a [`ScalerMonitor`].
macro_rules! scaler_metric {
    ($(#[$doc:meta])* $name:ident, $label:literal, $precision:literal, |$m:ident| $value:expr) => {
        $(#[$doc])*
        #[derive(Clone)]
        pub struct $name {
            monitor: ScalerMonitor,
            name: MetricName,
            state: NumericMetricState,
        }

        impl $name {
            /// The metric of the optimizer that `monitor` belongs to.
            pub fn new(monitor: &ScalerMonitor) -> Self {
                Self {
                    monitor: monitor.clone(),
                    name: Arc::new($label.to_string()),
                    state: NumericMetricState::new(),
                }
            }
        }

        impl Metric for $name {
            type Input = ();

            fn update(&mut self, _item: &(), _metadata: &MetricMetadata) -> SerializedEntry {
                let $m = &self.monitor;
                let value: f64 = $value;
                self.state
                    .update(value, 1, FormatOptions::new(self.name()).precision($precision))
            }

            fn clear(&mut self) {
                self.state.reset()
            }

            fn name(&self) -> MetricName {
                self.name.clone()
            }

            fn attributes(&self) -> MetricAttributes {
                NumericAttributes {
                    unit: None,
                    higher_is_better: false,
                }
                .into()
            }
        }

        impl Numeric for $name {
            fn value(&self) -> NumericEntry {
                self.state.current_value()
            }

            fn running_value(&self) -> NumericEntry {
                self.state.running_value()
            }
        }
    };
}

scaler_metric!(
    /// The loss scale (1 at bf16/f32): a scale that keeps falling means overflowing gradients.
    LossScaleMetric,
    "Loss Scale",
    0,
    |m| f64::from(m.snapshot().scale)
);

scaler_metric!(
    /// Optimizer steps skipped on inf/NaN gradients since the start of training.
    SkippedStepsMetric,
    "Skipped Steps",
    0,
    |m| m.snapshot().skipped_steps as f64
);

scaler_metric!(
    /// The global L2 norm of the last optimizer step's gradients, unscaled and before clipping
    /// (PyTorch's `clip_grad_norm_` return value, Lightning's `grad_norm`): a spike before a
    /// loss spike, inf or NaN at a skipped step. Computed by a `GradientAccumulation` (a
    /// window of 1 without accumulation) that clips (`max_grad_norm`) or only measures
    /// (`track_grad_norm`); NaN without either.
    GradNormMetric,
    "Gradient Norm",
    4,
    |m| m.grad_norm().map_or(f64::NAN, f64::from)
);

scaler_metric!(
    /// The peak bytes in use of the last sampled micro-step, in MiB (NaN before a sample, or
    /// without allocator figures). Needs `AmpOptimizer::track_memory`.
    StepMemoryMetric,
    "Step Memory Peak (MiB)",
    1,
    |m| m.step_memory().map_or(f64::NAN, |f| mib(f.peak_bytes))
);

scaler_metric!(
    /// The activations of the last sampled micro-step (what backward found live beyond what
    /// the previous step left), in MiB. Needs `AmpOptimizer::track_memory`.
    ActivationMemoryMetric,
    "Activation Memory (MiB)",
    1,
    |m| {
        m.step_memory()
            .and_then(|f| f.activation_bytes)
            .map_or(f64::NAN, mib)
    }
);
