//! The fused optimizer steps: unscale, skip-on-overflow and the update of one parameter in
//! one pass, with f32 state and f32 math whatever the parameter's dtype.
//!
//! A parameter's step count is an f32 `[1]` device tensor: every unit reads the count before
//! this step, and unit 0 writes the new one (+1 unless skipped) to a separate buffer.

use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;

use super::rounding::{random16, stochastic_round};

/// `count + 1` unless the step is skipped: written once, by unit 0.
#[cube]
pub fn write_count(step: &Tensor<f32>, step_out: &mut Tensor<f32>, skipped: bool) {
    if ABSOLUTE_POS == 0 {
        let mut next = step[0];
        if !skipped {
            next += 1.0f32;
        }
        step_out[0] = next;
    }
}

/// `p` after AdamW's decoupled weight decay (`decay = 1 - lr * weight_decay`). Cautious: an
/// element whose first moment (the update's sign) and value have opposite signs keeps its
/// value; a zero on either side counts as aligned.
#[cube]
pub fn decayed(p: f32, m: f32, decay: f32, #[comptime] cautious: bool) -> f32 {
    if comptime![cautious] {
        let opposed = (p > 0.0f32 && m < 0.0f32) || (p < 0.0f32 && m > 0.0f32);
        select(opposed, p, p * decay)
    } else {
        p * decay
    }
}

/// One AdamW step on one parameter; `optim::kernels::fallback::adamw_step` op for op. With
/// `max_exp_avg_sq` (AMSGrad) the denominator uses the running maximum of the second moment;
/// with `has_l2` (Adam) the gradient gets `l2 * p` and `decay` is 1.
///
/// When `found_inf[0]` is raised, the outputs receive the inputs unchanged (a bit copy, a
/// no-op when the outputs alias the inputs) and the count stays.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn adamw_kernel<P: Float, G: Float, N: Size>(
    param: &LinearView<Vector<P, N>>,
    grad: &LinearView<Vector<G, N>>,
    exp_avg: &LinearView<Vector<f32, N>>,
    exp_avg_sq: &LinearView<Vector<f32, N>>,
    step: &Tensor<f32>,
    inv_scale: &Tensor<f32>,
    found_inf: &Tensor<f32>,
    max_exp_avg_sq: &ComptimeOption<LinearView<Vector<f32, N>>>,
    param_out: &mut LinearView<Vector<P, N>, ReadWrite>,
    exp_avg_out: &mut LinearView<Vector<f32, N>, ReadWrite>,
    exp_avg_sq_out: &mut LinearView<Vector<f32, N>, ReadWrite>,
    step_out: &mut Tensor<f32>,
    max_exp_avg_sq_out: &mut ComptimeOption<LinearView<Vector<f32, N>, ReadWrite>>,
    lr: f32,
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    ln_beta1: f32,
    ln_beta2: f32,
    epsilon: f32,
    decay: f32,
    l2: f32,
    seed: u32,
    ulp_scale: f32,
    min_binade: f32,
    #[comptime] stochastic: bool,
    #[comptime] cautious: bool,
    #[comptime] has_l2: bool,
    #[define(P, G)] _dtypes: [StorageType; 2],
) {
    let skipped = found_inf[0] > 0.5f32;
    write_count(step, step_out, skipped);
    if !param_out.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    let pos = ABSOLUTE_POS;
    if skipped {
        param_out[pos] = param[pos];
        exp_avg_out[pos] = exp_avg[pos];
        exp_avg_sq_out[pos] = exp_avg_sq[pos];
        #[comptime]
        if let ComptimeOption::Some(max_out) = max_exp_avg_sq_out {
            max_out[pos] = max_exp_avg_sq.unwrap()[pos];
        }
        terminate!();
    }

    let p = Vector::<f32, N>::cast_from(param[pos]);
    let mut g = Vector::<f32, N>::cast_from(grad[pos]) * Vector::new(inv_scale[0]);
    if comptime![has_l2] {
        // Adam's L2 penalty, on the unscaled gradient.
        g += p * Vector::new(l2);
    }
    let m = exp_avg[pos] * Vector::new(beta1) + g * Vector::new(one_minus_beta1);
    let v = exp_avg_sq[pos] * Vector::new(beta2) + (g * g) * Vector::new(one_minus_beta2);

    // Bias corrections from this parameter's count, this step included:
    // 1 - beta^t = -(exp(t ln beta) - 1).
    let t = step[0] + 1.0f32;
    let bc1 = -(f32::exp(t * ln_beta1) - 1.0f32);
    let bc2 = -(f32::exp(t * ln_beta2) - 1.0f32);

    let mut v_denom = v;
    #[comptime]
    if let ComptimeOption::Some(max_out) = max_exp_avg_sq_out {
        v_denom = max(max_exp_avg_sq.unwrap()[pos], v);
        max_out[pos] = v_denom;
    }

    let m_hat = m / Vector::new(bc1);
    let v_hat = v_denom / Vector::new(bc2);
    let update = m_hat / (Vector::sqrt(v_hat) + Vector::new(epsilon));
    let mut p_decayed = p * Vector::new(decay);
    if comptime![cautious] {
        #[unroll]
        for i in 0..N::value() {
            p_decayed[i] = decayed(p[i], m[i], decay, true);
        }
    }
    let new_p = p_decayed - update * Vector::new(lr);

    if comptime![stochastic] {
        // Element `pos * N + i` in logical order: its rounding stream index.
        let step_bits = u32::cast_from(t);
        let mut rounded = new_p;
        #[unroll]
        for i in 0..N::value() {
            let index = (pos * N::value() + i) as u32;
            let r = random16(seed, step_bits, index);
            rounded[i] = stochastic_round(new_p[i], r, ulp_scale, min_binade);
        }
        param_out[pos] = Vector::cast_from(rounded);
    } else {
        param_out[pos] = Vector::cast_from(new_p);
    }
    exp_avg_out[pos] = m;
    exp_avg_sq_out[pos] = v;
}

