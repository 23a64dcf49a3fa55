//! [`MemoryReport`]: where the memory of one training step goes, rows that add up to its
//! peak, and advice computed from the figures and from what the step already does.

use core::fmt;

use serde::{Deserialize, Serialize};

use super::{MemorySource, mib};

/// What the measured step already does: advice never repeats a switch that is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StepSettings {
    /// Autocast computes in f16/bf16 (the activations are already half).
    pub half_precision: bool,
    /// Activation checkpointing is on (`Autodiff<B, BalancedCheckpointing>`).
    pub checkpointing: bool,
    /// Sequences (or samples) per micro-batch, where known: at 1 there is nothing to split.
    pub micro_batch: Option<usize>,
    /// The frozen parameters are already stored in bf16/f16.
    pub frozen_storage_half: bool,
}

/// One switch that would shrink the step, and what it would save for this model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Advice {
    /// What to do, with the API that does it.
    pub action: String,
    /// Estimated bytes saved at the peak; `None` where it depends on choices not known here
    /// (which parts to freeze).
    pub saving: Option<u64>,
}

impl fmt::Display for Advice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.saving {
            Some(bytes) => write!(f, "{} (saves ~{:.2} MiB)", self.action, mib(bytes)),
            None => f.write_str(&self.action),
        }
    }
}

/// Where the memory of one training step goes.
///
/// Parameters, gradients and optimizer state are exact (tensor sizes); activations and the
/// peak are measured ([`MemorySource`]), and `None` where nothing measures them (Flex without
/// [`CountingAlloc`](super::CountingAlloc)) rather than a made-up zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemoryReport {
    /// Trainable parameters.
    pub parameters: u64,
    /// Values (elements) of the trainable parameters: the denominator of
    /// [`bytes_per_parameter`](Self::bytes_per_parameter).
    #[serde(default)]
    pub trainable_values: u64,
    /// Frozen parameters.
    pub frozen_parameters: u64,
    /// Gradients of the step.
    pub gradients: u64,
    /// Optimizer state (as the optimizer reports it).
    pub optimizer_state: u64,
    /// What autodiff saved for backward: in use after forward minus before it.
    pub activations: Option<u64>,
    /// Live before the step and not one of the categories: the batch, caches, the rest of
    /// the process heap (Flex) or of the device (other buffers).
    pub other_in_use: Option<u64>,
    /// The highest bytes in use during the step.
    pub peak_in_use: Option<u64>,
    /// The allocator's reserve beyond the peak: padding, cached pages, fragmentation.
    pub reserve_and_fragmentation: Option<u64>,
    /// Where the measured figures come from; `None`: nothing measured them.
    pub source: Option<MemorySource>,
    /// What the step already does.
    pub settings: StepSettings,
}

/// A row of the report that has a size.
const ACTIVATIONS: &str = "activations";
const PARAMETERS: &str = "parameters";
const GRADIENTS: &str = "gradients";
const OPTIMIZER_STATE: &str = "optimizer state";
const WORKSPACE: &str = "workspace / temporaries";

impl MemoryReport {
    /// The exact categories, the activations and what else was live (0 where unknown).
    fn named_sum(&self) -> u64 {
        self.parameters
            + self.frozen_parameters
            + self.gradients
            + self.optimizer_state
            + self.activations.unwrap_or(0)
            + self.other_in_use.unwrap_or(0)
    }

    /// The peak minus every other row: the backend's workspace and the step's temporaries,
    /// so that the rows add up to the peak. Negative when the categories were not all live
    /// at the peak (gradients grow while activations are freed during backward).
    pub fn unexplained(&self) -> Option<i64> {
        self.peak_in_use
            .map(|peak| peak as i64 - self.named_sum() as i64)
    }

    /// Bytes per trainable parameter value held by the weights, their gradients and the
    /// optimizer state: 16 for f32 weights with f32 AdamW, about 6 with
    /// [`MemorySaving`](crate::MemorySaving). `None` without trainable parameters.
    pub fn bytes_per_parameter(&self) -> Option<f64> {
        (self.trainable_values > 0).then(|| {
            (self.parameters + self.gradients + self.optimizer_state) as f64
                / self.trainable_values as f64
        })
    }

    /// The largest category of the step among the figures shown, and its bytes ("other live
    /// memory" is not the step's and is left out).
    pub fn largest(&self) -> (&'static str, u64) {
        [
            (ACTIVATIONS, self.activations.unwrap_or(0)),
            (PARAMETERS, self.parameters + self.frozen_parameters),
            (GRADIENTS, self.gradients),
            (OPTIMIZER_STATE, self.optimizer_state),
            (WORKSPACE, self.unexplained().map_or(0, |b| b.max(0) as u64)),
        ]
        .into_iter()
        .max_by_key(|(_, b)| *b)
        .unwrap_or((ACTIVATIONS, 0))
    }

