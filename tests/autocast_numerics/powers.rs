//! Powers where Burn's are wrong (`src/backend/workarounds/powers.rs`,
//! `negative_powers.rs`): CubeCL's `pow` at a zero or negative base (WGSL leaves it
//! undefined), and the gradients at a zero base, where burn-autodiff's bare formulas give NaN
//! and PyTorch's masked ones do not. Under `Amp`, above autodiff, all are IEEE's values and
//! PyTorch's gradients; the plain backends' are canaries.

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::backend::AutodiffBackend;
use burn_amp::{Amp, autocast};

use super::*;

/// `0^-0.5`, `0^-3`, `(-2)^-3` and `[0, -2]^[-1, 2]` (a tensor exponent) on `B`.
fn powers<B: Backend>(device: &B::Device) -> Vec<f32> {
    let x = || Tensor::<B, 1>::from_floats([0.0, -2.0], device);
    let exponent = Tensor::<B, 1>::from_floats([-1.0, 2.0], device);
    [
        x().slice(0..1).powf_scalar(-0.5),
        x().powf_scalar(-3.0),
        x().powf(exponent),
    ]
    .into_iter()
    .flat_map(values)
    .collect()
}

/// CubeCL's powers where WGSL's `pow` is undefined (a zero or negative base), canaries:
/// `0^-0.5`, `0^-3` and `0^-1` (a tensor exponent) are 0 (IEEE, PyTorch and Flex: `+inf`),
/// `(-2)^-3` is NaN (want -0.125). Under `Amp` they are IEEE's, as on Flex
/// (`src/backend/workarounds/negative_powers.rs`).
#[test]
fn powers_of_zero_and_negative_bases_wgpu() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    let inf = f32::INFINITY;
    assert_eq!(
        powers::<Flex>(&Default::default()),
        [inf, inf, -0.125, inf, 4.0]
    );
    let got = powers::<Wgpu>(&device);
    assert!(
        got[..2] == [0.0, 0.0] && got[2].is_nan() && got[3..] == [0.0, 4.0],
        "CubeCL's powers of 0 and -2: {got:?}"
    );
    let _g = autocast(Precision::F32);
    assert_eq!(powers::<Amp<Wgpu>>(&device), [inf, inf, -0.125, inf, 4.0]);
}

/// Negative powers under `Amp` above autodiff on `B`, of negative, fractional and positive
/// bases, to scalar and tensor exponents: values, the bases' gradients and a tensor exponent's
/// (at 0 too) within 1e-5 relative of Flex's (IEEE's `pow`; on wgpu through `negative_powers`, CUDA's own `powf`).
pub(crate) fn negative_powers<B: Backend>(device: &B::Device) {
    fn run<A: AutodiffBackend>(device: &A::Device) -> Vec<f32> {
        let x = Tensor::<A, 1>::from_floats([-2.0, -0.5, 0.5, 3.0], device).require_grad();
        let y = Tensor::<A, 1>::from_floats([-3.0, -2.0, -0.5, 2.0], device);
        let outs = [
            x.clone().powf_scalar(-3.0),
            x.clone().powi_scalar(-5),
            x.clone().abs().powf_scalar(-1.5),
            x.clone().powf(y),
        ];
        let loss = outs
            .iter()
            .cloned()
            .reduce(|a, b| a + b)
            .expect("four")
            .sum();
        // The exponent's gradient, `x^r ln x`, at positive bases, at r = 0 too (`ln x`).
        let base = Tensor::<A, 1>::from_floats([0.5, 3.0, 2.0], device);
        let r = Tensor::<A, 1>::from_floats([0.0, -0.5, 1.5], device).require_grad();
        let loss = loss + base.powf(r.clone()).sum();
        let grads = loss.backward();
        let grad = x.grad(&grads).expect("x's gradient");
        let mut all: Vec<f32> = outs.into_iter().flat_map(values).collect();
        all.extend(values(grad));
        all.extend(values(r.grad(&grads).expect("r's gradient")));
        all
    }
    let _g = autocast(Precision::F32);
    let want = run::<Amp<Autodiff<Flex>>>(&Default::default());
    let got = run::<Amp<Autodiff<B>>>(device);
    assert!(
        first_mismatch(&got, &want, 1e-6, 1e-5).is_none(),
        "negative powers {got:?}, Flex's {want:?}"
    );
}

