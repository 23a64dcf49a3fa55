//! `adamw_step`.

use super::*;

/// A run of AdamW steps (one skipped), kernel against fallback: parameter, moments (AMSGrad's
/// maximum too when `c.amsgrad`) and the step count each returns.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_adamw_plan<B: AmpKernels>(
    device: &B::Device,
    rng: &mut Rng,
    c: &FusedAdamWConfig,
    shape: &[usize],
    dtype: FloatDType,
    grad_dtype: FloatDType,
    inv_scale: f32,
    grad_magnitude: f32,
    plan: &[bool],
) {
    let lr = 1e-2;
    let tol = step_tol(dtype);
    let n: usize = shape.iter().product();
    let p0 = rng.vec(n, 1.0);
    let new = |p: &Vec<f32>| {
        let mut s = zero_moments::<B>(shape, 0.0, device);
        if c.amsgrad {
            s.max_exp_avg_sq = Some(tensor::<B>(vec![0.0; n], shape, FloatDType::F32, device));
        }
        AdamState::<B> {
            p: tensor::<B>(p.clone(), shape, dtype, device),
            s,
        }
    };
    let (mut k, mut r) = (new(&p0), new(&p0));
    // (a) The count handed in is the steps applied BEFORE this one (the old signature took
    // the count including this step) and each step returns the new count, +1 unless skipped.
    let mut applied = 0.0f32;
    for (i, &skip) in plan.iter().enumerate() {
        let what = format!(
            "adamw {shape:?} {dtype:?} grad {grad_dtype:?} inv {inv_scale} amsgrad {} \
             cautious {} step {i} skip {skip}",
            c.amsgrad, c.cautious_weight_decay
        );
        let mut g = rng.vec(n, grad_magnitude);
        if skip {
            g = grad_values(rng, n, Inject::All);
        }
        let found = if skip { 1.0 } else { 0.0 };
        let before = skip.then(|| adam_bytes::<B>(&k));
        let grad = || tensor::<B>(g.clone(), shape, grad_dtype, device);
        // This step, on the kernel's state (`kernel`) or on the fallback's.
        let step = |kernel, a: AdamState<B>| {
            let scaling = scaling::<B>(inv_scale, found, device);
            let (p, s) = adamw::<B>(kernel, a.p, grad(), a.s, scaling, lr, c);
            AdamState { p, s }
        };
        k = step(true, k);
        r = step(false, r);
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
            let names = [
                "param",
                "exp_avg",
                "exp_avg_sq",
                "step count",
                "max_exp_avg_sq",
            ];
            assert_eq!(after.len(), before.len(), "{what}: state tensors");
            for (j, name) in names.iter().take(after.len()).enumerate() {
                assert!(after[j] == before[j], "{what}: {name} not bit-identical");
            }
        }
        assert_eq!(
            k.s.max_exp_avg_sq.is_some(),
            c.amsgrad,
            "{what}: kernel's AMSGrad maximum"
        );
        assert_eq!(
            r.s.max_exp_avg_sq.is_some(),
            c.amsgrad,
            "{what}: fallback's AMSGrad maximum"
        );
        if let (Some(km), Some(rm)) = (&k.s.max_exp_avg_sq, &r.s.max_exp_avg_sq) {
            let (km, rm) = (values::<B>(km.clone()), values::<B>(rm.clone()));
            assert_close(&format!("{what} max_exp_avg_sq"), &km, &rm, F32_STEP);
            let v = values::<B>(k.s.exp_avg_sq.clone());
            assert!(
                km.iter().zip(&v).all(|(max, v)| max >= v),
                "{what}: the maximum is below the second moment"
            );
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
    let c = adamw_config(0.9, 0.999, 1e-8, 0.01);
    for shape in STEP_SHAPES {
        // Step 3 overflows: skipped, and the step count does not move.
        let plan = [false, false, true, false, false];
        run_adamw_plan::<B>(
            device,
            &mut rng,
            &c,
            shape,
            dtype,
            dtype,
            1.0 / 1024.0,
            1000.0,
            &plan,
        );
    }
}

/// The variants of the step: (AMSGrad, cautious weight decay, decoupled weight decay).
const VARIANTS: [(bool, bool, bool); 5] = [
    (true, false, true),
    (false, true, true),
    (true, true, true),
    (false, false, false),
    (true, false, false),
];

/// AMSGrad, cautious weight decay and Adam's L2 penalty, kernel against fallback over steps
/// with an overflow (skipped bit for bit, AMSGrad's maximum included), and with `maximize`'s
/// negative `inv_scale`. Whether each variant
/// changes the step: `check_adamw_variants_by_hand`.
fn check_adamw_variants<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(17);
    for (amsgrad, cautious, decoupled) in VARIANTS {
        let c = adamw_config(0.9, 0.99, 1e-8, 0.1)
            .with_amsgrad(amsgrad)
            .with_cautious_weight_decay(cautious)
            .with_decoupled_weight_decay(decoupled);
        let plan = [false, false, true, false, false];
        for shape in [&[4097][..], &[16, 24], &[3]] {
            run_adamw_plan::<B>(device, &mut rng, &c, shape, dtype, dtype, 1.0, 1.0, &plan);
        }
        // `maximize`: the adaptor hands the kernel a negative `inv_scale`.
        run_adamw_plan::<B>(
            device,
            &mut rng,
            &c,
            &[16, 24],
            dtype,
            dtype,
            -1.0,
            1.0,
            &plan,
        );
    }
}

