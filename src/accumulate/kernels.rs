//! Gradient accumulation's kernel as [`AccumKernels`]: `acc += f32(grad) × weight`, with a
//! burn-op default for every backend ([`fallback`]), a CubeCL kernel on `CubeBackend` (in place
//! when the sum's buffer is unshared) and a fusion custom op on `Fusion`.

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::{Fusion, FusionBackend};

use crate::kernels::cube::{Elementwise, address_type, empty_like, output_for};
use crate::kernels::cubecl_kernels::accumulate as k;
use crate::kernels::{fusion, kernels_for_flex_and_amp};

/// Gradient accumulation's kernel. See the [module docs](self).
pub trait AccumKernels: Backend {
    /// One micro-step of gradient accumulation: `acc + grad × weight`, in f32 whatever the
    /// gradient's dtype (f64 for f64 gradients). `None` starts a window: the result is then
    /// `grad × weight` alone. A weight of 1 costs no multiplication, so the first micro-step
    /// of a one-step window is the gradient bit for bit.
    ///
    /// `acc` (f32, or f64 for f64 gradients) has the gradient's shape. It is consumed: the
    /// kernels write the sum into its buffer when nothing else holds it, so a clone the
    /// caller keeps never changes.
    fn accumulate(
        acc: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        weight: f32,
    ) -> FloatTensor<Self> {
        fallback::accumulate::<Self>(acc, grad, weight)
    }
}

kernels_for_flex_and_amp!(AccumKernels {
    fn accumulate(acc: Option<FloatTensor<Self>>, grad: FloatTensor<Self>, weight: f32) -> FloatTensor<Self>;
});

/// The accumulation composed from plain burn ops: the reference the CubeCL kernel is tested
/// against, and what non-CubeCL backends run.
pub mod fallback {
    use burn_backend::tensor::FloatTensor;
    use burn_backend::{Backend, TensorMetadata};
    use burn_std::{DType, FloatDType};

    use crate::scaler::kernels::fallback::s;

    /// See [`AccumKernels::accumulate`](super::AccumKernels::accumulate).
    ///
    /// Exactly the burn-tensor ops the plain `acc + grad.cast(..).mul_scalar(weight)` runs,
    /// in its order: a cast only when the dtype differs (as `Tensor::cast`), no
    /// multiplication for a weight of 1, then one `add`. But an empty gradient runs none:
    /// CubeCL 0.10 launches an op on an empty tensor with a zero-sized grid, which the CUDA
    /// driver refuses, and every later read on that stream then fails (wgpu runs it as a
    /// no-op). The result is the same: `acc`, or an empty sum.
    pub fn accumulate<B: Backend>(
        acc: Option<FloatTensor<B>>,
        grad: FloatTensor<B>,
        weight: f32,
    ) -> FloatTensor<B> {
        let dtype = if grad.dtype() == DType::F64 {
            FloatDType::F64
        } else {
            FloatDType::F32
        };
        if grad.shape().num_elements() == 0 {
            return match acc {
                Some(acc) => acc,
                None if grad.dtype() == DType::from(dtype) => grad,
                None => B::float_empty(grad.shape(), &B::float_device(&grad), dtype),
            };
        }
        let current: FloatDType = grad.dtype().into();
        let grad = if current == dtype {
            grad
        } else {
            B::float_cast(grad, dtype)
        };
        let grad = if weight == 1.0 {
            grad
        } else {
            B::float_mul_scalar(grad, s(weight as f64))
        };
        match acc {
            Some(acc) => B::float_add(acc, grad),
            None => grad,
        }
    }
}

