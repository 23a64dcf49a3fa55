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

mod common;

use burn::backend::Wgpu;
use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn_amp::AmpKernels;
use burn_amp::accumulate::AccumKernels;
use burn_amp::optim::kernels::{AdamWMoments, Scaling, Velocity};
use burn_amp::optim::{FusedAdamWConfig, FusedSgdConfig};
use burn_amp::scaler::ScaleRule;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorData, TensorMetadata, read_sync};
use burn_std::{DType, FloatDType, Shape, Slice};

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

/// xorshift64*: reproducible data without a dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

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
// unscale_and_check
// ---------------------------------------------------------------------------------------

/// Shapes with sizes off the vector width (1, 3, 1023, 4097), aligned ones, 2-d ones and
/// empty ones.
const SHAPES: &[&[usize]] = &[
    &[1],
    &[3],
    &[1023],
    &[4096],
    &[4097],
    &[7, 5],
    &[64, 33],
    &[0],
    &[4, 0],
];

fn check_unscale<B: AmpKernels>(device: &B::Device, dtype: FloatDType, seed: u64) {
    let mut rng = Rng::new(seed);
    let injects = [
        Inject::Clean,
        Inject::Nan,
        Inject::PosInf,
        Inject::NegInf,
        Inject::All,
    ];
    for shape in SHAPES {
        let n: usize = shape.iter().product();
        for inject in injects {
            for (inv, found0) in [(1.0 / 1024.0, 0.0), (1.0 / 3000.0, 0.0), (0.5, 1.0)] {
                let what =
                    format!("unscale {shape:?} {dtype:?} {inject:?} inv {inv} found {found0}");
                let g = grad_values(&mut rng, n, inject);
                let grad = tensor::<B>(g.clone(), shape, dtype, device);
                let (outs, found) = B::unscale_and_check(
                    vec![grad],
                    scalar::<B>(inv, device),
                    scalar::<B>(found0, device),
                );
                let grad_ref = tensor::<B>(g.clone(), shape, dtype, device);
                let (refs, found_ref) = fallback::unscale_and_check::<B>(
                    vec![grad_ref],
                    scalar::<B>(inv, device),
                    scalar::<B>(found0, device),
                );
                assert_eq!(outs.len(), 1);
                let out = outs.into_iter().next().unwrap();
                assert_eq!(out.shape(), Shape::from(shape.to_vec()), "{what}: shape");
                assert_eq!(out.dtype(), DType::from(dtype), "{what}: dtype");
                let out = values::<B>(out);
                let expected = values::<B>(refs.into_iter().next().unwrap());
                assert_close(&what, &out, &expected, EXACT);
                let found = values::<B>(found);
                let found_ref = values::<B>(found_ref);
                assert_eq!(found, found_ref, "{what}: found_inf vs fallback");
                let bad = n > 0 && inject != Inject::Clean;
                let want = if bad || found0 == 1.0 { 1.0 } else { 0.0 };
                assert_eq!(found, vec![want], "{what}: found_inf");
            }
        }
    }
}

/// Several gradients of mixed sizes (one empty, one poisoned) in one call.
fn check_unscale_list<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(7);
    let shapes: [&[usize]; 6] = [&[1023], &[0], &[3], &[32, 32], &[4097], &[1]];
    for poisoned in [None, Some(2usize), Some(4)] {
        let data: Vec<Vec<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let inject = if Some(i) == poisoned {
                    Inject::All
                } else {
                    Inject::Clean
                };
                grad_values(&mut rng, s.iter().product(), inject)
            })
            .collect();
        let make = |data: &Vec<Vec<f32>>| -> Vec<FloatTensor<B>> {
            data.iter()
                .zip(shapes)
                .map(|(d, s)| tensor::<B>(d.clone(), s, dtype, device))
                .collect()
        };
        let inv = 1.0 / 65536.0;
        let (outs, found) = B::unscale_and_check(
            make(&data),
            scalar::<B>(inv, device),
            scalar::<B>(0.0, device),
        );
        let (refs, found_ref) = fallback::unscale_and_check::<B>(
            make(&data),
            scalar::<B>(inv, device),
            scalar::<B>(0.0, device),
        );
        assert_eq!(outs.len(), shapes.len());
        for (i, (o, r)) in outs.into_iter().zip(refs).enumerate() {
            let what = format!("unscale list {dtype:?} poisoned {poisoned:?}, grad {i}");
            assert_eq!(o.shape(), Shape::from(shapes[i].to_vec()), "{what}");
            assert_close(&what, &values::<B>(o), &values::<B>(r), EXACT);
        }
        let want = if poisoned.is_some() { 1.0 } else { 0.0 };
        assert_eq!(values::<B>(found), vec![want]);
        assert_eq!(values::<B>(found_ref), vec![want]);
    }
}

/// A clone the caller still holds never changes: the kernels only write in place into
/// buffers nobody else holds.
fn check_unscale_no_alias<B: AmpKernels>(device: &B::Device) {
    let g = vec![1.0, 2.0, f32::INFINITY, 4.0];
    let grad = tensor::<B>(g.clone(), &[4], FloatDType::F32, device);
    let found = scalar::<B>(0.0, device);
    let (outs, new_found) =
        B::unscale_and_check(vec![grad.clone()], scalar::<B>(0.5, device), found.clone());
    assert_eq!(
        values::<B>(outs[0].clone()),
        vec![0.5, 1.0, f32::INFINITY, 2.0]
    );
    assert_eq!(values::<B>(new_found), vec![1.0]);
    // The held clones are untouched.
    assert_eq!(values::<B>(grad), g);
    assert_eq!(values::<B>(found), vec![0.0]);
}

/// Gradients seen through `swap_dims` (strided, not contiguous): read in logical order,
/// unvectorised, and the output keeps the logical shape.
fn check_non_contiguous<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(21);
    let (rows, cols) = (64, 33);
    for inject in [Inject::Clean, Inject::Nan] {
        let g = grad_values(&mut rng, rows * cols, inject);
        let make =
            || B::float_swap_dims(tensor::<B>(g.clone(), &[rows, cols], dtype, device), 0, 1);
        let what = format!("strided unscale {dtype:?} {inject:?}");
        let (outs, found) = B::unscale_and_check(
            vec![make()],
            scalar::<B>(0.25, device),
            scalar::<B>(0.0, device),
        );
        let (refs, found_ref) = fallback::unscale_and_check::<B>(
            vec![make()],
            scalar::<B>(0.25, device),
            scalar::<B>(0.0, device),
        );
        assert_eq!(outs[0].shape(), Shape::new([cols, rows]), "{what}");
        assert_close(
            &what,
            &values::<B>(outs[0].clone()),
            &values::<B>(refs[0].clone()),
            EXACT,
        );
        assert_eq!(
            values::<B>(found),
            values::<B>(found_ref),
            "{what}: found_inf"
        );
    }
    // AdamW with a contiguous parameter and a strided gradient, on the first step (count 0
    // before it; the old signature passed the count including the step, 1).
    let lr = 1e-2;
    let c = adamw_config(0.9, 0.999, 1e-8, 0.01);
    let p0 = rng.vec(rows * cols, 1.0);
    let g = grad_values(&mut rng, rows * cols, Inject::Clean);
    let run = |kernel: bool| {
        let p = tensor::<B>(p0.clone(), &[cols, rows], dtype, device);
        let grad = B::float_swap_dims(tensor::<B>(g.clone(), &[rows, cols], dtype, device), 0, 1);
        let state = zero_moments::<B>(&[cols, rows], 0.0, device);
        let scaling = scaling::<B>(1.0 / 1024.0, 0.0, device);
        let (p, s) = adamw::<B>(kernel, p, grad, state, scaling, lr, &c);
        (
            values::<B>(p),
            values::<B>(s.exp_avg),
            values::<B>(s.exp_avg_sq),
            count::<B>(s.step),
        )
    };
    let (k, r) = (run(true), run(false));
    let what = format!("strided adamw {dtype:?}");
    assert_close(&format!("{what} param"), &k.0, &r.0, step_tol(dtype));
    assert_close(&format!("{what} exp_avg"), &k.1, &r.1, F32_STEP);
    assert_close(&format!("{what} exp_avg_sq"), &k.2, &r.2, F32_STEP);
    assert_eq!((k.3, r.3), (1.0, 1.0), "{what}: step count");
}

// ---------------------------------------------------------------------------------------
// check_finite (read-only)
// ---------------------------------------------------------------------------------------

const INJECTS: [Inject; 5] = [
    Inject::Clean,
    Inject::Nan,
    Inject::PosInf,
    Inject::NegInf,
    Inject::All,
];

