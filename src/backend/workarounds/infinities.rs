//! Where an infinity makes a NaN that the math does not, in Burn 0.21's ops.
//!
//! **`log_sigmoid(-inf)`**: `-inf`, with a gradient of 1 (Flex's and PyTorch's). Burn's default
//! composition, which CubeCL runs (so CUDA too), makes a NaN there of the value and of the
//! gradient (`exp(inf - inf)`): a `-inf` put in on purpose (a mask) then leaves a NaN gradient
//! even where a `mask_where` drops the value, and the scaler skips every step. The op runs on a
//! finite stand-in where the input is `-inf`, its output set to `-inf` there, and its backward
//! gets the same stand-in.
//!
//! **`exp`'s backward behind a mask**: `grad · exp(x)`, which is `0 · inf = NaN` where `exp(x)`
//! overflowed (x > 88.7 in f32) and nothing flowed back. Burn composes `elu`, `celu`, `selu`
//! (`exp(x)` everywhere, then a `mask_where` keeps `x` where it is positive) and `mish`
//! (`tanh(softplus(x))`, whose derivative at `softplus(x) = inf` is 0) so: their gradients are
//! NaN at every input above 88.7, on every backend (measured; PyTorch's fused kernels: 1,
//! 1.0507, 1), and with a loss scaler every step is skipped while the loss stays finite. Here
//! the product is 0 where the output is `+inf` and the gradient 0, which is the derivative
//! (`0 · e^x` for a finite `x`); a NaN gradient, or a non-zero one at an overflow, stays as
//! it was.
//!
//! **`log`'s and `log1p`'s backward behind a clamp**: `grad / x`, `0 / 0 = NaN` at the pole
//! (`log(0)`, `log1p(-1)`) where the value was clamped away. burn-nn's `BinaryCrossEntropyLoss`
//! on probabilities is `log(p).clamp_min(-100)` and `log1p(-p).clamp_min(-100)`: its gradient
//! is NaN wherever `p` is exactly 0 or 1, which f32's `sigmoid` gives from a logit of 16.7 up
//! (and -103.3 down), whatever the target (measured; PyTorch's `BCELoss`: 0 through the
//! sigmoid). The same rule: 0 where the derivative is infinite and the gradient 0. And
//! **`sqrt`'s at 0 behind a clamp**: `cosine_similarity` clamps each norm, `sqrt(Σ x²)`, at its
//! `eps`, so a zero vector (a padding row) had a NaN gradient; the same rule.
//!
//! Above a listed autodiff backend these are [nodes of `Amp`'s own](super::elementwise_node):
//! burn-autodiff's backward reads the input back from its checkpointer, which keeps one copy
//! per node, so a fix of the input's value before Burn's node was measured to be lost where
//! another op kept the same input (`log_sigmoid(x) + x · c`). Below autodiff, `log_sigmoid`'s
//! backward is an op of `Amp` (`log_sigmoid_backward`) and is fixed there; those of `exp`,
//! `log`, `log1p` and `sqrt` are products that `Amp` cannot tell from any other, and stay
//! burn-autodiff's.

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Scalar};

use super::elementwise_node::{Elementwise, elementwise_node};
use super::nan::{bools, equal_at};

/// A finite stand-in for `-inf` in every float dtype (f16's lowest): `log_sigmoid` of it is
/// itself, its gradient 1, as at `-inf`.
const LOWEST_HALF: f64 = -65504.0;

pub(crate) fn log_sigmoid<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    elementwise_node::<B, _>(tensor, LogSigmoid)
}

/// `log_sigmoid`'s backward at `x`: the stand-in's, 1 at `-inf`.
pub(crate) fn log_sigmoid_backward<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    LogSigmoid.backward::<B>(x, grad)
}

pub(crate) fn float_exp<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    elementwise_node::<B, _>(tensor, Unbounded::Exp)
}

pub(crate) fn float_log<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    elementwise_node::<B, _>(tensor, Unbounded::Log)
}

pub(crate) fn float_log1p<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    elementwise_node::<B, _>(tensor, Unbounded::Log1p)
}

pub(crate) fn float_sqrt<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    elementwise_node::<B, _>(tensor, Unbounded::Sqrt)
}

#[derive(Debug, Clone, Copy)]
struct LogSigmoid;

impl Elementwise for LogSigmoid {
    fn forward<X: Backend>(self, x: FloatTensor<X>) -> FloatTensor<X> {
        let at = equal_at::<X>(&x, f64::NEG_INFINITY);
        let y = X::log_sigmoid(X::float_mask_fill(
            x,
            at.clone(),
            Scalar::Float(LOWEST_HALF),
        ));
        X::float_mask_fill(y, at, Scalar::Float(f64::NEG_INFINITY))
    }

    fn backward<X: Backend>(self, x: FloatTensor<X>, grad: FloatTensor<X>) -> FloatTensor<X> {
        let at = equal_at::<X>(&x, f64::NEG_INFINITY);
        X::log_sigmoid_backward(X::float_mask_fill(x, at, Scalar::Float(LOWEST_HALF)), grad)
    }
}

/// The ops whose derivative reaches infinity, at an overflow (`exp`) or a pole (`log`,
/// `log1p`, `sqrt` at 0).
#[derive(Debug, Clone, Copy)]
enum Unbounded {
    Exp,
    Log,
    Log1p,
    Sqrt,
}

impl Unbounded {
    /// burn-autodiff's derivative at `x` (the same bits where it is finite).
    fn derivative<X: Backend>(self, x: FloatTensor<X>) -> FloatTensor<X> {
        match self {
            Unbounded::Exp => X::float_exp(x),
            Unbounded::Log => X::float_recip(x),
            Unbounded::Log1p => X::float_recip(X::float_add_scalar(x, Scalar::Float(1.0))),
            Unbounded::Sqrt => X::float_div_scalar(
                X::float_powf_scalar(x, Scalar::Float(-0.5)),
                Scalar::Float(2.0),
            ),
        }
    }
}

impl Elementwise for Unbounded {
    fn forward<X: Backend>(self, x: FloatTensor<X>) -> FloatTensor<X> {
        match self {
            Unbounded::Exp => X::float_exp(x),
            Unbounded::Log => X::float_log(x),
            Unbounded::Log1p => X::float_log1p(x),
            Unbounded::Sqrt => X::float_sqrt(x),
        }
    }

    /// `grad · derivative` (burn-autodiff's product), 0 where the gradient is 0 and the
    /// derivative infinite: nothing flowed back to where the value overflowed or hit a pole.
    fn backward<X: Backend>(self, x: FloatTensor<X>, grad: FloatTensor<X>) -> FloatTensor<X> {
        let derivative = self.derivative::<X>(x);
        let infinite = X::float_is_inf(derivative.clone(), bools::<X>(&derivative));
        let nothing_back = X::bool_and(equal_at::<X>(&grad, 0.0), infinite);
        let product = X::float_mul(grad, derivative);
        X::float_mask_fill(product, nothing_back, Scalar::Float(0.0))
    }
}