/// `acc + f32(grad) * weight` into `acc`'s buffer when it may be mutated, else a fresh one.
/// `acc` is f32 and non-empty, of `grad`'s shape.
fn accumulate_some<R: CubeRuntime>(
    acc: CubeTensor<R>,
    grad: CubeTensor<R>,
    weight: f32,
) -> CubeTensor<R> {
    let launch = Elementwise::over(&[&acc, &grad]);
    let dtype = grad.dtype;
    // `acc` is argument 0.
    let (out, out_view) = output_for(&acc, 0);
    let addr = address_type(&[&acc, &grad, &out]);
    // SAFETY: every access is `ABSOLUTE_POS` behind the output's bounds check, on views of
    // one shape (asserted by the caller).
    unsafe {
        k::accumulate_kernel::launch_unchecked(
            &launch.client,
            launch.count,
            launch.dim,
            addr,
            launch.vector_size,
            acc.into_linear_view(),
            grad.into_linear_view(),
            out_view,
            weight,
            dtype.into(),
        )
    };
    out
}

/// `f32(grad) * weight`, in `grad`'s buffer when it is f32 and may be mutated, else in a
/// fresh f32 one. `grad` is non-empty.
fn accumulate_none<R: CubeRuntime>(grad: CubeTensor<R>, weight: f32) -> CubeTensor<R> {
    let launch = Elementwise::over(&[&grad]);
    let dtype = grad.dtype;
    let (out, out_view) = if dtype == DType::F32 {
        output_for(&grad, 0)
    } else {
        let out = empty_like(&grad, DType::F32);
        let view = out.clone().into_linear_view();
        (out, view)
    };
    let addr = address_type(&[&grad, &out]);
    // SAFETY: as `accumulate_some`; the output has the gradient's shape.
    unsafe {
        k::accumulate_init_kernel::launch_unchecked(
            &launch.client,
            launch.count,
            launch.dim,
            addr,
            launch.vector_size,
            grad.into_linear_view(),
            out_view,
            weight,
            dtype.into(),
        )
    };
    out
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> AccumKernels
    for CubeBackend<R, F, I, BT>
{
    fn accumulate(
        acc: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        weight: f32,
    ) -> FloatTensor<Self> {
        // f64 gradients (or an accumulator that is not f32) take the burn ops.
        if grad.dtype == DType::F64 || acc.as_ref().is_some_and(|a| a.dtype != DType::F32) {
            return fallback::accumulate::<Self>(acc, grad, weight);
        }
        let empty = grad.meta.num_elements() == 0;
        match acc {
            Some(acc) => {
                assert_eq!(
                    acc.meta.shape(),
                    grad.meta.shape(),
                    "the accumulator must have the gradient's shape"
                );
                if empty {
                    acc
                } else {
                    accumulate_some(acc, grad, weight)
                }
            }
            // As the fallback: an f32 gradient with weight 1 is the sum itself, uncopied.
            None if grad.dtype == DType::F32 && weight == 1.0 => grad,
            None if empty => empty_like(&grad, DType::F32),
            None => accumulate_none(grad, weight),
        }
    }
}

impl<B: FusionBackend + AccumKernels> AccumKernels for Fusion<B> {
    fn accumulate(
        acc: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        weight: f32,
    ) -> FloatTensor<Self> {
        if let Some(acc) = &acc {
            assert_eq!(
                acc.shape(),
                grad.shape(),
                "the accumulator must have the gradient's shape"
            );
        }
        let empty = grad.shape().num_elements() == 0;
        // f64 gradients (or an accumulator that is not f32) take the burn ops, which fusion
        // can still fuse; so do empty tensors without an accumulator.
        if grad.dtype() == DType::F64
            || acc.as_ref().is_some_and(|a| a.dtype() != DType::F32)
            || (empty && acc.is_none())
        {
            return fallback::accumulate::<Self>(acc, grad, weight);
        }
        let acc = match acc {
            Some(acc) if empty => return acc,
            // As the fallback: an f32 gradient with weight 1 is the sum itself, uncopied.
            None if grad.dtype() == DType::F32 && weight == 1.0 => return grad,
            acc => acc,
        };
        let out = (grad.shape(), DType::F32);
        let has_acc = acc.is_some();
        let inputs = acc.into_iter().chain([grad]).collect();
        fusion::custom_op::<B, _>("burn_amp_accumulate", inputs, &[out], move |mut i| {
            let grad = i.pop().unwrap();
            let acc = if has_acc { i.pop() } else { None };
            vec![B::accumulate(acc, grad, weight)]
        })
        .pop()
        .unwrap()
    }
}