/// `check_finite` over `grads`, kernel against fallback and against the flag
/// `unscale_and_check` raises on the same gradients. The gradients (held by the caller) are
/// never written; with `hold_found` the caller also keeps a clone of the incoming flag, which
/// must not change either (without it the kernel may raise the flag in place). Returns the
/// flag.
#[track_caller]
fn check_finite_both<B: AmpKernels>(
    grads: &[FloatTensor<B>],
    found0: f32,
    hold_found: bool,
    device: &B::Device,
    what: &str,
) -> f32 {
    let held: Vec<Vec<u8>> = grads.iter().map(|g| read::<B>(g.clone()).1).collect();
    let found_in = scalar::<B>(found0, device);
    let found = if hold_found {
        B::check_finite(grads.to_vec(), found_in.clone())
    } else {
        B::check_finite(grads.to_vec(), scalar::<B>(found0, device))
    };
    let found_ref = fallback::check_finite::<B>(grads.to_vec(), scalar::<B>(found0, device));
    let (_, found_unscale) = B::unscale_and_check(
        grads.to_vec(),
        scalar::<B>(1.0, device),
        scalar::<B>(found0, device),
    );
    assert_eq!(found.shape(), Shape::new([1]), "{what}: found_inf shape");
    assert_eq!(found.dtype(), DType::F32, "{what}: found_inf dtype");
    let found = values::<B>(found);
    assert_eq!(
        found,
        values::<B>(found_ref),
        "{what}: check_finite vs fallback"
    );
    assert_eq!(
        found,
        values::<B>(found_unscale),
        "{what}: check_finite vs unscale_and_check"
    );
    assert_eq!(
        values::<B>(found_in),
        vec![found0],
        "{what}: the held found_inf changed"
    );
    for (i, (g, h)) in grads.iter().zip(&held).enumerate() {
        assert!(
            read::<B>(g.clone()).1 == *h,
            "{what}: gradient {i} was written"
        );
    }
    found[0]
}

/// One gradient per call: every shape of [`SHAPES`] (sizes 1, 3, 1023, 4096, 4097, 2-d and
/// empty), NaN/+inf/-inf at random positions, an incoming flag of 0 and 1, held or not. Then
/// one non-finite value at the first and at the last element (the tail past the vector width).
fn check_check_finite<B: AmpKernels>(device: &B::Device, dtype: FloatDType, seed: u64) {
    let mut rng = Rng::new(seed);
    for shape in SHAPES {
        let n: usize = shape.iter().product();
        for inject in INJECTS {
            for found0 in [0.0f32, 1.0] {
                for hold_found in [false, true] {
                    let what = format!(
                        "check_finite {shape:?} {dtype:?} {inject:?} found {found0} held {hold_found}"
                    );
                    let g = grad_values(&mut rng, n, inject);
                    let grad = tensor::<B>(g, shape, dtype, device);
                    let found = check_finite_both::<B>(&[grad], found0, hold_found, device, &what);
                    let bad = n > 0 && inject != Inject::Clean;
                    let want = if bad || found0 == 1.0 { 1.0 } else { 0.0 };
                    assert_eq!(found, want, "{what}: found_inf");
                }
            }
        }
    }
    for n in [1usize, 3, 1023, 4097] {
        for pos in [0, n - 1] {
            for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let what = format!("check_finite {n} {dtype:?} {special} at {pos}");
                let mut g = rng.vec(n, 1000.0);
                g[pos] = special;
                let grad = tensor::<B>(g, &[n], dtype, device);
                assert_eq!(
                    check_finite_both::<B>(&[grad], 0.0, false, device, &what),
                    1.0,
                    "{what}"
                );
            }
        }
    }
}

/// Lists of gradients of mixed sizes (one empty), one of them poisoned with each kind of
/// non-finite value; lists of empty gradients only, and no gradient at all.
fn check_check_finite_list<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(17);
    let shapes: [&[usize]; 6] = [&[1023], &[0], &[3], &[32, 32], &[4097], &[1]];
    let cases = [
        (None, Inject::Clean),
        (Some(0usize), Inject::Nan),
        (Some(2), Inject::PosInf),
        (Some(4), Inject::NegInf),
        (Some(5), Inject::All),
        (Some(1), Inject::All), // the empty one: nothing to find
    ];
    for (poisoned, inject) in cases {
        let grads: Vec<FloatTensor<B>> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let inject = if Some(i) == poisoned {
                    inject
                } else {
                    Inject::Clean
                };
                let g = grad_values(&mut rng, s.iter().product(), inject);
                tensor::<B>(g, s, dtype, device)
            })
            .collect();
        for found0 in [0.0f32, 1.0] {
            let what = format!("check_finite list {dtype:?} poisoned {poisoned:?} {inject:?}");
            let bad = poisoned.is_some_and(|i| i != 1);
            let want = if bad || found0 == 1.0 { 1.0 } else { 0.0 };
            let found = check_finite_both::<B>(&grads, found0, found0 == 0.0, device, &what);
            assert_eq!(found, want, "{what}: found_inf");
        }
    }
    for found0 in [0.0f32, 1.0] {
        let empties = vec![
            tensor::<B>(vec![], &[0], dtype, device),
            tensor::<B>(vec![], &[4, 0], dtype, device),
        ];
        let what = format!("check_finite empties {dtype:?} found {found0}");
        assert_eq!(
            check_finite_both::<B>(&empties, found0, false, device, &what),
            found0
        );
        let what = format!("check_finite no gradient {dtype:?} found {found0}");
        assert_eq!(
            check_finite_both::<B>(&[], found0, true, device, &what),
            found0
        );
    }
}

/// Gradients seen through `swap_dims` and through a column slice (strided, not contiguous):
/// the check reads the logical elements only, so a non-finite value in a column the slice
/// leaves out is not seen.
fn check_check_finite_strided<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(23);
    let (rows, cols) = (64, 33);
    for inject in INJECTS {
        let what = format!("strided check_finite {dtype:?} {inject:?}");
        let g = grad_values(&mut rng, rows * cols, inject);
        let t = B::float_swap_dims(tensor::<B>(g, &[rows, cols], dtype, device), 0, 1);
        let want = if inject == Inject::Clean { 0.0 } else { 1.0 };
        assert_eq!(
            check_finite_both::<B>(&[t], 0.0, false, device, &what),
            want,
            "{what}"
        );
    }
    let sliced = |g: &Vec<f32>, transpose: bool| {
        let t = B::float_slice(
            tensor::<B>(g.clone(), &[rows, cols], dtype, device),
            &[Slice::from(0..rows), Slice::from(1..cols - 1)],
        );
        if transpose {
            B::float_swap_dims(t, 0, 1)
        } else {
            t
        }
    };
    let mut outside = rng.vec(rows * cols, 1000.0);
    outside[5 * cols] = f32::NAN; // column 0
    outside[10 * cols + cols - 1] = f32::INFINITY; // the last column
    outside[(rows - 1) * cols] = f32::NEG_INFINITY; // column 0, the last row
    let mut inside = outside.clone();
    inside[7 * cols + 16] = f32::NAN;
    for transpose in [false, true] {
        let what = format!("sliced check_finite {dtype:?} transposed {transpose}");
        let t = sliced(&outside, transpose);
        assert_eq!(
            check_finite_both::<B>(&[t], 0.0, false, device, &format!("{what}, outside")),
            0.0,
            "{what}: a value outside the slice was seen"
        );
        let t = sliced(&inside, transpose);
        assert_eq!(
            check_finite_both::<B>(&[t], 0.0, false, device, &format!("{what}, inside")),
            1.0,
            "{what}: a value inside the slice was missed"
        );
    }
}

/// Clones the caller holds (the gradients, the incoming flag) never change, in f32 and f16.
fn check_finite_no_alias<B: AmpKernels>(device: &B::Device) {
    for dtype in [FloatDType::F32, FloatDType::F16] {
        let g = vec![1.0, 2.0, f32::INFINITY, 4.0];
        let grad = tensor::<B>(g.clone(), &[4], dtype, device);
        let clean = tensor::<B>(vec![1.0, -2.0], &[2], dtype, device);
        let found = scalar::<B>(0.0, device);
        let new_found = B::check_finite(vec![clean.clone(), grad.clone()], found.clone());
        assert_eq!(values::<B>(new_found), vec![1.0], "{dtype:?}");
        // The held clones are untouched.
        assert_eq!(values::<B>(grad), g, "{dtype:?}");
        assert_eq!(values::<B>(clean), vec![1.0, -2.0], "{dtype:?}");
        assert_eq!(values::<B>(found), vec![0.0], "{dtype:?}");
        // And through the helper: bytes of every held input, kernel against fallback.
        let grad = tensor::<B>(g.clone(), &[4], dtype, device);
        let what = format!("check_finite held clones {dtype:?}");
        assert_eq!(
            check_finite_both::<B>(&[grad], 0.0, true, device, &what),
            1.0
        );
    }
}

// ---------------------------------------------------------------------------------------
// update_scale
// ---------------------------------------------------------------------------------------

/// The scale update on the host, in f32 as the kernel computes it. Since the refactor a
/// growth past `max_scale` (or to inf) is refused, the scale stays (it used to be clamped to
/// `max_scale`), and `floor_overflows` resets on every clean step and on an overflow above
/// the floor (it used to keep its count through those overflows).
fn host_update_scale(state: [f32; 4], overflow: bool, rule: ScaleRule) -> [f32; 4] {
    let [scale, tracker, hyst, floor] = state;
    if overflow {
        let backoff = hyst <= 1.0;
        let backed_off = (scale * rule.backoff_factor).max(rule.min_scale);
        let at_floor = scale <= rule.min_scale;
        [
            if backoff { backed_off } else { scale },
            0.0,
            if backoff { hyst } else { hyst - 1.0 },
            if at_floor { floor + 1.0 } else { 0.0 },
        ]
    } else {
        let counted = tracker + 1.0;
        if counted >= rule.growth_interval as f32 {
            let grown = scale * rule.growth_factor;
            // `<=` is false for inf: a growth to inf is refused too.
            let scale = if grown <= rule.max_scale {
                grown
            } else {
                scale
            };
            [scale, 0.0, rule.hysteresis as f32, 0.0]
        } else {
            [scale, counted, hyst, 0.0]
        }
    }
}

