//! [`AmpKernels`] for [`CubeBackend`]: the CubeCL kernels of `cubecl_kernels/`, launched on
//! the backend's own tensors (any runtime: wgpu, CUDA, ROCm, CPU).
//!
//! Outputs are written in place when the input buffer may be mutated (`can_mut`, nothing else
//! holds it) and into a fresh buffer otherwise, so a clone the caller still holds never
//! changes under it.

use burn_backend::tensor::FloatTensor;
use burn_backend::{DType, TensorMetadata};
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_std::Shape;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearViewLaunch;
use cubecl::{calculate_cube_count_elemwise, tensor_vector_size_parallel};

use super::cubecl_kernels as k;
use super::{AdamWHyper, AmpKernels, ScaleRule, SgdHyper, fallback};

fn is_f32(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::Flex32)
}

/// A device scalar (`inv_scale`, `found_inf`, `step`, the scaler state) as f32.
fn as_f32<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    if is_f32(t.dtype) {
        t
    } else {
        cast(t, DType::F32)
    }
}

/// A device scalar read as `[0]` by the kernels: f32, and not empty.
fn scalar_f32<R: CubeRuntime>(t: CubeTensor<R>, what: &str) -> CubeTensor<R> {
    assert!(
        t.meta.num_elements() >= 1,
        "{what} must be an f32 [1] tensor, got shape {:?}",
        t.meta.shape()
    );
    as_f32(t)
}

