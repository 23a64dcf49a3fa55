//! Gradient accumulation as an optimizer: train with an effective batch of `N × b` while
//! holding the activations of only `b` samples.
//!
//! [`GradientAccumulation`] wraps any Burn [`Optimizer`] and is itself one, so it drops into
//! a hand-written loop or burn-train's `Learner` unchanged. Each call to
//! [`step`](Optimizer::step) adds the micro-batch's gradients to f32 buffers and returns the
//! module untouched; every `N`-th call (the *boundary*) hands the accumulated gradients to
//! the wrapped optimizer and clears them.
//!
//! # Mean, not sum
//! With [`Reduction::Mean`] (the default) the optimizer sees `Σ gᵢ / N`: for a loss that is
//! a mean over the batch, the same update as one batch of `N × b` (up to f32 rounding), so
//! learning rates need no retuning. [`Reduction::Sum`] gives `Σ gᵢ`, which is what Burn's
//! own `GradientsAccumulator` (and `LearnerBuilder::grads_accumulation`) computes: with sum,
//! an SGD learning rate tuned for one batch acts `N` times larger.
//!
//! # Missing and frozen parameters
//! - A parameter that gets no gradient in some micro-steps (an unused branch, a sparse
//!   head) is still divided by `N`: the missing micro-steps count as zero gradient. That is
//!   the gradient of the mean loss over all `N` micro-batches, and what one big batch gives.
//! - A parameter that stops requiring gradients mid-window (frozen, `no_grad`) or leaves
//!   the module has its partial accumulation **dropped** at the boundary, not applied.
//!
//! # Learning-rate schedules
//! The wrapper makes one optimizer step per window, and only the learning rate passed to the
//! boundary call is used (mid-window calls ignore theirs). A schedule should therefore
//! advance once per optimizer step, not per micro-batch. In a hand-written loop, step the
//! scheduler only when [`is_boundary`](GradientAccumulation::is_boundary) says the next
//! call closes the window:
//!
//! ```ignore
//! let lr = if accum.is_boundary() { scheduler.step() } else { 0.0 }; // unused mid-window
//! model = accum.step(lr, model, grads);
//! ```
//! burn-train's `Learner` advances its scheduler on **every** micro-batch (its own
//! `grads_accumulation` does too). Under `Learner`, wrap the scheduler in a
//! [`WindowedLrScheduler`] with the same `N`: it advances the wrapped schedule once per
//! window, exactly at the boundary call, so the schedule counts optimizer steps. Otherwise
//! a schedule passed to `Learner` must be written in micro-batches (warm-up and decay
//! lengths × N), and it then moves in jumps of N between optimizer steps. Leave `Learner`'s
//! own `grads_accumulation` unset when the wrapper accumulates.
//!
//! # Loss scaling
//! With an f16 [`GradScaler`], call
//! [`step_scaled`](GradientAccumulation::step_scaled) (any optimizer) or
//! [`step_scaled_fused`](GradientAccumulation::step_scaled_fused) (a fused one) instead of
//! the scaler's own `step`. Mid-window the still-scaled gradients are summed (the scale is
//! constant within a window, because the scaler's `update` only runs at boundaries); at the
//! boundary the sum is unscaled and checked once, optionally clipped, the step runs or is
//! skipped once, and the scale is updated once. An overflow in any micro-step therefore
//! skips the whole window exactly once. Touching the scaler mid-window (unscale, step,
//! update, load) is reported as an [`AccumulationError`]. Do not hand the wrapper to the
//! scaler's own `step` either: that would unscale and update per micro-batch, and an
//! overflowing micro-batch would be dropped from its window instead of skipping it.
//!
//! # Saving
//! [`Optimizer::to_record`] saves the partial sums, the position in the window and the
//! wrapped optimizer's record: a run stopped after any micro-step resumes bit for bit (with
//! `FullPrecisionSettings`; a half-precision recorder rounds the partial sums).

use std::collections::HashMap;

use hashbrown::HashMap as RecordMap;

