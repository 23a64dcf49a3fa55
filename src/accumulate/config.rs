//! The configuration of a [`GradientAccumulation`] and its typed errors.

use std::collections::HashMap;

use burn::config::Config;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::{GradientAccumulation, Window};
use crate::scaler::Stage;

/// How the micro-batch gradients of a window are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Reduction {
    /// `Σ gᵢ / N`: the update of one batch of `N × b` for a mean-reduced loss.
    #[default]
    Mean,
    /// `Σ gᵢ`, as Burn's `GradientsAccumulator`.
    Sum,
}

/// Configuration of [`GradientAccumulation`].
#[derive(Config, Debug)]
pub struct GradientAccumulationConfig {
    /// Micro-batches per window, i.e. per optimizer step (`N`, at least 1).
    pub micro_batches: usize,
    /// How the micro-batch gradients are combined.
    #[config(default = "Reduction::Mean")]
    pub reduction: Reduction,
    /// Clip the accumulated (and unscaled) gradients of all parameters to this global L2
    /// norm at the boundary, as `torch.nn.utils.clip_grad_norm_`.
    pub max_grad_norm: Option<f32>,
    /// Compute the global L2 norm of each window's gradients (unscaled) without clipping
    /// them, for [`GradientAccumulation::last_grad_norm`] and the `GradNormMetric`
    /// (Lightning's `grad_norm`): one reduction over the window's sums, on the device, read
    /// only by whoever asks. With `max_grad_norm` the clipping computes it anyway.
    #[config(default = false)]
    pub track_grad_norm: bool,
}

/// A configuration that cannot run, or a window used inconsistently.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum AccumulationError {
    /// `micro_batches = 0`.
    #[error("gradient accumulation needs micro_batches >= 1 per optimizer step, got 0")]
    ZeroMicroBatches,
    /// `max_grad_norm` not a finite number > 0.
    #[error("max_grad_norm = {0}: expected a finite number > 0 (or None for no clipping)")]
    InvalidMaxGradNorm(f32),
    /// The gradients were unscaled before a micro-step.
    #[error(
        "the module's gradients are at stage {stage:?} of the GradScaler: inside an \
         accumulation window the sums are unscaled once, at the boundary. Do not call \
         GradScaler::unscale before stepping a GradientAccumulation; set max_grad_norm \
         for clipping"
    )]
    ScalerNotReady {
        /// The module's stage.
        stage: Stage,
    },
    /// The scale changed within a window: the micro-batches were scaled differently.
    #[error(
        "the loss scale changed after micro-step {micro_step} of the window (an update() \
         that changed it, or a load_record() on the GradScaler mid-window): the accumulated \
         gradients mix scales. Call discard_window(), and update the scaler only after \
         steps of this module"
    )]
    ScaleChangedMidWindow {
        /// Micro-steps already accumulated in the window.
        micro_step: usize,
    },
    /// A resumed window's sums carry another scale than the scaler's.
    #[error(
        "the resumed accumulation window was scaled by {window_scale}, but the GradScaler's \
         scale is {scaler_scale}: load the scaler record saved with this accumulation record, \
         or call discard_window()"
    )]
    WindowScaleMismatch {
        /// The scale saved with the window.
        window_scale: f32,
        /// The scaler's scale now.
        scaler_scale: f32,
    },
    /// A window begun unscaled continued scaled, or the reverse.
    #[error(
        "this window was begun {begun} and continued {continued}: scaled and unscaled \
         gradients cannot be summed. Use one kind of step for the whole window"
    )]
    MixedScaling {
        /// How the window was begun.
        begun: &'static str,
        /// How it was continued.
        continued: &'static str,
    },
    /// A record saved with another configuration.
    #[error(
        "the accumulation record was saved with micro_batches = {saved_micro_batches}, \
         {saved_reduction:?}, but this accumulator has micro_batches = {micro_batches}, \
         {reduction:?}: a partial window cannot be carried across"
    )]
    RecordMismatch {
        /// Micro-batches in the record.
        saved_micro_batches: usize,
        /// Reduction in the record.
        saved_reduction: Reduction,
        /// Micro-batches of this accumulator.
        micro_batches: usize,
        /// Reduction of this accumulator.
        reduction: Reduction,
    },
}

impl GradientAccumulationConfig {
    /// Wraps `inner`. Fails for `micro_batches = 0` or a `max_grad_norm` that is not > 0.
    pub fn init<B: AutodiffBackend, O>(
        &self,
        inner: O,
    ) -> Result<GradientAccumulation<O, B>, AccumulationError> {
        if self.micro_batches == 0 {
            return Err(AccumulationError::ZeroMicroBatches);
        }
        if let Some(norm) = self.max_grad_norm
            && !(norm.is_finite() && norm > 0.0)
        {
            return Err(AccumulationError::InvalidMaxGradNorm(norm));
        }
        Ok(GradientAccumulation {
            inner,
            micro_batches: self.micro_batches,
            reduction: self.reduction,
            max_grad_norm: self.max_grad_norm,
            track_grad_norm: self.track_grad_norm,
            last_grad_norm: None,
            buffers: HashMap::new(),
            micro_step: 0,
            optimizer_steps: 0,
            window: Window::Empty,
        })
    }
}
