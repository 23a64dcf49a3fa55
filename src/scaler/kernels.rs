//! The loss scaler's kernels: the inf/NaN check (read-only, or fused with unscaling) and the
//! scale update, as [`ScalerKernels`], with a burn-op default for every backend
//! ([`fallback`]), the CubeCL kernels on `CubeBackend` and fusion custom ops on `Fusion`.

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::{Fusion, FusionBackend};
use burn_std::Shape;
use cubecl::prelude::*;

use crate::kernels::cube::{Elementwise, address_type, empty_like, output_for, scalar_f32};
use crate::kernels::cubecl_kernels::scaler as k;
use crate::kernels::{fusion, kernels_for_flex_and_amp};

/// Index of each field in the f32 `[4]` scaler state tensor. One tensor, so that the whole
/// update is one single-thread kernel with one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleState {
    /// The loss scale.
    Scale = 0,
    /// Clean steps since the last growth or overflow.
    GrowthTracker = 1,
    /// Overflows still tolerated before the next back-off.
    HysteresisLeft = 2,
    /// Overflows in a row with the scale already at `min_scale`.
    FloorOverflows = 3,
}

/// Constants of the scale update: a validated
/// [`GradScalerConfig`](super::GradScalerConfig), as the kernels take it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleRule {
    /// Multiplier after `growth_interval` clean steps (> 1).
    pub growth_factor: f32,
    /// Multiplier on overflow, in (0, 1).
    pub backoff_factor: f32,
    /// Clean steps before growth (≥ 1).
    pub growth_interval: u32,
    /// Overflows tolerated before backing off (≥ 1; 1 is PyTorch's behaviour).
    pub hysteresis: u32,
    /// Floor of the scale.
    pub min_scale: f32,
    /// Ceiling of the scale: a growth past it is refused.
    pub max_scale: f32,
}

/// The loss scaler's kernels. See the [module docs](self).
pub trait ScalerKernels: Backend {
    /// Raises `found_inf` (f32 `[1]`, 0 or 1) to 1 if any element of any gradient is NaN or
    /// ±inf. Reads the gradients, writes nothing else: the fused optimizers unscale inside
    /// their own kernels. Empty tensors are allowed.
    fn check_finite(
        grads: Vec<FloatTensor<Self>>,
        found_inf: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        fallback::check_finite::<Self>(grads, found_inf)
    }

    /// Multiplies each gradient by `inv_scale[0]` (in its own dtype, computed in f32) and
    /// raises `found_inf` as [`check_finite`](Self::check_finite) does. Shapes and dtypes are
    /// kept; empty tensors are allowed.
    fn unscale_and_check(
        grads: Vec<FloatTensor<Self>>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
    ) -> (Vec<FloatTensor<Self>>, FloatTensor<Self>) {
        fallback::unscale_and_check::<Self>(grads, inv_scale, found_inf)
    }

    /// The dynamic loss-scale update for one optimizer step; see [`fallback::update_scale`]
    /// for the exact rule. Returns the new f32 `[4]` state.
    fn update_scale(
        state: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        rule: ScaleRule,
    ) -> FloatTensor<Self> {
        fallback::update_scale::<Self>(state, found_inf, rule)
    }
}

kernels_for_flex_and_amp!(ScalerKernels {
    fn check_finite(grads: Vec<FloatTensor<Self>>, found_inf: FloatTensor<Self>) -> FloatTensor<Self>;
    fn unscale_and_check(grads: Vec<FloatTensor<Self>>, inv_scale: FloatTensor<Self>, found_inf: FloatTensor<Self>) -> (Vec<FloatTensor<Self>>, FloatTensor<Self>);
    fn update_scale(state: FloatTensor<Self>, found_inf: FloatTensor<Self>, rule: ScaleRule) -> FloatTensor<Self>;
});

/// The scaler's kernels composed from plain burn ops: the reference the CubeCL kernels are
/// tested against, and what non-CubeCL backends run. None of them reads back to the host.
pub mod fallback {
    use burn_backend::tensor::FloatTensor;
    use burn_backend::{Backend, Scalar, TensorMetadata, get_device_settings};
    use burn_std::{FloatDType, Shape, Slice};

    use super::{ScaleRule, ScaleState};

    pub(crate) fn s(v: f64) -> Scalar {
        Scalar::Float(v)
    }

