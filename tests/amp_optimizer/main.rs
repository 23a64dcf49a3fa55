//! `AmpOptimizer` in a hand-written loop: `loss.backward()` and `optim.step(..)` as a plain
//! Burn loop writes them. At f16 the gradients reach the wrapped optimizer unscaled; chosen
//! overflowing steps are skipped bit for bit while the scale backs off (also once per
//! accumulation window); no host read with a fused optimizer; bf16/f32 pass through; misuse is
//! a typed error; the record resumes the scale.
//!
//! The installation is process-wide (one per backend type, like PyTorch's autocast state),
//! so the tests of this binary take turns ([`serial`]).

#[path = "../common/mod.rs"]
mod common;
mod ema;
mod ema_optimizer;
mod from_burn;
mod maximize;
mod param_groups;
mod random_schedules;
mod shared_accumulation;
mod shared_random;
mod shared_scaler;

use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, GradientsParams, MultiGradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, FloatDType};
use burn_amp::amp_optimizer::ScalerSnapshot;
use burn_amp::grads::GradList;
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::scaler::{GradScalerConfig, Unfused};
use burn_amp::{
    Amp, AmpOptimizer, AmpOptimizerError, GradientAccumulation, Precision, autocast, host_reads,
};
use common::models::{Mlp, params};

type B = Amp<Autodiff<Flex>>;
type Inner = <B as AutodiffBackend>::InnerBackend;

const D_IN: usize = 8;
const CLASSES: usize = 4;

static SERIAL: Mutex<()> = Mutex::new(());

/// One test at a time: an `AmpOptimizer` installs itself for the whole process.
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn model(device: &burn::tensor::Device<B>) -> Mlp<B> {
    B::seed(device, 3);
    Mlp::new(D_IN, 16, CLASSES, device)
}

/// A fixed batch per step; `poison` puts a NaN into it.
fn batch(
    step: usize,
    poison: bool,
    device: &burn::tensor::Device<B>,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let rows = 16;
    let mut x: Vec<f32> = (0..rows * D_IN)
        .map(|i| ((i * 7 + step * 13) % 23) as f32 / 23.0 - 0.5)
        .collect();
    if poison {
        x[5] = f32::NAN;
    }
    let y: Vec<i64> = (0..rows).map(|i| ((i + step) % CLASSES) as i64).collect();
    (
        Tensor::from_data(TensorData::new(x, [rows, D_IN]), device),
        Tensor::from_data(TensorData::new(y, [rows]), device),
    )
}

/// The plain Burn loop: nothing in it knows about loss scaling.
fn step<O: Optimizer<Mlp<B>, B>>(
    model: Mlp<B>,
    optim: &mut O,
    step: usize,
    poison: bool,
) -> Mlp<B> {
    let device = model.l1.weight.device();
    let (x, y) = batch(step, poison, &device);
    let loss = model.loss(x, y);
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    optim.step(1e-2, model, grads)
}

/// Records the gradients it is handed (as f32), then steps the optimizer it wraps.
#[derive(Clone)]
struct Recorder<O> {
    inner: O,
    seen: Arc<Mutex<Vec<Vec<f32>>>>,
}

impl<O: Optimizer<Mlp<B>, B>> Optimizer<Mlp<B>, B> for Recorder<O> {
    type Record = O::Record;

    fn step(&mut self, lr: f64, module: Mlp<B>, grads: GradientsParams) -> Mlp<B> {
        let list = GradList::<Inner>::peek::<B, Mlp<B>>(&module, &grads);
        let all = list
            .tensors()
            .into_iter()
            .flat_map(|g| {
                Tensor::<Inner, 1>::from_primitive(TensorPrimitive::Float(g))
                    .cast(DType::F32)
                    .into_data()
                    .to_vec::<f32>()
                    .unwrap()
            })
            .collect();
        self.seen.lock().unwrap().push(all);
        self.inner.step(lr, module, grads)
    }

