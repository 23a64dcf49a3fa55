//! A scalar operand of a half tensor kept in f32 (`src/backend/workarounds/scalars.rs`), as
//! PyTorch's half kernels keep it: `x + s`, `x - s`, `x * s`, `x / s`, `x % s` are the f32
//! result rounded once. Burn 0.21 rounds `s` to the tensor's dtype first: in f16 a divisor
//! of 1,048,576 (a Gram matrix's `c · h · w`) is inf and the quotient 0, `x * 1e5` is NaN at
//! 0, `x * 1e-8` is 0; in bf16 `x * 0.1` is scaled 0.1% too far. The plain backend is the
//! canary; gradients through `x / s` too. Last, a mask fill past the half range is the
//! range's end, not an infinity.

use burn::backend::{Autodiff, Flex};
use burn::tensor::TensorData;
use burn_amp::{Amp, autocast};

use super::*;

type Binary<B> = fn(Tensor<B, 1>, f32) -> Tensor<B, 1>;
/// The reference on the host, in f32 (`None`: the backend's own f32 op).
type Host = Option<fn(f32, f32) -> f32>;

/// Each op, and its reference.
fn ops<B: Backend>() -> [(&'static str, Binary<B>, Host); 5] {
    [
        ("add", |x, s| x.add_scalar(s), Some(|x, s| x + s)),
        ("sub", |x, s| x.sub_scalar(s), Some(|x, s| x - s)),
        ("mul", |x, s| x.mul_scalar(s), Some(|x, s| x * s)),
        ("div", |x, s| x.div_scalar(s), Some(|x, s| x / s)),
        // Flex's own f32 remainder is `((x % s) + s) % s`, 0 for `0.001 % 2^20` (a defect of
        // its own, `remainder.rs`: `Amp` computes it exactly there) and CubeCL's
        // `x - s · floor(x / s)` in f32: the reference is PyTorch's (`python_mod`) on Flex,
        // the backend's f32 op on wgpu.
        ("remainder", |x, s| x.remainder_scalar(s), None),
    ]
}

/// The f32 result of `x op s` rounded to `dtype`.
fn rounded(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        _ => half::f16::from_f32(v).to_f32(),
    }
}

/// Values of the half dtype: large, small, zero, negative, subnormal in f16.
fn inputs(dtype: DType) -> Vec<f32> {
    let xs = [
        1000.0f32,
        -3.0,
        0.0,
        1e-3,
        0.3,
        -7.5e-2,
        6e-5,
        40_000.0,
        1.0 / 3.0,
    ];
    xs.iter().map(|&x| rounded(x, dtype)).collect()
}

/// Scalars a half dtype does not hold (f16: past its range, under it, inexact; bf16:
/// inexact) and two it holds (the half op runs as before, exactly the same).
const SCALARS: [f32; 6] = [1_048_576.0, 1e5, 1e-8, 0.1, 0.5, 3.0];

