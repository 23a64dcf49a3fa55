//! `QTensorOps` of `Amp<B>`: quantized ops are forwarded untouched.
//!
//! Written by macro from the trait's signatures (see `backend/macros.rs`).

use burn_backend::ops::QTensorOps;
use burn_backend::quantization::{QuantScheme, QuantizationParametersPrimitive};
use burn_backend::tensor::BoolTensor;
use burn_backend::tensor::{Device, FloatTensor, IntTensor, QuantizedTensor};
use burn_backend::{Backend, ExecutionError, Scalar, TensorData, TensorPrimitive};
use burn_std::{BoolDType, FloatDType, IntDType, Shape, Slice};

use crate::backend::Amp;
use crate::backend::macros::{forward, forward_primitive};

impl<B: Backend> QTensorOps<Self> for Amp<B> {
    forward! {
        fn q_from_data(data: TensorData, device: &Device<Self>) -> QuantizedTensor<Self>;
        fn quantize_dynamic(tensor: FloatTensor<Self>, scheme: &QuantScheme) -> QuantizedTensor<Self>;
        fn dequantize(tensor: QuantizedTensor<Self>, dtype: FloatDType) -> FloatTensor<Self>;
        fn q_device(tensor: &QuantizedTensor<Self>) -> Device<Self>;
        fn q_to_device(tensor: QuantizedTensor<Self>, device: &Device<Self>) -> QuantizedTensor<Self>;
        fn q_reshape(tensor: QuantizedTensor<Self>, shape: Shape) -> QuantizedTensor<Self>;
        fn q_detach(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_set_require_grad(tensor: QuantizedTensor<Self>, require_grad: bool) -> QuantizedTensor<Self>;
        fn q_is_require_grad(tensor: &QuantizedTensor<Self>) -> bool;
        fn q_expand(tensor: QuantizedTensor<Self>, shape: Shape) -> QuantizedTensor<Self>;
        fn q_transpose(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_swap_dims(tensor: QuantizedTensor<Self>, dim1: usize, dim2: usize) -> QuantizedTensor<Self>;
        fn q_permute(tensor: QuantizedTensor<Self>, axes: &[usize]) -> QuantizedTensor<Self>;
        fn q_flip(tensor: QuantizedTensor<Self>, axes: &[usize]) -> QuantizedTensor<Self>;
        fn q_select(tensor: QuantizedTensor<Self>, dim: usize, indices: IntTensor<Self>) -> QuantizedTensor<Self>;
        fn q_slice(tensor: QuantizedTensor<Self>, slices: &[Slice]) -> QuantizedTensor<Self>;
        fn q_gather(dim: usize, tensor: QuantizedTensor<Self>, indices: IntTensor<Self>) -> QuantizedTensor<Self>;
        fn q_repeat_dim(tensor: QuantizedTensor<Self>, dim: usize, times: usize) -> QuantizedTensor<Self>;
        fn q_abs(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_cat(tensors: Vec<QuantizedTensor<Self>>, dim: usize) -> QuantizedTensor<Self>;
        fn q_argmax(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> IntTensor<Self>;
        fn q_argtopk(tensor: QuantizedTensor<Self>, dim: usize, k: usize, out_dtype: IntDType) -> IntTensor<Self>;
        fn q_topk(tensor: QuantizedTensor<Self>, dim: usize, k: usize) -> QuantizedTensor<Self>;
        fn q_argmin(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> IntTensor<Self>;
        fn q_max(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_max_dim(tensor: QuantizedTensor<Self>, dim: usize) -> QuantizedTensor<Self>;
        fn q_max_dim_with_indices(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> (QuantizedTensor<Self>, IntTensor<Self>);
        fn q_min(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_min_dim(tensor: QuantizedTensor<Self>, dim: usize) -> QuantizedTensor<Self>;
        fn q_min_dim_with_indices(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> (QuantizedTensor<Self>, IntTensor<Self>);
        fn q_max_abs(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_max_abs_dim(tensor: QuantizedTensor<Self>, dim: usize) -> QuantizedTensor<Self>;
        fn q_any(tensor: QuantizedTensor<Self>, out_dtype: BoolDType) -> BoolTensor<Self>;
        fn q_any_dim(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: BoolDType) -> BoolTensor<Self>;
        fn q_all(tensor: QuantizedTensor<Self>, out_dtype: BoolDType) -> BoolTensor<Self>;
        fn q_all_dim(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: BoolDType) -> BoolTensor<Self>;
        fn q_sort(tensor: QuantizedTensor<Self>, dim: usize, descending: bool) -> QuantizedTensor<Self>;
        fn q_sort_with_indices(tensor: QuantizedTensor<Self>, dim: usize, descending: bool, out_dtype: IntDType) -> (QuantizedTensor<Self>, IntTensor<Self>);
        fn q_argsort(tensor: QuantizedTensor<Self>, dim: usize, descending: bool, out_dtype: IntDType) -> IntTensor<Self>;
    }

    forward_primitive! {
        fn q_add(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_add_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self>;
        fn q_clamp_min(tensor: QuantizedTensor<Self>, min: Scalar) -> TensorPrimitive<Self>;
        fn q_clamp_max(tensor: QuantizedTensor<Self>, max: Scalar) -> TensorPrimitive<Self>;
        fn q_clamp(tensor: QuantizedTensor<Self>, min: Scalar, max: Scalar) -> TensorPrimitive<Self>;
        fn q_sub(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_sub_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self>;
        fn q_mul(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_mul_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self>;
        fn q_div(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_div_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self>;
        fn q_neg(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_recip(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_sum(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_sum_dim(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self>;
        fn q_prod(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_prod_dim(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self>;
        fn q_mean(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_mean_dim(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self>;
        fn q_cumsum(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self>;
        fn q_cumprod(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self>;
        fn q_cummin(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self>;
        fn q_cummax(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self>;
        fn q_exp(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_log(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_log1p(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_powf(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_powi(lhs: QuantizedTensor<Self>, rhs: IntTensor<Self>) -> TensorPrimitive<Self>;
        fn q_powi_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self>;
        fn q_powf_scalar(tensor: QuantizedTensor<Self>, value: Scalar) -> TensorPrimitive<Self>;
        fn q_sqrt(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_cos(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_sin(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_tan(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_cosh(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_sinh(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_tanh(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        fn q_erf(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
    }

    fn q_matmul(lhs: TensorPrimitive<Self>, rhs: TensorPrimitive<Self>) -> TensorPrimitive<Self> {
        rewrap(B::q_matmul(rewrap(lhs), rewrap(rhs)))
    }

    fn quantize(
        tensor: FloatTensor<Self>,
        scheme: &QuantScheme,
        qparams: QuantizationParametersPrimitive<Self>,
    ) -> QuantizedTensor<Self> {
        B::quantize(
            tensor,
            scheme,
            QuantizationParametersPrimitive {
                scales: qparams.scales,
            },
        )
    }

    fn q_into_data(
        tensor: QuantizedTensor<Self>,
    ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
        crate::backend::count_host_read();
        B::q_into_data(tensor)
    }
}

/// The same tensor under another backend type parameter: `Amp<B>` shares `B`'s primitives.
fn rewrap<
    B: Backend,
    C: Backend<
            FloatTensorPrimitive = B::FloatTensorPrimitive,
            QuantizedTensorPrimitive = B::QuantizedTensorPrimitive,
        >,
>(
    t: TensorPrimitive<B>,
) -> TensorPrimitive<C> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}
