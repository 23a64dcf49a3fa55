//! Integer powers, exact. Burn 0.21 raises ints through floats (`int_powi`, and
//! `int_powi_scalar` past an exponent of 2): the float type's `pow`, truncated back to int.
//! CubeCL's float `pow` lands just below a whole power, so the truncation loses one: on wgpu
//! 5³ = 124, 3⁷ = 2186, 5⁵ = 3124 (their negatives too), where Flex's is exact. `Amp`
//! multiplies instead, by squaring, as PyTorch's integer `pow` does: exact wherever the
//! result fits the int type (past it, a scalar power wraps as PyTorch's does; an elementwise
//! power past the type's width counts its exponent as the width or one more, which is
//! exact for -1, 0 and 1 and an overflow, not PyTorch's wrapped value, for other bases).
//!
//! A negative exponent (an error in PyTorch) keeps Burn's meaning, the float power truncated:
//! ±1 for a base of ±1, else 0 (for a base of 0 too, where Burn's float is infinite).

use burn_backend::tensor::{BoolTensor, IntTensor};
use burn_backend::{Backend, DType, Scalar, TensorMetadata, get_device_settings};

/// `lhs` to the power `rhs`, a scalar.
pub(crate) fn int_powi_scalar<B: Backend>(lhs: IntTensor<B>, rhs: Scalar) -> IntTensor<B> {
    let exponent = rhs.elem::<i64>();
    if exponent < 0 {
        return B::int_powi_scalar(lhs, rhs);
    }
    let device = B::int_device(&lhs);
    let ones = || B::int_ones(lhs.shape(), &device, lhs.dtype().into());
    // Square-and-multiply over the exponent's bits, lowest first.
    let (mut power, mut base, mut rest) = (None::<IntTensor<B>>, lhs.clone(), exponent);
    while rest > 0 {
        if rest & 1 == 1 {
            power = Some(match power {
                Some(power) => B::int_mul(power, base.clone()),
                None => base.clone(),
            });
        }
        rest >>= 1;
        if rest > 0 {
            base = B::int_mul(base.clone(), base);
        }
    }
    power.unwrap_or_else(ones)
}

/// `lhs` to the power `rhs`, element by element.
pub(crate) fn int_powi<B: Backend>(lhs: IntTensor<B>, rhs: IntTensor<B>) -> IntTensor<B> {
    let bools = get_device_settings::<B>(&B::int_device(&lhs)).bool_dtype;
    let negative = B::int_lower_elem(rhs.clone(), Scalar::Int(0), bools);
    let exponent = B::int_abs(rhs);
    let (shape, device, dtype) = (lhs.shape(), B::int_device(&lhs), lhs.dtype());
    // Past the int type's width, any base but -1, 0, 1 overflows: an exponent of the width or
    // one more, of the same parity, gives those three their powers with few bits to walk
    // (i32: 32 or 33, 6 bits; i64: 64 or 65, 7 bits: 2^40 is exact there).
    let width: i64 = if matches!(dtype, DType::I64 | DType::U64) {
        64
    } else {
        32
    };
    let bits = if width == 64 { 7 } else { 6 };
    let large = B::int_greater_elem(exponent.clone(), Scalar::Int(width + 1), bools);
    let parity = B::int_remainder_scalar(exponent.clone(), Scalar::Int(2));
    let exponent = B::int_mask_where(
        exponent,
        large,
        B::int_add_scalar(parity, Scalar::Int(width)),
    );
    let ones = || B::int_ones(shape.clone(), &device, dtype.into());
    let mut power = ones();
    let (mut base, mut rest) = (lhs.clone(), exponent);
    // Each product is one the result needs (a factor of 1 elsewhere), so none passes the
    // result where it fits: no wrap, and no overflow check tripped in a debug build.
    for bit in 0..bits {
        let odd: BoolTensor<B> = B::int_equal_elem(
            B::int_remainder_scalar(rest.clone(), Scalar::Int(2)),
            Scalar::Int(1),
            bools,
        );
        power = B::int_mul(power, B::int_mask_where(ones(), odd, base.clone()));
        if bit + 1 < bits {
            rest = B::int_div_scalar(rest, Scalar::Int(2));
            let done = B::int_equal_elem(rest.clone(), Scalar::Int(0), bools);
            base = B::int_mask_fill(base, done, Scalar::Int(1));
            base = B::int_mul(base.clone(), base);
        }
    }
    // A negative exponent: ±1 for a base of ±1 (the power of |exponent| is its sign), else 0.
    let unit = B::int_equal_elem(B::int_abs(lhs), Scalar::Int(1), bools);
    let zeroed = B::bool_and(negative, B::bool_not(unit));
    B::int_mask_fill(power, zeroed, Scalar::Int(0))
}
