//! Numerics of autocast against f32 references, where half precision breaks results outright:
//! average pooling over large windows, deformable convolution at large coordinates, the
//! softmax of attention under autodiff, probabilities (sigmoid) fed to a binary
//! cross-entropy, and an explicit precision the device cannot run.
//!
//! Every comparison states its tolerance; the references run the same values in f32.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::module::Param;
use burn::nn::LinearConfig;
use burn::nn::loss::BinaryCrossEntropyLossConfig;
use burn::tensor::activation::{sigmoid, silu};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData, module};
use burn_amp::{Amp, AmpError, Precision, autocast};
use burn_backend::ops::{AttentionModuleOptions, DeformConvOptions};
use burn_std::DType;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

fn low(precision: Precision) -> DType {
    precision.low_dtype().expect("a low precision").into()
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().to_vec::<f32>().unwrap()
}

/// `|g - r| <= atol + rtol * |r|` for every element, else the first offender.
fn first_mismatch(got: &[f32], want: &[f32], atol: f32, rtol: f32) -> Option<(usize, f32, f32)> {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .enumerate()
        .find(|(_, (g, r))| !within((**g - **r).abs(), atol + rtol * r.abs()))
        .map(|(i, (g, r))| (i, *g, *r))
}

/// `err <= tol`, false for NaN.
fn within(err: f32, tol: f32) -> bool {
    err <= tol
}

/// ‖got − want‖₂ / ‖want‖₂ (NaN and inf count as an error of 1e30).
fn rel_l2(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        let d = (*g as f64 - *w as f64).powi(2);
        num += if d.is_finite() { d } else { 1e60 };
        den += (*w as f64).powi(2);
    }
    (num.sqrt() / den.sqrt().max(1e-30)) as f32
}

/// A fixed pseudo-random stream in [0, 1).
fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32) / (1u64 << 24) as f32
    }
}

