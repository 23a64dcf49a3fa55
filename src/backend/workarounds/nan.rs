//! NaN propagation, PyTorch's: a NaN in gives a NaN out. Burn 0.21's kernels turn a NaN into
//! a number in some ops, and not the same ones on every backend: Flex in `relu`, `clamp_min`,
//! `clamp_max`, whole-tensor maxima and minima, and max pools (a NaN first in a window
//! survives, one after a number does not);
//! CubeCL (wgpu; CUDA runs the same kernels) in `sigmoid` and `hard_sigmoid` (0), `clamp`,
//! maxima and minima and their indices, max pools, `cummax`, `cummin`, powers and `atan2`
//! (0), and `topk` (PyTorch ranks a NaN above every number). A NaN hidden so leaves a broken
//! forward with a finite loss and finite gradients: the loss scaler, whose skip relies on them
//! going non-finite, applies the step, where PyTorch's skips it.
//!
//! `Amp` puts the NaN back into the op's value: where an input is NaN (elementwise), where a
//! window, a row or a prefix holds one (pools, reductions, scans), and an index of a NaN for
//! `argmax`, `argmin` and the indices of a maximum or minimum. Under a listed autodiff backend
//! the value is replaced inside the op's own tensor, so the graph is the one the op built:
//! nothing more kept, no node added, the same gradients (under an autodiff backend `Amp` does
//! not list, the fill is an op of its own, whose gradient is 0 where it fills: hence fills
//! only where an input is NaN). `relu`, `sigmoid`, `atan2` and the powers are nodes of
//! `Amp`'s own instead, whose recomputation in the backward fills the NaN again
//! ([`Activation`], [`Atan2`], [`powers`](super::powers)). A few elementwise kernels more per op
//! (`is_nan`, a fill; fused on CubeCL; none for `relu`, a kernel that keeps the NaN, nor for
//! the clamps above autodiff), and an extra pool, reduction or scan of the NaN mask for those.
//! The indices of a max pool (its backward's) stay the backend's.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn_backend::{Backend, Scalar, TensorMetadata, get_device_settings};
use burn_std::{BoolDType, IntDType};

use super::elementwise_node::{BinaryElementwise, Elementwise, binary_node, elementwise_node};
use super::negative_powers;
use crate::backend::concrete::{AutodiffTensor, Visit, dispatch, moved};

/// The bool dtype of `x`'s device.
pub(super) fn bools<B: Backend>(x: &FloatTensor<B>) -> BoolDType {
    get_device_settings::<B>(&B::float_device(x)).bool_dtype
}

/// Where `x` is NaN.
fn nan_at<B: Backend>(x: &FloatTensor<B>) -> BoolTensor<B> {
    B::float_is_nan(x.clone(), bools::<B>(x))
}

/// Where `x` is `value`.
pub(super) fn equal_at<B: Backend>(x: &FloatTensor<B>, value: f64) -> BoolTensor<B> {
    B::float_equal_elem(x.clone(), Scalar::Float(value), bools::<B>(x))
}

/// 1 where `mask`, else 0, in `like`'s dtype: a mask that pools, scans, sums and broadcasts
/// as floats do.
fn ones_at<B: Backend>(like: &FloatTensor<B>, mask: BoolTensor<B>) -> FloatTensor<B> {
    B::bool_into_float(mask, like.dtype().into())
}

/// Where a pooled, scanned or summed count of such masks is at least 1.
fn counted<B: Backend>(count: FloatTensor<B>) -> BoolTensor<B> {
    let bools = bools::<B>(&count);
    B::float_greater_elem(count, Scalar::Float(0.5), bools)
}

/// `out` with NaN where `at` (the same shape): its value only (see the module docs).
fn with_nan<B: Backend>(out: FloatTensor<B>, at: BoolTensor<B>) -> FloatTensor<B> {
    with_value::<B>(out, at, f64::NAN)
}

