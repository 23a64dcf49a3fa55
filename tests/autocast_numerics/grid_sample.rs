//! `grid_sample_2d` under `Amp`, every mode PyTorch has (nearest, bilinear, bicubic) × every
//! padding × both `align_corners`, forward and backward, against an f64 reference written
//! from PyTorch's `GridSampler.h` (below): the output, the input's gradient (the map is
//! linear in the input: its transpose applied to the output's weights), and the grid's
//! gradient (central differences of the reference). Burn 0.21 panics on nearest and bicubic
//! under autodiff and on wgpu and CUDA (`src/backend/workarounds/grid_sample.rs`); bilinear is
//! Burn's own, checked here too. Ties of nearest round to even, as PyTorch's `nearbyint`.

use burn::backend::{Autodiff, Flex};
use burn::tensor::TensorData;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{GridSampleOptions, GridSamplePaddingMode, InterpolateMode};
use burn_amp::{Amp, autocast};

use super::*;

const INPUT: [usize; 4] = [2, 3, 5, 7];
const GRID: [usize; 4] = [2, 4, 6, 2];
const MODES: [InterpolateMode; 3] = [
    InterpolateMode::Nearest,
    InterpolateMode::Bilinear,
    InterpolateMode::Bicubic,
];
const PADDINGS: [GridSamplePaddingMode; 3] = [
    GridSamplePaddingMode::Zeros,
    GridSamplePaddingMode::Border,
    GridSamplePaddingMode::Reflection,
];

/// PyTorch's grid sampler in f64, one `[n, c, h, w]` input, one `[n, h_out, w_out, 2]` grid.
struct Reference<'a> {
    input: &'a [f64],
    shape: [usize; 4],
    options: &'a GridSampleOptions,
}

impl Reference<'_> {
    fn unnormalize(&self, g: f64, size: usize) -> f64 {
        let size = size as f64;
        match self.options.align_corners {
            true => (g + 1.0) / 2.0 * (size - 1.0),
            false => ((g + 1.0) * size - 1.0) / 2.0,
        }
    }

    fn reflect(x: f64, twice_low: f64, twice_high: f64) -> f64 {
        if twice_low == twice_high {
            return 0.0;
        }
        let (low, span) = (twice_low / 2.0, (twice_high - twice_low) / 2.0);
        let x = (x - low).abs();
        let (extra, flips) = (x % span, (x / span).floor());
        match flips as i64 % 2 {
            0 => extra + low,
            _ => span - extra + low,
        }
    }

    /// `compute_coordinates`: the padding.
    fn padded(&self, x: f64, size: usize) -> f64 {
        let clip = |x: f64| x.max(0.0).min(size as f64 - 1.0);
        let s = size as f64;
        match self.options.padding_mode {
            GridSamplePaddingMode::Zeros => x,
            GridSamplePaddingMode::Border => clip(x),
            GridSamplePaddingMode::Reflection => clip(match self.options.align_corners {
                true => Self::reflect(x, 0.0, 2.0 * (s - 1.0)),
                false => Self::reflect(x, -1.0, 2.0 * s - 1.0),
            }),
        }
    }

    /// The taps of one output pixel: (flat input index within the plane, weight).
    fn taps(&self, gx: f64, gy: f64) -> Vec<(usize, f64)> {
        let [_, _, h, w] = self.shape;
        let on = |x: i64, y: i64| x >= 0 && y >= 0 && x < w as i64 && y < h as i64;
        let mut taps = Vec::new();
        let mut push = |x: i64, y: i64, weight: f64| {
            if on(x, y) {
                taps.push((y as usize * w + x as usize, weight));
            }
        };
        match self.options.mode {
            InterpolateMode::Nearest => {
                let x = self.padded(self.unnormalize(gx, w), w).round_ties_even();
                let y = self.padded(self.unnormalize(gy, h), h).round_ties_even();
                push(x as i64, y as i64, 1.0);
            }
            InterpolateMode::Bilinear => {
                let x = self.padded(self.unnormalize(gx, w), w);
                let y = self.padded(self.unnormalize(gy, h), h);
                let (x0, y0) = (x.floor(), y.floor());
                let (tx, ty) = (x - x0, y - y0);
                let (x0, y0) = (x0 as i64, y0 as i64);
                push(x0, y0, (1.0 - tx) * (1.0 - ty));
                push(x0 + 1, y0, tx * (1.0 - ty));
                push(x0, y0 + 1, (1.0 - tx) * ty);
                push(x0 + 1, y0 + 1, tx * ty);
            }
            _ => {
                let (x, y) = (self.unnormalize(gx, w), self.unnormalize(gy, h));
                let (x0, y0) = (x.floor(), y.floor());
                let (cx, cy) = (cubic(x - x0), cubic(y - y0));
                for (j, cy) in cy.iter().enumerate() {
                    for (i, cx) in cx.iter().enumerate() {
                        let xi = self.padded(x0 - 1.0 + i as f64, w) as i64;
                        let yj = self.padded(y0 - 1.0 + j as f64, h) as i64;
                        push(xi, yj, cx * cy);
                    }
                }
            }
        }
        taps
    }

    /// The output, `[n, c, h_out, w_out]`, and `∂⟨out, weights⟩/∂input`.
    fn run(&self, grid: &[f64], grid_shape: [usize; 4], weights: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let [n, c, h, w] = self.shape;
        let p = grid_shape[1] * grid_shape[2];
        let mut out = vec![0.0; n * c * p];
        let mut grad = vec![0.0; self.input.len()];
        for b in 0..n {
            for q in 0..p {
                let at = (b * p + q) * 2;
                for (index, weight) in self.taps(grid[at], grid[at + 1]) {
                    for ch in 0..c {
                        let plane = (b * c + ch) * h * w;
                        let o = (b * c + ch) * p + q;
                        out[o] += weight * self.input[plane + index];
                        grad[plane + index] += weight * weights[o];
                    }
                }
            }
        }
        (out, grad)
    }
}