    /// `tensor` as f32 (no copy when it is already).
    pub(crate) fn to_f32<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
        if t.dtype() == FloatDType::F32.into() {
            t
        } else {
            B::float_cast(t, FloatDType::F32)
        }
    }

    /// 1.0 where `t` is NaN or ±inf, else 0.0; reduced to one f32 `[1]` value (the max).
    fn any_non_finite<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
        let device = B::float_device(&t);
        let bool_dtype = get_device_settings::<B>(&device).bool_dtype;
        let bad = B::bool_or(
            B::float_is_nan(t.clone(), bool_dtype),
            B::float_is_inf(t, bool_dtype),
        );
        let bad = B::bool_into_float(bad, FloatDType::F32);
        B::float_reshape(B::float_max(bad), Shape::new([1]))
    }

    /// Elementwise max of two tensors of one shape (NaN-free inputs).
    pub(crate) fn maximum<B: Backend>(a: FloatTensor<B>, b: FloatTensor<B>) -> FloatTensor<B> {
        let bool_dtype = get_device_settings::<B>(&B::float_device(&a)).bool_dtype;
        let a_smaller = B::float_lower(a.clone(), b.clone(), bool_dtype);
        B::float_mask_where(a, a_smaller, b)
    }

    /// See [`ScalerKernels::check_finite`](super::ScalerKernels::check_finite).
    pub fn check_finite<B: Backend>(
        grads: Vec<FloatTensor<B>>,
        mut found_inf: FloatTensor<B>,
    ) -> FloatTensor<B> {
        for grad in grads {
            let n = grad.shape().num_elements();
            if n == 0 {
                continue;
            }
            let flat = B::float_reshape(to_f32::<B>(grad), Shape::new([n]));
            found_inf = maximum::<B>(found_inf, any_non_finite::<B>(flat));
        }
        found_inf
    }

    /// See [`ScalerKernels::unscale_and_check`](super::ScalerKernels::unscale_and_check).
    pub fn unscale_and_check<B: Backend>(
        grads: Vec<FloatTensor<B>>,
        inv_scale: FloatTensor<B>,
        mut found_inf: FloatTensor<B>,
    ) -> (Vec<FloatTensor<B>>, FloatTensor<B>) {
        let mut out = Vec::with_capacity(grads.len());
        for grad in grads {
            let shape = grad.shape();
            if shape.num_elements() == 0 {
                out.push(grad);
                continue;
            }
            let dtype = grad.dtype();
            let flat = B::float_reshape(to_f32::<B>(grad), Shape::new([shape.num_elements()]));
            found_inf = maximum::<B>(found_inf, any_non_finite::<B>(flat.clone()));
            let unscaled = B::float_mul(flat, inv_scale.clone());
            let unscaled = B::float_reshape(unscaled, shape);
            out.push(if dtype == FloatDType::F32.into() {
                unscaled
            } else {
                B::float_cast(unscaled, dtype.into())
            });
        }
        (out, found_inf)
    }

    fn field<B: Backend>(state: &FloatTensor<B>, f: ScaleState) -> FloatTensor<B> {
        let i = f as usize;
        B::float_slice(state.clone(), &[Slice::from(i..i + 1)])
    }

    /// `if cond { a } else { b }` elementwise, with `cond` 0.0/1.0: `b + cond * (a - b)` is
    /// not exact for large values, so select through a mask.
    pub(crate) fn select<B: Backend>(
        cond: FloatTensor<B>,
        a: FloatTensor<B>,
        b: FloatTensor<B>,
    ) -> FloatTensor<B> {
        let device = B::float_device(&cond);
        let bool_dtype = get_device_settings::<B>(&device).bool_dtype;
        let mask = B::float_greater_elem(cond, s(0.5), bool_dtype);
        B::float_mask_where(b, mask, a)
    }

    fn full<B: Backend>(value: f64, like: &FloatTensor<B>) -> FloatTensor<B> {
        B::float_full(
            Shape::new([1]),
            s(value),
            &B::float_device(like),
            FloatDType::F32,
        )
    }

    /// The scale update, PyTorch's `_amp_update_scale_` with DeepSpeed's hysteresis:
    ///
    /// - overflow: the growth tracker resets; if `hysteresis_left <= 1` the scale backs off
    ///   (`max(scale * backoff, min_scale)`), otherwise `hysteresis_left -= 1`.
    ///   `floor_overflows` counts overflows in a row with the scale already at `min_scale`.
    /// - clean step: the tracker counts up; at `growth_interval` the scale grows to
    ///   `scale * growth` unless that passes `max_scale` or is not finite (then it stays, as
    ///   PyTorch keeps a scale whose growth is not finite), the tracker resets and
    ///   `hysteresis_left` refills. `floor_overflows` resets.
    pub fn update_scale<B: Backend>(
        state: FloatTensor<B>,
        found_inf: FloatTensor<B>,
        rule: ScaleRule,
    ) -> FloatTensor<B> {
        let scale = field::<B>(&state, ScaleState::Scale);
        let tracker = field::<B>(&state, ScaleState::GrowthTracker);
        let hyst = field::<B>(&state, ScaleState::HysteresisLeft);
        let floor = field::<B>(&state, ScaleState::FloorOverflows);
        let device = B::float_device(&state);
        let bool_dtype = get_device_settings::<B>(&device).bool_dtype;
        let zero = || full::<B>(0.0, &state);

        // Overflow branch.
        let backoff = B::bool_into_float(
            B::float_lower_equal_elem(hyst.clone(), s(1.0), bool_dtype),
            FloatDType::F32,
        );
        let backed_off = maximum::<B>(
            B::float_mul_scalar(scale.clone(), s(rule.backoff_factor as f64)),
            full::<B>(rule.min_scale as f64, &state),
        );
        let at_floor = B::bool_into_float(
            B::float_lower_equal_elem(scale.clone(), s(rule.min_scale as f64), bool_dtype),
            FloatDType::F32,
        );
        let inf_scale = select::<B>(backoff.clone(), backed_off, scale.clone());
        let inf_hyst = select::<B>(
            backoff,
            hyst.clone(),
            B::float_sub_scalar(hyst.clone(), s(1.0)),
        );
        let inf_floor = select::<B>(at_floor, B::float_add_scalar(floor, s(1.0)), zero());

        // Clean branch.
        let counted = B::float_add_scalar(tracker, s(1.0));
        let grow = B::bool_into_float(
            B::float_greater_equal_elem(
                counted.clone(),
                s(rule.growth_interval as f64),
                bool_dtype,
            ),
            FloatDType::F32,
        );
        let grown = B::float_mul_scalar(scale.clone(), s(rule.growth_factor as f64));
        // `grown <= max_scale` is false for inf and NaN: the scale then stays.
        let fits = B::bool_into_float(
            B::float_lower_equal_elem(grown.clone(), s(rule.max_scale as f64), bool_dtype),
            FloatDType::F32,
        );
        let grown = select::<B>(fits, grown, scale.clone());
        let ok_scale = select::<B>(grow.clone(), grown, scale);
        let ok_tracker = select::<B>(grow.clone(), zero(), counted);
        let ok_hyst = select::<B>(grow, full::<B>(rule.hysteresis as f64, &state), hyst);

        let inf = B::float_cat(vec![inf_scale, zero(), inf_hyst, inf_floor], 0);
        let ok = B::float_cat(vec![ok_scale, ok_tracker, ok_hyst, zero()], 0);
        let found = B::float_expand(found_inf, Shape::new([4]));
        select::<B>(found, inf, ok)
    }
}

