//! Picks, writes and concatenations on empty tensors, float, int and bool (see the module docs
//! above).
//!
//! A pick (`select`, `gather`, `gather_nd`, `embedding`) of no index, or from an empty tensor,
//! has an empty result, made here. A write of an empty value (`select_add`, `scatter_add`,
//! `scatter_nd`, `slice_assign`, the bool `or` writes) leaves the tensor as it is. A `cat` with
//! an empty result is made here, and pieces without elements are left out of one that is not:
//! CubeCL's `cat` is a `slice_assign` per piece, and Burn's `Tensor::cat` leaves out only the
//! pieces empty along the cat dimension, so `[0, 4]` and `[0, 3]` along dimension 1 (an empty
//! batch) reach a zero grid.

use burn_backend::tensor::{BoolTensor, FloatTensor, IndexingUpdateOp, IntTensor};
use burn_backend::{Backend, TensorMetadata};
use burn_std::{Shape, Slice};

use super::super::nd;
use super::is_empty;
use super::kind::{Bool, Float, Int, Kind};

/// A pick from `tensor` at `indices` whose result, of shape `rule(tensor, indices)`, is empty:
/// that result (`Ok`); else `tensor` back, for `B`'s op.
fn pick<B: Backend, K: Kind<B>>(
    tensor: K::Tensor,
    indices: &IntTensor<B>,
    rule: impl FnOnce(&Shape, &Shape) -> Shape,
) -> Result<K::Tensor, K::Tensor> {
    let index_shape = indices.shape();
    if index_shape.num_elements() > 0 && !is_empty(&tensor) {
        return Err(tensor);
    }
    let shape = rule(&tensor.shape(), &index_shape);
    if shape.num_elements() > 0 {
        return Err(tensor);
    }
    Ok(K::empty_over(vec![tensor], shape))
}

/// [`pick`] of a float tensor.
pub(crate) fn picked<B: Backend>(
    tensor: FloatTensor<B>,
    indices: &IntTensor<B>,
    rule: impl FnOnce(&Shape, &Shape) -> Shape,
) -> Result<FloatTensor<B>, FloatTensor<B>> {
    pick::<B, Float>(tensor, indices, rule)
}

// The shape rules of the picks, as Burn's.

/// `select` along `dim`: the tensor's shape, `dim` as long as the indices.
pub(crate) fn selected(dim: usize) -> impl Fn(&Shape, &Shape) -> Shape {
    move |tensor, indices| {
        let mut shape = tensor.clone();
        shape[dim] = indices.num_elements();
        shape
    }
}

/// `gather`: the indices' shape.
pub(crate) fn gathered(_: &Shape, indices: &Shape) -> Shape {
    indices.clone()
}

/// `gather_nd`, indices `[.., k]` into data of rank `k` or more: `[.., data[k..]]`.
fn gathered_nd(data: &Shape, indices: &Shape) -> Shape {
    let (batch, k) = indices.as_slice().split_at(indices.num_dims() - 1);
    let mut dims = batch.to_vec();
    dims.extend_from_slice(&data.as_slice()[k[0]..]);
    Shape::from(dims)
}

/// Whether `gather_nd`'s shape rule applies (else `B` reports the misuse).
fn gather_nd_fits(data: &Shape, indices: &Shape) -> bool {
    indices.num_dims() >= 1 && indices[indices.num_dims() - 1] <= data.num_dims()
}

/// `embedding(weights [n, d], indices [..])`: `[.., d]`.
fn embedded(weights: &Shape, indices: &Shape) -> Shape {
    let mut dims = indices.as_slice().to_vec();
    dims.push(weights[weights.num_dims() - 1]);
    Shape::from(dims)
}

pub(crate) fn embedding<B: Backend>(
    weights: FloatTensor<B>,
    indices: IntTensor<B>,
) -> FloatTensor<B> {
    picked::<B>(weights, &indices, embedded).unwrap_or_else(|w| B::embedding(w, indices))
}

pub(crate) fn float_gather_nd<B: Backend>(
    data: FloatTensor<B>,
    indices: IntTensor<B>,
) -> FloatTensor<B> {
    if !gather_nd_fits(&data.shape(), &indices.shape()) {
        return B::float_gather_nd(data, indices);
    }
    picked::<B>(data, &indices, gathered_nd)
        .unwrap_or_else(|d| nd::float_gather_nd::<B>(d, indices))
}

pub(crate) fn int_gather_nd<B: Backend>(data: IntTensor<B>, indices: IntTensor<B>) -> IntTensor<B> {
    if !gather_nd_fits(&data.shape(), &indices.shape()) {
        return B::int_gather_nd(data, indices);
    }
    pick::<B, Int>(data, &indices, gathered_nd)
        .unwrap_or_else(|d| nd::int_gather_nd::<B>(d, indices))
}

pub(crate) fn int_select<B: Backend>(
    tensor: IntTensor<B>,
    dim: usize,
    indices: IntTensor<B>,
) -> IntTensor<B> {
    pick::<B, Int>(tensor, &indices, selected(dim))
        .unwrap_or_else(|t| B::int_select(t, dim, indices))
}

pub(crate) fn int_gather<B: Backend>(
    dim: usize,
    tensor: IntTensor<B>,
    indices: IntTensor<B>,
) -> IntTensor<B> {
    pick::<B, Int>(tensor, &indices, gathered).unwrap_or_else(|t| B::int_gather(dim, t, indices))
}

