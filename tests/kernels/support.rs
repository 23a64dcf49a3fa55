// The helpers every kernel check uses: tensors in a dtype, read-backs, tolerances, injected
// non-finite gradients, the fallbacks under one name. Pasted with `include!` into the kernel
// tests (`main.rs`) and into `examples/gpu_check`, which runs the same checks on CUDA, so
// that a check is written once. Items only: no inner attributes or `//!` docs.

use burn_amp::AmpKernels;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorData, TensorMetadata, read_sync};
use burn_std::{DType, FloatDType, Shape};

/// Every burn-op reference under one name, as the tests used it before the kernels were split
/// by concept (the names do not collide).
mod fallback {
    pub use burn_amp::accumulate::kernels::fallback::*;
    pub use burn_amp::ema::kernels::fallback::*;
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
    if shape.contains(&0) {
        // CubeCL on CUDA copies only pitched row-major layouts, and an empty shape such as
        // [4, 0] has a zero stride: writing or reading it is an error there. Nothing to copy.
        return B::float_empty(Shape::from(shape.to_vec()), device, dtype);
    }
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
    if t.shape().num_elements() == 0 {
        return (Vec::new(), Vec::new(), t.dtype()); // see `tensor`: no copy of an empty layout
    }
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

/// One bf16 rounding: 8 significant bits, a full ulp is up to 2^-7 relative (run on CUDA only:
/// WGSL has no bf16).
const BF16_STEP: Tol = Tol {
    rtol: 1.0 / 128.0,
    atol_of_max: 0.0,
    atol: 1.0 / 16_777_216.0,
};

fn step_tol(dtype: FloatDType) -> Tol {
    match dtype {
        FloatDType::F32 => F32_STEP,
        FloatDType::BF16 => BF16_STEP,
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
