//! The precision doctor: which op made the first inf/NaN, and which ops lose most to half
//! precision.
//!
//! `Amp<B>` sees every float op, so it is the one place in a Burn stack that can answer both.
//! Two tools, each a scoped session on the calling thread:
//! - [`detect_anomaly`]: every float op's output is checked for inf/NaN on the device; the
//!   first op that *created* one (its inputs were finite) is reported once, as an
//!   [`Anomaly`]: op, policy category, dtypes, shapes, call index, and a backtrace trimmed to
//!   the model's frames. PyTorch's `detect_anomaly`, JAX's `jax_debug_nans`. A value no
//!   watched op made (the batch, a spoilt parameter) is told apart: [`Entered`].
//! - [`PrecisionReport::measure`]: one step run at f32 and under autocast on the same batch and
//!   weights; per op call, the error of its autocast output (against the f32 run, and against
//!   the same op run in f32 on the same inputs), underflow, overflow, range; for an op that
//!   chooses (argmax, top-k, a sort's indices) the share of its choices that differ from
//!   f32's; and the gradients' underflow at the loss scale.
//!
//! Off, each op pays one relaxed atomic load (no thread-local read): the overhead bench
//! (`benches/autocast.rs`) measures it. On, each op reads back to the host: a debugging mode.
//!
//! Coverage follows the stack: `Amp<Autodiff<B>>` sees the forward ops (autodiff runs the
//! backward on `B` directly); `Autodiff<Amp<B>>` sees forward and backward ops, and names the
//! forward op a backward op belongs to.

mod anomaly;
mod backtrace;
mod choices;
mod entered;
mod gradients;
mod measure;
mod precision_report;

pub(crate) use choices::Chosen;
use choices::{makes_choices, makes_indices_alone, makes_mask};

pub use anomaly::{Anomaly, AnomalyGuard, Cause, NonFinite, Phase, detect_anomaly, detect_nan};
pub use backtrace::Frame;
pub use entered::Entered;
pub use gradients::GradientPrecision;
pub use precision_report::{OpPrecision, PrecisionReport, Suggestion};

use core::any::Any;
use core::cell::{Cell, RefCell};
use core::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::{Backend, DType, Scalar, TensorMetadata};
use burn_std::{FloatDType, Shape};
use serde::Serialize;

use crate::backend::{Category, Op};
use crate::custom_op::CustomOp;

/// Threads with a session on: the only thing an op reads while every session is off.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SESSION: RefCell<Option<Session>> = const { RefCell::new(None) };
    /// Set while a probe runs its own ops on `B` (a nested `Amp` must not probe them).
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// What this thread's session does with each op.
pub(crate) enum Session {
    Anomaly(anomaly::State),
    Reference(precision_report::Reference),
    Compare(precision_report::Comparison),
}

/// Installs `session` on this thread until the returned value is dropped.
pub(crate) struct Installed {
    previous: Option<Session>,
    // A session is per thread: it must end on the thread that started it.
    _not_send: core::marker::PhantomData<*const ()>,
}

impl Installed {
    pub(crate) fn new(session: Session) -> Self {
        let previous = SESSION.with(|s| s.borrow_mut().replace(session));
        if previous.is_none() {
            ACTIVE.fetch_add(1, Ordering::Relaxed);
        }
        Self {
            previous,
            _not_send: core::marker::PhantomData,
        }
    }

    /// The session installed by `self`, taken out (it ends now; the previous one returns).
    pub(crate) fn take(mut self) -> Option<Session> {
        self.restore()
    }

    fn restore(&mut self) -> Option<Session> {
        let previous = self.previous.take();
        let had_previous = previous.is_some();
        let ours = SESSION.with(|s| core::mem::replace(&mut *s.borrow_mut(), previous));
        if ours.is_some() && !had_previous {
            ACTIVE.fetch_sub(1, Ordering::Relaxed);
        }
        ours
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        self.restore();
    }
}

/// Runs `f` on this thread's session, if one is installed.
pub(crate) fn with_session<R>(f: impl FnOnce(&mut Session) -> R) -> Option<R> {
    SESSION.with(|s| s.borrow_mut().as_mut().map(f))
}

/// Marks a training step's end: anomaly reports count op calls from the step's start.
/// `AmpOptimizer` calls it after each step.
#[inline(always)]
pub(crate) fn step_boundary() {
    if ACTIVE.load(Ordering::Relaxed) != 0 {
        with_session(|s| {
            if let Session::Anomaly(state) = s {
                state.next_step();
            }
        });
    }
}

/// Which session a probe serves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Anomaly,
    Reference,
    Compare,
}

/// The op a probe watches: one of the policy table's, or a [custom op](crate::custom_op).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProbedOp {
    Table(Op),
    Custom(CustomOp),
}

impl ProbedOp {
    fn name(self) -> &'static str {
        match self {
            Self::Table(op) => op.name(),
            Self::Custom(op) => op.name(),
        }
    }

    fn category(self) -> Category {
        match self {
            Self::Table(op) => op.category(),
            Self::Custom(op) => op.category(),
        }
    }
}