/// PyTorch's `get_cubic_upsample_coefficients` (A = -0.75).
fn cubic(t: f64) -> [f64; 4] {
    let a = -0.75;
    let near = |x: f64| ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
    let far = |x: f64| ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a;
    [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)]
}

/// Grid coordinates whose pixel positions lie at fractions 0.1..0.4 or 0.6..0.9 past a
/// whole number from 3 pixels before the image to 3 after it: off every kink of the sampler
/// (pixel centres, half-pixels where reflection folds and nearest rounds), so that
/// differences of the reference are its derivative.
fn grid_values(options: &GridSampleOptions, seed: u64) -> Vec<f32> {
    let mut draw = uniform(seed);
    let [n, h_out, w_out, _] = GRID;
    let mut grid = Vec::with_capacity(n * h_out * w_out * 2);
    for _ in 0..n * h_out * w_out {
        for size in [INPUT[3], INPUT[2]] {
            let whole = (draw() * (size as f32 + 6.0)).floor() - 3.0;
            let fraction = 0.1 + 0.3 * draw() + if draw() < 0.5 { 0.0 } else { 0.5 };
            let x = (whole + fraction) as f64;
            let s = size as f64;
            let g = match options.align_corners {
                true => x * 2.0 / (s - 1.0) - 1.0,
                false => (2.0 * x + 1.0) / s - 1.0,
            };
            grid.push(g as f32);
        }
    }
    grid
}

fn input_values(seed: u64) -> Vec<f32> {
    let mut draw = uniform(seed);
    (0..INPUT.iter().product::<usize>())
        .map(|_| draw() * 2.0 - 1.0)
        .collect()
}

