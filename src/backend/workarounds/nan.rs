//! NaN propagation, PyTorch's: a NaN in gives a NaN out. Burn 0.21's kernels turn a NaN into
//! a number in some ops, and not the same ones on every backend: Flex in `relu`, `clamp_min`,
//! `clamp_max` and max pools (a NaN first in a window survives, one after a number does not);
//! CubeCL (wgpu; CUDA runs the same kernels) in `sigmoid` and `hard_sigmoid` (0), `clamp`,
//! maxima and minima along a dimension and their indices, max pools, `cummax`, and
//! `powf_scalar` (0). A NaN hidden so leaves a broken forward with a finite loss and finite
//! gradients: the loss scaler, whose skip relies on them going non-finite, applies the step,
//! where PyTorch's skips it.
//!
//! `Amp` puts the NaN back into the op's value: where the input is NaN (elementwise), where a
//! window, a row or a prefix holds one (pools, reductions, scans), and an index of a NaN for
//! `argmax`, `argmin` and the indices of a maximum or minimum. Under a listed autodiff backend
//! the value is replaced inside the op's own tensor, so the graph is the one the op built:
//! nothing more kept, no node added, the same gradients. A few elementwise kernels more per op
//! (`is_nan`, a fill; fused on CubeCL), and an extra pool, reduction or scan of the NaN mask
//! for those. The indices of a max pool (its backward's) stay the backend's.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn_backend::{Backend, Scalar, TensorMetadata, get_device_settings};
use burn_std::IntDType;

use crate::backend::concrete::{AutodiffTensor, Visit, dispatch, moved};
use crate::backend::recompute;

/// Where `x` is NaN.
fn nan_at<B: Backend>(x: &FloatTensor<B>) -> BoolTensor<B> {
    let bools = get_device_settings::<B>(&B::float_device(x)).bool_dtype;
    B::float_is_nan(x.clone(), bools)
}

/// `out` with NaN where `at` (the same shape): its value only (see the module docs).
fn with_nan<B: Backend>(out: FloatTensor<B>, at: BoolTensor<B>) -> FloatTensor<B> {
    struct Fill<P, M>(P, M);
    impl<P: 'static, M: 'static> Visit for Fill<P, M> {
        type Out = P;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> P {
            let mut out: AutodiffTensor<X> = moved(self.0);
            let at: BoolTensor<X> = moved(self.1);
            out.primitive = X::float_mask_fill(out.primitive, at, Scalar::Float(f64::NAN));
            moved(out)
        }
    }
    match dispatch::<B, _>(Fill(out, at)) {
        Ok(out) => out,
        Err(Fill(out, at)) => B::float_mask_fill(out, at, Scalar::Float(f64::NAN)),
    }
}

/// An elementwise op: NaN where `x` is.
fn elementwise<B: Backend>(
    x: FloatTensor<B>,
    op: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    let at = nan_at::<B>(&x);
    with_nan::<B>(op(x), at)
}

/// A reduction along `dim` (keeping it) or of everything: NaN where a NaN was reduced.
pub(crate) fn reduced<B: Backend>(
    x: FloatTensor<B>,
    dim: Option<usize>,
    op: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    let at = match dim {
        Some(dim) => B::bool_any_dim(nan_at::<B>(&x), dim),
        None => B::bool_any(nan_at::<B>(&x)),
    };
    with_nan::<B>(op(x), at)
}

/// Indices along `dim` of a maximum or minimum of `x`: where a row holds a NaN, its first NaN's.
pub(crate) fn indices<B: Backend>(
    x: &FloatTensor<B>,
    dim: usize,
    indices: IntTensor<B>,
    dtype: IntDType,
) -> IntTensor<B> {
    let at = nan_at::<B>(x);
    let any = B::bool_any_dim(at.clone(), dim);
    first_nan::<B>(at, any, dim, indices, dtype)
}

/// A maximum or minimum along `dim` with its indices: NaN, and the first NaN's index, where a
/// row holds one (one NaN mask for both).
pub(crate) fn with_indices<B: Backend>(
    x: &FloatTensor<B>,
    dim: usize,
    (values, indices): (FloatTensor<B>, IntTensor<B>),
    dtype: IntDType,
) -> (FloatTensor<B>, IntTensor<B>) {
    let at = nan_at::<B>(x);
    let any = B::bool_any_dim(at.clone(), dim);
    let indices = first_nan::<B>(at, any.clone(), dim, indices, dtype);
    (with_nan::<B>(values, any), indices)
}

