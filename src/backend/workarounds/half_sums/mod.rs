//! Half-precision kernels that sum in half precision. Autocast lowers a matmul or a
//! convolution to f16 for its speed and its memory, on the understanding every AMP library
//! gives: the products are summed in f32 (cuBLAS, cuDNN; CubeCL's matmul too), and only the
//! result is rounded to f16. Two kernels of Burn 0.21 sum in f16 instead, so a sum stops
//! growing once its terms fall below half an f16 step (`0.25 + 0.25 + ...` stalls at 512):
//!
//! - **CubeCL's direct convolution** (burn-cubecl `conv_direct`), which wgpu runs for every
//!   convolution (WGSL has no accelerated one; the other candidate, `im2col_1x1`, only
//!   takes 1×1 kernels), and for the weight gradient too (`conv_weight_backward`'s fallback
//!   is a convolution over the batch and the map, thousands of terms): relative L2 error
//!   against f32 training, 64 → 64 channels, 3×3, batch 8 of 16×16, forward 3.5e-3, weight
//!   gradient 7.0e-3, transposed convolution's 7.2e-3 (Flex, which sums in f32: 3.6e-4,
//!   4.6e-4, 4.1e-4, the rounding of the f16 inputs and result).
//! - **The `gemm` crate's f16 kernels** (Flex's f16 matmul): with one row (`m = 1`, a batch
//!   of one) or one column (`n = 1`, the weight gradient of a one-output head) the sum is
//!   rounded to f16 after every term, and after every block of the inner dimension otherwise:
//!   `[1, 4096] @ [4096, 64]` 7.2e-2, a `[4096, 64] @ [64, 1]` head's weight gradient 7.4e-3,
//!   `[64, 16384] @ [16384, 64]` 6.4e-4 (2.2e-4 summed in f32). bf16 is right there (Flex
//!   computes it in f32).
//!
//! `Amp` runs these on the half values widened to f32 and rounds the result to the half
//! dtype: the numbers of a kernel that sums in f32, the output's dtype unchanged. Above a
//! listed autodiff backend the op is one node of its own whose backward also runs in f32 and
//! keeps the half inputs it was given, not f32 copies; below autodiff the backward kernels
//! are widened too. The price is the op's f32 traffic (on wgpu, a convolution reads twice the
//! bytes).
//!
//! [`set_enabled`]`(false)` keeps the half sums for this thread, for speed over precision
//! (PyTorch's `allow_fp16_reduced_precision_reduction`, there for cuBLAS).

use std::cell::Cell;

use burn_backend::ops::{ConvOptions, ConvTransposeOptions};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, TensorMetadata};

mod node;

pub(crate) use node::{Summed, summed};

thread_local! {
    static ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Turns the f32 sums on or off for this thread (on by default); returns the previous
/// setting. Off, these ops run in half precision as Burn runs them.
pub fn set_enabled(enabled: bool) -> bool {
    ENABLED.with(|e| e.replace(enabled))
}

/// Whether the f32 sums are on for this thread.
pub fn is_enabled() -> bool {
    ENABLED.with(|e| e.get())
}

/// Whether `B` sums a convolution of `dtype` inputs in that dtype: f16 on wgpu (no bf16
/// there) and on Flex.
pub(crate) fn conv_sums_in_half<B: Backend>(dtype: DType) -> bool {
    dtype == DType::F16 && (super::on_wgpu::<B>() || super::on_flex::<B>()) && is_enabled()
}

/// Whether `B` sums a matmul of `dtype` inputs in that dtype, or the products of its backward:
/// f16 on Flex.
pub(crate) fn matmul_sums_in_half<B: Backend>(dtype: DType) -> bool {
    dtype == DType::F16 && super::on_flex::<B>() && is_enabled()
}

/// The backward kernels `Amp` runs below autodiff (`Autodiff<Amp<B>>`), on the half tensors
/// burn-autodiff saved, as the forwards above.
macro_rules! backward_ops {
    ($($sums:ident: $name:ident($($t:ident),+ $(; $options:ident: $ty:ty)?);)*) => {$(
        pub(crate) fn $name<B: Backend>(
            $($t: FloatTensor<B>,)+ $($options: $ty)?
        ) -> FloatTensor<B> {
            let inputs = [$($t),+];
            if $sums::<B>(inputs[0].dtype()) {
                return super::in_f32::<B, _>(inputs, |[$($t),+]| B::$name($($t,)+ $($options)?));
            }
            let [$($t),+] = inputs;
            B::$name($($t,)+ $($options)?)
        }
    )*};
}

backward_ops! {
    matmul_sums_in_half: linear_x_backward(weight, output_grad);
    matmul_sums_in_half: linear_weight_backward(x, output_grad);
    conv_sums_in_half: conv1d_x_backward(x, weight, output_grad; options: ConvOptions<1>);
    conv_sums_in_half: conv1d_weight_backward(x, weight, output_grad; options: ConvOptions<1>);
    conv_sums_in_half: conv2d_x_backward(x, weight, output_grad; options: ConvOptions<2>);
    conv_sums_in_half: conv2d_weight_backward(x, weight, output_grad; options: ConvOptions<2>);
    conv_sums_in_half: conv3d_x_backward(x, weight, output_grad; options: ConvOptions<3>);
    conv_sums_in_half: conv3d_weight_backward(x, weight, output_grad; options: ConvOptions<3>);
    conv_sums_in_half: conv_transpose1d_x_backward(weight, output_grad; options: ConvTransposeOptions<1>);
    conv_sums_in_half: conv_transpose1d_weight_backward(x, weight, output_grad; options: ConvTransposeOptions<1>);
    conv_sums_in_half: conv_transpose2d_x_backward(weight, output_grad; options: ConvTransposeOptions<2>);
    conv_sums_in_half: conv_transpose2d_weight_backward(x, weight, output_grad; options: ConvTransposeOptions<2>);
    conv_sums_in_half: conv_transpose3d_x_backward(weight, output_grad; options: ConvTransposeOptions<3>);
    conv_sums_in_half: conv_transpose3d_weight_backward(x, weight, output_grad; options: ConvTransposeOptions<3>);
}