/// `sum(grid_sample(x, grid) ⊙ w)` on `B`: the output, and the gradients of `x` and `grid`.
fn run<B: AutodiffBackend>(
    x: &[f32],
    grid: &[f32],
    w: &[f32],
    options: &GridSampleOptions,
    device: &B::Device,
) -> [Vec<f32>; 3] {
    let x = Tensor::<B, 4>::from_data(TensorData::new(x.to_vec(), INPUT), device).require_grad();
    let grid =
        Tensor::<B, 4>::from_data(TensorData::new(grid.to_vec(), GRID), device).require_grad();
    let y = x.clone().grid_sample_2d(grid.clone(), options.clone());
    let w = Tensor::<B, 4>::from_data(TensorData::new(w.to_vec(), y.dims()), device);
    let grads = (y.clone() * w).sum().backward();
    let grad = |t: Tensor<B, 4>| values(t.grad(&grads).expect("a gradient"));
    [values(y.inner()), grad(x), grad(grid)]
}

/// Every mode × padding × `align_corners` under `Amp<Autodiff<X>>` at `precision`: output
/// and input gradient within `tolerance` of the reference (relative L2; in f32 whatever the
/// precision, as the policy samples there), the grid's gradient within `10 × tolerance` of
/// its central differences (step 1e-6 in f64: truncation ~1e-12).
pub(crate) fn samples_as_pytorch<X: Backend>(
    device: &X::Device,
    precision: Precision,
    backend: &str,
    tolerance: f32,
) {
    let x = input_values(1);
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let out_len = INPUT[0] * INPUT[1] * GRID[1] * GRID[2];
    let w: Vec<f32> = input_values(2).into_iter().take(out_len).collect();
    let w64: Vec<f64> = w.iter().map(|&v| v as f64).collect();
    for mode in MODES {
        for padding_mode in PADDINGS {
            for align_corners in [false, true] {
                let options = GridSampleOptions {
                    mode: mode.clone(),
                    padding_mode,
                    align_corners,
                };
                let what = format!("{mode:?}, {padding_mode:?}, align_corners {align_corners}");
                let grid = grid_values(&options, 3 + align_corners as u64);
                let grid64: Vec<f64> = grid.iter().map(|&v| v as f64).collect();
                let reference = Reference {
                    input: &x64,
                    shape: INPUT,
                    options: &options,
                };
                let (want_y, want_dx) = reference.run(&grid64, GRID, &w64);
                let loss = |grid: &[f64]| -> f64 {
                    let (y, _) = reference.run(grid, GRID, &w64);
                    y.iter().zip(&w64).map(|(y, w)| y * w).sum()
                };
                let step = 1e-6;
                let want_dgrid: Vec<f64> = (0..grid64.len())
                    .map(|i| {
                        let mut moved = grid64.clone();
                        moved[i] += step;
                        let up = loss(&moved);
                        moved[i] -= 2.0 * step;
                        (up - loss(&moved)) / (2.0 * step)
                    })
                    .collect();
                let f32s = |v: &[f64]| v.iter().map(|&v| v as f32).collect::<Vec<_>>();
                let _g = autocast(precision);
                let [y, dx, dgrid] = run::<Amp<Autodiff<X>>>(&x, &grid, &w, &options, device);
                let err = rel_l2(&y, &f32s(&want_y));
                assert!(
                    err <= tolerance,
                    "{what}: output on {backend} {err:.1e} off"
                );
                let err = rel_l2(&dx, &f32s(&want_dx));
                assert!(
                    err <= tolerance,
                    "{what}: input gradient on {backend} {err:.1e} off"
                );
                if matches!(mode, InterpolateMode::Nearest) {
                    // Piecewise constant: a zero gradient, PyTorch's.
                    assert!(
                        dgrid.iter().all(|&g| g == 0.0),
                        "{what}: grid gradient on {backend} not zero"
                    );
                } else {
                    let err = rel_l2(&dgrid, &f32s(&want_dgrid));
                    assert!(
                        err <= 10.0 * tolerance,
                        "{what}: grid gradient on {backend} {err:.1e} off"
                    );
                }
            }
        }
    }
}