/// `indices`, but the index of the first NaN (`at`) along `dim` in the rows that hold one.
fn first_nan<B: Backend>(
    at: BoolTensor<B>,
    any: BoolTensor<B>,
    dim: usize,
    indices: IntTensor<B>,
    dtype: IntDType,
) -> IntTensor<B> {
    // An argmax's dtype is the backend's choice (Flex: i32 for an i64 input).
    let first = B::int_argmax(B::bool_into_int(at, dtype), dim);
    let first = match first.dtype() == indices.dtype() {
        true => first,
        false => B::int_cast(first, indices.dtype().into()),
    };
    B::int_mask_where(indices, any, first)
}

/// `out`, a max pool of `x` (`pool` pools the same way, without indices): NaN where a window
/// holds one.
pub(crate) fn pooled<B: Backend>(
    x: &FloatTensor<B>,
    out: FloatTensor<B>,
    pool: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    let windows = pool(B::bool_into_float(nan_at::<B>(x), x.dtype().into()));
    let bools = get_device_settings::<B>(&B::float_device(x)).bool_dtype;
    let at = B::float_greater_elem(windows, Scalar::Float(0.5), bools);
    with_nan::<B>(out, at)
}

/// A scan along `dim`: NaN from the first NaN on.
fn scanned<B: Backend>(
    x: FloatTensor<B>,
    dim: usize,
    op: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    let seen = B::float_cumsum(B::bool_into_float(nan_at::<B>(&x), x.dtype().into()), dim);
    let bools = get_device_settings::<B>(&B::float_device(&x)).bool_dtype;
    let at = B::float_greater_elem(seen, Scalar::Float(0.5), bools);
    with_nan::<B>(op(x), at)
}

pub(crate) fn relu<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    elementwise::<B>(tensor, recompute::relu::<B>)
}

pub(crate) fn sigmoid<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    elementwise::<B>(tensor, recompute::sigmoid::<B>)
}

pub(crate) fn hard_sigmoid<B: Backend>(
    tensor: FloatTensor<B>,
    alpha: Scalar,
    beta: Scalar,
) -> FloatTensor<B> {
    elementwise::<B>(tensor, |t| B::hard_sigmoid(t, alpha, beta))
}

pub(crate) fn float_clamp<B: Backend>(
    tensor: FloatTensor<B>,
    min: Scalar,
    max: Scalar,
) -> FloatTensor<B> {
    elementwise::<B>(tensor, |t| B::float_clamp(t, min, max))
}

pub(crate) fn float_clamp_min<B: Backend>(tensor: FloatTensor<B>, min: Scalar) -> FloatTensor<B> {
    elementwise::<B>(tensor, |t| B::float_clamp_min(t, min))
}

pub(crate) fn float_clamp_max<B: Backend>(tensor: FloatTensor<B>, max: Scalar) -> FloatTensor<B> {
    elementwise::<B>(tensor, |t| B::float_clamp_max(t, max))
}

/// `op`, a power of `tensor` to `exponent`: NaN where `tensor` is, but for the 0th power (1,
/// IEEE's `pow` and PyTorch's).
fn power<B: Backend>(
    tensor: FloatTensor<B>,
    exponent: Scalar,
    op: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    match exponent.elem::<f64>() == 0.0 {
        true => op(tensor),
        false => elementwise::<B>(tensor, op),
    }
}

pub(crate) fn float_powf_scalar<B: Backend>(
    tensor: FloatTensor<B>,
    value: Scalar,
) -> FloatTensor<B> {
    power::<B>(tensor, value, |t| B::float_powf_scalar(t, value))
}

pub(crate) fn float_powf_scalar_impl<B: Backend>(
    tensor: FloatTensor<B>,
    value: Scalar,
) -> FloatTensor<B> {
    power::<B>(tensor, value, |t| {
        recompute::float_powf_scalar_impl::<B>(t, value)
    })
}

pub(crate) fn float_powi_scalar<B: Backend>(lhs: FloatTensor<B>, rhs: Scalar) -> FloatTensor<B> {
    power::<B>(lhs, rhs, |t| B::float_powi_scalar(t, rhs))
}

pub(crate) fn float_powi_scalar_impl<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: Scalar,
) -> FloatTensor<B> {
    power::<B>(lhs, rhs, |t| B::float_powi_scalar_impl(t, rhs))
}

pub(crate) fn float_cummax<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    scanned::<B>(tensor, dim, |t| B::float_cummax(t, dim))
}

pub(crate) fn float_cummin<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    scanned::<B>(tensor, dim, |t| B::float_cummin(t, dim))
}
