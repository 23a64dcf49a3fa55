//! A weight average: `average += (f32(weights) − average) · rate`.

use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;

/// `average + (f32(weights) − average) * rate` at `ABSOLUTE_POS` (bounds checked by the
/// caller), in f32.
#[cube]
fn lerp<W: Float, N: Size>(
    average: &LinearView<Vector<f32, N>>,
    weights: &LinearView<Vector<W, N>>,
    rate: f32,
) -> Vector<f32, N> {
    let a = average[ABSOLUTE_POS];
    let difference = Vector::<f32, N>::cast_from(weights[ABSOLUTE_POS]) - a;
    a + difference * Vector::new(rate)
}

/// `output = average + (f32(weights) − average) * rate[0]`: one update of an f32 weight
/// average from weights of any float dtype; `ema::kernels::fallback::ema_update` op for op.
/// `rate` (f32 `[1]` on the device) is `(1 − decay_n) · (1 − found_inf)`: 0 at a skipped
/// step, without a read.
///
/// `output` may alias `average` (in place).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn ema_update_kernel<W: Float, N: Size>(
    average: &LinearView<Vector<f32, N>>,
    weights: &LinearView<Vector<W, N>>,
    rate: &Tensor<f32>,
    output: &mut LinearView<Vector<f32, N>, ReadWrite>,
    #[define(W)] _dtype: StorageType,
) {
    if !output.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    output[ABSOLUTE_POS] = lerp::<W, N>(average, weights, rate[0]);
}

/// [`ema_update_kernel()`] with the rate known on the host (`1 − decay_n`, no overflow flag);
/// `ema::kernels::fallback::ema_update_scalar` op for op.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn ema_update_scalar_kernel<W: Float, N: Size>(
    average: &LinearView<Vector<f32, N>>,
    weights: &LinearView<Vector<W, N>>,
    output: &mut LinearView<Vector<f32, N>, ReadWrite>,
    rate: f32,
    #[define(W)] _dtype: StorageType,
) {
    if !output.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    output[ABSOLUTE_POS] = lerp::<W, N>(average, weights, rate);
}