use burn::config::Config;
use burn::lr_scheduler::LrScheduler;
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::Record;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use burn_std::FloatDType;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::kernels::{AmpKernels, fallback};
use crate::scaler::{FusedOptimizer, GradScaler, ScalerError, Stage, StepReport};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// What a scaled micro-step returns: the module, and at the boundary the scaler's report.
pub type ScaledStep<M, B> =
    Result<(M, Option<StepReport<<B as AutodiffBackend>::InnerBackend>>), AccumulationError>;

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
    /// Micro-batches per optimizer step (`N`, at least 1).
    pub steps: usize,
    /// How the micro-batch gradients are combined.
    #[config(default = "Reduction::Mean")]
    pub reduction: Reduction,
    /// Clip the accumulated (and unscaled) gradients of all parameters to this global L2
    /// norm at the boundary, as `torch.nn.utils.clip_grad_norm_`.
    pub max_grad_norm: Option<f32>,
}

/// A configuration that cannot run, or a window used inconsistently.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum AccumulationError {
    /// `steps = 0`.
    #[error("gradient accumulation needs steps >= 1 micro-batch per optimizer step, got 0")]
    ZeroSteps,
    /// `max_grad_norm` not a finite number > 0.
    #[error("max_grad_norm = {0}: expected a finite number > 0 (or None for no clipping)")]
    InvalidMaxGradNorm(f32),
    /// The scaler was unscaled or stepped outside the accumulation window.
    #[error(
        "the GradScaler is at stage {stage:?}, not Ready: inside an accumulation window only \
         step_scaled may unscale, step and update it"
    )]
    ScalerNotReady {
        /// The scaler's stage.
        stage: Stage,
    },
    /// The scale changed within a window: the micro-batches were scaled differently.
    #[error(
        "the loss scale changed after micro-step {micro_step} of the window (update() or \
         load_record() was called on the GradScaler mid-window): the accumulated gradients \
         mix scales. Call discard_window(), and leave the scaler to step_scaled"
    )]
    ScaleChangedMidWindow {
        /// Micro-steps already accumulated in the window.
        micro_step: usize,
    },
    /// A window begun with `step` continued with `step_scaled`, or the reverse.
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
        "the accumulation record was saved with steps = {saved_steps}, {saved_reduction:?}, \
         but this accumulator has steps = {steps}, {reduction:?}: a partial window cannot be \
         carried across"
    )]
    RecordMismatch {
        /// Steps in the record.
        saved_steps: usize,
        /// Reduction in the record.
        saved_reduction: Reduction,
        /// Steps of this accumulator.
        steps: usize,
        /// Reduction of this accumulator.
        reduction: Reduction,
    },
    /// The scaler refused a transition.
    #[error(transparent)]
    Scaler(#[from] ScalerError),
}

/// What the current window holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Window {
    /// No micro-step yet.
    Empty,
    /// Begun with [`Optimizer::step`]: true gradients.
    Unscaled,
    /// Begun with a scaled step: gradients × scale. `generation` is the scaler's
    /// [`scale_generation`](GradScaler::scale_generation) the window was scaled at (`None`
    /// after loading a record: adopted by the next call).
    Scaled { generation: Option<u64> },
}

impl Window {
    fn name(self) -> &'static str {
        match self {
            Window::Empty => "empty",
            Window::Unscaled => "unscaled (step)",
            Window::Scaled { .. } => "scaled (step_scaled)",
        }
    }

    fn code(self) -> u8 {
        match self {
            Window::Empty => 0,
            Window::Unscaled => 1,
            Window::Scaled { .. } => 2,
        }
    }

    fn from_code(code: u8) -> Self {
        match code {
            1 => Window::Unscaled,
            2 => Window::Scaled { generation: None },
            _ => Window::Empty,
        }
    }
}

/// One parameter's partial sum, flattened.
#[derive(Debug, Clone)]
struct Buffer<B: Backend> {
    /// f32 (f64 for f64 gradients).
    acc: Tensor<B, 1>,
    shape: Shape,
    /// The gradients' dtype: the optimizer gets the sum back in it.
    dtype: FloatDType,
}

/// A micro-step's arithmetic on one flattened gradient: `acc + grad × weight`.
type AccumulateFn<B> = fn(Option<Tensor<B, 1>>, Tensor<B, 1>, f32) -> Tensor<B, 1>;

