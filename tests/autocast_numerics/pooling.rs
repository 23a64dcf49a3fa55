//! Average pooling accumulates in f32.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{TensorData, module};
use burn_amp::{Amp, autocast};

use super::*;

#[derive(Debug, Clone, Copy)]
enum Pool {
    /// `avg_pool2d` with one window over the whole map.
    Avg2d,
    /// `adaptive_avg_pool2d` to 1×1.
    Adaptive2d,
    /// `avg_pool1d` with one window over the flattened map.
    Avg1d,
    /// `adaptive_avg_pool1d` to 1.
    Adaptive1d,
}

impl Pool {
    const ALL: [Pool; 4] = [Pool::Avg2d, Pool::Adaptive2d, Pool::Avg1d, Pool::Adaptive1d];

    fn run<X: Backend>(self, x: Tensor<X, 4>) -> Tensor<X, 1> {
        let [n, c, h, w] = x.dims();
        match self {
            Pool::Avg2d => module::avg_pool2d(x, [h, w], [h, w], [0, 0], true, false).flatten(0, 3),
            Pool::Adaptive2d => module::adaptive_avg_pool2d(x, [1, 1]).flatten(0, 3),
            Pool::Avg1d => {
                module::avg_pool1d(x.reshape([n, c, h * w]), h * w, h * w, 0, true, false)
                    .flatten(0, 2)
            }
            Pool::Adaptive1d => {
                module::adaptive_avg_pool1d(x.reshape([n, c, h * w]), 1).flatten(0, 2)
            }
        }
    }
}

/// Maps of ones (f16 stops counting at 2048, bf16 at 256) and of values up to 61 whose sum
/// (about 127,000) is beyond f16's 65,504.
fn pool_inputs() -> Vec<(&'static str, [usize; 4], Vec<f32>)> {
    let ones = |h: usize| vec![1.0f32; 2 * h * h];
    let large: Vec<f32> = (0..2 * 64 * 64)
        .map(|i| 1.0 + (i % 13) as f32 * 5.0)
        .collect();
    vec![
        ("56x56 ones", [1, 2, 56, 56], ones(56)),
        ("64x64 ones", [1, 2, 64, 64], ones(64)),
        ("64x64 values 1..61 (sum > 65504)", [1, 2, 64, 64], large),
    ]
}

/// Average pooling of a low-precision activation through `Amp<B>`: f32 out, and the f32
/// values. Inputs are small integers, exact in f16 and bf16, so the reference (the same
/// backend in f32) sees the same values; tolerance 1e-5 absolute + 1e-5 relative.
pub(crate) fn pooling_matches_f32<B: Backend>(device: &B::Device, precision: Precision) {
    let mut failures = Vec::new();
    for (name, dims, data) in pool_inputs() {
        let x = Tensor::<B, 4>::from_data(TensorData::new(data, dims), device);
        for pool in Pool::ALL {
            let reference = values(pool.run(x.clone()));
            let xa = Tensor::<Amp<B>, 4>::from_data(x.to_data(), device).cast(low(precision));
            let out = {
                let _g = autocast(precision);
                pool.run(xa)
            };
            let dtype = out.dtype();
            let got = values(out);
            if dtype != DType::F32 {
                failures.push(format!(
                    "{pool:?} on {name}: output {dtype:?}, expected F32 (values {got:?}, f32 {reference:?})"
                ));
            } else if let Some((i, g, r)) = first_mismatch(&got, &reference, 1e-5, 1e-5) {
                failures.push(format!("{pool:?} on {name}: {g} at {i}, f32 reference {r}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "average pooling under {precision}:\n{}",
        failures.join("\n")
    );
}

flex_and_wgpu_tests!(pooling_matches_f32:
    average_pooling_accumulates_in_f32_flex_f16,
    average_pooling_accumulates_in_f32_flex_bf16,
    average_pooling_accumulates_in_f32_wgpu_f16
);

/// Forward and backward of the pooling ops on a training stack: an f32 parameter cast to the
/// low dtype (an activation), pooled, weighted per channel by (3, -2) and summed. The f32
/// output and the gradient 3/4096 and -2/4096 (exact in f16 and bf16) must come out, with
/// no panic on the mixed dtypes the backward meets.
pub(crate) fn pooling_backward<A: AutodiffBackend>(precision: Precision) {
    let device = Default::default();
    let (h, w) = (64, 64);
    for pool in Pool::ALL {
        let x = Tensor::<A, 4>::ones([1, 2, h, w], &device).require_grad();
        let weights = Tensor::<A, 1>::from_floats([3.0, -2.0], &device);
        let loss = {
            let _g = autocast(precision);
            let y = pool.run(x.clone().cast(low(precision)));
            assert_eq!(y.dtype(), DType::F32, "{pool:?}: output dtype");
            let got = values(y.clone());
            assert!(
                first_mismatch(&got, &[1.0, 1.0], 1e-6, 0.0).is_none(),
                "{pool:?}: mean of 64x64 ones is {got:?}"
            );
            (y * weights).sum()
        };
        let grads = loss.backward();
        let grad = x.grad(&grads).expect("x has a gradient");
        assert_eq!(
            grad.dtype(),
            DType::F32,
            "{pool:?}: an f32 parameter gets an f32 gradient"
        );
        let got = values(grad);
        let want: Vec<f32> = (0..2 * h * w)
            .map(|i| if i < h * w { 3.0 } else { -2.0 } / (h * w) as f32)
            .collect();
        if let Some((i, g, r)) = first_mismatch(&got, &want, 1e-9, 1e-6) {
            panic!("{pool:?} under {precision}: gradient {g} at {i}, expected {r}");
        }
    }
}

#[test]
fn average_pooling_backward_amp_over_autodiff() {
    pooling_backward::<Amp<Autodiff<Flex>>>(Precision::F16);
    pooling_backward::<Amp<Autodiff<Flex>>>(Precision::Bf16);
}

#[test]
fn average_pooling_backward_autodiff_over_amp() {
    pooling_backward::<Autodiff<Amp<Flex>>>(Precision::F16);
    pooling_backward::<Autodiff<Amp<Flex>>>(Precision::Bf16);
}
