//! Pools drawn at random under `Amp` on wgpu, against Flex: `avg_pool2d`, `max_pool2d`,
//! `adaptive_avg_pool2d`, `avg_pool1d`, `max_pool1d`, over random shapes, kernels, strides,
//! padding, `count_include_pad` and `ceil_mode`, the output used as it is or permuted to
//! channels-last (its gradient then arrives channels-last); outputs and the input's gradient.
//!
//! Found here, with `workarounds.rs`'s `avg_pool2d` defect already avoided: Burn 0.21's
//! `ceil_mode` makes outputs whose window lies in the right padding alone (PyTorch has no
//! such output), which CubeCL's average without padding counted makes 0 / 0, NaN (Flex: 0).
//! `Amp` makes them 0 (`src/backend/workarounds/pooling.rs`). Such a window of a max pool is
//! empty too: Flex says -inf, CubeCL f32::MIN; both are left as they are (a sentinel either
//! way), and those draws are left out here.

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::TensorData;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::module;
use burn_amp::{Amp, autocast};

use super::common::Rng;
use super::*;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Avg2d,
    Max2d,
    Adaptive2d,
    Avg1d,
    Max1d,
}

/// A pool drawn from a seed.
#[derive(Debug, Clone, Copy)]
struct Pool {
    kind: Kind,
    shape: [usize; 4],
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    count_include_pad: bool,
    ceil_mode: bool,
    channels_last: bool,
}

impl Pool {
    fn draw(rng: &mut Rng) -> Self {
        let kind = [
            Kind::Avg2d,
            Kind::Max2d,
            Kind::Adaptive2d,
            Kind::Avg1d,
            Kind::Max1d,
        ][rng.below(5)];
        let one_d = matches!(kind, Kind::Avg1d | Kind::Max1d);
        let (h, w) = if one_d {
            (1, 2 + rng.below(20))
        } else {
            (1 + rng.below(10), 1 + rng.below(10))
        };
        let kernel = if one_d {
            let k = 1 + rng.below(w);
            [k, k]
        } else {
            [1 + rng.below(h), 1 + rng.below(w)]
        };
        // Often the kernel itself (the common pool), which with padding and `ceil_mode` makes
        // windows of padding alone.
        let stride = if rng.below(2) == 0 {
            kernel
        } else {
            [1 + rng.below(kernel[0]), 1 + rng.below(kernel[1])]
        };
        // Padding at most half the kernel, as Burn and PyTorch require.
        let padding = [rng.below(kernel[0] / 2 + 1), rng.below(kernel[1] / 2 + 1)];
        Self {
            kind,
            shape: [1 + rng.below(3), 1 + rng.below(7), h, w],
            kernel,
            stride,
            padding,
            count_include_pad: rng.below(2) == 0,
            ceil_mode: rng.below(2) == 0,
            channels_last: rng.below(2) == 0,
        }
    }

    /// Whether an output's window lies in the right padding alone (`ceil_mode`).
    fn has_padding_window(&self) -> bool {
        let [_, _, h, w] = self.shape;
        let (length, axes) = match self.kind {
            Kind::Avg1d | Kind::Max1d => (h * w, 1),
            _ => (0, 2),
        };
        (0..axes).any(|i| {
            let size = if axes == 1 { length } else { self.shape[2 + i] };
            let (k, s, p) = (self.kernel[i], self.stride[i], self.padding[i]);
            let out = burn::tensor::ops::conv::calculate_pool_output_size(
                k,
                s,
                p,
                1,
                size,
                self.ceil_mode,
            );
            self.ceil_mode && (out - 1) * s >= size + p
        })
    }

    /// The output and the input's gradient on `B`, for a fixed ramp, each output weighted
    /// by another.
    fn run<B: AutodiffBackend>(&self, device: &B::Device) -> (Vec<f32>, Vec<f32>) {
        let [n, c, h, w] = self.shape;
        let xv: Vec<f32> = (0..n * c * h * w)
            .map(|i| ((i * 7919) % 113) as f32 / 64.0 - 0.8)
            .collect();
        let x = Tensor::<B, 4>::from_data(TensorData::new(xv, self.shape), device).require_grad();
        let (k, s, p) = (self.kernel, self.stride, self.padding);
        let line = || x.clone().reshape([n, c, h * w]);
        let y: Tensor<B, 4> = match self.kind {
            Kind::Avg2d => {
                module::avg_pool2d(x.clone(), k, s, p, self.count_include_pad, self.ceil_mode)
            }
            Kind::Max2d => module::max_pool2d(x.clone(), k, s, p, [1, 1], self.ceil_mode),
            Kind::Adaptive2d => module::adaptive_avg_pool2d(x.clone(), k),
            Kind::Avg1d => module::avg_pool1d(
                line(),
                k[0],
                s[0],
                p[0],
                self.count_include_pad,
                self.ceil_mode,
            )
            .unsqueeze_dim(2),
            Kind::Max1d => {
                module::max_pool1d(line(), k[0], s[0], p[0], 1, self.ceil_mode).unsqueeze_dim(2)
            }
        };
        output_and_gradient(&x, y, self.channels_last, device)
    }
}

