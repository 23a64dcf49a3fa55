//! `EmaKernels`: `ema_update` (a device rate) and `ema_update_scalar` (a host rate).

use super::*;
use burn_amp::ema::EmaKernels;

/// Sizes off the vector width, a 2-d shape and empty ones.
const EMA_SHAPES: &[&[usize]] = &[&[1], &[3], &[1023], &[4097], &[16, 24], &[0], &[4, 0]];

/// `average + (weights − average) · rate`: a subtract, a multiply and an add, which a
/// compiler may contract into one fused multiply-add (one rounding instead of two); exact
/// at a rate of 0 (a skipped step: `average + 0`).
fn ema_tol(rate: f32) -> Tol {
    if rate == 0.0 { EXACT } else { F32_STEP }
}

/// The update with the rate on the device (`true`) or the host, kernel or fallback.
fn ema<B: AmpKernels>(
    kernel: bool,
    on_device: bool,
    average: FloatTensor<B>,
    weights: FloatTensor<B>,
    rate: f32,
) -> FloatTensor<B> {
    let device = B::float_device(&average);
    match (kernel, on_device) {
        (true, true) => B::ema_update(average, weights, scalar::<B>(rate, &device)),
        (true, false) => B::ema_update_scalar(average, weights, rate),
        (false, true) => fallback::ema_update::<B>(average, weights, scalar::<B>(rate, &device)),
        (false, false) => fallback::ema_update_scalar::<B>(average, weights, rate),
    }
}

/// One update, kernel against fallback, the rate on the device and on the host: weights of
/// `dtype`, averages off them by up to 10%, rates of a skipped step (0), a warm-up's first
/// (0.9) and a late one (1e-3).
fn check_ema_update<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(53);
    for shape in EMA_SHAPES {
        let n: usize = shape.iter().product();
        for (rate, on_device) in [0.0f32, 0.9, 1e-3]
            .into_iter()
            .flat_map(|r| [(r, true), (r, false)])
        {
            let what = format!("ema_update {shape:?} {dtype:?} rate {rate} on device {on_device}");
            let w = rng.vec(n, 10.0);
            let a: Vec<f32> = w.iter().map(|w| w * (1.0 + rng.unit() * 0.1)).collect();
            let average = || tensor::<B>(a.clone(), shape, FloatDType::F32, device);
            let weights = || tensor::<B>(w.clone(), shape, dtype, device);
            let out = ema::<B>(true, on_device, average(), weights(), rate);
            let expected = ema::<B>(false, on_device, average(), weights(), rate);
            assert_eq!(out.shape(), Shape::from(shape.to_vec()), "{what}: shape");
            assert_eq!(out.dtype(), DType::F32, "{what}: dtype");
            let out = values::<B>(out);
            assert_close(&what, &out, &values::<B>(expected), ema_tol(rate));
            if rate == 0.0 {
                assert!(out == a, "{what}: a skipped step moved the average");
            }
        }
    }
}

/// Ten updates chained as `ModelEma` chains them (the average handed from one to the next,
/// so the kernel works in place), one rate tensor shared by the device-rate ones, host rates
/// between them, against the fallback's.
fn check_ema_chain<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(59);
    let n = 4097;
    let a0 = rng.vec(n, 1.0);
    let (mut k, mut r) = (
        tensor::<B>(a0.clone(), &[n], FloatDType::F32, device),
        tensor::<B>(a0, &[n], FloatDType::F32, device),
    );
    let rate = scalar::<B>(0.1, device);
    for step in 0..10 {
        let w = rng.vec(n, 1.0);
        let weights = || tensor::<B>(w.clone(), &[n], dtype, device);
        if step % 2 == 0 {
            k = B::ema_update(k, weights(), rate.clone());
            r = fallback::ema_update::<B>(r, weights(), rate.clone());
        } else {
            k = B::ema_update_scalar(k, weights(), 0.1);
            r = fallback::ema_update_scalar::<B>(r, weights(), 0.1);
        }
        let what = format!("ema chain {dtype:?} step {step}");
        // Each step may round once less than the fallback; ten of them.
        let tol = Tol {
            rtol: 1e-5,
            ..F32_STEP
        };
        assert_close(&what, &values::<B>(k.clone()), &values::<B>(r.clone()), tol);
    }
}

/// A clone of the average the caller holds never changes, nor does the rate.
fn check_ema_held_clones<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(61);
    let n = 1023;
    let average = tensor::<B>(rng.vec(n, 1.0), &[n], FloatDType::F32, device);
    let weights = tensor::<B>(rng.vec(n, 1.0), &[n], dtype, device);
    let rate = scalar::<B>(0.5, device);
    let before = read::<B>(average.clone()).1;
    let updated = B::ema_update(average.clone(), weights.clone(), rate.clone());
    assert!(read::<B>(updated).1 != before, "nothing was averaged");
    let updated = B::ema_update_scalar(average.clone(), weights, 0.5);
    assert!(
        read::<B>(updated).1 != before,
        "nothing was averaged (host rate)"
    );
    assert!(read::<B>(average).1 == before, "the held average changed");
    assert_eq!(values::<B>(rate), [0.5], "the rate changed");
}

