//! Typed errors: each says what was wrong and what to do.

use thiserror::Error;

use crate::Precision;

/// Errors of burn-amp.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum AmpError {
    /// Autocast was asked for a dtype the device cannot compute in.
    #[error(
        "autocast precision {precision} is not supported on device {device} (backend {backend}); \
         use Precision::F16 (`autocast(Precision::F16)`) or Precision::F32 on this device"
    )]
    UnsupportedPrecision {
        /// The precision asked for.
        precision: Precision,
        /// The device, as `Debug` prints it.
        device: String,
        /// The backend's name.
        backend: String,
    },
}
