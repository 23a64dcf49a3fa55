//! Scaled steps: the optimizer kernels unscale in f32 (item 9).

use super::adamw::run_adamw_plan;
use super::*;

/// (e) A real loss scale, 2^16, on f16 gradients (scaled magnitudes up to 60000, within
/// f16), with a skipped step: AdamW and SGD with momentum, kernel against fallback.
fn check_scaled_steps_f16_grads<B: AmpKernels>(device: &B::Device, param_dtype: FloatDType) {
    let inv = 1.0f32 / 65536.0;
    let mut rng = Rng::new(53);
    let plan = [false, true, false, false];
    let c = adamw_config(0.9, 0.999, 1e-8, 0.01);
    for shape in [&[4097][..], &[16, 24], &[3]] {
        run_adamw_plan::<B>(
            device,
            &mut rng,
            &c,
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
        let velocity = || fresh_velocity::<B>(vec![0.0; n], shape, device);
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
            // This step, on the kernel's run (`kernel`) or on the fallback's.
            let step = |kernel, p, b| {
                let scaling = scaling::<B>(inv, found, device);
                sgd::<B>(kernel, p, grad(), b, scaling, lr, &c)
            };
            (kp, kb) = step(true, kp, kb);
            (rp, rb) = step(false, rp, rb);
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

    // The fused path: the real scale, no overflow.
    let scaled = || scaling::<B>(inv, 0.0, device);
    let one_minus_beta1 = (1.0 - beta_1 as f64) as f32;
    let one_minus_beta2 = (1.0 - beta_2 as f64) as f32;
    let want_m: Vec<f32> = unscaled.iter().map(|u| u * one_minus_beta1).collect();
    let want_v: Vec<f32> = unscaled.iter().map(|u| (u * u) * one_minus_beta2).collect();
    let mut results = Vec::new();
    for kernel in [true, false] {
        let what = format!("small scaled grads, adamw {param_dtype:?} kernel {kernel}");
        let moments = zero_moments::<B>(&[n], 0.0, device);
        let (p, s) = adamw::<B>(kernel, param(), grad(), moments, scaled(), lr, &c);
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
        let velocity = Some(fresh_velocity::<B>(vec![0.0; n], &[n], device));
        let (_, v) = sgd::<B>(kernel, param(), grad(), velocity, scaled(), 0.1, &c);
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

// ---------------------------------------------------------------------------------------
// The tests: every check on Wgpu (fusion) and on the bare CubeBackend.
// ---------------------------------------------------------------------------------------

on_both! {
    scaled_steps_f16_grads_f32_params: check_scaled_steps_f16_grads(FloatDType::F32);
    scaled_steps_f16_grads_f16_params: check_scaled_steps_f16_grads(FloatDType::F16);
    small_scaled_grads_move_f32_moments_f32_params: check_small_scaled_grads(FloatDType::F32);
    small_scaled_grads_move_f32_moments_f16_params: check_small_scaled_grads(FloatDType::F16);
}