/// `out` with `value` where `at` (the same shape): its value only.
fn with_value<B: Backend>(out: FloatTensor<B>, at: BoolTensor<B>, value: f64) -> FloatTensor<B> {
    struct Fill<P, M>(P, M, f64);
    impl<P: 'static, M: 'static> Visit for Fill<P, M> {
        type Out = P;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> P {
            let mut out: AutodiffTensor<X> = moved(self.0);
            let at: BoolTensor<X> = moved(self.1);
            out.primitive = X::float_mask_fill(out.primitive, at, Scalar::Float(self.2));
            moved(out)
        }
    }
    match dispatch::<B, _>(Fill(out, at, value)) {
        Ok(out) => out,
        Err(Fill(out, at, value)) => B::float_mask_fill(out, at, Scalar::Float(value)),
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

/// A maximum or minimum along `dim` (keeping it) or of everything ([`reduced`]), with
/// `infinity` (`-inf` for a maximum, `+inf` for a minimum) where every element reduced is
/// that infinity: CubeCL's kernels start from the dtype's lowest (highest) finite value and
/// return it for a row of `-inf` (`+inf`); Flex and PyTorch return the infinity. One more
/// reduction, of a mask, off Flex.
pub(crate) fn extreme<B: Backend>(
    x: FloatTensor<B>,
    dim: Option<usize>,
    infinity: f64,
    op: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    if super::on_flex::<B>() {
        return reduced::<B>(x, dim, op);
    }
    let at = equal_at::<B>(&x, infinity);
    let all = match dim {
        Some(dim) => B::bool_all_dim(at, dim),
        None => B::bool_all(at),
    };
    with_value::<B>(reduced::<B>(x, dim, op), all, infinity)
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
    let windows = pool(ones_at::<B>(x, nan_at::<B>(x)));
    with_nan::<B>(out, counted::<B>(windows))
}

/// A scan along `dim`: NaN from the first NaN on.
fn scanned<B: Backend>(
    x: FloatTensor<B>,
    dim: usize,
    op: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    let seen = B::float_cumsum(ones_at::<B>(&x, nan_at::<B>(&x)), dim);
    with_nan::<B>(op(x), counted::<B>(seen))
}

pub(crate) fn relu<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    elementwise_node::<B, _>(tensor, Activation::Relu)
}

pub(crate) fn sigmoid<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    elementwise_node::<B, _>(tensor, Activation::Sigmoid)
}

/// `relu` and `sigmoid`, NaN where the input is. Above a listed autodiff backend they are
/// [nodes of `Amp`'s own](super::elementwise_node) rather than burn-autodiff's with the value
/// filled in: theirs are memory-bound, so a later op that reads the output back (the product in
/// SiLU, `w`'s gradient in `relu(x) · w`) gets it recomputed by the backend's kernel, which
/// hides the NaN again (measured: Flex's `relu`, wgpu's `sigmoid`).
///
/// `relu` is one pass: on Flex its `clamp` to `[0, inf]` (Rust's, which keeps a NaN; Flex's
/// `relu` is `max`, which does not), elsewhere Burn's default composition, `x` filled with 0
/// where `x <= 0` (false at a NaN), which CubeCL runs as its `relu` already. Its gradient is
/// the backend's `relu_backward` given the input, as burn-autodiff's node gives it, nothing
/// recomputed: the rule at a NaN is the backend's (Burn's default and PyTorch's: the gradient
/// passes; Flex's: 0). `sigmoid` is the backend's kernel with the NaN filled in off Flex
/// (Flex's keeps it); its gradient is computed from that output (NaN there, as PyTorch's).
#[derive(Debug, Clone, Copy)]
enum Activation {
    Relu,
    Sigmoid,
}

impl Elementwise for Activation {
    fn forward<X: Backend>(self, x: FloatTensor<X>) -> FloatTensor<X> {
        match self {
            // Flex's own kernel (under an autodiff backend `Amp` does not list, the clamp's
            // gradient would pass at 0, where `relu`'s is 0).
            Activation::Relu if super::on_flex::<X>() && !X::ad_enabled(&X::float_device(&x)) => {
                X::float_clamp(x, Scalar::Float(0.0), Scalar::Float(f64::INFINITY))
            }
            Activation::Relu => {
                let at_most_zero =
                    X::float_lower_equal_elem(x.clone(), Scalar::Float(0.0), bools::<X>(&x));
                X::float_mask_fill(x, at_most_zero, Scalar::Float(0.0))
            }
            Activation::Sigmoid if super::on_flex::<X>() => X::sigmoid(x),
            Activation::Sigmoid => {
                let at = nan_at::<X>(&x);
                X::float_mask_fill(X::sigmoid(x), at, Scalar::Float(f64::NAN))
            }
        }
    }