/// Each variant changes the step it should, where it should: from a state whose second
/// moment is above the new one (AMSGrad divides by the old maximum) and parameters whose
/// sign disagrees with their first moment on about half the elements (cautious decay keeps
/// those), kernel and fallback against the hand formula (f64); Adam's L2 penalty enters the
/// moments instead of decaying the value.
fn check_adamw_variants_by_hand<B: AmpKernels>(device: &B::Device) {
    let (lr, beta_1, beta_2, epsilon, weight_decay) = (0.1f32, 0.9f32, 0.99f32, 1e-8f32, 0.5f32);
    let mut rng = Rng::new(23);
    let n = 1000;
    let p0 = rng.vec(n, 1.0);
    let g = rng.vec(n, 1.0);
    let m0 = rng.vec(n, 1.0);
    let v0: Vec<f32> = rng.vec(n, 1.0).iter().map(|x| x * x).collect();
    let max0: Vec<f32> = v0.iter().map(|v| v * 4.0).collect();
    for (amsgrad, cautious, decoupled) in [(false, false, true)].into_iter().chain(VARIANTS) {
        let what =
            format!("adamw by hand, amsgrad {amsgrad} cautious {cautious} decoupled {decoupled}");
        let c = adamw_config(beta_1, beta_2, epsilon, weight_decay)
            .with_amsgrad(amsgrad)
            .with_cautious_weight_decay(cautious)
            .with_decoupled_weight_decay(decoupled);
        let l2 = if decoupled { 0.0 } else { weight_decay as f64 };
        let wd = if decoupled { weight_decay as f64 } else { 0.0 };
        let (b1, b2, t) = (beta_1 as f64, beta_2 as f64, 3);
        let (mut kept, mut larger) = (0, 0);
        let hand: Vec<f32> = (0..n)
            .map(|i| {
                let p = p0[i] as f64;
                let gi = g[i] as f64 + l2 * p;
                let m = b1 * m0[i] as f64 + (1.0 - b1) * gi;
                let v = b2 * v0[i] as f64 + (1.0 - b2) * gi * gi;
                let denom = if amsgrad { v.max(max0[i] as f64) } else { v };
                larger += usize::from(amsgrad && denom > v);
                let opposed = p * m < 0.0;
                kept += usize::from(cautious && opposed);
                let decayed = if cautious && opposed {
                    p
                } else {
                    p * (1.0 - lr as f64 * wd)
                };
                let update = (m / (1.0 - b1.powi(t)))
                    / ((denom / (1.0 - b2.powi(t))).sqrt() + epsilon as f64);
                (decayed - lr as f64 * update) as f32
            })
            .collect();
        // The data makes each variant matter on a good share of the elements.
        if amsgrad {
            assert!(
                larger > n / 2,
                "{what}: the maximum divides on {larger} of {n}"
            );
        }
        if cautious {
            assert!(
                (n / 4..3 * n / 4).contains(&kept),
                "{what}: {kept} of {n} kept"
            );
        }
        for kernel in [true, false] {
            let state = AdamWMoments {
                exp_avg: tensor::<B>(m0.clone(), &[n], FloatDType::F32, device),
                exp_avg_sq: tensor::<B>(v0.clone(), &[n], FloatDType::F32, device),
                max_exp_avg_sq: amsgrad
                    .then(|| tensor::<B>(max0.clone(), &[n], FloatDType::F32, device)),
                step: scalar::<B>(2.0, device),
            };
            let (p, s) = adamw::<B>(
                kernel,
                tensor::<B>(p0.clone(), &[n], FloatDType::F32, device),
                tensor::<B>(g.clone(), &[n], FloatDType::F32, device),
                state,
                scaling::<B>(1.0, 0.0, device),
                lr,
                &c,
            );
            let what = format!("{what}, kernel {kernel}");
            assert_close(
                &format!("{what}: param"),
                &values::<B>(p),
                &hand,
                Tol {
                    rtol: 1e-5,
                    atol_of_max: 0.0,
                    atol: 1e-6,
                },
            );
            if amsgrad {
                let want: Vec<f32> = (0..n)
                    .map(|i| {
                        let gi = g[i] as f64 + l2 * p0[i] as f64;
                        let v = beta_2 as f64 * v0[i] as f64 + (1.0 - beta_2 as f64) * gi * gi;
                        v.max(max0[i] as f64) as f32
                    })
                    .collect();
                let max = values::<B>(s.max_exp_avg_sq.expect("AMSGrad's maximum"));
                assert_close(&format!("{what}: max_exp_avg_sq"), &max, &want, F32_STEP);
            }
        }
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
            max_exp_avg_sq: None,
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
                max_exp_avg_sq: None,
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
// The tests: every check on Wgpu (fusion) and on the bare CubeBackend.
// ---------------------------------------------------------------------------------------

on_both! {
    adamw_f32: check_adamw(FloatDType::F32);
    adamw_f16: check_adamw(FloatDType::F16);
    adamw_variants_f32: check_adamw_variants(FloatDType::F32);
    adamw_variants_f16: check_adamw_variants(FloatDType::F16);
    adamw_variants_by_hand: check_adamw_variants_by_hand();
    adamw_skip_with_held_clones: check_adamw_skip_with_clones();
    adamw_per_parameter_counts_f32: check_adamw_per_parameter_counts(FloatDType::F32);
    adamw_per_parameter_counts_f16: check_adamw_per_parameter_counts(FloatDType::F16);
}
