//! What burn-amp's kernels share. The kernels themselves live beside the concept they serve,
//! each as an extension trait whose every method has a plain burn-op default:
//!
//! - [`ScalerKernels`]: the inf/NaN check, unscaling, the scale update;
//! - [`OptimKernels`]: the fused AdamW (f32 or 8-bit moments, optionally rounding
//!   stochastically into half-precision parameters) and SGD steps;
//! - [`AccumKernels`]: `acc += grad × weight` in f32;
//! - [`EmaKernels`]: a weight average's update by a device-scalar rate.
//!
//! [`AmpKernels`] is their sum. CubeCL backends (`CubeBackend`, and the `Fusion<CubeBackend>`
//! that burn-wgpu and burn-cuda use by default) override the defaults with the kernels of
//! `cubecl_kernels/`; `Flex` runs the defaults; `Amp<B>` forwards to `B`.
//!
//! Device scalars are f32 `[1]` tensors read inside the kernels (`inv_scale`, `found_inf`, a
//! parameter's step count), so nothing here ever reads back to the host.

pub(crate) mod cube;
#[path = "../../cubecl_kernels/mod.rs"]
pub(crate) mod cubecl_kernels;
pub(crate) mod fusion;

use crate::accumulate::AccumKernels;
use crate::ema::EmaKernels;
use crate::optim::OptimKernels;
use crate::scaler::ScalerKernels;

/// Every kernel burn-amp uses: implemented for any backend that implements the four
/// concept traits (which, with their defaults, any backend can).
pub trait AmpKernels: ScalerKernels + OptimKernels + AccumKernels + EmaKernels {}

impl<B: ScalerKernels + OptimKernels + AccumKernels + EmaKernels> AmpKernels for B {}

/// Implements a kernel trait for `Flex` (its burn-op defaults) and for `Amp<B>` (forwarding
/// each listed method to `B`: `Amp`'s primitives are `B`'s own).
macro_rules! kernels_for_flex_and_amp {
    ($trait:ident { $(fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty;)* }) => {
        impl $trait for burn::backend::Flex {}

        impl<B: $trait> $trait for $crate::Amp<B> {
            $(
                #[inline]
                fn $name($($arg: $ty),*) -> $ret {
                    B::$name($($arg),*)
                }
            )*
        }
    };
}

pub(crate) use kernels_for_flex_and_amp;
