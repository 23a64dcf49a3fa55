//! `gather_nd` and `scatter_nd` as a `select` and a `select_add` on the data with its indexed
//! dimensions flattened into one.
//!
//! Two defects of Burn 0.21 meet here. **CubeCL's `scatter_nd` adds without atomics**: where
//! an index repeats, all but one of its updates are lost (on wgpu, three updates of 1 at one
//! row give 2, ints and floats alike), and burn-autodiff's backward of `gather_nd` is such a
//! `scatter_nd` of the output gradient, so a row picked twice gets one gradient, not two
//! (PyTorch's indexing accumulates them). **burn-autodiff has no int `gather_nd` or
//! `scatter_nd`** (the trait's default, `unimplemented!`): an int lookup by multi-index panics
//! in any model that trains. `select` and `select_add` have neither defect, so `Amp` computes
//! `gather_nd` as a `select` of the flattened data at each index's flat position, and an
//! adding `scatter_nd` as a `select_add` there (the other reductions stay `B`'s: with a
//! repeated index, their result is as undefined in Burn as PyTorch's `index_put_`). The
//! values picked are the same; the flat positions cost a few int ops over the indices.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_backend::tensor::{FloatTensor, IndexingUpdateOp, IntTensor};
use burn_backend::{Backend, Scalar, TensorMetadata};
use burn_std::{Shape, Slice};

use crate::backend::concrete::{Visit, dispatch, moved};

/// The indexing of `data` by `indices` `[.., k]`: the data as `[rows, ..rest]` (its first `k`
/// dimensions flattened), each index's row as `[n]`, and the shapes to give back.
struct Flat<B: Backend> {
    rows: IntTensor<B>,
    /// `[rows, ..data[k..]]`.
    flat_data: Shape,
    /// `[n, ..data[k..]]`, and `[..indices[..-1], ..data[k..]]`: a pick's or an update's.
    flat_picked: Shape,
    picked: Shape,
}

impl<B: Backend> Flat<B> {
    fn new(data: &Shape, indices: IntTensor<B>) -> Self {
        let index_shape = indices.shape();
        let (batch, k) = index_shape.as_slice().split_at(index_shape.num_dims() - 1);
        let (k, n) = (k[0], batch.iter().product::<usize>());
        let (leading, rest) = data.as_slice().split_at(k);
        let with_rest = |first: &[usize]| Shape::from([first, rest].concat());
        let device = B::int_device(&indices);
        let pairs = B::int_reshape(indices, Shape::from(vec![n, k]));
        // Row-major position: sum over j of index_j * (product of the dimensions after j).
        let mut rows: Option<IntTensor<B>> = None;
        let mut stride = 1;
        for j in (0..k).rev() {
            let column = match k {
                1 => pairs.clone(),
                _ => B::int_slice(pairs.clone(), &[Slice::from(0..n), Slice::from(j..j + 1)]),
            };
            let term = match stride {
                1 => column,
                _ => B::int_mul_scalar(column, Scalar::Int(stride as i64)),
            };
            rows = Some(match rows {
                Some(sum) => B::int_add(sum, term),
                None => term,
            });
            stride *= leading[j];
        }
        let rows = match rows {
            Some(rows) => B::int_reshape(rows, Shape::from(vec![n])),
            // `k = 0`: each index picks all of the data.
            None => B::int_zeros(Shape::from(vec![n]), &device, pairs.dtype().into()),
        };
        Flat {
            rows,
            flat_data: with_rest(&[stride]),
            flat_picked: with_rest(&[n]),
            picked: with_rest(batch),
        }
    }
}

/// `data.gather_nd(indices)`, float: the workarounds' `select` (a pick of one row is copied
/// before fusion can broadcast it wrong).
pub(crate) fn float_gather_nd<B: Backend>(
    data: FloatTensor<B>,
    indices: IntTensor<B>,
) -> FloatTensor<B> {
    let flat = Flat::<B>::new(&data.shape(), indices);
    let picked = super::float_select::<B>(B::float_reshape(data, flat.flat_data), 0, flat.rows);
    B::float_reshape(picked, flat.picked)
}

/// `data.scatter_nd(indices, values, reduction)`, float: an adding one as a `select_add`.
pub(crate) fn float_scatter_nd<B: Backend>(
    data: FloatTensor<B>,
    indices: IntTensor<B>,
    values: FloatTensor<B>,
    reduction: IndexingUpdateOp,
) -> FloatTensor<B> {
    if !matches!(reduction, IndexingUpdateOp::Add) {
        return B::float_scatter_nd(data, indices, values, reduction);
    }
    let shape = data.shape();
    let flat = Flat::<B>::new(&shape, indices);
    let data = B::float_reshape(data, flat.flat_data);
    let values = B::float_reshape(values, flat.flat_picked);
    B::float_reshape(B::float_select_add(data, 0, flat.rows, values), shape)
}

/// `data.gather_nd(indices)`, int: an int `select`.
pub(crate) fn int_gather_nd<B: Backend>(data: IntTensor<B>, indices: IntTensor<B>) -> IntTensor<B> {
    let flat = Flat::<B>::new(&data.shape(), indices);
    let picked = B::int_select(B::int_reshape(data, flat.flat_data), 0, flat.rows);
    B::int_reshape(picked, flat.picked)
}

/// `data.scatter_nd(indices, values, reduction)`, int: an adding one as a `select_add`; the
/// others (no `select` form) `B`'s, or under autodiff its inner backend's.
pub(crate) fn int_scatter_nd<B: Backend>(
    data: IntTensor<B>,
    indices: IntTensor<B>,
    values: IntTensor<B>,
    reduction: IndexingUpdateOp,
) -> IntTensor<B> {
    if !matches!(reduction, IndexingUpdateOp::Add) {
        return int_scatter_nd_below_autodiff::<B>(data, indices, values, reduction);
    }
    let shape = data.shape();
    let flat = Flat::<B>::new(&shape, indices);
    let data = B::int_reshape(data, flat.flat_data);
    let values = B::int_reshape(values, flat.flat_picked);
    B::int_reshape(B::int_select_add(data, 0, flat.rows, values), shape)
}

/// `B`'s int `scatter_nd`, or its inner backend's when `B` is a listed autodiff backend (int
/// tensors carry no graph: autodiff's int tensor is its inner backend's).
fn int_scatter_nd_below_autodiff<B: Backend>(
    data: IntTensor<B>,
    indices: IntTensor<B>,
    values: IntTensor<B>,
    reduction: IndexingUpdateOp,
) -> IntTensor<B> {
    struct ScatterNd<P>(P, P, P, IndexingUpdateOp);
    impl<P: 'static> Visit for ScatterNd<P> {
        type Out = P;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> P {
            let ScatterNd(data, indices, values, reduction) = self;
            let (data, indices, values) = (moved(data), moved(indices), moved(values));
            moved(X::int_scatter_nd(data, indices, values, reduction))
        }
    }
    dispatch::<B, _>(ScatterNd(data, indices, values, reduction)).unwrap_or_else(
        |ScatterNd(data, indices, values, reduction)| {
            B::int_scatter_nd(data, indices, values, reduction)
        },
    )
}
