//! WGSL's `pow` is undefined at a zero or negative base, and CubeCL's wgpu kernel special-cases
//! only even and positive odd exponents (its test for an odd one, `y % 2 == 1`, misses the
//! negative ones): `0^-0.5`, `0^-3` and `0^-1` come out 0 (IEEE, PyTorch, Flex: `+inf`), and
//! `(-2)^-3` NaN (-0.125). A positive exponent is right at every base (0, a sign for an odd
//! integer, NaN for a fraction), and so is a reciprocal (`1/0 = inf`, `1/-0 = -inf`): on wgpu
//! `Amp` raises to a negative exponent as the reciprocal of the positive power, which is
//! IEEE's `pow` (`x^-y = 1 / x^y`). Above a listed autodiff backend these run inside the
//! powers' nodes ([`powers`](super::powers)), forward and backward alike; under another
//! autodiff backend their gradients are the ops' own (hence the select and the divisor below).
//! CUDA's `powf` is IEEE's.

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Scalar, TensorMetadata};

use super::nan::bools;

/// `op(tensor, exponent)`, a power to a scalar exponent; on wgpu, for a negative one, the
/// reciprocal of `op(tensor, -exponent)`.
pub(super) fn scalar<B: Backend>(
    tensor: FloatTensor<B>,
    exponent: Scalar,
    op: impl FnOnce(FloatTensor<B>, Scalar) -> FloatTensor<B>,
) -> FloatTensor<B> {
    if !super::on_wgpu::<B>() || exponent.elem::<f64>() >= 0.0 {
        return op(tensor, exponent);
    }
    let positive = match exponent {
        Scalar::Float(e) => Scalar::Float(-e),
        Scalar::Int(e) => Scalar::Int(-e),
        other => other,
    };
    B::float_recip(op(tensor, positive))
}

/// `lhs` to the power `rhs`; on wgpu, where `rhs` is negative, the reciprocal of `lhs` to
/// `-rhs`.
pub(super) fn float_powf<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    if !super::on_wgpu::<B>() {
        return B::float_powf(lhs, rhs);
    }
    let negative = B::float_lower_elem(rhs.clone(), Scalar::Float(0.0), bools::<B>(&rhs));
    // `|rhs|`, not through `abs`, whose gradient at 0 is 0: the exponent's gradient at 0 is
    // `ln lhs`.
    let magnitude = B::float_mask_where(rhs.clone(), negative.clone(), B::float_neg(rhs));
    let power = B::float_powf(lhs, magnitude);
    let negative = B::bool_expand(negative, power.shape());
    // Where the exponent is not negative the reciprocal is of 1: its gradient there is 0,
    // where that of the power itself (0 at a zero base) would give NaN (-0 / 0²).
    let divisor = B::float_mask_fill(
        power.clone(),
        B::bool_not(negative.clone()),
        Scalar::Float(1.0),
    );
    B::float_mask_where(power, negative, B::float_recip(divisor))
}