/// One update by the kernel, the fallback and the host model, all equal.
#[track_caller]
fn update_scale_all<B: AmpKernels>(
    state: [f32; 4],
    overflow: bool,
    rule: ScaleRule,
    device: &B::Device,
    what: &str,
) -> [f32; 4] {
    let f = if overflow { 1.0 } else { 0.0 };
    let t = || tensor::<B>(state.to_vec(), &[4], FloatDType::F32, device);
    let got = values::<B>(B::update_scale(t(), scalar::<B>(f, device), rule));
    let want = values::<B>(fallback::update_scale::<B>(
        t(),
        scalar::<B>(f, device),
        rule,
    ));
    let host = host_update_scale(state, overflow, rule);
    assert_eq!(got, want, "{what}, {rule:?}: kernel vs fallback");
    assert_eq!(got, host.to_vec(), "{what}, {rule:?}: kernel vs host model");
    host
}

fn check_update_scale<B: AmpKernels>(device: &B::Device) {
    // Overflow (1) / clean (0) script: growth, hysteresis, the min_scale floor and its
    // counter, the max_scale ceiling and growths it refuses (the clean run at the end).
    let script = [
        0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    let configs = [
        (8.0f32, 1.0f32, 64.0f32),
        (65536.0, 0.5, 1e6),
        // A ceiling that is no power-of-two multiple of the start: the old rule clamped the
        // scale to 50; now the growth from 32 is refused.
        (8.0, 1.0, 50.0),
        // The default ceiling, f32::MAX: the growth from 2^127 would be inf, refused.
        (2f32.powi(126), 1.0, f32::MAX),
    ];
    for hysteresis in [1u32, 3] {
        for (start, min_scale, max_scale) in configs {
            let rule = ScaleRule {
                growth_factor: 2.0,
                backoff_factor: 0.5,
                growth_interval: 2,
                hysteresis,
                min_scale,
                max_scale,
            };
            let init = vec![start, 0.0, hysteresis as f32, 0.0];
            let mut state = tensor::<B>(init.clone(), &[4], FloatDType::F32, device);
            let mut state_ref = tensor::<B>(init.clone(), &[4], FloatDType::F32, device);
            let mut host: [f32; 4] = init.try_into().unwrap();
            let (mut saw_floor, mut saw_ceiling) = (false, false);
            let (mut saw_refused, mut saw_floor_reset, mut top) = (false, false, 0f32);
            for (i, &overflow) in script.iter().enumerate() {
                let f = overflow as f32;
                state = B::update_scale(state, scalar::<B>(f, device), rule);
                state_ref = fallback::update_scale::<B>(state_ref, scalar::<B>(f, device), rule);
                let next = host_update_scale(host, overflow == 1, rule);
                let got = values::<B>(state.clone());
                let want = values::<B>(state_ref.clone());
                assert_eq!(
                    got, want,
                    "update_scale step {i} (overflow {overflow}), {rule:?}: kernel vs fallback"
                );
                assert_eq!(
                    got,
                    next.to_vec(),
                    "update_scale step {i} (overflow {overflow}), {rule:?}: kernel vs host model"
                );
                // A growth step (tracker back to 0 on a clean step) that kept the scale.
                saw_refused |= overflow == 0
                    && host[1] + 1.0 >= rule.growth_interval as f32
                    && next[0] == host[0];
                saw_floor_reset |= host[3] > 0.0 && next[3] == 0.0;
                host = next;
                saw_floor |= got[3] > 0.0;
                saw_ceiling |= got[0] == max_scale;
                top = top.max(got[0]);
                assert!(got[0] <= max_scale, "step {i}, {rule:?}: past the ceiling");
                assert!(got[0].is_finite(), "step {i}, {rule:?}: an infinite scale");
            }
            if (start, max_scale) == (8.0, 64.0) {
                assert!(saw_floor && saw_ceiling, "the script reaches both clamps");
                assert!(
                    saw_refused,
                    "{rule:?}: a growth past the ceiling was refused"
                );
                assert!(saw_floor_reset, "{rule:?}: the floor counter was reset");
            }
            if max_scale == 50.0 {
                assert_eq!(top, 32.0, "{rule:?}: refused, not clamped to 50");
                assert!(saw_refused && saw_floor && saw_floor_reset, "{rule:?}");
            }
            if max_scale == f32::MAX {
                assert_eq!(
                    top,
                    2f32.powi(127),
                    "{rule:?}: the growth to inf is refused"
                );
                assert!(saw_refused, "{rule:?}");
            }
        }
    }
}

/// Single updates from chosen states: the floor counter (c) and the ceiling, kernel vs
/// fallback vs host model vs the value written out by hand.
fn check_update_scale_edges<B: AmpKernels>(device: &B::Device) {
    let rule = |max_scale: f32| ScaleRule {
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 1,
        hysteresis: 2,
        min_scale: 1.0,
        max_scale,
    };
    // (state, overflow, max_scale, expected, what)
    let cases: [([f32; 4], bool, f32, [f32; 4], &str); 10] = [
        // Before the refactor the counter kept 3 here.
        (
            [8.0, 0.0, 1.0, 3.0],
            true,
            1024.0,
            [4.0, 0.0, 1.0, 0.0],
            "overflow above the floor resets the counter",
        ),
        (
            [1.0, 0.0, 1.0, 3.0],
            true,
            1024.0,
            [1.0, 0.0, 1.0, 4.0],
            "overflow at the floor counts",
        ),
        (
            [1.0, 0.0, 2.0, 3.0],
            true,
            1024.0,
            [1.0, 0.0, 1.0, 4.0],
            "overflow at the floor, hysteresis left, counts",
        ),
        (
            [2.0, 0.0, 1.0, 0.0],
            true,
            1024.0,
            [1.0, 0.0, 1.0, 0.0],
            "backing off onto the floor: not at it yet",
        ),
        (
            [4.0, 0.0, 2.0, 5.0],
            true,
            1024.0,
            [4.0, 0.0, 1.0, 0.0],
            "hysteresis above the floor resets the counter",
        ),
        (
            [1.0, 0.0, 1.0, 3.0],
            false,
            1024.0,
            [2.0, 0.0, 2.0, 0.0],
            "a clean step resets the counter",
        ),
        (
            [512.0, 0.0, 1.0, 0.0],
            false,
            1024.0,
            [1024.0, 0.0, 2.0, 0.0],
            "growth onto the ceiling",
        ),
        // Before the refactor: clamped to 1024.
        (
            [768.0, 0.0, 1.0, 0.0],
            false,
            1024.0,
            [768.0, 0.0, 2.0, 0.0],
            "growth past the ceiling refused",
        ),
        (
            [1024.0, 0.0, 1.0, 0.0],
            false,
            1024.0,
            [1024.0, 0.0, 2.0, 0.0],
            "growth at the ceiling refused",
        ),
        (
            [2f32.powi(127), 0.0, 1.0, 0.0],
            false,
            f32::MAX,
            [2f32.powi(127), 0.0, 2.0, 0.0],
            "growth to inf refused",
        ),
    ];
    for (state, overflow, max_scale, expected, what) in cases {
        let got = update_scale_all::<B>(state, overflow, rule(max_scale), device, what);
        assert_eq!(got, expected, "{what}: {state:?} overflow {overflow}");
    }
}

// ---------------------------------------------------------------------------------------
// adamw_step
// ---------------------------------------------------------------------------------------

const STEP_SHAPES: &[&[usize]] = &[&[1], &[3], &[1023], &[4097], &[16, 24]];

fn adamw_config(beta_1: f32, beta_2: f32, epsilon: f32, weight_decay: f32) -> FusedAdamWConfig {
    FusedAdamWConfig::new()
        .with_beta_1(beta_1)
        .with_beta_2(beta_2)
        .with_epsilon(epsilon)
        .with_weight_decay(weight_decay)
}

fn sgd_config(momentum: f32, dampening: f32, weight_decay: f32, nesterov: bool) -> FusedSgdConfig {
    FusedSgdConfig::new()
        .with_momentum(momentum)
        .with_dampening(dampening)
        .with_weight_decay(weight_decay)
        .with_nesterov(nesterov)
}

fn scaling<B: Backend>(
    inv_scale: f32,
    found_inf: f32,
    device: &B::Device,
) -> Scaling<FloatTensor<B>> {
    Scaling {
        inv_scale: scalar::<B>(inv_scale, device),
        found_inf: scalar::<B>(found_inf, device),
    }
}

/// Zero moments of `shape` and a step count of `count` (steps applied before the next one).
fn zero_moments<B: Backend>(
    shape: &[usize],
    count: f32,
    device: &B::Device,
) -> AdamWMoments<FloatTensor<B>> {
    let n: usize = shape.iter().product();
    let zeros = || tensor::<B>(vec![0.0; n], shape, FloatDType::F32, device);
    AdamWMoments {
        exp_avg: zeros(),
        exp_avg_sq: zeros(),
        step: scalar::<B>(count, device),
    }
}

/// One AdamW step, by the kernel or by the fallback.
fn adamw<B: AmpKernels>(
    kernel: bool,
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    state: AdamWMoments<FloatTensor<B>>,
    scaling: Scaling<FloatTensor<B>>,
    lr: f32,
    c: &FusedAdamWConfig,
) -> (FloatTensor<B>, AdamWMoments<FloatTensor<B>>) {
    if kernel {
        B::adamw_step(param, grad, state, scaling, lr, c)
    } else {
        fallback::adamw_step::<B>(param, grad, state, scaling, lr, c)
    }
}

/// One SGD step, by the kernel or by the fallback.
fn sgd<B: AmpKernels>(
    kernel: bool,
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    velocity: Option<Velocity<FloatTensor<B>>>,
    scaling: Scaling<FloatTensor<B>>,
    lr: f32,
    c: &FusedSgdConfig,
) -> (FloatTensor<B>, Option<Velocity<FloatTensor<B>>>) {
    if kernel {
        B::sgd_step(param, grad, velocity, scaling, lr, c)
    } else {
        fallback::sgd_step::<B>(param, grad, velocity, scaling, lr, c)
    }
}

/// A step count: an f32 `[1]` tensor.
#[track_caller]
fn count<B: Backend>(t: FloatTensor<B>) -> f32 {
    assert_eq!(t.dtype(), DType::F32, "a step count is f32");
    let v = values::<B>(t);
    assert_eq!(v.len(), 1, "a step count is [1]");
    v[0]
}

struct AdamState<B: Backend> {
    p: FloatTensor<B>,
    s: AdamWMoments<FloatTensor<B>>,
}

/// The raw bytes of a parameter and its AdamW state, to compare across a skipped step.
fn adam_bytes<B: Backend>(a: &AdamState<B>) -> [Vec<u8>; 4] {
    [
        read::<B>(a.p.clone()).1,
        read::<B>(a.s.exp_avg.clone()).1,
        read::<B>(a.s.exp_avg_sq.clone()).1,
        read::<B>(a.s.step.clone()).1,
    ]
}

/// A run of AdamW steps (one skipped), kernel against fallback: parameter, moments and the
/// step count each returns.
fn run_adamw_plan<B: AmpKernels>(
    device: &B::Device,
    rng: &mut Rng,
    shape: &[usize],
    dtype: FloatDType,
    grad_dtype: FloatDType,
    inv_scale: f32,
    grad_magnitude: f32,
    plan: &[bool],
) {
    let lr = 1e-2;
    let c = adamw_config(0.9, 0.999, 1e-8, 0.01);
    let tol = step_tol(dtype);
    let n: usize = shape.iter().product();
    let p0 = rng.vec(n, 1.0);
    let new = |p: &Vec<f32>| AdamState::<B> {
        p: tensor::<B>(p.clone(), shape, dtype, device),
        s: zero_moments::<B>(shape, 0.0, device),
    };
    let (mut k, mut r) = (new(&p0), new(&p0));
    // (a) The count handed in is the steps applied BEFORE this one (the old signature took
    // the count including this step) and each step returns the new count, +1 unless skipped.
    let mut applied = 0.0f32;
    for (i, &skip) in plan.iter().enumerate() {
        let what = format!(
            "adamw {shape:?} {dtype:?} grad {grad_dtype:?} inv {inv_scale} step {i} skip {skip}"
        );
        let mut g = rng.vec(n, grad_magnitude);
        if skip {
            g = grad_values(rng, n, Inject::All);
        }
        let found = if skip { 1.0 } else { 0.0 };
        let before = skip.then(|| adam_bytes::<B>(&k));
        let grad = || tensor::<B>(g.clone(), shape, grad_dtype, device);
        let (p, s) = adamw::<B>(
            true,
            k.p,
            grad(),
            k.s,
            scaling::<B>(inv_scale, found, device),
            lr,
            &c,
        );
        k = AdamState { p, s };
        let (p, s) = adamw::<B>(
            false,
            r.p,
            grad(),
            r.s,
            scaling::<B>(inv_scale, found, device),
            lr,
            &c,
        );
        r = AdamState { p, s };
        if !skip {
            applied += 1.0;
        }
        assert_eq!(
            count::<B>(k.s.step.clone()),
            applied,
            "{what}: kernel's step count"
        );
        assert_eq!(
            count::<B>(r.s.step.clone()),
            applied,
            "{what}: fallback's step count"
        );
        assert_eq!(k.p.dtype(), DType::from(dtype), "{what}: param dtype");
        assert_eq!(k.s.exp_avg.dtype(), DType::F32, "{what}: exp_avg dtype");
        assert_eq!(
            k.s.exp_avg_sq.dtype(),
            DType::F32,
            "{what}: exp_avg_sq dtype"
        );
        if let Some(before) = before {
            let after = adam_bytes::<B>(&k);
            for (j, name) in ["param", "exp_avg", "exp_avg_sq", "step count"]
                .iter()
                .enumerate()
            {
                assert!(after[j] == before[j], "{what}: {name} not bit-identical");
            }
        }
        let kp = values::<B>(k.p.clone());
        assert_close(
            &format!("{what} param"),
            &kp,
            &values::<B>(r.p.clone()),
            tol,
        );
        assert_close(
            &format!("{what} exp_avg"),
            &values::<B>(k.s.exp_avg.clone()),
            &values::<B>(r.s.exp_avg.clone()),
            F32_STEP,
        );
        assert_close(
            &format!("{what} exp_avg_sq"),
            &values::<B>(k.s.exp_avg_sq.clone()),
            &values::<B>(r.s.exp_avg_sq.clone()),
            F32_STEP,
        );
        assert!(kp.iter().all(|x| x.is_finite()), "{what}: finite param");
    }
    // The parameters did move.
    assert!(values::<B>(k.p) != tensor_values_rounded::<B>(&p0, shape, dtype, device));
}

fn check_adamw<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(11);
    for shape in STEP_SHAPES {
        // Step 3 overflows: skipped, and the step count does not move.
        let plan = [false, false, true, false, false];
        run_adamw_plan::<B>(
            device,
            &mut rng,
            shape,
            dtype,
            dtype,
            1.0 / 1024.0,
            1000.0,
            &plan,
        );
    }
}