fn assert_f32<R: CubeRuntime>(t: &CubeTensor<R>, what: &str) {
    assert!(
        is_f32(t.dtype),
        "{what} must be f32 whatever the parameter's dtype, got {:?}",
        t.dtype
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
fn address_type<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> AddressType {
    tensors
        .iter()
        .map(|t| t.required_address_type())
        .max()
        .unwrap_or_default()
}

/// One unit per vector of `num_elems / vector_size`; over 65,535 cubes is spread on y/z.
fn elemwise_dims<R: CubeRuntime>(
    client: &ComputeClient<R>,
    num_elems: usize,
    vector_size: usize,
) -> (CubeCount, CubeDim) {
    let units = num_elems / vector_size;
    let cube_dim = CubeDim::new(client, units);
    (
        calculate_cube_count_elemwise(client, units, cube_dim),
        cube_dim,
    )
}

/// An output for `input`: `input` itself (passed as an alias of argument `input_pos`) when
/// it may be mutated, else a fresh buffer of the same shape and dtype.
fn output_for<R: CubeRuntime>(
    input: &CubeTensor<R>,
    input_pos: usize,
) -> (CubeTensor<R>, LinearViewLaunch<R>) {
    if input.can_mut() && input.is_nonoverlapping() {
        (input.clone(), input.as_linear_view_alias(input_pos))
    } else {
        let out = empty_device_dtype(
            input.client.clone(),
            input.device.clone(),
            input.shape(),
            input.dtype,
        );
        let view = out.clone().into_linear_view();
        (out, view)
    }
}

fn assert_same_shape<R: CubeRuntime>(param: &CubeTensor<R>, other: &CubeTensor<R>, what: &str) {
    assert_eq!(
        param.meta.shape(),
        other.meta.shape(),
        "{what} must have the parameter's shape"
    );
}

/// Unscales one non-empty gradient and raises `found` (f32 `[1]`, mutable) in place.
fn unscale_one<R: CubeRuntime>(
    grad: CubeTensor<R>,
    inv_scale: &CubeTensor<R>,
    found: &CubeTensor<R>,
) -> CubeTensor<R> {
    let client = grad.client.clone();
    let vs = vector_size(&[&grad]);
    let (count, dim) = elemwise_dims(&client, grad.meta.num_elements(), vs);
    let dtype = grad.dtype;
    let (out, out_view) = output_for(&grad, 0);
    let addr = address_type(&[&grad, &out]);
    // SAFETY: every access is `ABSOLUTE_POS` behind the output's bounds check, on views of
    // one shape, or `[0]` of the f32 `[1]` device scalars.
    unsafe {
        k::unscale_and_check_kernel::launch_unchecked(
            &client,
            count,
            dim,
            addr,
            vs,
            grad.into_linear_view(),
            inv_scale.clone().into_tensor_arg(),
            found.clone().into_tensor_arg(),
            out_view,
            dtype.into(),
        )
    };
    out
}

/// A fresh contiguous f32 buffer of `like`'s shape, on its device.
fn empty_f32<R: CubeRuntime>(like: &CubeTensor<R>) -> CubeTensor<R> {
    empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        like.shape(),
        DType::F32,
    )
}

/// `acc + f32(grad) * weight` into `acc`'s buffer when it may be mutated, else a fresh one.
/// `acc` is f32 and non-empty, of `grad`'s shape.
fn accumulate_some<R: CubeRuntime>(
    acc: CubeTensor<R>,
    grad: CubeTensor<R>,
    weight: f32,
) -> CubeTensor<R> {
    let client = acc.client.clone();
    let vs = vector_size(&[&acc, &grad]);
    let (count, dim) = elemwise_dims(&client, acc.meta.num_elements(), vs);
    let dtype = grad.dtype;
    // `acc` is argument 0. Never in place into a buffer someone else holds (`output_for`
    // checks `can_mut`): `into_contiguous` and clones share buffers.
    let (out, out_view) = output_for(&acc, 0);
    let addr = address_type(&[&acc, &grad, &out]);
    // SAFETY: every access is `ABSOLUTE_POS` behind the output's bounds check, on views of
    // one shape (asserted by the caller).
    unsafe {
        k::accumulate_kernel::launch_unchecked(
            &client,
            count,
            dim,
            addr,
            vs,
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
    let client = grad.client.clone();
    let vs = vector_size(&[&grad]);
    let (count, dim) = elemwise_dims(&client, grad.meta.num_elements(), vs);
    let dtype = grad.dtype;
    let (out, out_view) = if dtype == DType::F32 {
        output_for(&grad, 0)
    } else {
        let out = empty_f32(&grad);
        let view = out.clone().into_linear_view();
        (out, view)
    };
    let addr = address_type(&[&grad, &out]);
    // SAFETY: as `accumulate_some`; the output has the gradient's shape.
    unsafe {
        k::accumulate_init_kernel::launch_unchecked(
            &client,
            count,
            dim,
            addr,
            vs,
            grad.into_linear_view(),
            out_view,
            weight,
            dtype.into(),
        )
    };
    out
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> AmpKernels
    for CubeBackend<R, F, I, BT>
{
    fn unscale_and_check(
        grads: Vec<FloatTensor<Self>>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
    ) -> (Vec<FloatTensor<Self>>, FloatTensor<Self>) {
        if grads.iter().all(|g| g.meta.num_elements() == 0) {
            return (grads, found_inf);
        }
        let inv_scale = scalar_f32(inv_scale, "inv_scale");
        // The flag is raised in place: never in a buffer someone else still reads.
        let mut found = scalar_f32(found_inf, "found_inf");
        if !found.can_mut() {
            found = found.copy();
        }
        let out = grads
            .into_iter()
            .map(|grad| {
                if grad.meta.num_elements() == 0 {
                    grad
                } else {
                    unscale_one(grad, &inv_scale, &found)
                }
            })
            .collect();
        (out, found)
    }

    fn update_scale(
        state: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        rule: ScaleRule,
    ) -> FloatTensor<Self> {
        let state = into_contiguous(as_f32(state));
        assert_eq!(
            state.meta.num_elements(),
            4,
            "the scaler state is an f32 [4] tensor"
        );
        let found = scalar_f32(found_inf, "found_inf");
        let client = state.client.clone();
        let out = empty_device_dtype(
            client.clone(),
            state.device.clone(),
            Shape::new([4]),
            DType::F32,
        );
        k::update_scale_kernel::launch(
            &client,
            CubeCount::new_single(),
            CubeDim::new_single(),
            state.into_tensor_arg(),
            found.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rule.growth_factor,
            rule.backoff_factor,
            rule.growth_interval,
            rule.hysteresis,
            rule.min_scale,
            rule.max_scale,
        );
        out
    }

    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        exp_avg: FloatTensor<Self>,
        exp_avg_sq: FloatTensor<Self>,
        step: FloatTensor<Self>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        h: AdamWHyper,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if param.meta.num_elements() == 0 {
            return (param, exp_avg, exp_avg_sq);
        }
        assert_same_shape(&param, &grad, "the gradient");
        assert_same_shape(&param, &exp_avg, "exp_avg");
        assert_same_shape(&param, &exp_avg_sq, "exp_avg_sq");
        assert_f32(&exp_avg, "exp_avg");
        assert_f32(&exp_avg_sq, "exp_avg_sq");
        let step = scalar_f32(step, "step");
        let inv_scale = scalar_f32(inv_scale, "inv_scale");
        let found = scalar_f32(found_inf, "found_inf");

        let client = param.client.clone();
        let vs = vector_size(&[&param, &grad, &exp_avg, &exp_avg_sq]);
        let (count, dim) = elemwise_dims(&client, param.meta.num_elements(), vs);
        let dtypes = [param.dtype.into(), grad.dtype.into()];
        // Argument positions of the aliased inputs: param 0, exp_avg 2, exp_avg_sq 3.
        let (p_out, p_view) = output_for(&param, 0);
        let (m_out, m_view) = output_for(&exp_avg, 2);
        let (v_out, v_view) = output_for(&exp_avg_sq, 3);
        let addr = address_type(&[&param, &grad, &exp_avg, &exp_avg_sq, &p_out, &m_out, &v_out]);
        // The scalar constants exactly as the fallback rounds them (f64 math, then f32).
        // SAFETY: see `unscale_one`; every view has the parameter's shape (asserted).
        unsafe {
            k::adamw_kernel::launch_unchecked(
                &client,
                count,
                dim,
                addr,
                vs,
                param.into_linear_view(),
                grad.into_linear_view(),
                exp_avg.into_linear_view(),
                exp_avg_sq.into_linear_view(),
                step.into_tensor_arg(),
                inv_scale.into_tensor_arg(),
                found.into_tensor_arg(),
                p_view,
                m_view,
                v_view,
                h.lr,
                h.beta1,
                h.beta2,
                (1.0 - h.beta1 as f64) as f32,
                (1.0 - h.beta2 as f64) as f32,
                (h.beta1 as f64).ln() as f32,
                (h.beta2 as f64).ln() as f32,
                h.epsilon,
                (1.0 - (h.lr * h.weight_decay) as f64) as f32,
                dtypes,
            )
        };
        (p_out, m_out, v_out)
    }

    fn sgd_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        momentum: Option<FloatTensor<Self>>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        h: SgdHyper,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        if param.meta.num_elements() == 0 {
            return (param, momentum);
        }
        assert_same_shape(&param, &grad, "the gradient");
        let inv_scale = scalar_f32(inv_scale, "inv_scale");
        let found = scalar_f32(found_inf, "found_inf");
        let client = param.client.clone();
        let dtypes = [param.dtype.into(), grad.dtype.into()];
        let has_wd = h.weight_decay != 0.0;
        let one_minus_dampening = (1.0 - h.dampening as f64) as f32;

        if h.momentum == 0.0 {
            // As the fallback: no buffer without momentum (one passed in is dropped).
            let vs = vector_size(&[&param, &grad]);
            let (count, dim) = elemwise_dims(&client, param.meta.num_elements(), vs);
            let (p_out, p_view) = output_for(&param, 0);
            let addr = address_type(&[&param, &grad, &p_out]);
            // SAFETY: see `unscale_one`; every view has the parameter's shape (asserted).
            unsafe {
                k::sgd_kernel::launch_unchecked(
                    &client,
                    count,
                    dim,
                    addr,
                    vs,
                    param.into_linear_view(),
                    grad.into_linear_view(),
                    inv_scale.into_tensor_arg(),
                    found.into_tensor_arg(),
                    p_view,
                    h.lr,
                    h.weight_decay,
                    has_wd,
                    dtypes,
                )
            };
            return (p_out, None);
        }

        match momentum {
            Some(buf) => {
                assert_same_shape(&param, &buf, "the momentum buffer");
                assert_f32(&buf, "the momentum buffer");
                let vs = vector_size(&[&param, &grad, &buf]);
                let (count, dim) = elemwise_dims(&client, param.meta.num_elements(), vs);
                // Argument positions of the aliased inputs: param 0, buf 2.
                let (p_out, p_view) = output_for(&param, 0);
                let (b_out, b_view) = output_for(&buf, 2);
                let addr = address_type(&[&param, &grad, &buf, &p_out, &b_out]);
                // SAFETY: see `unscale_one`; every view has the parameter's shape (asserted).
                unsafe {
                    k::sgd_momentum_kernel::launch_unchecked(
                        &client,
                        count,
                        dim,
                        addr,
                        vs,
                        param.into_linear_view(),
                        grad.into_linear_view(),
                        buf.into_linear_view(),
                        inv_scale.into_tensor_arg(),
                        found.into_tensor_arg(),
                        p_view,
                        b_view,
                        h.lr,
                        h.weight_decay,
                        h.momentum,
                        one_minus_dampening,
                        has_wd,
                        h.nesterov,
                        dtypes,
                    )
                };
                (p_out, Some(b_out))
            }
            None => {
                let vs = vector_size(&[&param, &grad]);
                let (count, dim) = elemwise_dims(&client, param.meta.num_elements(), vs);
                let (p_out, p_view) = output_for(&param, 0);
                let b_out = empty_device_dtype(
                    client.clone(),
                    param.device.clone(),
                    param.shape(),
                    DType::F32,
                );
                let addr = address_type(&[&param, &grad, &p_out, &b_out]);
                // SAFETY: see `unscale_one`; every view has the parameter's shape (asserted).
                unsafe {
                    k::sgd_momentum_init_kernel::launch_unchecked(
                        &client,
                        count,
                        dim,
                        addr,
                        vs,
                        param.into_linear_view(),
                        grad.into_linear_view(),
                        inv_scale.into_tensor_arg(),
                        found.into_tensor_arg(),
                        p_view,
                        b_out.clone().into_linear_view(),
                        h.lr,
                        h.weight_decay,
                        h.momentum,
                        has_wd,
                        h.nesterov,
                        dtypes,
                    )
                };
                (p_out, Some(b_out))
            }
        }
    }

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
            None if empty => empty_f32(&grad),
            None => accumulate_none(grad, weight),
        }
    }
}