    fn step_multi(&mut self, lr: f64, module: Mlp<B>, grads: MultiGradientsParams) -> Mlp<B> {
        self.inner.step_multi(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        self.inner = self.inner.load_record(record);
        self
    }
}

/// The gradients the optimizer saw in one step, and the loss scale the wrapper reported.
fn recorded_grads(precision: Precision, wrap: bool) -> (Vec<f32>, f32) {
    let _g = autocast(precision);
    let device = Default::default();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorder = Unfused(Recorder {
        inner: SgdConfig::new().init::<B, Mlp<B>>(),
        seen: seen.clone(),
    });
    let m = model(&device);
    let scale = if wrap {
        let mut optim = AmpOptimizer::new(recorder, GradScalerConfig::new()).unwrap();
        step(m, &mut optim, 0, false);
        optim.monitor().snapshot().scale
    } else {
        let mut optim = recorder;
        step(m, &mut optim, 0, false);
        1.0
    };
    let grads = seen.lock().unwrap().pop().expect("one step");
    (grads, scale)
}

#[test]
fn f16_gradients_reach_the_optimizer_unscaled() {
    let _s = serial();
    let (reference, _) = recorded_grads(Precision::F32, false);
    let (wrapped, scale_used) = recorded_grads(Precision::F16, true);
    assert_eq!(scale_used, 65536.0, "the f16 backward was not scaled");
    assert_eq!(reference.len(), wrapped.len());
    // f16 matmuls against f32: relative to the largest gradient, as for any f16 result.
    let scale = reference.iter().fold(0f32, |m, g| m.max(g.abs()));
    let err = reference
        .iter()
        .zip(&wrapped)
        .fold(0f32, |m, (r, w)| m.max((r - w).abs()));
    assert!(
        err < 1e-2 * scale,
        "f16 grads off the f32 ones by {err} (largest {scale}): not unscaled?"
    );
    // At f32 the wrapper passes the very same gradients through.
    let (passed, scale_used) = recorded_grads(Precision::F32, true);
    assert_eq!(
        passed, reference,
        "f32 through the wrapper must be unchanged"
    );
    assert_eq!(scale_used, 1.0);
}

fn weights_bits(model: &Mlp<B>) -> Vec<u32> {
    params(model).into_iter().map(f32::to_bits).collect()
}

#[test]
fn overflowing_steps_are_skipped_and_the_scale_backs_off() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let device = Default::default();
    let adam = AdamConfig::new().init::<B, Mlp<B>>();
    let mut optim = AmpOptimizer::new(adam, GradScalerConfig::new()).unwrap();
    let monitor = optim.monitor();
    let poisoned = [2, 5];
    let mut m = model(&device);
    let mut scales = Vec::new();
    for i in 0..8 {
        let before = weights_bits(&m);
        m = step(m, &mut optim, i, poisoned.contains(&i));
        let moved = weights_bits(&m) != before;
        assert_eq!(moved, !poisoned.contains(&i), "step {i}: moved = {moved}");
        scales.push(optim.scale());
    }
    let s = 65536.0;
    assert_eq!(
        scales,
        [s, s, s / 2.0, s / 2.0, s / 2.0, s / 4.0, s / 4.0, s / 4.0]
    );
    assert_eq!(
        monitor.snapshot(),
        ScalerSnapshot {
            scale: s / 4.0,
            skipped_steps: 2,
            optimizer_steps: 8
        }
    );
    // The parameters stay f32 (autocast computes in f16, stores in f32).
    assert_eq!(m.l1.weight.val().dtype(), DType::F32);
}

#[test]
fn an_overflow_inside_an_accumulation_window_skips_the_window_once() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let device = Default::default();
    let accum = GradientAccumulation::new(AdamConfig::new().init::<B, Mlp<B>>(), 4).unwrap();
    let mut optim = AmpOptimizer::new(accum, GradScalerConfig::new()).unwrap();
    let mut m = model(&device);
    let mut at_boundaries = Vec::new();
    for i in 0..12 {
        let before = weights_bits(&m);
        // Micro-step 5 is in the second window.
        m = step(m, &mut optim, i, i == 5);
        let moved = weights_bits(&m) != before;
        if i % 4 == 3 {
            at_boundaries.push((moved, optim.scale()));
        } else {
            assert!(!moved, "micro-step {i} moved the weights");
            // The scale never changes inside a window.
            let expected = if i < 8 { 65536.0 } else { 32768.0 };
            assert_eq!(optim.scale(), expected, "micro-step {i}");
        }
    }
    assert_eq!(
        at_boundaries,
        [(true, 65536.0), (false, 32768.0), (true, 32768.0)]
    );
    let snapshot = optim.monitor().snapshot();
    assert_eq!((snapshot.skipped_steps, snapshot.optimizer_steps), (1, 3));
}

#[test]
fn a_fused_optimizer_steps_with_no_host_read() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let device = Default::default();
    let fused = FusedAdamWConfig::new().init::<B, Mlp<B>>().unwrap();
    let mut optim = AmpOptimizer::new(fused, GradScalerConfig::new()).unwrap();
    let mut m = model(&device);
    m = step(m, &mut optim, 0, false); // first step: kernels compiled, states made
    let before = host_reads();
    for i in 1..6 {
        m = step(m, &mut optim, i, i == 3);
    }
    assert_eq!(host_reads() - before, 0, "host reads in 5 scaled steps");
    // ...and the step at 3 was skipped on the device.
    assert_eq!(optim.monitor().snapshot().skipped_steps, 1);
    assert_eq!(optim.scale(), 32768.0);
}

#[test]
fn bf16_passes_through_and_scales_nothing() {
    let _s = serial();
    let _g = autocast(Precision::Bf16);
    let device = Default::default();
    let mut wrapped = AmpOptimizer::new(
        SgdConfig::new().init::<B, Mlp<B>>(),
        GradScalerConfig::new(),
    )
    .unwrap();
    let mut plain = SgdConfig::new().init::<B, Mlp<B>>();
    let (mut a, mut b) = (model(&device), model(&device));
    for i in 0..3 {
        a = step(a, &mut wrapped, i, false);
        b = step(b, &mut plain, i, false);
    }
    assert_eq!(weights_bits(&a), weights_bits(&b));
    assert_eq!(wrapped.monitor().snapshot().scale, 1.0);
}

