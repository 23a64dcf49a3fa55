//! `sgd_step`.

use super::*;

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
    let mut rng = Rng::new(13);
    // With momentum, also `maximize`'s negative `inv_scale` (the gradient negated before the
    // weight decay is added).
    let signed = configs.into_iter().flat_map(|c| {
        [(c, 1.0f32)]
            .into_iter()
            .chain((c.0 != 0.0).then_some((c, -1.0)))
    });
    for ((momentum, dampening, weight_decay, nesterov), sign) in signed {
        let inv = sign / 256.0;
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
                    (momentum != 0.0).then(|| fresh_velocity::<B>(garbage.clone(), shape, device))
                };
                let (mut kb, mut rb) = (velocity(), velocity());
                let mut applied = 0.0f32;
                for (i, &skip) in plan.iter().enumerate() {
                    let what =
                        format!("sgd {c:?} inv {inv} {shape:?} {dtype:?} plan {plan:?} step {i}");
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
                    // This step, on the kernel's run (`kernel`) or on the fallback's.
                    let step = |kernel, p, b| {
                        let scaling = scaling::<B>(inv, found, device);
                        sgd::<B>(kernel, p, grad(), b, scaling, lr, &c)
                    };
                    (kp, kb) = step(true, kp, kb);
                    (rp, rb) = step(false, rp, rb);
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
        // One step on gradient `g` (overflowed when `found` is 1), by the kernel or the fallback.
        let step = |p, v, g: &Vec<f32>, found| {
            let grad = tensor::<B>(g.clone(), &[n], dtype, device);
            let scaling = scaling::<B>(inv, found, device);
            let (p, v) = sgd::<B>(kernel, p, grad, Some(v), scaling, lr, &c);
            (p, v.expect("a velocity"))
        };
        let v = fresh_velocity::<B>(garbage.clone(), &[n], device);
        let (p, v) = step(p, v, &poisoned, 1.0);
        assert!(read::<B>(p.clone()).1 == p_bytes, "{what}: skipped param");
        assert!(
            read::<B>(v.velocity.clone()).1 == garbage_bytes,
            "{what}: skipped buffer"
        );
        assert_eq!(count::<B>(v.step.clone()), 0.0, "{what}: skipped count");

        let (p, v) = step(p, v, &g1, 0.0);
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

        let (p, v) = step(p, v, &g2, 0.0);
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
// The tests: every check on Wgpu (fusion) and on the bare CubeBackend.
// ---------------------------------------------------------------------------------------

on_both! {
    sgd_f32: check_sgd(FloatDType::F32);
    sgd_f16: check_sgd(FloatDType::F16);
    sgd_first_step_ignores_buffer_f32: check_sgd_first_step_ignores_buffer(FloatDType::F32);
    sgd_first_step_ignores_buffer_f16: check_sgd_first_step_ignores_buffer(FloatDType::F16);
}