/// Rounds to the bf16 grid (which f16 also holds in this range): the low-precision runs
/// then see exactly the values of the f32 reference, and input rounding is not counted.
fn on_grid(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

fn panic_message(err: Box<dyn std::any::Any + Send>) -> String {
    err.downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// 1. Average pooling accumulates in f32
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Pool {
    /// `avg_pool2d` with one window over the whole map.
    Avg2d,
    /// `adaptive_avg_pool2d` to 1×1.
    Adaptive2d,
    /// `avg_pool1d` with one window over the flattened map.
    Avg1d,
    /// `adaptive_avg_pool1d` to 1.
    Adaptive1d,
}

impl Pool {
    const ALL: [Pool; 4] = [Pool::Avg2d, Pool::Adaptive2d, Pool::Avg1d, Pool::Adaptive1d];

    fn run<X: Backend>(self, x: Tensor<X, 4>) -> Tensor<X, 1> {
        let [n, c, h, w] = x.dims();
        match self {
            Pool::Avg2d => module::avg_pool2d(x, [h, w], [h, w], [0, 0], true, false).flatten(0, 3),
            Pool::Adaptive2d => module::adaptive_avg_pool2d(x, [1, 1]).flatten(0, 3),
            Pool::Avg1d => {
                module::avg_pool1d(x.reshape([n, c, h * w]), h * w, h * w, 0, true, false)
                    .flatten(0, 2)
            }
            Pool::Adaptive1d => {
                module::adaptive_avg_pool1d(x.reshape([n, c, h * w]), 1).flatten(0, 2)
            }
        }
    }
}

/// Maps of ones (f16 stops counting at 2048, bf16 at 256) and of values up to 61 whose sum
/// (about 127,000) is beyond f16's 65,504.
fn pool_inputs() -> Vec<(&'static str, [usize; 4], Vec<f32>)> {
    let ones = |h: usize| vec![1.0f32; 2 * h * h];
    let large: Vec<f32> = (0..2 * 64 * 64)
        .map(|i| 1.0 + (i % 13) as f32 * 5.0)
        .collect();
    vec![
        ("56x56 ones", [1, 2, 56, 56], ones(56)),
        ("64x64 ones", [1, 2, 64, 64], ones(64)),
        ("64x64 values 1..61 (sum > 65504)", [1, 2, 64, 64], large),
    ]
}

/// Average pooling of a low-precision activation through `Amp<B>`: f32 out, and the f32
/// values. Inputs are small integers, exact in f16 and bf16, so the reference (the same
/// backend in f32) sees the same values; tolerance 1e-5 absolute + 1e-5 relative.
fn pooling_matches_f32<B: Backend>(device: &B::Device, precision: Precision) {
    let mut failures = Vec::new();
    for (name, dims, data) in pool_inputs() {
        let x = Tensor::<B, 4>::from_data(TensorData::new(data, dims), device);
        for pool in Pool::ALL {
            let reference = values(pool.run(x.clone()));
            let xa = Tensor::<Amp<B>, 4>::from_data(x.to_data(), device).cast(low(precision));
            let out = {
                let _g = autocast(precision);
                pool.run(xa)
            };
            let dtype = out.dtype();
            let got = values(out);
            if dtype != DType::F32 {
                failures.push(format!(
                    "{pool:?} on {name}: output {dtype:?}, expected F32 (values {got:?}, f32 {reference:?})"
                ));
            } else if let Some((i, g, r)) = first_mismatch(&got, &reference, 1e-5, 1e-5) {
                failures.push(format!("{pool:?} on {name}: {g} at {i}, f32 reference {r}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "average pooling under {precision}:\n{}",
        failures.join("\n")
    );
}

#[test]
fn average_pooling_accumulates_in_f32_flex_f16() {
    pooling_matches_f32::<Flex>(&Default::default(), Precision::F16);
}

#[test]
fn average_pooling_accumulates_in_f32_flex_bf16() {
    pooling_matches_f32::<Flex>(&Default::default(), Precision::Bf16);
}

#[test]
fn average_pooling_accumulates_in_f32_wgpu_f16() {
    if let Some(device) = common::wgpu_device() {
        pooling_matches_f32::<Wgpu>(&device, Precision::F16);
    }
}

/// Forward and backward of the pooling ops on a training stack: an f32 parameter cast to the
/// low dtype (an activation), pooled, weighted per channel by (3, -2) and summed. The f32
/// output and the gradient 3/4096 and -2/4096 (exact in f16 and bf16) must come out, with
/// no panic on the mixed dtypes the backward meets.
fn pooling_backward<A: AutodiffBackend>(precision: Precision) {
    let device = Default::default();
    let (h, w) = (64, 64);
    for pool in Pool::ALL {
        let x = Tensor::<A, 4>::ones([1, 2, h, w], &device).require_grad();
        let weights = Tensor::<A, 1>::from_floats([3.0, -2.0], &device);
        let loss = {
            let _g = autocast(precision);
            let y = pool.run(x.clone().cast(low(precision)));
            assert_eq!(y.dtype(), DType::F32, "{pool:?}: output dtype");
            let got = values(y.clone());
            assert!(
                first_mismatch(&got, &[1.0, 1.0], 1e-6, 0.0).is_none(),
                "{pool:?}: mean of 64x64 ones is {got:?}"
            );
            (y * weights).sum()
        };
        let grads = loss.backward();
        let grad = x.grad(&grads).expect("x has a gradient");
        assert_eq!(
            grad.dtype(),
            DType::F32,
            "{pool:?}: an f32 parameter gets an f32 gradient"
        );
        let got = values(grad);
        let want: Vec<f32> = (0..2 * h * w)
            .map(|i| if i < h * w { 3.0 } else { -2.0 } / (h * w) as f32)
            .collect();
        if let Some((i, g, r)) = first_mismatch(&got, &want, 1e-9, 1e-6) {
            panic!("{pool:?} under {precision}: gradient {g} at {i}, expected {r}");
        }
    }
}

#[test]
fn average_pooling_backward_amp_over_autodiff() {
    pooling_backward::<Amp<Autodiff<Flex>>>(Precision::F16);
    pooling_backward::<Amp<Autodiff<Flex>>>(Precision::Bf16);
}

#[test]
fn average_pooling_backward_autodiff_over_amp() {
    pooling_backward::<Autodiff<Amp<Flex>>>(Precision::F16);
    pooling_backward::<Autodiff<Amp<Flex>>>(Precision::Bf16);
}

// ---------------------------------------------------------------------------------------
// 2. Deformable convolution runs in f32
// ---------------------------------------------------------------------------------------

/// A 1×1024 row of 0, 1, 0, 1, ... sampled by a 1×1 deformable convolution (weight 1) at four
/// positions with stride 300: base 0 with offset 600.25, base 300 + 0.25, base 600 + 0.25,
/// base 900 + 0.75. The bilinear samples are 0.25, 0.25, 0.25 and 0.75. In f16 an offset of
/// 600.25 (or a coordinate 600.25 formed in the kernel's element type) rounds to 600 and the
/// sample to 0; in bf16 already above 64. Tolerance: 1e-5 (computed in f32).
fn deform_conv_matches_f32<B: Backend>(device: &B::Device, precision: Precision) {
    let width = 1024;
    let row: Vec<f32> = (0..width).map(|i| (i % 2) as f32).collect();
    let x = Tensor::<B, 4>::from_data(TensorData::new(row, [1, 1, 1, width]), device);
    // Offsets [batch, 2 * kh * kw, out_h, out_w]: channel 0 is dy, channel 1 is dx.
    let offsets = vec![0.0f32, 0.0, 0.0, 0.0, 600.25, 0.25, 0.25, 0.75];
    let offset = Tensor::<B, 4>::from_data(TensorData::new(offsets, [1, 2, 1, 4]), device);
    let weight = Tensor::<B, 4>::ones([1, 1, 1, 1], device);
    let options = DeformConvOptions::new([1, 300], [0, 0], [1, 1], 1, 1);

    let reference = values(module::deform_conv2d(
        x.clone(),
        offset.clone(),
        weight.clone(),
        None,
        None,
        options.clone(),
    ));
    assert_eq!(
        reference,
        vec![0.25, 0.25, 0.25, 0.75],
        "the f32 reference itself"
    );

    // The image is an activation in the low dtype; offsets and weight are f32 (parameters or
    // an f32 computation).
    let xa = Tensor::<Amp<B>, 4>::from_data(x.to_data(), device).cast(low(precision));
    let offset = Tensor::<Amp<B>, 4>::from_data(offset.to_data(), device);
    let weight = Tensor::<Amp<B>, 4>::from_data(weight.to_data(), device);
    let out = {
        let _g = autocast(precision);
        module::deform_conv2d(xa, offset, weight, None, None, options)
    };
    let dtype = out.dtype();
    let got = values(out);
    assert!(
        dtype == DType::F32 && first_mismatch(&got, &reference, 1e-5, 0.0).is_none(),
        "deform_conv2d under {precision}: {dtype:?} {got:?}, f32 reference {reference:?}"
    );
}

#[test]
fn deform_conv2d_runs_in_f32_flex_f16() {
    deform_conv_matches_f32::<Flex>(&Default::default(), Precision::F16);
}

#[test]
fn deform_conv2d_runs_in_f32_flex_bf16() {
    deform_conv_matches_f32::<Flex>(&Default::default(), Precision::Bf16);
}

#[test]
fn deform_conv2d_runs_in_f32_wgpu_f16() {
    if let Some(device) = common::wgpu_device() {
        deform_conv_matches_f32::<Wgpu>(&device, Precision::F16);
    }
}

// ---------------------------------------------------------------------------------------
// 3. Attention under autodiff: softmax in f32, matmuls in the low dtype
// ---------------------------------------------------------------------------------------

struct AttnData {
    shape_q: [usize; 4],
    shape_kv: [usize; 4],
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Weights of the loss `sum(out * r)`: varied upstream gradients.
    r: Vec<f32>,
    /// Which of dq, dk, dv have a meaningful f32 reference.
    grads: [bool; 3],
}

struct AttnResult {
    out_dtype: DType,
    grad_dtypes: [DType; 3],
    out: Vec<f32>,
    /// dq, dk, dv.
    grads: [Vec<f32>; 3],
}

/// Large logits over a long, flat sequence: 8 queries, 1024 keys, head dim 16, scores
/// q·k/4 = 16 ± 0.3, so that hundreds of keys share the softmax (its sum S > 256, checked:
/// S² overflows f16 in the backward of the division), and values 10 ± 1 (a common part: the
/// softmax backward subtracts nearly equal numbers, which half precision loses).
fn large_logits() -> AttnData {
    let (sq, sk, d) = (8, 1024, 16);
    let mut u = uniform(7);
    let q = (0..sq * d).map(|_| on_grid(0.9 + 0.2 * u())).collect();
    let k = (0..sk * d).map(|_| on_grid(3.5 + u())).collect();
    let v = (0..sk * d).map(|_| on_grid(9.0 + 2.0 * u())).collect();
    let r = (0..sq * d).map(|_| on_grid(2.0 * u() - 1.0)).collect();
    let data = AttnData {
        shape_q: [1, 1, sq, d],
        shape_kv: [1, 1, sk, d],
        q,
        k,
        v,
        r,
        grads: [true; 3],
    };
    for i in 0..sq {
        let scores: Vec<f32> = (0..sk)
            .map(|j| {
                (0..d)
                    .map(|m| data.q[i * d + m] * data.k[j * d + m])
                    .sum::<f32>()
                    / 4.0
            })
            .collect();
        let max = scores.iter().copied().fold(f32::MIN, f32::max);
        let sum: f32 = scores.iter().map(|s| (s - max).exp()).sum();
        assert!(
            max > 15.0 && sum > 256.0,
            "query {i}: max score {max}, softmax sum {sum}"
        );
    }
    data
}

/// 70,000 keys with equal scores: the softmax sum (70,000) is beyond f16's 65,504. With all
/// scores equal dq and dk are zero up to rounding: only the output and dv are compared.
fn long_flat() -> AttnData {
    let (sq, sk, d) = (2, 70_000, 4);
    let mut u = uniform(11);
    let q = vec![0.5; sq * d];
    let k = vec![1.0; sk * d];
    let v = (0..sk * d).map(|_| on_grid(0.5 + u())).collect();
    let r = (0..sq * d).map(|_| on_grid(2.0 * u() - 1.0)).collect();
    AttnData {
        shape_q: [1, 1, sq, d],
        shape_kv: [1, 1, sk, d],
        q,
        k,
        v,
        r,
        grads: [false, false, true],
    }
}

fn attention_run<X: AutodiffBackend>(data: &AttnData, precision: Option<Precision>) -> AttnResult {
    let device = Default::default();
    let t = |v: &Vec<f32>, s: [usize; 4]| {
        Tensor::<X, 4>::from_data(TensorData::new(v.clone(), s), &device)
    };
    let q = t(&data.q, data.shape_q).require_grad();
    let k = t(&data.k, data.shape_kv).require_grad();
    let v = t(&data.v, data.shape_kv).require_grad();
    let r = t(&data.r, data.shape_q);
    let guard = precision.map(autocast);
    let out = module::attention(
        q.clone(),
        k.clone(),
        v.clone(),
        None,
        None,
        AttentionModuleOptions::default(),
    );
    let out_dtype = out.dtype();
    let loss = (out.clone() * r).sum();
    drop(guard);
    let grads = loss.backward();
    let gq = q.grad(&grads).expect("dq");
    let gk = k.grad(&grads).expect("dk");
    let gv = v.grad(&grads).expect("dv");
    AttnResult {
        out_dtype,
        grad_dtypes: [gq.dtype(), gk.dtype(), gv.dtype()],
        out: values(out),
        grads: [values(gq), values(gk), values(gv)],
    }
}

/// Attention on a training stack at `precision` against `Autodiff<Flex>` in f32 on the same
/// values. Tolerances, as relative L2 errors: the output 1e-2 (f16) / 2e-2 (bf16); the
/// gradients 2e-2 (f16) / 1e-1 (bf16). They cover what the lowered matmuls cost by
/// themselves (scores near 16 rounded to f16 move by up to 0.008, to bf16 by up to 0.06,
/// against a spread of 0.3; the gradient of the softmax weights is rounded once): measured
/// 5e-3 (f16) and 5e-2 (bf16) on dq and dk. A softmax in half precision, with its backward,
/// is off by 1e2 to 1e3 (f16) and about 1 (bf16) on the same gradients.
fn attention_matches_f32<A: AutodiffBackend>(
    data: &AttnData,
    precision: Precision,
    check_grads: bool,
) -> Vec<String> {
    let reference = attention_run::<Autodiff<Flex>>(data, None);
    let amp = attention_run::<A>(data, Some(precision));
    let (tol_out, tol_grad) = match precision {
        Precision::F16 => (1e-2, 2e-2),
        _ => (2e-2, 1e-1),
    };
    let mut failures = Vec::new();
    if amp.out_dtype != low(precision) {
        failures.push(format!(
            "output dtype {:?}, expected {:?}",
            amp.out_dtype,
            low(precision)
        ));
    }
    if check_grads && amp.grad_dtypes != [DType::F32; 3] {
        failures.push(format!(
            "f32 q, k, v got gradients of {:?}",
            amp.grad_dtypes
        ));
    }
    let err = rel_l2(&amp.out, &reference.out);
    eprintln!(
        "  {} {precision}: output rel. L2 error {err:.2e}",
        std::any::type_name::<A>()
    );
    if !within(err, tol_out) {
        failures.push(format!(
            "output: rel. L2 error {err:.3e} > {tol_out:e} (first values {:?}, f32 {:?})",
            &amp.out[..4],
            &reference.out[..4]
        ));
    }
    for (name, got, want) in ["dq", "dk", "dv"]
        .iter()
        .zip(&amp.grads)
        .zip(&reference.grads)
        .zip(data.grads)
        .filter(|(_, compared)| *compared)
        .map(|(((n, g), w), _)| (n, g, w))
    {
        let err = rel_l2(got, want);
        eprintln!("  {name}: rel. L2 error {err:.2e}");
        if check_grads && !within(err, tol_grad) {
            failures.push(format!(
                "{name}: rel. L2 error {err:.3e} > {tol_grad:e} (first values {:?}, f32 {:?})",
                &got[..3],
                &want[..3]
            ));
        }
    }
    failures
}

fn check_attention<A: AutodiffBackend>(precision: Precision, check_grads: bool) {
    let mut failures = Vec::new();
    for (name, data) in [
        ("large logits", large_logits()),
        ("70,000 flat keys", long_flat()),
    ] {
        eprintln!("{name}:");
        for f in attention_matches_f32::<A>(&data, precision, check_grads) {
            failures.push(format!("{name}: {f}"));
        }
    }
    assert!(
        failures.is_empty(),
        "attention on {} under {precision}:\n{}",
        std::any::type_name::<A>(),
        failures.join("\n")
    );
}

#[test]
fn attention_softmax_in_f32_amp_over_autodiff_f16() {
    check_attention::<Amp<Autodiff<Flex>>>(Precision::F16, true);
}

#[test]
fn attention_softmax_in_f32_amp_over_autodiff_bf16() {
    check_attention::<Amp<Autodiff<Flex>>>(Precision::Bf16, true);
}

/// `Autodiff<Amp<B>>`: autodiff composes attention from ops that each pass through `Amp`, so
/// the forward already follows the policy. Its backward runs through `Amp` at the precision
/// in force then and gives the lowered matmuls' gradients in the low dtype (this stack's
/// known gradient-dtype rule), so only the forward is compared here.
#[test]
fn attention_softmax_in_f32_autodiff_over_amp() {
    check_attention::<Autodiff<Amp<Flex>>>(Precision::F16, false);
    check_attention::<Autodiff<Amp<Flex>>>(Precision::Bf16, false);
}

/// Inference (no autodiff): `B::attention` runs on the lowered inputs, its output is in the
/// low dtype and close to f32 (Flex's kernel keeps its softmax in f32).
#[test]
fn attention_inference_keeps_the_backend_kernel() {
    let data = large_logits();
    let device = Default::default();
    let t = |v: &Vec<f32>, s: [usize; 4]| {
        Tensor::<Amp<Flex>, 4>::from_data(TensorData::new(v.clone(), s), &device)
    };
    let run = |q, k, v| module::attention(q, k, v, None, None, AttentionModuleOptions::default());
    let reference = values(run(
        t(&data.q, data.shape_q),
        t(&data.k, data.shape_kv),
        t(&data.v, data.shape_kv),
    ));
    for precision in [Precision::F16, Precision::Bf16] {
        let _g = autocast(precision);
        let out = run(
            t(&data.q, data.shape_q),
            t(&data.k, data.shape_kv),
            t(&data.v, data.shape_kv),
        );
        assert_eq!(out.dtype(), low(precision));
        let err = rel_l2(&values(out), &reference);
        assert!(err <= 2e-2, "{precision}: rel. L2 error {err:e}");
    }
}

// ---------------------------------------------------------------------------------------
// 4. Probabilities: sigmoid in f32
// ---------------------------------------------------------------------------------------

/// A linear layer (exact weights) whose logits are 12, 10, 9, -9, 11, -12, 3 and 8.5, through
/// `sigmoid` and burn-nn's `BinaryCrossEntropyLoss` on probabilities, targets making four of
/// them confidently wrong. Returns the loss, the weight's gradient, and the dtype of p.
fn bce_on_probabilities<X: AutodiffBackend>(
    precision: Option<Precision>,
) -> (f32, Vec<f32>, DType) {
    let device = Default::default();
    let mut linear = LinearConfig::new(4, 1).init::<X>(&device);
    linear.weight = Param::from_tensor(Tensor::from_data(
        TensorData::new(vec![1.0f32, 0.5, 0.25, 2.0], [4, 1]),
        &device,
    ));
    linear.bias = Some(Param::from_tensor(Tensor::from_floats([0.0], &device)));
    let x: Vec<f32> = vec![
        12.0, 0.0, 0.0, 0.0, //
        0.0, 20.0, 0.0, 0.0, //
        0.0, 0.0, 36.0, 0.0, //
        0.0, 0.0, 0.0, -4.5, //
        5.0, 4.0, 8.0, 1.0, //
        -12.0, 0.0, 0.0, 0.0, //
        1.0, 1.0, 2.0, 0.5, //
        8.0, 0.0, 0.0, 0.25,
    ];
    let x = Tensor::<X, 2>::from_data(TensorData::new(x, [8, 4]), &device);
    let targets = Tensor::<X, 2, Int>::from_data(
        TensorData::new(vec![0i64, 0, 0, 1, 1, 0, 1, 0], [8, 1]),
        &device,
    );
    let bce = BinaryCrossEntropyLossConfig::new().init(&device);
    let guard = precision.map(autocast);
    let p = sigmoid(linear.forward(x));
    let p_dtype = p.dtype();
    let loss = bce.forward(p, targets);
    drop(guard);
    let loss_value = values(loss.clone())[0];
    let grads = loss.backward();
    let grad = linear.weight.val().grad(&grads).expect("weight gradient");
    assert_eq!(
        grad.dtype(),
        DType::F32,
        "an f32 weight gets an f32 gradient"
    );
    (loss_value, values(grad), p_dtype)
}

/// Tolerances: the loss 1e-3 relative (logits are exact in f16/bf16, the sigmoid and the
/// log run in f32 as in the reference); the weight gradient 2e-2 relative L2 (its matmul runs
/// in the low dtype).
fn bce_matches_f32(precision: Precision) {
    let (want_loss, want_grad, _) = bce_on_probabilities::<Autodiff<Flex>>(None);
    let (loss, grad, p_dtype) = bce_on_probabilities::<Amp<Autodiff<Flex>>>(Some(precision));
    let grad_err = rel_l2(&grad, &want_grad);
    eprintln!(
        "{precision}: loss {loss} (f32 {want_loss}), weight grad rel. L2 error {grad_err:.2e}"
    );
    assert_eq!(p_dtype, DType::F32, "sigmoid makes probabilities in f32");
    assert!(
        (loss - want_loss).abs() <= 1e-3 * want_loss.abs(),
        "BCE on probabilities under {precision}: loss {loss}, f32 reference {want_loss}"
    );
    assert!(
        grad_err <= 2e-2,
        "weight gradient under {precision}: {grad:?}, f32 reference {want_grad:?}"
    );
}

#[test]
fn bce_on_sigmoid_probabilities_matches_f32_f16() {
    bce_matches_f32(Precision::F16);
}

#[test]
fn bce_on_sigmoid_probabilities_matches_f32_bf16() {
    bce_matches_f32(Precision::Bf16);
}

/// Bytes allocated and not yet freed by this thread (the measurement below).
struct CountingAlloc;

thread_local! {
    static LIVE_BYTES: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    let _ = LIVE_BYTES.try_with(|c| c.set(c.get() + delta));
}

// SAFETY: forwards to the system allocator; the counter is a const-initialised Cell.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn live_bytes() -> isize {
    LIVE_BYTES.with(|c| c.get())
}

/// Bytes per element that `f`, given an activation in the low dtype (as a lowered linear
/// returns it), leaves alive on this thread: what autodiff saved for the backward (the
/// activation itself included, if saved), then the output's own bytes.
fn retained_per_element<A: AutodiffBackend>(
    precision: Precision,
    n: usize,
    f: impl FnOnce(Tensor<A, 1>) -> Tensor<A, 1>,
) -> (f64, f64) {
    let device = Default::default();
    let x = Tensor::<A, 1>::from_data(
        TensorData::new(
            (0..n).map(|i| (i % 17) as f32 - 8.0).collect::<Vec<_>>(),
            [n],
        ),
        &device,
    )
    .require_grad();
    let _g = autocast(precision);
    let before = live_bytes();
    let y = f(x.clone().cast(low(precision)));
    let after = live_bytes();
    let out_bytes = y.dtype().size() as f64;
    let total = (after - before) as f64 / n as f64;
    drop(y);
    (total - out_bytes, out_bytes)
}

/// SiLU is `x * sigmoid(x)` in burn (no backend op): with `sigmoid` in f32 its output is
/// promoted to f32. Measured here: the output dtype, and the bytes per element that one SiLU
/// keeps for the backward (the counting allocator above, on `Amp<Autodiff<Flex>>`).
#[test]
fn silu_cost_of_sigmoid_in_f32() {
    type A = Amp<Autodiff<Flex>>;
    let n = 1 << 20;
    let mut dtypes = Vec::new();
    for precision in [Precision::F16, Precision::Bf16] {
        let (saved, out) = retained_per_element::<A>(precision, n, silu);
        eprintln!(
            "silu under {precision}: {saved:.2} bytes/element saved for backward, output {out} bytes/element"
        );
        // Calibration: gelu saves its input (2 bytes in f16/bf16).
        let (gelu_saved, _) =
            retained_per_element::<A>(precision, n, burn::tensor::activation::gelu);
        eprintln!("  (calibration: gelu saves {gelu_saved:.2} bytes/element)");
        let _g = autocast(precision);
        let a = Tensor::<A, 1>::ones([4], &Default::default())
            .require_grad()
            .cast(low(precision));
        dtypes.push((precision, silu(a).dtype()));
        // Before sigmoid moved to f32: x and sigmoid(x) in the low dtype, 4 bytes. Now 12:
        // sigmoid's input (autodiff saves it; x cast to f32), sigmoid(x) in f32 (saved by the
        // mul), and the mul's own f32 copy of x (promoted), 4 bytes each.
        assert!(saved <= 12.5, "silu saves {saved:.2} bytes/element");
    }
    for (precision, dtype) in dtypes {
        assert_eq!(
            dtype,
            DType::F32,
            "silu's output under {precision} (x * f32 sigmoid promotes)"
        );
    }
}

// ---------------------------------------------------------------------------------------
// 5. An explicit precision the device cannot run is a clear error
// ---------------------------------------------------------------------------------------

/// burn's NdArray backend has no f16 (`supports_dtype(F16)` is false): an explicit
/// `Precision::F16` must fail at the first lowered op with the same typed message as bf16
/// does, naming the device and the alternative, not somewhere inside the backend.
#[test]
fn explicit_f16_without_device_support_is_a_clear_error() {
    use burn_ndarray::{NdArray, NdArrayDevice};
    let device = NdArrayDevice::Cpu;
    assert!(!<NdArray as Backend>::supports_dtype(&device, DType::F16));
    assert!(!<NdArray as Backend>::supports_dtype(&device, DType::BF16));
    type A = Amp<NdArray>;
    let a = Tensor::<A, 2>::from_data(TensorData::new(vec![0.5f32; 4], [2, 2]), &device);
    for precision in [Precision::F16, Precision::Bf16] {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = autocast(precision);
            a.clone().matmul(a.clone())
        }));
        let msg = panic_message(result.expect_err("a lowered matmul must fail"));
        let expected = AmpError::UnsupportedPrecision {
            precision,
            device: format!("{device:?}"),
            backend: <NdArray as Backend>::name(&device),
            alternative: Precision::F32,
        }
        .to_string();
        assert_eq!(msg, expected, "{precision}");
        assert!(
            msg.contains("Precision::F32") && msg.contains("Cpu"),
            "{msg}"
        );
    }
    // Autocast off still works on this device.
    let _g = autocast(Precision::F32);
    assert_eq!(a.clone().matmul(a).dtype(), DType::F32);
}
