//! Half-precision elementwise ops computed in f32 and rounded once, as PyTorch's half kernels
//! compute (their "opmath" type). Autocast keeps `gelu`, `tanh` and `asinh` in the input's
//! dtype (PyTorch's lists do), and CubeCL computes them in that dtype, step by step:
//!
//! - **`gelu`** is Burn's composition `x · (1 + erf(x / √2)) / 2` on every CubeCL backend, each
//!   step rounded to f16: in the negative tail `1 + erf` is the difference of two numbers near
//!   1, and `gelu(-3.83)` came out 2043 f16 steps from the rounded f32 value (wgpu, lavapipe),
//!   its gradient (`gelu_backward`, the same composition) 398;
//! - **`tanh`** and **`asinh`** of a small input are 0 or several times the input on wgpu
//!   (lavapipe: `tanh(-2e-4)` is 1678 steps off, as `asinh(-1e-4)`).
//!
//! Flex computes them in f32 (0.5 steps: correctly rounded) and keeps Burn's. Elsewhere, a
//! half input is widened, the op and its derivative run in f32, and the output and the input's
//! gradient are rounded to the input's dtype, in an [elementwise node of `Amp`'s
//! own](super::elementwise_node) above autodiff (the half input kept, as before). Below
//! autodiff the forward is the same and `gelu_backward` too; `tanh`'s and `asinh`'s backwards
//! stay burn-autodiff's.
//!
//! **`gelu`'s derivative**, in any dtype: Burn 0.21's `gelu` is the exact `x · Φ(x)`, but the
//! trait's default `gelu_backward`, which every backend but Flex keeps (CubeCL's wgpu and CUDA
//! among them), is the derivative of the tanh approximation: off by up to 8.7e-4 near
//! `x = 2` (4.7e-4 relative L2 over [-6, 6], f32, wgpu), a gradient that is not the forward's.
//! Outside Flex `gelu` is this node at every dtype, and its derivative (below autodiff too)
//! is `Φ(x) + x · φ(x)`, PyTorch's for `approximate="none"`: within 2.4e-7 of an f64
//! reference (wgpu's `erf` is within 4.5e-7). Under an autodiff backend `Amp` does not list
//! (a bare `CubeBackend`), where it builds no node, the forward is composed (`x · Φ(x)`) so
//! that autodiff differentiates `erf`.

use core::f64::consts::{FRAC_1_SQRT_2, PI};

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, Scalar, TensorMetadata};

use super::elementwise_node::{Elementwise, elementwise_node};
use super::in_f32;
use crate::backend::recompute;

/// Whether `B` computes an elementwise op on `tensor` in its half dtype.
fn in_half_arithmetic<B: Backend>(tensor: &FloatTensor<B>) -> bool {
    matches!(tensor.dtype(), DType::F16 | DType::BF16) && !super::on_flex::<B>()
}

pub(crate) fn gelu<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    match super::on_flex::<B>() {
        false => elementwise_node::<B, _>(tensor, Opmath::Gelu),
        true => recompute::gelu::<B>(tensor),
    }
}

pub(crate) fn float_tanh<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    match in_half_arithmetic::<B>(&tensor) {
        true => elementwise_node::<B, _>(tensor, Opmath::Tanh),
        false => recompute::float_tanh::<B>(tensor),
    }
}

pub(crate) fn float_asinh<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    match in_half_arithmetic::<B>(&tensor) {
        true => elementwise_node::<B, _>(tensor, Opmath::Asinh),
        false => recompute::float_asinh::<B>(tensor),
    }
}

/// `gelu`'s backward kernel, which `Amp` runs below autodiff.
pub(crate) fn gelu_backward<B: Backend>(x: FloatTensor<B>, grad: FloatTensor<B>) -> FloatTensor<B> {
    match super::on_flex::<B>() {
        false => Opmath::Gelu.backward::<B>(x, grad),
        true => B::gelu_backward(x, grad),
    }
}

/// `op` on `inputs`, in f32 where they are half (the output rounded back once), as they are
/// otherwise.
fn in_opmath<X: Backend, const N: usize>(
    inputs: [FloatTensor<X>; N],
    op: impl FnOnce([FloatTensor<X>; N]) -> FloatTensor<X>,
) -> FloatTensor<X> {
    match inputs[0].dtype() {
        DType::F16 | DType::BF16 => in_f32::<X, N>(inputs, op),
        _ => op(inputs),
    }
}

/// `Φ(x) = (1 + erf(x / √2)) / 2`, the standard normal's distribution function.
fn normal_cdf<X: Backend>(x: FloatTensor<X>) -> FloatTensor<X> {
    let erf = X::float_erf(X::float_mul_scalar(x, FRAC_1_SQRT_2.into()));
    X::float_mul_scalar(X::float_add_scalar(erf, 1.0.into()), 0.5.into())
}

/// `grad · (Φ(x) + x · φ(x))`: the derivative of `x · Φ(x)`, `φ` the standard normal's
/// density.
fn exact_gelu_backward<X: Backend>(x: FloatTensor<X>, grad: FloatTensor<X>) -> FloatTensor<X> {
    let cdf = normal_cdf::<X>(x.clone());
    let squared = X::float_mul(x.clone(), x.clone());
    let density = X::float_exp(X::float_mul_scalar(squared, (-0.5).into()));
    let density = X::float_mul_scalar(density, (1.0 / (2.0 * PI).sqrt()).into());
    let derivative = X::float_add(cdf, X::float_mul(x, density));
    X::float_mul(grad, derivative)
}

#[derive(Debug, Clone, Copy)]
enum Opmath {
    Gelu,
    Tanh,
    Asinh,
}

impl Elementwise for Opmath {
    fn forward<X: Backend>(self, x: FloatTensor<X>) -> FloatTensor<X> {
        in_opmath::<X, 1>([x], |[x]| match self {
            // Under an autodiff backend `Amp` does not list (no node of its own), composed, so
            // that autodiff differentiates `erf` rather than keep Burn's `gelu_backward`.
            Opmath::Gelu if X::ad_enabled(&X::float_device(&x)) => {
                X::float_mul(x.clone(), normal_cdf::<X>(x))
            }
            Opmath::Gelu => X::gelu(x),
            Opmath::Tanh => X::float_tanh(x),
            Opmath::Asinh => X::float_asinh(x),
        })
    }

    fn backward<X: Backend>(self, x: FloatTensor<X>, grad: FloatTensor<X>) -> FloatTensor<X> {
        let one = Scalar::Float(1.0);
        in_opmath::<X, 2>([x, grad], |[x, grad]| match self {
            Opmath::Gelu => exact_gelu_backward::<X>(x, grad),
            // 1 - tanh(x)², from the input in f32 (burn-autodiff's from the half output).
            Opmath::Tanh => {
                let y = X::float_tanh(x);
                let squared = X::float_mul(y.clone(), y);
                X::float_mul(grad, X::float_neg(X::float_sub_scalar(squared, one)))
            }
            Opmath::Asinh => {
                let squared = X::float_mul(x.clone(), x);
                X::float_div(grad, X::float_sqrt(X::float_add_scalar(squared, one)))
            }
        })
    }
}