#[test]
fn a_second_optimizer_on_one_backend_is_refused_until_the_first_is_dropped() {
    let _s = serial();
    let sgd = || SgdConfig::new().init::<B, Mlp<B>>();
    let first = AmpOptimizer::new(sgd(), GradScalerConfig::new()).unwrap();
    let clone = first.clone(); // a clone is the same installation (Learner clones it)
    let err = AmpOptimizer::new(sgd(), GradScalerConfig::new()).unwrap_err();
    assert!(
        matches!(err, AmpOptimizerError::AlreadyInstalled { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("already installed"), "{err}");
    assert!(
        err.to_string().contains("share_scaler"),
        "the way for several: {err}"
    );
    drop(first);
    assert!(AmpOptimizer::new(sgd(), GradScalerConfig::new()).is_err());
    drop(clone);
    AmpOptimizer::new(sgd(), GradScalerConfig::new()).expect("free again");
    // A bad configuration is the scaler's named error, before anything is installed.
    let bad = AmpOptimizer::new(sgd(), GradScalerConfig::new().with_backoff_factor(2.0));
    assert!(matches!(bad, Err(AmpOptimizerError::Scaler(_))));
    // A disabled scaler installs nothing.
    let _off = AmpOptimizer::new(sgd(), GradScalerConfig::new().with_enabled(false)).unwrap();
    let _on = AmpOptimizer::new(sgd(), GradScalerConfig::new()).unwrap();
}

#[test]
fn the_record_resumes_the_scale_trajectory() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let device = Default::default();
    let config = GradScalerConfig::new()
        .with_growth_interval(2)
        .with_init_scale(16.0);
    let adam = || AdamConfig::new().init::<B, Mlp<B>>();

    // Uninterrupted: 6 steps, one overflow at 1.
    let mut optim = AmpOptimizer::new(adam(), config.clone()).unwrap();
    let mut m = model(&device);
    let mut record = None;
    let mut at_3 = None;
    for i in 0..6 {
        m = step(m, &mut optim, i, i == 1);
        if i == 2 {
            record = Some(burn_amp_record(&optim));
            at_3 = Some(m.clone());
        }
    }
    let (uninterrupted, final_weights) = (optim.scale(), weights_bits(&m));
    let counts = optim.step_counts();
    assert_eq!(
        (counts.optimizer_steps, counts.skipped_steps),
        (6, 1),
        "6 steps, the overflow at step 1 skipped"
    );
    drop(optim);

    // Resumed after step 2 into a fresh optimizer, through a saved record.
    let mut resumed = AmpOptimizer::new(adam(), config).unwrap();
    resumed = Optimizer::<Mlp<B>, B>::load_record(resumed, record.unwrap());
    // The metrics continue from the record: its scale, 3 steps, 1 skipped.
    let at_resume = resumed.monitor().snapshot();
    assert_eq!((at_resume.optimizer_steps, at_resume.skipped_steps), (3, 1));
    assert_eq!(at_resume.scale, resumed.scale());
    let mut m = at_3.unwrap();
    for i in 3..6 {
        m = step(m, &mut resumed, i, false);
    }
    assert_eq!(resumed.scale(), uninterrupted);
    assert_eq!(weights_bits(&m), final_weights, "resumed run differs");
    assert_eq!(
        resumed.step_counts(),
        counts,
        "the counts continue across the resume"
    );
    assert_eq!(resumed.monitor().snapshot().skipped_steps, 1);
}

/// The record, through bytes as a checkpointer writes it.
fn burn_amp_record<O>(
    optim: &AmpOptimizer<O, B>,
) -> <AmpOptimizer<O, B> as Optimizer<Mlp<B>, B>>::Record
where
    O: Optimizer<Mlp<B>, B> + burn_amp::scaler::ScaledStep<Mlp<B>, B>,
{
    let bytes = common::save::<B, _>(optim.to_record());
    common::load::<B, _>(bytes, &Default::default())
}

#[test]
fn multi_device_gradients_are_checked_together() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let device: burn::tensor::Device<B> = Default::default();
    let mut optim = AmpOptimizer::new(
        AdamConfig::new().init::<B, Mlp<B>>(),
        GradScalerConfig::new(),
    )
    .unwrap();
    let mut m = model(&device);
    for (i, poison) in [(0, [false, false]), (1, [false, true]), (2, [false, false])] {
        let before = weights_bits(&m);
        // Two workers (the same device listed twice: all this machine can open twice).
        let mut multi = MultiGradientsParams::default();
        for (w, p) in poison.into_iter().enumerate() {
            let (x, y) = batch(i * 2 + w, p, &device);
            let grads = GradientsParams::from_grads(m.loss(x, y).backward(), &m);
            multi
                .grads
                .push((grads, burn::tensor::backend::DeviceOps::id(&device)));
        }
        m = optim.step_multi(1e-2, m, multi);
        assert_eq!(weights_bits(&m) != before, i != 1, "step {i}");
    }
    assert_eq!(optim.scale(), 32768.0);
    assert_eq!(m.valid().l1.weight.val().dtype(), FloatDType::F32.into());
}
