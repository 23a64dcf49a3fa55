//! Where an infinity makes a NaN that the math does not (`src/backend/workarounds/infinities.rs`):
//! `log_sigmoid(-inf)` on CubeCL; `exp`'s backward behind a mask, which makes the gradients
//! of Burn's `elu`, `celu`, `selu` and `mish` NaN above 88.7 on every backend; `log`'s and
//! `log1p`'s behind a clamp, which makes burn-nn's binary cross-entropy on probabilities NaN
//! at a probability of 0 or 1. Under `Amp`, above autodiff, all are right; the plain
//! backends' NaNs are canaries.

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::activation::{celu, elu, log_sigmoid, mish, selu, softplus};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, TensorData};
use burn_amp::{Amp, autocast};

use super::*;

/// `log_sigmoid` at `-inf` is `-inf` and its gradient 1 (PyTorch's and Flex's); Burn's default
/// composition, which CubeCL runs, gives NaN for both. Under `Amp`, above and below autodiff,
/// behind a `mask_where` that drops the masked values (the gradient stays finite), and beside
/// another op that keeps the same input; at F16 (recomputed, memory-bound node) and F32.
pub(crate) fn log_sigmoid_at_minus_infinity<B: Backend>(device: &B::Device) {
    let inputs = vec![f32::NEG_INFINITY, -100.0, 0.0, 3.0, f32::INFINITY];
    let want = [
        f32::NEG_INFINITY,
        -100.0,
        -core::f32::consts::LN_2,
        -0.048587352,
        0.0,
    ];
    let want_grad = [1.0, 1.0, 0.5, 0.047425873, 0.0];
    fn check<A: burn::tensor::backend::AutodiffBackend>(
        device: &A::Device,
        inputs: &[f32],
        want: &[f32],
        want_grad: &[f32],
        name: &str,
    ) {
        let x =
            Tensor::<A, 1>::from_data(TensorData::new(inputs.to_vec(), [5]), device).require_grad();
        let y = log_sigmoid(x.clone());
        let got = values(y.clone());
        let close = |g: f32, w: f32| g == w || (g - w).abs() <= 1e-6 + 1e-5 * w.abs();
        assert!(
            got.iter().zip(want).all(|(g, w)| close(*g, *w)),
            "{name}: {got:?}, want {want:?}"
        );
        let grad = values(x.grad(&y.sum().backward()).expect("x's gradient"));
        assert!(
            grad.iter().zip(want_grad).all(|(g, w)| close(*g, *w)),
            "{name} gradient: {grad:?}, want {want_grad:?}"
        );
        // A mask that drops the `-inf` term: the loss and every gradient finite.
        let keep = x.clone().greater_elem(-1e30);
        let y = log_sigmoid(x.clone()).mask_where(keep.bool_not(), x.zeros_like());
        let grad = values(x.grad(&y.sum().backward()).expect("x's gradient"));
        assert!(
            grad.iter().all(|g| g.is_finite()),
            "{name} masked: {grad:?}"
        );
    }
    // Another op keeping the same input for its backward (`x · c`, both tracked): the
    // checkpointer keeps one copy of `x`, holding the `-inf`, that both backwards read.
    fn shared<A: burn::tensor::backend::AutodiffBackend>(device: &A::Device, name: &str) {
        let x = Tensor::<A, 1>::from_floats([f32::NEG_INFINITY, 1.0], device).require_grad();
        let c = Tensor::<A, 1>::from_floats([2.0, 3.0], device).require_grad();
        let y = log_sigmoid(x.clone()) + x.clone() * c;
        let grad = values(x.grad(&y.sum().backward()).expect("x's gradient"));
        // 1 + 2 at -inf; sigmoid(-1) + 3 at 1.
        let want = [3.0, 3.268_941_4];
        assert!(
            grad.iter().zip(want).all(|(g, w)| (g - w).abs() <= 1e-5),
            "{name} shared input: {grad:?}, want {want:?}"
        );
    }
    for precision in [Precision::F16, Precision::F32] {
        let _g = autocast(precision);
        let name = |layout: &str| format!("{layout} at {precision:?}");
        check::<Amp<Autodiff<B>>>(
            device,
            &inputs,
            &want,
            &want_grad,
            &name("Amp<Autodiff<B>>"),
        );
        check::<Autodiff<Amp<B>>>(
            device,
            &inputs,
            &want,
            &want_grad,
            &name("Autodiff<Amp<B>>"),
        );
        shared::<Amp<Autodiff<B>>>(device, &name("Amp<Autodiff<B>>"));
        shared::<Autodiff<Amp<B>>>(device, &name("Autodiff<Amp<B>>"));
    }
}

