//! The precision report: one step at f32 and under autocast, op by op.

use core::fmt::{self, Write as _};
use std::collections::HashMap;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_backend::TensorMetadata;
use serde::Serialize;

use super::choices::differing_choices;
use super::gradients::Gradients;
use super::measure::{bf16_epsilon, f16_epsilon, range_loss, relative_error, smallest_normal};
use super::{Chosen, GradientPrecision, Installed, ProbedOp, Session, category_name, host_values};
use crate::error::AmpError;
use crate::precision::{Precision, autocast};

/// Values of the f32 run kept on the host for the comparison; beyond, ops are compared with
/// their f32 shadow only.
const REFERENCE_CAPACITY: usize = 1 << 26;

/// A gradient this much smaller than the largest is rounding noise.
pub(super) const NEGLIGIBLE: f64 = 1e-6;

/// What the report suggests for an op or a gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Suggestion {
    /// Nothing to do.
    Fine,
    /// Keep the op in f32: `let _f32 = autocast(Precision::F32);` around the call.
    KeepInF32,
    /// f16's range is the problem: bf16 has f32's.
    UseBf16,
    /// Gradients flush to zero at this loss scale: a larger initial scale (or bf16).
    RaiseLossScale,
    /// Gradients overflow at this loss scale: the scaler will skip steps until it halves.
    LowerLossScale,
    /// The op chooses otherwise than in the f32 run (a router's experts, a prediction): the
    /// ops that compute what it compares should run in f32.
    ComputeItsInputInF32,
}

impl fmt::Display for Suggestion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Suggestion::Fine => "-",
            Suggestion::KeepInF32 => "keep in f32: `let _f32 = autocast(Precision::F32);`",
            Suggestion::UseBf16 => "out of f16's range: bf16, or keep in f32",
            Suggestion::RaiseLossScale => "raise the loss scale (or bf16)",
            Suggestion::LowerLossScale => "lower the loss scale",
            Suggestion::ComputeItsInputInF32 => {
                "its choices differ from f32's: compute what it compares in f32"
            }
        })
    }
}

/// One op call of the autocast run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpPrecision {
    /// The op, as the backend trait's method.
    pub op: &'static str,
    /// Its policy category.
    pub category: &'static str,
    /// Its index among the float ops of the step.
    pub call: usize,
    /// The output's shape.
    pub shape: Vec<usize>,
    /// The output's dtype under autocast.
    pub dtype: String,
    /// Relative error (L2) of the output against the same op run in f32 on the same inputs:
    /// what this op loses by itself. `None` where the op ran in f32.
    pub own_error: Option<f64>,
    /// Relative error (L2) against the f32 run's output: what has accumulated up to here.
    /// `None` where the runs diverged or the f32 values were not kept.
    pub error: Option<f64>,
    /// Values nonzero in f32 and zero here.
    pub underflow: f64,
    /// Values finite in f32 and inf/NaN here.
    pub overflow: f64,
    /// Smallest nonzero |x| in f32.
    pub min_abs: f64,
    /// Largest |x| in f32.
    pub max_abs: f64,
    /// For the choices an op made by comparing floats, a row of their own: indices
    /// (`argmax`, `argtopk`, `sort_with_indices`'s, `into_int`, a custom op's from
    /// [`run_with_indices`](crate::custom_op::CustomOp::run_with_indices)) or a comparison's
    /// mask (`greater_elem`, `lower`, ...). The share that differ from the f32 run's (a router
    /// sending tokens to other experts): a top-k's k per row as a set, a sort's first place,
    /// else value by value. `None` for float outputs, and where the runs diverged.
    pub differing: Option<f64>,
    /// For choices: the call whose output the op compared (its first float input), where a
    /// watched op made it (the first call that made those values: a reshape after it is not
    /// named). The op to compute in f32 when the choices differ.
    pub compared: Option<usize>,
    /// What to do.
    pub suggestion: Suggestion,
}

