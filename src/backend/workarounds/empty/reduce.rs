//! Reductions and orderings of empty tensors, float, int and bool (see the module docs above).
//!
//! A reduction keeps its dimension (Burn's rule). Along a dimension that is not the empty one
//! its result is empty too; over nothing it is PyTorch's value: the sum 0, the product 1, the
//! float mean NaN, `any` false, `all` true. Where there is none (a max, an argmax, the mean of
//! ints) a panic says so, as PyTorch raises, rather than the backend's refused launch. A sort,
//! an argsort or a top-k of an empty tensor is empty, as is a top-0 of any tensor.

use burn_backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn_backend::{Backend, TensorMetadata};
use burn_std::{BoolDType, IntDType, Shape};

use super::super::{flex_views, nan, products};
use super::ops::{empty_like, with_indices};
use super::{Fill, constant, float_dtype};

/// What a reduction of an empty tensor gives.
enum Reduced {
    /// An empty result of this shape: the tensor is empty along another dimension.
    Empty(Shape),
    /// A result of this shape over nothing: the op's identity.
    OverNothing(Shape),
}

/// The reduction of a tensor of `shape` along `dim` (`None`: all of it, `[1]`), `None` when
/// the tensor is not empty (then `B` runs the op).
fn reduced(shape: &Shape, dim: Option<usize>) -> Option<Reduced> {
    if shape.num_elements() > 0 {
        return None;
    }
    let out = match dim {
        Some(dim) => {
            let mut out = shape.clone();
            out[dim] = 1;
            out
        }
        None => Shape::from(vec![1]),
    };
    Some(match out.num_elements() {
        0 => Reduced::Empty(out),
        _ => Reduced::OverNothing(out),
    })
}

/// A reduction without an identity (a max, an argmax, the mean of ints) of a tensor of
/// `shape`: its empty result's shape, `None` when the tensor is not empty, a panic over
/// nothing.
fn without_identity(shape: &Shape, dim: Option<usize>, op: &str) -> Option<Shape> {
    match reduced(shape, dim)? {
        Reduced::Empty(out) => Some(out),
        Reduced::OverNothing(_) => {
            let along = dim
                .map(|d| format!(" along dimension {d}"))
                .unwrap_or_default();
            panic!(
                "{op}{along} of an empty tensor of shape {shape:?}: it has no value (PyTorch \
                 raises the same); skip or mask empty inputs before it"
            )
        }
    }
}

/// A float reduction with an identity: `B`'s (`inner`) unless the tensor is empty.
fn float_reduced<B: Backend>(
    tensor: FloatTensor<B>,
    dim: Option<usize>,
    identity: f64,
    inner: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    match reduced(&tensor.shape(), dim) {
        None => inner(tensor),
        Some(Reduced::Empty(out)) => empty_like::<B>(tensor, out),
        Some(Reduced::OverNothing(out)) => {
            let dtype = float_dtype(tensor.dtype());
            constant::<B>(vec![tensor], out, dtype, Fill::Value(identity))
        }
    }
}

/// An int reduction: `B`'s (`inner`) unless the tensor is empty; over nothing `identity`, or a
/// panic where there is none.
fn int_reduced<B: Backend>(
    tensor: IntTensor<B>,
    dim: Option<usize>,
    identity: Result<i64, &str>,
    inner: impl FnOnce(IntTensor<B>) -> IntTensor<B>,
) -> IntTensor<B> {
    let shape = tensor.shape();
    let out = match identity {
        Ok(_) => match reduced(&shape, dim) {
            None => return inner(tensor),
            Some(Reduced::Empty(out) | Reduced::OverNothing(out)) => out,
        },
        Err(op) => match without_identity(&shape, dim, op) {
            None => return inner(tensor),
            Some(out) => out,
        },
    };
    let (device, dtype) = (B::int_device(&tensor), tensor.dtype().into());
    match identity {
        Ok(value) if out.num_elements() > 0 => B::int_full(out, value.into(), &device, dtype),
        _ => B::int_empty(out, &device, dtype),
    }
}

/// `any` (identity false) or `all` (true) of a tensor of `shape`: `None` when it is not empty.
fn bool_reduced<B: Backend>(
    shape: &Shape,
    dim: Option<usize>,
    identity: bool,
    device: &B::Device,
    dtype: BoolDType,
) -> Option<BoolTensor<B>> {
    Some(match reduced(shape, dim)? {
        Reduced::Empty(out) => B::bool_empty(out, device, dtype),
        Reduced::OverNothing(out) if identity => B::bool_ones(out, device, dtype),
        Reduced::OverNothing(out) => B::bool_zeros(out, device, dtype),
    })
}

