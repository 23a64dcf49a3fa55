//! The saved state of a [`GradientAccumulation`], and its saving and loading: the wrapped
//! optimizer's record, the position in the window, the scale the window's sums carry, and the
//! partial sums.

use std::collections::HashMap;

use hashbrown::HashMap as RecordMap;

use burn::module::{AutodiffModule, ParamId};
use burn::optim::Optimizer;
use burn::prelude::*;
use burn::record::Record;
use burn::tensor::backend::AutodiffBackend;
use burn_std::FloatDType;

use super::{AccumulationError, Buffer, GradientAccumulation, Reduction, Window, WindowScale};
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

/// The state of a [`GradientAccumulation`].
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

impl<O, B: AutodiffBackend> GradientAccumulation<O, B> {
    pub(super) fn record_with<R: Record<B>>(&self, inner: R) -> GradientAccumulationRecord<B, R> {
        let (window, window_scale) = match &self.window {
            Window::Empty => (0, None),
            Window::Unscaled => (1, None),
            Window::Scaled(WindowScale::Live { scale, .. }) => {
                (2, Some(scale.clone().into_scalar().elem::<f32>()))
            }
            Window::Scaled(WindowScale::Saved(saved)) => (2, Some(*saved)),
        };
        let buffers = self
            .buffers
            .iter()
            .map(|(id, b)| {
                let record = AccumulatedGradRecord {
                    shape: b.shape.to_vec(),
                    acc: ExactTensor(Tensor::from_inner(b.acc.clone())),
                    dtype: dtype_code(b.dtype),
                };
                (*id, record)
            })
            .collect();
        GradientAccumulationRecord {
            inner,
            micro_batches: self.micro_batches,
            sum: self.reduction == Reduction::Sum,
            micro_step: self.micro_step,
            optimizer_steps: self.optimizer_steps,
            window,
            window_scale,
            buffers,
        }
    }

    /// Restores a saved state, wrapped optimizer included. Fails when the record was saved
    /// with another `micro_batches` or reduction.
    pub fn try_load_record<M>(
        mut self,
        record: GradientAccumulationRecord<B, O::Record>,
    ) -> Result<Self, AccumulationError>
    where
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        let saved_reduction = if record.sum {
            Reduction::Sum
        } else {
            Reduction::Mean
        };
        if record.micro_batches != self.micro_batches || saved_reduction != self.reduction {
            return Err(AccumulationError::RecordMismatch {
                saved_micro_batches: record.micro_batches,
                saved_reduction,
                micro_batches: self.micro_batches,
                reduction: self.reduction,
            });
        }
        self.inner = self.inner.load_record(record.inner);
        self.micro_step = record.micro_step;
        self.optimizer_steps = record.optimizer_steps;
        self.window = match (record.window, record.window_scale) {
            (1, _) => Window::Unscaled,
            (2, Some(scale)) => Window::Scaled(WindowScale::Saved(scale)),
            // A scaled window saved without its scale cannot be checked: start afresh.
            _ => Window::Empty,
        };
        self.buffers = if matches!(self.window, Window::Empty) {
            self.micro_step = 0;
            HashMap::new()
        } else {
            record
                .buffers
                .into_iter()
                .map(|(id, r)| {
                    let buffer = Buffer {
                        acc: r.acc.into_tensor().inner(),
                        shape: Shape::from(r.shape),
                        dtype: dtype_from_code(r.dtype),
                    };
                    (id, buffer)
                })
                .collect()
        };
        Ok(self)
    }
}

fn dtype_code(dtype: FloatDType) -> u8 {
    match dtype {
        FloatDType::F32 => 0,
        FloatDType::F16 => 1,
        FloatDType::BF16 => 2,
        FloatDType::F64 => 3,
        FloatDType::Flex32 => 4,
    }
}

fn dtype_from_code(code: u8) -> FloatDType {
    match code {
        1 => FloatDType::F16,
        2 => FloatDType::BF16,
        3 => FloatDType::F64,
        4 => FloatDType::Flex32,
        _ => FloatDType::F32,
    }
}
