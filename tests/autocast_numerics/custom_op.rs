//! A backend trait of the user's own under `Amp` (`burn_amp::custom_op`): a fused
//! `lhs · rhs + bias`, shaped as Burn's `custom-cubecl-kernel` example (a trait over
//! `Backend`, implemented for each backend, and for `Autodiff<B>` with a backward of its own).
//! Its "kernel" refuses inputs of differing dtypes, as a real one would fail on them, and
//! records the dtype it read.
//!
//! Checked: under autocast the op reads half inputs (`Category::Lower`), its output and the
//! loss and gradients stay within half precision of f32 training (relative L2 5e-3 f16,
//! 3e-2 bf16), parameters get f32 gradients, with `Amp` above autodiff and below it; a
//! parameter used twice is cast once; an op whose kernel reads f32 alone gets f32 (bitwise
//! f32 training), also from half inputs outside autocast; inputs of mixed dtypes reach it in
//! one dtype whatever the category; the precision doctor names it when it overflows f16 and
//! measures what it loses against its own f32 run. An op with three outputs (`run_many`):
//! each in the op's dtype, trained within f16's rounding, named when one output alone
//! overflows, measured output by output.

use std::cell::RefCell;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, broadcast_shape};
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Shape, TensorData, TensorMetadata, TensorPrimitive};
use burn_amp::backend::cast_cache;
use burn_amp::custom_op::{Category, CustomOp};
use burn_amp::doctor::Cause;
use burn_amp::{Amp, PrecisionReport, autocast, detect_anomaly};
use burn_cubecl::element::BoolElement;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::Fusion;

use super::*;

/// The user's backend trait.
pub trait FusedBackend: Backend {
    fn fused_matmul_add(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

thread_local! {
    /// The dtypes the kernel read, one per call.
    static READ: RefCell<Vec<DType>> = const { RefCell::new(Vec::new()) };
}

fn read_dtypes() -> Vec<DType> {
    READ.with(|r| r.take())
}

/// The "kernel": inputs in one dtype (else a panic, where a real kernel would read a buffer
/// as the wrong type), computed in f32 and written in the inputs' dtype.
fn kernel<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    bias: FloatTensor<B>,
) -> FloatTensor<B> {
    let dtype = lhs.dtype();
    assert!(
        rhs.dtype() == dtype && bias.dtype() == dtype,
        "kernel: inputs in one dtype, got {dtype:?}, {:?}, {:?}",
        rhs.dtype(),
        bias.dtype()
    );
    READ.with(|r| r.borrow_mut().push(dtype));
    let f32 = |t| B::float_cast(t, FloatDType::F32);
    let out = B::float_add(B::float_matmul(f32(lhs), f32(rhs)), f32(bias));
    B::float_cast(out, FloatDType::from(dtype))
}

impl FusedBackend for Flex {
    fn fused_matmul_add(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        kernel::<Self>(lhs, rhs, bias)
    }
}

/// Wgpu, and CUDA in the GPU check: each CubeCL backend under fusion.
impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> FusedBackend
    for Fusion<CubeBackend<R, F, I, BT>>
{
    fn fused_matmul_add(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        kernel::<Self>(lhs, rhs, bias)
    }
}

/// The backward of the user's op, as the Burn example writes one.
#[derive(Debug)]
struct FusedBackward;

impl<B: Backend> Backward<B, 3> for FusedBackward {
    type State = (NodeId, NodeId, Shape);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_lhs, node_rhs, node_bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (lhs, rhs, bias_shape) = ops.state;
        let lhs: FloatTensor<B> = checkpointer.retrieve_node_output(lhs);
        let rhs: FloatTensor<B> = checkpointer.retrieve_node_output(rhs);
        let (lhs_shape, rhs_shape) = (lhs.shape(), rhs.shape());
        let grad_lhs = B::float_matmul(grad.clone(), B::float_transpose(rhs));
        let grad_rhs = B::float_matmul(B::float_transpose(lhs), grad.clone());
        if let Some(node) = node_bias {
            grads.register::<B>(node.id, broadcast_shape::<B>(grad, &bias_shape));
        }
        if let Some(node) = node_lhs {
            grads.register::<B>(node.id, broadcast_shape::<B>(grad_lhs, &lhs_shape));
        }
        if let Some(node) = node_rhs {
            grads.register::<B>(node.id, broadcast_shape::<B>(grad_rhs, &rhs_shape));
        }
    }
}

