//! The scaler's and optimizers' device scalars are f32 whatever the device's default float
//! dtype. With f16 as the default, an initial scale of 65536 made that way is inf and every
//! step is skipped forever. One test in its own binary: the default is set once per device,
//! before any tensor is made there.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::scaler::GradScalerConfig;
use burn_amp::{Amp, Precision};
use burn_backend::set_default_float_dtype;

type B = Amp<Autodiff<Flex>>;

#[derive(Module, Debug)]
struct One<B: Backend> {
    w: Param<Tensor<B, 1>>,
}

#[test]
fn device_scalars_are_f32_under_an_f16_default() {
    let device = Default::default();
    set_default_float_dtype::<B>(&device, FloatDType::F16).unwrap();
    let model = One::<B> {
        w: Param::from_tensor(Tensor::ones([4], &device)),
    };
    assert_eq!(model.w.val().dtype(), DType::F16, "the default applies");
    let mut scaler = GradScalerConfig::new()
        .init::<B>(&device, Precision::F16)
        .unwrap();
    assert_eq!(scaler.scale_value(), 65536.0);
    let mut optim = FusedAdamWConfig::new()
        .with_weight_decay(0.0)
        .init::<B, One<B>>()
        .unwrap();
    let mut model = model;
    for step in 0..3 {
        // Small gradients: 65536 × a gradient of 1 would overflow the f16 parameters' grads.
        let loss = model.w.val().sum().mul_scalar(1e-3);
        let grads = GradientsParams::from_grads(scaler.scale(loss).backward(), &model);
        let (m, report) = scaler.step(&mut optim, 1e-2, model, grads).unwrap();
        model = m;
        assert!(!report.skipped(), "step {step} was skipped");
        scaler.update().unwrap();
    }
    let w = model
        .w
        .val()
        .cast(DType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    // Three AdamW steps of lr · g/|g| = 0.01 each on a gradient of ones.
    assert!(w.iter().all(|v| (v - 0.97).abs() < 2e-3), "{w:?}");
    assert_eq!(scaler.scale_value(), 65536.0);
}
