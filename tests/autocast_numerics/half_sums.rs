//! Matmuls and convolutions lowered to half precision sum their products in f32, as cuBLAS
//! and cuDNN do (`src/backend/workarounds/half_sums.rs`): wgpu's direct convolution and
//! Flex's f16 `gemm` sum in f16, where a sum stops growing once its terms fall below half an
//! f16 step (`0.25 + 0.25 + ...` stalls at 512). Under `Amp`, forward and backward, the
//! results are those of an f32 sum of the half inputs; the plain backends' stalls are
//! canaries.

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::module::{conv_transpose2d, conv1d, conv2d};
use burn::tensor::ops::{ConvOptions, ConvTransposeOptions};
use burn::tensor::{TensorData, backend::AutodiffBackend};
use burn_amp::{Amp, autocast};

use super::*;

/// Values in [-1, 1) from the fixed stream of `uniform(seed)`, plus `offset`.
fn random<B: Backend, const D: usize>(
    shape: [usize; D],
    device: &B::Device,
    seed: u64,
    offset: f32,
) -> Tensor<B, D> {
    let mut next = uniform(seed);
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| next() * 2.0 - 1.0 + offset).collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// Sums whose terms are exact in half precision and whose results are: 4096 terms of 0.25
/// give 1024, which a half sum leaves at 512. Over input channels (a convolution, a matmul
/// of one row), and over a batch and a map (a convolution's weight gradient, a one-column
/// matmul's).
pub(crate) fn exact_sums<B: Backend>(device: &B::Device, precision: Precision) {
    type A<B> = Amp<Autodiff<B>>;
    let _autocast = autocast(precision);
    let full = |shape: Vec<usize>, value: f32| {
        let n = shape.iter().product();
        TensorData::new(vec![value; n], shape)
    };
    let conv = |x: Tensor<A<B>, 3>, w: Tensor<A<B>, 3>| {
        conv1d(x, w, None, ConvOptions::new([1], [0], [1], 1))
    };
    let x = Tensor::<A<B>, 3>::from_data(full(vec![1, 4096, 4], 0.25), device);
    let w = Tensor::<A<B>, 3>::from_data(full(vec![2, 4096, 1], 1.0), device);
    let channels = values(conv(x, w));
    let x = Tensor::<A<B>, 3>::from_data(full(vec![16, 1, 256], 0.25), device);
    let w = Tensor::<A<B>, 3>::from_data(full(vec![1, 1, 1], 1.0), device).require_grad();
    let weight_grad = values(
        w.grad(&conv(x, w.clone()).sum().backward())
            .expect("w's gradient"),
    );
    let row = Tensor::<A<B>, 2>::from_data(full(vec![1, 4096], 0.25), device);
    let w = Tensor::<A<B>, 2>::from_data(full(vec![4096, 8], 1.0), device);
    let one_row = values(row.matmul(w));
    let x = Tensor::<A<B>, 2>::from_data(full(vec![4096, 8], 0.25), device);
    let w = Tensor::<A<B>, 2>::from_data(full(vec![8, 1], 1.0), device).require_grad();
    let one_column = values(
        w.grad(&x.matmul(w.clone()).sum().backward())
            .expect("w's gradient"),
    );
    // Below autodiff, on half leaves (weights stored in f16): the backward kernels, which
    // promote to f32 when a weight is f32.
    type Below<B> = Autodiff<Amp<B>>;
    let half = |shape: Vec<usize>, value: f32| {
        Tensor::<Below<B>, 3>::from_data(full(shape, value), device)
            .cast(low(precision))
            .require_grad()
    };
    let (x, w) = (half(vec![16, 1, 256], 0.25), half(vec![4096, 1, 1], 0.25));
    // The cast's backward gives the convolution a half gradient.
    let grads = conv1d(
        x.clone(),
        w.clone(),
        None,
        ConvOptions::new([1], [0], [1], 1),
    )
    .cast(DType::F32)
    .sum()
    .backward();
    let below_x = values(x.grad(&grads).expect("x's gradient"));
    let below_w = values(w.grad(&grads).expect("w's gradient"));
    for (what, got) in [
        ("conv1d over 4096 channels", channels),
        (
            "below autodiff, conv1d's input gradient over 4096 channels",
            below_x,
        ),
        (
            "below autodiff, conv1d's weight gradient over 16 × 256",
            below_w,
        ),
        ("conv1d's weight gradient over 16 × 256", weight_grad),
        ("[1, 4096] @ [4096, 8]", one_row),
        ("the weight gradient of [4096, 8] @ [8, 1]", one_column),
    ] {
        let wrong: Vec<f32> = got.iter().copied().filter(|v| *v != 1024.0).collect();
        assert!(
            wrong.is_empty(),
            "{what} at {precision:?}: {} of {} values wrong, the first {:?}, want 1024 (a sum \
             in half precision stalls at 512)",
            wrong.len(),
            got.len(),
            wrong[0]
        );
    }
}

/// Relative L2 errors against an f32 run: forward, weight gradient and input gradient of a
/// 3×3 convolution (64 → 64 channels, batch 8 of 16×16) followed by a transposed one, and of
/// matmuls with one row, one column, and a long inner dimension. Each within `tol` (the f16
/// rounding of inputs and results: 2e-4 to 4.4e-4 measured; summed in f16, 3.5e-3 to 7.2e-2).
pub(crate) fn against_f32<B: Backend>(device: &B::Device, precision: Precision, tol: f32) {
    cases::<Amp<Autodiff<B>>>(device, precision, tol, "above autodiff");
    cases::<Autodiff<Amp<B>>>(device, precision, tol, "below autodiff");
}

