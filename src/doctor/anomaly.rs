//! Anomaly mode: the first op that created an inf or NaN, named once.

use core::fmt;

use burn_backend::{Backend, TensorMetadata};
use serde::Serialize;

use super::backtrace::{self, Frame};
use super::entered::{Entered, Trace};
use super::{
    Installed, Probe, ProbedOp, Session, TensorInfo, any_nonfinite, category_name, host_values,
};
use crate::backend::Op;
use crate::error::AmpError;

/// Checks every float op for inf and NaN on this thread until the guard is dropped, like
/// `torch.autograd.detect_anomaly`. The first op that *creates* a non-finite value (its
/// inputs were finite) is reported once: [`AnomalyGuard::report`], [`AnomalyGuard::check`],
/// and one line on the `log` crate's `error` level.
///
/// Each op then reads a scalar back to the host: a debugging mode (see the overhead figures
/// in the README). Masks filled with `-inf` are not blamed (their scalar is already inf), nor
/// is host data that holds inf/NaN: [`AnomalyGuard::entered`] tells where such a value came in;
/// for models that make infinities on purpose in other ways, [`detect_nan`] checks NaN only.
///
/// At f16 with a loss scaler, the first steps overflow on purpose while the scale settles;
/// under `Autodiff<Amp<B>>` (backward ops seen) that overflow is reported: start anomaly mode
/// once the scale has settled, or use [`detect_nan`].
#[must_use = "anomaly mode ends when the guard is dropped; bind it with `let guard = ...`"]
pub fn detect_anomaly() -> AnomalyGuard {
    AnomalyGuard::new(false)
}

/// [`detect_anomaly`] for NaN only (JAX's `jax_debug_nans`): infinities pass.
#[must_use = "anomaly mode ends when the guard is dropped; bind it with `let guard = ...`"]
pub fn detect_nan() -> AnomalyGuard {
    AnomalyGuard::new(true)
}

/// Anomaly mode on this thread, until dropped.
pub struct AnomalyGuard {
    installed: Installed,
}

impl fmt::Debug for AnomalyGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnomalyGuard")
            .field("report", &self.report())
            .finish()
    }
}

impl AnomalyGuard {
    fn new(nan_only: bool) -> Self {
        Self {
            installed: Installed::new(Session::Anomaly(State {
                nan_only,
                ..State::default()
            })),
        }
    }

    /// `R::default()` while another session is on top of this one (a precision report
    /// measured inside anomaly mode).
    fn read<R: Default>(&self, f: impl FnOnce(&State) -> R) -> R {
        super::with_session(|s| match s {
            Session::Anomaly(state) => Some(f(state)),
            _ => None,
        })
        .flatten()
        .unwrap_or_default()
    }

    /// The first op that created an inf/NaN, if any has.
    pub fn report(&self) -> Option<Anomaly> {
        self.read(|s| s.first.as_deref().cloned())
    }

    /// The first inf/NaN that no watched op made, where it came in: host data loaded with it
    /// (`float_from_data`: a batch, an additive mask's `-inf`, a record), or the input of the
    /// step's first op with a non-finite output that held it already (a tensor made on
    /// another thread, such as a data loader's, or before the guard; a gradient from the
    /// backward above `Amp`; a parameter an optimizer kernel spoilt; a custom op called
    /// through `cast` alone). An input whose inf/NaN gives a finite output (a mask's `-inf`
    /// through a softmax) is not looked at. Values a watched op placed (a mask filled with
    /// `-inf`) or passed on are told apart from those by their dtype, shape and counts of
    /// NaN, +inf and -inf. Not an error ([`check`] stays `Ok`). Once a watched op has created
    /// one in a step ([`report`]), the rest of that step is not traced: what follows may be
    /// its consequence (the backward of a NaN loss). Steps are `AmpOptimizer`'s.
    ///
    /// [`check`]: Self::check
    /// [`report`]: Self::report
    pub fn entered(&self) -> Option<Entered> {
        self.read(|s| s.entered.as_deref().cloned())
    }

    /// `Err(AmpError::Anomaly)` once an op has created an inf/NaN.
    pub fn check(&self) -> Result<(), AmpError> {
        match self.report() {
            Some(anomaly) => Err(AmpError::Anomaly(Box::new(anomaly))),
            None => Ok(()),
        }
    }

    /// Float ops checked so far.
    pub fn ops_checked(&self) -> u64 {
        self.read(|s| s.checked)
    }