/// One training step's precision, op by op: see [`PrecisionReport::measure`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrecisionReport {
    /// The autocast precision compared with f32.
    pub precision: Precision,
    /// The loss scale both runs' backward used (1 unless f16).
    pub loss_scale: f32,
    /// The f32 run's loss.
    pub loss_f32: f32,
    /// The autocast run's loss.
    pub loss: f32,
    /// Every float op call of the autocast run, in order.
    pub ops: Vec<OpPrecision>,
    /// Every trainable parameter's gradient.
    pub gradients: Vec<GradientPrecision>,
    /// The call where the two runs stopped doing the same ops (data-dependent control flow),
    /// after which ops are compared with their f32 shadow only.
    pub diverged_at: Option<usize>,
}

impl PrecisionReport {
    /// Runs one step twice on the same weights, at f32 and at `precision`: `loss_fn` makes
    /// the loss from the model (same batch both times: capture it), `backward` runs on
    /// `loss × loss_scale` (f16; 1 otherwise) in both runs, and nothing is updated.
    ///
    /// The generator is seeded alike before each run (dropout draws the same masks). Ops
    /// are seen where they pass through `Amp`: the forward ops under `Amp<Autodiff<B>>`,
    /// forward and backward under `Autodiff<Amp<B>>`. Run it before installing an
    /// `AmpOptimizer` (or pass its `scale()`): an installed one would scale the loss again.
    pub fn measure<B, M, F>(
        model: &M,
        precision: Precision,
        loss_scale: f32,
        mut loss_fn: F,
    ) -> Result<Self, AmpError>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        F: FnMut(&M) -> Tensor<B, 1>,
    {
        if crate::amp_optimizer::registry::is_installed::<B>() {
            return Err(AmpError::ReportUnderOptimizer);
        }
        let loss_scale = if precision.needs_loss_scaling() {
            loss_scale
        } else {
            1.0
        };
        let device = model.devices().into_iter().next();
        let mut run = |session: Session, at: Precision| {
            if let Some(device) = &device {
                B::seed(device, 0x5EED);
            }
            let installed = Installed::new(session);
            let _autocast = autocast(at);
            let loss = loss_fn(model);
            let grads = loss.clone().mul_scalar(loss_scale).backward();
            let session = installed.take();
            let loss = loss.into_data().convert::<f32>().to_vec::<f32>().unwrap()[0];
            (session, loss, GradientsParams::from_grads(grads, model))
        };
        let (reference, loss_f32, grads_f32) =
            run(Session::Reference(Reference::default()), Precision::F32);
        let Some(Session::Reference(reference)) = reference else {
            unreachable!("the reference session was installed for the run")
        };
        let (comparison, loss, grads) = run(
            Session::Compare(Comparison::new(reference.outputs)),
            precision,
        );
        let Some(Session::Compare(comparison)) = comparison else {
            unreachable!("the comparison session was installed for the run")
        };
        let mut gradients = Gradients::<B>::new(grads_f32, grads, precision, loss_scale as f64);
        model.visit(&mut gradients);
        // A gradient that is rounding noise in f32 too (a bias that a norm or a softmax
        // cancels: ~1e-10) flushing to zero is no loss.
        let largest = gradients.rows.iter().map(|g| g.norm).fold(0.0, f64::max);
        for g in &mut gradients.rows {
            if g.norm < NEGLIGIBLE * largest {
                g.suggestion = Suggestion::Fine;
            }
        }
        Ok(Self {
            precision,
            loss_scale,
            loss_f32,
            loss,
            ops: comparison.rows,
            gradients: gradients.rows,
            diverged_at: comparison.diverged_at,
        })
    }