/// `acc += grad × weight`, in f32 (f64 for f64 gradients), whatever the gradient's dtype:
/// [`AmpKernels::accumulate`], one fused pass on CubeCL backends (in place in `acc`'s
/// buffer), the burn ops of [`accumulate_into_plain`] elsewhere.
///
/// The whole arithmetic of a micro-step. A weight of 1 (sum, or `N = 1`) costs no
/// multiplication, so a one-step window hands the optimizer its gradient bit for bit.
///
/// Used by the scaled steps, whose bounds already require `B: AmpKernels`.
fn accumulate_into<B: AmpKernels>(
    acc: Option<Tensor<B, 1>>,
    grad: Tensor<B, 1>,
    weight: f32,
) -> Tensor<B, 1> {
    let acc = acc.map(|a| a.into_primitive().tensor());
    let sum = B::accumulate(acc, grad.into_primitive().tensor(), weight);
    Tensor::from_primitive(TensorPrimitive::Float(sum))
}

/// [`accumulate_into`] composed from plain burn ops ([`fallback::accumulate`], which is
/// also the default of [`AmpKernels::accumulate`]: the two agree bit for bit wherever the
/// kernel is that default, as on `Flex`).
///
/// Used by [`GradientAccumulation::try_step`] and the plain [`Optimizer`] impl. Those keep
/// the bounds of Burn's own optimizers: requiring `B::InnerBackend: AmpKernels` there would
/// stop `GradientAccumulation` from wrapping optimizers over backends that do not
/// implement `AmpKernels` (ndarray, candle, tch, router, or any user backend). So only the
/// scaled steps, which require it already, run the fused kernel.
fn accumulate_into_plain<B: Backend>(
    acc: Option<Tensor<B, 1>>,
    grad: Tensor<B, 1>,
    weight: f32,
) -> Tensor<B, 1> {
    let acc = acc.map(|a| a.into_primitive().tensor());
    let sum = fallback::accumulate::<B>(acc, grad.into_primitive().tensor(), weight);
    Tensor::from_primitive(TensorPrimitive::Float(sum))
}

/// Scales `grads` so that their global L2 norm is at most `max_norm`, on the device.
fn clip_global_norm<B: Backend>(grads: &mut [Tensor<B, 1>], max_norm: f32) {
    let Some(sum_sq) = grads
        .iter()
        .map(|g| g.clone().cast(FloatDType::F32).square().sum())
        .reduce(|a, b| a + b)
    else {
        return;
    };
    // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1.
    let coef = sum_sq
        .sqrt()
        .add_scalar(1e-6)
        .recip()
        .mul_scalar(max_norm)
        .clamp_max(1.0);
    for g in grads.iter_mut() {
        let c = coef.clone().cast(g.dtype());
        *g = g.clone() * c;
    }
}

/// Adds the gradients of `module`'s parameters in `grads` to `buffers`, with `add`.
fn accumulate_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    buffers: &mut HashMap<ParamId, Buffer<Inner<B>>>,
    weight: f32,
    add: AccumulateFn<Inner<B>>,
) {
    struct Visit<'a, B: Backend> {
        grads: &'a mut GradientsParams,
        buffers: &'a mut HashMap<ParamId, Buffer<B>>,
        weight: f32,
        add: AccumulateFn<B>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Visit<'_, Inner<B>> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(grad) = self.grads.remove::<Inner<B>, D>(param.id) else {
                return;
            };
            let shape = grad.shape();
            let dtype: FloatDType = grad.dtype().into();
            let flat = grad.reshape([shape.num_elements()]);
            let previous = self.buffers.remove(&param.id).map(|b| {
                assert_eq!(
                    b.shape, shape,
                    "parameter {} changed shape within an accumulation window",
                    param.id
                );
                b.acc
            });
            let acc = (self.add)(previous, flat, self.weight);
            self.buffers.insert(param.id, Buffer { acc, shape, dtype });
        }
    }
    module.visit(&mut Visit {
        grads,
        buffers,
        weight,
        add,
    });
}

/// The window's sums of `module`'s trainable parameters, in visiting order. Every other
/// sum (a parameter frozen mid-window, or gone) is dropped.
fn take_window<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    buffers: &mut HashMap<ParamId, Buffer<Inner<B>>>,
) -> Vec<(ParamId, Buffer<Inner<B>>)> {
    struct Visit<'a, B: Backend> {
        buffers: &'a mut HashMap<ParamId, Buffer<B>>,
        out: Vec<(ParamId, Buffer<B>)>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Visit<'_, Inner<B>> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(buffer) = self.buffers.remove(&param.id)
                && param.is_require_grad()
            {
                self.out.push((param.id, buffer));
            }
        }
    }
    let mut visit = Visit {
        buffers,
        out: Vec::new(),
    };
    module.visit(&mut visit);
    let out = visit.out;
    buffers.clear();
    out
}

