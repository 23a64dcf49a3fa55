//! `AccumKernels`: `accumulate`.

use super::*;
use burn_amp::accumulate::AccumKernels;

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

/// `fallback::accumulate` against [`tensor_composition`], bit for bit. Empty gradients
/// against their shape and dtype alone: the composition's ops on an empty tensor launch a
/// zero-sized grid, which CUDA refuses (the fallback launches nothing for them).
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
                    let sum = fallback::accumulate::<B>(acc(), grad(), weight);
                    assert_eq!(sum.shape(), Shape::new([n]), "{what}: shape");
                    let (_, got, got_dtype) = read::<B>(sum);
                    assert_eq!(got_dtype, DType::from(acc_dtype), "{what}: dtype");
                    if n == 0 {
                        continue;
                    }
                    let (_, want, want_dtype) =
                        read::<B>(tensor_composition::<B>(acc(), grad(), weight));
                    assert_eq!(got_dtype, want_dtype, "{what}: dtype");
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

on_both! {
    accumulate_f32: check_accumulate(FloatDType::F32);
    accumulate_f16: check_accumulate(FloatDType::F16);
    accumulate_window_f32: check_accumulate_window(FloatDType::F32);
    accumulate_window_f16: check_accumulate_window(FloatDType::F16);
    accumulate_never_writes_held_clones_f32: check_accumulate_held_clones(FloatDType::F32);
    accumulate_never_writes_held_clones_f16: check_accumulate_held_clones(FloatDType::F16);
    accumulate_strided_f32: check_accumulate_strided(FloatDType::F32);
    accumulate_strided_f16: check_accumulate_strided(FloatDType::F16);
    accumulate_fallback_is_the_tensor_composition:
        check_fallback_is_the_composition(&[FloatDType::F32, FloatDType::F16]);
}
