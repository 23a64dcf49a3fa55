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
//! let (model, _) = scaler.step(&mut accum, lr, model, grads)?;
//! ```
//! burn-train's `Learner` advances its scheduler on **every** micro-batch (its own
//! `grads_accumulation` does too). Under `Learner`, wrap the scheduler in a
//! [`WindowedLrScheduler`] with the same `N`: it advances the wrapped schedule once per
//! window, exactly at the boundary call, so the schedule counts optimizer steps. Leave
//! `Learner`'s own `grads_accumulation` unset when the wrapper accumulates.
//!
//! # Loss scaling
//! Give the wrapper to [`GradScaler::step`](crate::scaler::GradScaler::step) like any
//! optimizer (it is a [`ScaledStep`] when the wrapped one is), and call `update` after every
//! micro-batch as usual. Mid-window the still-scaled gradients are summed and the scaler's
//! `update` leaves the scale alone; at the boundary the sums are checked once (and unscaled,
//! inside the fused kernels or before clipping), the wrapped optimizer steps or skips once,
//! and `update` then moves the scale once. An overflow in any micro-step therefore skips the
//! whole window exactly once. A scale that changes mid-window anyway (another module's
//! `update` by hand, a loaded scaler record) is an [`AccumulationError::ScaleChangedMidWindow`];
//! optimizers sharing an [`AmpOptimizer`](crate::AmpOptimizer)'s scaler keep it for the
//! window ([`ScaledStep::holds_scaled_gradients`]).
//!
//! # Saving
//! [`Optimizer::to_record`] saves the partial sums, the position in the window, the loss scale
//! a scaled window carries and the wrapped optimizer's record: a run stopped after any
//! micro-step resumes bit for bit, whatever the recorder's precision settings (the partial
//! sums are saved as they are: Burn's half-precision settings would round them to f16, where
//! a scaled sum over 65504 is inf). A resumed window checks the scaler's scale against the
//! saved one (one host read) and refuses a mismatch
//! ([`AccumulationError::WindowScaleMismatch`]).
//!
//! # Epochs
//! A window counts micro-batches, not epochs: with an epoch of `k · N + r` micro-batches its
//! last `r` carry into the next epoch's first window (Lightning and Accelerate step on a
//! partial window at the end of the dataloader instead). The last partial window of a run is
//! not applied; [`discard_window`](GradientAccumulation::discard_window) says so explicitly.

mod config;
pub mod kernels;
mod record;
mod scheduler;

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_backend::ops::FloatTensorOps;
use burn_std::FloatDType;

pub use config::{AccumulationError, GradientAccumulationConfig, Reduction};
pub use kernels::AccumKernels;
pub use record::{AccumulatedGradRecord, GradientAccumulationRecord};
pub use scheduler::WindowedLrScheduler;

use crate::grads::{GradEntry, GradList, flat, primitive, tensor};
use crate::scaler::{ScaleSignals, ScaledStep, ScalerError, ScalerKernels, Stage, StepOutcome};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// The loss scale a scaled window's sums carry.
#[derive(Debug, Clone)]
enum WindowScale<B: Backend> {
    /// Seen this run: the scaler's scale tensor and generation at the first micro-step.
    Live {
        scale: Tensor<B, 1>,
        generation: u64,
    },
    /// Loaded from a record: checked against the scaler at the next micro-step.
    Saved(f32),
}

/// What the current window holds.
#[derive(Debug, Clone)]
enum Window<B: Backend> {
    /// No micro-step yet.
    Empty,
    /// Begun unscaled: true gradients.
    Unscaled,
    /// Begun scaled: gradients × scale.
    Scaled(WindowScale<B>),
}

impl<B: Backend> Window<B> {
    fn name(&self) -> &'static str {
        match self {
            Window::Empty => "empty",
            Window::Unscaled => "unscaled",
            Window::Scaled(_) => "loss-scaled",
        }
    }
}

/// One parameter's partial sum, flattened.
#[derive(Debug, Clone)]
struct Buffer<B: Backend> {
    /// f32 (f64 for f64 gradients).
    acc: Tensor<B, 1>,
    shape: Shape,
    /// The gradients' dtype: the unscaled path hands the sum back in it.
    dtype: FloatDType,
}

