//! The CubeCL kernels of `AmpKernels` against their references, the fallbacks composed from
//! burn ops (`burn_amp::kernels::fallback`), run on the same backend and device: wgpu on
//! lavapipe, both as `Wgpu` (fusion custom ops over `CubeBackend`) and as the bare
//! `CubeBackend`. WGSL has no bf16, so the bf16 instantiation is not run here (the kernels
//! pick their dtype at run time; the same code serves it on CUDA).
//!
//! Tolerances, `|kernel - fallback| <= atol + rtol * |fallback|`:
//! - unscale and the scale update are the same f32 operations in the same order: exact
//!   (NaN matched to NaN);
//! - optimizer steps in f32: `rtol = 1e-6`, with `atol = 1e-6 * max|fallback|` of the
//!   tensor (the fused fallback may contract or reorder a multiply-add);
//! - optimizer steps on f16 parameters: one f16 rounding apart, `rtol = 2^-10`,
//!   `atol = 2^-24` (an f32 difference of one ulp may round to neighbouring f16 values);
//! - skipped steps: parameter and moments bit for bit equal to their inputs;
//! - accumulation: exact without a partial sum or with weight 1; otherwise `F32_STEP` (a
//!   compiler may contract the multiply and add into one fused multiply-add). The fallback
//!   itself is checked bit for bit against the tensor-API composition that
//!   `GradientAccumulation` ran before the kernel, on `Flex` (f32, f16, bf16, f64) and here.

mod common;

use burn::backend::Wgpu;
use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn_amp::kernels::{AdamWHyper, AmpKernels, ScaleRule, SgdHyper, fallback};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorData, TensorMetadata, read_sync};
use burn_std::{DType, FloatDType, Shape};

/// The bare CubeCL backend on wgpu, without fusion.
type Cube = CubeBackend<WgpuRuntime, f32, i32, u32>;

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
    // AdamW with a contiguous parameter and a strided gradient.
    let h = AdamWHyper {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        weight_decay: 0.01,
    };
    let p0 = rng.vec(rows * cols, 1.0);
    let g = grad_values(&mut rng, rows * cols, Inject::Clean);
    let run = |kernel: bool| {
        let p = tensor::<B>(p0.clone(), &[cols, rows], dtype, device);
        let grad = B::float_swap_dims(tensor::<B>(g.clone(), &[rows, cols], dtype, device), 0, 1);
        let zeros = || {
            tensor::<B>(
                vec![0.0; rows * cols],
                &[cols, rows],
                FloatDType::F32,
                device,
            )
        };
        let args = (
            p,
            grad,
            zeros(),
            zeros(),
            scalar::<B>(1.0, device),
            scalar::<B>(1.0 / 1024.0, device),
            scalar::<B>(0.0, device),
        );
        let (p, m, v) = if kernel {
            B::adamw_step(args.0, args.1, args.2, args.3, args.4, args.5, args.6, h)
        } else {
            fallback::adamw_step::<B>(args.0, args.1, args.2, args.3, args.4, args.5, args.6, h)
        };
        (values::<B>(p), values::<B>(m), values::<B>(v))
    };
    let (k, r) = (run(true), run(false));
    let what = format!("strided adamw {dtype:?}");
    assert_close(&format!("{what} param"), &k.0, &r.0, step_tol(dtype));
    assert_close(&format!("{what} exp_avg"), &k.1, &r.1, F32_STEP);
    assert_close(&format!("{what} exp_avg_sq"), &k.2, &r.2, F32_STEP);
}

// ---------------------------------------------------------------------------------------
// update_scale
// ---------------------------------------------------------------------------------------