#[test]
fn log_sigmoid_at_minus_infinity_flex() {
    log_sigmoid_at_minus_infinity::<Flex>(&Default::default());
}

#[test]
fn log_sigmoid_at_minus_infinity_wgpu() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    log_sigmoid_at_minus_infinity::<Wgpu>(&device);
    // Canary: plain wgpu's value and gradient at -inf are NaN.
    let x = Tensor::<Autodiff<Wgpu>, 1>::from_floats([f32::NEG_INFINITY], &device).require_grad();
    let y = log_sigmoid(x.clone());
    let value = values(y.clone())[0];
    let grad = values(x.grad(&y.sum().backward()).unwrap())[0];
    assert!(
        value.is_nan() && grad.is_nan(),
        "plain wgpu: {value}, {grad}"
    );
}

/// Inputs across `exp`'s overflow (88.72 in f32), negative ones too; none beyond f16's range.
const INPUTS: [f32; 9] = [-3.0, -1.0, 0.5, 20.0, 88.0, 89.0, 100.0, 1000.0, 30000.0];

const SELU_ALPHA: f64 = 1.673_263_242_354_377_3;
const SELU_GAMMA: f64 = 1.050_700_987_355_480_5;

/// An activation Burn composes with `exp`, with its value and derivative in f64 (PyTorch's).
struct Activation<A: Backend> {
    name: &'static str,
    op: fn(Tensor<A, 1>) -> Tensor<A, 1>,
    value: fn(f64) -> f64,
    derivative: fn(f64) -> f64,
}

fn softplus_f64(x: f64) -> f64 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

fn sigmoid_f64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn activations<A: Backend>() -> [Activation<A>; 4] {
    [
        Activation {
            name: "elu",
            op: |x| elu(x, 1.0),
            value: |x| if x > 0.0 { x } else { x.exp_m1() },
            derivative: |x| if x > 0.0 { 1.0 } else { x.exp() },
        },
        Activation {
            name: "celu",
            op: |x| celu(x, 1.0),
            value: |x| if x > 0.0 { x } else { x.exp_m1() },
            derivative: |x| if x > 0.0 { 1.0 } else { x.exp() },
        },
        Activation {
            name: "selu",
            op: selu,
            value: |x| SELU_GAMMA * if x > 0.0 { x } else { SELU_ALPHA * x.exp_m1() },
            derivative: |x| SELU_GAMMA * if x > 0.0 { 1.0 } else { SELU_ALPHA * x.exp() },
        },
        Activation {
            name: "mish",
            op: mish,
            value: |x| x * softplus_f64(x).tanh(),
            derivative: |x| {
                let t = softplus_f64(x).tanh();
                t + x * (1.0 - t * t) * sigmoid_f64(x)
            },
        },
    ]
}