    /// The ops that lose most: by own error, then by error against the f32 run.
    pub fn worst(&self, n: usize) -> Vec<&OpPrecision> {
        let mut ops: Vec<&OpPrecision> = self.ops.iter().collect();
        let key = |o: &OpPrecision| {
            (
                o.overflow + o.underflow + o.own_error.unwrap_or(0.0) + o.differing.unwrap_or(0.0),
                o.error.unwrap_or(0.0),
            )
        };
        ops.sort_by(|a, b| {
            key(b)
                .partial_cmp(&key(a))
                .unwrap_or(core::cmp::Ordering::Equal)
        });
        ops.truncate(n);
        ops
    }

    /// A row's suggestion, with the op to compute in f32 where a choice differs.
    fn suggestion(&self, o: &OpPrecision) -> String {
        let made = o
            .compared
            .filter(|_| o.suggestion != Suggestion::Fine)
            .and_then(|call| {
                self.ops
                    .iter()
                    .find(|r| r.call == call)
                    .map(|r| format!(" (call {call}, `{}`)", r.op))
            });
        format!("{}{}", o.suggestion, made.unwrap_or_default())
    }

    /// The report as one JSON line.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("the report serializes")
    }

    /// The worst `n` ops and every gradient with something to fix, as markdown tables.
    pub fn table(&self, n: usize) -> String {
        let mut s = String::new();
        let rel = |a: f32, b: f32| ((a - b) / a.abs().max(f32::MIN_POSITIVE)).abs();
        let _ = writeln!(
            s,
            "precision report: {} against f32; loss {:.5} vs {:.5} (rel. diff {:.1e}); loss \
             scale {}; {} op calls{}",
            self.precision,
            self.loss,
            self.loss_f32,
            rel(self.loss_f32, self.loss),
            self.loss_scale,
            self.ops.len(),
            match self.diverged_at {
                Some(at) => format!(" (the runs diverge at call {at})"),
                None => String::new(),
            }
        );
        let _ = writeln!(
            s,
            "\n| op | call | shape | dtype | own error | error vs f32 run | underflow | overflow \
             | f32 |x| range | suggestion |\n|---|---|---|---|---|---|---|---|---|---|"
        );
        let e = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.1e}"));
        for o in self.worst(n) {
            // Indices: the share that differ stands where a float output's error does, and
            // they have no range to lose.
            let (error, range) = match o.differing {
                Some(d) => (format!("{:.2}% differ", 100.0 * d), "- | - | -".to_string()),
                None => (
                    e(o.error),
                    format!(
                        "{:.2}% | {:.2}% | {:.1e}..{:.1e}",
                        100.0 * o.underflow,
                        100.0 * o.overflow,
                        o.min_abs,
                        o.max_abs
                    ),
                ),
            };
            let _ = writeln!(
                s,
                "| {} ({}) | {} | {:?} | {} | {} | {} | {} | {} |",
                o.op,
                o.category,
                o.call,
                o.shape,
                o.dtype.to_lowercase(),
                e(o.own_error),
                error,
                range,
                self.suggestion(o)
            );
        }
        let _ = writeln!(
            s,
            "\n| gradient | shape | f32 norm | error | underflow | underflow at scale | overflow at scale \
             | suggestion |\n|---|---|---|---|---|---|---|---|"
        );
        // Those with a suggestion first, then by error; rounding noise (~0 in f32) last.
        let largest = self.gradients.iter().map(|g| g.norm).fold(0.0, f64::max);
        let key = |g: &GradientPrecision| {
            (
                g.suggestion != Suggestion::Fine,
                g.norm >= NEGLIGIBLE * largest,
                g.error,
            )
        };
        let mut gradients: Vec<&GradientPrecision> = self.gradients.iter().collect();
        gradients.sort_by(|a, b| {
            key(b)
                .partial_cmp(&key(a))
                .unwrap_or(core::cmp::Ordering::Equal)
        });
        for g in gradients.iter().take(n) {
            let _ = writeln!(
                s,
                "| {} | {:?} | {:.1e} | {:.1e} | {:.2}% | {:.2}% | {:.2}% | {} |",
                g.parameter,
                g.shape,
                g.norm,
                g.error,
                100.0 * g.underflow,
                100.0 * g.underflow_at_scale,
                100.0 * g.overflow_at_scale,
                g.suggestion
            );
        }
        s
    }
}