    /// Ops whose output was non-finite because an input already was (passed on, not blamed).
    pub fn ops_passing_it_on(&self) -> u64 {
        self.read(|s| s.passed_on)
    }

    /// Ops that created inf/NaN from finite inputs: the first is [`report`](Self::report)ed.
    pub fn ops_creating_it(&self) -> u64 {
        self.read(|s| s.created)
    }

    /// Forgets the report (and what [`entered`](Self::entered)), to find the next one.
    pub fn clear(&self) {
        super::with_session(|s| {
            if let Session::Anomaly(state) = s {
                state.first = None;
                state.entered = None;
                state.trace = Trace::default();
                state.passed_on = 0;
                state.created = 0;
            }
        });
    }

    /// Ends anomaly mode and returns its report.
    pub fn finish(self) -> Option<Anomaly> {
        match self.installed.take() {
            Some(Session::Anomaly(state)) => state.first.map(|a| *a),
            _ => None,
        }
    }
}

#[derive(Default)]
pub(crate) struct State {
    nan_only: bool,
    /// Op calls since the step began.
    call: u64,
    step: u64,
    checked: u64,
    passed_on: u64,
    created: u64,
    // Boxed: a session is mostly without a report.
    first: Option<Box<Anomaly>>,
    /// What the step's watched ops made non-finite, to tell a value from outside.
    trace: Trace,
    entered: Option<Box<Entered>>,
}

impl State {
    pub(crate) fn next_step(&mut self) {
        self.step += 1;
        self.call = 0;
        self.trace = Trace::default();
    }
}

/// What made the values non-finite.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Cause {
    /// The op computed them from finite inputs.
    Op,
    /// A scalar operand was already inf/NaN (`x * NaN`): the op brought it into the tensors.
    Scalar,
    /// Autocast's cast of input `input` to the op's dtype overflowed (|x| above the half
    /// dtype's maximum, 65504 for f16).
    Cast {
        /// The input's position among the op's float inputs.
        input: usize,
        /// Its dtype before the cast.
        from: String,
        /// The dtype autocast cast it to.
        to: String,
    },
}

/// Which pass the op belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "pass", rename_all = "snake_case")]
pub enum Phase {
    /// The forward pass (or code outside autodiff).
    Forward,
    /// Autodiff's backward pass (seen when `Amp` is below `Autodiff`).
    Backward {
        /// The forward op this backward step belongs to, where autodiff's frames name it.
        of: Option<String>,
    },
}

/// How many values were non-finite, and of which kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct NonFinite {
    /// NaN values.
    pub nan: usize,
    /// +inf values.
    pub pos_inf: usize,
    /// -inf values.
    pub neg_inf: usize,
    /// All values of the output.
    pub total: usize,
}

impl NonFinite {
    /// Counted on the device: three sums read back, not the values.
    pub(super) fn on_device<B: Backend>(tensor: &B::FloatTensorPrimitive) -> Self {
        use burn::tensor::{Tensor, TensorPrimitive};
        let n = tensor.shape().num_elements();
        let t = B::float_reshape(B::float_detach(tensor.clone()), burn_std::Shape::new([n]));
        let t = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t));
        let counts = Tensor::cat(
            vec![
                t.clone().is_nan().int().sum(),
                t.clone().equal_elem(f32::INFINITY).int().sum(),
                t.equal_elem(f32::NEG_INFINITY).int().sum(),
            ],
            0,
        );
        let counts: Vec<i64> = counts.into_data().iter::<i64>().collect();
        Self {
            nan: counts[0] as usize,
            pos_inf: counts[1] as usize,
            neg_inf: counts[2] as usize,
            total: n,
        }
    }

    pub(super) fn count(values: &[f32]) -> Self {
        let mut n = NonFinite {
            total: values.len(),
            ..Self::default()
        };
        for v in values {
            if v.is_nan() {
                n.nan += 1;
            } else if *v == f32::INFINITY {
                n.pos_inf += 1;
            } else if *v == f32::NEG_INFINITY {
                n.neg_inf += 1;
            }
        }
        n
    }
}

impl fmt::Display for NonFinite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if self.nan > 0 {
            parts.push(format!("{} NaN", self.nan));
        }
        if self.pos_inf > 0 {
            parts.push(format!("{} +inf", self.pos_inf));
        }
        if self.neg_inf > 0 {
            parts.push(format!("{} -inf", self.neg_inf));
        }
        write!(f, "{} of {} values", parts.join(", "), self.total)
    }
}

