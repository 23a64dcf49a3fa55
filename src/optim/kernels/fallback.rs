//! The fused steps composed from plain burn ops: the reference the CubeCL kernels are tested
//! against, and what non-CubeCL backends run. None of them reads back to the host.

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata, get_device_settings};
use burn_std::{FloatDType, Shape};

use super::{AdamWConstants, AdamWMoments, Scaling, StochasticRounding, Velocity};
use crate::optim::rounding::fallback::stochastic_round;
use crate::optim::{FusedAdamWConfig, FusedSgdConfig};
use crate::scaler::kernels::fallback::{s, select, to_f32};

/// `found_inf` broadcast to `shape`, as the skip mask.
pub(crate) fn skip_mask<B: Backend>(
    found_inf: &FloatTensor<B>,
    shape: &Shape,
) -> burn_backend::tensor::BoolTensor<B> {
    let device = B::float_device(found_inf);
    let bool_dtype = get_device_settings::<B>(&device).bool_dtype;
    let flag = broadcast::<B>(found_inf.clone(), shape);
    B::float_greater_elem(flag, s(0.5), bool_dtype)
}

/// A `[1]` tensor broadcast to `shape`.
fn broadcast<B: Backend>(t: FloatTensor<B>, shape: &Shape) -> FloatTensor<B> {
    let ones = vec![1; shape.num_dims()];
    B::float_expand(B::float_reshape(t, Shape::from(ones)), shape.clone())
}

/// `count + 1 - found_inf`: the count after this step.
fn next_count<B: Backend>(step: FloatTensor<B>, found_inf: FloatTensor<B>) -> FloatTensor<B> {
    let applied = B::float_add_scalar(B::float_neg(found_inf), s(1.0));
    B::float_add(step, applied)
}

fn to_dtype<B: Backend>(t: FloatTensor<B>, dtype: burn_std::DType) -> FloatTensor<B> {
    if t.dtype() == dtype {
        t
    } else {
        B::float_cast(t, dtype.into())
    }
}

/// See [`OptimKernels::adamw_step`](super::OptimKernels::adamw_step).
pub fn adamw_step<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    state: AdamWMoments<FloatTensor<B>>,
    scaling: Scaling<FloatTensor<B>>,
    lr: f32,
    c: &FusedAdamWConfig,
) -> (FloatTensor<B>, AdamWMoments<FloatTensor<B>>) {
    let shape = param.shape();
    if shape.num_elements() == 0 {
        // Nothing to update; the count still follows the rule.
        let step = next_count::<B>(state.step, scaling.found_inf);
        return (param, AdamWMoments { step, ..state });
    }
    let k = AdamWConstants::new(lr, c);
    let dtype = param.dtype();
    let bool_dtype = get_device_settings::<B>(&B::float_device(&param)).bool_dtype;
    let AdamWMoments {
        exp_avg,
        exp_avg_sq,
        max_exp_avg_sq,
        step,
    } = state;
    let p = to_f32::<B>(param.clone());
    let mut g = B::float_mul(to_f32::<B>(grad), broadcast::<B>(scaling.inv_scale, &shape));
    if let Some(l2) = k.l2 {
        g = B::float_add(g, B::float_mul_scalar(p.clone(), s(l2 as f64)));
    }
    let m = B::float_add(
        B::float_mul_scalar(exp_avg.clone(), s(c.beta_1 as f64)),
        B::float_mul_scalar(g.clone(), s(k.one_minus_beta1 as f64)),
    );
    let v = B::float_add(
        B::float_mul_scalar(exp_avg_sq.clone(), s(c.beta_2 as f64)),
        B::float_mul_scalar(B::float_mul(g.clone(), g), s(k.one_minus_beta2 as f64)),
    );
    // Bias corrections from this parameter's count, this step included:
    // 1 - beta^t = 1 - exp(t ln beta).
    let t = broadcast::<B>(B::float_add_scalar(step.clone(), s(1.0)), &shape);
    let bc1 = B::float_neg(B::float_sub_scalar(
        B::float_exp(B::float_mul_scalar(t.clone(), s(k.ln_beta1 as f64))),
        s(1.0),
    ));
    let bc2 = B::float_neg(B::float_sub_scalar(
        B::float_exp(B::float_mul_scalar(t, s(k.ln_beta2 as f64))),
        s(1.0),
    ));
    // AMSGrad: the running maximum (the old one where the new moment is not above it).
    let max_v = max_exp_avg_sq.clone().map(|old| {
        let grew = B::float_lower(old.clone(), v.clone(), bool_dtype);
        B::float_mask_where(old, grew, v.clone())
    });
    let m_hat = B::float_div(m.clone(), bc1);
    let v_hat = B::float_div(max_v.clone().unwrap_or_else(|| v.clone()), bc2);
    let update = B::float_div(
        m_hat,
        B::float_add_scalar(B::float_sqrt(v_hat), s(c.epsilon as f64)),
    );
    let mut decayed = B::float_mul_scalar(p.clone(), s(k.decay as f64));
    if c.cautious_weight_decay {
        // Opposed signs of value and first moment (the update's sign) keep the value.
        let positive = |t: &FloatTensor<B>| B::float_greater_elem(t.clone(), s(0.0), bool_dtype);
        let negative = |t: &FloatTensor<B>| B::float_lower_elem(t.clone(), s(0.0), bool_dtype);
        let opposed = B::bool_or(
            B::bool_and(positive(&p), negative(&m)),
            B::bool_and(negative(&p), positive(&m)),
        );
        decayed = B::float_mask_where(decayed, opposed, p);
    }
    let new_p = B::float_sub(decayed, B::float_mul_scalar(update, s(lr as f64)));
    let rounding = StochasticRounding::new(c.weight_rounding, c.seed, dtype, shape.num_elements());
    let new_p = match rounding {
        Some(r) => stochastic_round::<B>(new_p, B::float_add_scalar(step.clone(), s(1.0)), r),
        None => new_p,
    };
    let new_p = to_dtype::<B>(new_p, dtype);
    let skip = skip_mask::<B>(&scaling.found_inf, &shape);
    let state = AdamWMoments {
        exp_avg: B::float_mask_where(m, skip.clone(), exp_avg),
        exp_avg_sq: B::float_mask_where(v, skip.clone(), exp_avg_sq),
        max_exp_avg_sq: max_v
            .zip(max_exp_avg_sq)
            .map(|(new, old)| B::float_mask_where(new, skip.clone(), old)),
        step: next_count::<B>(step, scaling.found_inf),
    };
    (B::float_mask_where(new_p, skip, param), state)
}