/// Each activation's value and gradient at [`INPUTS`] on `A`: `None` where they match the f64
/// reference within `rtol`, else what went wrong.
pub(crate) fn activation_errors<A: AutodiffBackend>(device: &A::Device, rtol: f32) -> Vec<String> {
    let mut errors = Vec::new();
    for act in activations::<A>() {
        let x = Tensor::<A, 1>::from_floats(INPUTS, device).require_grad();
        let y = (act.op)(x.clone());
        let got = values(y.clone());
        let grad = values(x.grad(&y.sum().backward()).expect("x's gradient"));
        let want: Vec<f32> = INPUTS
            .iter()
            .map(|x| (act.value)(*x as f64) as f32)
            .collect();
        let want_grad: Vec<f32> = INPUTS
            .iter()
            .map(|x| (act.derivative)(*x as f64) as f32)
            .collect();
        if let Some((i, g, w)) = first_mismatch(&got, &want, 1e-6, rtol) {
            errors.push(format!("{} at {}: {g}, want {w}", act.name, INPUTS[i]));
        }
        if let Some((i, g, w)) = first_mismatch(&grad, &want_grad, 1e-6, rtol) {
            errors.push(format!(
                "{} gradient at {}: {g}, want {w}",
                act.name, INPUTS[i]
            ));
        }
    }
    errors
}

/// `elu`, `celu`, `selu`, `mish`: values and gradients within `rtol` of PyTorch's (f64) from
/// -3 to 30000 under `Amp` above autodiff, at `precision` and at F32; `exp`'s gradient still
/// `+inf` where the overflow reached the loss, and NaN behind a mask where its input is NaN.
pub(crate) fn exp_behind_a_mask<B: Backend>(device: &B::Device, precision: Precision) {
    for (precision, rtol) in [(precision, 2e-2), (Precision::F32, 1e-5)] {
        let _g = autocast(precision);
        let errors = activation_errors::<Amp<Autodiff<B>>>(device, rtol);
        assert!(
            errors.is_empty(),
            "Amp<Autodiff<B>> at {precision:?}: {errors:?}"
        );

        type A<B> = Amp<Autodiff<B>>;
        // The overflow reaches the loss: the gradient stays +inf (the scaler skips).
        let x = Tensor::<A<B>, 1>::from_floats([100.0, 1.0], device).require_grad();
        let y = x.clone().exp();
        let grad = values(x.grad(&y.sum().backward()).expect("x's gradient"));
        assert!(
            grad[0] == f32::INFINITY && (grad[1] - 1f32.exp()).abs() < 1e-2,
            "{grad:?}"
        );
        // A NaN in behind a mask: NaN out, as in PyTorch.
        let x = Tensor::<A<B>, 1>::from_floats([f32::NAN, 100.0], device).require_grad();
        let y = x
            .clone()
            .exp()
            .mask_where(x.clone().is_nan(), x.zeros_like());
        let y = y.mask_where(x.clone().greater_elem(50.0), x.zeros_like());
        let grad = values(x.grad(&y.sum().backward()).expect("x's gradient"));
        assert!(
            grad[0].is_nan() && grad[1] == 0.0,
            "{precision:?} masked NaN: {grad:?}"
        );
    }
}

/// Canaries: plain autodiff, and `Amp` below it (`exp`'s backward there is a product `Amp`
/// cannot tell from another), give NaN gradients above 88.7; `softplus` itself is `+inf`
/// there on every backend (Burn composes it as `log(exp(x) + 1)`; PyTorch: `x` above 20).
fn canaries<B: Backend>(device: &B::Device) {
    let nan_above_overflow = |errors: Vec<String>| {
        ["elu", "celu", "selu", "mish"].iter().all(|name| {
            errors.iter().any(|e| {
                e == &format!(
                    "{name} gradient at 89: NaN, want {}",
                    if *name == "selu" {
                        SELU_GAMMA as f32
                    } else {
                        1.0
                    }
                )
            })
        })
    };
    let plain = activation_errors::<Autodiff<B>>(device, 1e-5);
    assert!(nan_above_overflow(plain.clone()), "plain: {plain:?}");
    let _g = autocast(Precision::F32);
    let below = activation_errors::<Autodiff<Amp<B>>>(device, 1e-5);
    assert!(
        nan_above_overflow(below.clone()),
        "Autodiff<Amp<B>>: {below:?}"
    );
    let x = Tensor::<Amp<Autodiff<B>>, 1>::from_floats([100.0], device);
    assert_eq!(values(softplus(x, 1.0)), [f32::INFINITY]);
}

