//! The saved state of a [`GradientAccumulation`](super::GradientAccumulation): the wrapped
//! optimizer's record, the position in the window, the scale the window's sums carry, and the
//! partial sums.

use hashbrown::HashMap as RecordMap;

use burn::module::ParamId;
use burn::prelude::*;
use burn::record::Record;
use burn_std::FloatDType;

use crate::record::ExactTensor;

/// One parameter's partial sum in a [`GradientAccumulationRecord`].
#[derive(Record)]
pub struct AccumulatedGradRecord<B: Backend> {
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// The partial sum (f32), flattened; saved as it is, whatever the recorder's precision
    /// (a scaled window's sums overflow f16).
    pub acc: ExactTensor<B, 1>,
    /// The gradients' dtype (0 f32, 1 f16, 2 bf16, 3 f64, 4 flex32).
    pub dtype: u8,
}

/// The state of a [`GradientAccumulation`](super::GradientAccumulation).
#[derive(Record)]
pub struct GradientAccumulationRecord<B: Backend, R: Record<B>> {
    /// The wrapped optimizer's record.
    pub inner: R,
    /// Micro-batches per window it was saved with.
    pub micro_batches: usize,
    /// Whether it summed (`Reduction::Sum`).
    pub sum: bool,
    /// Micro-steps accumulated in the saved window.
    pub micro_step: usize,
    /// Windows closed.
    pub optimizer_steps: u64,
    /// 0 empty, 1 unscaled, 2 scaled.
    pub window: u8,
    /// The loss scale a scaled window's sums were multiplied by: checked against the
    /// scaler's when the window resumes.
    pub window_scale: Option<f32>,
    /// The partial sums.
    pub buffers: RecordMap<ParamId, AccumulatedGradRecord<B>>,
}

pub(super) fn dtype_code(dtype: FloatDType) -> u8 {
    match dtype {
        FloatDType::F32 => 0,
        FloatDType::F16 => 1,
        FloatDType::BF16 => 2,
        FloatDType::F64 => 3,
        FloatDType::Flex32 => 4,
    }
}

pub(super) fn dtype_from_code(code: u8) -> FloatDType {
    match code {
        1 => FloatDType::F16,
        2 => FloatDType::BF16,
        3 => FloatDType::F64,
        4 => FloatDType::Flex32,
        _ => FloatDType::F32,
    }
}