    /// The switches that would shrink the largest category, largest saving first; none that
    /// the step already uses.
    pub fn advice(&self) -> Vec<Advice> {
        let s = self.settings;
        let activations = self.activations.unwrap_or(0);
        let mut advice = Vec::new();
        let mut add = |on: bool, action: &str, saving: Option<u64>| {
            if on {
                advice.push(Advice {
                    action: action.to_string(),
                    saving,
                });
            }
        };
        match self.largest().0 {
            ACTIVATIONS | WORKSPACE => {
                add(
                    !s.half_precision,
                    "autocast at Precision::Bf16 or F16: the saved activations in half",
                    Some(activations / 2),
                );
                add(
                    s.micro_batch != Some(1),
                    "half the micro-batch, two accumulated (GradientAccumulation)",
                    Some(activations / 2),
                );
                add(
                    !s.checkpointing,
                    "activation checkpointing (Autodiff<B, BalancedCheckpointing>): recompute instead of keeping",
                    Some(activations / 2),
                );
            }
            OPTIMIZER_STATE => {
                // 8-bit moments: 2 bytes (and a little) per value instead of 8.
                let int8 = 2 * self.trainable_values + self.trainable_values / 32;
                add(
                    self.optimizer_state > 2 * int8,
                    "8-bit AdamW moments (FusedAdamWConfig::with_moments(MomentStorage::int8()), or MemorySaving)",
                    Some(self.optimizer_state.saturating_sub(int8)),
                );
                add(
                    true,
                    "SGD with momentum keeps one buffer per parameter, Adam two",
                    Some(self.optimizer_state / 2),
                );
                add(
                    true,
                    "freeze what needs no training (Frozen: no gradient, no optimizer state)",
                    None,
                );
            }
            GRADIENTS => {
                add(
                    self.f32_weights(),
                    "bf16 weights with stochastic rounding (MemorySaving): half the weights and their gradients",
                    Some((self.parameters + self.gradients) / 2),
                );
                add(
                    true,
                    "freeze what needs no training (Frozen: no gradient, no optimizer state)",
                    None,
                );
            }
            _ => {
                add(
                    self.frozen_parameters > 0 && !s.frozen_storage_half,
                    "store the frozen parts in bf16/f16 (Frozen::with_storage)",
                    Some(self.frozen_parameters / 2),
                );
                add(
                    self.frozen_parameters == 0,
                    "freeze a backbone and store it in bf16 (Frozen::with_storage)",
                    None,
                );
                add(
                    self.f32_weights(),
                    "bf16 weights with stochastic rounding (MemorySaving): half the weights and their gradients",
                    Some((self.parameters + self.gradients) / 2),
                );
                add(true, "a smaller model", None);
            }
        }
        advice.sort_by_key(|a| core::cmp::Reverse(a.saving.unwrap_or(0)));
        advice
    }
}

impl MemoryReport {
    /// The trainable parameters are 4-byte floats.
    fn f32_weights(&self) -> bool {
        self.trainable_values > 0 && self.parameters >= 4 * self.trainable_values
    }
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match self.source {
            Some(MemorySource::Allocator) => "device allocator, sampled",
            Some(MemorySource::CountingAllocator) => "process heap, CountingAlloc",
            None => "tensor sizes only",
        };
        let unknown =
            "unknown: install burn_amp::memory::CountingAlloc (Flex) or use a CubeCL backend";
        let row = |f: &mut fmt::Formatter<'_>, name: &str, bytes: Option<u64>| match bytes {
            Some(b) => writeln!(f, "  {name:<24} {:>10.2} MiB", mib(b)),
            None => writeln!(f, "  {name:<24} {unknown}"),
        };
        writeln!(f, "memory of one training step ({source})")?;
        row(f, PARAMETERS, Some(self.parameters))?;
        row(f, "frozen parameters", Some(self.frozen_parameters))?;
        row(f, GRADIENTS, Some(self.gradients))?;
        row(f, OPTIMIZER_STATE, Some(self.optimizer_state))?;
        row(f, ACTIVATIONS, self.activations)?;
        if let Some(other) = self.other_in_use {
            row(f, "other live memory", Some(other))?;
        }
        match self.unexplained() {
            Some(b) if b >= 0 => row(f, WORKSPACE, Some(b as u64))?,
            Some(b) => writeln!(
                f,
                "  {:<24} {:>10.2} MiB",
                "not live at the peak",
                -mib(b.unsigned_abs())
            )?,
            None => {}
        }
        row(f, "= peak in use", self.peak_in_use)?;
        if let Some(reserve) = self.reserve_and_fragmentation {
            row(f, "reserve + fragmentation", Some(reserve))?;
        }
        if let Some(b) = self.bytes_per_parameter() {
            writeln!(
                f,
                "  {:<24} {b:>10.2} (weights + gradients + optimizer state)",
                "bytes per parameter"
            )?;
        }
        let (name, _) = self.largest();
        let advice = self.advice();
        if advice.is_empty() {
            writeln!(f, "  largest: {name}; every switch for it is already on")?;
        } else {
            writeln!(f, "  largest: {name}; to shrink it:")?;
            for a in advice {
                writeln!(f, "    - {a}")?;
            }
        }
        Ok(())
    }
}