    fn backward<X: Backend>(self, x: FloatTensor<X>, grad: FloatTensor<X>) -> FloatTensor<X> {
        match self {
            Activation::Relu => X::relu_backward(x, grad),
            Activation::Sigmoid => X::sigmoid_backward(self.forward::<X>(x), grad),
        }
    }
}

pub(crate) fn hard_sigmoid<B: Backend>(
    tensor: FloatTensor<B>,
    alpha: Scalar,
    beta: Scalar,
) -> FloatTensor<B> {
    clamped::<B>(tensor, |t| B::hard_sigmoid(t, alpha, beta))
}

pub(crate) fn float_clamp<B: Backend>(
    tensor: FloatTensor<B>,
    min: Scalar,
    max: Scalar,
) -> FloatTensor<B> {
    clamped::<B>(tensor, |t| B::float_clamp(t, min, max))
}

pub(crate) fn float_clamp_min<B: Backend>(tensor: FloatTensor<B>, min: Scalar) -> FloatTensor<B> {
    clamped::<B>(tensor, |t| B::float_clamp_min(t, min))
}

pub(crate) fn float_clamp_max<B: Backend>(tensor: FloatTensor<B>, max: Scalar) -> FloatTensor<B> {
    clamped::<B>(tensor, |t| B::float_clamp_max(t, max))
}

/// A clamp (`hard_sigmoid` is one of `a x + b`): NaN where `x` is. Above autodiff there is
/// nothing to fill: burn-autodiff composes clamps from a comparison and a fill, false at a NaN,
/// which keeps it (their backward too, recomputed or not); the backends' own kernels below it
/// are what hide it (Flex's `max` and `min`, CubeCL's `clamp`).
fn clamped<B: Backend>(
    x: FloatTensor<B>,
    op: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    if B::ad_enabled(&B::float_device(&x)) {
        op(x)
    } else {
        elementwise::<B>(x, op)
    }
}

/// Where either of two masks of a binary op ([`ones_at`]) is 1: `a` of the shape of its left
/// input, `b` of its right, broadcast to its output's.
fn either<B: Backend>(a: FloatTensor<B>, b: FloatTensor<B>) -> BoolTensor<B> {
    counted::<B>(B::float_add(a, b))
}

/// `atan2(lhs, rhs)`: NaN where either is (CubeCL gives 0).
pub(crate) fn float_atan2<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    binary_node::<B, _>(lhs, rhs, Atan2)
}

/// `atan2(y, x)` with its NaN, as a node of `Amp`'s own for the reason [`Activation`] is one:
/// on wgpu Burn's recomputation happened to keep the NaN (the kernel fused with the product
/// that reads it back), which nothing promises on another backend or grouping. The backward
/// is Burn's and PyTorch's, `x / (x² + y²)` and `-y / (x² + y²)`, with squares as products
/// (CubeCL's `powi_scalar` turns a NaN into 0).
#[derive(Debug, Clone, Copy)]
struct Atan2;

impl Atan2 {
    /// `x² + y²`, broadcast.
    fn squared_norm<X: Backend>(y: FloatTensor<X>, x: FloatTensor<X>) -> FloatTensor<X> {
        X::float_add(X::float_mul(x.clone(), x), X::float_mul(y.clone(), y))
    }
}

impl BinaryElementwise for Atan2 {
    fn forward<X: Backend>(self, y: FloatTensor<X>, x: FloatTensor<X>) -> FloatTensor<X> {
        let at = either::<X>(
            ones_at::<X>(&y, nan_at::<X>(&y)),
            ones_at::<X>(&y, nan_at::<X>(&x)),
        );
        X::float_mask_fill(X::float_atan2(y, x), at, Scalar::Float(f64::NAN))
    }