fn check_update_scale<B: AmpKernels>(device: &B::Device) {
    // Overflow (1) / clean (0) script: growth, hysteresis, the min_scale floor and its
    // counter, the max_scale ceiling.
    let script = [
        0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 1, 0, 0, 1, 1, 1,
    ];
    for hysteresis in [1u32, 3] {
        for (start, min_scale, max_scale) in [(8.0f32, 1.0f32, 64.0f32), (65536.0, 0.5, 1e6)] {
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
            let mut state_ref = tensor::<B>(init, &[4], FloatDType::F32, device);
            let (mut saw_floor, mut saw_ceiling) = (false, false);
            for (i, &overflow) in script.iter().enumerate() {
                let f = overflow as f32;
                state = B::update_scale(state, scalar::<B>(f, device), rule);
                state_ref = fallback::update_scale::<B>(state_ref, scalar::<B>(f, device), rule);
                let got = values::<B>(state.clone());
                let want = values::<B>(state_ref.clone());
                assert_eq!(
                    got, want,
                    "update_scale step {i} (overflow {overflow}), {rule:?}: kernel vs fallback"
                );
                saw_floor |= got[3] > 0.0;
                saw_ceiling |= got[0] == max_scale;
            }
            if start == 8.0 {
                assert!(saw_floor && saw_ceiling, "the script reaches both clamps");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// adamw_step
// ---------------------------------------------------------------------------------------

const STEP_SHAPES: &[&[usize]] = &[&[1], &[3], &[1023], &[4097], &[16, 24]];

struct AdamState<B: Backend> {
    p: FloatTensor<B>,
    m: FloatTensor<B>,
    v: FloatTensor<B>,
}

fn check_adamw<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let h = AdamWHyper {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        weight_decay: 0.01,
    };
    let tol = step_tol(dtype);
    let mut rng = Rng::new(11);
    for shape in STEP_SHAPES {
        let n: usize = shape.iter().product();
        let p0 = rng.vec(n, 1.0);
        let new = |p: &Vec<f32>| AdamState::<B> {
            p: tensor::<B>(p.clone(), shape, dtype, device),
            m: tensor::<B>(vec![0.0; n], shape, FloatDType::F32, device),
            v: tensor::<B>(vec![0.0; n], shape, FloatDType::F32, device),
        };
        let (mut k, mut r) = (new(&p0), new(&p0));
        let scale = 1024.0f32;
        // Step 3 overflows: skipped, and the step count does not move.
        let plan = [false, false, true, false, false];
        let mut t = 0.0f32;
        for (i, &skip) in plan.iter().enumerate() {
            let what = format!("adamw {shape:?} {dtype:?} step {i} skip {skip}");
            let inject = if skip { Inject::All } else { Inject::Clean };
            let g = grad_values(&mut rng, n, inject);
            if !skip {
                t += 1.0;
            }
            let found = if skip { 1.0 } else { 0.0 };
            let before = if skip {
                Some((
                    read::<B>(k.p.clone()).1,
                    read::<B>(k.m.clone()).1,
                    read::<B>(k.v.clone()).1,
                ))
            } else {
                None
            };
            let (p, m, v) = B::adamw_step(
                k.p,
                tensor::<B>(g.clone(), shape, dtype, device),
                k.m,
                k.v,
                scalar::<B>(t, device),
                scalar::<B>(1.0 / scale, device),
                scalar::<B>(found, device),
                h,
            );
            k = AdamState { p, m, v };
            let (p, m, v) = fallback::adamw_step::<B>(
                r.p,
                tensor::<B>(g, shape, dtype, device),
                r.m,
                r.v,
                scalar::<B>(t, device),
                scalar::<B>(1.0 / scale, device),
                scalar::<B>(found, device),
                h,
            );
            r = AdamState { p, m, v };
            assert_eq!(k.p.dtype(), DType::from(dtype), "{what}: param dtype");
            assert_eq!(k.m.dtype(), DType::F32, "{what}: exp_avg dtype");
            let (kp, kp_bytes, _) = read::<B>(k.p.clone());
            let (km, km_bytes, _) = read::<B>(k.m.clone());
            let (kv, kv_bytes, _) = read::<B>(k.v.clone());
            if let Some((p_b, m_b, v_b)) = before {
                assert!(kp_bytes == p_b, "{what}: param not bit-identical");
                assert!(km_bytes == m_b, "{what}: exp_avg not bit-identical");
                assert!(kv_bytes == v_b, "{what}: exp_avg_sq not bit-identical");
            }
            assert_close(
                &format!("{what} param"),
                &kp,
                &values::<B>(r.p.clone()),
                tol,
            );
            assert_close(
                &format!("{what} exp_avg"),
                &km,
                &values::<B>(r.m.clone()),
                F32_STEP,
            );
            assert_close(
                &format!("{what} exp_avg_sq"),
                &kv,
                &values::<B>(r.v.clone()),
                F32_STEP,
            );
            assert!(kp.iter().all(|x| x.is_finite()), "{what}: finite param");
        }
        // The parameters did move.
        assert!(values::<B>(k.p) != tensor_values_rounded::<B>(&p0, shape, dtype, device));
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
    let h = AdamWHyper {
        lr: 1e-1,
        beta1: 0.9,
        beta2: 0.99,
        epsilon: 1e-8,
        weight_decay: 0.1,
    };
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
    let (p_b, m_b, v_b) = (
        read::<B>(p.clone()).1,
        read::<B>(m.clone()).1,
        read::<B>(v.clone()).1,
    );
    for found in [1.0f32, 0.0] {
        let (p2, m2, v2) = B::adamw_step(
            p.clone(),
            tensor::<B>(
                grad_values(&mut rng, n, Inject::Clean),
                &[n],
                FloatDType::F16,
                device,
            ),
            m.clone(),
            v.clone(),
            scalar::<B>(3.0, device),
            scalar::<B>(1.0, device),
            scalar::<B>(found, device),
            h,
        );
        let changed = read::<B>(p2).1 != p_b;
        assert_eq!(
            changed,
            found == 0.0,
            "the param moves iff the step is not skipped"
        );
        if found == 1.0 {
            assert!(read::<B>(m2).1 == m_b && read::<B>(v2).1 == v_b);
        }
        // The inputs the caller held are untouched either way.
        assert!(read::<B>(p.clone()).1 == p_b);
        assert!(read::<B>(m.clone()).1 == m_b);
        assert!(read::<B>(v.clone()).1 == v_b);
    }
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
    let mut rng = Rng::new(13);
    for (momentum, dampening, weight_decay, nesterov) in configs {
        let h = SgdHyper {
            lr: 0.05,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        };
        // First step skipped (the buffer is created as zeros, as the fallback does), and a
        // later one.
        let plans: [&[bool]; 2] = [&[false, false, true, false], &[true, false, false]];
        for plan in plans {
            for shape in STEP_SHAPES {
                let n: usize = shape.iter().product();
                let p0 = rng.vec(n, 1.0);
                let mut kp = tensor::<B>(p0.clone(), shape, dtype, device);
                let mut rp = tensor::<B>(p0, shape, dtype, device);
                let (mut kb, mut rb): (Option<FloatTensor<B>>, Option<FloatTensor<B>>) =
                    (None, None);
                for (i, &skip) in plan.iter().enumerate() {
                    let what = format!("sgd {h:?} {shape:?} {dtype:?} plan {plan:?} step {i}");
                    let inject = if skip { Inject::All } else { Inject::Clean };
                    let g = grad_values(&mut rng, n, inject);
                    let found = if skip { 1.0 } else { 0.0 };
                    let before = if skip {
                        Some((read::<B>(kp.clone()).1, kb.clone().map(|b| read::<B>(b).1)))
                    } else {
                        None
                    };
                    let (p, b) = B::sgd_step(
                        kp,
                        tensor::<B>(g.clone(), shape, dtype, device),
                        kb,
                        scalar::<B>(1.0 / 256.0, device),
                        scalar::<B>(found, device),
                        h,
                    );
                    (kp, kb) = (p, b);
                    let (p, b) = fallback::sgd_step::<B>(
                        rp,
                        tensor::<B>(g, shape, dtype, device),
                        rb,
                        scalar::<B>(1.0 / 256.0, device),
                        scalar::<B>(found, device),
                        h,
                    );
                    (rp, rb) = (p, b);
                    assert_eq!(kb.is_some(), rb.is_some(), "{what}: buffer presence");
                    assert_eq!(kp.dtype(), DType::from(dtype), "{what}: param dtype");
                    let (pv, pbytes, _) = read::<B>(kp.clone());
                    if let Some((p_b, b_b)) = before {
                        assert!(pbytes == p_b, "{what}: param not bit-identical");
                        if let (Some(b_b), Some(kb)) = (b_b, kb.clone()) {
                            assert!(read::<B>(kb).1 == b_b, "{what}: buffer not bit-identical");
                        }
                    }
                    assert_close(&format!("{what} param"), &pv, &values::<B>(rp.clone()), tol);
                    if let (Some(kb), Some(rb)) = (kb.clone(), rb.clone()) {
                        assert_eq!(kb.dtype(), DType::F32, "{what}: buffer dtype");
                        assert_close(
                            &format!("{what} buffer"),
                            &values::<B>(kb),
                            &values::<B>(rb),
                            F32_STEP,
                        );
                    }
                }
            }
        }
    }
}

/// Empty parameters come back as they are.
fn check_empty_steps<B: AmpKernels>(device: &B::Device) {
    let e = || tensor::<B>(vec![], &[0, 3], FloatDType::F32, device);
    let (p, m, v) = B::adamw_step(
        e(),
        e(),
        e(),
        e(),
        scalar::<B>(1.0, device),
        scalar::<B>(1.0, device),
        scalar::<B>(0.0, device),
        AdamWHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            weight_decay: 0.0,
        },
    );
    for t in [p, m, v] {
        assert_eq!(t.shape(), Shape::new([0, 3]));
    }
    let (p, b) = B::sgd_step(
        e(),
        e(),
        Some(e()),
        scalar::<B>(1.0, device),
        scalar::<B>(0.0, device),
        SgdHyper {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        },
    );
    assert_eq!(p.shape(), Shape::new([0, 3]));
    assert_eq!(b.unwrap().shape(), Shape::new([0, 3]));
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
