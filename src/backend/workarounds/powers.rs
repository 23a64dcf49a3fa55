//! Powers as nodes of `Amp`'s own above a listed autodiff backend ([`elementwise_node`],
//! [`binary_node`]), for two reasons.
//!
//! Their value is [`nan`]'s (NaN where the base is, IEEE's exceptions, negative powers as
//! reciprocals on wgpu), and burn-autodiff's nodes are memory-bound: a later op that reads
//! the output back in the backward got it recomputed with the backend's kernel, which hides
//! the NaN again on CubeCL (measured on wgpu under balanced checkpointing: `w`'s gradient in
//! `x^0.5 · w` and `x^3 · w` a number where PyTorch's is NaN).
//!
//! Their backward is PyTorch's (`pow_backward_self`, `pow_backward_exponent`):
//! `r · x^(r-1)` but 0 where `r = 0`, and `x^r · ln x` but 0 where `x = 0` and `r ≥ 0`, each
//! power the forward's (so NaN at a NaN base, where CubeCL's kernel gave 0). Burn's is the
//! bare formula, every backend: `0 · 0^-1` and `0^r · ln 0` are NaN, so an exponent learned
//! on a base that reaches 0 (a ReLU's output) had a NaN gradient at every step, and a loss
//! scaler skipped them all; a 0th power had no gradient at all (PyTorch's: 0).

use burn_backend::tensor::{BoolTensor, FloatTensor};
use burn_backend::{Backend, Scalar, TensorMetadata};

use super::elementwise_node::{BinaryElementwise, Elementwise, binary_node, elementwise_node};
use super::nan::{self, bools, equal_at};

pub(crate) fn float_powf_scalar<B: Backend>(
    tensor: FloatTensor<B>,
    value: Scalar,
) -> FloatTensor<B> {
    ScalarPower::node::<B>(tensor, value, PowerOp::Powf)
}

pub(crate) fn float_powf_scalar_impl<B: Backend>(
    tensor: FloatTensor<B>,
    value: Scalar,
) -> FloatTensor<B> {
    ScalarPower::node::<B>(tensor, value, PowerOp::PowfImpl)
}

pub(crate) fn float_powi_scalar<B: Backend>(lhs: FloatTensor<B>, rhs: Scalar) -> FloatTensor<B> {
    ScalarPower::node::<B>(lhs, rhs, PowerOp::Powi)
}

pub(crate) fn float_powi_scalar_impl<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: Scalar,
) -> FloatTensor<B> {
    ScalarPower::node::<B>(lhs, rhs, PowerOp::PowiImpl)
}

pub(crate) fn float_powf<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    binary_node::<B, _>(lhs, rhs, TensorPower)
}

/// Which of the backend's scalar powers runs: each keeps its kernels (the dispatchers pick a
/// product or a reciprocal for small integer exponents).
#[derive(Debug, Clone, Copy)]
enum PowerOp {
    Powf,
    PowfImpl,
    Powi,
    PowiImpl,
}

/// `x` to a scalar exponent `p`; the gradient `p · x^(p-1)`, 0 for `p = 0`.
#[derive(Debug, Clone, Copy)]
struct ScalarPower {
    exponent: Scalar,
    op: PowerOp,
}

impl ScalarPower {
    fn node<B: Backend>(x: FloatTensor<B>, exponent: Scalar, op: PowerOp) -> FloatTensor<B> {
        elementwise_node::<B, _>(x, ScalarPower { exponent, op })
    }
}

impl Elementwise for ScalarPower {
    fn forward<X: Backend>(self, x: FloatTensor<X>) -> FloatTensor<X> {
        nan::power::<X>(x, self.exponent, |x, exponent| match self.op {
            PowerOp::Powf => X::float_powf_scalar(x, exponent),
            PowerOp::PowfImpl => X::float_powf_scalar_impl(x, exponent),
            PowerOp::Powi => X::float_powi_scalar(x, exponent),
            PowerOp::PowiImpl => X::float_powi_scalar_impl(x, exponent),
        })
    }

    fn backward<X: Backend>(self, x: FloatTensor<X>, grad: FloatTensor<X>) -> FloatTensor<X> {
        let p = self.exponent.elem::<f64>();
        if p == 0.0 {
            return X::float_zeros(grad.shape(), &X::float_device(&grad), grad.dtype().into());
        }
        let exponent = match self.exponent {
            Scalar::Int(p) => Scalar::Int(p - 1),
            _ => Scalar::Float(p - 1.0),
        };
        let below = ScalarPower { exponent, ..self }.forward::<X>(x);
        X::float_mul(grad, X::float_mul_scalar(below, Scalar::Float(p)))
    }
}

/// `x` to a tensor exponent `r` (broadcast).
#[derive(Debug, Clone, Copy)]
struct TensorPower;

impl BinaryElementwise for TensorPower {
    fn forward<X: Backend>(self, x: FloatTensor<X>, r: FloatTensor<X>) -> FloatTensor<X> {
        nan::powf::<X>(x, r)
    }

    /// `r · x^(r-1)`, 0 where `r = 0`.
    fn backward_lhs<X: Backend>(
        self,
        x: FloatTensor<X>,
        r: FloatTensor<X>,
        grad: FloatTensor<X>,
    ) -> FloatTensor<X> {
        let below = nan::powf::<X>(x, X::float_sub_scalar(r.clone(), Scalar::Float(1.0)));
        let zeroth = equal_at::<X>(&r, 0.0);
        let slope = X::float_mul(r, below);
        let zeroth = X::bool_expand(zeroth, slope.shape());
        X::float_mul(grad, X::float_mask_fill(slope, zeroth, Scalar::Float(0.0)))
    }

    /// `x^r · ln x`, 0 where `x = 0` and `r ≥ 0`.
    fn backward_rhs<X: Backend>(
        self,
        x: FloatTensor<X>,
        r: FloatTensor<X>,
        grad: FloatTensor<X>,
    ) -> FloatTensor<X> {
        let (zero, nonnegative) = (equal_at::<X>(&x, 0.0), nonnegative_at::<X>(&r));
        let slope = X::float_mul(nan::powf::<X>(x.clone(), r), X::float_log(x));
        // `0^r · ln 0` is `0 · -inf` (or `1 · -inf` at `r = 0`), where the derivative's limit
        // along positive bases is 0 (PyTorch's).
        let at = X::bool_and(
            X::bool_expand(zero, slope.shape()),
            X::bool_expand(nonnegative, slope.shape()),
        );
        X::float_mul(grad, X::float_mask_fill(slope, at, Scalar::Float(0.0)))
    }
}

/// Where `r ≥ 0`.
fn nonnegative_at<X: Backend>(r: &FloatTensor<X>) -> BoolTensor<X> {
    X::float_greater_equal_elem(r.clone(), Scalar::Float(0.0), bools::<X>(r))
}