/// See [`OptimKernels::sgd_step`](super::OptimKernels::sgd_step).
pub fn sgd_step<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    velocity: Option<Velocity<FloatTensor<B>>>,
    scaling: Scaling<FloatTensor<B>>,
    lr: f32,
    c: &FusedSgdConfig,
) -> (FloatTensor<B>, Option<Velocity<FloatTensor<B>>>) {
    let shape = param.shape();
    if shape.num_elements() == 0 {
        // Nothing to update; the count still follows the rule.
        let velocity = velocity.filter(|_| c.momentum != 0.0).map(|v| Velocity {
            step: next_count::<B>(v.step, scaling.found_inf.clone()),
            ..v
        });
        return (param, velocity);
    }
    let dtype = param.dtype();
    let p = to_f32::<B>(param.clone());
    let mut g = B::float_mul(to_f32::<B>(grad), broadcast::<B>(scaling.inv_scale, &shape));
    if c.weight_decay != 0.0 {
        g = B::float_add(g, B::float_mul_scalar(p.clone(), s(c.weight_decay as f64)));
    }
    let skip = skip_mask::<B>(&scaling.found_inf, &shape);
    let velocity = match velocity.filter(|_| c.momentum != 0.0) {
        None => None,
        Some(Velocity { velocity, step }) => {
            let continued = B::float_add(
                B::float_mul_scalar(velocity.clone(), s(c.momentum as f64)),
                B::float_mul_scalar(g.clone(), s(1.0 - c.dampening as f64)),
            );
            // PyTorch: the first applied step's buffer is the gradient itself.
            let started = broadcast::<B>(step.clone(), &shape);
            let b = select::<B>(started, continued, g.clone());
            g = if c.nesterov {
                B::float_add(g, B::float_mul_scalar(b.clone(), s(c.momentum as f64)))
            } else {
                b.clone()
            };
            Some(Velocity {
                velocity: B::float_mask_where(b, skip.clone(), velocity),
                step: next_count::<B>(step, scaling.found_inf),
            })
        }
    };
    let new_p = B::float_sub(p, B::float_mul_scalar(g, s(lr as f64)));
    let new_p = to_dtype::<B>(new_p, dtype);
    (B::float_mask_where(new_p, skip, param), velocity)
}

/// Zeros of `like`'s shape in f32, on its device: a new moment or velocity.
pub(crate) fn zeros_f32<B: Backend>(like: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_zeros(like.shape(), &B::float_device(like), FloatDType::F32)
}

/// An f32 `[1]` zero on `like`'s device: a new step count.
pub(crate) fn zero_count<B: Backend>(like: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_zeros(Shape::new([1]), &B::float_device(like), FloatDType::F32)
}