/// Powers at a zero base against PyTorch's gradients (`pow_backward_self`,
/// `pow_backward_exponent`): `x = [0, 0, 2, 0, -2]` to `r = [2, 0, 0, 0.5, 2]` is
/// `[0, 1, 1, 0, 4]`, `x`'s gradient `r x^(r-1)` but 0 where `r = 0`: `[0, 0, 0, inf, -4]`,
/// `r`'s `x^r ln x` but 0 where `x = 0` and `r ≥ 0`: `[0, 0, ln 2, 0, NaN]` (the log of a
/// negative base). One exponent for `[0, 1, 2, 3]` squared (broadcast): its gradient
/// `4 ln 2 + 9 ln 3`, the bases' `2x`. A 0th power: gradient 0. Under `Amp` above autodiff
/// on `B`, at F16 (powers run in f32); returns the values and gradients of plain
/// `Autodiff<B>` beside them (Burn's bare formulas: NaN at `0 · 0^-1` and `0^r ln 0`, no
/// gradient for the 0th power).
pub(crate) fn powers_at_a_zero_base<B: Backend>(device: &B::Device) -> Vec<f32> {
    fn run<A: AutodiffBackend>(device: &A::Device) -> Vec<f32> {
        let x = Tensor::<A, 1>::from_floats([0.0, 0.0, 2.0, 0.0, -2.0], device).require_grad();
        let r = Tensor::<A, 1>::from_floats([2.0, 0.0, 0.0, 0.5, 2.0], device).require_grad();
        let y = x.clone().powf(r.clone());
        let grads = y.clone().sum().backward();
        let mut all = values(y);
        all.extend(values(x.grad(&grads).expect("x's gradient")));
        all.extend(values(r.grad(&grads).expect("r's gradient")));
        let x = Tensor::<A, 2>::from_floats([[0.0, 1.0, 2.0, 3.0]], device).require_grad();
        let r = Tensor::<A, 2>::from_floats([[2.0]], device).require_grad();
        let grads = x.clone().powf(r.clone()).sum().backward();
        all.extend(values(x.grad(&grads).expect("x's gradient")));
        all.extend(values(r.grad(&grads).expect("r's gradient")));
        let x = Tensor::<A, 1>::from_floats([0.0, 2.0], device).require_grad();
        let grads = (x.clone().powf_scalar(0.0) + x.clone().mul_scalar(0.0))
            .sum()
            .backward();
        all.extend(values(x.grad(&grads).expect("x's gradient")));
        all
    }
    let (inf, nan, ln2, ln3) = (f32::INFINITY, f32::NAN, 2f32.ln(), 3f32.ln());
    let want = [
        [0.0, 1.0, 1.0, 0.0, 4.0].as_slice(),
        &[0.0, 0.0, 0.0, inf, -4.0],
        &[0.0, 0.0, ln2, 0.0, nan],
        &[0.0, 2.0, 4.0, 6.0],
        &[4.0 * ln2 + 9.0 * ln3],
        &[0.0, 0.0],
    ]
    .concat();
    let got = {
        let _g = autocast(Precision::F16);
        run::<Amp<Autodiff<B>>>(device)
    };
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(&want)
            .all(|(g, w)| (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= 1e-5 * w.abs());
    assert!(same, "powers at a zero base: {got:?}, want {want:?}");
    run::<Autodiff<B>>(device)
}

/// Plain autodiff on Flex: Burn's bare formulas (a canary).
#[test]
fn powers_at_a_zero_base_flex() {
    let plain = powers_at_a_zero_base::<Flex>(&Default::default());
    let nan_at = |at: &[usize]| at.iter().all(|&i| plain[i].is_nan());
    // `x`'s gradient at 0^0; `r`'s at 0^2, 0^0 (`-inf`), 0^0.5.
    assert!(nan_at(&[6, 10, 13]), "plain: {plain:?}");
    assert_eq!(plain[11], f32::NEG_INFINITY, "plain: {plain:?}");
}

#[test]
fn powers_at_a_zero_base_wgpu() {
    if let Some(device) = common::wgpu_device() {
        powers_at_a_zero_base::<Wgpu>(&device);
    }
}

#[test]
fn negative_powers_wgpu() {
    if let Some(device) = common::wgpu_device() {
        negative_powers::<Wgpu>(&device);
    }
}