impl<B: FusedBackend, C: CheckpointStrategy> FusedBackend for Autodiff<B, C> {
    fn fused_matmul_add(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match FusedBackward
            .prepare::<C>([lhs.node.clone(), rhs.node.clone(), bias.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let lhs_state = prep.checkpoint(&lhs);
                let rhs_state = prep.checkpoint(&rhs);
                let bias_shape = bias.primitive.shape();
                let out = B::fused_matmul_add(
                    lhs.primitive.clone(),
                    rhs.primitive.clone(),
                    bias.primitive,
                );
                prep.finish((lhs_state, rhs_state, bias_shape), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_matmul_add(
                lhs.primitive,
                rhs.primitive,
                bias.primitive,
            )),
        }
    }
}

/// The user's declaration: a matmul, lowered under autocast.
const FUSED: CustomOp = CustomOp::new("fused_matmul_add", Category::Lower);

impl<B: FusedBackend> FusedBackend for Amp<B> {
    fn fused_matmul_add(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        FUSED.run::<B, 3>([lhs, rhs, bias], |[lhs, rhs, bias]| {
            B::fused_matmul_add(lhs, rhs, bias)
        })
    }
}

fn fused<B: FusedBackend>(
    lhs: Tensor<B, 3>,
    rhs: Tensor<B, 3>,
    bias: Tensor<B, 3>,
) -> Tensor<B, 3> {
    let prim = |t: Tensor<B, 3>| t.into_primitive().tensor();
    Tensor::from_primitive(TensorPrimitive::Float(B::fused_matmul_add(
        prim(lhs),
        prim(rhs),
        prim(bias),
    )))
}

const BATCH: usize = 2;
const ROWS: usize = 8;
const WIDTH: usize = 32;

/// A two-layer model's inputs and weights (on the bf16 grid, so the half runs read the
/// reference's values), f32.
fn data() -> [TensorData; 5] {
    let mut draw = uniform(21);
    let mut t = |shape: Vec<usize>, scale: f32| {
        let n = shape.iter().product();
        let v = (0..n)
            .map(|_| on_grid((draw() - 0.5) * scale))
            .collect::<Vec<_>>();
        TensorData::new(v, shape)
    };
    [
        t(vec![BATCH, ROWS, WIDTH], 2.0),
        t(vec![1, WIDTH, WIDTH], 0.5),
        t(vec![1, 1, WIDTH], 0.2),
        t(vec![1, WIDTH, WIDTH], 0.5),
        t(vec![BATCH, ROWS, WIDTH], 1.0),
    ]
}

/// The loss, the input's gradient and the weights' and bias's, each in f32, with their dtypes;
/// the second layer reuses the first's bias (a parameter used twice).
fn run<B: AutodiffBackend + FusedBackend>(device: &B::Device) -> (Vec<Vec<f32>>, Vec<DType>) {
    let [x, w1, bias, w2, target] = data().map(|d| Tensor::<B, 3>::from_data(d, device));
    let [x, w1, bias, w2] = [x, w1, bias, w2].map(|t| t.require_grad());
    let hidden = fused(x.clone(), w1.clone(), bias.clone());
    let out = fused(hidden, w2.clone(), bias.clone());
    let loss = (out * target).sum();
    let mut read = vec![values(loss.clone())];
    let grads = loss.backward();
    let mut dtypes = vec![];
    for t in [x, w1, bias, w2] {
        let g = t.grad(&grads).expect("a gradient");
        dtypes.push(g.dtype());
        read.push(values(g));
    }
    (read, dtypes)
}

fn reference() -> Vec<Vec<f32>> {
    let (values, _) = run::<Autodiff<Flex>>(&Default::default());
    read_dtypes();
    values
}

fn assert_near(got: &[Vec<f32>], want: &[Vec<f32>], precision: Precision, what: &str) {
    let tolerance = if precision == Precision::Bf16 {
        3e-2
    } else {
        5e-3
    };
    let names = ["loss", "x's gradient", "w1's", "bias's", "w2's"];
    for ((got, want), name) in got.iter().zip(want).zip(names) {
        let err = rel_l2(got, want);
        assert!(
            err <= tolerance,
            "{what}: {name} {err:.2e} from f32 training's (tolerance {tolerance:.0e})"
        );
    }
}

/// Under autocast the op reads the half dtype and trains within half precision of f32, above
/// autodiff (f32 gradients for the f32 leaves, each parameter cast once) and below it.
pub(super) fn lowered<B: FusedBackend>(device: &B::Device, precision: Precision)
where
    Amp<Autodiff<B>>: AutodiffBackend<Device = B::Device>,
    Autodiff<Amp<B>>: AutodiffBackend<Device = B::Device>,
{
    let want = reference();
    let low = low(precision);
    let _guard = autocast(precision);

    let (got, dtypes) = run::<Amp<Autodiff<B>>>(device);
    assert_eq!(
        read_dtypes(),
        vec![low; 2],
        "above autodiff: the kernel reads {low:?}"
    );
    assert_eq!(
        dtypes,
        vec![DType::F32; 4],
        "above autodiff: f32 leaves, f32 gradients"
    );
    assert_near(&got, &want, precision, "Amp<Autodiff<B>>");

    let (got, _) = run::<Autodiff<Amp<B>>>(device);
    assert_eq!(
        read_dtypes(),
        vec![low; 2],
        "below autodiff: the kernel reads {low:?}"
    );
    assert_near(&got, &want, precision, "Autodiff<Amp<B>>");
}

flex_and_wgpu_tests!(lowered: custom_op_lowered_flex_f16, custom_op_lowered_flex_bf16, custom_op_lowered_wgpu_f16);

#[test]
fn custom_op_parameters_are_cast_once() {
    type B = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let _guard = autocast(Precision::F16);
    let [x, w1, bias, ..] = data().map(|d| Tensor::<B, 3>::from_data(d, &device));
    let [w1, bias] = [w1, bias].map(|t| t.require_grad());
    cast_cache::clear();
    let out = fused(x.clone(), w1.clone(), bias.clone());
    assert_eq!(cast_cache::len(), 3, "half copies of w1, bias and x");
    // The second call's input is half already; w1 and bias hit the cache.
    let out = fused(out, w1, bias);
    assert_eq!(
        cast_cache::len(),
        3,
        "one half copy of each parameter, used twice"
    );
    assert_eq!(out.dtype(), DType::F16);
    read_dtypes();
}

/// A kernel that reads f32 alone gets f32: under autocast (where its gradients are f32
/// training's, bitwise), and from half inputs outside it.
#[test]
fn custom_op_reading_f32_alone_gets_f32() {
    const F32_ONLY: CustomOp = FUSED.accepts(&[FloatDType::F32]);
    type B = Amp<Autodiff<Flex>>;
    /// What `impl FusedBackend for Amp<B>` would do with `F32_ONLY`, for `B = Autodiff<Flex>`.
    fn call(lhs: Tensor<B, 3>, rhs: Tensor<B, 3>, bias: Tensor<B, 3>) -> Tensor<B, 3> {
        type Inner = Autodiff<Flex>;
        let prim = |t: Tensor<B, 3>| t.into_primitive().tensor();
        let [lhs, rhs, bias] = F32_ONLY.cast::<Inner, 3>([prim(lhs), prim(rhs), prim(bias)]);
        Tensor::from_primitive(TensorPrimitive::Float(Inner::fused_matmul_add(
            lhs, rhs, bias,
        )))
    }
    let device = Default::default();
    let [x, w1, bias, ..] = data();
    let on = |d: &TensorData| Tensor::<B, 3>::from_data(d.clone(), &device).require_grad();
    let want = {
        let _f32 = autocast(Precision::F32);
        let (x, w1, bias) = (on(&x), on(&w1), on(&bias));
        let out = fused(x.clone(), w1.clone(), bias.clone());
        let grads = out.sum().backward();
        read_dtypes();
        [x, w1, bias].map(|t| t.grad(&grads).unwrap().into_data())
    };
    {
        let _guard = autocast(Precision::F16);
        let (x, w1, bias) = (on(&x), on(&w1), on(&bias));
        let out = call(x.clone(), w1.clone(), bias.clone());
        assert_eq!(read_dtypes(), vec![DType::F32], "under autocast f16");
        assert_eq!(out.dtype(), DType::F32);
        let grads = out.sum().backward();
        let got = [x, w1, bias].map(|t| t.grad(&grads).unwrap().into_data());
        assert_bitwise(&got, &want, "an f32-only op under autocast", "f32 training");
    }
    // Half inputs, autocast off: widened for the kernel.
    let _off = autocast(Precision::F32);
    let half = |d: &TensorData| on(d).cast(DType::F16);
    let out = call(half(&x), half(&w1), half(&bias));
    assert_eq!(read_dtypes(), vec![DType::F32], "half inputs, autocast off");
    assert_eq!(out.dtype(), DType::F32);
}

/// Inputs of mixed dtypes reach the kernel in one dtype, in every category; the canary: the
/// same inputs given to the kernel directly fail its check.
#[test]
fn custom_op_inputs_arrive_in_one_dtype() {
    type B = Flex;
    let device = Default::default();
    let [x, w1, bias, ..] = data().map(|d| Tensor::<B, 3>::from_data(d, &device));
    let prim = |t: &Tensor<B, 3>| t.clone().into_primitive().tensor();
    let (x16, wbf) = (x.clone().cast(DType::F16), w1.clone().cast(DType::BF16));
    // (category, precision) → the dtype the kernel reads, from f16 x, bf16 w1 and f32 bias.
    let cases = [
        (Category::Lower, Precision::F16, DType::F16),
        (Category::Lower, Precision::Bf16, DType::BF16),
        (Category::Lower, Precision::F32, DType::F32),
        (Category::F32, Precision::F16, DType::F32),
        (Category::Promote, Precision::F16, DType::F32),
        (Category::Pass, Precision::F16, DType::F32),
    ];
    for (category, precision, want) in cases {
        let _guard = autocast(precision);
        let op = CustomOp::new("mixed", category);
        let [l, r, b] = op.cast::<B, 3>([prim(&x16), prim(&wbf), prim(&bias)]);
        let out = B::fused_matmul_add(l, r, b);
        assert_eq!(read_dtypes(), vec![want], "{category:?} at {precision:?}");
        assert_eq!(out.dtype(), want);
    }
    // f16 with bf16 alone (no f32 among them): promoted to f32 too.
    let op = CustomOp::new("halves", Category::Pass);
    let v = op.cast_vec::<B>(vec![
        prim(&x16),
        prim(&wbf),
        prim(&bias.clone().cast(DType::F16)),
    ]);
    assert!(v.iter().all(|t| t.dtype() == DType::F32));

    let direct = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        B::fused_matmul_add(prim(&x16), prim(&wbf), prim(&bias))
    }));
    let message = panic_message(direct.expect_err("mixed dtypes fail the kernel's check"));
    assert!(message.contains("inputs in one dtype"), "{message}");
}