/// Gradient accumulation around any optimizer `O`. See the [module docs](self).
#[derive(Clone)]
pub struct GradientAccumulation<O, B: AutodiffBackend> {
    inner: O,
    micro_batches: usize,
    reduction: Reduction,
    max_grad_norm: Option<f32>,
    /// Compute the norm without clipping.
    track_grad_norm: bool,
    /// The global norm of the last window's gradients before clipping (with `max_grad_norm`
    /// or `track_grad_norm`).
    last_grad_norm: Option<Tensor<Inner<B>, 1>>,
    buffers: HashMap<ParamId, Buffer<Inner<B>>>,
    micro_step: usize,
    optimizer_steps: u64,
    window: Window<Inner<B>>,
}

/// `acc + grad × weight` on one flattened gradient: the window's arithmetic.
type AccumulateFn<B> = fn(Option<Tensor<B, 1>>, Tensor<B, 1>, f32) -> Tensor<B, 1>;

/// [`AccumKernels::accumulate`]: one fused pass on CubeCL backends, in place in `acc`'s
/// buffer. Used by the scaled path, whose bounds require the kernels already.
fn accumulate_kernel<B: AccumKernels>(
    acc: Option<Tensor<B, 1>>,
    grad: Tensor<B, 1>,
    weight: f32,
) -> Tensor<B, 1> {
    tensor(B::accumulate(acc.map(primitive), primitive(grad), weight))
}

/// The same from plain burn ops ([`kernels::fallback::accumulate`], bit for bit the kernel
/// wherever the kernel is that default, as on `Flex`). Used by the plain [`Optimizer`] impl,
/// which keeps the bounds of Burn's own optimizers so that the wrapper works over backends
/// that do not implement the kernel traits (ndarray, candle, tch, router, user backends).
fn accumulate_plain<B: Backend>(
    acc: Option<Tensor<B, 1>>,
    grad: Tensor<B, 1>,
    weight: f32,
) -> Tensor<B, 1> {
    tensor(kernels::fallback::accumulate::<B>(
        acc.map(primitive),
        primitive(grad),
        weight,
    ))
}

impl<O, B: AutodiffBackend> GradientAccumulation<O, B> {
    /// Wraps `inner` with `micro_batches` micro-batches per optimizer step, averaged.
    pub fn new(inner: O, micro_batches: usize) -> Result<Self, AccumulationError> {
        GradientAccumulationConfig::new(micro_batches).init(inner)
    }

