//! Deformable convolution runs in f32, and its gradients are right on every backend.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
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

/// The output and every gradient (`x`, offset, weight, then the mask's and the bias's where
/// present) of `sum(deform_conv2d(..) * r)` on `B`, in f32, on fixed values: offsets in
/// ±1.7, so that taps cross pixel boundaries and the image's edge.
fn deform_conv_gradients<B: AutodiffBackend>(
    device: &B::Device,
    options: &DeformConvOptions<2>,
    mask: bool,
    bias: bool,
) -> Vec<Vec<f32>> {
    let _f32 = autocast(Precision::F32);
    let (channels, out_channels, [h, w]) = (4, 6, [7, 6]);
    let mut u = uniform(3);
    let mut t = |shape: [usize; 4], lo: f32, hi: f32| {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| on_grid(lo + (hi - lo) * u())).collect();
        Tensor::<B, 4>::from_data(TensorData::new(v, shape), device).require_grad()
    };
    let out = |size: usize, d: usize| {
        (size + 2 * options.padding[d] - options.dilation[d] * 2 - 1) / options.stride[d] + 1
    };
    let (oh, ow, groups) = (out(h, 0), out(w, 1), options.offset_groups);
    let x = t([2, channels, h, w], -1.0, 1.0);
    let offset = t([2, groups * 18, oh, ow], -1.7, 1.7);
    let weight = t(
        [out_channels, channels / options.weight_groups, 3, 3],
        -0.5,
        0.5,
    );
    let m = t([2, groups * 9, oh, ow], 0.2, 1.0);
    let r = t([2, out_channels, oh, ow], -1.0, 1.0).detach();
    let b = Tensor::<B, 1>::from_data(
        TensorData::new(vec![0.5f32; out_channels], [out_channels]),
        device,
    )
    .require_grad();
    let y = module::deform_conv2d(
        x.clone(),
        offset.clone(),
        weight.clone(),
        mask.then(|| m.clone()),
        bias.then(|| b.clone()),
        options.clone(),
    );
    let grads = (y.clone() * r).sum().backward();
    let mut got = vec![values(y)];
    got.extend(
        [x.grad(&grads), offset.grad(&grads), weight.grad(&grads)].map(|g| values(g.unwrap())),
    );
    got.extend(mask.then(|| values(m.grad(&grads).unwrap())));
    got.extend(bias.then(|| values(b.grad(&grads).unwrap())));
    got
}

/// burn-cubecl 0.21's deformable convolution gets the offset and mask gradients wrong for any
/// kernel larger than 1×1 (each tap reads tap (0, 0)'s column): under `Amp` (above and below
/// autodiff) they are Flex's, within `tolerance` (relative L2; 1e-5, f32 rounding, where
/// matmuls are f32), with a plain, then a strided, padded, dilated and grouped (weights and
/// offsets) 3×3 convolution, with and without mask and bias. Flex's are held to central
/// differences in `gradient_check`. Returns plain Burn's offset gradient's largest relative
/// L2 error against Flex's on `X`.
pub(crate) fn deform_conv_gradients_match_flex<X: Backend>(
    device: &X::Device,
    tolerance: f32,
) -> f32 {
    let plain_options = DeformConvOptions::new([1, 1], [0, 0], [1, 1], 1, 1);
    let grouped = DeformConvOptions::new([2, 1], [1, 2], [1, 2], 2, 2);
    let mut failures = Vec::new();
    let mut plain_worst = 0f32;
    for options in [plain_options, grouped] {
        for (mask, bias) in [(false, false), (true, false), (false, true), (true, true)] {
            let flex =
                deform_conv_gradients::<Autodiff<Flex>>(&Default::default(), &options, mask, bias);
            let plain = deform_conv_gradients::<Autodiff<X>>(device, &options, mask, bias);
            plain_worst = plain_worst.max(rel_l2(&plain[2], &flex[2]));
            let stacks = [
                (
                    "Amp<Autodiff<_>>",
                    deform_conv_gradients::<Amp<Autodiff<X>>>(device, &options, mask, bias),
                ),
                (
                    "Autodiff<Amp<_>>",
                    deform_conv_gradients::<Autodiff<Amp<X>>>(device, &options, mask, bias),
                ),
            ];
            for (stack, got) in stacks {
                let names = ["output", "x", "offset", "weight"]
                    .into_iter()
                    .chain(mask.then_some("mask"))
                    .chain(bias.then_some("bias"));
                for ((name, g), f) in names.zip(&got).zip(&flex) {
                    let err = rel_l2(g, f);
                    if !within(err, tolerance) {
                        failures.push(format!("{stack} {options:?} mask {mask} bias {bias}: {name} {err:.2e} from Flex's"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    plain_worst
}

#[test]
fn deform_conv2d_gradients_match_flex_wgpu() {
    if let Some(device) = common::wgpu_device() {
        let plain = deform_conv_gradients_match_flex::<burn::backend::Wgpu>(&device, 1e-5);
        // The canary: when Burn's kernel is fixed, `Amp`'s composition can go.
        assert!(
            plain > 0.5,
            "plain Burn's offset gradient is {plain:.2e} from Flex's on wgpu: fixed upstream?"
        );
    }
}