fn tensor_values_rounded<B: Backend>(
    v: &[f32],
    shape: &[usize],
    dtype: FloatDType,
    device: &B::Device,
) -> Vec<f32> {
    values::<B>(tensor::<B>(v.to_vec(), shape, dtype, device))
}

/// Skipped steps with clones held by the caller: outputs bit-identical, clones untouched.
fn check_adamw_skip_with_clones<B: AmpKernels>(device: &B::Device) {
    let lr = 1e-1;
    let c = adamw_config(0.9, 0.99, 1e-8, 0.1);
    let mut rng = Rng::new(5);
    let n = 1000;
    let p = tensor::<B>(rng.vec(n, 1.0), &[n], FloatDType::F16, device);
    let m = tensor::<B>(rng.vec(n, 1.0), &[n], FloatDType::F32, device);
    let v = tensor::<B>(
        rng.vec(n, 1.0).iter().map(|x| x * x).collect(),
        &[n],
        FloatDType::F32,
        device,
    );
    let step = scalar::<B>(3.0, device);
    let (p_b, m_b, v_b, step_b) = (
        read::<B>(p.clone()).1,
        read::<B>(m.clone()).1,
        read::<B>(v.clone()).1,
        read::<B>(step.clone()).1,
    );
    for found in [1.0f32, 0.0] {
        let state = AdamWMoments {
            exp_avg: m.clone(),
            exp_avg_sq: v.clone(),
            step: step.clone(),
        };
        let grad = tensor::<B>(
            grad_values(&mut rng, n, Inject::Clean),
            &[n],
            FloatDType::F16,
            device,
        );
        let (p2, s2) = B::adamw_step(
            p.clone(),
            grad,
            state,
            scaling::<B>(1.0, found, device),
            lr,
            &c,
        );
        let changed = read::<B>(p2).1 != p_b;
        assert_eq!(
            changed,
            found == 0.0,
            "the param moves iff the step is not skipped"
        );
        // (a) The count: 3 applied before, 4 after unless skipped.
        let want_count = if found == 1.0 { 3.0 } else { 4.0 };
        assert_eq!(
            count::<B>(s2.step.clone()),
            want_count,
            "found {found}: step count"
        );
        if found == 1.0 {
            assert!(read::<B>(s2.exp_avg).1 == m_b && read::<B>(s2.exp_avg_sq).1 == v_b);
            assert!(read::<B>(s2.step).1 == step_b);
        }
        // The inputs the caller held are untouched either way.
        assert!(read::<B>(p.clone()).1 == p_b);
        assert!(read::<B>(m.clone()).1 == m_b);
        assert!(read::<B>(v.clone()).1 == v_b);
        assert!(read::<B>(step.clone()).1 == step_b);
    }
}

