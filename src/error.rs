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
}

fn off_note(alternative: &Precision) -> &'static str {
    if *alternative == Precision::F32 {
        ", which turns autocast off,"
    } else {
        ""
    }
}
