//! burn-nn's modules and losses as a model holds them, under autocast, against the same
//! module in f32: "any Burn model trains unchanged" checked one building block at a time.
//!
//! Each case builds a module on `Autodiff<Flex>` in f32, runs a forward and a loss, and reads
//! the loss, every parameter's gradient, every tracked input's gradient and any state the
//! forward updates (batch norm's running statistics). The same module (its record, loaded)
//! then runs on `Amp<Autodiff<B>>` and on `Autodiff<Amp<B>>` under `autocast(precision)`,
//! and each value is held to the f32 one: relative L2 error at most [`tolerance`]. Inputs are
//! on the bf16 grid, so what is measured is what the lowered ops cost, not the rounding of
//! the data.
//!
//! The op-level checks (`tests/autocast_ops.rs`, `gradient_check`) see each op alone; these
//! see the compositions burn-nn writes (a norm's mean and variance, an RNN's gates over time,
//! attention's masks, RoPE's rotation matrix, CTC's recursion, the losses' reductions), where
//! a half intermediate between two f32 ops is what breaks.
//!
//! `cases.rs`: 40 cases of layers and losses; `activations.rs`: the activation layers;
//! `settings.rs`: layers with their configs off the default path; `blocks.rs`: blocks of
//! the architectures people train. Here the context they build in, the runs and the
//! comparison.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Int, TensorData};
use burn_amp::{Amp, autocast};

use super::common::models::materialize;
use super::common::{load, save};
use super::*;

mod activations;
mod blocks;
mod cases;
mod settings;

use cases::{BATCH, D, SEQ};

/// Every case: burn-nn's layers and losses, its activation layers, layers with their configs
/// off the default path, architecture blocks.
fn cases<B: AutodiffBackend>() -> Vec<(&'static str, Case<B>)> {
    let mut all = cases::cases();
    all.extend(activations::cases());
    all.extend(settings::cases());
    all.extend(blocks::cases());
    all
}

/// What one run of a case gives, in order: the loss, then each parameter's gradient (in the
/// module's visiting order), each tracked input's, each recorded state.
struct Run {
    values: Vec<(String, Vec<f32>)>,
    grad_dtypes: Vec<(String, DType)>,
}

/// A named value (a gradient, an output) in f32, with the dtype it came in.
type Named = (String, Vec<f32>, DType);
/// Reads a module's parameter gradients after the backward.
type ParamReader<B> = Box<dyn Fn(&<B as AutodiffBackend>::Gradients) -> Vec<Named>>;
/// Reads a tracked input's gradient after the backward.
type InputReader<B> = Box<dyn Fn(&<B as AutodiffBackend>::Gradients) -> Option<(Vec<f32>, DType)>>;

/// The context a case builds its module and inputs in.
struct Cx<B: AutodiffBackend> {
    device: B::Device,
    /// The reference's records, loaded into the case's modules on the stack under test.
    weights: Option<Vec<Vec<u8>>>,
    /// The records of the modules the reference built, in order.
    saved: Vec<Vec<u8>>,
    draws: Box<dyn FnMut() -> f32>,
    /// The reference's weights (the stack under test loads them instead).
    weight_draws: Box<dyn FnMut() -> f32>,
    params: Vec<ParamReader<B>>,
    inputs: Vec<(String, InputReader<B>)>,
    states: Vec<(String, Vec<f32>)>,
    /// Whether the loss is [`Cx::project`]'s, rather than a loss function's.
    projected: bool,
    /// The run's half dtype (f32 in the reference).
    low: FloatDType,
}

impl<B: AutodiffBackend> Cx<B> {
    fn new(device: B::Device, weights: Option<Vec<Vec<u8>>>, low: FloatDType) -> Self {
        Cx {
            device,
            weights,
            saved: Vec::new(),
            draws: Box::new(uniform(2026)),
            weight_draws: Box::new(uniform(7)),
            params: Vec::new(),
            inputs: Vec::new(),
            states: Vec::new(),
            projected: false,
            low,
        }
    }

