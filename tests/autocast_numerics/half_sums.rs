//! Matmuls and convolutions lowered to half precision sum their products in f32, as cuBLAS
//! and cuDNN do (`src/backend/workarounds/half_sums.rs`): wgpu's direct convolution and
//! Flex's f16 `gemm` sum in f16, where a sum stops growing once its terms fall below half an
//! f16 step (`0.25 + 0.25 + ...` stalls at 512). Under `Amp`, forward and backward, the
//! results are those of an f32 sum of the half inputs; the plain backends' stalls are
//! canaries.

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::module::{self, conv_transpose2d, conv1d, conv2d};
use burn::tensor::ops::{ConvOptions, ConvTransposeOptions};
use burn::tensor::{TensorData, backend::AutodiffBackend};
use burn_amp::{Amp, autocast};

// The allocator's counts: this test binary's (the GPU check compiles the checks alone).
#[cfg(test)]
use super::probabilities::live_bytes;
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
/// matmuls with one row, one column, and a long inner dimension; with biases, batch dimensions
/// a matmul operand broadcasts along, and inputs autodiff does not track (a data batch, a
/// frozen weight). Each within `tol` (the f16 rounding of inputs and results: 2e-4 to 4.4e-4
/// measured; summed in f16, 3.5e-3 to 7.2e-2).
pub(crate) fn against_f32<B: Backend>(device: &B::Device, precision: Precision, tol: f32) {
    cases::<Amp<Autodiff<B>>>(device, precision, tol, "above autodiff");
    cases::<Autodiff<Amp<B>>>(device, precision, tol, "below autodiff");
}

/// Which inputs are trained: all; all but the first (a data batch); all but the second (a
/// frozen weight).
const ALL: [bool; 3] = [true; 3];
const DATA: [bool; 3] = [false, true, true];
const FROZEN: [bool; 3] = [true, false, true];

fn cases<A: AutodiffBackend>(device: &A::Device, precision: Precision, tol: f32, layout: &str) {
    let at = At {
        precision,
        tol,
        layout,
    };
    let convs = [
        random::<A, 4>([8, 64, 16, 16], device, 1, 0.0),
        random::<A, 4>([64, 64, 3, 3], device, 2, 0.0).div_scalar(8.0),
        random::<A, 4>([64, 32, 3, 3], device, 3, 0.0).div_scalar(8.0),
    ];
    compare(
        &at,
        "conv2d then conv_transpose2d",
        ALL,
        convs,
        |[x, w, wt]| {
            let y = conv2d(
                x.clone(),
                w.clone(),
                None,
                ConvOptions::new([1, 1], [1, 1], [1, 1], 1),
            );
            let options = ConvTransposeOptions::new([2, 2], [1, 1], [1, 1], [1, 1], 1);
            conv_transpose2d(y, wt.clone(), None, options)
        },
    );
    let biased = |channels| {
        [
            random::<A, 4>([8, channels, 16, 16], device, 7, 1.0),
            random::<A, 4>([channels, channels, 3, 3], device, 8, 0.0).div_scalar(8.0),
            random::<A, 4>([1, 1, 1, channels], device, 9, 0.0),
        ]
    };
    compare(
        &at,
        "conv2d with a bias, of a data batch",
        DATA,
        biased(32),
        |[x, w, b]| {
            let options = ConvOptions::new([1, 1], [1, 1], [1, 1], 1);
            conv2d(x.clone(), w.clone(), Some(b.clone().flatten(0, 3)), options)
        },
    );
    compare(
        &at,
        "a frozen conv_transpose2d with a bias",
        FROZEN,
        biased(16),
        |[x, w, b]| {
            let options = ConvTransposeOptions::new([2, 2], [1, 1], [1, 1], [1, 1], 1);
            conv_transpose2d(x.clone(), w.clone(), Some(b.clone().flatten(0, 3)), options)
        },
    );

    // Offset 1: terms of one sign, as a sum of activations after a ReLU. Batch dimensions:
    // one weight for 4 inputs, one input for 4 weights.
    let product = |[x, w, c]: &[Tensor<A, 3>; 3]| x.clone().matmul(w.clone()) + c.clone();
    for (bx, bw, m, k, n) in [
        (1, 1, 1, 4096, 64),
        (1, 1, 4096, 64, 1),
        (1, 1, 64, 16384, 64),
        (4, 1, 16, 2048, 8),
        (1, 4, 16, 2048, 8),
    ] {
        let inputs = [
            random::<A, 3>([bx, m, k], device, 4, 1.0),
            random::<A, 3>([bw, k, n], device, 5, 1.0).div_scalar(16.0),
            random::<A, 3>([bx.max(bw), m, n], device, 6, 0.0),
        ];
        let what = format!("[{bx}, {m}, {k}] @ [{bw}, {k}, {n}] + c");
        compare(&at, &what, ALL, inputs, product);
    }
    // `linear` (burn-nn's `Linear`): its weight `[d_in, d_out]`, its bias's gradient a sum
    // over the batch.
    let inputs = |batch: usize, d_in: usize, d_out: usize| {
        [
            random::<A, 3>([1, batch, d_in], device, 16, 1.0),
            random::<A, 3>([1, d_in, d_out], device, 17, 1.0).div_scalar(16.0),
            random::<A, 3>([1, 1, d_out], device, 18, 0.0),
        ]
    };
    let linear = |[x, w, b]: &[Tensor<A, 3>; 3]| {
        let weight = w.clone().squeeze_dim::<2>(0);
        module::linear(x.clone(), weight, Some(b.clone().flatten(0, 2)))
    };
    compare(
        &at,
        "linear of a data batch",
        DATA,
        inputs(4096, 256, 8),
        linear,
    );
    compare(
        &at,
        "a frozen linear of a row",
        FROZEN,
        inputs(1, 4096, 64),
        linear,
    );
}

