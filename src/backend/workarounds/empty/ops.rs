//! The ops with a result of their own shape rule on empty tensors (see the module docs
//! above): creation, casts, matmul, linear, picks, writes of nothing.

use burn_backend::tensor::{BoolTensor, Device, FloatTensor, IntTensor};
use burn_backend::{Backend, Distribution, Scalar, TensorMetadata};
use burn_std::{BoolDType, FloatDType, IntDType, Shape, Slice};

use super::{Fill, broadcast, constant, float_dtype, is_empty, unchanged};

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
    B::float_matmul(lhs, rhs)
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
    B::linear(x, weight, bias)
}

/// A pick of no index, or from an empty tensor: empty, the picked shape.
pub(crate) fn picked<B: Backend>(
    tensor: FloatTensor<B>,
    indices: &IntTensor<B>,
    shape: impl FnOnce(&Shape, &Shape) -> Shape,
) -> Result<FloatTensor<B>, FloatTensor<B>> {
    let index_shape = indices.shape();
    if index_shape.num_elements() > 0 && !is_empty(&tensor) {
        return Err(tensor);
    }
    let shape = shape(&tensor.shape(), &index_shape);
    if shape.num_elements() > 0 {
        return Err(tensor);
    }
    let dtype = float_dtype(tensor.dtype());
    Ok(constant::<B>(vec![tensor], shape, dtype, Fill::Empty))
}

/// `embedding(weights [n, d], indices [..])`: `[.., d]`.
pub(crate) fn embedding<B: Backend>(
    weights: FloatTensor<B>,
    indices: IntTensor<B>,
) -> FloatTensor<B> {
    match picked::<B>(weights, &indices, |w, i| {
        let mut dims = i.as_slice().to_vec();
        dims.push(w[w.num_dims() - 1]);
        Shape::from(dims)
    }) {
        Ok(out) => out,
        Err(weights) => B::embedding(weights, indices),
    }
}

/// An int pick of no index, or from an empty tensor: empty.
fn int_picked<B: Backend>(tensor: &IntTensor<B>, shape: Shape) -> Option<IntTensor<B>> {
    (shape.num_elements() == 0)
        .then(|| B::int_empty(shape, &B::int_device(tensor), tensor.dtype().into()))
}

pub(crate) fn int_select<B: Backend>(
    tensor: IntTensor<B>,
    dim: usize,
    indices: IntTensor<B>,
) -> IntTensor<B> {
    let (mut shape, index_shape) = (tensor.shape(), indices.shape());
    if shape.num_elements() == 0 || index_shape.num_elements() == 0 {
        shape[dim] = index_shape[0];
        if let Some(out) = int_picked::<B>(&tensor, shape) {
            return out;
        }
    }
    B::int_select(tensor, dim, indices)
}

pub(crate) fn int_gather<B: Backend>(
    dim: usize,
    tensor: IntTensor<B>,
    indices: IntTensor<B>,
) -> IntTensor<B> {
    match int_picked::<B>(&tensor, indices.shape()) {
        Some(out) => out,
        None => B::int_gather(dim, tensor, indices),
    }
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

/// `select_add`, `scatter_add` and `slice_assign` of an empty `value`: the tensor unchanged
/// (what `value` came from stays in the graph).
macro_rules! writes_of_nothing {
    ($($name:ident([$($before:ident: $bty:ty),*] tensor [$($after:ident: $aty:ty),*]);)*) => {$(
        pub(crate) fn $name<B: Backend>(
            $($before: $bty,)*
            tensor: FloatTensor<B>,
            $($after: $aty,)*
            value: FloatTensor<B>,
        ) -> FloatTensor<B> {
            if is_empty(&value) {
                return unchanged::<B>(tensor, value);
            }
            B::$name($($before,)* tensor, $($after,)* value)
        }
    )*};
}

writes_of_nothing! {
    float_select_add([] tensor [dim: usize, indices: IntTensor<B>]);
    float_scatter_add([dim: usize] tensor [indices: IntTensor<B>]);
    float_slice_assign([] tensor [slices: &[Slice]]);
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
