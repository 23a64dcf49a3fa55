// The helpers of the numerics checks, `include!`d by `main.rs` and by the GPU check
// (`examples/gpu_check/numerics.rs`), which runs these checks on CUDA.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_amp::Precision;
use burn_std::DType;

fn low(precision: Precision) -> DType {
    precision.low_dtype().expect("a low precision").into()
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().to_vec::<f32>().unwrap()
}

/// `|g - r| <= atol + rtol * |r|` for every element, else the first offender.
fn first_mismatch(got: &[f32], want: &[f32], atol: f32, rtol: f32) -> Option<(usize, f32, f32)> {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .enumerate()
        .find(|(_, (g, r))| !within((**g - **r).abs(), atol + rtol * r.abs()))
        .map(|(i, (g, r))| (i, *g, *r))
}

/// `err <= tol`, false for NaN.
fn within(err: f32, tol: f32) -> bool {
    err <= tol
}

/// ‖got − want‖₂ / ‖want‖₂ (NaN and inf count as an error of 1e30).
fn rel_l2(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        let d = (*g as f64 - *w as f64).powi(2);
        num += if d.is_finite() { d } else { 1e60 };
        den += (*w as f64).powi(2);
    }
    (num.sqrt() / den.sqrt().max(1e-30)) as f32
}

/// Gradients of two runs that differ in where a value lives (a copy shared, a cast
/// recomputed), never in an operation: f32, and bitwise equal.
fn assert_bitwise(
    got: &[burn::tensor::TensorData],
    want: &[burn::tensor::TensorData],
    what: &str,
    against: &str,
) {
    assert!(!got.is_empty());
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(a.dtype, DType::F32, "{what}: gradient {i} is f32");
        assert_eq!(a, b, "{what}: gradient {i} differs from {against}");
    }
}

/// Each gradient within half precision of the f32 run's, but those in `skip`: relative L2
/// error at most 5e-3 (f16) or 3e-2 (bf16, an 8-bit mantissa).
fn assert_near_f32(
    got: &[burn::tensor::TensorData],
    f32: &[burn::tensor::TensorData],
    precision: Precision,
    what: &str,
    skip: &[usize],
) {
    let tolerance = if precision == Precision::Bf16 {
        3e-2
    } else {
        5e-3
    };
    for (i, (got, want)) in got.iter().zip(f32).enumerate() {
        if skip.contains(&i) {
            continue;
        }
        let (got, want) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        let err = rel_l2(&got, &want);
        assert!(
            err <= tolerance,
            "{what}: gradient {i} {err:.2e} from f32's (tolerance {tolerance:.0e})"
        );
    }
}

/// A fixed pseudo-random stream in [0, 1).
fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32) / (1u64 << 24) as f32
    }
}

/// Rounds to the bf16 grid (which f16 also holds in this range): the low-precision runs
/// then see exactly the values of the f32 reference, and input rounding is not counted.
fn on_grid(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

fn panic_message(err: Box<dyn std::any::Any + Send>) -> String {
    err.downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}