    /// The case's module: as initialised on the reference, with the reference's weights on
    /// the stack under test. Its parameters' gradients are read after the backward.
    fn module<M: Module<B> + 'static>(&mut self, module: M) -> M {
        let n = self.params.len();
        let module = match &self.weights {
            Some(weights) => module.load_record(load::<B, _>(weights[n].clone(), &self.device)),
            None => {
                // Burn initialises lazily, per clone, from a generator the tests running
                // beside this one draw from too: give the weights their values once, then
                // values of the case's own draws, so a run is reproducible.
                let module = materialize(module).map(&mut Redraw(&mut self.weight_draws));
                self.saved.push(save::<B, _>(module.clone().into_record()));
                module
            }
        };
        let kept = module.clone();
        self.params.push(Box::new(move |grads| {
            let mut visitor = ParamGrads::<B> {
                grads,
                module: n,
                out: Vec::new(),
            };
            kept.visit(&mut visitor);
            visitor.out
        }));
        module
    }

    /// Values in `[lo, hi)` on the bf16 grid.
    fn data<const D: usize>(&mut self, shape: [usize; D], lo: f32, hi: f32) -> Tensor<B, D> {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| on_grid(lo + (hi - lo) * (self.draws)()))
            .collect();
        Tensor::from_data(TensorData::new(v, shape), &self.device)
    }

    /// A tracked f32 input in `[lo, hi)`, whose gradient is compared.
    fn input<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        lo: f32,
        hi: f32,
    ) -> Tensor<B, D> {
        let x = self.data(shape, lo, hi).require_grad();
        self.track(name, x.clone());
        x
    }

    /// A tracked f32 input of `values`, whose gradient is compared.
    fn tracked<const D: usize>(
        &mut self,
        name: &str,
        values: Vec<f32>,
        shape: [usize; D],
    ) -> Tensor<B, D> {
        let x = Tensor::from_data(TensorData::new(values, shape), &self.device).require_grad();
        self.track(name, x.clone());
        x
    }

    /// Reads `x`'s gradient after the backward.
    fn track<const D: usize>(&mut self, name: &str, x: Tensor<B, D>) {
        let read: InputReader<B> = Box::new(move |grads| {
            let g = x.grad(grads)?;
            Some((values(g.clone()), g.dtype()))
        });
        self.inputs.push((name.to_string(), read));
    }

    /// A tracked f32 input of distinct values in `[lo, hi)` (a golden-ratio sequence, not on
    /// the bf16 grid): no ties for a max to break.
    fn distinct_input<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        lo: f32,
        hi: f32,
    ) -> Tensor<B, D> {
        let n = shape.iter().product();
        let phi = (5f64.sqrt() - 1.0) / 2.0;
        let v: Vec<f32> = (0..n)
            .map(|i| lo + (hi - lo) * ((i as f64 * phi + 0.1).fract() as f32))
            .collect();
        self.tracked(name, v, shape)
    }

    /// A tracked f32 input on the grid, at least `margin` from each of `kinks`, cast to the
    /// run's half dtype (exactly: the values are on its grid): an op with a kink sees the
    /// same values as in f32 and takes the same side of it. After a lowered op, a value
    /// within a rounding step of a kink may take the other side, from one run to the next
    /// (the order of the sums moves with the threads), and flip that element's gradient.
    fn half_input<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        lo: f32,
        hi: f32,
        kinks: &[f32],
        margin: f32,
    ) -> Tensor<B, D> {
        let n = shape.iter().product();
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            let x = on_grid(lo + (hi - lo) * (self.draws)());
            if kinks.iter().all(|k| (x - k).abs() >= margin) {
                v.push(x);
            }
        }
        self.tracked(name, v, shape).cast(self.low)
    }

    fn ints<const D: usize>(&mut self, shape: [usize; D], below: usize) -> Tensor<B, D, Int> {
        let n = shape.iter().product();
        let v: Vec<i64> = (0..n)
            .map(|_| ((self.draws)() * below as f32) as i64 % below as i64)
            .collect();
        Tensor::from_data(TensorData::new(v, shape), &self.device)
    }

    /// A state the forward left (compared, not differentiated).
    fn state<const D: usize>(&mut self, name: &str, t: Tensor<B, D>) {
        self.states.push((name.to_string(), values(t)));
    }

    /// `sum(out * r)` for fixed weights `r` in [-1, 1): every output element's gradient is
    /// different, so a wrong one cannot hide in a symmetric sum.
    /// The output is compared, element by element; the sum, where terms cancel, is not.
    fn project<const D: usize>(&mut self, out: Tensor<B, D>) -> Tensor<B, 1> {
        self.projected = true;
        let name = format!("output {}", self.states.len());
        self.state(&name, out.clone());
        let r = self.data(out.dims(), -1.0, 1.0);
        (out * r).sum()
    }
}

