//! `interpolate` backpropagated under `Amp`: burn-cubecl 0.21 has no backward for bilinear,
//! bicubic or lanczos3, nor Flex for lanczos3 (panics), which `Amp` builds from the forward's
//! own weights (`src/backend/workarounds/interpolate.rs`). Values and gradients on wgpu
//! against Flex's (plain autodiff's where it has the backward), the adjoint identity
//! `⟨L x, w⟩ = ⟨x, Lᵀ w⟩` on both, and canaries that plain autodiff still panics.

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::TensorData;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::module::interpolate;
use burn::tensor::ops::{InterpolateMode, InterpolateOptions};
use burn_amp::{Amp, autocast};

use super::*;

const MODES: [InterpolateMode; 4] = [
    InterpolateMode::Nearest,
    InterpolateMode::Bilinear,
    InterpolateMode::Bicubic,
    InterpolateMode::Lanczos3,
];
const INPUT: [usize; 4] = [2, 3, 5, 7];
/// Up along one axis and down along the other, the same size, up along both.
const OUTPUTS: [[usize; 2]; 3] = [[9, 4], [5, 7], [11, 13]];

fn values(shape: [usize; 4], seed: usize) -> TensorData {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i * 7 + seed * 3) % 17) as f32 - 8.0) * 0.125)
        .collect();
    TensorData::new(v, shape)
}

/// `sum(interpolate(x) ⊙ w)`: the output, `x`'s gradient, and the loss, as f32.
fn run<B: AutodiffBackend>(
    options: &InterpolateOptions,
    out: [usize; 2],
    device: &B::Device,
) -> (Vec<f32>, Vec<f32>, f64) {
    let x = Tensor::<B, 4>::from_data(values(INPUT, 1), device).require_grad();
    let y = interpolate(x.clone(), out, options.clone());
    let w = Tensor::<B, 4>::from_data(values(y.dims(), 2), device);
    let loss = (y.clone() * w).sum();
    let grads = loss.backward();
    let f32s = |t: Tensor<B::InnerBackend, 4>| {
        t.cast(DType::F32)
            .into_data()
            .to_vec::<f32>()
            .expect("f32 values")
    };
    let loss_value = f32s(loss.inner().reshape([1, 1, 1, 1]))[0] as f64;
    (
        f32s(y.inner()),
        f32s(x.grad(&grads).expect("a gradient")),
        loss_value,
    )
}

#[test]
fn interpolation_backpropagates_on_wgpu_as_on_flex() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    backpropagates_as_on_flex::<Wgpu>(&device, "wgpu", 1e-5);
}

/// Every mode, both `align_corners`, three sizes, under `Amp<Autodiff<X>>` and
/// `Autodiff<Amp<X>>` at F32 and F16:
/// the output and gradient within `tolerance` of Flex's (relative L2), the adjoint identity
/// on both (Flex's within 1e-5). The GPU check runs it on CUDA, whose f32 matmuls (the
/// backward's) may run in TF32 (cubek-matmul's accelerated kernels, picked by autotune).
pub(crate) fn backpropagates_as_on_flex<X: Backend>(
    device: &X::Device,
    backend: &str,
    tolerance: f32,
) {
    let x_values = values(INPUT, 1).to_vec::<f32>().unwrap();
    for mode in MODES {
        for align_corners in [true, false] {
            let options = InterpolateOptions::new(mode.clone()).with_align_corners(align_corners);
            for out in OUTPUTS {
                let what = format!("{mode:?}, align_corners {align_corners}, to {out:?}");
                // The gradient is the transposed map applied to `w`: ⟨x, Lᵀ w⟩ = ⟨L x, w⟩.
                let adjoint = |grad: &[f32], loss: f64, on: &str, tolerance: f64| {
                    let dot: f64 = x_values
                        .iter()
                        .zip(grad)
                        .map(|(&x, &g)| x as f64 * g as f64)
                        .sum();
                    assert!(
                        (dot - loss).abs() <= tolerance * loss.abs().max(1.0),
                        "{what}, {on}: ⟨x, grad⟩ {dot} against the loss {loss}"
                    );
                };
                // Flex's own backward where it has one; lanczos3's is `Amp`'s there too.
                let flex = Default::default();
                let (want_y, want_grad, loss) = match mode {
                    InterpolateMode::Lanczos3 => run::<Amp<Autodiff<Flex>>>(&options, out, &flex),
                    _ => run::<Autodiff<Flex>>(&options, out, &flex),
                };
                adjoint(&want_grad, loss, "Flex", 1e-5);
                for precision in [Precision::F32, Precision::F16] {
                    let _g = autocast(precision);
                    let above = run::<Amp<Autodiff<X>>>(&options, out, device);
                    let below = run::<Autodiff<Amp<X>>>(&options, out, device);
                    for (stack, (y, grad, loss)) in [("above", above), ("below", below)] {
                        let err = rel_l2(&y, &want_y);
                        assert!(
                            err <= tolerance,
                            "{what}, {precision:?}, {stack} autodiff: output on {backend} \
                             {err:.1e} from Flex's"
                        );
                        let err = rel_l2(&grad, &want_grad);
                        assert!(
                            err <= tolerance,
                            "{what}, {precision:?}, {stack} autodiff: gradient on {backend} \
                             {err:.1e} from Flex's"
                        );
                        adjoint(&grad, loss, backend, tolerance as f64);
                    }
                }
            }
        }
    }
}

/// Burn 0.21's defects, which `Amp` works around: fixed in a later Burn, this fails. (On wgpu
/// without fusion, so that the panic comes at the call and leaves the device's stream alone.)
#[test]
fn plain_autodiff_has_no_bilinear_backward_on_cubecl_nor_lanczos3_on_flex() {
    type Unfused =
        burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
    let lanczos3 = InterpolateOptions::new(InterpolateMode::Lanczos3);
    let plain =
        std::panic::catch_unwind(|| run::<Autodiff<Flex>>(&lanczos3, [9, 4], &Default::default()));
    assert!(
        plain.is_err(),
        "plain autodiff backpropagates a lanczos3 interpolation on Flex now: the defect is fixed"
    );
    let Some(device) = common::wgpu_device() else {
        return;
    };
    let bilinear = InterpolateOptions::new(InterpolateMode::Bilinear);
    let plain = std::panic::catch_unwind(|| run::<Autodiff<Unfused>>(&bilinear, [9, 4], &device));
    assert!(
        plain.is_err(),
        "plain autodiff backpropagates a bilinear interpolation on wgpu now: the defect is fixed"
    );
}