#[test]
fn custom_op_with_no_dtype_to_read_is_refused() {
    let empty: &'static [FloatDType] = &[];
    let err = std::panic::catch_unwind(|| FUSED.accepts(empty)).expect_err("an empty list");
    assert!(panic_message(err).contains("at least one float dtype"));
}

/// `detect_anomaly` names a custom op that overflows f16 (300 · 300 · 32 > 65504), not the
/// ops that pass its inf on.
#[test]
fn custom_op_overflow_is_named_by_the_doctor() {
    type B = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let _amp = autocast(Precision::F16);
    let full = |shape: [usize; 3], v: f32| Tensor::<B, 3>::full(shape, v, &device);
    let guard = detect_anomaly();
    let out = fused(
        full([1, 2, WIDTH], 300.0),
        full([1, WIDTH, WIDTH], 300.0).require_grad(),
        full([1, 1, WIDTH], 0.0),
    );
    let _passed_on = (out.clone() + 1.0).exp();
    read_dtypes();
    let anomaly = guard.report().expect("the overflow is reported");
    assert_eq!(anomaly.op, "fused_matmul_add", "{anomaly}");
    assert_eq!(anomaly.category, "lower");
    assert_eq!(anomaly.cause, Cause::Op);
    assert_eq!(anomaly.output.dtype, "F16");
    assert_eq!(guard.ops_creating_it(), 1);
    assert!(
        guard.ops_passing_it_on() >= 2,
        "{}",
        guard.ops_passing_it_on()
    );
}

