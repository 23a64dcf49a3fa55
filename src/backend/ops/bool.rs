//! `BoolTensorOps` of `Amp<B>`: bool ops are forwarded untouched, but for those on empty
//! tensors (`workarounds::empty`).
//!
//! Written by macro from the trait's signatures (see `backend/macros.rs`).

use burn_backend::ops::BoolTensorOps;
use burn_backend::tensor::{BoolTensor, Device, FloatTensor, IntTensor};
use burn_backend::{Backend, ExecutionError, Scalar, TensorData, TensorMetadata};
use burn_std::{BoolDType, FloatDType, IntDType, Shape, Slice};

use crate::backend::Amp;
use crate::backend::macros::{forward, forward_empty};

impl<B: Backend> BoolTensorOps<Self> for Amp<B> {
    forward! {
        fn bool_empty(shape: Shape, device: &Device<Self>, dtype: BoolDType) -> BoolTensor<Self>;
        fn bool_zeros(shape: Shape, device: &Device<Self>, dtype: BoolDType) -> BoolTensor<Self> => via workarounds;
        fn bool_ones(shape: Shape, device: &Device<Self>, dtype: BoolDType) -> BoolTensor<Self> => via workarounds;
        fn bool_from_data(data: TensorData, device: &Device<Self>) -> BoolTensor<Self>;
        fn bool_into_int(tensor: BoolTensor<Self>, out_dtype: IntDType) -> IntTensor<Self> => empty [bool tensor] int(out_dtype);
        fn bool_into_float(tensor: BoolTensor<Self>, out_dtype: FloatDType) -> FloatTensor<Self> => empty [bool tensor] float(out_dtype);
        fn bool_device(tensor: &BoolTensor<Self>) -> Device<Self>;
        fn bool_to_device(tensor: BoolTensor<Self>, device: &Device<Self>) -> BoolTensor<Self>;
        fn bool_reshape(tensor: BoolTensor<Self>, shape: Shape) -> BoolTensor<Self> => via workarounds;
        fn bool_slice(tensor: BoolTensor<Self>, slices: &[Slice]) -> BoolTensor<Self>;
        fn bool_slice_assign(tensor: BoolTensor<Self>, slices: &[Slice], value: BoolTensor<Self>) -> BoolTensor<Self> => via workarounds;
        fn bool_mask_where(tensor: BoolTensor<Self>, mask: BoolTensor<Self>, value: BoolTensor<Self>) -> BoolTensor<Self> => empty [bool tensor, bool mask, bool value] bool(tensor.dtype().into());
        fn bool_mask_fill(tensor: BoolTensor<Self>, mask: BoolTensor<Self>, value: Scalar) -> BoolTensor<Self> => empty [bool tensor, bool mask] bool(tensor.dtype().into());
        fn bool_gather(dim: usize, tensor: BoolTensor<Self>, indices: IntTensor<Self>) -> BoolTensor<Self> => via workarounds;
        fn bool_scatter_or(dim: usize, tensor: BoolTensor<Self>, indices: IntTensor<Self>, value: BoolTensor<Self>) -> BoolTensor<Self> => via workarounds;
        fn bool_select(tensor: BoolTensor<Self>, dim: usize, indices: IntTensor<Self>) -> BoolTensor<Self> => via workarounds;
        fn bool_select_or(tensor: BoolTensor<Self>, dim: usize, indices: IntTensor<Self>, value: BoolTensor<Self>) -> BoolTensor<Self> => via workarounds;
        fn bool_repeat_dim(tensor: BoolTensor<Self>, dim: usize, times: usize) -> BoolTensor<Self> => via workarounds;
        fn bool_cat(tensors: Vec<BoolTensor<Self>>, dim: usize) -> BoolTensor<Self> => via workarounds;
        fn bool_equal(lhs: BoolTensor<Self>, rhs: BoolTensor<Self>) -> BoolTensor<Self> => empty [bool lhs, bool rhs] bool(lhs.dtype().into());
        fn bool_not_equal(lhs: BoolTensor<Self>, rhs: BoolTensor<Self>) -> BoolTensor<Self> => empty [bool lhs, bool rhs] bool(lhs.dtype().into());
        fn bool_equal_elem(lhs: BoolTensor<Self>, rhs: Scalar) -> BoolTensor<Self> => empty [bool lhs] bool(lhs.dtype().into());
        fn bool_not_equal_elem(lhs: BoolTensor<Self>, rhs: Scalar) -> BoolTensor<Self> => empty [bool lhs] bool(lhs.dtype().into());
        fn bool_not(tensor: BoolTensor<Self>) -> BoolTensor<Self> => empty [bool tensor] bool(tensor.dtype().into());
        fn bool_and(lhs: BoolTensor<Self>, rhs: BoolTensor<Self>) -> BoolTensor<Self> => empty [bool lhs, bool rhs] bool(lhs.dtype().into());
        fn bool_or(lhs: BoolTensor<Self>, rhs: BoolTensor<Self>) -> BoolTensor<Self> => empty [bool lhs, bool rhs] bool(lhs.dtype().into());
        fn bool_xor(lhs: BoolTensor<Self>, rhs: BoolTensor<Self>) -> BoolTensor<Self> => empty [bool lhs, bool rhs] bool(lhs.dtype().into());
        fn bool_transpose(tensor: BoolTensor<Self>) -> BoolTensor<Self> => via workarounds;
        fn bool_swap_dims(tensor: BoolTensor<Self>, dim1: usize, dim2: usize) -> BoolTensor<Self> => via workarounds;
        fn bool_permute(tensor: BoolTensor<Self>, axes: &[usize]) -> BoolTensor<Self> => via workarounds;
        fn bool_flip(tensor: BoolTensor<Self>, axes: &[usize]) -> BoolTensor<Self> => empty [bool tensor] bool(tensor.dtype().into());
        fn bool_any(tensor: BoolTensor<Self>) -> BoolTensor<Self> => via workarounds;
        fn bool_any_dim(tensor: BoolTensor<Self>, dim: usize) -> BoolTensor<Self> => via workarounds;
        fn bool_all(tensor: BoolTensor<Self>) -> BoolTensor<Self> => via workarounds;
        fn bool_all_dim(tensor: BoolTensor<Self>, dim: usize) -> BoolTensor<Self> => via workarounds;
        fn bool_argwhere(tensor: BoolTensor<Self>, out_dtype: IntDType) -> impl Future<Output = IntTensor<Self>> + 'static + Send;
        fn bool_expand(tensor: BoolTensor<Self>, shape: Shape) -> BoolTensor<Self> => via workarounds;
        fn bool_unfold(tensor: BoolTensor<Self>, dim: usize, size: usize, step: usize) -> BoolTensor<Self> => via workarounds;
    }

    fn bool_into_data(
        tensor: BoolTensor<Self>,
    ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
        crate::backend::count_host_read();
        let empty = crate::backend::workarounds::empty::no_data(&tensor);
        async move {
            match empty {
                Some(data) => Ok(data),
                None => B::bool_into_data(tensor).await,
            }
        }
    }
}