pub(crate) fn float_sum<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    float_reduced::<B>(tensor, None, 0.0, B::float_sum)
}

pub(crate) fn float_sum_dim<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    float_reduced::<B>(tensor, Some(dim), 0.0, |t| {
        flex_views::float_sum_dim::<B>(t, dim)
    })
}

/// The mean of nothing: NaN (PyTorch's too).
pub(crate) fn float_mean<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    float_reduced::<B>(tensor, None, f64::NAN, B::float_mean)
}

pub(crate) fn float_mean_dim<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    float_reduced::<B>(tensor, Some(dim), f64::NAN, |t| {
        flex_views::float_mean_dim::<B>(t, dim)
    })
}

pub(crate) fn float_prod<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    float_reduced::<B>(tensor, None, 1.0, products::float_prod::<B>)
}

pub(crate) fn float_prod_dim<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    float_reduced::<B>(tensor, Some(dim), 1.0, |t| {
        products::float_prod_dim::<B>(t, dim)
    })
}

/// Float maxima and minima: an empty result along a dimension that is not the empty one.
macro_rules! float_extremes {
    ($($name:ident($($dim:ident)?) $op:literal;)*) => {$(
        pub(crate) fn $name<B: Backend>(tensor: FloatTensor<B>, $($dim: usize)?) -> FloatTensor<B> {
            let dim = None$(.or(Some($dim)))?;
            match without_identity(&tensor.shape(), dim, $op) {
                Some(out) => empty_like::<B>(tensor, out),
                None => {
                    let op = |t| B::$name(t, $($dim)?);
                    match $op {
                        "max" => nan::extreme::<B>(tensor, dim, f64::NEG_INFINITY, op),
                        "min" => nan::extreme::<B>(tensor, dim, f64::INFINITY, op),
                        _ => nan::reduced::<B>(tensor, dim, op),
                    }
                }
            }
        }
    )*};
}

float_extremes! {
    float_max() "max";
    float_min() "min";
    float_max_abs() "max_abs";
    float_max_dim(dim) "max";
    float_min_dim(dim) "min";
    float_max_abs_dim(dim) "max_abs";
}

/// A max or min along `dim` with its indices.
macro_rules! float_extremes_with_indices {
    ($($name:ident $op:literal;)*) => {$(
        pub(crate) fn $name<B: Backend>(
            tensor: FloatTensor<B>,
            dim: usize,
            indices_dtype: IntDType,
        ) -> (FloatTensor<B>, IntTensor<B>) {
            match without_identity(&tensor.shape(), Some(dim), $op) {
                Some(out) => with_indices::<B>(tensor, out, indices_dtype),
                None => {
                    let extremes = B::$name(tensor.clone(), dim, indices_dtype);
                    nan::with_indices::<B>(&tensor, dim, extremes, indices_dtype)
                }
            }
        }
    )*};
}

float_extremes_with_indices! {
    float_max_dim_with_indices "max";
    float_min_dim_with_indices "min";
}

/// `argmax` and `argmin` of floats.
macro_rules! float_arg_extremes {
    ($($name:ident $op:literal;)*) => {$(
        pub(crate) fn $name<B: Backend>(
            tensor: FloatTensor<B>,
            dim: usize,
            out_dtype: IntDType,
        ) -> IntTensor<B> {
            match without_identity(&tensor.shape(), Some(dim), $op) {
                Some(out) => B::int_empty(out, &B::float_device(&tensor), out_dtype),
                None => {
                    let indices = B::$name(tensor.clone(), dim, out_dtype);
                    nan::indices::<B>(&tensor, dim, indices, out_dtype)
                }
            }
        }
    )*};
}

float_arg_extremes! {
    float_argmax "argmax";
    float_argmin "argmin";
}

pub(crate) fn int_sum<B: Backend>(tensor: IntTensor<B>) -> IntTensor<B> {
    int_reduced::<B>(tensor, None, Ok(0), B::int_sum)
}

pub(crate) fn int_sum_dim<B: Backend>(tensor: IntTensor<B>, dim: usize) -> IntTensor<B> {
    int_reduced::<B>(tensor, Some(dim), Ok(0), |t| B::int_sum_dim(t, dim))
}

pub(crate) fn int_prod<B: Backend>(tensor: IntTensor<B>) -> IntTensor<B> {
    int_reduced::<B>(tensor, None, Ok(1), B::int_prod)
}

pub(crate) fn int_prod_dim<B: Backend>(tensor: IntTensor<B>, dim: usize) -> IntTensor<B> {
    int_reduced::<B>(tensor, Some(dim), Ok(1), |t| B::int_prod_dim(t, dim))
}

