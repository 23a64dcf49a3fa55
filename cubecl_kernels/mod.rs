//! The CubeCL kernels behind [`AmpKernels`](crate::kernels::AmpKernels).
//!
//! Every kernel is generic over the float type of its tensors through `#[define(..)]` and a
//! run-time [`StorageType`], so one kernel serves f16, bf16 and f32: the dtype is chosen at
//! launch. The math is always f32; only the stored values use the tensors' own dtypes.
//! Scalars of the run-time float type cannot be launch scalars, so hyper-parameters are f32.
//!
//! Each elementwise kernel takes [`LinearView`]s: any layout is read in logical order, and the
//! loads are vectorised (`N`) whenever the innermost dimension allows it. The device scalars
//! (`inv_scale`, `found_inf`, `step`, the scaler state) are f32 `[1]`/`[4]` tensors read in the
//! kernel, so nothing is ever read back to the host.
//!
//! Outputs are separate arguments; the host side either allocates them or passes them as
//! aliases of their inputs (in place) when the input buffer may be mutated.

use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;

/// Whether any lane of `x` is NaN or ±inf.
#[cube]
fn any_non_finite<N: Size>(x: Vector<f32, N>) -> bool {
    let bad = Vector::<u32, N>::cast_from(Vector::is_nan(x))
        + Vector::<u32, N>::cast_from(Vector::is_inf(x));
    let mut acc = 0u32;
    #[unroll]
    for i in 0..N::value() {
        acc += bad[i];
    }
    acc != 0u32
}

/// `out = grad * inv_scale[0]` (in f32, stored in the grad's dtype), and
/// `found_inf[0] = 1.0` if any element of `grad` is NaN or ±inf.
///
/// Every writer of `found_inf` stores the same value, so a plain store is race-free in
/// effect. `found_inf` is never lowered here.
#[cube(launch, launch_unchecked, address_type = "dynamic")]
pub fn unscale_and_check_kernel<F: Float, N: Size>(
    grad: &LinearView<Vector<F, N>>,
    inv_scale: &Tensor<f32>,
    found_inf: &mut Tensor<f32>,
    output: &mut LinearView<Vector<F, N>, ReadWrite>,
    #[define(F)] _dtype: StorageType,
) {
    if !output.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    let g = Vector::<f32, N>::cast_from(grad[ABSOLUTE_POS]);
    if any_non_finite::<N>(g) {
        found_inf[0] = 1.0f32;
    }
    output[ABSOLUTE_POS] = Vector::cast_from(g * Vector::new(inv_scale[0]));
}

/// The dynamic loss-scale update, one thread; `fallback::update_scale` op for op.
///
/// `state`/`output` are f32 `[4]`: scale, growth tracker, hysteresis left, floor overflows.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn update_scale_kernel(
    state: &Tensor<f32>,
    found_inf: &Tensor<f32>,
    output: &mut Tensor<f32>,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
    hysteresis: u32,
    min_scale: f32,
    max_scale: f32,
) {
    if ABSOLUTE_POS != 0 {
        terminate!();
    }
    let scale = state[0];
    let tracker = state[1];
    let hyst = state[2];
    let floor = state[3];

    if found_inf[0] > 0.5f32 {
        // Overflow: back off once the hysteresis is used up.
        let backoff = hyst <= 1.0f32;
        let scaled = scale * backoff_factor;
        // `maximum(a, b)`: `b` where `a < b`, else `a`.
        let backed_off = if scaled < min_scale {
            min_scale
        } else {
            scaled
        };
        output[0] = if backoff { backed_off } else { scale };
        output[1] = 0.0f32;
        output[2] = if backoff { hyst } else { hyst - 1.0f32 };
        // Not `floor + if at_floor { 1.0 } else { 0.0 }`: in cubecl 0.10 an `if` expression
        // with two literal branches compiled to the else value.
        output[3] = if scale <= min_scale {
            floor + 1.0f32
        } else {
            floor
        };
    } else {
        // Clean step: count it; grow at `growth_interval`.
        let counted = tracker + 1.0f32;
        if counted >= f32::cast_from(growth_interval) {
            let grown = scale * growth_factor;
            // `minimum(a, b)`: `b` where `a > b`, else `a`.
            output[0] = if grown > max_scale { max_scale } else { grown };
            output[1] = 0.0f32;
            output[2] = f32::cast_from(hysteresis);
            output[3] = 0.0f32;
        } else {
            output[0] = scale;
            output[1] = counted;
            output[2] = hyst;
            output[3] = floor;
        }
    }
}