/// Registers the sums as gradients of their parameters, cast to each sum's `dtype` and
/// reshaped to the parameter's rank.
fn to_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    list: Vec<(ParamId, Buffer<Inner<B>>)>,
) -> GradientsParams {
    struct Visit<B: Backend> {
        list: HashMap<ParamId, Buffer<B>>,
        out: GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Visit<Inner<B>> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(b) = self.list.remove(&param.id) {
                let grad: Tensor<Inner<B>, D> = b.acc.cast(b.dtype).reshape(b.shape);
                self.out.register::<Inner<B>, D>(param.id, grad);
            }
        }
    }
    let mut visit = Visit {
        list: list.into_iter().collect(),
        out: GradientsParams::new(),
    };
    module.visit(&mut visit);
    visit.out
}

/// Takes `module`'s gradients out of `grads`, flattened, keeping `dtypes` as their target.
fn from_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    dtypes: &HashMap<ParamId, FloatDType>,
) -> Vec<(ParamId, Buffer<Inner<B>>)> {
    struct Visit<'a, B: Backend> {
        grads: &'a mut GradientsParams,
        dtypes: &'a HashMap<ParamId, FloatDType>,
        out: Vec<(ParamId, Buffer<B>)>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Visit<'_, Inner<B>> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.remove::<Inner<B>, D>(param.id) {
                let shape = grad.shape();
                let dtype = self
                    .dtypes
                    .get(&param.id)
                    .copied()
                    .unwrap_or_else(|| grad.dtype().into());
                let acc = grad.reshape([shape.num_elements()]);
                self.out.push((param.id, Buffer { acc, shape, dtype }));
            }
        }
    }
    let mut visit = Visit {
        grads,
        dtypes,
        out: Vec::new(),
    };
    module.visit(&mut visit);
    visit.out
}

/// Multi-device gradients summed onto one [`GradientsParams`], as Burn's adaptor does.
fn single_device<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    multi: MultiGradientsParams,
) -> GradientsParams {
    struct Gather {
        multi: MultiGradientsParams,
        out: GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Gather {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some((grad, _)) = self.multi.remove::<Inner<B>, D>(param.id) {
                self.out.register::<Inner<B>, D>(param.id, grad);
            }
        }
    }
    let mut gather = Gather {
        multi,
        out: GradientsParams::new(),
    };
    module.visit(&mut gather);
    gather.out
}

/// Gradient accumulation around any optimizer `O`. See the [module docs](self).
#[derive(Clone)]
pub struct GradientAccumulation<O, B: AutodiffBackend> {
    inner: O,
    steps: usize,
    reduction: Reduction,
    max_grad_norm: Option<f32>,
    buffers: HashMap<ParamId, Buffer<Inner<B>>>,
    micro_step: usize,
    optimizer_steps: u64,
    window: Window,
}

impl GradientAccumulationConfig {
    /// Wraps `inner`. Fails for `steps = 0` or a `max_grad_norm` that is not > 0.
    pub fn init<B: AutodiffBackend, O>(
        &self,
        inner: O,
    ) -> Result<GradientAccumulation<O, B>, AccumulationError> {
        if self.steps == 0 {
            return Err(AccumulationError::ZeroSteps);
        }
        if let Some(norm) = self.max_grad_norm
            && !(norm.is_finite() && norm > 0.0)
        {
            return Err(AccumulationError::InvalidMaxGradNorm(norm));
        }
        Ok(GradientAccumulation {
            inner,
            steps: self.steps,
            reduction: self.reduction,
            max_grad_norm: self.max_grad_norm,
            buffers: HashMap::new(),
            micro_step: 0,
            optimizer_steps: 0,
            window: Window::Empty,
        })
    }
}

impl<O, B: AutodiffBackend> GradientAccumulation<O, B> {
    /// Wraps `inner` with `steps` micro-batches per optimizer step and the mean reduction.
    pub fn new(inner: O, steps: usize) -> Result<Self, AccumulationError> {
        GradientAccumulationConfig::new(steps).init(inner)
    }

