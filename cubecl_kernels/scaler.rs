//! Loss scaling: the inf/NaN check (read-only, or fused with unscaling) and the scale update.

use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;

use super::any_non_finite;

/// `found_inf[0] = 1.0` if any element of `grad` is NaN or ±inf. Reads `grad`, writes
/// nothing else: the fused optimizers then unscale inside their own kernels.
///
/// Every writer of `found_inf` stores the same value, so a plain store is race-free in
/// effect. `found_inf` is never lowered here.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn check_finite_kernel<F: Float, N: Size>(
    grad: &LinearView<Vector<F, N>>,
    found_inf: &mut Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    if !grad.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    if any_non_finite::<N>(Vector::<f32, N>::cast_from(grad[ABSOLUTE_POS])) {
        found_inf[0] = 1.0f32;
    }
}

/// `out = grad * inv_scale[0]` (in f32, stored in the grad's dtype), and
/// `found_inf[0] = 1.0` if any element of `grad` is NaN or ±inf.
#[cube(launch_unchecked, address_type = "dynamic")]
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

/// The dynamic loss-scale update, one thread; `scaler::kernels::fallback::update_scale` op
/// for op.
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
        // Overflows in a row with the scale already at the floor; any other step resets.
        // A statement, not an `if` expression: in cubecl 0.10 an `if` expression with two
        // literal branches compiled to the else value.
        let mut at_floor = 0.0f32;
        if scale <= min_scale {
            at_floor = floor + 1.0f32;
        }
        output[3] = at_floor;
    } else {
        // Clean step: count it; at `growth_interval` grow, unless the grown scale would pass
        // `max_scale` (or be inf): then keep it, as PyTorch keeps a scale whose growth is not
        // finite, so a power-of-two scale stays one.
        let counted = tracker + 1.0f32;
        if counted >= f32::cast_from(growth_interval) {
            let grown = scale * growth_factor;
            output[0] = if grown <= max_scale { grown } else { scale };
            output[1] = 0.0f32;
            output[2] = f32::cast_from(hysteresis);
        } else {
            output[0] = scale;
            output[1] = counted;
            output[2] = hyst;
        }
        output[3] = 0.0f32;
    }
}