/// (f) The step count is kept per parameter: two parameters with the same values, gradient
/// and moments but counts 0 and 5 get different bias corrections, each as the fallback and
/// as the hand formula (f64) computes it.
fn check_adamw_per_parameter_counts<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let lr = 1e-2f32;
    let (beta_1, beta_2, epsilon, weight_decay) = (0.9f32, 0.999f32, 1e-8f32, 0.01f32);
    let c = adamw_config(beta_1, beta_2, epsilon, weight_decay);
    let inv = 1.0f32 / 1024.0;
    let mut rng = Rng::new(59);
    let n = 1023;
    let p0 = rng.vec(n, 1.0);
    let g = rng.vec(n, 1000.0);
    let m0 = rng.vec(n, 0.1);
    let v0: Vec<f32> = rng.vec(n, 0.1).iter().map(|x| x * x + 1e-4).collect();
    let p_stored = values::<B>(tensor::<B>(p0.clone(), &[n], dtype, device));
    let g_stored = values::<B>(tensor::<B>(g.clone(), &[n], dtype, device));
    // The hand formula carries the kernel's f32 rounding of 1 - beta^t = -(exp(t ln beta) - 1)
    // (about 1e-4 relative for t = 1, beta_2 = 0.999): 1e-5 absolute on parameters near 1.
    let hand_tol = match dtype {
        FloatDType::F32 => Tol {
            rtol: 1e-5,
            atol_of_max: 0.0,
            atol: 1e-5,
        },
        _ => Tol {
            rtol: 1.0 / 1024.0,
            atol_of_max: 0.0,
            atol: 1e-5,
        },
    };
    let mut params = Vec::new();
    for count0 in [0.0f32, 5.0] {
        let what = format!("adamw per-parameter count {count0} {dtype:?}");
        let run = |kernel: bool| {
            let state = AdamWMoments {
                exp_avg: tensor::<B>(m0.clone(), &[n], FloatDType::F32, device),
                exp_avg_sq: tensor::<B>(v0.clone(), &[n], FloatDType::F32, device),
                step: scalar::<B>(count0, device),
            };
            let (p, s) = adamw::<B>(
                kernel,
                tensor::<B>(p0.clone(), &[n], dtype, device),
                tensor::<B>(g.clone(), &[n], dtype, device),
                state,
                scaling::<B>(inv, 0.0, device),
                lr,
                &c,
            );
            (
                values::<B>(p),
                values::<B>(s.exp_avg),
                values::<B>(s.exp_avg_sq),
                count::<B>(s.step),
            )
        };
        let (k, r) = (run(true), run(false));
        assert_eq!(k.3, count0 + 1.0, "{what}: kernel's count");
        assert_eq!(r.3, count0 + 1.0, "{what}: fallback's count");
        assert_close(&format!("{what} param"), &k.0, &r.0, step_tol(dtype));
        assert_close(&format!("{what} exp_avg"), &k.1, &r.1, F32_STEP);
        assert_close(&format!("{what} exp_avg_sq"), &k.2, &r.2, F32_STEP);
        let t = (count0 + 1.0) as i32;
        let (b1, b2) = (beta_1 as f64, beta_2 as f64);
        let hand: Vec<f32> = (0..n)
            .map(|i| {
                let gi = g_stored[i] as f64 * inv as f64;
                let m = b1 * m0[i] as f64 + (1.0 - b1) * gi;
                let v = b2 * v0[i] as f64 + (1.0 - b2) * gi * gi;
                let m_hat = m / (1.0 - b1.powi(t));
                let v_hat = v / (1.0 - b2.powi(t));
                let p = p_stored[i] as f64 * (1.0 - lr as f64 * weight_decay as f64);
                (p - lr as f64 * m_hat / (v_hat.sqrt() + epsilon as f64)) as f32
            })
            .collect();
        assert_close(
            &format!("{what} param vs hand formula"),
            &k.0,
            &hand,
            hand_tol,
        );
        params.push(k.0);
    }
    let differ = params[0]
        .iter()
        .zip(&params[1])
        .filter(|(a, b)| a != b)
        .count();
    assert!(
        differ > n / 4,
        "{dtype:?}: counts 0 and 5 gave the same update on {} of {n} elements",
        n - differ
    );
}

// ---------------------------------------------------------------------------------------
// sgd_step
// ---------------------------------------------------------------------------------------

fn check_sgd<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let configs = [
        // (momentum, dampening, weight_decay, nesterov)
        (0.0, 0.0, 0.0, false),
        (0.0, 0.0, 1e-2, false),
        (0.9, 0.0, 0.0, false),
        (0.9, 0.1, 1e-2, false),
        (0.9, 0.0, 1e-2, true),
    ];
    let tol = step_tol(dtype);
    let lr = 0.05;
    let inv = 1.0f32 / 256.0;
    let mut rng = Rng::new(13);
    for (momentum, dampening, weight_decay, nesterov) in configs {
        let c = sgd_config(momentum, dampening, weight_decay, nesterov);
        // First step skipped, and a later one. (b) There is no separate init kernel any more:
        // the velocity starts with count 0 and whatever its buffer holds (garbage here; the
        // old test started from no buffer, which the fallback created as zeros). The first
        // applied step sets it to the gradient; a skipped one leaves count and buffer.
        let plans: [&[bool]; 2] = [&[false, false, true, false], &[true, false, false]];
        for plan in plans {
            for shape in STEP_SHAPES {
                let n: usize = shape.iter().product();
                let p0 = rng.vec(n, 1.0);
                let garbage = rng.vec(n, 100.0);
                let mut kp = tensor::<B>(p0.clone(), shape, dtype, device);
                let mut rp = tensor::<B>(p0, shape, dtype, device);
                let velocity = || {
                    (momentum != 0.0).then(|| Velocity {
                        velocity: tensor::<B>(garbage.clone(), shape, FloatDType::F32, device),
                        step: scalar::<B>(0.0, device),
                    })
                };
                let (mut kb, mut rb) = (velocity(), velocity());
                let mut applied = 0.0f32;
                for (i, &skip) in plan.iter().enumerate() {
                    let what = format!("sgd {c:?} {shape:?} {dtype:?} plan {plan:?} step {i}");
                    let inject = if skip { Inject::All } else { Inject::Clean };
                    let g = grad_values(&mut rng, n, inject);
                    let found = if skip { 1.0 } else { 0.0 };
                    let before = if skip {
                        Some((
                            read::<B>(kp.clone()).1,
                            kb.clone()
                                .map(|b| (read::<B>(b.velocity).1, read::<B>(b.step).1)),
                        ))
                    } else {
                        None
                    };
                    let first = kb.as_ref().is_some_and(|_| applied == 0.0) && !skip;
                    let p_before = values::<B>(kp.clone());
                    let grad = || tensor::<B>(g.clone(), shape, dtype, device);
                    let g_stored = values::<B>(grad());
                    let (p, b) = sgd::<B>(
                        true,
                        kp,
                        grad(),
                        kb,
                        scaling::<B>(inv, found, device),
                        lr,
                        &c,
                    );
                    (kp, kb) = (p, b);
                    let (p, b) = sgd::<B>(
                        false,
                        rp,
                        grad(),
                        rb,
                        scaling::<B>(inv, found, device),
                        lr,
                        &c,
                    );
                    (rp, rb) = (p, b);
                    assert_eq!(kb.is_some(), rb.is_some(), "{what}: buffer presence");
                    assert_eq!(kb.is_some(), momentum != 0.0, "{what}: buffer iff momentum");
                    assert_eq!(kp.dtype(), DType::from(dtype), "{what}: param dtype");
                    if !skip && momentum != 0.0 {
                        applied += 1.0;
                    }
                    let (pv, pbytes, _) = read::<B>(kp.clone());
                    if let Some((p_b, b_b)) = before {
                        assert!(pbytes == p_b, "{what}: param not bit-identical");
                        if let (Some((vel_b, step_b)), Some(kb)) = (b_b, kb.clone()) {
                            assert!(
                                read::<B>(kb.velocity).1 == vel_b,
                                "{what}: buffer not bit-identical"
                            );
                            assert!(
                                read::<B>(kb.step).1 == step_b,
                                "{what}: count not bit-identical"
                            );
                        }
                    }
                    assert_close(&format!("{what} param"), &pv, &values::<B>(rp.clone()), tol);
                    if let (Some(kb), Some(rb)) = (kb.clone(), rb.clone()) {
                        assert_eq!(kb.velocity.dtype(), DType::F32, "{what}: buffer dtype");
                        assert_eq!(count::<B>(kb.step), applied, "{what}: kernel's count");
                        assert_eq!(count::<B>(rb.step), applied, "{what}: fallback's count");
                        let kv = values::<B>(kb.velocity);
                        assert_close(
                            &format!("{what} buffer"),
                            &kv,
                            &values::<B>(rb.velocity),
                            F32_STEP,
                        );
                        if first {
                            // (b) The gradient itself (unscaled, with its weight decay), not
                            // the garbage the buffer held.
                            let want: Vec<f32> = g_stored
                                .iter()
                                .zip(&p_before)
                                .map(|(g, p)| g * inv + p * weight_decay)
                                .collect();
                            assert_close(&format!("{what} first buffer"), &kv, &want, F32_STEP);
                        }
                    }
                }
            }
        }
    }
}