/// Int reductions without an identity (the mean of ints is an int: of nothing, none).
macro_rules! int_extremes {
    ($($name:ident($($dim:ident)?) $op:literal;)*) => {$(
        pub(crate) fn $name<B: Backend>(tensor: IntTensor<B>, $($dim: usize)?) -> IntTensor<B> {
            int_reduced::<B>(tensor, None$(.or(Some($dim)))?, Err($op), |t| B::$name(t, $($dim)?))
        }
    )*};
}

int_extremes! {
    int_mean() "the mean of ints";
    int_max() "max";
    int_min() "min";
    int_max_abs() "max_abs";
    int_mean_dim(dim) "the mean of ints";
    int_max_dim(dim) "max";
    int_min_dim(dim) "min";
    int_max_abs_dim(dim) "max_abs";
    int_argmax(dim) "argmax";
    int_argmin(dim) "argmin";
}

/// A max or min of ints along `dim` with its indices (in the tensor's dtype, as Burn's).
macro_rules! int_extremes_with_indices {
    ($($name:ident $op:literal;)*) => {$(
        pub(crate) fn $name<B: Backend>(tensor: IntTensor<B>, dim: usize) -> (IntTensor<B>, IntTensor<B>) {
            match without_identity(&tensor.shape(), Some(dim), $op) {
                Some(out) => empty_pair::<B>(&tensor, out),
                None => B::$name(tensor, dim),
            }
        }
    )*};
}

int_extremes_with_indices! {
    int_max_dim_with_indices "max";
    int_min_dim_with_indices "min";
}

/// Two empty int tensors of `shape` in `tensor`'s dtype: values and their indices.
fn empty_pair<B: Backend>(tensor: &IntTensor<B>, shape: Shape) -> (IntTensor<B>, IntTensor<B>) {
    let (device, dtype) = (B::int_device(tensor), tensor.dtype().into());
    (
        B::int_empty(shape.clone(), &device, dtype),
        B::int_empty(shape, &device, dtype),
    )
}

/// `any` (false over nothing) and `all` (true) of float and int tensors.
macro_rules! any_all {
    ($($name:ident($tensor:ident, $device:ident$(, $dim:ident)?) $identity:literal;)*) => {$(
        pub(crate) fn $name<B: Backend>(
            tensor: $tensor<B>,
            $($dim: usize,)?
            out_dtype: BoolDType,
        ) -> BoolTensor<B> {
            let device = B::$device(&tensor);
            bool_reduced::<B>(&tensor.shape(), None$(.or(Some($dim)))?, $identity, &device, out_dtype)
                .unwrap_or_else(|| B::$name(tensor, $($dim,)? out_dtype))
        }
    )*};
}

any_all! {
    float_any(FloatTensor, float_device) false;
    float_all(FloatTensor, float_device) true;
    float_any_dim(FloatTensor, float_device, dim) false;
    float_all_dim(FloatTensor, float_device, dim) true;
    int_any(IntTensor, int_device) false;
    int_all(IntTensor, int_device) true;
    int_any_dim(IntTensor, int_device, dim) false;
    int_all_dim(IntTensor, int_device, dim) true;
}

/// `any` and `all` of bool tensors (in their own bool dtype).
macro_rules! bool_any_all {
    ($($name:ident($($dim:ident)?) $identity:literal;)*) => {$(
        pub(crate) fn $name<B: Backend>(tensor: BoolTensor<B>, $($dim: usize)?) -> BoolTensor<B> {
            let device = B::bool_device(&tensor);
            let dtype = tensor.dtype().into();
            bool_reduced::<B>(&tensor.shape(), None$(.or(Some($dim)))?, $identity, &device, dtype)
                .unwrap_or_else(|| B::$name(tensor, $($dim)?))
        }
    )*};
}

bool_any_all! {
    bool_any() false;
    bool_all() true;
    bool_any_dim(dim) false;
    bool_all_dim(dim) true;
}

/// The shape of the top `k` along `dim` of a tensor of `shape` when it is empty (no kernel
/// needed), `None` otherwise. Of an empty dimension no `k > 0` can be taken: a panic that
/// says so (PyTorch: "selected index k out of range").
fn top_k(shape: &Shape, dim: usize, k: usize) -> Option<Shape> {
    let mut out = shape.clone();
    out[dim] = k;
    if out.num_elements() > 0 && shape.num_elements() == 0 {
        panic!(
            "top {k} along dimension {dim} of an empty tensor of shape {shape:?}: there are \
             not {k} values (PyTorch raises the same); skip empty inputs or take top 0"
        );
    }
    (out.num_elements() == 0).then_some(out)
}

