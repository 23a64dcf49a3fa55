//! The kernels of [`AmpKernels`](super::AmpKernels) composed from plain burn ops: the
//! reference the CubeCL kernels are tested against, and what non-CubeCL backends run.
//! None of them reads back to the host.

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Scalar, TensorMetadata, get_device_settings};
use burn_std::{DType, FloatDType, Shape, Slice};

use super::{AdamWHyper, ScaleRule, ScaleState, SgdHyper};

fn s(v: f64) -> Scalar {
    Scalar::Float(v)
}

/// `tensor` as f32 (no copy when it is already).
fn to_f32<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
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

/// See [`AmpKernels::unscale_and_check`](super::AmpKernels::unscale_and_check).
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

/// Elementwise max of two tensors of one shape (NaN-free inputs).
fn maximum<B: Backend>(a: FloatTensor<B>, b: FloatTensor<B>) -> FloatTensor<B> {
    let bool_dtype = get_device_settings::<B>(&B::float_device(&a)).bool_dtype;
    let a_smaller = B::float_lower(a.clone(), b.clone(), bool_dtype);
    B::float_mask_where(a, a_smaller, b)
}

/// Elementwise min of two tensors of one shape.
fn minimum<B: Backend>(a: FloatTensor<B>, b: FloatTensor<B>) -> FloatTensor<B> {
    let bool_dtype = get_device_settings::<B>(&B::float_device(&a)).bool_dtype;
    let a_larger = B::float_greater(a.clone(), b.clone(), bool_dtype);
    B::float_mask_where(a, a_larger, b)
}

fn field<B: Backend>(state: &FloatTensor<B>, f: ScaleState) -> FloatTensor<B> {
    let i = f as usize;
    B::float_slice(state.clone(), &[Slice::from(i..i + 1)])
}

/// `if cond { a } else { b }` elementwise, with `cond` 0.0/1.0: `b + cond * (a - b)` is not
/// exact for large values, so select through a mask.
fn select<B: Backend>(
    cond: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
) -> FloatTensor<B> {
    let device = B::float_device(&cond);
    let bool_dtype = get_device_settings::<B>(&device).bool_dtype;
    let mask = B::float_greater_elem(cond, s(0.5), bool_dtype);
    B::float_mask_where(b, mask, a)
}

/// The scale update, PyTorch's `_amp_update_scale_` with DeepSpeed's hysteresis:
///
/// - overflow: the growth tracker resets; if `hysteresis_left <= 1` the scale backs off
///   (`max(scale * backoff, min_scale)`), otherwise `hysteresis_left -= 1`. An overflow
///   with the scale already at `min_scale` counts one more `floor_overflows`.
/// - clean step: the tracker counts up; at `growth_interval` the scale grows
///   (`min(scale * growth, max_scale)`), the tracker resets, `hysteresis_left` refills
///   and `floor_overflows` resets.
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

    // Overflow branch.
    let backoff = B::bool_into_float(
        B::float_lower_equal_elem(hyst.clone(), s(1.0), bool_dtype),
        FloatDType::F32,
    );
    let backed_off = maximum::<B>(
        B::float_mul_scalar(scale.clone(), s(rule.backoff_factor as f64)),
        B::float_full(
            Shape::new([1]),
            s(rule.min_scale as f64),
            &device,
            FloatDType::F32,
        ),
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
    let inf_tracker = B::float_zeros(Shape::new([1]), &device, FloatDType::F32);
    let inf_floor = B::float_add(floor.clone(), at_floor);

    // Clean branch.
    let counted = B::float_add_scalar(tracker, s(1.0));
    let grow = B::bool_into_float(
        B::float_greater_equal_elem(counted.clone(), s(rule.growth_interval as f64), bool_dtype),
        FloatDType::F32,
    );
    let grown = minimum::<B>(
        B::float_mul_scalar(scale.clone(), s(rule.growth_factor as f64)),
        B::float_full(
            Shape::new([1]),
            s(rule.max_scale as f64),
            &device,
            FloatDType::F32,
        ),
    );
    let ok_scale = select::<B>(grow.clone(), grown, scale);
    let ok_tracker = select::<B>(
        grow.clone(),
        B::float_zeros(Shape::new([1]), &device, FloatDType::F32),
        counted,
    );
    let full_hyst = B::float_full(
        Shape::new([1]),
        s(rule.hysteresis as f64),
        &device,
        FloatDType::F32,
    );
    let ok_hyst = select::<B>(grow.clone(), full_hyst, hyst);
    let ok_floor = select::<B>(
        grow,
        B::float_zeros(Shape::new([1]), &device, FloatDType::F32),
        floor,
    );

    let inf = B::float_cat(vec![inf_scale, inf_tracker, inf_hyst, inf_floor], 0);
    let ok = B::float_cat(vec![ok_scale, ok_tracker, ok_hyst, ok_floor], 0);
    let found = B::float_expand(found_inf, Shape::new([4]));
    select::<B>(found, inf, ok)
}

/// `found_inf` broadcast to `shape`, as the skip mask.
fn skip_mask<B: Backend>(
    found_inf: &FloatTensor<B>,
    shape: &Shape,
) -> burn_backend::tensor::BoolTensor<B> {
    let device = B::float_device(found_inf);
    let bool_dtype = get_device_settings::<B>(&device).bool_dtype;
    let ones = vec![1; shape.num_dims()];
    let flag = B::float_reshape(found_inf.clone(), Shape::from(ones));
    let flag = B::float_expand(flag, shape.clone());
    B::float_greater_elem(flag, s(0.5), bool_dtype)
}