/// One op call under a session: written by the `autocast_ops!` macro around every float op
/// of `Amp<B>`, and by [`CustomOp::run`]. `start` is `None` whenever no session is on, and
/// that is all an op pays.
pub struct Probe<B: Backend> {
    op: ProbedOp,
    kind: Kind,
    /// The float inputs as the caller gave them (anomaly: were they finite already? report:
    /// which op made what a choice compares?).
    inputs: Vec<B::FloatTensorPrimitive>,
    /// The float inputs as the op ran, after autocast's casts.
    cast_inputs: Vec<B::FloatTensorPrimitive>,
    /// A scalar operand that is itself inf/NaN (a mask fill with -inf creates nothing).
    nonfinite_scalar: bool,
    /// Whether an input is in a half dtype: the op then runs in it.
    half_input: bool,
    /// The same op on the same inputs in f32 (precision report): its float outputs.
    shadows: Vec<B::FloatTensorPrimitive>,
    /// The op's `dim` argument, where it has one: the precision report compares the choices
    /// of a sort or a top-k along it.
    dim: Option<usize>,
}

impl<B: Backend> Probe<B> {
    /// A probe for this call, or `None` when this thread has no session (the cost of an op
    /// while the doctor is off: one relaxed atomic load).
    #[inline(always)]
    pub fn start(op: Op) -> Option<Self> {
        if ACTIVE.load(Ordering::Relaxed) == 0 {
            return None;
        }
        Self::start_cold(ProbedOp::Table(op))
    }

    /// [`start`](Self::start) for a custom op.
    #[inline(always)]
    pub(crate) fn start_custom(op: CustomOp) -> Option<Self> {
        if ACTIVE.load(Ordering::Relaxed) == 0 {
            return None;
        }
        Self::start_cold(ProbedOp::Custom(op))
    }

    #[cold]
    #[inline(never)]
    fn start_cold(op: ProbedOp) -> Option<Self> {
        if BUSY.with(Cell::get) {
            return None;
        }
        let kind = SESSION.with(|s| {
            s.borrow().as_ref().map(|s| match s {
                Session::Anomaly(_) => Kind::Anomaly,
                Session::Reference(_) => Kind::Reference,
                Session::Compare(_) => Kind::Compare,
            })
        })?;
        // Choices hold no inf or NaN; the precision report compares them with the f32 run's.
        if !makes_floats(op) && (kind == Kind::Anomaly || !makes_choices(op)) {
            return None;
        }
        Some(Self {
            op,
            kind,
            inputs: Vec::new(),
            cast_inputs: Vec::new(),
            nonfinite_scalar: false,
            half_input: false,
            shadows: Vec::new(),
            dim: None,
        })
    }

    /// One float input, before autocast's cast.
    pub fn input(&mut self, tensor: &B::FloatTensorPrimitive) {
        self.half_input |= is_half(tensor.dtype());
        // The report looks for the op that made what a choice compares.
        if self.kind == Kind::Anomaly || (self.kind == Kind::Compare && makes_choices(self.op)) {
            self.inputs.push(tensor.clone());
        }
    }

    /// One scalar operand.
    pub fn scalar(&mut self, scalar: &Scalar) {
        if let Scalar::Float(x) = scalar {
            self.nonfinite_scalar |= !x.is_finite();
        }
    }

    /// The op's `dim` argument.
    pub fn along(&mut self, dim: usize) {
        self.dim = Some(dim);
    }

    /// One float input as the op runs it, after autocast's cast.
    pub fn cast_input(&mut self, tensor: &B::FloatTensorPrimitive) {
        if self.kind == Kind::Anomaly {
            self.cast_inputs.push(tensor.clone());
        }
    }

    /// Whether the precision report wants this op run again in f32 on the same inputs: it
    /// runs in a half dtype (its inputs are, or autocast lowers them).
    pub fn wants_shadow(&self, target: Option<FloatDType>) -> bool {
        // An index op's shadow would read the same values (a half value is exact in f32): it
        // chooses alike, so only the f32 run's choices tell something.
        self.kind == Kind::Compare
            && makes_floats(self.op)
            && match target {
                Some(target) => matches!(target, FloatDType::F16 | FloatDType::BF16),
                None => self.half_input,
            }
    }

    /// A float input for the f32 shadow run: detached (the shadow is no part of the graph),
    /// in f32.
    pub fn shadow_input(tensor: &B::FloatTensorPrimitive) -> B::FloatTensorPrimitive {
        let tensor = B::float_detach(tensor.clone());
        if is_half(tensor.dtype()) {
            B::float_cast(tensor, FloatDType::F32)
        } else {
            tensor
        }
    }

    /// The shadow run's output.
    pub fn shadow(&mut self, output: &dyn Any) {
        self.shadow_floats(&float_outputs::<B>(output));
    }

    /// The shadow run's float outputs, in the op's order (a custom op's).
    pub(crate) fn shadow_floats(&mut self, outputs: &[&B::FloatTensorPrimitive]) {
        self.shadows = outputs.iter().map(|t| (*t).clone()).collect();
    }

