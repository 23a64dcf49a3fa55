//! Launch helpers shared by the `CubeBackend` impls of the kernel traits: vector widths,
//! cube counts, in-place outputs and the checks on device scalars.

use burn_backend::{DType, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::cast;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearViewLaunch;
use cubecl::{calculate_cube_count_elemwise, tensor_vector_size_parallel};

pub(crate) fn is_f32(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::Flex32)
}

/// A device scalar read as `[0]` by the kernels: f32, and not empty.
pub(crate) fn scalar_f32<R: CubeRuntime>(t: CubeTensor<R>, what: &str) -> CubeTensor<R> {
    assert!(
        t.meta.num_elements() >= 1,
        "{what} must be an f32 [1] tensor, got shape {:?}",
        t.meta.shape()
    );
    if is_f32(t.dtype) {
        t
    } else {
        cast(t, DType::F32)
    }
}

pub(crate) fn assert_f32<R: CubeRuntime>(t: &CubeTensor<R>, what: &str) {
    assert!(
        is_f32(t.dtype),
        "{what} must be f32 whatever the parameter's dtype, got {:?}",
        t.dtype
    );
}

pub(crate) fn assert_same_shape<R: CubeRuntime>(
    param: &CubeTensor<R>,
    other: &CubeTensor<R>,
    what: &str,
) {
    assert_eq!(
        param.meta.shape(),
        other.meta.shape(),
        "{what} must have the parameter's shape"
    );
}

/// The widest vector size every tensor allows (all of one shape), 1 if any forbids it.
fn vector_size<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> usize {
    tensors
        .iter()
        .map(|t| {
            let rank = t.meta.num_dims();
            if rank == 0 {
                return 1;
            }
            tensor_vector_size_parallel(
                t.client.io_optimized_vector_sizes(t.dtype.size()),
                t.meta.shape(),
                t.meta.strides(),
                rank - 1,
            )
        })
        .min()
        .unwrap_or(1)
}

/// The widest address type any of `tensors` needs.
pub(crate) fn address_type<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> AddressType {
    tensors
        .iter()
        .map(|t| t.required_address_type())
        .max()
        .unwrap_or_default()
}

/// The launch of an elementwise kernel over tensors of one shape (the first one's): their
/// client, the widest vector size they all allow, and one unit per vector (over 65,535 cubes
/// is spread on y/z).
pub(crate) struct Elementwise<R: CubeRuntime> {
    pub client: ComputeClient<R>,
    pub vector_size: usize,
    pub count: CubeCount,
    pub dim: CubeDim,
}

impl<R: CubeRuntime> Elementwise<R> {
    pub(crate) fn over(tensors: &[&CubeTensor<R>]) -> Self {
        let client = tensors[0].client.clone();
        let vector_size = vector_size(tensors);
        let units = tensors[0].meta.num_elements() / vector_size;
        let dim = CubeDim::new(&client, units);
        let count = calculate_cube_count_elemwise(&client, units, dim);
        Self {
            client,
            vector_size,
            count,
            dim,
        }
    }
}

/// An output for `input`: `input` itself (passed as an alias of argument `input_pos`) when
/// it may be mutated, else a fresh buffer of the same shape and dtype.
///
/// Never in place into a buffer someone else holds: `into_contiguous` and clones share
/// buffers, and a clone the caller keeps must not change under it.
pub(crate) fn output_for<R: CubeRuntime>(
    input: &CubeTensor<R>,
    input_pos: usize,
) -> (CubeTensor<R>, LinearViewLaunch<R>) {
    if input.can_mut() && input.is_nonoverlapping() {
        (input.clone(), input.as_linear_view_alias(input_pos))
    } else {
        let out = empty_like(input, input.dtype);
        let view = out.clone().into_linear_view();
        (out, view)
    }
}

/// [`output_for`] as a plain tensor argument, for kernels that index a contiguous buffer
/// directly (in place only when `input` is contiguous).
pub(crate) fn tensor_output_for<R: CubeRuntime>(
    input: &CubeTensor<R>,
    input_pos: usize,
) -> (CubeTensor<R>, TensorArg<R>) {
    if input.can_mut() && input.is_contiguous() {
        (input.clone(), input.as_tensor_alias(input_pos))
    } else {
        let out = empty_like(input, input.dtype);
        (out.clone(), out.into_tensor_arg())
    }
}

/// A fresh contiguous buffer of `like`'s shape and `dtype`, on its device.
pub(crate) fn empty_like<R: CubeRuntime>(like: &CubeTensor<R>, dtype: DType) -> CubeTensor<R> {
    empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        like.shape(),
        dtype,
    )
}

/// A fresh f32 `[1]` buffer on `like`'s device: the step count a kernel writes. Never an
/// alias of its input: every unit reads the old count while one writes the new.
pub(crate) fn empty_scalar_f32<R: CubeRuntime>(like: &CubeTensor<R>) -> CubeTensor<R> {
    empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        burn_std::Shape::new([1]),
        DType::F32,
    )
}