/// A model on the custom op: its two layers.
#[derive(Module, Debug)]
struct TwoLayers<B: Backend> {
    w1: Param<Tensor<B, 3>>,
    bias: Param<Tensor<B, 3>>,
    w2: Param<Tensor<B, 3>>,
}

impl<B: Backend> TwoLayers<B> {
    fn new(w1: Tensor<B, 3>, bias: Tensor<B, 3>, w2: Tensor<B, 3>) -> Self {
        let param = Param::from_tensor;
        Self {
            w1: param(w1),
            bias: param(bias),
            w2: param(w2),
        }
    }
}

/// `PrecisionReport` measures the custom op against its own f32 run (it reads f32 too): it
/// loses f16's rounding, as a matmul does.
#[test]
fn custom_op_is_measured_by_the_precision_report() {
    type B = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let [x, w1, bias, w2, target] = data().map(|d| Tensor::<B, 3>::from_data(d, &device));
    let model = TwoLayers::new(w1, bias, w2);
    let report = PrecisionReport::measure(&model, Precision::F16, 1024.0, |m: &TwoLayers<B>| {
        let hidden = fused(x.clone(), m.w1.val(), m.bias.val());
        (fused(hidden, m.w2.val(), m.bias.val()) * target.clone()).sum()
    })
    .unwrap();
    read_dtypes();
    let rows: Vec<_> = report
        .ops
        .iter()
        .filter(|o| o.op == "fused_matmul_add")
        .collect();
    assert_eq!(rows.len(), 2, "{}", report.table(20));
    for row in rows {
        assert_eq!((row.category, row.dtype.as_str()), ("lower", "F16"));
        let own = row.own_error.expect("measured against its f32 run");
        assert!(own > 0.0 && own < 5e-3, "{row:?}");
    }
}

