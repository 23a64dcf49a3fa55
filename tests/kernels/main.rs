//! The CubeCL kernels of the three kernel traits (`ScalerKernels`, `OptimKernels`,
//! `AccumKernels`, summed as `AmpKernels`) against their references, the fallbacks composed
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
//!   `GradientAccumulation` ran before the kernel, on `Flex` (f32, f16, bf16, f64) and here.
//!
//! Layout: this file holds the helpers shared by every kernel and `on_both!`, which runs a
//! check on both backends; `scaler.rs`, `optim.rs` (with `optim/`: `adamw.rs`, `sgd.rs`,
//! `scaled.rs`) and `accumulate.rs` hold the checks and tests of each trait.

#[path = "../common/mod.rs"]
mod common;

use burn::backend::Wgpu;
use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn_amp::AmpKernels;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorData, TensorMetadata, read_sync};
use burn_std::{DType, FloatDType, Shape};

/// The bare CubeCL backend on wgpu, without fusion.
type Cube = CubeBackend<WgpuRuntime, f32, i32, u32>;

/// Every burn-op reference under one name, as the tests used it before the kernels were split
/// by concept (the names do not collide).
mod fallback {
    pub use burn_amp::accumulate::kernels::fallback::*;
    pub use burn_amp::optim::kernels::fallback::*;
    pub use burn_amp::scaler::kernels::fallback::*;
}

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

use common::Rng;

fn tensor<B: Backend>(
    values: Vec<f32>,
    shape: &[usize],
    dtype: FloatDType,
    device: &B::Device,
) -> FloatTensor<B> {
    let t = B::float_from_data(TensorData::new(values, shape.to_vec()), device);
    if dtype == FloatDType::F32 {
        t
    } else {
        B::float_cast(t, dtype)
    }
}

fn scalar<B: Backend>(v: f32, device: &B::Device) -> FloatTensor<B> {
    tensor::<B>(vec![v], &[1], FloatDType::F32, device)
}

/// The values (as f32) and the raw bytes of a tensor, in its own dtype.
fn read<B: Backend>(t: FloatTensor<B>) -> (Vec<f32>, Vec<u8>, DType) {
    let data = read_sync(B::float_into_data(t)).expect("read back");
    let dtype = data.dtype;
    let bytes = data.as_bytes().to_vec();
    let values = data.convert::<f32>().to_vec::<f32>().expect("f32 data");
    (values, bytes, dtype)
}

fn values<B: Backend>(t: FloatTensor<B>) -> Vec<f32> {
    read::<B>(t).0
}

#[derive(Debug, Clone, Copy)]
struct Tol {
    rtol: f32,
    /// Absolute tolerance, as a fraction of the largest |expected| of the tensor.
    atol_of_max: f32,
    /// Absolute floor.
    atol: f32,
}

const EXACT: Tol = Tol {
    rtol: 0.0,
    atol_of_max: 0.0,
    atol: 0.0,
};
const F32_STEP: Tol = Tol {
    rtol: 1e-6,
    atol_of_max: 1e-6,
    atol: 0.0,
};
/// One f16 rounding: half an ulp is 2^-11 relative; allow a full ulp.
const F16_STEP: Tol = Tol {
    rtol: 1.0 / 1024.0,
    atol_of_max: 0.0,
    atol: 1.0 / 16_777_216.0,
};

fn step_tol(dtype: FloatDType) -> Tol {
    match dtype {
        FloatDType::F32 => F32_STEP,
        _ => F16_STEP,
    }
}

#[track_caller]
fn assert_close(what: &str, actual: &[f32], expected: &[f32], tol: Tol) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    let max = expected
        .iter()
        .filter(|v| v.is_finite())
        .fold(0f32, |m, v| m.max(v.abs()));
    let atol = tol.atol + tol.atol_of_max * max;
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let ok = if e.is_nan() {
            a.is_nan()
        } else if e.is_infinite() {
            a == e
        } else {
            (a - e).abs() <= atol + tol.rtol * e.abs()
        };
        assert!(
            ok,
            "{what}: element {i} of {}: kernel {a:e}, fallback {e:e} (tolerance {tol:?}, max {max:e})",
            expected.len()
        );
    }
}

/// A gradient with NaN, +inf and -inf injected at random positions, per `inject`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Inject {
    Clean,
    Nan,
    PosInf,
    NegInf,
    All,
}

fn grad_values(rng: &mut Rng, n: usize, inject: Inject) -> Vec<f32> {
    // Scaled-gradient magnitudes that stay finite in f16.
    let mut v = rng.vec(n, 1000.0);
    if n == 0 {
        return v;
    }
    let specials: &[f32] = match inject {
        Inject::Clean => &[],
        Inject::Nan => &[f32::NAN],
        Inject::PosInf => &[f32::INFINITY],
        Inject::NegInf => &[f32::NEG_INFINITY],
        Inject::All => &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY],
    };
    for &s in specials {
        for _ in 0..1 + n / 1000 {
            let i = rng.below(n);
            v[i] = s;
        }
    }
    v
}

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
mod optim;
mod scaler;