fn run<A: AutodiffBackend, const D: usize>(
    precision: Precision,
    trained: [bool; 3],
    inputs: [Tensor<A, D>; 3],
    op: impl Fn(&[Tensor<A, D>; 3]) -> Tensor<A, D>,
) -> Vec<Vec<f32>> {
    let _autocast = autocast(precision);
    let inputs: [_; 3] = core::array::from_fn(|i| match trained[i] {
        true => inputs[i].clone().require_grad(),
        false => inputs[i].clone(),
    });
    let out = op(&inputs);
    let grads = out.clone().sum().backward();
    let mut all = vec![values(out)];
    for (t, trained) in inputs.iter().zip(trained) {
        let grad = t.grad(&grads);
        assert_eq!(
            grad.is_some(),
            trained,
            "a gradient exactly for each trained input"
        );
        all.extend(grad.map(values));
    }
    all
}

/// Where [`cases`] compares: the precision, the tolerance, the layout (`Amp` above or below
/// autodiff).
struct At<'a> {
    precision: Precision,
    tol: f32,
    layout: &'a str,
}

fn compare<A: AutodiffBackend, const D: usize>(
    at: &At,
    what: &str,
    trained: [bool; 3],
    inputs: [Tensor<A, D>; 3],
    op: impl Fn(&[Tensor<A, D>; 3]) -> Tensor<A, D>,
) {
    let At {
        precision,
        tol,
        layout,
    } = *at;
    let want = run(Precision::F32, trained, inputs.clone(), &op);
    let got = run(precision, trained, inputs, &op);
    let names = [
        "input 0's gradient",
        "input 1's gradient",
        "input 2's gradient",
    ];
    let names = core::iter::once("output").chain((0..3).filter(|&i| trained[i]).map(|i| names[i]));
    for (name, (g, w)) in names.zip(got.iter().zip(&want)) {
        let err = rel_l2(g, w);
        assert!(
            within(err, tol),
            "{what}, {layout}, at {precision:?}, {name}: relative L2 error {err:.3e} > {tol:.1e}"
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

/// What an op summed in f32 keeps for its backward is the half input it was given, tracked or
/// not (no f32 copy): beyond its output, nothing new, as Burn's own node keeps (Flex f16,
/// `Amp<Autodiff<Flex>>`, counting allocator). An f32 copy would be 2 bytes per byte of the
/// half input.
#[test]
fn summed_ops_keep_their_half_inputs() {
    type A = Amp<Autodiff<Flex>>;
    /// `op` of half leaves of these shapes, `x` trained and the weight frozen or the
    /// reverse: the bytes it leaves alive beyond its output, per byte of the untracked input.
    fn kept(
        x_trained: bool,
        x: [usize; 4],
        w: [usize; 4],
        op: fn(Tensor<A, 4>, Tensor<A, 4>) -> Tensor<A, 4>,
    ) -> f64 {
        let device = Default::default();
        let half = |shape: [usize; 4], seed, trained: bool| {
            let t = random::<A, 4>(shape, &device, seed, 0.0).cast(DType::F16);
            if trained { t.require_grad() } else { t }
        };
        let (x, w) = (half(x, 19, x_trained), half(w, 20, !x_trained));
        let untracked = if x_trained { &w } else { &x };
        let untracked_bytes = untracked.shape().num_elements() * 2;
        let before = live_bytes();
        let out = op(x.clone(), w.clone());
        let out_bytes = out.shape().num_elements() * 2;
        let kept = live_bytes() - before - out_bytes as isize;
        kept as f64 / untracked_bytes as f64
    }
    let _autocast = autocast(Precision::F16);
    let conv = |x, w| conv2d(x, w, None, ConvOptions::new([1, 1], [1, 1], [1, 1], 1));
    for (what, x_trained, x, w, op) in [
        (
            "matmul of a data batch",
            false,
            [1, 1, 512, 1024],
            [1, 1, 1024, 64],
            (|x: Tensor<A, 4>, w| x.matmul(w)) as fn(_, _) -> _,
        ),
        (
            "a frozen linear's weight",
            true,
            [1, 1, 16, 1024],
            [1, 1, 1024, 1024],
            |x, w: Tensor<A, 4>| module::linear(x, w.squeeze_dims::<2>(&[0, 1]), None),
        ),
        (
            "conv2d of a data batch",
            false,
            [8, 32, 32, 32],
            [16, 32, 3, 3],
            conv,
        ),
    ] {
        // Warm-up: the thread's first ops allocate their lazily built state.
        kept(x_trained, x, w, op);
        let per_byte = kept(x_trained, x, w, op);
        eprintln!(
            "{what}: {per_byte:.3} bytes kept beyond the output per byte of the untracked input"
        );
        assert!(
            per_byte.abs() < 0.05,
            "{what}: {per_byte:.3} bytes kept beyond the output per byte of the untracked half \
             input (an f32 copy: 2)"
        );
    }
}

/// A summed op's node holds its inputs' handles until it is registered: burn-autodiff 0.21
/// frees a graph none of whose tensors is held from a backward on any thread, and with it the
/// step of a parent (here the bias's cast) whose handle went early, whose gradient was then
/// lost. Every step of a linear layer of a data batch, beside another thread's backwards,
/// gives the bias its gradient, and the same one.
#[test]
fn summed_ops_keep_their_gradients_beside_other_threads_backwards() {
    type A = Amp<Autodiff<Flex>>;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let noise = {
        let done = done.clone();
        std::thread::spawn(move || {
            let device = Default::default();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let a = Tensor::<Autodiff<Flex>, 2>::from_data([[1.0, 2.0], [3.0, 4.0]], &device)
                    .require_grad();
                let grads = a.clone().matmul(a.clone()).sum().backward();
                assert!(a.grad(&grads).is_some());
            }
        })
    };
    let device = Default::default();
    let _autocast = autocast(Precision::F16);
    let x = random::<A, 2>([64, 256], &device, 21, 0.0);
    let w = random::<A, 2>([256, 16], &device, 22, 0.0).require_grad();
    let b = random::<A, 1>([16], &device, 23, 0.0).require_grad();
    let mut first = None;
    for step in 0..200 {
        let grads = module::linear(x.clone(), w.clone(), Some(b.clone()))
            .sum()
            .backward();
        let bias = b.grad(&grads).map(values);
        let first = first.get_or_insert_with(|| bias.clone());
        assert!(bias.is_some(), "step {step}: the bias has no gradient");
        assert_eq!(&bias, first, "step {step}: the bias's gradient changed");
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    noise.join().expect("the other thread's backwards");
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