/// Checks one non-empty gradient, raising `found` (f32 `[1]`, mutable) in place.
fn check_one<R: CubeRuntime>(grad: CubeTensor<R>, found: &CubeTensor<R>) {
    let launch = Elementwise::over(&[&grad]);
    let dtype = grad.dtype;
    let addr = address_type(&[&grad]);
    // SAFETY: every access is `ABSOLUTE_POS` behind the gradient's bounds check, or `[0]` of
    // the f32 `[1]` flag.
    unsafe {
        k::check_finite_kernel::launch_unchecked(
            &launch.client,
            launch.count,
            launch.dim,
            addr,
            launch.vector_size,
            grad.into_linear_view(),
            found.clone().into_tensor_arg(),
            dtype.into(),
        )
    };
}

/// Unscales one non-empty gradient and raises `found` (f32 `[1]`, mutable) in place.
fn unscale_one<R: CubeRuntime>(
    grad: CubeTensor<R>,
    inv_scale: &CubeTensor<R>,
    found: &CubeTensor<R>,
) -> CubeTensor<R> {
    let launch = Elementwise::over(&[&grad]);
    let dtype = grad.dtype;
    let (out, out_view) = output_for(&grad, 0);
    let addr = address_type(&[&grad, &out]);
    // SAFETY: every access is `ABSOLUTE_POS` behind the output's bounds check, on views of
    // one shape, or `[0]` of the f32 `[1]` device scalars.
    unsafe {
        k::unscale_and_check_kernel::launch_unchecked(
            &launch.client,
            launch.count,
            launch.dim,
            addr,
            launch.vector_size,
            grad.into_linear_view(),
            inv_scale.clone().into_tensor_arg(),
            found.clone().into_tensor_arg(),
            out_view,
            dtype.into(),
        )
    };
    out
}