/// Weights seen through `swap_dims` (strided): read in logical order.
fn check_ema_strided<B: AmpKernels>(device: &B::Device, dtype: FloatDType) {
    let mut rng = Rng::new(67);
    let (rows, cols) = (64, 33);
    let w = rng.vec(rows * cols, 1.0);
    let a = rng.vec(rows * cols, 1.0);
    let weights = || B::float_swap_dims(tensor::<B>(w.clone(), &[rows, cols], dtype, device), 0, 1);
    let average = || tensor::<B>(a.clone(), &[cols, rows], FloatDType::F32, device);
    for on_device in [true, false] {
        let out = ema::<B>(true, on_device, average(), weights(), 0.25);
        let expected = ema::<B>(false, on_device, average(), weights(), 0.25);
        let what = format!("strided ema_update {dtype:?} rate on device {on_device}");
        assert_close(&what, &values::<B>(out), &values::<B>(expected), F32_STEP);
    }
}

/// The updates `ModelEma` composed with the tensor API before the kernels existed (the rate
/// a `[1]` tensor or a host `f32`): the fallbacks must be them, op for op.
fn ema_tensor_composition<B: Backend>(
    average: FloatTensor<B>,
    weights: FloatTensor<B>,
    rate: f32,
    on_device: bool,
) -> FloatTensor<B> {
    use burn::tensor::{Tensor, TensorPrimitive};
    let wrap = |t| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
    let device = B::float_device(&average);
    let average = wrap(average);
    let difference = wrap(weights).cast(FloatDType::F32) - average.clone();
    let step = if on_device {
        let rate =
            Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(scalar::<B>(rate, &device)));
        difference * rate.reshape([1, 1])
    } else {
        difference * rate
    };
    (average + step).into_primitive().tensor()
}

/// `fallback::ema_update` against [`ema_tensor_composition`], bit for bit.
fn check_ema_fallback_is_the_composition<B: Backend>(device: &B::Device, dtypes: &[FloatDType]) {
    let mut rng = Rng::new(71);
    for &dtype in dtypes {
        for (rate, on_device) in [0.0f32, 0.9, 1.0 / 3.0, 1e-3]
            .into_iter()
            .flat_map(|r| [(r, true), (r, false)])
        {
            let what = format!("ema composition {dtype:?} rate {rate} on device {on_device}");
            let (w, a) = (rng.vec(96, 10.0), rng.vec(96, 10.0));
            let average = || tensor::<B>(a.clone(), &[8, 12], FloatDType::F32, device);
            let weights = || tensor::<B>(w.clone(), &[8, 12], dtype, device);
            let got = if on_device {
                fallback::ema_update::<B>(average(), weights(), scalar::<B>(rate, device))
            } else {
                fallback::ema_update_scalar::<B>(average(), weights(), rate)
            };
            let (_, got, got_dtype) = read::<B>(got);
            let (_, want, _) = read::<B>(ema_tensor_composition::<B>(
                average(),
                weights(),
                rate,
                on_device,
            ));
            assert_eq!(got_dtype, DType::F32, "{what}: dtype");
            assert!(got == want, "{what}: not bit-identical");
        }
    }
}

/// On `Flex` (whose `EmaKernels` is the fallback), every float dtype it has.
#[test]
fn ema_fallback_is_the_tensor_composition_flex() {
    use burn::backend::Flex;
    common::big_stack(|| {
        let device = Default::default();
        check_ema_fallback_is_the_composition::<Flex>(
            &device,
            &[
                FloatDType::F32,
                FloatDType::F16,
                FloatDType::BF16,
                FloatDType::F64,
            ],
        );
        // And `Flex`'s `EmaKernels::ema_update` is that fallback.
        let w = || tensor::<Flex>(vec![1.0, -3.0, 0.1], &[3], FloatDType::BF16, &device);
        let a = || tensor::<Flex>(vec![2.0, 0.5, 1e-3], &[3], FloatDType::F32, &device);
        let r = || scalar::<Flex>(0.3, &device);
        assert!(
            read::<Flex>(Flex::ema_update(a(), w(), r())).1
                == read::<Flex>(fallback::ema_update::<Flex>(a(), w(), r())).1
        );
        assert!(
            read::<Flex>(Flex::ema_update_scalar(a(), w(), 0.3)).1
                == read::<Flex>(fallback::ema_update_scalar::<Flex>(a(), w(), 0.3)).1
        );
    });
}

// ---------------------------------------------------------------------------------------
// The tests: every check on Wgpu (fusion) and on the bare CubeBackend.
// ---------------------------------------------------------------------------------------

on_both! {
    ema_update_f32: check_ema_update(FloatDType::F32);
    ema_update_f16: check_ema_update(FloatDType::F16);
    ema_chain_f32: check_ema_chain(FloatDType::F32);
    ema_chain_f16: check_ema_chain(FloatDType::F16);
    ema_never_writes_held_clones_f32: check_ema_held_clones(FloatDType::F32);
    ema_never_writes_held_clones_f16: check_ema_held_clones(FloatDType::F16);
    ema_strided_f16: check_ema_strided(FloatDType::F16);
    ema_fallback_is_the_tensor_composition:
        check_ema_fallback_is_the_composition(&[FloatDType::F32, FloatDType::F16]);
}
