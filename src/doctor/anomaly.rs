//! Anomaly mode: the first op that created an inf or NaN, named once.

use core::fmt;

use burn_backend::{Backend, TensorMetadata};
use serde::Serialize;

use super::backtrace::{self, Frame};
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
    /// through a softmax) is not looked at. Not an error ([`check`] stays `Ok`). `None`
    /// where the step's first non-finite value was made by a watched op ([`report`]) or placed
    /// (a mask filled with `-inf`: for the rest of that step, where a value came from is not
    /// told; [`detect_nan`] ignores such masks). Steps are `AmpOptimizer`'s.
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
                state.seen = false;
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
    /// A non-finite output was met in this step.
    seen: bool,
    entered: Option<Box<Entered>>,
}

impl State {
    pub(crate) fn next_step(&mut self) {
        self.step += 1;
        self.call = 0;
        self.seen = false;
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
    fn count(values: &[f32]) -> Self {
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

/// An inf or NaN no watched op made: where it came in (host data loaded, or an op's input).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Entered {
    /// The op that read it, named as the backend trait's method.
    pub op: &'static str,
    /// Forward or backward.
    pub phase: Phase,
    /// Training step (counted by `AmpOptimizer`'s steps since the guard was made).
    pub step: u64,
    /// The op's index among the float ops of that step.
    pub call: u64,
    /// The input's position among the op's float inputs; `None` for `float_from_data`, which
    /// brought it in from host data (a batch, a mask, a record).
    pub input: Option<usize>,
    /// The input as it reached the op (before autocast's cast), or the data's tensor.
    pub tensor: TensorInfo,
    /// How many of its values were non-finite.
    pub values: NonFinite,
    /// The call stack at the op, trimmed to the model's frames (first: the innermost).
    pub backtrace: Vec<Frame>,
}

impl Entered {
    fn at<B: Backend>(
        probe: &Probe<B>,
        input: Option<usize>,
        tensor: &B::FloatTensorPrimitive,
        (step, call): (u64, u64),
    ) -> Self {
        let (backtrace, phase) = where_now();
        let entered = Self {
            op: probe.op.name(),
            phase,
            step,
            call,
            input,
            tensor: TensorInfo::of::<B>(tensor),
            values: NonFinite::count(&host_values::<B>(tensor)),
            backtrace,
        };
        log::warn!("burn-amp: {entered}");
        entered
    }

    /// The innermost frame of the model's code: where the op was called.
    pub fn user_frame(&self) -> Option<&Frame> {
        self.backtrace.first()
    }

    /// What to do about it, in a sentence.
    pub fn advice(&self) -> String {
        if self.input.is_none() {
            return "the host data already held it: check the batch (a division by zero in \
                    preprocessing, a missing value read as NaN) or the record loaded; an \
                    additive attention mask's -inf is expected here"
                .into();
        }
        "no op that the doctor watches made this value: check what reaches this line: the \
         batch (`x.is_nan().any()` on the inputs, a division by zero in preprocessing), a \
         gradient (under `Amp<Autodiff<B>>` the backward runs below `Amp`, unseen: \
         `Autodiff<Amp<B>>` shows its ops), a parameter an earlier update spoilt (only a loss \
         scaler skips a non-finite step), a custom op called through `CustomOp::cast` alone, \
         a constant built with inf/NaN"
            .into()
    }
}

impl fmt::Display for Entered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match self.input {
            Some(input) => format!("read {} in its input {input}", self.values),
            None => format!("loaded {} from host data", self.values),
        };
        writeln!(
            f,
            "{} ({}, step {}, op call {}) {source} ({}), made by no watched op",
            self.op, self.phase, self.step, self.call, self.tensor
        )?;
        write_frames(f, &self.backtrace)?;
        write!(f, "  advice: {}", self.advice())
    }
}

/// The model's frames, innermost first, as a report prints them.
fn write_frames(f: &mut fmt::Formatter<'_>, frames: &[Frame]) -> fmt::Result {
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

/// Checks the op's outputs; blames the op (or its input cast) when it created inf/NaN.
pub(crate) fn check<B: Backend>(probe: &Probe<B>, outputs: &[&B::FloatTensorPrimitive]) {
    let (nan_only, call, step, reported) = match super::with_session(|s| match s {
        Session::Anomaly(state) => {
            let call = state.call;
            state.call += 1;
            state.checked += 1;
            Some((state.nan_only, call, state.step, state.first.is_some()))
        }
        _ => None,
    })
    .flatten()
    {
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
    // Whether a non-finite output was met earlier in this step (if not, a non-finite input
    // came from outside the watched ops), and whether a way in is told already (the first is
    // kept; a later one is not looked at).
    let (seen, told) = super::with_session(|s| match s {
        Session::Anomaly(state) => Some((
            core::mem::replace(&mut state.seen, true),
            state.entered.is_some(),
        )),
        _ => None,
    })
    .flatten()
    .unwrap_or((true, true));
    let enter = |input: Option<usize>, tensor: &B::FloatTensorPrimitive| {
        if seen || told {
            return;
        }
        let entered = Entered::at(probe, input, tensor, (step, call));
        super::with_session(|s| {
            if let Session::Anomaly(state) = s {
                state.entered = Some(Box::new(entered));
            }
        });
    };
    // Host data brought in (a batch, a mask, a record): the data's, not an op's.
    if probe.op == ProbedOp::Table(Op::float_from_data) {
        enter(None, bad);
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
        if let Some(input) = bad_input {
            enter(Some(input), &probe.inputs[input]);
        }
        super::with_session(|s| {
            if let Session::Anomaly(state) = s {
                state.passed_on += 1;
            }
        });
        return;
    }
    super::with_session(|s| {
        if let Session::Anomaly(state) = s {
            state.created += 1;
        }
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
    super::with_session(|s| {
        if let Session::Anomaly(state) = s {
            state.first = Some(Box::new(anomaly));
        }
    });
}

/// The call stack here, trimmed to the model's frames, and the pass it belongs to.
fn where_now() -> (Vec<Frame>, Phase) {
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
