//! The device update of a weight average as [`EmaKernels`]: `average += (f32(weights) −
//! average) · rate`, the rate a device scalar (an update that a skipped step makes 0, without
//! a read) or a host one; with a burn-op default for every backend ([`fallback`]), CubeCL
//! kernels on `CubeBackend` (in place when the average's buffer is unshared) and fusion
//! custom ops on `Fusion`.
//!
//! Why kernels for three element-wise ops: composed from burn ops (the fallbacks), an
//! update from f16 weights took 1.23 times the kernel's time on lavapipe with a host rate,
//! and 1.87 times with a device rate broadcast from a `[1]` tensor (`cargo bench --bench
//! low_bit -- --ema`, side by side; README).

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::{Fusion, FusionBackend};
use burn_std::Shape;

use crate::kernels::cube::{Elementwise, address_type, output_for, scalar_f32};
use crate::kernels::cubecl_kernels::ema as k;
use crate::kernels::{fusion, kernels_for_flex_and_amp};

/// The device update of a weight average. See the [module docs](self).
pub trait EmaKernels: Backend {
    /// `average + (weights − average) · rate[0]`, in f32: `average` is f32, `weights` of
    /// its shape in any float dtype (widened as read), `rate` f32 `[1]` on their device.
    /// `average` is consumed: the kernels write into its buffer when nothing else holds it,
    /// so a clone the caller keeps never changes.
    fn ema_update(
        average: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        rate: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        fallback::ema_update::<Self>(average, weights, rate)
    }

    /// [`ema_update`](Self::ema_update) with the rate known on the host.
    fn ema_update_scalar(
        average: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        rate: f32,
    ) -> FloatTensor<Self> {
        fallback::ema_update_scalar::<Self>(average, weights, rate)
    }
}

kernels_for_flex_and_amp!(EmaKernels {
    fn ema_update(average: FloatTensor<Self>, weights: FloatTensor<Self>, rate: FloatTensor<Self>) -> FloatTensor<Self>;
    fn ema_update_scalar(average: FloatTensor<Self>, weights: FloatTensor<Self>, rate: f32) -> FloatTensor<Self>;
});

/// The updates composed from plain burn ops: the references the CubeCL kernels are tested
/// against, and what non-CubeCL backends run.
pub mod fallback {
    use burn_backend::tensor::FloatTensor;
    use burn_backend::{Backend, TensorMetadata};
    use burn_std::{DType, FloatDType, Shape};

    use crate::scaler::kernels::fallback::s;

    /// See [`EmaKernels::ema_update`](super::EmaKernels::ema_update).
    ///
    /// The burn-tensor ops of `average + (weights.cast(F32) − average) · rate`, in that
    /// order (a cast only when the dtype differs, as `Tensor::cast`); an empty average is
    /// returned as it is (no op launched on an empty tensor: see `accumulate`'s fallback).
    pub fn ema_update<B: Backend>(
        average: FloatTensor<B>,
        weights: FloatTensor<B>,
        rate: FloatTensor<B>,
    ) -> FloatTensor<B> {
        let rank = average.shape().num_dims();
        lerp::<B>(average, weights, |difference| {
            B::float_mul(
                difference,
                B::float_reshape(rate, Shape::from(vec![1; rank])),
            )
        })
    }

    /// See [`EmaKernels::ema_update_scalar`](super::EmaKernels::ema_update_scalar): the
    /// same ops, the rate a scalar operand.
    pub fn ema_update_scalar<B: Backend>(
        average: FloatTensor<B>,
        weights: FloatTensor<B>,
        rate: f32,
    ) -> FloatTensor<B> {
        lerp::<B>(average, weights, |difference| {
            B::float_mul_scalar(difference, s(rate as f64))
        })
    }

    fn lerp<B: Backend>(
        average: FloatTensor<B>,
        weights: FloatTensor<B>,
        times_rate: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
    ) -> FloatTensor<B> {
        if average.shape().num_elements() == 0 {
            return average;
        }
        let weights = if weights.dtype() == DType::F32 {
            weights
        } else {
            B::float_cast(weights, FloatDType::F32)
        };
        let difference = B::float_sub(weights, average.clone());
        B::float_add(average, times_rate(difference))
    }
}