/// The first op that created an inf or NaN.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Anomaly {
    /// The op, named as the backend trait's method.
    pub op: &'static str,
    /// Its category in the autocast policy table (`lower`, `f32`, `promote`, `pass`).
    pub category: &'static str,
    /// The op computed the values, or autocast's cast of an input overflowed.
    pub cause: Cause,
    /// Forward or backward.
    pub phase: Phase,
    /// Training step (counted by `AmpOptimizer`'s steps since the guard was made).
    pub step: u64,
    /// The op's index among the float ops of that step.
    pub call: u64,
    /// The float inputs as the op ran them (after autocast's casts).
    pub inputs: Vec<TensorInfo>,
    /// The output.
    pub output: TensorInfo,
    /// How many values went non-finite.
    pub values: NonFinite,
    /// The call stack at the op, trimmed to the model's frames (first: the innermost).
    pub backtrace: Vec<Frame>,
}

impl Anomaly {
    /// The innermost frame of the model's code: where the op was called.
    pub fn user_frame(&self) -> Option<&Frame> {
        self.backtrace.first()
    }

    /// What to do about it, in a sentence.
    pub fn advice(&self) -> String {
        let half = |d: &str| d == "F16" || d == "BF16";
        let max = if self.output.dtype == "BF16" {
            "3.4e38"
        } else {
            "65504"
        };
        match &self.cause {
            Cause::Cast { to, .. } => format!(
                "the input is above {to}'s range ({max}) before the op runs: keep this op in f32 \
                 (`let _f32 = autocast(Precision::F32);` around the call), train in bf16, or \
                 bring the activations down (normalisation, smaller init)"
            ),
            Cause::Scalar => "a scalar operand of this op is already inf/NaN: find where that \
                 number is computed (a learning rate, a scale, a division by zero on the host)"
                .into(),
            Cause::Op if half(&self.output.dtype) && self.values.nan == 0 => format!(
                "the op's result exceeds {}'s range ({max}): keep it in f32 (`let _f32 = \
                 autocast(Precision::F32);` around the call) or train in bf16",
                self.output.dtype.to_lowercase()
            ),
            Cause::Op
                if self.inputs.iter().all(|i| !half(&i.dtype)) && !half(&self.output.dtype) =>
            {
                "the op ran in f32 and still made it: not a precision problem but the model's or \
                 the data's (log or sqrt of a negative, 0/0, inf - inf, an overflowing exp); \
                 check the values reaching this line"
                    .into()
            }
            Cause::Op => "the op's inputs are in a half dtype: rerun with \
                 `autocast(Precision::F32)` around the call; if the NaN goes away, keep the op \
                 in f32, else the model or the data makes it"
                .into(),
        }
    }
}

impl fmt::Display for Anomaly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} ({} op, {}, step {}, op call {}) produced {} in {}",
            self.op,
            self.category,
            self.phase,
            self.step,
            self.call,
            self.values,
            self.output.dtype.to_lowercase()
        )?;
        let inputs: Vec<String> = self.inputs.iter().map(|i| i.to_string()).collect();
        writeln!(
            f,
            "  from finite inputs [{}] -> {}",
            inputs.join(", "),
            self.output
        )?;
        if self.cause == Cause::Scalar {
            writeln!(f, "  a scalar operand was inf/NaN")?;
        }
        if let Cause::Cast { input, from, to } = &self.cause {
            writeln!(
                f,
                "  autocast's cast of input {input} from {} to {} overflowed",
                from.to_lowercase(),
                to.to_lowercase()
            )?;
        }
        write_frames(f, &self.backtrace)?;
        write!(f, "  advice: {}", self.advice())
    }
}

/// The model's frames, innermost first, as a report prints them.
pub(super) fn write_frames(f: &mut fmt::Formatter<'_>, frames: &[Frame]) -> fmt::Result {
    for (i, frame) in frames.iter().take(8).enumerate() {
        writeln!(f, "  {} {frame}", if i == 0 { "at" } else { "  " })?;
    }
    if frames.is_empty() {
        writeln!(
            f,
            "  (no frame of the model's code: build with debug symbols, or the op ran outside \
             it)"
        )?;
    }
    Ok(())
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Phase::Forward => write!(f, "forward"),
            Phase::Backward { of: Some(of) } => write!(f, "backward of {of}"),
            Phase::Backward { of: None } => write!(f, "backward"),
        }
    }
}