/// (b) With count 0 the buffer's content does not matter, NaN and inf included: a skipped
/// first step keeps it bit for bit (count still 0), the first applied step sets the velocity
/// to the unscaled gradient (no dampening), the next one uses it.
fn check_sgd_first_step_ignores_buffer<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let (lr, momentum, dampening) = (0.1f32, 0.9f32, 0.5f32);
    let c = sgd_config(momentum, dampening, 0.0, false);
    let inv = 1.0f32 / 256.0;
    let mut rng = Rng::new(61);
    let n = 1023;
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -7.0];
    let garbage: Vec<f32> = (0..n).map(|i| specials[i % specials.len()]).collect();
    let p0 = rng.vec(n, 1.0);
    let g1 = rng.vec(n, 1000.0);
    let g2 = rng.vec(n, 1000.0);
    let poisoned = grad_values(&mut rng, n, Inject::All);
    let stored = |v: &Vec<f32>| values::<B>(tensor::<B>(v.clone(), &[n], dtype, device));
    let (p0_s, g1_s, g2_s) = (stored(&p0), stored(&g1), stored(&g2));
    let garbage_bytes = read::<B>(tensor::<B>(garbage.clone(), &[n], FloatDType::F32, device)).1;
    let mut results = Vec::new();
    for kernel in [true, false] {
        let what = format!("sgd first step {dtype:?} kernel {kernel}");
        let p = tensor::<B>(p0.clone(), &[n], dtype, device);
        let p_bytes = read::<B>(p.clone()).1;
        let v = Some(Velocity {
            velocity: tensor::<B>(garbage.clone(), &[n], FloatDType::F32, device),
            step: scalar::<B>(0.0, device),
        });
        let grad = |g: &Vec<f32>| tensor::<B>(g.clone(), &[n], dtype, device);
        let (p, v) = sgd::<B>(
            kernel,
            p,
            grad(&poisoned),
            v,
            scaling::<B>(inv, 1.0, device),
            lr,
            &c,
        );
        let v = v.expect("a velocity");
        assert!(read::<B>(p.clone()).1 == p_bytes, "{what}: skipped param");
        assert!(
            read::<B>(v.velocity.clone()).1 == garbage_bytes,
            "{what}: skipped buffer"
        );
        assert_eq!(count::<B>(v.step.clone()), 0.0, "{what}: skipped count");

        let (p, v) = sgd::<B>(
            kernel,
            p,
            grad(&g1),
            Some(v),
            scaling::<B>(inv, 0.0, device),
            lr,
            &c,
        );
        let v = v.expect("a velocity");
        assert_eq!(count::<B>(v.step.clone()), 1.0, "{what}: first count");
        let v1: Vec<f32> = g1_s.iter().map(|g| g * inv).collect();
        let p1 = values::<B>(p.clone());
        assert_close(
            &format!("{what}: first velocity"),
            &values::<B>(v.velocity.clone()),
            &v1,
            EXACT,
        );
        let want: Vec<f32> = p0_s.iter().zip(&v1).map(|(p, v)| p - v * lr).collect();
        assert_close(&format!("{what}: first param"), &p1, &want, step_tol(dtype));

        let (p, v) = sgd::<B>(
            kernel,
            p,
            grad(&g2),
            Some(v),
            scaling::<B>(inv, 0.0, device),
            lr,
            &c,
        );
        let v = v.expect("a velocity");
        assert_eq!(count::<B>(v.step.clone()), 2.0, "{what}: second count");
        let v2: Vec<f32> = v1
            .iter()
            .zip(&g2_s)
            .map(|(v, g)| v * momentum + g * inv * (1.0 - dampening))
            .collect();
        let v2_got = values::<B>(v.velocity);
        assert_close(&format!("{what}: second velocity"), &v2_got, &v2, F32_STEP);
        results.push((p1, values::<B>(p), v2_got));
    }
    let (k, r) = (&results[0], &results[1]);
    let what = format!("sgd first step {dtype:?} kernel vs fallback");
    assert_close(&format!("{what}: first param"), &k.0, &r.0, step_tol(dtype));
    assert_close(
        &format!("{what}: second param"),
        &k.1,
        &r.1,
        step_tol(dtype),
    );
    assert_close(&format!("{what}: second velocity"), &k.2, &r.2, F32_STEP);
}

// ---------------------------------------------------------------------------------------
// Scaled steps: the optimizer kernels unscale in f32 (item 9)
// ---------------------------------------------------------------------------------------

/// (e) A real loss scale, 2^16, on f16 gradients (scaled magnitudes up to 60000, within
/// f16), with a skipped step: AdamW and SGD with momentum, kernel against fallback.
fn check_scaled_steps_f16_grads<B: AmpKernels>(device: &B::Device, param_dtype: FloatDType) {
    let inv = 1.0f32 / 65536.0;
    let mut rng = Rng::new(53);
    let plan = [false, true, false, false];
    for shape in [&[4097][..], &[16, 24], &[3]] {
        run_adamw_plan::<B>(
            device,
            &mut rng,
            shape,
            param_dtype,
            FloatDType::F16,
            inv,
            60000.0,
            &plan,
        );
    }
    let lr = 0.05;
    let c = sgd_config(0.9, 0.0, 1e-2, true);
    let tol = step_tol(param_dtype);
    for shape in [&[4097][..], &[16, 24], &[3]] {
        let n: usize = shape.iter().product();
        let p0 = rng.vec(n, 1.0);
        let velocity = || Velocity {
            velocity: tensor::<B>(vec![0.0; n], shape, FloatDType::F32, device),
            step: scalar::<B>(0.0, device),
        };
        let (mut kp, mut rp) = (
            tensor::<B>(p0.clone(), shape, param_dtype, device),
            tensor::<B>(p0, shape, param_dtype, device),
        );
        let (mut kb, mut rb) = (Some(velocity()), Some(velocity()));
        let mut applied = 0.0;
        for (i, &skip) in plan.iter().enumerate() {
            let what = format!("scaled sgd {shape:?} {param_dtype:?} step {i} skip {skip}");
            let g = if skip {
                grad_values(&mut rng, n, Inject::All)
            } else {
                rng.vec(n, 60000.0)
            };
            let found = if skip { 1.0 } else { 0.0 };
            let grad = || tensor::<B>(g.clone(), shape, FloatDType::F16, device);
            let before = skip.then(|| read::<B>(kp.clone()).1);
            (kp, kb) = sgd::<B>(
                true,
                kp,
                grad(),
                kb,
                scaling::<B>(inv, found, device),
                lr,
                &c,
            );
            (rp, rb) = sgd::<B>(
                false,
                rp,
                grad(),
                rb,
                scaling::<B>(inv, found, device),
                lr,
                &c,
            );
            if !skip {
                applied += 1.0;
            }
            if let Some(before) = before {
                assert!(
                    read::<B>(kp.clone()).1 == before,
                    "{what}: param not bit-identical"
                );
            }
            let (kv, rv) = (kb.clone().unwrap(), rb.clone().unwrap());
            assert_eq!(count::<B>(kv.step), applied, "{what}: kernel's count");
            assert_eq!(count::<B>(rv.step), applied, "{what}: fallback's count");
            assert_close(
                &format!("{what} param"),
                &values::<B>(kp.clone()),
                &values::<B>(rp.clone()),
                tol,
            );
            assert_close(
                &format!("{what} buffer"),
                &values::<B>(kv.velocity),
                &values::<B>(rv.velocity),
                F32_STEP,
            );
        }
    }
}

/// (e) f16 gradients whose unscaled values are below half the smallest f16 subnormal
/// (|g| · 2^-16 < 2^-25, with |g| in [1e-4, 1.9e-3]): unscaled in f16 first (the old path,
/// `unscale_and_check` then a step with `inv_scale` 1) they flush to zero and the moments
/// never move; the fused steps unscale in f32 inside the kernel, where they are exact, and
/// the f32 moments (and an f32 parameter) move.
fn check_small_scaled_grads<B: AmpKernels>(device: &B::Device, param_dtype: FloatDType) {
    let inv = 1.0f32 / 65536.0;
    let mut rng = Rng::new(67);
    let n = 1023;
    let g: Vec<f32> = (0..n)
        .map(|i| {
            let m = 1e-4 + rng.unit().abs() * 1.8e-3;
            if i % 2 == 0 { m } else { -m }
        })
        .collect();
    let grad = || tensor::<B>(g.clone(), &[n], FloatDType::F16, device);
    let unscaled: Vec<f32> = values::<B>(grad()).iter().map(|g| g * inv).collect();
    assert!(
        unscaled
            .iter()
            .all(|u| *u != 0.0 && u.abs() < 2f32.powi(-25)),
        "the test values: nonzero in f32, below half an f16 subnormal"
    );
    let p0 = rng.vec(n, 1.0);
    let param = || tensor::<B>(p0.clone(), &[n], param_dtype, device);
    let p0_stored = values::<B>(param());
    let lr = 1e-3;
    let (beta_1, beta_2) = (0.9f32, 0.999f32);
    let c = adamw_config(beta_1, beta_2, 1e-8, 0.0);

    // The old path: unscaled into the f16 gradient, every value is 0.
    let (old, found) = B::unscale_and_check(
        vec![grad()],
        scalar::<B>(inv, device),
        scalar::<B>(0.0, device),
    );
    assert_eq!(values::<B>(found), vec![0.0]);
    let old = old.into_iter().next().unwrap();
    assert!(
        values::<B>(old.clone()).iter().all(|v| *v == 0.0),
        "{param_dtype:?}: unscaled in f16 the gradients flush to zero"
    );
    let (_, s) = B::adamw_step(
        param(),
        old,
        zero_moments::<B>(&[n], 0.0, device),
        scaling::<B>(1.0, 0.0, device),
        lr,
        &c,
    );
    assert!(
        values::<B>(s.exp_avg).iter().all(|v| *v == 0.0),
        "the old path leaves the moments at zero"
    );

    // The fused path.
    let one_minus_beta1 = (1.0 - beta_1 as f64) as f32;
    let one_minus_beta2 = (1.0 - beta_2 as f64) as f32;
    let want_m: Vec<f32> = unscaled.iter().map(|u| u * one_minus_beta1).collect();
    let want_v: Vec<f32> = unscaled.iter().map(|u| (u * u) * one_minus_beta2).collect();
    let mut results = Vec::new();
    for kernel in [true, false] {
        let what = format!("small scaled grads, adamw {param_dtype:?} kernel {kernel}");
        let (p, s) = adamw::<B>(
            kernel,
            param(),
            grad(),
            zero_moments::<B>(&[n], 0.0, device),
            scaling::<B>(inv, 0.0, device),
            lr,
            &c,
        );
        assert_eq!(count::<B>(s.step), 1.0, "{what}: count");
        let (m, v, p) = (
            values::<B>(s.exp_avg),
            values::<B>(s.exp_avg_sq),
            values::<B>(p),
        );
        assert!(m.iter().all(|x| *x != 0.0), "{what}: exp_avg moved");
        assert!(v.iter().all(|x| *x != 0.0), "{what}: exp_avg_sq moved");
        assert_close(&format!("{what} exp_avg"), &m, &want_m, F32_STEP);
        assert_close(&format!("{what} exp_avg_sq"), &v, &want_v, F32_STEP);
        if param_dtype == FloatDType::F32 {
            // m_hat / (sqrt(v_hat) + eps) = u / (|u| + 1e-8) >= 0.13 here: a step of lr · 0.13.
            assert!(
                p.iter().zip(&p0_stored).all(|(a, b)| a != b),
                "{what}: the parameter moved"
            );
        }
        results.push((p, m, v));
    }
    let what = format!("small scaled grads, adamw {param_dtype:?} kernel vs fallback");
    assert_close(
        &format!("{what} param"),
        &results[0].0,
        &results[1].0,
        step_tol(param_dtype),
    );
    assert_close(
        &format!("{what} exp_avg"),
        &results[0].1,
        &results[1].1,
        F32_STEP,
    );
    assert_close(
        &format!("{what} exp_avg_sq"),
        &results[0].2,
        &results[1].2,
        F32_STEP,
    );

    // SGD with momentum: the velocity is the unscaled gradient, exactly.
    let c = sgd_config(0.9, 0.0, 0.0, false);
    let mut velocities = Vec::new();
    for kernel in [true, false] {
        let what = format!("small scaled grads, sgd {param_dtype:?} kernel {kernel}");
        let velocity = Velocity {
            velocity: tensor::<B>(vec![0.0; n], &[n], FloatDType::F32, device),
            step: scalar::<B>(0.0, device),
        };
        let (_, v) = sgd::<B>(
            kernel,
            param(),
            grad(),
            Some(velocity),
            scaling::<B>(inv, 0.0, device),
            0.1,
            &c,
        );
        let v = v.expect("a velocity");
        assert_eq!(count::<B>(v.step), 1.0, "{what}: count");
        let v = values::<B>(v.velocity);
        assert_close(&what, &v, &unscaled, EXACT);
        velocities.push(v);
    }
    assert_close(
        "small scaled grads, sgd kernel vs fallback",
        &velocities[0],
        &velocities[1],
        EXACT,
    );
}