/// Each op and scalar on half values: the f32 result rounded once, within one step of the
/// half dtype where the backend's f32 division may not be correctly rounded (WGSL allows 2.5
/// f32 ulps; measured: equal everywhere); the plain backend's, for the record.
fn check<B: Backend>(device: &B::Device, precision: Precision) {
    type A<B> = Amp<B>;
    let dtype = low(precision);
    let xs = inputs(dtype);
    let _g = autocast(precision);
    let mut canary_wrong = 0;
    for (name, op, host) in ops::<A<B>>() {
        for s in SCALARS {
            let want: Vec<f32> = match host {
                Some(host) => xs.iter().map(|&x| host(x, s)).collect(),
                None if core::any::TypeId::of::<B>() == core::any::TypeId::of::<Flex>() => xs
                    .iter()
                    .map(|&x| super::remainder::python_mod(x as f64, s as f64) as f32)
                    .collect(),
                None => values(op_plain::<B>(name)(
                    Tensor::from_data(TensorData::new(xs.clone(), [xs.len()]), device),
                    s,
                )),
            };
            let want: Vec<f32> = want.into_iter().map(|v| rounded(v, dtype)).collect();
            let x = Tensor::<A<B>, 1>::from_data(TensorData::new(xs.clone(), [xs.len()]), device)
                .cast(dtype);
            let y = op(x, s);
            assert_eq!(y.dtype(), dtype, "{name} {s}: the tensor's dtype");
            let got = values(y);
            for ((g, w), x) in got.iter().zip(&want).zip(&xs) {
                let same = g == w || (g.is_nan() && w.is_nan());
                let one_step = (g - w).abs() <= (rounded(w.abs() * 1.001, dtype) - w.abs()).abs();
                assert!(
                    same || (name == "div" && one_step),
                    "{precision:?} {name}({x}, {s}): {g}, want {w}"
                );
            }
            let plain = Tensor::<B, 1>::from_data(TensorData::new(xs.clone(), [xs.len()]), device)
                .cast(dtype);
            let plain = values(op_plain::<B>(name)(plain, s));
            canary_wrong += plain
                .iter()
                .zip(&want)
                .filter(|(p, w)| p != w && !(p.is_nan() && w.is_nan()))
                .count();
        }
    }
    eprintln!(
        "{precision:?}: the plain backend's results off the f32 result rounded once: {canary_wrong}"
    );
    assert!(
        canary_wrong > 0,
        "the canary: Burn 0.21 rounds the scalar first"
    );

    // The gradient through `x / 1,048,576`: 2^-20 (an f16 subnormal, exact), 0 before.
    let x =
        Tensor::<Amp<Autodiff<B>>, 1>::from_data(TensorData::new(xs.clone(), [xs.len()]), device)
            .cast(dtype)
            .require_grad();
    let y = x.clone().div_scalar(1_048_576.0);
    let grad = values(x.grad(&y.sum().backward()).expect("x's gradient"));
    assert!(
        grad.iter().all(|&g| g == 2f32.powi(-20)),
        "{precision:?}: {grad:?}"
    );
}

/// An attention mask of `-1e9` or `f32::MIN` on half scores: the row masked whole is uniform
/// after the softmax, as in the program's f32 run, and a masked element beside unmasked ones
/// is an exact 0. Filled as -inf (the value rounded to the half dtype: f16 for both values,
/// bf16 for `f32::MIN`), the first row was NaN.
fn masks<B: Backend>(device: &B::Device, precision: Precision) {
    let dtype = low(precision);
    let scores = [0.5f32, -1.0, 2.0, 1.0, 0.25, -0.5];
    let mask = [true, true, true, false, true, false];
    for fill in [-1e9f32, f32::MIN] {
        let run = |p: Precision| {
            let _g = autocast(p);
            let x =
                Tensor::<Amp<B>, 2>::from_data(TensorData::new(scores.to_vec(), [2, 3]), device);
            let x = if p == Precision::F32 {
                x
            } else {
                x.cast(dtype)
            };
            let m = Tensor::<Amp<B>, 2, burn::tensor::Bool>::from_data(
                TensorData::new(mask.to_vec(), [2, 3]),
                device,
            );
            values(burn::tensor::activation::softmax(x.mask_fill(m, fill), 1))
        };
        let (half, f32_run) = (run(precision), run(Precision::F32));
        assert_eq!(
            &half[..3],
            &[1.0 / 3.0; 3],
            "{precision:?} {fill}: the row masked whole"
        );
        assert_eq!(&f32_run[..3], &[1.0 / 3.0; 3]);
        assert_eq!(half[4], 0.0, "{precision:?} {fill}: a masked element");
        assert!((half[3] + half[5] - 1.0).abs() < 1e-6, "{half:?}");
    }
}

flex_and_wgpu_tests!(masks: masks_flex_f16, masks_flex_bf16, masks_wgpu_f16);

fn op_plain<B: Backend>(name: &str) -> Binary<B> {
    ops::<B>().into_iter().find(|(n, ..)| *n == name).unwrap().1
}

flex_and_wgpu_tests!(check: scalars_flex_f16, scalars_flex_bf16, scalars_wgpu_f16);
