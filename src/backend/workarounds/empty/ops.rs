//! The ops with a result of their own shape rule on empty tensors (see the module docs
//! above): creation, casts, matmul, linear.

use burn_backend::tensor::{BoolTensor, Device, FloatTensor, IntTensor};
use burn_backend::{Backend, Distribution, Scalar, TensorMetadata};
use burn_std::{BoolDType, FloatDType, IntDType, Shape};

use super::super::half_sums::{self, Summed};
use super::{Fill, broadcast, constant, float_dtype, is_empty};

/// Creation ops: an empty shape is an allocation (`*_empty`), not a fill kernel.
macro_rules! created {
    ($($name:ident($($extra:ident: $ty:ty),*) -> $out:ident<B>, $dtype:ty, $empty:ident;)*) => {$(
        pub(crate) fn $name<B: Backend>(
            shape: Shape,
            $($extra: $ty,)*
            device: &Device<B>,
            dtype: $dtype,
        ) -> $out<B> {
            if shape.num_elements() == 0 {
                return B::$empty(shape, device, dtype);
            }
            B::$name(shape, $($extra,)* device, dtype)
        }
    )*};
}

created! {
    float_zeros() -> FloatTensor<B>, FloatDType, float_empty;
    float_ones() -> FloatTensor<B>, FloatDType, float_empty;
    float_full(fill_value: Scalar) -> FloatTensor<B>, FloatDType, float_empty;
    float_random(distribution: Distribution) -> FloatTensor<B>, FloatDType, float_empty;
    int_zeros() -> IntTensor<B>, IntDType, int_empty;
    int_ones() -> IntTensor<B>, IntDType, int_empty;
    int_full(fill_value: Scalar) -> IntTensor<B>, IntDType, int_empty;
    int_random(distribution: Distribution) -> IntTensor<B>, IntDType, int_empty;
    bool_zeros() -> BoolTensor<B>, BoolDType, bool_empty;
    bool_ones() -> BoolTensor<B>, BoolDType, bool_empty;
}

pub(crate) fn float_cast<B: Backend>(tensor: FloatTensor<B>, dtype: FloatDType) -> FloatTensor<B> {
    if is_empty(&tensor) && float_dtype(tensor.dtype()) != dtype {
        let shape = tensor.shape();
        return constant::<B>(vec![tensor], shape, dtype, Fill::Empty);
    }
    B::float_cast(tensor, dtype)
}

/// `[.., m, k] @ [.., k, n]`: empty when a batch dimension, `m` or `n` is 0; zeros when only
/// `k` is.
pub(crate) fn float_matmul<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    if (is_empty(&lhs) || is_empty(&rhs))
        && let Some(shape) = matmul_shape(&lhs.shape(), &rhs.shape())
    {
        let dtype = float_dtype(lhs.dtype());
        return constant::<B>(vec![lhs, rhs], shape, dtype, Fill::Value(0.0));
    }
    if half_sums::matmul_sums_in_half::<B>(lhs.dtype()) {
        return half_sums::summed::<B>(Summed::Matmul, lhs, rhs, None);
    }
    B::float_matmul(lhs, rhs)
}

/// The int matmul: as the float one.
pub(crate) fn int_matmul<B: Backend>(lhs: IntTensor<B>, rhs: IntTensor<B>) -> IntTensor<B> {
    if (is_empty(&lhs) || is_empty(&rhs))
        && let Some(shape) = matmul_shape(&lhs.shape(), &rhs.shape())
    {
        let (device, dtype) = (B::int_device(&lhs), lhs.dtype().into());
        return match shape.num_elements() {
            0 => B::int_empty(shape, &device, dtype),
            _ => B::int_zeros(shape, &device, dtype),
        };
    }
    B::int_matmul(lhs, rhs)
}

fn matmul_shape(lhs: &Shape, rhs: &Shape) -> Option<Shape> {
    let rank = lhs.num_dims();
    if rank < 2 || rhs.num_dims() != rank || lhs[rank - 1] != rhs[rank - 2] {
        return None;
    }
    let lhs_batch = Shape::from(lhs.as_slice()[..rank - 2].to_vec());
    let rhs_batch = Shape::from(rhs.as_slice()[..rank - 2].to_vec());
    let mut dims = if rank > 2 {
        broadcast(&[lhs_batch, rhs_batch])?.as_slice().to_vec()
    } else {
        Vec::new()
    };
    dims.extend([lhs[rank - 2], rhs[rank - 1]]);
    Some(Shape::from(dims))
}

/// `x @ weight (+ bias)`, `weight` `[d_in, d_out]`.
pub(crate) fn linear<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let (x_shape, w_shape) = (x.shape(), weight.shape());
    let rank = x_shape.num_dims();
    if (is_empty(&x) || is_empty(&weight))
        && w_shape.num_dims() == 2
        && x_shape[rank - 1] == w_shape[0]
    {
        let mut dims = x_shape.as_slice().to_vec();
        dims[rank - 1] = w_shape[1];
        let shape = Shape::from(dims);
        let dtype = float_dtype(x.dtype());
        if shape.num_elements() == 0 {
            let mut inputs = vec![x, weight];
            inputs.extend(bias);
            return constant::<B>(inputs, shape, dtype, Fill::Empty);
        }
        // Only the inner dimension is empty: the bias alone.
        let zeros = constant::<B>(vec![x, weight], shape, dtype, Fill::Value(0.0));
        return match bias {
            Some(bias) => B::float_add(zeros, bias),
            None => zeros,
        };
    }
    if half_sums::matmul_sums_in_half::<B>(x.dtype()) {
        return half_sums::summed::<B>(Summed::Linear, x, weight, bias);
    }
    B::linear(x, weight, bias)
}

/// An empty float tensor as ints: empty.
pub(crate) fn float_into_int<B: Backend>(
    tensor: FloatTensor<B>,
    out_dtype: IntDType,
) -> IntTensor<B> {
    if is_empty(&tensor) {
        return B::int_empty(tensor.shape(), &B::float_device(&tensor), out_dtype);
    }
    B::float_into_int(tensor, out_dtype)
}

/// An empty result of `shape` over `tensor`, in its dtype.
pub(super) fn empty_like<B: Backend>(tensor: FloatTensor<B>, shape: Shape) -> FloatTensor<B> {
    let dtype = float_dtype(tensor.dtype());
    constant::<B>(vec![tensor], shape, dtype, Fill::Empty)
}

/// The empty result of a max or min and its empty indices.
pub(super) fn with_indices<B: Backend>(
    tensor: FloatTensor<B>,
    shape: Shape,
    indices_dtype: IntDType,
) -> (FloatTensor<B>, IntTensor<B>) {
    let indices = B::int_empty(shape.clone(), &B::float_device(&tensor), indices_dtype);
    (empty_like::<B>(tensor, shape), indices)
}

#[cfg(test)]
mod tests {
    use super::super::tests::s;
    use super::*;

    #[test]
    fn matmul_shapes() {
        assert_eq!(matmul_shape(&s(&[0, 8]), &s(&[8, 4])), Some(s(&[0, 4])));
        assert_eq!(matmul_shape(&s(&[3, 0]), &s(&[0, 4])), Some(s(&[3, 4])));
        assert_eq!(
            matmul_shape(&s(&[2, 1, 0, 8]), &s(&[1, 5, 8, 4])),
            Some(s(&[2, 5, 0, 4]))
        );
        assert_eq!(matmul_shape(&s(&[0, 8]), &s(&[7, 4])), None);
    }
}