/// One AdamW step on one parameter; `fallback::adamw_step` op for op.
///
/// When `found_inf[0]` is raised, the outputs receive the inputs unchanged (a bit copy, a
/// no-op when the outputs alias the inputs).
#[cube(launch, launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn adamw_kernel<P: Float, G: Float, N: Size>(
    param: &LinearView<Vector<P, N>>,
    grad: &LinearView<Vector<G, N>>,
    exp_avg: &LinearView<Vector<f32, N>>,
    exp_avg_sq: &LinearView<Vector<f32, N>>,
    step: &Tensor<f32>,
    inv_scale: &Tensor<f32>,
    found_inf: &Tensor<f32>,
    param_out: &mut LinearView<Vector<P, N>, ReadWrite>,
    exp_avg_out: &mut LinearView<Vector<f32, N>, ReadWrite>,
    exp_avg_sq_out: &mut LinearView<Vector<f32, N>, ReadWrite>,
    lr: f32,
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    ln_beta1: f32,
    ln_beta2: f32,
    epsilon: f32,
    decay: f32,
    #[define(P, G)] _dtypes: [StorageType; 2],
) {
    if !param_out.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    let pos = ABSOLUTE_POS;
    if found_inf[0] > 0.5f32 {
        param_out[pos] = param[pos];
        exp_avg_out[pos] = exp_avg[pos];
        exp_avg_sq_out[pos] = exp_avg_sq[pos];
        terminate!();
    }

    let p = Vector::<f32, N>::cast_from(param[pos]);
    let g = Vector::<f32, N>::cast_from(grad[pos]) * Vector::new(inv_scale[0]);
    let m = exp_avg[pos] * Vector::new(beta1) + g * Vector::new(one_minus_beta1);
    let v = exp_avg_sq[pos] * Vector::new(beta2) + (g * g) * Vector::new(one_minus_beta2);

    // Bias corrections from the device step count: 1 - beta^t = -(exp(t ln beta) - 1).
    let t = step[0];
    let bc1 = -(f32::exp(t * ln_beta1) - 1.0f32);
    let bc2 = -(f32::exp(t * ln_beta2) - 1.0f32);

    let m_hat = m / Vector::new(bc1);
    let v_hat = v / Vector::new(bc2);
    let update = m_hat / (Vector::sqrt(v_hat) + Vector::new(epsilon));
    let new_p = p * Vector::new(decay) - update * Vector::new(lr);

    param_out[pos] = Vector::cast_from(new_p);
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

/// One SGD step without momentum; `fallback::sgd_step` with `momentum == 0`.
#[cube(launch, launch_unchecked, address_type = "dynamic")]
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

/// One SGD step with an existing f32 momentum buffer.
#[cube(launch, launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn sgd_momentum_kernel<P: Float, G: Float, N: Size>(
    param: &LinearView<Vector<P, N>>,
    grad: &LinearView<Vector<G, N>>,
    buf: &LinearView<Vector<f32, N>>,
    inv_scale: &Tensor<f32>,
    found_inf: &Tensor<f32>,
    param_out: &mut LinearView<Vector<P, N>, ReadWrite>,
    buf_out: &mut LinearView<Vector<f32, N>, ReadWrite>,
    lr: f32,
    weight_decay: f32,
    momentum: f32,
    one_minus_dampening: f32,
    #[comptime] has_weight_decay: bool,
    #[comptime] nesterov: bool,
    #[define(P, G)] _dtypes: [StorageType; 2],
) {
    if !param_out.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    let pos = ABSOLUTE_POS;
    if found_inf[0] > 0.5f32 {
        param_out[pos] = param[pos];
        buf_out[pos] = buf[pos];
        terminate!();
    }
    let p = Vector::<f32, N>::cast_from(param[pos]);
    let g = sgd_gradient::<G, N>(grad[pos], p, inv_scale[0], weight_decay, has_weight_decay);
    let b = buf[pos] * Vector::new(momentum) + g * Vector::new(one_minus_dampening);
    let d = if comptime![nesterov] {
        g + b * Vector::new(momentum)
    } else {
        b
    };
    param_out[pos] = Vector::cast_from(p - d * Vector::new(lr));
    buf_out[pos] = b;
}

