//! A weight average of half-precision weights (`MemorySaving`: 8-bit moments, weights in
//! f16 or bf16 rounded stochastically) under an `AmpOptimizer` at f16 with an overflow: the
//! average is f32, follows an f64 reference of the weights of the steps taken, and passes
//! over the skipped one. Flex (f16, bf16) and wgpu (f16: the same ops fused); the average on
//! the device and in host memory.

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::ema::EmaPlacement;
use burn_amp::kernels::AmpKernels;
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::scaler::GradScalerConfig;
use burn_amp::{AmpOptimizer, EmaConfig, MemorySaving, ModelEma, Precision, autocast};
use burn_std::FloatDType;

use crate::common::models::{Mlp, params};
use crate::{common, serial};

fn batch<BK: Backend>(
    step: usize,
    poison: bool,
    device: &BK::Device,
) -> (Tensor<BK, 2>, Tensor<BK, 1, Int>) {
    let mut x: Vec<f32> = (0..16 * 32)
        .map(|i| ((i * 7 + step * 13) % 23) as f32 / 23.0 - 0.5)
        .collect();
    if poison {
        x[5] = f32::NAN;
    }
    let y: Vec<i64> = (0..16).map(|i| ((i + step) % 4) as i64).collect();
    (
        Tensor::from_data(TensorData::new(x, [16, 32]), device),
        Tensor::from_data(TensorData::new(y, [16]), device),
    )
}

fn check<BK>(device: &BK::Device, weights: FloatDType, placement: EmaPlacement)
where
    BK: AutodiffBackend,
    BK::InnerBackend: AmpKernels,
{
    let _g = autocast(Precision::F16);
    BK::seed(device, 3);
    let preset = MemorySaving::new()
        .with_weights(weights)
        .with_optimizer(FusedAdamWConfig::memory_saving());
    let mut model = preset.prepare(Mlp::<BK>::new(32, 64, 4, device));
    let inner = preset.optimizer::<BK, Mlp<BK>>().unwrap();
    let mut optim = AmpOptimizer::new(inner, GradScalerConfig::new()).unwrap();
    let decay = 0.6;
    let config = EmaConfig::new().with_decay(decay).with_placement(placement);
    let mut ema = ModelEma::<BK, _>::new(&model, config).unwrap();
    assert_eq!(
        ema.module().l1.weight.val().dtype(),
        burn::tensor::DType::F32
    );
    let mut taken = vec![params(&model)];
    for step in 0..6 {
        let (x, y) = batch::<BK>(step, step == 3, device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = optim.step(1e-2, model, grads);
        ema.update_after(&model, &optim).unwrap();
        if step != 3 {
            taken.push(params(&model));
        }
    }
    assert_eq!(
        ema.updates(),
        5,
        "{weights:?}, {placement:?}: the skipped step was averaged"
    );
    let want = common::ema_reference(&taken, decay, false);
    let err = common::largest_error(&params(&ema.module()), &want);
    assert!(err < 1e-6, "{weights:?}, {placement:?}: off by {err}");
}

#[test]
fn the_average_of_half_weights_is_f32_and_skips_the_overflow_flex() {
    let _s = serial();
    for weights in [FloatDType::F16, FloatDType::BF16] {
        for placement in [EmaPlacement::Device, EmaPlacement::Host] {
            common::big_stack(move || {
                check::<burn_amp::Amp<Autodiff<Flex>>>(&Default::default(), weights, placement)
            });
        }
    }
}

#[test]
fn the_average_of_half_weights_is_f32_and_skips_the_overflow_wgpu() {
    let _s = serial();
    if let Some(device) = common::wgpu_device() {
        for placement in [EmaPlacement::Device, EmaPlacement::Host] {
            let device = device.clone();
            common::big_stack(move || {
                check::<burn_amp::Amp<Autodiff<Wgpu>>>(&device, FloatDType::F16, placement)
            });
        }
    }
}