/// 2× downsampling by nearest neighbour (the grid of `affine_grid` for an identity at half
/// the size, `align_corners = false`): every sample sits on a tie between two pixels, and
/// PyTorch's `nearbyint` takes the even one: pixels 0, 2, 4, 6 of 8.
fn downsampled_by_nearest<B: Backend>(device: &B::Device) -> Vec<f32> {
    let x = Tensor::<B, 4>::from_data(
        TensorData::new((0..8).map(|v| v as f32).collect(), [1, 1, 1, 8]),
        device,
    );
    let xs = [-0.75f32, -0.25, 0.25, 0.75];
    let grid: Vec<f32> = xs.iter().flat_map(|&g| [g, 0.0]).collect();
    let grid = Tensor::<B, 4>::from_data(TensorData::new(grid, [1, 1, 4, 2]), device);
    let options = GridSampleOptions {
        mode: InterpolateMode::Nearest,
        padding_mode: GridSamplePaddingMode::Zeros,
        align_corners: false,
    };
    values(x.grid_sample_2d(grid, options))
}

fn check<X: Backend>(device: &X::Device, precision: Precision) {
    samples_as_pytorch::<X>(device, precision, core::any::type_name::<X>(), 1e-5);
    let _g = autocast(precision);
    assert_eq!(
        downsampled_by_nearest::<Amp<X>>(device),
        [0.0, 2.0, 4.0, 6.0],
        "ties to even"
    );
}

flex_and_wgpu_tests!(check: grid_sample_flex_f16, grid_sample_flex_bf16, grid_sample_wgpu_f16);

/// Burn 0.21's defects, which `Amp` works around: fixed in a later Burn, this fails. Under
/// autodiff nearest and bicubic panic (the reference composition is bilinear only), Flex has
/// no bicubic, and Flex's nearest rounds ties away from zero (pixels 1, 3, 5, 7 where
/// PyTorch takes 0, 2, 4, 6). wgpu's kernels have neither mode (a panic before any launch;
/// on wgpu without fusion, so that it comes at the call and leaves the device's stream alone).
#[test]
fn plain_burn_has_no_nearest_or_bicubic_grid_sample_under_autodiff() {
    let device = Default::default();
    let (x, grid) = (
        input_values(1),
        grid_values(&GridSampleOptions::default(), 3),
    );
    let w: Vec<f32> = input_values(2)
        .into_iter()
        .take(INPUT[0] * INPUT[1] * GRID[1] * GRID[2])
        .collect();
    for mode in [InterpolateMode::Nearest, InterpolateMode::Bicubic] {
        let options = GridSampleOptions {
            mode: mode.clone(),
            ..Default::default()
        };
        let plain =
            std::panic::catch_unwind(|| run::<Autodiff<Flex>>(&x, &grid, &w, &options, &device));
        assert!(
            plain.is_err(),
            "plain autodiff samples a grid in {mode:?} mode now: the defect is fixed"
        );
    }
    let bicubic = GridSampleOptions {
        mode: InterpolateMode::Bicubic,
        ..Default::default()
    };
    let plain = std::panic::catch_unwind(|| {
        let x = Tensor::<Flex, 4>::from_data(TensorData::new(x.clone(), INPUT), &device);
        let grid = Tensor::<Flex, 4>::from_data(TensorData::new(grid.clone(), GRID), &device);
        x.grid_sample_2d(grid, bicubic)
    });
    assert!(
        plain.is_err(),
        "Flex samples a grid bicubically now: the defect is fixed"
    );
    assert_eq!(
        downsampled_by_nearest::<Flex>(&device),
        [1.0, 3.0, 5.0, 7.0],
        "Flex's nearest rounds ties to even now (PyTorch's): the workaround can go"
    );
    type Unfused =
        burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
    if let Some(device) = common::wgpu_device() {
        let plain = std::panic::catch_unwind(|| downsampled_by_nearest::<Unfused>(&device));
        assert!(
            plain.is_err(),
            "wgpu samples a grid by nearest neighbour now: the defect is fixed"
        );
    }
}