    /// Micro-batches per optimizer step (`N`).
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// The reduction.
    pub fn reduction(&self) -> Reduction {
        self.reduction
    }

    /// Micro-steps accumulated in the current window, `0..N`.
    pub fn micro_step(&self) -> usize {
        self.micro_step
    }

    /// Whether the next call to a step method closes the window and runs the optimizer:
    /// the moment to advance a learning-rate schedule (see the [module docs](self)).
    pub fn is_boundary(&self) -> bool {
        self.micro_step + 1 == self.steps
    }

    /// Windows closed so far: the optimizer steps taken, counting a window that the scaler
    /// skipped for overflow (as PyTorch's schedulers count it).
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The wrapped optimizer, mutably.
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// The wrapped optimizer; a partial window is dropped.
    pub fn into_inner(self) -> O {
        self.inner
    }

    /// Drops the partial window (its sums and position): the next call begins a new one.
    pub fn discard_window(&mut self) {
        self.buffers.clear();
        self.micro_step = 0;
        self.window = Window::Empty;
    }

    /// Bytes held by the partial sums (f32 buffers of every parameter with a gradient).
    pub fn buffer_bytes(&self) -> usize {
        self.buffers
            .values()
            .map(|b| b.shape.num_elements() * b.acc.dtype().size())
            .sum()
    }

    fn weight(&self) -> f32 {
        match self.reduction {
            Reduction::Mean => 1.0 / self.steps as f32,
            Reduction::Sum => 1.0,
        }
    }

    fn close_window(&mut self) {
        self.buffers.clear();
        self.micro_step = 0;
        self.window = Window::Empty;
        self.optimizer_steps += 1;
    }

    fn begin(&mut self, kind: Window) -> Result<(), AccumulationError> {
        match (self.window, kind) {
            (Window::Empty, _)
            | (Window::Unscaled, Window::Unscaled)
            | (Window::Scaled { .. }, Window::Scaled { .. }) => Ok(()),
            (begun, continued) => Err(AccumulationError::MixedScaling {
                begun: begun.name(),
                continued: continued.name(),
            }),
        }
    }

    /// Like [`Optimizer::step`], with a window begun by a scaled step reported as an error
    /// rather than a panic.
    pub fn try_step<M>(
        &mut self,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<M, AccumulationError>
    where
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        self.begin(Window::Unscaled)?;
        self.window = Window::Unscaled;
        let weight = self.weight();
        // Plain burn ops: no `AmpKernels` bound here (see `accumulate_into_plain`).
        let add = accumulate_into_plain::<Inner<B>>;
        accumulate_grads::<B, M>(&module, &mut grads, &mut self.buffers, weight, add);
        drop(grads);
        if !self.is_boundary() {
            self.micro_step += 1;
            return Ok(module);
        }
        let mut list = take_window::<B, M>(&module, &mut self.buffers);
        self.clip(&mut list);
        let grads = to_grads::<B, M>(&module, list);
        self.close_window();
        Ok(self.inner.step(lr, module, grads))
    }

    fn clip(&self, list: &mut [(ParamId, Buffer<Inner<B>>)]) {
        let Some(max_norm) = self.max_grad_norm else {
            return;
        };
        let mut grads: Vec<_> = list.iter().map(|(_, b)| b.acc.clone()).collect();
        clip_global_norm(&mut grads, max_norm);
        for ((_, b), g) in list.iter_mut().zip(grads) {
            b.acc = g;
        }
    }