fn cases<A: AutodiffBackend>(device: &A::Device, precision: Precision, tol: f32, layout: &str) {
    let convs = [
        random::<A, 4>([8, 64, 16, 16], device, 1, 0.0),
        random::<A, 4>([64, 64, 3, 3], device, 2, 0.0).div_scalar(8.0),
        random::<A, 4>([64, 32, 3, 3], device, 3, 0.0).div_scalar(8.0),
    ];
    let what = format!("conv2d then conv_transpose2d, {layout}");
    compare(&what, precision, tol, convs, |[x, w, wt]| {
        let y = conv2d(
            x.clone(),
            w.clone(),
            None,
            ConvOptions::new([1, 1], [1, 1], [1, 1], 1),
        );
        let options = ConvTransposeOptions::new([2, 2], [1, 1], [1, 1], [1, 1], 1);
        conv_transpose2d(y, wt.clone(), None, options)
    });
    // Offset 1: terms of one sign, as a sum of activations after a ReLU.
    for (m, k, n) in [(1, 4096, 64), (4096, 64, 1), (64, 16384, 64)] {
        let inputs = [
            random::<A, 2>([m, k], device, 4, 1.0),
            random::<A, 2>([k, n], device, 5, 1.0).div_scalar(16.0),
            random::<A, 2>([m, n], device, 6, 0.0),
        ];
        let what = format!("[{m}, {k}] @ [{k}, {n}] + c, {layout}");
        compare(&what, precision, tol, inputs, |[x, w, c]| {
            x.clone().matmul(w.clone()) + c.clone()
        });
    }
}

fn run<A: AutodiffBackend, const D: usize>(
    precision: Precision,
    inputs: [Tensor<A, D>; 3],
    op: impl Fn(&[Tensor<A, D>; 3]) -> Tensor<A, D>,
) -> Vec<Vec<f32>> {
    let _autocast = autocast(precision);
    let inputs = inputs.map(|t| t.require_grad());
    let out = op(&inputs);
    let grads = out.clone().sum().backward();
    let mut all = vec![values(out)];
    all.extend(
        inputs
            .iter()
            .map(|t| values(t.grad(&grads).expect("a gradient"))),
    );
    all
}

fn compare<A: AutodiffBackend, const D: usize>(
    what: &str,
    precision: Precision,
    tol: f32,
    inputs: [Tensor<A, D>; 3],
    op: impl Fn(&[Tensor<A, D>; 3]) -> Tensor<A, D>,
) {
    let want = run(Precision::F32, inputs.clone(), &op);
    let got = run(precision, inputs, &op);
    let names = [
        "output",
        "input 0's gradient",
        "input 1's gradient",
        "input 2's gradient",
    ];
    for (name, (g, w)) in names.iter().zip(got.iter().zip(&want)) {
        let err = rel_l2(g, w);
        assert!(
            within(err, tol),
            "{what} at {precision:?}, {name}: relative L2 error {err:.3e} > {tol:.1e}"
        );
    }
}

flex_and_wgpu_tests!(exact_sums: exact_sums_flex_f16, exact_sums_flex_bf16, exact_sums_wgpu);

#[test]
fn against_f32_flex_f16() {
    against_f32::<Flex>(&Default::default(), Precision::F16, 1e-3);
}

#[test]
fn against_f32_flex_bf16() {
    against_f32::<Flex>(&Default::default(), Precision::Bf16, 8e-3);
}

#[test]
fn against_f32_wgpu() {
    if let Some(device) = common::wgpu_device() {
        against_f32::<Wgpu>(&device, Precision::F16, 1e-3);
    }
}

/// The plain backends: wgpu's f16 convolution and Flex's f16 matmul of one row sum in f16.
#[test]
fn half_sums_canaries() {
    fn stalls<B: Backend>(device: &B::Device) -> (f32, f32) {
        let half = |shape: [usize; 3], value: f32| {
            let n = shape.iter().product();
            Tensor::<B, 3>::from_data(TensorData::new(vec![value; n], shape), device)
                .cast(DType::F16)
        };
        let conv = conv1d(
            half([1, 4096, 1], 0.25),
            half([1, 4096, 1], 1.0),
            None,
            ConvOptions::new([1], [0], [1], 1),
        );
        let row = half([1, 1, 4096], 0.25).reshape([1, 4096]);
        let matmul = row.matmul(half([1, 4096, 8], 1.0).reshape([4096, 8]));
        (values(conv)[0], values(matmul)[0])
    }
    let (_, flex_row) = stalls::<Flex>(&Default::default());
    assert_eq!(flex_row, 512.0, "Flex's f16 [1, 4096] @ [4096, 8]");
    if let Some(device) = common::wgpu_device() {
        let (wgpu_conv, wgpu_row) = stalls::<Wgpu>(&device);
        assert_eq!(wgpu_conv, 512.0, "wgpu's f16 conv1d over 4096 channels");
        assert_eq!(wgpu_row, 1024.0, "wgpu's f16 matmul sums in f32");
    }
}