/// `y` (permuted to channels-last where asked) and `x`'s gradient of `sum(y ⊙ ramp)`, as
/// f32 values.
pub(crate) fn output_and_gradient<B: AutodiffBackend>(
    x: &Tensor<B, 4>,
    y: Tensor<B, 4>,
    channels_last: bool,
    device: &B::Device,
) -> (Vec<f32>, Vec<f32>) {
    let y = if channels_last {
        y.permute([0, 2, 3, 1])
    } else {
        y
    };
    let m = y.shape().num_elements();
    let wv: Vec<f32> = (0..m).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
    let weights = Tensor::<B, 4>::from_data(TensorData::new(wv, y.dims()), device);
    let grad = x
        .grad(&(y.clone() * weights).sum().backward())
        .expect("x's gradient");
    (values(y), values(grad))
}

/// `got` is `want` within 1e-5 (relative to `1 + |want|`), equal infinities equal.
fn agrees(got: &(Vec<f32>, Vec<f32>), want: &(Vec<f32>, Vec<f32>)) -> Option<String> {
    for (what, g, w) in [("output", &got.0, &want.0), ("gradient", &got.1, &want.1)] {
        if g.len() != w.len() {
            return Some(format!("{what}: {} values, Flex {}", g.len(), w.len()));
        }
        if let Some((i, a, b)) = g.iter().zip(w).enumerate().find_map(|(i, (a, b))| {
            let same = a == b || (a - b).abs() <= 1e-5 * (1.0 + b.abs());
            (!same).then_some((i, *a, *b))
        }) {
            return Some(format!("{what} {a} at {i}, Flex {b}"));
        }
    }
    None
}

/// 200 pools under `Amp` above autodiff on wgpu (and, for the average pools, below it),
/// against plain Flex: the same outputs and gradients. Plain wgpu is counted alongside: the
/// `avg_pool2d` defect of `workarounds.rs` and the padding windows above make it differ.
#[test]
fn random_pools_agree_with_flex_on_wgpu() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    let (compared, padding_windows, plain_differs) =
        random_pools_agree_with_flex::<Wgpu>(&device, 200, true);
    eprintln!(
        "{compared} pools compared, {padding_windows} with a window of padding alone; plain \
         Autodiff<Wgpu> differs from Flex on {plain_differs}"
    );
    assert!(compared >= 150, "only {compared} of 200 pools compared");
    assert!(
        padding_windows >= 5,
        "only {padding_windows} pools with a padding window"
    );
    // The defects showed (else this run proved nothing); a Burn without them fails here.
    assert!(
        plain_differs > 0,
        "plain wgpu agrees with Flex on every pool now"
    );
}

/// `draws` pools under `Amp` on `X` against Flex (panics with the first that differs):
/// how many were compared, how many had a window of padding alone, and (where `plain`) on
/// how many plain `Autodiff<X>` differs. The GPU check runs it on CUDA without `plain`
/// (plain Burn reads past a buffer there).
pub(crate) fn random_pools_agree_with_flex<X: Backend>(
    device: &X::Device,
    draws: usize,
    plain: bool,
) -> (usize, usize, usize) {
    let mut rng = Rng::new(41);
    let (mut compared, mut padding_windows, mut plain_differs) = (0, 0, 0);
    for draw in 0..draws {
        let pool = Pool::draw(&mut rng);
        let max = matches!(pool.kind, Kind::Max2d | Kind::Max1d);
        if max && pool.has_padding_window() {
            continue;
        }
        // A pool Burn refuses (a window wider than the padded input) is refused alike.
        let Ok(want) = std::panic::catch_unwind(|| pool.run::<Autodiff<Flex>>(&Default::default()))
        else {
            continue;
        };
        compared += 1;
        padding_windows += usize::from(pool.has_padding_window());
        let amp = {
            let _g = autocast(Precision::F32);
            pool.run::<Amp<Autodiff<X>>>(device)
        };
        if let Some(diff) = agrees(&amp, &want) {
            panic!("pool {draw} {pool:?} under Amp over autodiff: {diff}");
        }
        if matches!(pool.kind, Kind::Avg2d | Kind::Avg1d) {
            let below = {
                let _g = autocast(Precision::F32);
                pool.run::<Autodiff<Amp<X>>>(device)
            };
            if let Some(diff) = agrees(&below, &want) {
                panic!("pool {draw} {pool:?} under autodiff over Amp: {diff}");
            }
        }
        if plain {
            let plain = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.run::<Autodiff<X>>(device)
            }));
            if plain.map_or(true, |plain| agrees(&plain, &want).is_some()) {
                plain_differs += 1;
            }
        }
    }
    (compared, padding_windows, plain_differs)
}

/// Burn 0.21's `ceil_mode` padding window, measured: width 3, kernel 2, stride 2, padding 1
/// gives three outputs (PyTorch: two); without the padding counted the third is NaN on plain
/// wgpu, 0 under `Amp` and on Flex.
#[test]
fn ceil_mode_padding_windows_are_zero_not_nan() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    fn pooled<B: burn::tensor::backend::Backend>(device: &B::Device) -> Vec<f32> {
        let x = Tensor::<B, 4>::from_floats([[[[1.0, 2.0, 3.0]]]], device);
        values(module::avg_pool2d(x, [1, 2], [1, 2], [0, 1], false, true))
    }
    assert_eq!(pooled::<Flex>(&Default::default()), [1.0, 2.5, 0.0]);
    for precision in [Precision::F32, Precision::F16] {
        let _g = autocast(precision);
        assert_eq!(
            pooled::<Amp<Wgpu>>(&device),
            [1.0, 2.5, 0.0],
            "{precision:?}"
        );
    }
    let plain = pooled::<Wgpu>(&device);
    assert!(
        plain[2].is_nan(),
        "plain wgpu's padding window is {} now, not NaN: the defect is fixed",
        plain[2]
    );
}
