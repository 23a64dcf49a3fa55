//! One value gathering the memory-saving switches, whose `Display` explains each choice.

use core::fmt;

use crate::Precision;
use crate::scaler::GradScalerConfig;

/// The memory-saving switches of a training run.
#[derive(Debug, Clone)]
pub struct MemorySaving {
    /// Autocast precision: bf16/f16 halve the activations autodiff saves.
    pub precision: Precision,
    /// Micro-batches per optimizer step (1: no accumulation).
    pub accumulation_steps: usize,
    /// Names of the frozen parts (no gradients, no optimizer state).
    pub frozen: Vec<String>,
    /// Frozen weights stored in this precision (`F32` keeps them as they are).
    pub frozen_storage: Precision,
    /// Activation checkpointing (recompute instead of save).
    pub checkpointing: bool,
    /// Loss scaling; used only at `Precision::F16`.
    pub scaler: GradScalerConfig,
}

impl Default for MemorySaving {
    fn default() -> Self {
        Self {
            precision: Precision::Bf16,
            accumulation_steps: 1,
            frozen: Vec::new(),
            frozen_storage: Precision::F32,
            checkpointing: false,
            scaler: GradScalerConfig::new(),
        }
    }
}

impl MemorySaving {
    /// Sets the precision.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Sets the accumulation steps.
    pub fn with_accumulation(mut self, steps: usize) -> Self {
        self.accumulation_steps = steps;
        self
    }

    /// Names a frozen part.
    pub fn with_frozen(mut self, part: impl Into<String>, storage: Precision) -> Self {
        self.frozen.push(part.into());
        self.frozen_storage = storage;
        self
    }

    /// Turns activation checkpointing on or off.
    pub fn with_checkpointing(mut self, on: bool) -> Self {
        self.checkpointing = on;
        self
    }
}

impl fmt::Display for MemorySaving {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "memory-saving configuration")?;
        match self.precision {
            Precision::F32 => {
                writeln!(f, "  precision f32: no autocast; activations saved in f32")?
            }
            p => writeln!(
                f,
                "  precision {p}: matmul/conv/attention in {p}, saved activations half the bytes{}",
                if p.needs_loss_scaling() {
                    format!(
                        "; loss scaling from {} (f16 underflows below 6e-8)",
                        self.scaler.init_scale
                    )
                } else {
                    "; no loss scaling needed (f32's range)".into()
                }
            )?,
        }
        if self.accumulation_steps > 1 {
            writeln!(
                f,
                "  accumulation {}: activations of one micro-batch at a time, one optimizer step per {} micro-batches",
                self.accumulation_steps, self.accumulation_steps
            )?;
        } else {
            writeln!(f, "  accumulation off: one optimizer step per batch")?;
        }
        if self.frozen.is_empty() {
            writeln!(
                f,
                "  nothing frozen: every parameter has a gradient and optimizer state"
            )?;
        } else {
            writeln!(
                f,
                "  frozen {}: no gradients, no optimizer state{}",
                self.frozen.join(", "),
                match self.frozen_storage {
                    Precision::F32 => String::new(),
                    p => format!(", weights stored in {p} (half the bytes)"),
                }
            )?;
        }
        writeln!(
            f,
            "  checkpointing {}",
            if self.checkpointing {
                "on: activations recomputed in backward instead of saved (more compute)"
            } else {
                "off"
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_explains_each_choice() {
        let text = MemorySaving::default()
            .with_precision(Precision::F16)
            .with_accumulation(4)
            .with_frozen("embeddings", Precision::Bf16)
            .with_checkpointing(true)
            .to_string();
        for needle in [
            "precision f16",
            "loss scaling from 65536",
            "accumulation 4",
            "frozen embeddings",
            "stored in bf16",
            "checkpointing on",
        ] {
            assert!(text.contains(needle), "missing `{needle}` in:\n{text}");
        }
    }
}
