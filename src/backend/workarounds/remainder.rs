//! `x % s`, PyTorch's remainder (the divisor's sign), to the input dtype's precision.
//!
//! Flex computes it as `((x % s) + s) % s` in the input's dtype (f32 for a half input): the
//! sum rounds `x % s` to the precision of `s`, so a small remainder loses its low bits and one
//! below half an ulp of `s` vanishes: `0.001 % 2^20` is 0, `0.001 % 2π` 0.00100017 (PyTorch:
//! 0.001 and 0.001). Flex's formula in f64 is not enough (`0.001 % 2^20` one f32 ulp off). On
//! Flex `Amp` computes `x - s · floor(x / s)` in f64, plus `s` where the signs still differ
//! (a quotient rounded up to a whole number): exact in f64 for f32 values of `x / s` below
//! 2^29, then rounded once to the input's dtype. Above autodiff these are nodes of `Amp`'s
//! own ([`elementwise_node`], [`binary_node`]), so that a later op reading the output back
//! recomputes it the same way, with Burn's backward (`x`: the gradient; `s`: `-floor(x / s)`
//! times it).
//!
//! CubeCL computes `x - s · floor(x / s)` in the input's dtype, where `x / s` overflows a half
//! one (f16 `40000 % 0.5` was -inf on wgpu, for a scalar divisor and, until 2026-12-06, a
//! tensor one): there half inputs run in f32, rounded once.

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, Scalar, TensorMetadata, get_device_settings};
use burn_std::FloatDType;

use super::elementwise_node::{BinaryElementwise, Elementwise, binary_node, elementwise_node};
use crate::backend::recompute;

pub(crate) fn float_remainder_scalar<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: Scalar,
) -> FloatTensor<B> {
    if super::on_flex::<B>() {
        return elementwise_node::<B, _>(lhs, RemainderScalar(rhs));
    }
    match lhs.dtype() {
        DType::F16 | DType::BF16 => {
            super::in_f32::<B, 1>([lhs], |[t]| B::float_remainder_scalar(t, rhs))
        }
        _ => B::float_remainder_scalar(lhs, rhs),
    }
}

pub(crate) fn float_remainder<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
) -> FloatTensor<B> {
    if super::on_flex::<B>() {
        return binary_node::<B, _>(lhs, rhs, Remainder);
    }
    // Both half (autocast promotes a mixed pair to f32).
    match lhs.dtype() {
        DType::F16 | DType::BF16 => {
            super::in_f32::<B, 2>([lhs, rhs], |[x, s]| recompute::float_remainder::<B>(x, s))
        }
        _ => recompute::float_remainder::<B>(lhs, rhs),
    }
}

/// `x - s · floor(x / s)`, or `x - s · (floor(x / s) - 1)` (plus `s`) where the first's sign
/// still differs from `s`'s (a quotient rounded up to a whole number), in `x`'s dtype:
/// `quotient` is `x / s`, `s_times(t)` is `t · s`. A whole quotient of 0 subtracts nothing
/// (`0 · inf` would be NaN: `x % inf` is `x`, or `inf` for a negative `x`, PyTorch's).
fn python_mod<X: Backend>(
    x: FloatTensor<X>,
    quotient: FloatTensor<X>,
    s_times: impl Fn(FloatTensor<X>) -> FloatTensor<X>,
) -> FloatTensor<X> {
    let bools = get_device_settings::<X>(&X::float_device(&x)).bool_dtype;
    let whole = X::float_floor(quotient);
    let none = X::float_equal_elem(whole.clone(), Scalar::Float(0.0), bools);
    let taken = X::float_mask_fill(s_times(whole.clone()), none, Scalar::Float(0.0));
    let r = X::float_sub(x.clone(), taken);
    let wrong = X::float_lower_elem(s_times(r.clone()), Scalar::Float(0.0), bools);
    let one_less = X::float_sub_scalar(whole, Scalar::Float(1.0));
    let shifted = X::float_sub(x, s_times(one_less));
    X::float_mask_where(r, wrong, shifted)
}

#[derive(Debug, Clone, Copy)]
struct RemainderScalar(Scalar);

impl Elementwise for RemainderScalar {
    fn forward<X: Backend>(self, x: FloatTensor<X>) -> FloatTensor<X> {
        let s = self.0;
        super::widened::<X, 1>([x], FloatDType::F64, |[x]| {
            let quotient = X::float_div_scalar(x.clone(), s);
            python_mod::<X>(x, quotient, |t| X::float_mul_scalar(t, s))
        })
    }

    fn backward<X: Backend>(self, _x: FloatTensor<X>, grad: FloatTensor<X>) -> FloatTensor<X> {
        grad
    }
}

#[derive(Debug, Clone, Copy)]
struct Remainder;

impl BinaryElementwise for Remainder {
    fn forward<X: Backend>(self, x: FloatTensor<X>, s: FloatTensor<X>) -> FloatTensor<X> {
        super::widened::<X, 2>([x, s], FloatDType::F64, |[x, s]| {
            let quotient = X::float_div(x.clone(), s.clone());
            python_mod::<X>(x, quotient, |t| X::float_mul(t, s.clone()))
        })
    }

    fn backward_lhs<X: Backend>(
        self,
        _x: FloatTensor<X>,
        _s: FloatTensor<X>,
        grad: FloatTensor<X>,
    ) -> FloatTensor<X> {
        grad
    }

    /// `-floor(x / s)`, broadcast.
    fn backward_rhs<X: Backend>(
        self,
        x: FloatTensor<X>,
        s: FloatTensor<X>,
        grad: FloatTensor<X>,
    ) -> FloatTensor<X> {
        let quotient = X::float_floor(X::float_div(x, s));
        X::float_mul(grad, X::float_neg(quotient))
    }
}