/// The README's `softplus` thresholded as PyTorch's (`x` above 20): under `Amp` its gradient is
/// 1 there, and NaN without it.
fn thresholded_softplus<B: Backend>(device: &B::Device) {
    fn run<A: AutodiffBackend>(device: &A::Device) -> (Vec<f32>, Vec<f32>) {
        let x = Tensor::<A, 1>::from_floats([1.0, 100.0], device).require_grad();
        let y = softplus(x.clone(), 1.0).mask_where(x.clone().greater_elem(20.0), x.clone());
        let grad = values(x.grad(&y.clone().sum().backward()).expect("x's gradient"));
        (values(y), grad)
    }
    let _g = autocast(Precision::F32);
    let (value, grad) = run::<Amp<Autodiff<B>>>(device);
    assert!(
        (value[0] - 1.313_261_7).abs() < 1e-5 && value[1] == 100.0,
        "{value:?}"
    );
    assert!(
        (grad[0] - 0.731_058_6).abs() < 1e-5 && grad[1] == 1.0,
        "{grad:?}"
    );
    let (_, plain) = run::<Autodiff<B>>(device);
    assert!(plain[1].is_nan(), "plain: {plain:?}");
}

/// burn-nn's `BinaryCrossEntropyLoss` on `sigmoid` probabilities at logits 20 and -110 (`p`
/// exactly 1 and 0 in f32) with either target, and at ±3: the loss (clamped at 100 a term, as
/// PyTorch's `BCELoss`) within 1e-5 relative and the logits' gradient within 1e-6 of PyTorch's
/// (0 where saturated, `(p - t) / 6` elsewhere), under `Amp` above autodiff at `precision` and
/// F32. Returns plain autodiff's gradient (NaN at the four saturated logits: a canary).
pub(crate) fn bce_on_saturated_probabilities<B: Backend>(
    device: &B::Device,
    precision: Precision,
) -> Vec<f32> {
    fn run<A: AutodiffBackend>(device: &A::Device) -> (f32, Vec<f32>) {
        let logits = Tensor::<A, 2>::from_data(
            TensorData::new(vec![20.0f32, 20.0, -110.0, -110.0, 3.0, -3.0], [6, 1]),
            device,
        )
        .require_grad();
        let targets = Tensor::<A, 2, burn::tensor::Int>::from_data(
            TensorData::new(vec![1i64, 0, 0, 1, 1, 0], [6, 1]),
            device,
        );
        let bce = burn::nn::loss::BinaryCrossEntropyLossConfig::new().init(device);
        let loss = bce.forward(burn::tensor::activation::sigmoid(logits.clone()), targets);
        let value = values(loss.clone())[0];
        (
            value,
            values(logits.grad(&loss.backward()).expect("the logits' gradient")),
        )
    }
    let s3 = sigmoid_f64(3.0);
    let want_loss = ((100.0 + 100.0 - 2.0 * s3.ln()) / 6.0) as f32;
    let want_grad = [0.0, 0.0, 0.0, 0.0, (s3 - 1.0) / 6.0, (1.0 - s3) / 6.0].map(|g| g as f32);
    for precision in [precision, Precision::F32] {
        let _g = autocast(precision);
        let (loss, grad) = run::<Amp<Autodiff<B>>>(device);
        assert!(
            (loss - want_loss).abs() <= 1e-5 * want_loss,
            "{precision:?}: loss {loss}, want {want_loss}"
        );
        assert!(
            first_mismatch(&grad, &want_grad, 1e-6, 1e-4).is_none(),
            "{precision:?}: the logits' gradient {grad:?}, want {want_grad:?}"
        );
    }
    run::<Autodiff<B>>(device).1
}

