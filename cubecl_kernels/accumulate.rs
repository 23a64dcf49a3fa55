//! Gradient accumulation: `acc += f32(grad) × weight`.

use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;

/// `output = acc + f32(grad) * weight`: one micro-step of gradient accumulation into an f32
/// partial sum; `accumulate::kernels::fallback::accumulate` op for op (a multiply then an
/// add; a compiler that contracts them into one fused multiply-add rounds once instead of
/// twice).
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