/// The unscaled f32 gradient of SGD, with its L2 weight decay.
#[cube]
fn sgd_gradient<G: Float, N: Size>(
    grad: Vector<G, N>,
    p: Vector<f32, N>,
    inv_scale: f32,
    weight_decay: f32,
    #[comptime] has_weight_decay: bool,
) -> Vector<f32, N> {
    let g = Vector::<f32, N>::cast_from(grad) * Vector::new(inv_scale);
    if comptime![has_weight_decay] {
        g + p * Vector::new(weight_decay)
    } else {
        g
    }
}

/// One SGD step without momentum; `fallback::sgd_step` without a momentum buffer.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn sgd_kernel<P: Float, G: Float, N: Size>(
    param: &LinearView<Vector<P, N>>,
    grad: &LinearView<Vector<G, N>>,
    inv_scale: &Tensor<f32>,
    found_inf: &Tensor<f32>,
    param_out: &mut LinearView<Vector<P, N>, ReadWrite>,
    lr: f32,
    weight_decay: f32,
    #[comptime] has_weight_decay: bool,
    #[define(P, G)] _dtypes: [StorageType; 2],
) {
    if !param_out.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    let pos = ABSOLUTE_POS;
    if found_inf[0] > 0.5f32 {
        param_out[pos] = param[pos];
        terminate!();
    }
    let p = Vector::<f32, N>::cast_from(param[pos]);
    let g = sgd_gradient::<G, N>(grad[pos], p, inv_scale[0], weight_decay, has_weight_decay);
    param_out[pos] = Vector::cast_from(p - g * Vector::new(lr));
}

/// One SGD step with an f32 momentum buffer and its step count. The first applied step
/// (count 0) sets the buffer to the gradient itself, as PyTorch does, whatever the buffer
/// held; a skipped step changes nothing, so the next step is still the first.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn sgd_momentum_kernel<P: Float, G: Float, N: Size>(
    param: &LinearView<Vector<P, N>>,
    grad: &LinearView<Vector<G, N>>,
    buf: &LinearView<Vector<f32, N>>,
    step: &Tensor<f32>,
    inv_scale: &Tensor<f32>,
    found_inf: &Tensor<f32>,
    param_out: &mut LinearView<Vector<P, N>, ReadWrite>,
    buf_out: &mut LinearView<Vector<f32, N>, ReadWrite>,
    step_out: &mut Tensor<f32>,
    lr: f32,
    weight_decay: f32,
    momentum: f32,
    one_minus_dampening: f32,
    #[comptime] has_weight_decay: bool,
    #[comptime] nesterov: bool,
    #[define(P, G)] _dtypes: [StorageType; 2],
) {
    let skipped = found_inf[0] > 0.5f32;
    write_count(step, step_out, skipped);
    if !param_out.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    let pos = ABSOLUTE_POS;
    if skipped {
        param_out[pos] = param[pos];
        buf_out[pos] = buf[pos];
        terminate!();
    }
    let p = Vector::<f32, N>::cast_from(param[pos]);
    let g = sgd_gradient::<G, N>(grad[pos], p, inv_scale[0], weight_decay, has_weight_decay);
    let mut b = g;
    if step[0] > 0.5f32 {
        b = buf[pos] * Vector::new(momentum) + g * Vector::new(one_minus_dampening);
    }
    let d = if comptime![nesterov] {
        g + b * Vector::new(momentum)
    } else {
        b
    };
    param_out[pos] = Vector::cast_from(p - d * Vector::new(lr));
    buf_out[pos] = b;
}
