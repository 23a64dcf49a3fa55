//! Deformable convolution runs in f32.

use burn::tensor::{TensorData, module};
use burn_amp::{Amp, autocast};
use burn_backend::ops::DeformConvOptions;

use super::*;

/// A 1×1024 row of 0, 1, 0, 1, ... sampled by a 1×1 deformable convolution (weight 1) at four
/// positions with stride 300: base 0 with offset 600.25, base 300 + 0.25, base 600 + 0.25,
/// base 900 + 0.75. The bilinear samples are 0.25, 0.25, 0.25 and 0.75. In f16 an offset of
/// 600.25 (or a coordinate 600.25 formed in the kernel's element type) rounds to 600 and the
/// sample to 0; in bf16 already above 64. Tolerance: 1e-5 (computed in f32).
pub(crate) fn deform_conv_matches_f32<B: Backend>(device: &B::Device, precision: Precision) {
    let width = 1024;
    let row: Vec<f32> = (0..width).map(|i| (i % 2) as f32).collect();
    let x = Tensor::<B, 4>::from_data(TensorData::new(row, [1, 1, 1, width]), device);
    // Offsets [batch, 2 * kh * kw, out_h, out_w]: channel 0 is dy, channel 1 is dx.
    let offsets = vec![0.0f32, 0.0, 0.0, 0.0, 600.25, 0.25, 0.25, 0.75];
    let offset = Tensor::<B, 4>::from_data(TensorData::new(offsets, [1, 2, 1, 4]), device);
    let weight = Tensor::<B, 4>::ones([1, 1, 1, 1], device);
    let options = DeformConvOptions::new([1, 300], [0, 0], [1, 1], 1, 1);

    let reference = values(module::deform_conv2d(
        x.clone(),
        offset.clone(),
        weight.clone(),
        None,
        None,
        options.clone(),
    ));
    assert_eq!(
        reference,
        vec![0.25, 0.25, 0.25, 0.75],
        "the f32 reference itself"
    );

    // The image is an activation in the low dtype; offsets and weight are f32 (parameters or
    // an f32 computation).
    let xa = Tensor::<Amp<B>, 4>::from_data(x.to_data(), device).cast(low(precision));
    let offset = Tensor::<Amp<B>, 4>::from_data(offset.to_data(), device);
    let weight = Tensor::<Amp<B>, 4>::from_data(weight.to_data(), device);
    let out = {
        let _g = autocast(precision);
        module::deform_conv2d(xa, offset, weight, None, None, options)
    };
    let dtype = out.dtype();
    let got = values(out);
    assert!(
        dtype == DType::F32 && first_mismatch(&got, &reference, 1e-5, 0.0).is_none(),
        "deform_conv2d under {precision}: {dtype:?} {got:?}, f32 reference {reference:?}"
    );
}

flex_and_wgpu_tests!(deform_conv_matches_f32:
    deform_conv2d_runs_in_f32_flex_f16,
    deform_conv2d_runs_in_f32_flex_bf16,
    deform_conv2d_runs_in_f32_wgpu_f16
);