/// A `[1]` tensor broadcast to `shape`.
fn broadcast<B: Backend>(t: FloatTensor<B>, shape: &Shape) -> FloatTensor<B> {
    let ones = vec![1; shape.num_dims()];
    B::float_expand(B::float_reshape(t, Shape::from(ones)), shape.clone())
}

/// See [`AmpKernels::adamw_step`](super::AmpKernels::adamw_step).
#[allow(clippy::too_many_arguments)]
pub fn adamw_step<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    exp_avg: FloatTensor<B>,
    exp_avg_sq: FloatTensor<B>,
    step: FloatTensor<B>,
    inv_scale: FloatTensor<B>,
    found_inf: FloatTensor<B>,
    h: AdamWHyper,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let shape = param.shape();
    if shape.num_elements() == 0 {
        return (param, exp_avg, exp_avg_sq);
    }
    let dtype = param.dtype();
    let p = to_f32::<B>(param.clone());
    let g = B::float_mul(to_f32::<B>(grad), broadcast::<B>(inv_scale, &shape));
    let m = B::float_add(
        B::float_mul_scalar(exp_avg.clone(), s(h.beta1 as f64)),
        B::float_mul_scalar(g.clone(), s(1.0 - h.beta1 as f64)),
    );
    let v = B::float_add(
        B::float_mul_scalar(exp_avg_sq.clone(), s(h.beta2 as f64)),
        B::float_mul_scalar(B::float_mul(g.clone(), g), s(1.0 - h.beta2 as f64)),
    );
    // Bias corrections from the device step count: 1 - beta^t = 1 - exp(t ln beta).
    let t = broadcast::<B>(step, &shape);
    let bc1 = B::float_neg(B::float_sub_scalar(
        B::float_exp(B::float_mul_scalar(t.clone(), s((h.beta1 as f64).ln()))),
        s(1.0),
    ));
    let bc2 = B::float_neg(B::float_sub_scalar(
        B::float_exp(B::float_mul_scalar(t, s((h.beta2 as f64).ln()))),
        s(1.0),
    ));
    let m_hat = B::float_div(m.clone(), bc1);
    let v_hat = B::float_div(v.clone(), bc2);
    let update = B::float_div(
        m_hat,
        B::float_add_scalar(B::float_sqrt(v_hat), s(h.epsilon as f64)),
    );
    let decayed = B::float_mul_scalar(p, s(1.0 - (h.lr * h.weight_decay) as f64));
    let new_p = B::float_sub(decayed, B::float_mul_scalar(update, s(h.lr as f64)));
    let new_p = if dtype == FloatDType::F32.into() {
        new_p
    } else {
        B::float_cast(new_p, dtype.into())
    };
    let skip = skip_mask::<B>(&found_inf, &shape);
    (
        B::float_mask_where(new_p, skip.clone(), param),
        B::float_mask_where(m, skip.clone(), exp_avg),
        B::float_mask_where(v, skip, exp_avg_sq),
    )
}

/// See [`AmpKernels::sgd_step`](super::AmpKernels::sgd_step).
pub fn sgd_step<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    momentum: Option<FloatTensor<B>>,
    inv_scale: FloatTensor<B>,
    found_inf: FloatTensor<B>,
    h: SgdHyper,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let shape = param.shape();
    if shape.num_elements() == 0 {
        return (param, momentum);
    }
    let dtype = param.dtype();
    let p = to_f32::<B>(param.clone());
    let mut g = B::float_mul(to_f32::<B>(grad), broadcast::<B>(inv_scale, &shape));
    if h.weight_decay != 0.0 {
        g = B::float_add(g, B::float_mul_scalar(p.clone(), s(h.weight_decay as f64)));
    }
    let skip = skip_mask::<B>(&found_inf, &shape);
    let mut new_buf = None;
    if h.momentum != 0.0 {
        let buf = match momentum.clone() {
            Some(buf) => B::float_add(
                B::float_mul_scalar(buf, s(h.momentum as f64)),
                B::float_mul_scalar(g.clone(), s(1.0 - h.dampening as f64)),
            ),
            // PyTorch: the first step's buffer is the gradient itself.
            None => g.clone(),
        };
        g = if h.nesterov {
            B::float_add(g, B::float_mul_scalar(buf.clone(), s(h.momentum as f64)))
        } else {
            buf.clone()
        };
        new_buf = Some(match momentum {
            Some(old) => B::float_mask_where(buf, skip.clone(), old),
            None => B::float_mask_where(
                buf,
                skip.clone(),
                B::float_zeros(shape.clone(), &B::float_device(&p), FloatDType::F32),
            ),
        });
    }
    let new_p = B::float_sub(p, B::float_mul_scalar(g, s(h.lr as f64)));
    let new_p = if dtype == FloatDType::F32.into() {
        new_p
    } else {
        B::float_cast(new_p, dtype.into())
    };
    (B::float_mask_where(new_p, skip, param), new_buf)
}

/// See [`AmpKernels::accumulate`](super::AmpKernels::accumulate).
///
/// Exactly the burn-tensor ops the plain `acc + grad.cast(..).mul_scalar(weight)` runs, in
/// its order: a cast only when the dtype differs (as `Tensor::cast`), no multiplication for a
/// weight of 1, then one `add`.
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