/// The flag as an f32 `[1]` buffer the kernels may raise: never one someone else reads.
fn writable_flag<R: CubeRuntime>(found_inf: CubeTensor<R>) -> CubeTensor<R> {
    let found = scalar_f32(found_inf, "found_inf");
    if found.can_mut() { found } else { found.copy() }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> ScalerKernels
    for CubeBackend<R, F, I, BT>
{
    fn check_finite(
        grads: Vec<FloatTensor<Self>>,
        found_inf: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if grads.iter().all(|g| g.meta.num_elements() == 0) {
            return found_inf;
        }
        let found = writable_flag(found_inf);
        for grad in grads {
            if grad.meta.num_elements() != 0 {
                check_one(grad, &found);
            }
        }
        found
    }

    fn unscale_and_check(
        grads: Vec<FloatTensor<Self>>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
    ) -> (Vec<FloatTensor<Self>>, FloatTensor<Self>) {
        if grads.iter().all(|g| g.meta.num_elements() == 0) {
            return (grads, found_inf);
        }
        let inv_scale = scalar_f32(inv_scale, "inv_scale");
        let found = writable_flag(found_inf);
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
        let state = into_contiguous(scalar_f32(state, "the scaler state"));
        assert_eq!(
            state.meta.num_elements(),
            4,
            "the scaler state is an f32 [4] tensor"
        );
        let found = scalar_f32(found_inf, "found_inf");
        let client = state.client.clone();
        let out = empty_like(&state, DType::F32);
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
}

impl<B: FusionBackend + ScalerKernels> ScalerKernels for Fusion<B> {
    fn check_finite(
        grads: Vec<FloatTensor<Self>>,
        found_inf: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        // Empty gradients stay out of the op: nothing to check.
        let mut inputs: Vec<_> = grads
            .into_iter()
            .filter(|g| g.shape().num_elements() != 0)
            .collect();
        if inputs.is_empty() {
            return found_inf;
        }
        let found = fusion::like::<B>(&found_inf);
        inputs.push(found_inf);
        let mut out =
            fusion::custom_op::<B, _>("burn_amp_check_finite", inputs, &[found], |mut inputs| {
                let found = inputs.pop().unwrap();
                vec![B::check_finite(inputs, found)]
            });
        out.pop().unwrap()
    }

    fn unscale_and_check(
        grads: Vec<FloatTensor<Self>>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
    ) -> (Vec<FloatTensor<Self>>, FloatTensor<Self>) {
        // Empty gradients are returned as they are and stay out of the op.
        let mut result: Vec<Option<FloatTensor<Self>>> = Vec::with_capacity(grads.len());
        let mut positions = Vec::new();
        let mut inputs = Vec::new();
        for grad in grads {
            if grad.shape().num_elements() == 0 {
                result.push(Some(grad));
            } else {
                positions.push(result.len());
                result.push(None);
                inputs.push(grad);
            }
        }
        if inputs.is_empty() {
            return (result.into_iter().map(Option::unwrap).collect(), found_inf);
        }
        let mut outputs: Vec<(Shape, DType)> = inputs.iter().map(fusion::like::<B>).collect();
        outputs.push(fusion::like::<B>(&found_inf));
        inputs.push(inv_scale);
        inputs.push(found_inf);
        let mut outs = fusion::custom_op::<B, _>(
            "burn_amp_unscale_and_check",
            inputs,
            &outputs,
            |mut inputs| {
                let found = inputs.pop().unwrap();
                let inv_scale = inputs.pop().unwrap();
                let (mut grads, found) = B::unscale_and_check(inputs, inv_scale, found);
                grads.push(found);
                grads
            },
        );
        let found = outs.pop().unwrap();
        for (pos, t) in positions.into_iter().zip(outs) {
            result[pos] = Some(t);
        }
        (result.into_iter().map(Option::unwrap).collect(), found)
    }

    fn update_scale(
        state: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        rule: ScaleRule,
    ) -> FloatTensor<Self> {
        let out = (state.shape(), DType::F32);
        fusion::custom_op::<B, _>(
            "burn_amp_update_scale",
            vec![state, found_inf],
            &[out],
            move |inputs| {
                let [state, found]: [_; 2] = inputs.try_into().ok().unwrap();
                vec![B::update_scale(state, found, rule)]
            },
        )
        .pop()
        .unwrap()
    }
}