/// Replaces each parameter's values with draws of the same mean and standard deviation (a
/// norm's ones stay ones, a weight keeps its initialiser's scale).
struct Redraw<'a>(&'a mut Box<dyn FnMut() -> f32>);

impl<B: AutodiffBackend> ModuleMapper<B> for Redraw<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let (shape, device) = (tensor.shape(), tensor.device());
        let v = values(tensor);
        let n = v.len() as f32;
        let mean = v.iter().sum::<f32>() / n;
        let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n).sqrt();
        // Uniform on [-√3, √3): unit standard deviation.
        let v: Vec<f32> = (0..v.len())
            .map(|_| mean + std * 3f32.sqrt() * (2.0 * (self.0)() - 1.0))
            .collect();
        let tensor = Tensor::from_data(TensorData::new(v, shape), &device).require_grad();
        Param::from_mapped_value(id, tensor, mapper)
    }
}

struct ParamGrads<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    module: usize,
    out: Vec<Named>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ParamGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let name = format!("module {} parameter {}", self.module, self.out.len());
        if let Some(g) = param.val().grad(self.grads) {
            self.out.push((name, values(g.clone()), g.dtype()));
        }
    }
}

type Case<B> = fn(&mut Cx<B>) -> Tensor<B, 1>;

fn run<B: AutodiffBackend>(
    case: Case<B>,
    device: B::Device,
    weights: Option<Vec<Vec<u8>>>,
    precision: Option<Precision>,
) -> (Run, Vec<Vec<u8>>) {
    let low = precision
        .and_then(Precision::low_dtype)
        .unwrap_or(FloatDType::F32);
    let mut cx = Cx::<B>::new(device, weights, low);
    let _guard = precision.map(autocast);
    let loss = case(&mut cx);
    let mut values = Vec::new();
    if !cx.projected {
        values.push(("loss".to_string(), self::values(loss.clone())));
    }
    let grads = loss.backward();
    let mut grad_dtypes = Vec::new();
    for params in &cx.params {
        for (name, v, dtype) in params(&grads) {
            grad_dtypes.push((name.clone(), dtype));
            values.push((name, v));
        }
    }
    for (name, grad) in &cx.inputs {
        let (v, dtype) = grad(&grads).unwrap_or_else(|| panic!("{name} got no gradient"));
        grad_dtypes.push((name.clone(), dtype));
        values.push((format!("d {name}"), v));
    }
    values.append(&mut cx.states);
    (
        Run {
            values,
            grad_dtypes,
        },
        std::mem::take(&mut cx.saved),
    )
}

fn rms(v: &[f32]) -> f32 {
    (v.iter().map(|x| x * x).sum::<f32>() / v.len().max(1) as f32).sqrt()
}

fn largest_rms(values: &[(String, Vec<f32>)]) -> f32 {
    values.iter().map(|(_, v)| rms(v)).fold(0.0, f32::max)
}

/// `‖got − want‖ / ‖want‖`, but against at least a hundredth of the case's largest value:
/// a value that is a near-cancellation of terms of that size (a key projection's bias under
/// quiet softmax, whose plain softmax makes it 0: 2e-3 to 3e-3 of the case's largest
/// gradient, 1.8e-2 to 3.6e-2 relative in bf16) carries half precision's rounding of the
/// terms, not of itself (AMP's and PyTorch's). A value zero by symmetry (a key projection's
/// bias under softmax, a bias before a batch norm: f32 gives rounding noise, below
/// `1e-4 × scale` in root mean square) is measured as `rms(got) / scale`.
fn error(got: &[f32], want: &[f32], scale: f32) -> f32 {
    if got.len() != want.len() {
        return f32::INFINITY;
    }
    if rms(want) < 1e-4 * scale {
        return rms(got) / scale;
    }
    let diff: Vec<f32> = got.iter().zip(want).map(|(g, w)| g - w).collect();
    rms(&diff) / rms(want).max(1e-2 * scale)
}

/// The largest relative L2 error allowed against f32, for a value a case's ops lower.
fn tolerance(precision: Precision) -> f32 {
    match precision {
        Precision::Bf16 => 3e-2,
        _ => 5e-3,
    }
}

/// Every case on `Amp` above autodiff and below it, at `precision`, against f32.
pub(crate) fn check_modules<X: Backend>(device: &X::Device, precision: Precision) {
    check_both::<X>(device, precision, tolerance(precision));
}