/// An op with three float outputs, as `run_many` takes one: `h = x · w`, then each row's sum
/// and sum of squares of `h` (what a fused normalisation computes).
const MOMENTS: CustomOp = CustomOp::new("moments", Category::Lower);

/// `Amp` above autodiff on `B`.
type Outer<B> = Amp<Autodiff<B>>;

fn moments<B: Backend>(
    x: Tensor<Outer<B>, 3>,
    w: Tensor<Outer<B>, 3>,
    seen: bool,
) -> [Tensor<Outer<B>, 3>; 3] {
    use burn::tensor::ops::FloatTensorOps;
    type Inner<B> = Autodiff<B>;
    let prim = |t: Tensor<Outer<B>, 3>| t.into_primitive().tensor();
    let op = |[x, w]: [FloatTensor<Inner<B>>; 2]| {
        let h = Inner::<B>::float_matmul(x, w);
        let sums = Inner::<B>::float_sum_dim(h.clone(), 2);
        let squares = Inner::<B>::float_sum_dim(Inner::<B>::float_mul(h.clone(), h.clone()), 2);
        [h, sums, squares]
    };
    let inputs = [prim(x), prim(w)];
    let outputs = if seen {
        MOMENTS.run_many::<Inner<B>, 2, 3>(inputs, op)
    } else {
        op(MOMENTS.cast::<Inner<B>, 2>(inputs))
    };
    outputs.map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)))
}

/// An op with several outputs (`run_many`) under autocast: each output comes back in the
/// op's dtype, within half precision of f32 (relative L2 5e-3 f16, 3e-2 bf16) with the
/// gradients through all three, which reach the f32 leaves in f32.
pub(super) fn several_outputs<B: Backend>(device: &B::Device, precision: Precision) {
    let [x, w, ..] = data();
    let on = |d: &TensorData| Tensor::<Outer<B>, 3>::from_data(d.clone(), device).require_grad();
    let run = |precision| {
        let _guard = autocast(precision);
        let (x, w) = (on(&x), on(&w));
        let outputs = moments(x.clone(), w.clone(), true);
        let dtypes = outputs.each_ref().map(|t| t.dtype());
        let mut read: Vec<Vec<f32>> = outputs.iter().map(|t| values(t.clone())).collect();
        let loss = outputs
            .into_iter()
            .map(|t| t.sum().cast(DType::F32))
            .reduce(|a, b| a + b)
            .unwrap();
        let grads = loss.backward();
        let grads = [x, w].map(|t| t.grad(&grads).expect("a gradient"));
        assert_eq!(grads.each_ref().map(|g| g.dtype()), [DType::F32; 2]);
        read.extend(grads.map(values));
        (read, dtypes)
    };
    let (want, _) = run(Precision::F32);
    let (got, dtypes) = run(precision);
    assert_eq!(
        dtypes,
        [low(precision); 3],
        "every output in the op's dtype"
    );
    let tolerance = if precision == Precision::Bf16 {
        3e-2
    } else {
        5e-3
    };
    let names = ["h", "row sums", "row squares", "x's gradient", "w's"];
    for ((got, want), name) in got.iter().zip(&want).zip(names) {
        let err = rel_l2(got, want);
        assert!(
            err <= tolerance,
            "{name}: {err:.2e} from f32 at {precision:?}"
        );
    }
}

