//! Typed errors: each says what was wrong and what to do.

use thiserror::Error;

use crate::Precision;

/// Errors of burn-amp.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum AmpError {
    /// Autocast was asked for a dtype the device cannot compute in (explicit `F16` or `Bf16`).
    #[error(
        "autocast precision {precision} is not supported on device {device} (backend {backend}); \
         use Precision::{alternative:?} (`autocast(Precision::{alternative:?})`){} on this device",
        off_note(alternative)
    )]
    UnsupportedPrecision {
        /// The precision asked for.
        precision: Precision,
        /// The device, as `Debug` prints it.
        device: String,
        /// The backend's name.
        backend: String,
        /// What the device can run instead: the other low precision where supported, else
        /// `F32` (autocast off).
        alternative: Precision,
    },
    /// Anomaly mode found an op that created inf/NaN (see [`crate::doctor::detect_anomaly`]).
    #[error("an op created inf/NaN: {0}")]
    Anomaly(Box<crate::doctor::Anomaly>),
    /// A precision report was asked for while an `AmpOptimizer` is installed for the backend:
    /// its scale would multiply the loss on top of the report's.
    #[error(
        "PrecisionReport::measure runs its own loss scale, and an AmpOptimizer installed for \
         this backend would scale the loss again: measure before creating the AmpOptimizer \
         (or after dropping it), passing its scale (`optim.scale()`) as `loss_scale`"
    )]
    ReportUnderOptimizer,
}

fn off_note(alternative: &Precision) -> &'static str {
    if *alternative == Precision::F32 {
        ", which turns autocast off,"
    } else {
        ""
    }
}