pub(crate) fn bool_select<B: Backend>(
    tensor: BoolTensor<B>,
    dim: usize,
    indices: IntTensor<B>,
) -> BoolTensor<B> {
    pick::<B, Bool>(tensor, &indices, selected(dim))
        .unwrap_or_else(|t| B::bool_select(t, dim, indices))
}

pub(crate) fn bool_gather<B: Backend>(
    dim: usize,
    tensor: BoolTensor<B>,
    indices: IntTensor<B>,
) -> BoolTensor<B> {
    pick::<B, Bool>(tensor, &indices, gathered).unwrap_or_else(|t| B::bool_gather(dim, t, indices))
}

/// Each write of a `value` into a tensor (arguments before the tensor, between it and the
/// value, after the value): with an empty value, the tensor as it is, else the `inner` op.
macro_rules! writes_of_nothing {
    ($($kind:ident($tensor:ident) $name:ident([$($before:ident: $bty:ty),*] tensor [$($between:ident: $mty:ty),*] value [$($after:ident: $aty:ty),*]) else $inner:expr;)*) => {$(
        pub(crate) fn $name<B: Backend>(
            $($before: $bty,)*
            tensor: $tensor<B>,
            $($between: $mty,)*
            value: $tensor<B>,
            $($after: $aty,)*
        ) -> $tensor<B> {
            if is_empty(&value) {
                return <$kind as Kind<B>>::written(tensor, value);
            }
            $inner($($before,)* tensor, $($between,)* value $(, $after)*)
        }
    )*};
}

writes_of_nothing! {
    Float(FloatTensor) float_select_add([] tensor [dim: usize, indices: IntTensor<B>] value []) else B::float_select_add;
    Float(FloatTensor) float_scatter_add([dim: usize] tensor [indices: IntTensor<B>] value []) else B::float_scatter_add;
    Float(FloatTensor) float_scatter_nd([] tensor [indices: IntTensor<B>] value [reduction: IndexingUpdateOp]) else nd::float_scatter_nd::<B>;
    Float(FloatTensor) float_slice_assign([] tensor [slices: &[Slice]] value []) else B::float_slice_assign;
    Int(IntTensor) int_select_add([] tensor [dim: usize, indices: IntTensor<B>] value []) else B::int_select_add;
    Int(IntTensor) int_scatter_add([dim: usize] tensor [indices: IntTensor<B>] value []) else B::int_scatter_add;
    Int(IntTensor) int_scatter_nd([] tensor [indices: IntTensor<B>] value [reduction: IndexingUpdateOp]) else nd::int_scatter_nd::<B>;
    Int(IntTensor) int_slice_assign([] tensor [slices: &[Slice]] value []) else B::int_slice_assign;
    Bool(BoolTensor) bool_select_or([] tensor [dim: usize, indices: IntTensor<B>] value []) else B::bool_select_or;
    Bool(BoolTensor) bool_scatter_or([dim: usize] tensor [indices: IntTensor<B>] value []) else B::bool_scatter_or;
    Bool(BoolTensor) bool_slice_assign([] tensor [slices: &[Slice]] value []) else B::bool_slice_assign;
}

/// `cat` of `tensors` along `dim` when a piece is empty: an empty result made here (`Ok`),
/// else the pieces with elements, for `B`'s op.
fn cat<B: Backend, K: Kind<B>>(
    tensors: Vec<K::Tensor>,
    dim: usize,
) -> Result<K::Tensor, Vec<K::Tensor>> {
    if !tensors.iter().any(is_empty) {
        return Err(tensors);
    }
    let mut shape = tensors[0].shape();
    shape[dim] = tensors.iter().map(|t| t.shape()[dim]).sum();
    if shape.num_elements() == 0 {
        return Ok(K::empty_over(tensors, shape));
    }
    Err(tensors.into_iter().filter(|t| !is_empty(t)).collect())
}

/// [`cat`] of float tensors.
pub(crate) fn float_cat_pieces<B: Backend>(
    tensors: Vec<FloatTensor<B>>,
    dim: usize,
) -> Result<FloatTensor<B>, Vec<FloatTensor<B>>> {
    cat::<B, Float>(tensors, dim)
}

pub(crate) fn int_cat<B: Backend>(tensors: Vec<IntTensor<B>>, dim: usize) -> IntTensor<B> {
    cat::<B, Int>(tensors, dim).unwrap_or_else(|pieces| B::int_cat(pieces, dim))
}

pub(crate) fn bool_cat<B: Backend>(tensors: Vec<BoolTensor<B>>, dim: usize) -> BoolTensor<B> {
    cat::<B, Bool>(tensors, dim).unwrap_or_else(|pieces| B::bool_cat(pieces, dim))
}

#[cfg(test)]
mod tests {
    use super::super::tests::s;
    use super::*;

    #[test]
    fn pick_shapes_follow_burn() {
        assert_eq!(gathered_nd(&s(&[4, 3, 5]), &s(&[0, 2])), s(&[0, 5]));
        assert_eq!(
            gathered_nd(&s(&[4, 3, 5]), &s(&[2, 7, 1])),
            s(&[2, 7, 3, 5])
        );
        assert_eq!(gathered_nd(&s(&[4, 0]), &s(&[6, 1])), s(&[6, 0]));
        assert!(!gather_nd_fits(&s(&[4]), &s(&[6, 2])), "k above the rank");
        assert_eq!(selected(1)(&s(&[2, 5]), &s(&[0])), s(&[2, 0]));
        assert_eq!(embedded(&s(&[10, 4]), &s(&[0, 3])), s(&[0, 3, 4]));
    }
}