flex_and_wgpu_tests!(several_outputs: custom_op_several_outputs_flex_f16, custom_op_several_outputs_flex_bf16, custom_op_several_outputs_wgpu_f16);

/// `detect_anomaly` names the op when one of its outputs overflows f16 (each row of `h` is
/// 32 values of 128: squares summed to 524288 > 65504) while the others are finite; through
/// `cast` alone (the canary) nothing is named and the next op passes the inf on.
#[test]
fn custom_op_with_several_outputs_is_named_by_the_doctor() {
    let device = Default::default();
    let _amp = autocast(Precision::F16);
    let full = |shape: [usize; 3], v: f32| Tensor::<Outer<Flex>, 3>::full(shape, v, &device);
    for seen in [true, false] {
        let guard = detect_anomaly();
        let [h, sums, squares] =
            moments::<Flex>(full([1, 2, WIDTH], 2.0), full([1, WIDTH, WIDTH], 2.0), seen);
        let _passed_on = squares + 1.0;
        assert_eq!(values(h), vec![128.0; 2 * WIDTH]);
        assert_eq!(values(sums), vec![4096.0; 2]);
        match guard.report() {
            Some(anomaly) => {
                assert!(seen, "seen by the doctor through `cast` alone: {anomaly}");
                assert_eq!(anomaly.op, "moments", "{anomaly}");
                assert_eq!(anomaly.cause, Cause::Op);
                assert_eq!(anomaly.output.shape, vec![1, 2, 1], "the third output");
                assert_eq!((anomaly.values.pos_inf, anomaly.values.total), (2, 2));
                assert_eq!(guard.ops_creating_it(), 1);
            }
            None => {
                assert!(!seen, "run_many's overflow not reported");
                assert_eq!(guard.ops_creating_it(), 0);
                assert!(guard.ops_passing_it_on() >= 1);
            }
        }
    }
}

/// `PrecisionReport` measures each output against the op's own f32 run: three rows a call.
#[test]
fn custom_op_with_several_outputs_is_measured_by_the_precision_report() {
    let device = Default::default();
    let [x, w1, bias, w2, _] = data().map(|d| Tensor::<Outer<Flex>, 3>::from_data(d, &device));
    let model = TwoLayers::new(w1, bias, w2);
    let report = PrecisionReport::measure(
        &model,
        Precision::F16,
        1024.0,
        |m: &TwoLayers<Outer<Flex>>| {
            let [h, sums, squares] = moments::<Flex>(x.clone(), m.w1.val(), true);
            h.sum() + sums.sum() + squares.sum().mul_scalar(1e-3)
        },
    )
    .unwrap();
    let rows: Vec<_> = report.ops.iter().filter(|o| o.op == "moments").collect();
    let shapes: Vec<_> = rows.iter().map(|r| r.shape.clone()).collect();
    assert_eq!(
        shapes,
        vec![
            vec![BATCH, ROWS, WIDTH],
            vec![BATCH, ROWS, 1],
            vec![BATCH, ROWS, 1]
        ],
        "{}",
        report.table(20)
    );
    for row in rows {
        assert_eq!(row.dtype, "F16");
        let own = row.own_error.expect("measured against its f32 run");
        eprintln!("{} {:?}: own error {own:.2e}", row.op, row.shape);
        assert!(own > 0.0 && own < 5e-3, "{row:?}");
    }
}