/// The rate as a kernel takes it.
pub(crate) enum Rate<T> {
    /// f32 `[1]` on the device.
    Device(T),
    Host(f32),
}

/// The fallback for either rate.
fn fallback_for<B: Backend>(
    average: FloatTensor<B>,
    weights: FloatTensor<B>,
    rate: Rate<FloatTensor<B>>,
) -> FloatTensor<B> {
    match rate {
        Rate::Device(rate) => fallback::ema_update::<B>(average, weights, rate),
        Rate::Host(rate) => fallback::ema_update_scalar::<B>(average, weights, rate),
    }
}

/// The backends whose `EmaKernels` are CubeCL kernels, as `$m!(types)` (one list for
/// [`has_kernels`] and [`update`]).
macro_rules! with_listed {
    ($m:ident) => {
        $m!(
            burn::backend::Wgpu,
            crate::Amp<burn::backend::Wgpu>,
            CubeWgpu,
            crate::Amp<CubeWgpu>,
        );
        #[cfg(feature = "cuda")]
        $m!(burn_cuda::Cuda, crate::Amp<burn_cuda::Cuda>);
    };
}

type CubeWgpu = CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;

/// Whether a [`ModelEma`](super::ModelEma) on `B` (its inner backend) updates through the
/// CubeCL kernels: `Wgpu`, the bare `CubeBackend` on wgpu, `Cuda` (feature `cuda`), and
/// `Amp` over them. Other backends run the burn-op fallback: the same values.
pub fn has_kernels<B: Backend>() -> bool {
    use core::any::TypeId;
    macro_rules! check {
        ($($kernels:ty),* $(,)?) => {$(
            if TypeId::of::<B>() == TypeId::of::<$kernels>() {
                return true;
            }
        )*};
    }
    with_listed!(check);
    false
}

/// One update over any backend: [`EmaKernels`] where `B` is listed ([`has_kernels`]), found
/// by `TypeId` as `backend::concrete` finds autodiff backends (Rust has no specialization);
/// the burn-op fallback elsewhere. So [`ModelEma`](super::ModelEma) keeps the bounds of
/// Burn's modules and runs over ndarray, candle or a backend of the user's own.
pub(crate) fn update<B: Backend>(
    average: FloatTensor<B>,
    weights: FloatTensor<B>,
    rate: Rate<FloatTensor<B>>,
) -> FloatTensor<B> {
    use crate::backend::concrete::moved;
    use core::any::TypeId;
    macro_rules! run {
        ($($kernels:ty),* $(,)?) => {$(
            if TypeId::of::<B>() == TypeId::of::<$kernels>() {
                let (average, weights) = (moved(average), moved(weights));
                return moved(match rate {
                    Rate::Device(rate) => <$kernels>::ema_update(average, weights, moved(rate)),
                    Rate::Host(rate) => <$kernels>::ema_update_scalar(average, weights, rate),
                });
            }
        )*};
    }
    with_listed!(run);
    fallback_for::<B>(average, weights, rate)
}

/// What the kernels do not serve (the fallback does): an average that is not f32, f64
/// weights. An empty one needs nothing. Shapes are asserted.
fn kernel_serves(average: (Shape, DType), weights: (Shape, DType)) -> bool {
    assert_eq!(
        average.0, weights.0,
        "a weight average must have its weights' shape"
    );
    average.1 == DType::F32 && weights.1 != DType::F64
}

