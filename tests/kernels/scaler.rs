//! `ScalerKernels`: `unscale_and_check`, the read-only `check_finite` and `update_scale`.

use super::optim::{adamw, adamw_config, count, scaling, zero_moments};
use super::*;
use burn_amp::scaler::ScaleRule;
use burn_std::Slice;

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

/// The unscaled gradients and the `found_inf` flag `unscale_and_check` returns.
type Unscaled<B> = (Vec<FloatTensor<B>>, FloatTensor<B>);

/// `unscale_and_check` by the kernel and by the fallback, each on its own gradients from
/// `grads`.
fn unscale_both<B: AmpKernels>(
    grads: impl Fn() -> Vec<FloatTensor<B>>,
    inv_scale: f32,
    found_inf: f32,
    device: &B::Device,
) -> (Unscaled<B>, Unscaled<B>) {
    let inv = || scalar::<B>(inv_scale, device);
    let found = || scalar::<B>(found_inf, device);
    let kernel = B::unscale_and_check(grads(), inv(), found());
    let reference = fallback::unscale_and_check::<B>(grads(), inv(), found());
    (kernel, reference)
}

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
                let grad = || vec![tensor::<B>(g.clone(), shape, dtype, device)];
                let ((outs, found), (refs, found_ref)) =
                    unscale_both::<B>(grad, inv, found0, device);
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
        let ((outs, found), (refs, found_ref)) =
            unscale_both::<B>(|| make(&data), inv, 0.0, device);
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
        let ((outs, found), (refs, found_ref)) =
            unscale_both::<B>(|| vec![make()], 0.25, 0.0, device);
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
#[allow(clippy::type_complexity)]
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
// The tests: every check on Wgpu (fusion) and on the bare CubeBackend.
// ---------------------------------------------------------------------------------------

on_both! {
    unscale_f32: check_unscale(FloatDType::F32, 1);
    unscale_f16: check_unscale(FloatDType::F16, 2);
    unscale_list_f32: check_unscale_list(FloatDType::F32);
    unscale_list_f16: check_unscale_list(FloatDType::F16);
    unscale_never_writes_held_clones: check_unscale_no_alias();
    strided_f32: check_non_contiguous(FloatDType::F32);
    strided_f16: check_non_contiguous(FloatDType::F16);
    update_scale_script: check_update_scale();
    update_scale_edge_states: check_update_scale_edges();
    check_finite_f32: check_check_finite(FloatDType::F32, 3);
    check_finite_f16: check_check_finite(FloatDType::F16, 4);
    check_finite_list_f32: check_check_finite_list(FloatDType::F32);
    check_finite_list_f16: check_check_finite_list(FloatDType::F16);
    check_finite_strided_f32: check_check_finite_strided(FloatDType::F32);
    check_finite_strided_f16: check_check_finite_strided(FloatDType::F16);
    check_finite_never_writes_held_clones: check_finite_no_alias();
}
