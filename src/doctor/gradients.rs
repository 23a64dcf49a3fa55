//! The gradients' part of the precision report: each trainable parameter's gradient in the f32
//! and the autocast run, and what the loss scale does to it.

use crate::optim::groups::ModulePath;
use burn::module::{ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use serde::Serialize;

use super::Suggestion;
use super::measure::{range_loss, relative_error};
use crate::precision::Precision;

/// f16's smallest subnormal and largest finite value.
const F16_TINY: f64 = 5.960_464_5e-8;
const F16_MAX: f64 = 65504.0;
/// bf16's smallest subnormal and largest finite value.
const BF16_TINY: f64 = 9.183_549_6e-41;
const BF16_MAX: f64 = 3.389_531_4e38;

/// One parameter's gradient.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GradientPrecision {
    /// The parameter's path in the module (`layers.0.attn.query.weight`).
    pub parameter: String,
    /// The gradient's shape.
    pub shape: Vec<usize>,
    /// The f32 run's gradient's L2 norm (unscaled): an error relative to a gradient near 0
    /// says little.
    pub norm: f64,
    /// Relative error (L2) of the autocast run's gradient (unscaled) against the f32 run's.
    pub error: f64,
    /// Values nonzero in the f32 run and zero in the autocast run: underflow, measured.
    pub underflow: f64,
    /// Values that would underflow the half dtype once multiplied by the loss scale.
    pub underflow_at_scale: f64,
    /// Values that would overflow the half dtype once multiplied by the loss scale.
    pub overflow_at_scale: f64,
    /// What to do.
    pub suggestion: Suggestion,
}

/// Compares each trainable parameter's gradient in the two runs.
pub(super) struct Gradients<B: AutodiffBackend> {
    f32: GradientsParams,
    autocast: GradientsParams,
    precision: Precision,
    scale: f64,
    path: ModulePath,
    pub(super) rows: Vec<GradientPrecision>,
    _backend: core::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Gradients<B> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.enter(name);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let (Some(reference), Some(grad)) = (
            self.f32.get::<B::InnerBackend, D>(param.id),
            self.autocast.get::<B::InnerBackend, D>(param.id),
        ) else {
            return;
        };
        let shape = reference.shape().to_vec();
        let values = |t: Tensor<B::InnerBackend, D>| {
            t.into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .unwrap_or_default()
        };
        // Both runs' gradients are × scale; compared unscaled.
        let unscale = 1.0 / self.scale as f32;
        let reference: Vec<f32> = values(reference).iter().map(|g| g * unscale).collect();
        let grad: Vec<f32> = values(grad).iter().map(|g| g * unscale).collect();
        // The gradients are f32 here; what flushed them to zero is the half dtype upstream.
        let (underflow, _, _, _) = range_loss(&reference, &grad, f64::INFINITY);
        let (tiny, max) = match self.precision {
            Precision::F16 => (F16_TINY, F16_MAX),
            Precision::Bf16 => (BF16_TINY, BF16_MAX),
            Precision::F32 => (0.0, f64::INFINITY),
        };
        let n = reference.len().max(1) as f64;
        let scaled = |g: &f32| f64::from(g.abs()) * self.scale;
        let under_at = reference
            .iter()
            .filter(|g| **g != 0.0 && scaled(g) < tiny)
            .count() as f64
            / n;
        let over_at = reference.iter().filter(|g| scaled(g) > max).count() as f64 / n;
        let suggestion = if over_at > 0.0 {
            Suggestion::LowerLossScale
        } else if self.precision.needs_loss_scaling() && (underflow > 0.01 || under_at > 0.01) {
            Suggestion::RaiseLossScale
        } else {
            Suggestion::Fine
        };
        self.rows.push(GradientPrecision {
            parameter: self.path.joined(),
            shape,
            norm: reference
                .iter()
                .map(|g| f64::from(*g) * f64::from(*g))
                .sum::<f64>()
                .sqrt(),
            error: relative_error(&reference, &grad),
            underflow,
            underflow_at_scale: under_at,
            overflow_at_scale: over_at,
            suggestion,
        });
    }
}

impl<B: AutodiffBackend> Gradients<B> {
    pub(super) fn new(
        f32: GradientsParams,
        autocast: GradientsParams,
        precision: Precision,
        scale: f64,
    ) -> Self {
        Self {
            f32,
            autocast,
            precision,
            scale,
            path: ModulePath::default(),
            rows: Vec::new(),
            _backend: core::marker::PhantomData,
        }
    }
}