    fn step_scaled_with<M, F>(
        &mut self,
        scaler: &mut GradScaler<B>,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
        run: F,
    ) -> ScaledStep<M, B>
    where
        M: AutodiffModule<B>,
        B::InnerBackend: AmpKernels,
        F: FnOnce(
            &mut GradScaler<B>,
            &mut O,
            LearningRate,
            M,
            GradientsParams,
        ) -> Result<(M, StepReport<Inner<B>>), ScalerError>,
    {
        let stage = scaler.stage();
        if stage != Stage::Ready {
            return Err(AccumulationError::ScalerNotReady { stage });
        }
        let generation = scaler.scale_generation();
        self.begin(Window::Scaled { generation: None })?;
        if let Window::Scaled {
            generation: Some(g),
        } = self.window
            && g != generation
        {
            return Err(AccumulationError::ScaleChangedMidWindow {
                micro_step: self.micro_step,
            });
        }
        self.window = Window::Scaled {
            generation: Some(generation),
        };
        // Still scaled: the sum is unscaled once, at the boundary.
        let weight = self.weight();
        let add = accumulate_into::<Inner<B>>;
        accumulate_grads::<B, M>(&module, &mut grads, &mut self.buffers, weight, add);
        drop(grads);
        if !self.is_boundary() {
            self.micro_step += 1;
            return Ok((module, None));
        }

        let list = take_window::<B, M>(&module, &mut self.buffers);
        self.close_window();
        // Unscale and check the sums in f32, then clip and cast back to the gradients' dtype.
        let dtypes: HashMap<ParamId, FloatDType> =
            list.iter().map(|(id, b)| (*id, b.dtype)).collect();
        let needs_cast = list.iter().any(|(_, b)| b.dtype != b.acc.dtype().into());
        let list = list
            .into_iter()
            .map(|(id, b)| {
                let dtype = b.acc.dtype().into();
                (id, Buffer { dtype, ..b })
            })
            .collect();
        let mut grads = to_grads::<B, M>(&module, list);
        scaler.unscale(&module, &mut grads)?;
        if needs_cast || self.max_grad_norm.is_some() {
            let mut list = from_grads::<B, M>(&module, &mut grads, &dtypes);
            self.clip(&mut list);
            grads = to_grads::<B, M>(&module, list);
        }
        let (module, report) = run(scaler, &mut self.inner, lr, module, grads)?;
        scaler.update()?;
        Ok((module, Some(report)))
    }

    /// One micro-step of loss-scaled training with any optimizer: pass the gradients of
    /// `scaler.scale(loss)`. Returns the module and, at the boundary, the scaler's report
    /// (`None` mid-window). At the boundary this unscales, checks, clips, steps (or skips)
    /// and updates the scaler: do not call its `unscale`, `step` or `update` yourself.
    ///
    /// Like [`GradScaler::step`], it reads `found_inf` once per window.
    pub fn step_scaled<M>(
        &mut self,
        scaler: &mut GradScaler<B>,
        lr: LearningRate,
        module: M,
        grads: GradientsParams,
    ) -> ScaledStep<M, B>
    where
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
        B::InnerBackend: AmpKernels,
    {
        self.step_scaled_with(scaler, lr, module, grads, |s, o, lr, m, g| {
            s.step(o, lr, m, g)
        })
    }

    /// [`step_scaled`](Self::step_scaled) with a [fused optimizer](crate::scaler::fused):
    /// no host read, mid-window or at the boundary.
    pub fn step_scaled_fused<M>(
        &mut self,
        scaler: &mut GradScaler<B>,
        lr: LearningRate,
        module: M,
        grads: GradientsParams,
    ) -> ScaledStep<M, B>
    where
        M: AutodiffModule<B>,
        O: FusedOptimizer<B>,
        B::InnerBackend: AmpKernels,
    {
        self.step_scaled_with(scaler, lr, module, grads, |s, o, lr, m, g| {
            s.step_fused(o, lr, m, g)
        })
    }

    fn record_with<R>(&self, inner: R) -> GradientAccumulationRecord<B, R>
    where
        R: Record<B>,
    {
        let buffers = self
            .buffers
            .iter()
            .map(|(id, b)| {
                (
                    *id,
                    AccumulatedGradRecord {
                        shape: b.shape.to_vec(),
                        acc: Tensor::from_inner(b.acc.clone()),
                        dtype: dtype_code(b.dtype),
                    },
                )
            })
            .collect();
        GradientAccumulationRecord {
            inner,
            steps: self.steps,
            sum: self.reduction == Reduction::Sum,
            micro_step: self.micro_step,
            optimizer_steps: self.optimizer_steps,
            window: self.window.code(),
            buffers,
        }
    }