pub(crate) fn float_topk<B: Backend>(
    tensor: FloatTensor<B>,
    dim: usize,
    k: usize,
) -> FloatTensor<B> {
    match top_k(&tensor.shape(), dim, k) {
        Some(out) => empty_like::<B>(tensor, out),
        None => super::super::float_topk_values::<B>(tensor, dim, k),
    }
}

pub(crate) fn float_argtopk<B: Backend>(
    tensor: FloatTensor<B>,
    dim: usize,
    k: usize,
    out_dtype: IntDType,
) -> IntTensor<B> {
    match top_k(&tensor.shape(), dim, k) {
        Some(out) => B::int_empty(out, &B::float_device(&tensor), out_dtype),
        None => super::super::float_argtopk_indices::<B>(tensor, dim, k, out_dtype),
    }
}

pub(crate) fn int_topk<B: Backend>(tensor: IntTensor<B>, dim: usize, k: usize) -> IntTensor<B> {
    match top_k(&tensor.shape(), dim, k) {
        Some(out) => empty_pair::<B>(&tensor, out).0,
        None => B::int_topk(tensor, dim, k),
    }
}

pub(crate) fn int_argtopk<B: Backend>(tensor: IntTensor<B>, dim: usize, k: usize) -> IntTensor<B> {
    match top_k(&tensor.shape(), dim, k) {
        Some(out) => empty_pair::<B>(&tensor, out).1,
        None => super::super::int_argtopk_indices::<B>(tensor, dim, k),
    }
}

pub(crate) fn float_sort_with_indices<B: Backend>(
    tensor: FloatTensor<B>,
    dim: usize,
    descending: bool,
    indices_dtype: IntDType,
) -> (FloatTensor<B>, IntTensor<B>) {
    let shape = tensor.shape();
    if shape.num_elements() == 0 {
        return with_indices::<B>(tensor, shape, indices_dtype);
    }
    B::float_sort_with_indices(tensor, dim, descending, indices_dtype)
}

pub(crate) fn float_argsort<B: Backend>(
    tensor: FloatTensor<B>,
    dim: usize,
    descending: bool,
    out_dtype: IntDType,
) -> IntTensor<B> {
    let shape = tensor.shape();
    if shape.num_elements() == 0 {
        return B::int_empty(shape, &B::float_device(&tensor), out_dtype);
    }
    B::float_argsort(tensor, dim, descending, out_dtype)
}

pub(crate) fn int_sort_with_indices<B: Backend>(
    tensor: IntTensor<B>,
    dim: usize,
    descending: bool,
) -> (IntTensor<B>, IntTensor<B>) {
    let shape = tensor.shape();
    if shape.num_elements() == 0 {
        return empty_pair::<B>(&tensor, shape);
    }
    B::int_sort_with_indices(tensor, dim, descending)
}

pub(crate) fn int_argsort<B: Backend>(
    tensor: IntTensor<B>,
    dim: usize,
    descending: bool,
) -> IntTensor<B> {
    let shape = tensor.shape();
    if shape.num_elements() == 0 {
        return empty_pair::<B>(&tensor, shape).1;
    }
    B::int_argsort(tensor, dim, descending)
}

#[cfg(test)]
mod tests {
    use super::super::tests::s;
    use super::*;

    #[test]
    fn reductions_of_empty_shapes() {
        let kind = |r: Option<Reduced>| match r {
            None => "runs",
            Some(Reduced::Empty(_)) => "empty",
            Some(Reduced::OverNothing(_)) => "over nothing",
        };
        assert_eq!(kind(reduced(&s(&[3, 4]), Some(0))), "runs");
        assert_eq!(kind(reduced(&s(&[0, 4]), Some(1))), "empty");
        assert_eq!(kind(reduced(&s(&[0, 4]), Some(0))), "over nothing");
        assert_eq!(kind(reduced(&s(&[0, 4]), None)), "over nothing");
        assert_eq!(
            without_identity(&s(&[0, 4]), Some(1), "max"),
            Some(s(&[0, 1]))
        );
        assert_eq!(without_identity(&s(&[2, 4]), None, "max"), None);
    }

    #[test]
    fn top_k_shapes() {
        assert_eq!(top_k(&s(&[0, 4]), 1, 2), Some(s(&[0, 2])));
        assert_eq!(top_k(&s(&[3, 4]), 1, 0), Some(s(&[3, 0])));
        assert_eq!(top_k(&s(&[3, 4]), 1, 2), None);
        assert_eq!(top_k(&s(&[3, 0]), 1, 0), Some(s(&[3, 0])));
        let taken = std::panic::catch_unwind(|| top_k(&s(&[3, 0]), 1, 2));
        assert!(taken.is_err(), "top 2 of nothing");
    }
}