/// Empty parameters come back as they are, with their state. (An empty parameter's count
/// comes back unchanged too, in the kernels and the fallbacks alike: asserted equal here.)
fn check_empty_steps<B: AmpKernels>(device: &B::Device) {
    let e = || tensor::<B>(vec![], &[0, 3], FloatDType::F32, device);
    let c = adamw_config(0.9, 0.999, 1e-8, 0.0);
    let mut counts = Vec::new();
    for kernel in [true, false] {
        let state = AdamWMoments {
            exp_avg: e(),
            exp_avg_sq: e(),
            step: scalar::<B>(0.0, device),
        };
        let (p, s) = adamw::<B>(
            kernel,
            e(),
            e(),
            state,
            scaling::<B>(1.0, 0.0, device),
            1e-3,
            &c,
        );
        for t in [p, s.exp_avg, s.exp_avg_sq] {
            assert_eq!(t.shape(), Shape::new([0, 3]));
        }
        counts.push(count::<B>(s.step));
    }
    let c = sgd_config(0.9, 0.0, 0.0, false);
    for kernel in [true, false] {
        let velocity = Velocity {
            velocity: e(),
            step: scalar::<B>(0.0, device),
        };
        let (p, b) = sgd::<B>(
            kernel,
            e(),
            e(),
            Some(velocity),
            scaling::<B>(1.0, 0.0, device),
            0.1,
            &c,
        );
        assert_eq!(p.shape(), Shape::new([0, 3]));
        let b = b.expect("a velocity");
        assert_eq!(b.velocity.shape(), Shape::new([0, 3]));
        counts.push(count::<B>(b.step));
    }
    assert_eq!(counts[0], counts[1], "adamw: kernel's count vs fallback's");
    assert_eq!(counts[2], counts[3], "sgd: kernel's count vs fallback's");
}
// ---------------------------------------------------------------------------------------
// accumulate
// ---------------------------------------------------------------------------------------

/// Sizes off the vector width, a 2-d shape and empty ones.
const ACC_SHAPES: &[&[usize]] = &[&[1], &[3], &[1023], &[4097], &[16, 24], &[0], &[4, 0]];

/// `acc + grad × weight` with a multiply then an add: exact without a partial sum (a cast
/// and at most one multiply) and with weight 1 (one add); otherwise the kernel may contract
/// the two into one fused multiply-add, one rounding instead of two.
fn accumulate_tol(has_acc: bool, weight: f32) -> Tol {
    if has_acc && weight != 1.0 {
        F32_STEP
    } else {
        EXACT
    }
}

/// One micro-step, kernel against fallback: with and without an accumulator, weights 1 and
/// not, clean and poisoned gradients.
fn check_accumulate<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(31);
    for shape in ACC_SHAPES {
        let n: usize = shape.iter().product();
        for weight in [1.0f32, 0.25, 1.0 / 3.0] {
            for has_acc in [false, true] {
                for inject in [Inject::Clean, Inject::All] {
                    let what = format!(
                        "accumulate {shape:?} {dtype:?} weight {weight} acc {has_acc} {inject:?}"
                    );
                    let g = grad_values(&mut rng, n, inject);
                    let a = rng.vec(n, 100.0);
                    let acc =
                        || has_acc.then(|| tensor::<B>(a.clone(), shape, FloatDType::F32, device));
                    let grad = || tensor::<B>(g.clone(), shape, dtype, device);
                    let out = B::accumulate(acc(), grad(), weight);
                    let expected = fallback::accumulate::<B>(acc(), grad(), weight);
                    assert_eq!(out.shape(), Shape::from(shape.to_vec()), "{what}: shape");
                    assert_eq!(out.dtype(), DType::F32, "{what}: dtype");
                    assert_eq!(expected.dtype(), DType::F32, "{what}: fallback dtype");
                    assert_close(
                        &what,
                        &values::<B>(out),
                        &values::<B>(expected),
                        accumulate_tol(has_acc, weight),
                    );
                }
            }
        }
    }
}

/// A window of micro-steps chained as `GradientAccumulation` chains them (the sum handed
/// from one call to the next, so the kernel works in place), against the fallback's chain.
fn check_accumulate_window<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(37);
    for shape in [&[4097][..], &[1023], &[3]] {
        let n: usize = shape.iter().product();
        for (steps, weight) in [(4usize, 0.25f32), (3, 1.0)] {
            let what = format!("accumulate window {shape:?} {dtype:?} {steps} x {weight}");
            let (mut k, mut r): (Option<FloatTensor<B>>, Option<FloatTensor<B>>) = (None, None);
            for _ in 0..steps {
                let g = grad_values(&mut rng, n, Inject::Clean);
                k = Some(B::accumulate(
                    k,
                    tensor::<B>(g.clone(), shape, dtype, device),
                    weight,
                ));
                r = Some(fallback::accumulate::<B>(
                    r,
                    tensor::<B>(g, shape, dtype, device),
                    weight,
                ));
            }
            let tol = if weight == 1.0 { EXACT } else { F32_STEP };
            assert_close(
                &what,
                &values::<B>(k.unwrap()),
                &values::<B>(r.unwrap()),
                tol,
            );
        }
    }
}

/// Clones the caller holds (the accumulator; an f32 gradient, whose buffer the first
/// micro-step may reuse) never change.
fn check_accumulate_held_clones<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(41);
    let n = 1023;
    let a = rng.vec(n, 10.0);
    let g = rng.vec(n, 10.0);
    let acc = tensor::<B>(a.clone(), &[n], FloatDType::F32, device);
    let grad = tensor::<B>(g.clone(), &[n], dtype, device);
    let (acc_bytes, grad_bytes) = (read::<B>(acc.clone()).1, read::<B>(grad.clone()).1);
    let g_stored = values::<B>(grad.clone());

    let sum = B::accumulate(Some(acc.clone()), grad.clone(), 0.5);
    let want: Vec<f32> = a.iter().zip(&g_stored).map(|(a, g)| a + g * 0.5).collect();
    assert_close("held acc: sum", &values::<B>(sum), &want, F32_STEP);
    let first = B::accumulate(None, grad.clone(), 0.5);
    let want: Vec<f32> = g_stored.iter().map(|g| g * 0.5).collect();
    assert_close("held grad: first step", &values::<B>(first), &want, EXACT);
    let first = B::accumulate(None, grad.clone(), 1.0);
    assert_close("held grad: weight 1", &values::<B>(first), &g_stored, EXACT);

    assert!(
        read::<B>(acc).1 == acc_bytes,
        "the held accumulator changed"
    );
    assert!(read::<B>(grad).1 == grad_bytes, "the held gradient changed");
}

/// Accumulators and gradients seen through `swap_dims` (strided): read in logical order.
fn check_accumulate_strided<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(43);
    let (rows, cols) = (64, 33);
    let g = grad_values(&mut rng, rows * cols, Inject::Clean);
    let a = rng.vec(rows * cols, 100.0);
    let strided = |v: &Vec<f32>, dt| {
        B::float_swap_dims(tensor::<B>(v.clone(), &[rows, cols], dt, device), 0, 1)
    };
    for (acc_strided, weight) in [(true, 0.5f32), (false, 1.0 / 3.0)] {
        let what = format!("strided accumulate {dtype:?} acc strided {acc_strided}");
        let acc = || {
            if acc_strided {
                strided(&a, FloatDType::F32)
            } else {
                tensor::<B>(a.clone(), &[cols, rows], FloatDType::F32, device)
            }
        };
        let out = B::accumulate(Some(acc()), strided(&g, dtype), weight);
        let expected = fallback::accumulate::<B>(Some(acc()), strided(&g, dtype), weight);
        assert_eq!(out.shape(), Shape::new([cols, rows]), "{what}");
        assert_close(&what, &values::<B>(out), &values::<B>(expected), F32_STEP);
    }
}