    /// Micro-batches per window (`N`).
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
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
        self.micro_step + 1 == self.micro_batches
    }

    /// The global L2 norm of the last closed window's gradients, unscaled, before clipping
    /// (what `torch.nn.utils.clip_grad_norm_` returns): f32 `[1]` on the device, not read;
    /// inf or NaN for a window that overflowed. Computed by the clipping, or without it
    /// with `track_grad_norm`: `None` with neither, or before the first boundary.
    pub fn last_grad_norm(&self) -> Option<Tensor<Inner<B>, 1>> {
        self.last_grad_norm.clone()
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
            Reduction::Mean => 1.0 / self.micro_batches as f32,
            Reduction::Sum => 1.0,
        }
    }

    fn close_window(&mut self) {
        self.buffers.clear();
        self.micro_step = 0;
        self.window = Window::Empty;
        self.optimizer_steps += 1;
    }

    fn mixed(&self, continued: &'static str) -> AccumulationError {
        AccumulationError::MixedScaling {
            begun: self.window.name(),
            continued,
        }
    }

    /// Adds one micro-batch's gradients to the window with `add`.
    fn accumulate(&mut self, grads: GradList<Inner<B>>, add: AccumulateFn<Inner<B>>) {
        use burn_backend::TensorMetadata;
        let weight = self.weight();
        for GradEntry { id, grad, .. } in grads.into_entries() {
            let shape = grad.shape();
            let dtype: FloatDType = grad.dtype().into();
            let previous = self.buffers.remove(&id).map(|b| {
                assert_eq!(
                    b.shape, shape,
                    "parameter {id} changed shape within an accumulation window"
                );
                b.acc
            });
            // Over several devices a parameter's gradient is summed on the first that has
            // one (Burn's `MultiGradientsParams`), which can change from one micro-batch to
            // the next (an expert no token on device 0 chose): the window's sum stays put.
            let mut grad = flat(grad);
            if let Some(acc) = &previous {
                let device = acc.device();
                if grad.device() != device {
                    grad = grad.to_device(&device);
                }
            }
            let acc = add(previous, grad, weight);
            self.buffers.insert(id, Buffer { acc, shape, dtype });
        }
    }

    /// Closes the window: the sums of `module`'s trainable parameters as a gradient list
    /// (f32, each reshaped to its parameter), in visiting order. Every other sum (a parameter
    /// frozen mid-window, or gone) is dropped.
    fn take_window<M: AutodiffModule<B>>(&mut self, module: &M) -> GradList<Inner<B>> {
        struct Visit<'a, B: Backend> {
            buffers: &'a mut HashMap<ParamId, Buffer<B>>,
            entries: Vec<GradEntry<B>>,
        }
        impl<AB: AutodiffBackend> ModuleVisitor<AB> for Visit<'_, Inner<AB>> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                if let Some(b) = self.buffers.remove(&param.id)
                    && param.is_require_grad()
                {
                    self.entries.push(GradEntry {
                        id: param.id,
                        grad: Inner::<AB>::float_reshape(primitive(b.acc), b.shape),
                        param_dtype: param.val().dtype(),
                    });
                }
            }
        }
        let mut visit = Visit {
            buffers: &mut self.buffers,
            entries: Vec::new(),
        };
        module.visit(&mut visit);
        let entries = visit.entries;
        self.close_window();
        GradList::from_entries(entries)
    }

    /// One unscaled micro-step; at the boundary the window's gradients (clipped; f32 sums,
    /// f64 for an f64 parameter: not narrowed to a half gradient's dtype, where a sum of 8
    /// micro-batches' 1e4 would be inf), else `None`.
    fn unscaled_micro_step<M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        grads: GradList<Inner<B>>,
        add: AccumulateFn<Inner<B>>,
    ) -> Result<Option<GradList<Inner<B>>>, AccumulationError> {
        match self.window {
            Window::Empty | Window::Unscaled => self.window = Window::Unscaled,
            Window::Scaled(_) => return Err(self.mixed("unscaled")),
        }
        self.accumulate(grads, add);
        if !self.is_boundary() {
            self.micro_step += 1;
            return Ok(None);
        }
        let mut list = self.take_window(module).widened();
        self.last_grad_norm = match self.max_grad_norm {
            Some(max_norm) => list.clip_by_global_norm(max_norm),
            None if self.track_grad_norm => list.global_norm(),
            None => None,
        };
        Ok(Some(list))
    }

    /// Like [`Optimizer::step`], with misuse reported as an error rather than a panic.
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
        let list = GradList::take::<B, M>(&module, &mut grads);
        drop(grads);
        let add = accumulate_plain::<Inner<B>>;
        match self.unscaled_micro_step(&module, list, add)? {
            None => Ok(module),
            Some(list) => {
                // A Burn optimizer wants each gradient in its parameter's dtype.
                let grads = list.to_param_dtypes().into_params::<B, M>(&module);
                Ok(self.inner.step(lr, module, grads))
            }
        }
    }

    /// Checks that a scaled micro-step continues the window's scale, and starts or adopts it.
    fn continue_scaled(&mut self, scale: &ScaleSignals<Inner<B>>) -> Result<(), AccumulationError> {
        if scale.inv_scale.is_none() {
            return Err(AccumulationError::ScalerNotReady {
                stage: Stage::Unscaled,
            });
        }
        match &self.window {
            Window::Unscaled => return Err(self.mixed("loss-scaled")),
            Window::Scaled(WindowScale::Live { generation, .. })
                if *generation != scale.generation =>
            {
                return Err(AccumulationError::ScaleChangedMidWindow {
                    micro_step: self.micro_step,
                });
            }
            Window::Scaled(WindowScale::Saved(saved)) => {
                // Once per resumed window: one host read.
                let now = scale.scale.clone().into_scalar().elem::<f32>();
                if now != *saved {
                    return Err(AccumulationError::WindowScaleMismatch {
                        window_scale: *saved,
                        scaler_scale: now,
                    });
                }
            }
            Window::Empty | Window::Scaled(WindowScale::Live { .. }) => {}
        }
        if !matches!(self.window, Window::Scaled(WindowScale::Live { .. })) {
            self.window = Window::Scaled(WindowScale::Live {
                scale: scale.scale.clone(),
                generation: scale.generation,
            });
        }
        Ok(())
    }
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
    /// When the window was begun loss-scaled ([`try_step`](GradientAccumulation::try_step)
    /// returns the error instead).
    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        self.try_step(lr, module, grads)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`step`](Optimizer::step), with each parameter's gradients summed over the devices
    /// onto one, which the window's sum then stays on.
    fn step_multi(&mut self, lr: LearningRate, module: M, mut grads: MultiGradientsParams) -> M {
        let list = GradList::take_multi::<B, M>(&module, &mut grads);
        let add = accumulate_plain::<Inner<B>>;
        match self.unscaled_micro_step(&module, list, add) {
            Ok(None) => module,
            Ok(Some(list)) => {
                let grads = list.to_param_dtypes().into_params::<B, M>(&module);
                self.inner.step(lr, module, grads)
            }
            Err(e) => panic!("{e}"),
        }
    }

    fn to_record(&self) -> Self::Record {
        self.record_with(self.inner.to_record())
    }

    /// # Panics
    /// When the record was saved with another `micro_batches` or reduction
    /// ([`try_load_record`](GradientAccumulation::try_load_record) returns the error).
    fn load_record(self, record: Self::Record) -> Self {
        self.try_load_record::<M>(record)
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

impl<M, B, O> ScaledStep<M, B> for GradientAccumulation<O, B>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    B::InnerBackend: ScalerKernels + AccumKernels,
    O: ScaledStep<M, B>,
{
    /// Mid-window: adds the (still scaled) gradients and reports
    /// [`StepOutcome::Accumulated`]. At the boundary: checks the sums once (unscaling them
    /// first when they are clipped) and hands them, in f32, to the wrapped optimizer.
    fn step_scaled(
        &mut self,
        lr: LearningRate,
        module: M,
        grads: GradList<Inner<B>>,
        scale: Option<&ScaleSignals<Inner<B>>>,
    ) -> Result<(M, StepOutcome<Inner<B>>), ScalerError> {
        let add = accumulate_kernel::<Inner<B>>;
        let Some(scale) = scale else {
            return match self.unscaled_micro_step(&module, grads, add)? {
                None => Ok((module, StepOutcome::Accumulated)),
                Some(list) => self.inner.step_scaled(lr, module, list, None),
            };
        };
        self.continue_scaled(scale)?;
        self.accumulate(grads, add);
        if !self.is_boundary() {
            self.micro_step += 1;
            return Ok((module, StepOutcome::Accumulated));
        }
        let list = self.take_window(&module);
        let found = scale.found_inf.clone().unwrap_or_else(|| scale.zero());
        let (list, signals) = match (self.max_grad_norm, &scale.inv_scale) {
            // Clipping needs true values: unscale the f32 sums (and check) in one pass.
            (Some(max_norm), Some(inv)) => {
                let (mut list, found) = list.unscale_and_check(inv.clone(), found);
                self.last_grad_norm = list.clip_by_global_norm(max_norm);
                let signals = ScaleSignals {
                    inv_scale: None,
                    found_inf: Some(found),
                    ..scale.clone()
                };
                (list, signals)
            }
            // The wrapped optimizer unscales (the fused kernels in f32, as they update).
            _ => {
                // The norm of the scaled f32 sums, times 1/scale: no pass to unscale them.
                // (Its squares overflow f32 only where the norm is past ~1.8e19 / scale,
                // a window the check skips anyway.)
                self.last_grad_norm = match (self.track_grad_norm, &scale.inv_scale) {
                    (false, _) => None,
                    (true, Some(inv)) => list
                        .global_norm()
                        .map(|norm| norm.clone() * inv.clone().to_device(&norm.device())),
                    (true, None) => list.global_norm(),
                };
                let found = list.check_finite(found);
                let signals = ScaleSignals {
                    found_inf: Some(found),
                    ..scale.clone()
                };
                (list, signals)
            }
        };
        self.inner.step_scaled(lr, module, list, Some(&signals))
    }

    /// A window begun under a scale (live, or loaded from a record), until its boundary or
    /// [`discard_window`](GradientAccumulation::discard_window).
    fn holds_scaled_gradients(&self) -> bool {
        matches!(self.window, Window::Scaled(_))
    }

    fn last_grad_norm(&self) -> Option<Tensor<Inner<B>, 1>> {
        self.last_grad_norm.clone()
    }
}