/// An op's output in the f32 run.
struct Recorded {
    op: ProbedOp,
    shape: Vec<usize>,
    values: Option<Values>,
}

/// An output's values on the host: floats, or choices (indices; a mask as 0 and 1).
enum Values {
    Floats(Vec<f32>),
    Choices(Vec<i64>),
}

impl Values {
    fn len(&self) -> usize {
        match self {
            Values::Floats(v) => v.len(),
            Values::Choices(v) => v.len(),
        }
    }
}

/// The f32 run's session: every float op's output.
#[derive(Default)]
pub(crate) struct Reference {
    outputs: Vec<Recorded>,
    kept: usize,
}

/// The autocast run's session: each op against the f32 run's and against its own f32 shadow.
pub(crate) struct Comparison {
    reference: Vec<Option<Recorded>>,
    call: usize,
    diverged_at: Option<usize>,
    rows: Vec<OpPrecision>,
    /// Each float output's values (a hash) and the first call that made them: the op behind
    /// what a choice compares.
    made: HashMap<u64, usize>,
}

impl Comparison {
    fn new(reference: Vec<Recorded>) -> Self {
        Self {
            reference: reference.into_iter().map(Some).collect(),
            call: 0,
            diverged_at: None,
            rows: Vec::new(),
            made: HashMap::new(),
        }
    }
}