    /// The op's output: checked or recorded by the session.
    pub fn finish(self, output: &dyn Any) {
        // By the op, not the output's type: most backends' int and float tensors are one type.
        let outputs = if makes_floats(self.op) {
            float_outputs::<B>(output)
        } else {
            Vec::new()
        };
        let chosen = if makes_choices(self.op) {
            Chosen::<B>::of(self.op, output)
        } else {
            None
        };
        self.finish_outputs(&outputs, chosen.as_slice());
    }

    /// The op's outputs, in its order. The floats are checked together (the first non-finite
    /// one is reported), or each recorded or measured as a call of its own; then each output
    /// of choices (`argmax`'s indices, a comparison's mask) is recorded or compared as a call
    /// of its own.
    pub(crate) fn finish_outputs(self, outputs: &[&B::FloatTensorPrimitive], chosen: &[Chosen<B>]) {
        if outputs.is_empty() && chosen.is_empty() {
            return;
        }
        BUSY.with(|b| b.set(true));
        match self.kind {
            Kind::Anomaly => {
                if !outputs.is_empty() {
                    anomaly::check::<B>(&self, outputs)
                }
            }
            Kind::Reference => {
                for output in outputs {
                    precision_report::record::<B>(self.op, output);
                }
                for chosen in chosen {
                    precision_report::record_choices(self.op, chosen);
                }
            }
            Kind::Compare => {
                for (k, output) in outputs.iter().enumerate() {
                    precision_report::compare::<B>(self.op, output, self.shadows.get(k));
                }
                for chosen in chosen {
                    precision_report::compare_choices(self.op, chosen, self.dim, &self.inputs);
                }
            }
        }
        BUSY.with(|b| b.set(false));
    }
}

/// Ops whose output holds no float values to check (metadata, tests for inf/NaN, choices),
/// and `float_empty`, whose values are whatever the memory held. A custom op makes floats.
fn makes_floats(op: ProbedOp) -> bool {
    use Op::*;
    let ProbedOp::Table(table) = op else {
        return true;
    };
    let none = matches!(
        table,
        float_empty
            | float_device
            | float_is_require_grad
            | float_into_data
            | float_is_nan
            | float_is_inf
            | float_any
            | float_any_dim
            | float_all
            | float_all_dim
    );
    !(none || makes_indices_alone(op) || makes_mask(op))
}

/// The float tensors in an op's output: a tensor, or a tensor with its indices.
fn float_outputs<B: Backend>(output: &dyn Any) -> Vec<&B::FloatTensorPrimitive> {
    if let Some(t) = output.downcast_ref::<B::FloatTensorPrimitive>() {
        vec![t]
    } else if let Some((t, _)) =
        output.downcast_ref::<(B::FloatTensorPrimitive, B::IntTensorPrimitive)>()
    {
        vec![t]
    } else {
        Vec::new()
    }
}

fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// A tensor's dtype and shape, as a report shows them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TensorInfo {
    /// The dtype, e.g. `F16`.
    pub dtype: String,
    /// The dimensions.
    pub shape: Vec<usize>,
}

impl TensorInfo {
    fn of<B: Backend>(tensor: &B::FloatTensorPrimitive) -> Self {
        Self {
            dtype: format!("{:?}", tensor.dtype()),
            shape: tensor.shape().to_vec(),
        }
    }
}

impl core::fmt::Display for TensorInfo {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{} {:?}", self.dtype.to_lowercase(), self.shape)
    }
}

/// Whether any value is inf or NaN (`nan_only`: NaN), read back as one scalar.
fn any_nonfinite<B: Backend>(tensor: &B::FloatTensorPrimitive, nan_only: bool) -> bool {
    let t = B::float_detach(tensor.clone());
    if t.shape().num_elements() == 0 {
        return false;
    }
    // x * 0 is 0 for every finite x and NaN for inf and NaN: one sum says whether any is.
    // With `nan_only`, a hit is told apart on the host (rare: once per bad op).
    let sum = B::float_sum(B::float_mul_scalar(t, Scalar::Float(0.0)));
    let bad = !host_values::<B>(&sum)[0].is_finite();
    if bad && nan_only {
        return host_values::<B>(tensor).iter().any(|x| x.is_nan());
    }
    bad
}

/// The tensor's values on the host, as f32.
fn host_values<B: Backend>(tensor: &B::FloatTensorPrimitive) -> Vec<f32> {
    let t = B::float_detach(tensor.clone());
    let t = if t.dtype() == DType::F32 {
        t
    } else {
        B::float_cast(t, FloatDType::F32)
    };
    let n = t.shape().num_elements();
    let t = B::float_reshape(t, Shape::new([n]));
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t))
        .into_data()
        .to_vec::<f32>()
        .unwrap_or_default()
}

/// The policy category's name as a report shows it.
fn category_name(category: Category) -> &'static str {
    match category {
        Category::Lower => "lower",
        Category::F32 => "f32",
        Category::Promote => "promote",
        Category::Pass => "pass",
    }
}
