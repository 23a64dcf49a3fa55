//! Where a value no watched op made came in: host data loaded with it, or the input of an
//! op that read it from outside (a data loader's thread, the backward above `Amp`, a spoilt
//! parameter).

use core::fmt;

use burn_backend::Backend;
use serde::Serialize;

use super::anomaly::{NonFinite, Phase, where_now, write_frames};
use super::backtrace::Frame;
use super::{Probe, TensorInfo};

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
    pub(super) fn at<B: Backend>(
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
            values: NonFinite::count(&super::host_values::<B>(tensor)),
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

/// What the step's watched ops made non-finite: each such output's dtype, shape and counts.
/// An input that matches none came from outside. A fingerprint, not an identity (the
/// primitives carry none): a value from outside that matches a watched output exactly in
/// all of them is taken for it.
#[derive(Default)]
pub(crate) struct Trace {
    made: Vec<(TensorInfo, NonFinite)>,
    /// A watched op created one: what follows may be its consequence.
    stopped: bool,
}

/// Fingerprints kept per step; past it, a step is no longer traced.
const MADE_CAPACITY: usize = 4096;

impl Trace {
    pub(crate) fn stopped(&self) -> bool {
        self.stopped
    }

    pub(crate) fn stop(&mut self) {
        self.stopped = true;
        self.made = Vec::new();
    }

    /// A value's fingerprint: dtype, shape, and its NaN/+inf/-inf counted on the device.
    pub(crate) fn fingerprint<B: Backend>(
        tensor: &B::FloatTensorPrimitive,
    ) -> (TensorInfo, NonFinite) {
        (
            TensorInfo::of::<B>(tensor),
            NonFinite::on_device::<B>(tensor),
        )
    }

    /// A watched op of this step made or passed on a value with this fingerprint.
    pub(crate) fn made(&mut self, fingerprint: (TensorInfo, NonFinite)) {
        if self.made.len() >= MADE_CAPACITY {
            self.stop();
        } else if !self.explains(&fingerprint) {
            self.made.push(fingerprint);
        }
    }

    /// Whether a watched op of this step made a value with this fingerprint.
    pub(crate) fn explains(&self, fingerprint: &(TensorInfo, NonFinite)) -> bool {
        self.made.contains(fingerprint)
    }
}