/// Every case with autocast off (`Precision::F32`), on `Amp` above autodiff and below it,
/// against `Autodiff<Flex>` within `tolerance` (1e-5; 2.3e-6 measured on wgpu): f32 training
/// on another backend, where an f32 kernel's defect shows that half precision's tolerances
/// hide (Burn's `gelu` gradient outside Flex, 7.6e-4 before `Amp` gave its own).
pub(crate) fn check_modules_at_f32<X: Backend>(device: &X::Device, tolerance: f32) {
    check_both::<X>(device, Precision::F32, tolerance);
}

fn check_both<X: Backend>(device: &X::Device, precision: Precision, tolerance: f32) {
    let mut failures = Vec::new();
    failures.extend(check_stack::<Amp<Autodiff<X>>>(
        device, precision, tolerance, true,
    ));
    failures.extend(check_stack::<Autodiff<Amp<X>>>(
        device, precision, tolerance, false,
    ));
    assert!(
        failures.is_empty(),
        "{} {precision}:\n{}",
        std::any::type_name::<X>(),
        failures.join("\n")
    );
}

/// Every case on `A` (`Amp` above or below autodiff) at `precision` against `Autodiff<Flex>`
/// in f32, within `tolerance`: what failed. Above autodiff every gradient of an f32 leaf is f32 too.
fn check_stack<A: AutodiffBackend>(
    device: &A::Device,
    precision: Precision,
    tolerance: f32,
    above_autodiff: bool,
) -> Vec<String> {
    let stack = match above_autodiff {
        true => "Amp<Autodiff<_>>",
        false => "Autodiff<Amp<_>>",
    };
    let mut failures = Vec::new();
    let cases = cases::<Autodiff<Flex>>().into_iter().zip(cases::<A>());
    for ((name, reference), (_, amp)) in cases {
        // A case that fails runs twice more: burn-autodiff's `cat` (the reference's, and the
        // one above `Amp` below autodiff) drops the gradients before it while another thread
        // runs a backward (README, "Defects of Burn 0.21"), as the tests beside this one do. A
        // wrong value fails every run.
        let mut failed = Vec::new();
        for _ in 0..3 {
            let (want, weights) = run(reference, Default::default(), None, None);
            let (got, _) = run(amp, device.clone(), Some(weights), Some(precision));
            let worst;
            (failed, worst) = compare(&got, &want, tolerance, above_autodiff);
            eprintln!("  {stack} {name}: worst error {worst:.2e}");
            if failed.is_empty() {
                break;
            }
        }
        failures.extend(failed.iter().map(|f| format!("{stack} {name}: {f}")));
    }
    failures
}

/// What of `got` is not `want` within `tolerance`, and the worst error.
fn compare(got: &Run, want: &Run, tolerance: f32, above_autodiff: bool) -> (Vec<String>, f32) {
    let mut failures = Vec::new();
    let scale = largest_rms(&want.values);
    let mut worst = 0f32;
    for (what, w) in &want.values {
        let Some((_, g)) = got.values.iter().find(|(n, _)| n == what) else {
            failures.push(format!("no {what}"));
            continue;
        };
        let err = error(g, w, scale);
        worst = worst.max(err);
        if !within(err, tolerance) {
            failures.push(format!("{what} error {err:.2e}"));
        }
    }
    if got.values.len() != want.values.len() {
        failures.push(format!(
            "{} values, f32 gave {}",
            got.values.len(),
            want.values.len()
        ));
    }
    // Below autodiff the casts are invisible to it: a parameter read by a lowered op may get
    // a half gradient there (README, "Below autodiff"; the optimizers cast it).
    for (what, dtype) in got.grad_dtypes.iter().filter(|_| above_autodiff) {
        if *dtype != DType::F32 {
            failures.push(format!("{what}'s gradient is {dtype:?}, not f32"));
        }
    }
    (failures, worst)
}

flex_and_wgpu_tests!(check_modules: modules_f16_flex, modules_bf16_flex, modules_f16_wgpu);

#[test]
fn modules_f32_flex() {
    check_modules_at_f32::<Flex>(&Default::default(), 1e-5);
}

#[test]
fn modules_f32_wgpu() {
    if let Some(device) = super::common::wgpu_device() {
        check_modules_at_f32::<burn::backend::Wgpu>(&device, 1e-5);
    }
}
