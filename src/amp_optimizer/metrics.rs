//! The loss scaler in burn-train's dashboard and logs: [`LossScaleMetric`] and
//! [`SkippedStepsMetric`], numeric metrics like Burn's own `LearningRateMetric`.
//!
//! ```ignore
//! let optim = AmpOptimizer::new(adam, GradScalerConfig::new())?;
//! SupervisedTraining::new(dir, train, valid)
//!     .metric_train_numeric(LossScaleMetric::new(&optim.monitor()))
//!     .metric_train_numeric(SkippedStepsMetric::new(&optim.monitor()))
//! ```
//!
//! The scale and the skip count live on the device. The optimizer makes no host read for
//! them; the metrics read both in one transfer when the dashboard asks, at most once per
//! optimizer step (the second metric of an iteration reuses the first's read). That read is
//! the metrics' cost, like Burn's `LossMetric` reading the loss.

use std::sync::{Arc, Mutex};

use burn::prelude::*;
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes, NumericEntry,
    SerializedEntry,
};

/// The scaler's figures at one point of training.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalerSnapshot {
    /// The loss scale of the next backward (1 while nothing was scaled).
    pub scale: f32,
    /// Optimizer steps skipped because the gradients overflowed, since the start.
    pub skipped_steps: u64,
    /// Optimizer steps taken or skipped (accumulation micro-steps not counted).
    pub optimizer_steps: u64,
}

type Reader = Box<dyn Fn() -> (f32, f32) + Send>;

#[derive(Default)]
struct MonitorState {
    optimizer_steps: u64,
    /// Reads `(scale, skipped)` from the device: set after each scaled step.
    reader: Option<Reader>,
    /// The last read, and the step count it was made at.
    cached: Option<(u64, ScalerSnapshot)>,
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
    /// scaler's f32 `[4]` state and the skip count) after a scaled one. Handing over tensor
    /// handles reads nothing.
    pub(crate) fn record<B: Backend>(
        &self,
        stepped: bool,
        device: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
    ) {
        let mut state = self.lock();
        if stepped {
            state.optimizer_steps += 1;
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

    /// The figures now: one read from the device, unless nothing changed since the last.
    pub fn snapshot(&self) -> ScalerSnapshot {
        let mut state = self.lock();
        let steps = state.optimizer_steps;
        if let Some((at, snapshot)) = state.cached
            && at == steps
        {
            return snapshot;
        }
        let (scale, skipped) = state.reader.as_ref().map_or((1.0, 0.0), |read| read());
        let snapshot = ScalerSnapshot {
            scale,
            skipped_steps: skipped as u64,
            optimizer_steps: steps,
        };
        state.cached = Some((steps, snapshot));
        snapshot
    }
}

/// Defines a numeric burn-train metric that shows one figure of a [`ScalerMonitor`].
macro_rules! scaler_metric {
    ($(#[$doc:meta])* $name:ident, $label:literal, $precision:literal, |$s:ident| $value:expr) => {
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
                let $s = self.monitor.snapshot();
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
    |s| f64::from(s.scale)
);

scaler_metric!(
    /// Optimizer steps skipped on inf/NaN gradients since the start of training.
    SkippedStepsMetric,
    "Skipped Steps",
    0,
    |s| s.skipped_steps as f64
);