/// A hash of values, bit for bit (FNV-1a over 32-bit words: cheap beside the read-back; a
/// collision would only name another call).
fn fingerprint(values: &[f32]) -> u64 {
    values
        .iter()
        .fold(0xcbf2_9ce4_8422_2325 ^ values.len() as u64, |h, v| {
            (h ^ u64::from(v.to_bits())).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

pub(crate) fn record<B: Backend>(op: ProbedOp, output: &B::FloatTensorPrimitive) {
    keep(op, output.shape().to_vec(), || {
        Values::Floats(host_values::<B>(output))
    });
}

pub(crate) fn record_choices<B: Backend>(op: ProbedOp, chosen: &Chosen<B>) {
    keep(op, chosen.shape(), || Values::Choices(chosen.host()));
}

/// Records an output of the f32 run, its values while they fit in the capacity.
fn keep(op: ProbedOp, shape: Vec<usize>, values: impl FnOnce() -> Values) {
    let n: usize = shape.iter().product();
    let keep = super::with_session(|s| match s {
        Session::Reference(r) => r.kept + n <= REFERENCE_CAPACITY,
        _ => false,
    })
    .unwrap_or(false);
    let values = keep.then(values);
    super::with_session(|s| {
        if let Session::Reference(r) = s {
            r.kept += values.as_ref().map_or(0, Values::len);
            r.outputs.push(Recorded { op, shape, values });
        }
    });
}

/// The autocast run's next call, and the f32 run's values for it while the two runs do the
/// same ops; `None` outside a comparison.
fn next_call(op: ProbedOp, shape: &[usize], choices: bool) -> Option<(usize, Option<Values>)> {
    super::with_session(|s| match s {
        Session::Compare(c) => {
            let call = c.call;
            c.call += 1;
            let same = |r: &Recorded| {
                r.op == op
                    && r.shape == shape
                    && r.values
                        .as_ref()
                        .is_none_or(|v| matches!(v, Values::Choices(_)) == choices)
            };
            let reference = match c.reference.get_mut(call).and_then(Option::take) {
                Some(r) if c.diverged_at.is_none() && same(&r) => r.values,
                _ => {
                    c.diverged_at.get_or_insert(call);
                    None
                }
            };
            Some((call, reference))
        }
        _ => None,
    })
    .flatten()
}

fn push_row(row: OpPrecision) {
    super::with_session(|s| {
        if let Session::Compare(c) = s {
            c.rows.push(row);
        }
    });
}

/// More than this share of an op's choices differing from the f32 run's is worth a fix.
const CHOICES_DIFFER: f64 = 0.01;

pub(crate) fn compare_choices<B: Backend>(
    op: ProbedOp,
    chosen: &Chosen<B>,
    dim: Option<usize>,
    inputs: &[B::FloatTensorPrimitive],
) {
    let shape = chosen.shape();
    let Some((call, reference)) = next_call(op, &shape, true) else {
        return;
    };
    let differing = match reference {
        Some(Values::Choices(reference)) => Some(differing_choices(
            op,
            &shape,
            dim,
            &reference,
            &chosen.host(),
        )),
        _ => None,
    };
    let suggestion = if differing.unwrap_or(0.0) > CHOICES_DIFFER {
        Suggestion::ComputeItsInputInF32
    } else {
        Suggestion::Fine
    };
    // The op that made what it compares: its first float input's values, as an output's.
    let key = inputs.first().map(|x| fingerprint(&host_values::<B>(x)));
    let compared = super::with_session(|s| match s {
        Session::Compare(c) => key.and_then(|k| c.made.get(&k).copied()),
        _ => None,
    })
    .flatten();
    push_row(OpPrecision {
        op: op.name(),
        category: category_name(op.category()),
        call,
        shape,
        dtype: format!("{:?}", chosen.dtype()),
        own_error: None,
        error: None,
        underflow: 0.0,
        overflow: 0.0,
        min_abs: 0.0,
        max_abs: 0.0,
        differing,
        compared,
        suggestion,
    });
}

pub(crate) fn compare<B: Backend>(
    op: ProbedOp,
    output: &B::FloatTensorPrimitive,
    shadow: Option<&B::FloatTensorPrimitive>,
) {
    let shape = output.shape().to_vec();
    let dtype = output.dtype();
    let Some((call, reference)) = next_call(op, &shape, false) else {
        return;
    };
    let reference = match reference {
        Some(Values::Floats(values)) => Some(values),
        _ => None,
    };
    let values = host_values::<B>(output);
    let shadow = shadow.map(|s| host_values::<B>(s));
    // Underflow, overflow and range against what this op would give in f32: its shadow when
    // it ran in a half dtype, else the f32 run.
    let truth = shadow.as_deref().or(reference.as_deref());
    let (underflow, overflow, min_abs, max_abs) = match truth {
        Some(truth) => range_loss(truth, &values, smallest_normal(dtype)),
        None => (0.0, 0.0, 0.0, 0.0),
    };
    let own_error = shadow.as_deref().map(|s| relative_error(s, &values));
    let error = reference.as_deref().map(|r| relative_error(r, &values));
    let half = match dtype {
        burn_backend::DType::F16 => Some(f16_epsilon()),
        burn_backend::DType::BF16 => Some(bf16_epsilon()),
        _ => None,
    };
    let suggestion = match half {
        Some(_) if overflow > 0.0 && dtype == burn_backend::DType::F16 => Suggestion::UseBf16,
        Some(_) if underflow > 0.01 && dtype == burn_backend::DType::F16 => Suggestion::UseBf16,
        // A few roundings of the dtype are expected; much more means cancellation or a long
        // accumulation in half precision.
        Some(eps) if own_error.unwrap_or(0.0) > 16.0 * eps => Suggestion::KeepInF32,
        _ => Suggestion::Fine,
    };
    push_row(OpPrecision {
        op: op.name(),
        category: category_name(op.category()),
        call,
        shape,
        dtype: format!("{dtype:?}"),
        own_error,
        error,
        underflow,
        overflow,
        min_abs,
        max_abs,
        differing: None,
        compared: None,
        suggestion,
    });
    super::with_session(|s| {
        if let Session::Compare(c) = s {
            c.made.entry(fingerprint(&values)).or_insert(call);
        }
    });
}