/// `cosine_similarity` with PyTorch's `eps` (1e-8) of a zero row and `[3, 4]`: the value 0 and
/// the zero row's gradient `x2 / (eps · ‖x2‖)` = [6e7, 8e7] within 1e-5 relative, under `Amp`
/// above autodiff at F32 (in f16 such a gradient overflows). Returns plain autodiff's (NaN:
/// the clamped norm's `sqrt` at 0).
pub(crate) fn cosine_similarity_of_a_zero_row<B: Backend>(device: &B::Device) -> Vec<f32> {
    fn run<A: AutodiffBackend>(device: &A::Device) -> (Vec<f32>, Vec<f32>) {
        let x1 = Tensor::<A, 2>::from_floats([[0.0, 0.0], [1.0, 2.0]], device).require_grad();
        let x2 = Tensor::<A, 2>::from_floats([[3.0, 4.0], [3.0, 4.0]], device);
        let cos = burn::tensor::linalg::cosine_similarity(x1.clone(), x2, 1, Some(1e-8f64.elem()));
        let grad = values(
            x1.grad(&cos.clone().sum().backward())
                .expect("x1's gradient"),
        );
        (values(cos), grad)
    }
    let _g = autocast(Precision::F32);
    let (cos, grad) = run::<Amp<Autodiff<B>>>(device);
    let n = 5f64.sqrt();
    // d/dx1 of x1·x2 / (‖x1‖ ‖x2‖) at [1, 2]: x2 / (‖x1‖ ‖x2‖) − cos · x1 / ‖x1‖².
    let cos1 = 11.0 / (n * 5.0);
    let want_grad = [
        6e7,
        8e7,
        3.0 / (n * 5.0) - cos1 / 5.0,
        4.0 / (n * 5.0) - cos1 * 2.0 / 5.0,
    ]
    .map(|g| g as f32);
    assert!(
        cos[0] == 0.0 && (cos[1] - cos1 as f32).abs() < 1e-6,
        "cosine {cos:?}"
    );
    assert!(
        first_mismatch(&grad, &want_grad, 1e-6, 1e-5).is_none(),
        "gradient {grad:?}, want {want_grad:?}"
    );
    run::<Autodiff<B>>(device).1
}

fn bce_canary(plain: Vec<f32>) {
    assert!(
        plain[..4].iter().all(|g| g.is_nan()) && plain[4..].iter().all(|g| g.is_finite()),
        "plain: {plain:?}"
    );
}

#[test]
fn bce_on_saturated_probabilities_flex() {
    let device = Default::default();
    bce_on_saturated_probabilities::<Flex>(&device, Precision::F16);
    bce_canary(bce_on_saturated_probabilities::<Flex>(
        &device,
        Precision::Bf16,
    ));
}

#[test]
fn cosine_similarity_of_a_zero_row_flex() {
    let plain = cosine_similarity_of_a_zero_row::<Flex>(&Default::default());
    assert!(
        plain[0].is_nan() && plain[2].is_finite(),
        "plain: {plain:?}"
    );
}

/// On wgpu plain autodiff is right here, by another defect: CubeCL's `powf_scalar(0, -0.5)` is
/// 0 (IEEE, PyTorch and Flex: `+inf`), so burn-autodiff's `sqrt` derivative at 0 is 0, not
/// `+inf` (`powers::powers_of_zero_and_negative_bases_wgpu`).
#[test]
fn cosine_similarity_of_a_zero_row_wgpu() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    let plain = cosine_similarity_of_a_zero_row::<Wgpu>(&device);
    assert!(plain.iter().all(|g| g.is_finite()), "plain: {plain:?}");
}

#[test]
fn bce_on_saturated_probabilities_wgpu() {
    if let Some(device) = common::wgpu_device() {
        bce_canary(bce_on_saturated_probabilities::<Wgpu>(
            &device,
            Precision::F16,
        ));
    }
}

#[test]
fn exp_behind_a_mask_flex_f16() {
    exp_behind_a_mask::<Flex>(&Default::default(), Precision::F16);
}

#[test]
fn exp_behind_a_mask_flex_bf16() {
    let device = Default::default();
    exp_behind_a_mask::<Flex>(&device, Precision::Bf16);
    canaries::<Flex>(&device);
    thresholded_softplus::<Flex>(&device);
}

