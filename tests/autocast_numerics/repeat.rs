//! `repeat_dim`'s gradient under `Amp` (`src/backend/workarounds/repeat.rs`): burn-autodiff
//! 0.21 sums a tiled output's gradient as if each element's copies were adjacent, on every
//! backend, wherever the repeated dimension is longer than 1. Values and gradients against
//! sums by hand, and the canary that plain autodiff still gets them wrong.

use burn::backend::Autodiff;
use burn::tensor::TensorData;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::{Amp, autocast};

use super::*;

const X: [usize; 3] = [2, 3, 2];

/// `x` (`[2, 3, 2]`, small whole numbers: exact in f16 and bf16) repeated by `repeat`, its
/// values, and `x`'s gradient of `sum(y ⊙ w)` with `w` a ramp.
fn run<B: AutodiffBackend>(repeat: &[usize; 3], device: &B::Device) -> (Vec<f32>, Vec<f32>) {
    let n: usize = X.iter().product();
    let x: Vec<f32> = (0..n).map(|i| i as f32 - 5.0).collect();
    let x = Tensor::<B, 3>::from_data(TensorData::new(x, X), device).require_grad();
    let y = x.clone().repeat(repeat);
    let m = y.shape().num_elements();
    let w: Vec<f32> = (0..m).map(|i| (i % 7) as f32).collect();
    let w = Tensor::<B, 3>::from_data(TensorData::new(w, y.dims()), device);
    let grads = (y.clone() * w).sum().backward();
    (
        values(y.inner()),
        values(x.grad(&grads).expect("a gradient")),
    )
}

/// The tiled values and the gradient by hand: each element sums `w` at its copies.
fn by_hand(repeat: &[usize; 3]) -> (Vec<f32>, Vec<f32>) {
    let out = [X[0] * repeat[0], X[1] * repeat[1], X[2] * repeat[2]];
    let mut y = vec![0.0; out.iter().product()];
    let mut grad = vec![0.0; X.iter().product()];
    for (o, y) in y.iter_mut().enumerate() {
        let at = [o / (out[1] * out[2]), (o / out[2]) % out[1], o % out[2]];
        let i = (at[0] % X[0]) * X[1] * X[2] + (at[1] % X[1]) * X[2] + at[2] % X[2];
        *y = i as f32 - 5.0;
        grad[i] += (o % 7) as f32;
    }
    (y, grad)
}

const REPEATS: [[usize; 3]; 4] = [[1, 2, 1], [3, 1, 1], [1, 1, 4], [2, 2, 3]];

/// Under `Amp<Autodiff<X>>` at `precision`: values and gradients exactly the hand's.
pub(crate) fn repeat_backpropagates_right<X: Backend>(device: &X::Device, precision: Precision) {
    let _g = autocast(precision);
    for repeat in REPEATS {
        let (y, grad) = run::<Amp<Autodiff<X>>>(&repeat, device);
        let (want_y, want_grad) = by_hand(&repeat);
        assert_eq!(y, want_y, "repeat {repeat:?}: values");
        assert_eq!(
            grad, want_grad,
            "repeat {repeat:?} under {precision}: gradient"
        );
    }
}

flex_and_wgpu_tests!(repeat_backpropagates_right: repeat_flex_f16, repeat_flex_bf16, repeat_wgpu_f16);

/// Burn 0.21's defect, which `Amp` works around: fixed in a later Burn, this fails. (The
/// values are right; the gradients of a tiling along a dimension longer than 1 are not.)
#[test]
fn plain_autodiff_differentiates_repeat_as_an_interleaving() {
    let check = |got: (Vec<f32>, Vec<f32>), backend: &str| {
        let (want_y, want_grad) = by_hand(&[1, 2, 1]);
        assert_eq!(got.0, want_y, "plain {backend}: values");
        assert_ne!(
            got.1, want_grad,
            "plain {backend} differentiates repeat right now: fixed"
        );
    };
    check(
        run::<Autodiff<burn::backend::Flex>>(&[1, 2, 1], &Default::default()),
        "Flex",
    );
    if let Some(device) = common::wgpu_device() {
        check(
            run::<Autodiff<burn::backend::Wgpu>>(&[1, 2, 1], &device),
            "wgpu",
        );
    }
}
