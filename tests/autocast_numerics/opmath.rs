//! `gelu`, `tanh` and `asinh` of half inputs computed in f32 and rounded once
//! (`src/backend/workarounds/opmath.rs`), as PyTorch's half kernels compute: CubeCL computes
//! them step by step in the half dtype (`gelu`'s negative tail thousands of f16 steps off,
//! `tanh` and `asinh` of a small input 0 or several times it on wgpu). Errors are counted in
//! steps of the half dtype (its spacing at the exact value); the plain backends' are canaries.
//! Last, `gelu`'s gradient in f32 against its derivative in f64 (outside Flex, Burn 0.21's is
//! the tanh approximation's).

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::TensorData;
use burn::tensor::activation::gelu;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::{Amp, autocast};

use super::*;

/// The spacing of `dtype`'s values at `v` (normal range; its smallest normal below).
fn step(v: f32, dtype: DType) -> f32 {
    let (mantissa, smallest) = match dtype {
        DType::BF16 => (7, f32::MIN_POSITIVE),
        _ => (10, 6.1035156e-5),
    };
    2f32.powf(v.abs().max(smallest).log2().floor() - mantissa as f32)
}

/// The largest error in `dtype`'s steps, and where (input, got, want).
fn worst_steps(got: &[f32], want: &[f32], inputs: &[f32], dtype: DType) -> (f32, f32, f32, f32) {
    let mut worst = (0.0, 0.0, 0.0, 0.0);
    for ((g, w), x) in got.iter().zip(want).zip(inputs) {
        let steps = (g - w).abs() / step(*w, dtype);
        let steps = if steps.is_nan() { f32::INFINITY } else { steps };
        if steps > worst.0 {
            worst = (steps, *x, *g, *w);
        }
    }
    worst
}

/// 4000 inputs spread over [-4, 4] and 200 around 0 (steps of 1e-4).
fn inputs() -> Vec<f32> {
    let mut xs: Vec<f32> = (0..4000).map(|i| (i as f32 * 0.7919).sin() * 4.0).collect();
    xs.extend((0..200).map(|i| (i as f32 - 100.0) * 1e-4));
    xs
}

type Unary<A> = fn(Tensor<A, 1>) -> Tensor<A, 1>;

fn ops<A: AutodiffBackend>() -> [(&'static str, Unary<A>); 3] {
    [
        ("gelu", |x| gelu(x)),
        ("tanh", |x| x.tanh()),
        ("asinh", |x| x.asinh()),
    ]
}

/// Value and gradient (of the sum) of `op` on `inputs` rounded to `dtype`: at `precision` on
/// the half tensor, and at F32 on the same values widened (the reference).
fn run<A: AutodiffBackend>(
    device: &A::Device,
    op: Unary<A>,
    inputs: &[f32],
    dtype: DType,
    reference: bool,
    precision: Precision,
) -> (Vec<f32>, Vec<f32>) {
    let _autocast = autocast(if reference { Precision::F32 } else { precision });
    let x = Tensor::<A, 1>::from_data(TensorData::new(inputs.to_vec(), [inputs.len()]), device)
        .cast(dtype);
    let x = if reference { x.cast(DType::F32) } else { x }.require_grad();
    let y = op(x.clone());
    let grad = x.grad(&y.clone().sum().backward()).expect("x's gradient");
    (values(y), values(grad))
}

/// Values within 1 step of the half dtype of the f32 op's (0.5 measured: correctly rounded),
/// gradients within 2 (1.2 to 1.7 measured), above autodiff; below it, the values, and
/// `gelu`'s gradient (`gelu_backward` is an op of `Amp` there). On Flex `tanh`'s gradient is
/// burn-autodiff's, `1 - y²` from the half output (as PyTorch's): not checked there.
pub(crate) fn half_elementwise_in_f32<B: Backend>(device: &B::Device, precision: Precision) {
    let xs = inputs();
    let dtype = low(precision);
    let flex = core::any::TypeId::of::<B>() == core::any::TypeId::of::<Flex>();
    fn check<A: AutodiffBackend>(
        device: &A::Device,
        xs: &[f32],
        dtype: DType,
        precision: Precision,
        layout: &str,
        grads: &[&str],
    ) {
        for (name, op) in ops::<A>() {
            let (y, grad) = run::<A>(device, op, xs, dtype, false, precision);
            let (want_y, want_grad) = run::<A>(device, op, xs, dtype, true, precision);
            let (steps, x, got, want) = worst_steps(&y, &want_y, xs, dtype);
            assert!(
                steps <= 1.0,
                "{name} at {precision:?}, {layout}: {steps} steps off at x = {x} ({got}, want {want})"
            );
            if grads.contains(&name) {
                let (steps, x, got, want) = worst_steps(&grad, &want_grad, xs, dtype);
                assert!(
                    steps <= 2.0,
                    "{name}'s gradient at {precision:?}, {layout}: {steps} steps off at x = {x} \
                     ({got}, want {want})"
                );
            }
        }
    }
    let above: &[&str] = if flex {
        &["gelu", "asinh"]
    } else {
        &["gelu", "tanh", "asinh"]
    };
    check::<Amp<Autodiff<B>>>(device, &xs, dtype, precision, "above autodiff", above);
    check::<Autodiff<Amp<B>>>(device, &xs, dtype, precision, "below autodiff", &["gelu"]);
}

flex_and_wgpu_tests!(half_elementwise_in_f32:
    half_elementwise_in_f32_flex_f16, half_elementwise_in_f32_flex_bf16, half_elementwise_in_f32_wgpu);

/// Plain wgpu in f16: `gelu`'s tail and `tanh` near 0, hundreds of steps off.
#[test]
fn half_elementwise_canaries_wgpu() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    let xs = inputs();
    for (name, op) in ops::<Autodiff<Wgpu>>().into_iter().take(2) {
        let (y, _) = run::<Autodiff<Wgpu>>(&device, op, &xs, DType::F16, false, Precision::F32);
        let (want, _) = run::<Autodiff<Wgpu>>(&device, op, &xs, DType::F16, true, Precision::F32);
        let (steps, ..) = worst_steps(&y, &want, &xs, DType::F16);
        assert!(
            steps > 100.0,
            "plain wgpu's f16 {name}: {steps} steps off at most"
        );
    }
}