/// The plain composition `GradientAccumulation` ran before the kernel existed, with the
/// tensor API: the fallback must be it, op for op.
fn tensor_composition<B: Backend>(
    acc: Option<FloatTensor<B>>,
    grad: FloatTensor<B>,
    weight: f32,
) -> FloatTensor<B> {
    use burn::tensor::{Tensor, TensorPrimitive};
    let wrap = |t| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t));
    let grad = wrap(grad);
    let dtype = if grad.dtype() == DType::F64 {
        FloatDType::F64
    } else {
        FloatDType::F32
    };
    let grad = grad.cast(dtype);
    let grad = if weight == 1.0 {
        grad
    } else {
        grad.mul_scalar(weight)
    };
    let sum = match acc.map(wrap) {
        Some(acc) => acc + grad,
        None => grad,
    };
    sum.into_primitive().tensor()
}

/// `fallback::accumulate` against [`tensor_composition`], bit for bit.
fn check_fallback_is_the_composition<B: Backend>(device: &B::Device, dtypes: &[FloatDType]) {
    let mut rng = Rng::new(47);
    for &dtype in dtypes {
        let acc_dtype = if dtype == FloatDType::F64 {
            FloatDType::F64
        } else {
            FloatDType::F32
        };
        for n in [1usize, 1023, 4097, 0] {
            for weight in [1.0f32, 0.25, 1.0 / 3.0, 1.0 / 7.0] {
                for has_acc in [false, true] {
                    let what = format!("composition {dtype:?} {n} weight {weight} acc {has_acc}");
                    let g = grad_values(&mut rng, n, Inject::All);
                    let a = rng.vec(n, 100.0);
                    let acc = || has_acc.then(|| tensor::<B>(a.clone(), &[n], acc_dtype, device));
                    let grad = || tensor::<B>(g.clone(), &[n], dtype, device);
                    let (_, got, got_dtype) =
                        read::<B>(fallback::accumulate::<B>(acc(), grad(), weight));
                    let (_, want, want_dtype) =
                        read::<B>(tensor_composition::<B>(acc(), grad(), weight));
                    assert_eq!(got_dtype, want_dtype, "{what}: dtype");
                    assert_eq!(got_dtype, DType::from(acc_dtype), "{what}: dtype");
                    assert!(got == want, "{what}: not bit-identical");
                }
            }
        }
    }
}

/// On `Flex` (whose `AmpKernels` is the fallback), every float dtype it has.
#[test]
fn accumulate_fallback_is_the_tensor_composition_flex() {
    use burn::backend::Flex;
    common::big_stack(|| {
        check_fallback_is_the_composition::<Flex>(
            &Default::default(),
            &[
                FloatDType::F32,
                FloatDType::F16,
                FloatDType::BF16,
                FloatDType::F64,
            ],
        );
        // And `Flex`'s `AmpKernels::accumulate` is that fallback.
        let device = Default::default();
        let g = || tensor::<Flex>(vec![1.0, -3.0, 0.1], &[3], FloatDType::F16, &device);
        let a = || {
            Some(tensor::<Flex>(
                vec![2.0, 0.5, 1e-3],
                &[3],
                FloatDType::F32,
                &device,
            ))
        };
        assert!(
            read::<Flex>(Flex::accumulate(a(), g(), 0.3)).1
                == read::<Flex>(fallback::accumulate::<Flex>(a(), g(), 0.3)).1
        );
    });
}

// ---------------------------------------------------------------------------------------
// The tests: every check on Wgpu (fusion) and on the bare CubeBackend.
// ---------------------------------------------------------------------------------------

macro_rules! on_both {
    ($name:ident, |$b:ident, $dev:ident| $body:expr) => {
        mod $name {
            use super::*;
            #[test]
            fn fusion() {
                if let Some(device) = devices() {
                    common::big_stack(move || {
                        let $dev = &device;
                        type $b = Wgpu;
                        $body
                    });
                }
            }
            #[test]
            fn cube() {
                if let Some(device) = devices() {
                    common::big_stack(move || {
                        let $dev = &device;
                        type $b = Cube;
                        $body
                    });
                }
            }
        }
    };
}

on_both!(unscale_f32, |B, d| check_unscale::<B>(
    d,
    FloatDType::F32,
    1
));
on_both!(unscale_f16, |B, d| check_unscale::<B>(
    d,
    FloatDType::F16,
    2
));
on_both!(unscale_list_f32, |B, d| check_unscale_list::<B>(
    d,
    FloatDType::F32
));
on_both!(unscale_list_f16, |B, d| check_unscale_list::<B>(
    d,
    FloatDType::F16
));
on_both!(unscale_never_writes_held_clones, |B, d| {
    check_unscale_no_alias::<B>(d)
});
on_both!(strided_f32, |B, d| check_non_contiguous::<B>(
    d,
    FloatDType::F32
));
on_both!(strided_f16, |B, d| check_non_contiguous::<B>(
    d,
    FloatDType::F16
));
on_both!(update_scale_script, |B, d| check_update_scale::<B>(d));
on_both!(adamw_f32, |B, d| check_adamw::<B>(d, FloatDType::F32));
on_both!(adamw_f16, |B, d| check_adamw::<B>(d, FloatDType::F16));
on_both!(adamw_skip_with_held_clones, |B, d| {
    check_adamw_skip_with_clones::<B>(d)
});
on_both!(sgd_f32, |B, d| check_sgd::<B>(d, FloatDType::F32));
on_both!(sgd_f16, |B, d| check_sgd::<B>(d, FloatDType::F16));
on_both!(empty_steps, |B, d| check_empty_steps::<B>(d));
on_both!(accumulate_f32, |B, d| check_accumulate::<B>(
    d,
    FloatDType::F32
));
on_both!(accumulate_f16, |B, d| check_accumulate::<B>(
    d,
    FloatDType::F16
));
on_both!(accumulate_window_f32, |B, d| check_accumulate_window::<B>(
    d,
    FloatDType::F32
));
on_both!(accumulate_window_f16, |B, d| check_accumulate_window::<B>(
    d,
    FloatDType::F16
));
on_both!(accumulate_never_writes_held_clones_f32, |B, d| {
    check_accumulate_held_clones::<B>(d, FloatDType::F32)
});
on_both!(accumulate_never_writes_held_clones_f16, |B, d| {
    check_accumulate_held_clones::<B>(d, FloatDType::F16)
});
on_both!(
    accumulate_strided_f32,
    |B, d| check_accumulate_strided::<B>(d, FloatDType::F32)
);
on_both!(
    accumulate_strided_f16,
    |B, d| check_accumulate_strided::<B>(d, FloatDType::F16)
);
on_both!(accumulate_fallback_is_the_tensor_composition, |B, d| {
    check_fallback_is_the_composition::<B>(d, &[FloatDType::F32, FloatDType::F16])
});
on_both!(
    update_scale_edge_states,
    |B, d| check_update_scale_edges::<B>(d)
);
on_both!(check_finite_f32, |B, d| check_check_finite::<B>(
    d,
    FloatDType::F32,
    3
));
on_both!(check_finite_f16, |B, d| check_check_finite::<B>(
    d,
    FloatDType::F16,
    4
));
on_both!(check_finite_list_f32, |B, d| check_check_finite_list::<B>(
    d,
    FloatDType::F32
));
on_both!(check_finite_list_f16, |B, d| check_check_finite_list::<B>(
    d,
    FloatDType::F16
));
on_both!(
    check_finite_strided_f32,
    |B, d| check_check_finite_strided::<B>(d, FloatDType::F32)
);
on_both!(
    check_finite_strided_f16,
    |B, d| check_check_finite_strided::<B>(d, FloatDType::F16)
);
on_both!(check_finite_never_writes_held_clones, |B, d| {
    check_finite_no_alias::<B>(d)
});
on_both!(scaled_steps_f16_grads_f32_params, |B, d| {
    check_scaled_steps_f16_grads::<B>(d, FloatDType::F32)
});
on_both!(scaled_steps_f16_grads_f16_params, |B, d| {
    check_scaled_steps_f16_grads::<B>(d, FloatDType::F16)
});
on_both!(small_scaled_grads_move_f32_moments_f32_params, |B, d| {
    check_small_scaled_grads::<B>(d, FloatDType::F32)
});
on_both!(small_scaled_grads_move_f32_moments_f16_params, |B, d| {
    check_small_scaled_grads::<B>(d, FloatDType::F16)
});
on_both!(adamw_per_parameter_counts_f32, |B, d| {
    check_adamw_per_parameter_counts::<B>(d, FloatDType::F32)
});
on_both!(adamw_per_parameter_counts_f16, |B, d| {
    check_adamw_per_parameter_counts::<B>(d, FloatDType::F16)
});
on_both!(sgd_first_step_ignores_buffer_f32, |B, d| {
    check_sgd_first_step_ignores_buffer::<B>(d, FloatDType::F32)
});
on_both!(sgd_first_step_ignores_buffer_f16, |B, d| {
    check_sgd_first_step_ignores_buffer::<B>(d, FloatDType::F16)
});
