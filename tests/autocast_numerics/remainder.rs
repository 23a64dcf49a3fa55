//! `x % s` to the dtype's precision: PyTorch's remainder (`fmod`, plus `s` where the signs
//! differ) in f64 on the host, rounded once, against `Amp` on Flex (which computes
//! `x - s·floor(x/s)` in f64: `src/backend/workarounds/remainder.rs`), values and gradients.
//! Plain Flex computes it in the input's dtype and loses a small remainder's low bits: the
//! canary. And half tensors on CubeCL, whose quotient overflows f16 (plain wgpu's canary).

use burn::backend::{Autodiff, Flex};
use burn::tensor::TensorData;
use burn_amp::{Amp, autocast};

use super::*;

/// PyTorch's remainder, exact in f64 for f32 inputs but for the one rounding of `+ s`.
pub(crate) fn python_mod(x: f64, s: f64) -> f64 {
    let r = x % s;
    if r != 0.0 && (r < 0.0) != (s < 0.0) {
        r + s
    } else {
        r
    }
}

/// `x` in `dtype` (f32 or half), read back as f32.
fn in_dtype(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F16 => half::f16::from_f32(x).to_f32(),
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

const XS: [f32; 8] = [1e-3, -1e-3, 7.5, -7.5, 0.3, 40_000.0, -2.5e-4, 3.0];
const SCALARS: [f32; 5] = [1_048_576.0, core::f32::consts::TAU, 0.5, -3.0, 1e-2];

/// How many of `x % s` (a scalar `s`, and a tensor of it) on `B`, `x` and the tensor in
/// `dtype`, differ from PyTorch's remainder rounded to `dtype`. Plain Flex in f32: 22 of 80
/// (`0.001 % 2π` 0.0009999275, `3 % 2π` 3.0000005, `0.3 % 2^20` 0.25, `-0.001 % 2^20` 0).
fn remainders<B: Backend>(device: &B::Device, dtype: DType) -> usize {
    let xs: Vec<f32> = XS.iter().map(|&x| in_dtype(x, dtype)).collect();
    let x =
        || Tensor::<B, 1>::from_data(TensorData::new(xs.clone(), [xs.len()]), device).cast(dtype);
    let mut off = 0;
    for s in SCALARS {
        let got = values(x().remainder_scalar(s));
        let rhs = Tensor::<B, 1>::from_data(TensorData::new(vec![s; xs.len()], [xs.len()]), device)
            .cast(dtype);
        let by_tensor = values(x().remainder(rhs));
        let s_in = in_dtype(s, dtype) as f64;
        for (i, &xi) in xs.iter().enumerate() {
            let want = in_dtype(python_mod(xi as f64, s as f64) as f32, dtype);
            let want_t = in_dtype(python_mod(xi as f64, s_in) as f32, dtype);
            off += usize::from(got[i] != want) + usize::from(by_tensor[i] != want_t);
        }
    }
    off
}

#[test]
fn remainder_to_the_dtypes_precision_flex() {
    let device = Default::default();
    let _g = autocast(Precision::F16);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        assert_eq!(
            remainders::<Amp<Flex>>(&device, dtype),
            0,
            "Amp<Flex>, {dtype:?}"
        );
        assert_eq!(
            remainders::<Amp<Autodiff<Flex>>>(&device, dtype),
            0,
            "Amp<Autodiff<Flex>>, {dtype:?}"
        );
    }
    let plain = remainders::<Flex>(&device, DType::F32);
    eprintln!(
        "plain Flex, f32: {plain} of {} off",
        2 * XS.len() * SCALARS.len()
    );
    assert!(plain > 0, "the canary: Flex's f32 remainder");
}

/// Burn's gradients: `x`'s 1, `s`'s `-floor(x / s)`, a broadcast `s` summed; through a
/// product that reads the remainder back (its recomputation gives the same value).
#[test]
fn remainder_gradients_flex() {
    type A = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let _g = autocast(Precision::F16);
    let x = Tensor::<A, 2>::from_floats([[1e-3, -7.5, 7.5, 0.3]], &device).require_grad();
    let s = Tensor::<A, 2>::from_floats([[2.0]], &device).require_grad();
    let w = Tensor::<A, 2>::from_floats([[1.0, 2.0, 3.0, 4.0]], &device).require_grad();
    let r = x.clone().remainder(s.clone());
    let grads = (r.clone() * w.clone()).sum().backward();
    assert_eq!(values(r.clone()), [1e-3, 0.5, 1.5, 0.3]);
    assert_eq!(values(w.grad(&grads).expect("w's gradient")), values(r));
    assert_eq!(
        values(x.grad(&grads).expect("x's gradient")),
        [1.0, 2.0, 3.0, 4.0]
    );
    // -(0·1 + -4·2 + 3·3 + 0·4)
    assert_eq!(values(s.grad(&grads).expect("s's gradient")), [-1.0]);
    let x = Tensor::<A, 1>::from_floats([1e-3, -7.5], &device).require_grad();
    let y = x.clone().remainder_scalar(2.0);
    let grads = (y.clone() * y.clone()).sum().backward();
    assert_eq!(values(x.grad(&grads).expect("x's gradient")), [2e-3, 1.0]);
}

/// f16 `[40000, 500.75, -3.25] % [0.5, 0.5, 0.5]` on `B`, both operands tensors, and with a
/// scalar divisor: under `Amp` (at F16, so neither is widened by the policy) PyTorch's
/// `[0, 0.25, 0.25]` both ways. Returns plain `B`'s tensor remainder.
pub(crate) fn remainder_of_half_tensors<B: Backend>(device: &B::Device) -> Vec<f32> {
    fn run<X: Backend>(device: &X::Device) -> [Vec<f32>; 2] {
        let x = Tensor::<X, 1>::from_floats([40000.0, 500.75, -3.25], device).cast(DType::F16);
        let s = Tensor::<X, 1>::from_floats([0.5, 0.5, 0.5], device).cast(DType::F16);
        [
            values(x.clone().remainder(s)),
            values(x.remainder_scalar(0.5)),
        ]
    }
    let [tensor, scalar] = {
        let _g = autocast(Precision::F16);
        run::<Amp<B>>(device)
    };
    assert_eq!(tensor, [0.0, 0.25, 0.25], "a tensor divisor");
    assert_eq!(scalar, [0.0, 0.25, 0.25], "a scalar divisor");
    let [plain, _] = run::<B>(device);
    plain
}

/// CubeCL's remainder computes `x / s` in f16, which overflows at `40000 / 0.5` (the canary:
/// plain wgpu's `-inf`).
#[test]
fn remainder_of_half_tensors_wgpu() {
    if let Some(device) = common::wgpu_device() {
        let plain = remainder_of_half_tensors::<burn::backend::Wgpu>(&device);
        assert_eq!(plain[0], f32::NEG_INFINITY, "plain wgpu: {plain:?}");
    }
}

#[test]
fn remainder_of_half_tensors_flex() {
    let plain = remainder_of_half_tensors::<Flex>(&Default::default());
    assert_eq!(
        plain,
        [0.0, 0.25, 0.25],
        "plain Flex (its half remainder runs in f32)"
    );
}