/// `erf` in f64: its Maclaurin series below 3, the continued fraction of `erfc` above.
fn erf_f64(x: f64) -> f64 {
    if x.abs() < 3.0 {
        let (mut sum, mut term, mut n) = (0.0, x, 0.0);
        loop {
            let add = term / (2.0 * n + 1.0);
            sum += add;
            if add.abs() <= 1e-17 * sum.abs() {
                break;
            }
            n += 1.0;
            term *= -x * x / n;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        let z = x.abs();
        let fraction = (1..60).rev().fold(0.0, |f, k| (k as f64 / 2.0) / (z + f));
        let erfc = (-z * z).exp() / std::f64::consts::PI.sqrt() / (z + fraction);
        x.signum() * (1.0 - erfc)
    }
}

/// The largest absolute error of `gelu`'s gradient against its derivative `Φ(x) + x · φ(x)` in
/// f64, over 4001 f32 inputs in [-6, 6].
fn gelu_gradient_error<A: AutodiffBackend>(device: &A::Device) -> f32 {
    let xs: Vec<f32> = (0..=4000)
        .map(|i| -6.0 + 12.0 * i as f32 / 4000.0)
        .collect();
    let x =
        Tensor::<A, 1>::from_data(TensorData::new(xs.clone(), [xs.len()]), device).require_grad();
    let grad = values(
        x.grad(&gelu(x.clone()).sum().backward())
            .expect("x's gradient"),
    );
    xs.iter()
        .zip(grad)
        .map(|(&x, got)| {
            let x = x as f64;
            let cdf = 0.5 * (1.0 + erf_f64(x * std::f64::consts::FRAC_1_SQRT_2));
            let density = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            (got as f64 - (cdf + x * density)).abs() as f32
        })
        .fold(0.0, f32::max)
}

/// `gelu`'s gradient in f32 is its derivative (within 1e-6 of the f64 one; 2.4e-7 measured on
/// wgpu), under `Amp` above and below autodiff. Burn 0.21's `gelu_backward` outside Flex is
/// the tanh approximation's derivative: returns plain autodiff's error (a canary).
pub(crate) fn gelu_gradient_is_exact<B: Backend>(device: &B::Device) -> f32 {
    let _f32 = autocast(Precision::F32);
    for (stack, error) in [
        ("above", gelu_gradient_error::<Amp<Autodiff<B>>>(device)),
        ("below", gelu_gradient_error::<Autodiff<Amp<B>>>(device)),
    ] {
        assert!(
            error <= 1e-6,
            "gelu's gradient, Amp {stack} autodiff: {error:e} from its derivative"
        );
    }
    gelu_gradient_error::<Autodiff<B>>(device)
}

#[test]
fn gelu_gradient_is_exact_flex() {
    let plain = gelu_gradient_is_exact::<Flex>(&Default::default());
    assert!(plain <= 1e-6, "plain Flex: {plain:e}");
}

#[test]
fn gelu_gradient_is_exact_wgpu() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    let plain = gelu_gradient_is_exact::<Wgpu>(&device);
    assert!(
        plain > 5e-4,
        "plain wgpu's gelu gradient: {plain:e} off, no longer the canary"
    );
}