    fn backward_lhs<X: Backend>(
        self,
        y: FloatTensor<X>,
        x: FloatTensor<X>,
        grad: FloatTensor<X>,
    ) -> FloatTensor<X> {
        let norm = Self::squared_norm::<X>(y, x.clone());
        X::float_mul(grad, X::float_div(x, norm))
    }

    fn backward_rhs<X: Backend>(
        self,
        y: FloatTensor<X>,
        x: FloatTensor<X>,
        grad: FloatTensor<X>,
    ) -> FloatTensor<X> {
        let norm = Self::squared_norm::<X>(y.clone(), x);
        X::float_mul(grad, X::float_neg(X::float_div(y, norm)))
    }
}

/// `lhs` to the power `rhs`, IEEE's `pow` (and PyTorch's) where a NaN is in: NaN where `lhs`
/// is, but 1 for the 0th power (CubeCL gives 0 for `NaN^0.5`); NaN where `rhs` is, but 1 for
/// a base of 1 (CubeCL: NaN). Both fills only touch elements with a NaN input: on a backend
/// `Amp` does not list, a fill is a tracked op whose gradient is 0 where it fills. The value
/// of [`powers`](super::powers)' node.
pub(super) fn powf<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    let is = |x: &FloatTensor<B>, value: f64| ones_at::<B>(&lhs, equal_at::<B>(x, value));
    let (zeroth, of_one) = (is(&rhs, 0.0), is(&lhs, 1.0));
    let (nan_base, nan_exponent) = (
        ones_at::<B>(&lhs, nan_at::<B>(&lhs)),
        ones_at::<B>(&lhs, nan_at::<B>(&rhs)),
    );
    // Broadcast products of the two sides' masks: `a · b` where both, `a - a · b` where `a`
    // alone.
    let both = |a: &FloatTensor<B>, b: &FloatTensor<B>| B::float_mul(a.clone(), b.clone());
    let (nan_to_0th, one_to_nan) = (both(&nan_base, &zeroth), both(&of_one, &nan_exponent));
    let at = either::<B>(
        B::float_sub(nan_base, nan_to_0th.clone()),
        B::float_sub(nan_exponent, one_to_nan.clone()),
    );
    let ones = either::<B>(nan_to_0th, one_to_nan);
    let out = with_nan::<B>(negative_powers::float_powf::<B>(lhs, rhs), at);
    with_value::<B>(out, ones, 1.0)
}

/// `tensor` where it is a number, `+inf` where it is NaN: the order in which PyTorch ranks a
/// NaN (above every number) for a top-k. CubeCL's top-k passes over a NaN (the row's top
/// value of `[1, NaN, -2, 0.5]` comes out 0.5).
/// Detached: only its ranking is used, and under autodiff a tracked fill would keep its mask
/// for a backward that never comes.
pub(crate) fn nan_ranked_first<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    let tensor = B::float_detach(tensor);
    let at = nan_at::<B>(&tensor);
    B::float_mask_fill(tensor, at, Scalar::Float(f64::INFINITY))
}

/// `op`, a power of `tensor` to `exponent`: NaN where `tensor` is, but for the 0th power (1,
/// IEEE's `pow` and PyTorch's); a negative one [as a reciprocal](negative_powers) on wgpu.
/// The value of [`powers`](super::powers)' node.
pub(super) fn power<B: Backend>(
    tensor: FloatTensor<B>,
    exponent: Scalar,
    op: impl FnOnce(FloatTensor<B>, Scalar) -> FloatTensor<B>,
) -> FloatTensor<B> {
    let op = |t| negative_powers::scalar::<B>(t, exponent, op);
    match exponent.elem::<f64>() == 0.0 {
        true => op(tensor),
        false => elementwise::<B>(tensor, op),
    }
}

pub(crate) fn float_cummax<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    scanned::<B>(tensor, dim, |t| B::float_cummax(t, dim))
}

pub(crate) fn float_cummin<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    scanned::<B>(tensor, dim, |t| B::float_cummin(t, dim))
}
