//! The CubeCL kernels behind burn-amp's kernel traits, one file per concept.
//!
//! Every kernel is generic over the float type of its tensors through `#[define(..)]` and a
//! run-time [`StorageType`], so one kernel serves f16, bf16 and f32: the dtype is chosen at
//! launch. The math is always f32; only the stored values use the tensors' own dtypes.
//! Scalars of the run-time float type cannot be launch scalars, so hyper-parameters are f32.
//!
//! Each elementwise kernel takes [`LinearView`]s: any layout is read in logical order, and the
//! loads are vectorised (`N`) whenever the innermost dimension allows it. The device scalars
//! (`inv_scale`, `found_inf`, a parameter's step count, the scaler state) are f32 `[1]`/`[4]`
//! tensors read in the kernel, so nothing is ever read back to the host.
//!
//! Outputs are separate arguments; the host side either allocates them or passes them as
//! aliases of their inputs (in place) when the input buffer may be mutated.
//!
//! [`LinearView`]: cubecl::std::tensor::layout::linear::LinearView

pub mod accumulate;
pub mod ema;
pub mod optim;
pub mod quantized;
pub mod rounding;
pub mod scaler;

use cubecl::prelude::*;

/// Whether any lane of `x` is NaN or ±inf.
#[cube]
pub fn any_non_finite<N: Size>(x: Vector<f32, N>) -> bool {
    let bad = Vector::<u32, N>::cast_from(Vector::is_nan(x))
        + Vector::<u32, N>::cast_from(Vector::is_inf(x));
    let mut acc = 0u32;
    #[unroll]
    for i in 0..N::value() {
        acc += bad[i];
    }
    acc != 0u32
}