#[test]
fn exp_behind_a_mask_wgpu() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    exp_behind_a_mask::<Wgpu>(&device, Precision::F16);
    canaries::<Wgpu>(&device);
    thresholded_softplus::<Wgpu>(&device);
}

/// Maxima of rows of `-inf` and minima of rows of `+inf` under `Amp` on `B`, below and above
/// autodiff, the input in each of `dtypes`: the infinity (PyTorch's, Flex's; CubeCL's kernels
/// give the dtype's lowest or highest finite value, `nan::extreme`), beside a row with a NaN
/// (NaN) and one with a number (the number).
pub(crate) fn extremes_of_infinite_rows<B: Backend>(device: &B::Device, dtypes: &[DType]) {
    fn extremes<B: Backend>(device: &B::Device, dtype: DType) -> Vec<f32> {
        let (nan, ninf) = (f32::NAN, f32::NEG_INFINITY);
        let rows = [[1.0, ninf], [ninf, ninf], [nan, ninf]];
        let x = Tensor::<B, 2>::from_floats(rows, device).cast(dtype);
        [
            values(x.clone().max_dim(1)),
            values(x.clone().slice([1..2, 0..2]).max()),
            values(x.clone().neg().min_dim(1)),
            values(x.neg().slice([1..2, 0..2]).min()),
        ]
        .concat()
    }
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let want = [1.0, -inf, nan, -inf, -1.0, inf, nan, inf];
    let same = |got: &[f32]| {
        got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(g, w)| *g == w || (g.is_nan() && w.is_nan()))
    };
    let _g = autocast(Precision::F16);
    for &dtype in dtypes {
        let got = extremes::<Amp<B>>(device, dtype);
        assert!(same(&got), "Amp, {dtype:?}: {got:?}, want {want:?}");
        let got = extremes::<Amp<Autodiff<B>>>(device, dtype);
        assert!(
            same(&got),
            "above autodiff, {dtype:?}: {got:?}, want {want:?}"
        );
    }
}

#[test]
fn extremes_of_infinite_rows_flex() {
    let dtypes = [DType::F32, DType::F16, DType::BF16];
    extremes_of_infinite_rows::<Flex>(&Default::default(), &dtypes);
}

/// Plain CubeCL's maximum of a row of `-inf` (and minimum of `+inf`) is the dtype's lowest
/// (highest) finite value, in f32 and f16; Flex's is the infinity, as is CubeCL's
/// `max_dim_with_indices`, and `Amp`'s. Plain wgpu is a canary: it fails once Burn fixes it.
#[test]
fn max_of_a_row_of_minus_infinity_wgpu() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    extremes_of_infinite_rows::<Wgpu>(&device, &[DType::F32, DType::F16]);
    let ninf = f32::NEG_INFINITY;
    let rows = [[1.0, ninf], [ninf, ninf]];
    for (dtype, lowest) in [(DType::F32, f32::MIN), (DType::F16, -65504.0)] {
        let x = Tensor::<Wgpu, 2>::from_floats(rows, &device).cast(dtype);
        assert_eq!(
            values(x.clone().max_dim(1)),
            [1.0, lowest],
            "{dtype:?} max_dim"
        );
        assert_eq!(
            values(x.clone().slice([1..2, 0..2]).max()),
            [lowest],
            "{dtype:?} max"
        );
        assert_eq!(
            values(x.clone().neg().min_dim(1)),
            [-1.0, -lowest],
            "{dtype:?} min_dim"
        );
        assert_eq!(
            values(x.clone().max_dim_with_indices(1).0),
            [1.0, ninf],
            "{dtype:?} max_dim_with_indices"
        );
        let flex = Tensor::<Flex, 2>::from_floats(rows, &Default::default()).cast(dtype);
        assert_eq!(
            values(flex.max_dim(1)),
            [1.0, ninf],
            "{dtype:?} Flex max_dim"
        );
    }
}