/// The kernel's launch: into `average`'s buffer when it may be mutated, else a fresh one.
/// `average` is f32 and non-empty, of `weights`' shape.
fn launch<R: CubeRuntime>(
    average: CubeTensor<R>,
    weights: CubeTensor<R>,
    rate: Rate<CubeTensor<R>>,
) -> CubeTensor<R> {
    let launch = Elementwise::over(&[&average, &weights]);
    let dtype = weights.dtype;
    // `average` is argument 0.
    let (out, out_view) = output_for(&average, 0);
    let addr = address_type(&[&average, &weights, &out]);
    let (average, weights) = (average.into_linear_view(), weights.into_linear_view());
    let (client, count, dim, vector) =
        (&launch.client, launch.count, launch.dim, launch.vector_size);
    // SAFETY: every access is `ABSOLUTE_POS` behind the output's bounds check, on views of
    // one shape (asserted), or `[0]` of the f32 `[1]` rate.
    unsafe {
        match rate {
            Rate::Device(rate) => {
                let rate = scalar_f32(rate, "the average's rate").into_tensor_arg();
                k::ema_update_kernel::launch_unchecked(
                    client,
                    count,
                    dim,
                    addr,
                    vector,
                    average,
                    weights,
                    rate,
                    out_view,
                    dtype.into(),
                )
            }
            Rate::Host(rate) => k::ema_update_scalar_kernel::launch_unchecked(
                client,
                count,
                dim,
                addr,
                vector,
                average,
                weights,
                out_view,
                rate,
                dtype.into(),
            ),
        }
    };
    out
}

/// On `CubeBackend`: the kernel, or the fallback for what it does not serve.
fn on_cube<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    average: CubeTensor<R>,
    weights: CubeTensor<R>,
    rate: Rate<CubeTensor<R>>,
) -> CubeTensor<R> {
    let served = kernel_serves(
        (average.shape(), average.dtype),
        (weights.shape(), weights.dtype),
    );
    if average.meta.num_elements() == 0 {
        average
    } else if served {
        launch(average, weights, rate)
    } else {
        fallback_for::<CubeBackend<R, F, I, BT>>(average, weights, rate)
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> EmaKernels
    for CubeBackend<R, F, I, BT>
{
    fn ema_update(
        average: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        rate: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        on_cube::<R, F, I, BT>(average, weights, Rate::Device(rate))
    }

    fn ema_update_scalar(
        average: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        rate: f32,
    ) -> FloatTensor<Self> {
        on_cube::<R, F, I, BT>(average, weights, Rate::Host(rate))
    }
}

/// On `Fusion`: a custom op running `B`'s kernel (inputs: the average, the weights and, for
/// a device rate, the rate).
fn fused<B: FusionBackend + EmaKernels>(
    average: FloatTensor<Fusion<B>>,
    weights: FloatTensor<Fusion<B>>,
    rate: Rate<FloatTensor<Fusion<B>>>,
) -> FloatTensor<Fusion<B>> {
    let served = kernel_serves(
        (average.shape(), average.dtype()),
        (weights.shape(), weights.dtype()),
    );
    if average.shape().num_elements() == 0 {
        return average;
    }
    if !served {
        // Other dtypes take the burn ops, which fusion can still fuse.
        return fallback_for::<Fusion<B>>(average, weights, rate);
    }
    let out = [fusion::like::<B>(&average)];
    let mut out = match rate {
        Rate::Device(rate) => {
            let inputs = vec![average, weights, rate];
            fusion::custom_op::<B, _>("burn_amp_ema_update", inputs, &out, |mut i| {
                let (rate, weights) = (i.pop().unwrap(), i.pop().unwrap());
                vec![B::ema_update(i.pop().unwrap(), weights, rate)]
            })
        }
        Rate::Host(rate) => {
            let inputs = vec![average, weights];
            fusion::custom_op::<B, _>("burn_amp_ema_update_scalar", inputs, &out, move |mut i| {
                let weights = i.pop().unwrap();
                vec![B::ema_update_scalar(i.pop().unwrap(), weights, rate)]
            })
        }
    };
    out.pop().unwrap()
}

impl<B: FusionBackend + EmaKernels> EmaKernels for Fusion<B> {
    fn ema_update(
        average: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        rate: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        fused::<B>(average, weights, Rate::Device(rate))
    }

    fn ema_update_scalar(
        average: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        rate: f32,
    ) -> FloatTensor<Self> {
        fused::<B>(average, weights, Rate::Host(rate))
    }
}
