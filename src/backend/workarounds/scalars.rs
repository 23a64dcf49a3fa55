//! A scalar operand of a half tensor kept in f32, as PyTorch's half kernels keep it (their
//! "opmath" type): `x + s`, `x - s`, `x * s`, `x / s` and `x % s` on an f16 or bf16 tensor are
//! computed in f32 with `s` as given, and rounded once to the tensor's dtype.
//!
//! Burn 0.21 rounds `s` to the tensor's dtype first, on every backend (Flex's and CubeCL's
//! scalar conversions). In f16 a scalar past 65504 is inf and one under 6e-8 is 0: a Gram
//! matrix divided by `c · h · w = 1,048,576` came out all zeros, `x * 1e5` NaN at every 0 and
//! `x * 1e-8` 0 everywhere (Flex and wgpu, measured). In bf16 a scalar keeps 8 bits: `x * 0.1`
//! scaled every element 0.1% too far, the same way, and `1000 * 1e5` was one bf16 step from
//! the rounded product.
//!
//! A mask fill's value past the half dtype's range is its largest finite value of that sign
//! ([`float_mask_fill`]).
//!
//! `x % s` always (see [`remainder`](super::remainder)); the others only where `s` is not exact in
//! the tensor's dtype: otherwise the half op already gives the
//! f32 result rounded once (the product of two half values is exact in f32), and runs as it
//! did. A clamp bound or a comparison's threshold needs nothing: rounding is monotone, so a
//! half value compares with `s` as with its rounding (but at the rounded value itself).

use burn_backend::tensor::{BoolTensor, FloatTensor};
use burn_backend::{Backend, DType, Scalar, TensorMetadata};
use half::{bf16, f16};

/// Whether `s` is a value of `dtype` (every scalar is, for a dtype that is not half).
fn exact_in(s: Scalar, dtype: DType) -> bool {
    let v = match s {
        Scalar::Float(v) => v,
        Scalar::Int(v) => v as f64,
        Scalar::UInt(v) => v as f64,
        Scalar::Bool(_) => return true,
    };
    match dtype {
        DType::F16 => v.is_nan() || f16::from_f64(v).to_f64() == v,
        DType::BF16 => v.is_nan() || bf16::from_f64(v).to_f64() == v,
        _ => true,
    }
}

/// `op(tensor, s)`, in f32 when `s` is not exact in the half `tensor`'s dtype.
fn with_scalar<B: Backend>(
    tensor: FloatTensor<B>,
    s: Scalar,
    op: impl FnOnce(FloatTensor<B>, Scalar) -> FloatTensor<B>,
) -> FloatTensor<B> {
    if exact_in(s, tensor.dtype()) {
        op(tensor, s)
    } else {
        super::in_f32::<B, 1>([tensor], |[t]| op(t, s))
    }
}

pub(crate) fn float_add_scalar<B: Backend>(lhs: FloatTensor<B>, rhs: Scalar) -> FloatTensor<B> {
    with_scalar::<B>(lhs, rhs, B::float_add_scalar)
}

pub(crate) fn float_sub_scalar<B: Backend>(lhs: FloatTensor<B>, rhs: Scalar) -> FloatTensor<B> {
    with_scalar::<B>(lhs, rhs, B::float_sub_scalar)
}

pub(crate) fn float_mul_scalar<B: Backend>(lhs: FloatTensor<B>, rhs: Scalar) -> FloatTensor<B> {
    with_scalar::<B>(lhs, rhs, B::float_mul_scalar)
}

pub(crate) fn float_div_scalar<B: Backend>(lhs: FloatTensor<B>, rhs: Scalar) -> FloatTensor<B> {
    with_scalar::<B>(lhs, rhs, B::float_div_scalar)
}

/// `value` where `mask` is set: a finite value past the half dtype's range (an attention mask
/// of `-1e9` or `f32::MIN`) is filled as that dtype's largest finite value of its sign, not
/// as an infinity. Rounded to -inf, a row masked whole is NaN after the softmax (`-inf - -inf`)
/// where the program's f32 run gives a uniform row; -65504 gives it, and still an exact 0 for
/// a masked element beside an unmasked one. An infinite value is an infinity as asked.
/// (PyTorch refuses the fill: "value cannot be converted to type at::Half without overflow".)
pub(crate) fn float_mask_fill<B: Backend>(
    tensor: FloatTensor<B>,
    mask: BoolTensor<B>,
    value: Scalar,
) -> FloatTensor<B> {
    let largest = match tensor.dtype() {
        DType::F16 => f16::MAX.to_f64(),
        DType::BF16 => bf16::MAX.to_f64(),
        _ => return B::float_mask_fill(tensor, mask, value),
    };
    let value = match value {
        Scalar::Float(v) if v.is_finite() && v.abs() > largest => {
            Scalar::Float(largest.copysign(v))
        }
        other => other,
    };
    B::float_mask_fill(tensor, mask, value)
}
