//! The CubeCL kernels of the four kernel traits (`ScalerKernels`, `OptimKernels`,
//! `AccumKernels`, `EmaKernels`, summed as `AmpKernels`) against their references, the fallbacks composed
//! from burn ops (`burn_amp::{scaler, optim, accumulate}::kernels::fallback`), run on the same
//! backend and device: wgpu on lavapipe, both as `Wgpu` (fusion custom ops over
//! `CubeBackend`) and as the bare `CubeBackend`. WGSL has no bf16, so the bf16 instantiation
//! is not run here (the kernels pick their dtype at run time; the same code serves it on CUDA).
//!
//! Tolerances, `|kernel - fallback| <= atol + rtol * |fallback|`:
//! - the inf/NaN check, unscale and the scale update are the same f32 operations in the same
//!   order: exact (NaN matched to NaN); the scale update is also checked against a host model;
//! - optimizer steps in f32: `rtol = 1e-6`, with `atol = 1e-6 * max|fallback|` of the
//!   tensor (the fused fallback may contract or reorder a multiply-add);
//! - optimizer steps on f16 parameters: one f16 rounding apart, `rtol = 2^-10`,
//!   `atol = 2^-24` (an f32 difference of one ulp may round to neighbouring f16 values);
//! - skipped steps: parameter, moments and step count bit for bit equal to their inputs;
//! - step counts (f32 `[1]`): exact, kernel, fallback and the host count;
//! - accumulation: exact without a partial sum or with weight 1; otherwise `F32_STEP` (a
//!   compiler may contract the multiply and add into one fused multiply-add). The fallback
//!   itself is checked bit for bit against the tensor-API composition that
//!   `GradientAccumulation` ran before the kernel, on `Flex` (f32, f16, bf16, f64) and here;
//! - a weight average's update: the same, exact at a rate of 0 (a skipped step), the fallback
//!   bit for bit the composition `ModelEma` ran before the kernel.
//!
//! Layout: this file holds the helpers shared by every kernel and `on_both!`, which runs a
//! check on both backends; `scaler.rs`, `optim.rs` (with `optim/`: `adamw.rs`, `sgd.rs`,
//! `scaled.rs`), `accumulate.rs` and `ema.rs` hold the checks and tests of each trait.

#[path = "../common/mod.rs"]
mod common;

use burn::backend::Wgpu;
use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
/// The bare CubeCL backend on wgpu, without fusion.
type Cube = CubeBackend<WgpuRuntime, f32, i32, u32>;

include!("support.rs");

fn devices() -> Option<WgpuDevice> {
    common::wgpu_device()
}

// ---------------------------------------------------------------------------------------
// The tests: every check on Wgpu (fusion) and on the bare CubeBackend, as each module
// instantiates it with `on_both!` (defined before the modules, which use it).
// ---------------------------------------------------------------------------------------

macro_rules! on_both {
    // One test: `check::<$backend>(&device, args)`, skipped where this machine has no wgpu
    // adapter.
    (@test $test:ident, $backend:ty, $check:ident($($arg:expr),*)) => {
        #[test]
        fn $test() {
            if let Some(device) = devices() {
                common::big_stack(move || $check::<$backend>(&device, $($arg),*));
            }
        }
    };
    // `name: check(args);` per check: a module `name` with the tests `fusion` (`Wgpu`) and
    // `cube` (`Cube`), each running `check::<B>(&device, args)`.
    ($($name:ident: $check:ident($($arg:expr),*);)+) => {
        $(
            mod $name {
                use super::*;
                on_both!(@test fusion, Wgpu, $check($($arg),*));
                on_both!(@test cube, Cube, $check($($arg),*));
            }
        )+
    };
}

mod accumulate;
mod ema;
mod optim;
mod scaler;