    /// Restores a saved state, wrapped optimizer included. Fails when the record was saved
    /// with another `steps` or reduction.
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
        if record.steps != self.steps || saved_reduction != self.reduction {
            return Err(AccumulationError::RecordMismatch {
                saved_steps: record.steps,
                saved_reduction,
                steps: self.steps,
                reduction: self.reduction,
            });
        }
        self.inner = self.inner.load_record(record.inner);
        self.micro_step = record.micro_step;
        self.optimizer_steps = record.optimizer_steps;
        self.window = Window::from_code(record.window);
        self.buffers = record
            .buffers
            .into_iter()
            .map(|(id, r)| {
                let buffer = Buffer {
                    acc: r.acc.inner(),
                    shape: Shape::from(r.shape),
                    dtype: dtype_from_code(r.dtype),
                };
                (id, buffer)
            })
            .collect();
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

/// One parameter's partial sum in a [`GradientAccumulationRecord`].
#[derive(Record)]
pub struct AccumulatedGradRecord<B: Backend> {
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// The partial sum (f32), flattened.
    pub acc: Tensor<B, 1>,
    /// The gradients' dtype (0 f32, 1 f16, 2 bf16, 3 f64, 4 flex32).
    pub dtype: u8,
}

/// The state of a [`GradientAccumulation`]: the wrapped optimizer's record, the position in
/// the window and the partial sums.
#[derive(Record)]
pub struct GradientAccumulationRecord<B: Backend, R: Record<B>> {
    /// The wrapped optimizer's record.
    pub inner: R,
    /// `N` it was saved with.
    pub steps: usize,
    /// Whether it summed (`Reduction::Sum`).
    pub sum: bool,
    /// Micro-steps accumulated in the saved window.
    pub micro_step: usize,
    /// Windows closed.
    pub optimizer_steps: u64,
    /// 0 empty, 1 unscaled, 2 scaled.
    pub window: u8,
    /// The partial sums.
    pub buffers: RecordMap<ParamId, AccumulatedGradRecord<B>>,
}

impl<M, B, O> Optimizer<M, B> for GradientAccumulation<O, B>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    O: Optimizer<M, B>,
{
    type Record = GradientAccumulationRecord<B, O::Record>;

    /// Accumulates; every `N`-th call steps the wrapped optimizer with the window's mean
    /// (or sum). Mid-window `lr` is ignored.
    ///
    /// # Panics
    /// When the window was begun by a scaled step ([`try_step`](GradientAccumulation::try_step)
    /// returns the error instead).
    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        self.try_step(lr, module, grads)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        let grads = single_device::<B, M>(&module, grads);
        Optimizer::<M, B>::step(self, lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.record_with(self.inner.to_record())
    }

    /// # Panics
    /// When the record was saved with another `steps` or reduction
    /// ([`try_load_record`](GradientAccumulation::try_load_record) returns the error).
    fn load_record(self, record: Self::Record) -> Self {
        self.try_load_record::<M>(record)
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// A learning-rate scheduler that advances once per accumulation window: for burn-train's
/// `Learner`, which steps its scheduler on every micro-batch.
///
/// Call `step` once per micro-batch, in lockstep with [`GradientAccumulation::step`] (as
/// `Learner` does): the `N`-th call of each window, the boundary, advances the wrapped
/// schedule and returns its value; the calls before it return that same upcoming value
/// without advancing (they only label the micro-batch). The schedule then counts optimizer
/// steps, as it would without accumulation.
#[derive(Clone)]
pub struct WindowedLrScheduler<S> {
    inner: S,
    steps: usize,
    position: usize,
}

impl<S: LrScheduler> WindowedLrScheduler<S> {
    /// Wraps `inner` for windows of `steps` micro-batches.
    pub fn new(inner: S, steps: usize) -> Result<Self, AccumulationError> {
        if steps == 0 {
            return Err(AccumulationError::ZeroSteps);
        }
        Ok(Self {
            inner,
            steps,
            position: 0,
        })
    }

    /// The wrapped scheduler.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: LrScheduler> LrScheduler for WindowedLrScheduler<S> {
    type Record<B: Backend> = (S::Record<B>, usize);

    fn step(&mut self) -> LearningRate {
        if self.position + 1 == self.steps {
            self.position = 0;
            self.inner.step()
        } else {
            self.position += 1;
            self.inner.clone().step()
        }
    }

    fn to_record<B: Backend>(&self) -> Self::Record<B> {
        (self.inner.to_record::<B>(), self.position)
    }

    fn load_record<B: Backend>(mut self, record: Self::Record<B>) -> Self {
        self.inner = self.inner.load_record::<B>(record.0);
        self.position = record.1 % self.steps;
        self
    }
}