/// Runs `f` on this thread's anomaly session, if that is the session on.
fn with_state<R>(f: impl FnOnce(&mut State) -> R) -> Option<R> {
    super::with_session(|s| match s {
        Session::Anomaly(state) => Some(f(state)),
        _ => None,
    })
    .flatten()
}

/// Checks the op's outputs; blames the op (or its input cast) when it created inf/NaN.
pub(crate) fn check<B: Backend>(probe: &Probe<B>, outputs: &[&B::FloatTensorPrimitive]) {
    let (nan_only, call, step, reported) = match with_state(|state| {
        let call = state.call;
        state.call += 1;
        state.checked += 1;
        (state.nan_only, call, state.step, state.first.is_some())
    }) {
        Some(found) => found,
        None => return,
    };
    let Some(bad) = outputs
        .iter()
        .find(|t| any_nonfinite::<B>(t, nan_only))
        .copied()
    else {
        return;
    };
    let input_bad = |t: &B::FloatTensorPrimitive| any_nonfinite::<B>(t, nan_only);
    // Whether a value from outside the watched ops is still looked for in this step.
    let tracing =
        with_state(|state| state.entered.is_none() && !state.trace.stopped()).unwrap_or(false);
    let enter = |input: Option<usize>, tensor: &B::FloatTensorPrimitive| {
        let entered = Entered::at(probe, input, tensor, (step, call));
        with_state(|state| state.entered = Some(Box::new(entered)));
    };
    // Host data brought in (a batch, a mask, a record): the data's, not an op's.
    if probe.op == ProbedOp::Table(Op::float_from_data) {
        if tracing {
            enter(None, bad);
        }
        return;
    }
    // A fill or clamp with -inf places the scalar on purpose (attention masks): not blamed.
    let placed = probe.nonfinite_scalar && places_scalar(probe.op);
    let bad_input = if placed {
        None
    } else {
        probe.inputs.iter().position(input_bad)
    };
    if placed || bad_input.is_some() {
        if tracing {
            // An input no watched op made or passed on in this step came from outside.
            let outside = probe
                .inputs
                .iter()
                .enumerate()
                .filter(|(_, t)| input_bad(t))
                .find(|(_, t)| {
                    let seen = Trace::fingerprint::<B>(t);
                    !with_state(|state| state.trace.explains(&seen)).unwrap_or(false)
                });
            match outside {
                Some((input, tensor)) => enter(Some(input), tensor),
                None => {
                    let made = Trace::fingerprint::<B>(bad);
                    with_state(|state| state.trace.made(made));
                }
            }
        }
        with_state(|state| state.passed_on += 1);
        return;
    }
    with_state(|state| {
        state.trace.stop();
        state.created += 1;
    });
    if reported {
        // One report, the first: later creators are counted only.
        return;
    }
    let cause = match probe.cast_inputs.iter().position(input_bad) {
        _ if probe.nonfinite_scalar => Cause::Scalar,
        Some(input) => Cause::Cast {
            input,
            from: format!("{:?}", probe.inputs[input].dtype()),
            to: format!("{:?}", probe.cast_inputs[input].dtype()),
        },
        None => Cause::Op,
    };
    let (frames, phase) = where_now();
    let op = probe.op;
    let anomaly = Anomaly {
        op: op.name(),
        category: category_name(op.category()),
        cause,
        phase,
        step,
        call,
        inputs: probe.cast_inputs.iter().map(TensorInfo::of::<B>).collect(),
        output: TensorInfo::of::<B>(bad),
        values: NonFinite::count(&host_values::<B>(bad)),
        backtrace: frames,
    };
    log::error!("burn-amp anomaly: {anomaly}");
    with_state(|state| state.first = Some(Box::new(anomaly)));
}

/// The call stack here, trimmed to the model's frames, and the pass it belongs to.
pub(super) fn where_now() -> (Vec<Frame>, Phase) {
    let frames = backtrace::capture();
    let phase = if backtrace::in_backward(&frames) {
        Phase::Backward {
            of: backtrace::forward_op(&frames),
        }
    } else {
        Phase::Forward
    };
    (backtrace::trim(&frames), phase)
}

/// Ops that write their scalar operand into the output as it is.
fn places_scalar(op: ProbedOp) -> bool {
    matches!(
        op,
        ProbedOp::Table(
            Op::float_mask_fill
                | Op::float_full
                | Op::float_clamp
                | Op::float_clamp_min
                | Op::float_clamp_max
        )
    )
}