/// One SGD step creating the f32 momentum buffer (PyTorch: the first buffer is the
/// gradient itself). A skipped step leaves the parameter and writes a zero buffer, as the
/// fallback does.
#[cube(launch, launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn sgd_momentum_init_kernel<P: Float, G: Float, N: Size>(
    param: &LinearView<Vector<P, N>>,
    grad: &LinearView<Vector<G, N>>,
    inv_scale: &Tensor<f32>,
    found_inf: &Tensor<f32>,
    param_out: &mut LinearView<Vector<P, N>, ReadWrite>,
    buf_out: &mut LinearView<Vector<f32, N>, ReadWrite>,
    lr: f32,
    weight_decay: f32,
    momentum: f32,
    #[comptime] has_weight_decay: bool,
    #[comptime] nesterov: bool,
    #[define(P, G)] _dtypes: [StorageType; 2],
) {
    if !param_out.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    let pos = ABSOLUTE_POS;
    if found_inf[0] > 0.5f32 {
        param_out[pos] = param[pos];
        buf_out[pos] = Vector::new(0.0f32);
        terminate!();
    }
    let p = Vector::<f32, N>::cast_from(param[pos]);
    let g = sgd_gradient::<G, N>(grad[pos], p, inv_scale[0], weight_decay, has_weight_decay);
    let d = if comptime![nesterov] {
        g + g * Vector::new(momentum)
    } else {
        g
    };
    param_out[pos] = Vector::cast_from(p - d * Vector::new(lr));
    buf_out[pos] = g;
}

/// `output = acc + f32(grad) * weight`: one micro-step of gradient accumulation into an f32
/// partial sum; `fallback::accumulate` op for op (a multiply then an add; a compiler that
/// contracts them into one fused multiply-add rounds once instead of twice).
///
/// `output` may alias `acc` (in place).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn accumulate_kernel<G: Float, N: Size>(
    acc: &LinearView<Vector<f32, N>>,
    grad: &LinearView<Vector<G, N>>,
    output: &mut LinearView<Vector<f32, N>, ReadWrite>,
    weight: f32,
    #[define(G)] _dtype: StorageType,
) {
    if !output.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    let pos = ABSOLUTE_POS;
    let g = Vector::<f32, N>::cast_from(grad[pos]) * Vector::new(weight);
    output[pos] = acc[pos] + g;
}

/// `output = f32(grad) * weight`: the first micro-step of a window (no partial sum yet).
///
/// `output` may alias `grad` when `grad` is f32 (in place).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn accumulate_init_kernel<G: Float, N: Size>(
    grad: &LinearView<Vector<G, N>>,
    output: &mut LinearView<Vector<f32, N>, ReadWrite>,
    weight: f32,
    #[define(G)] _dtype: StorageType,
) {
    if !output.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    output[ABSOLUTE_POS] = Vector::<f32, N>::cast_from(grad[ABSOLUTE_POS]) * Vector::new(weight);
}
