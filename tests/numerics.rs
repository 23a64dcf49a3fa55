//! Numbers the scaler and the optimizers must get right (each test failed before its fix):
//! a gradient has its parameter's dtype on both stacks, every parameter keeps its own AdamW
//! step count, f16 gradients are unscaled in f32, SGD's momentum starts as PyTorch's after a
//! skipped step, several modules share one scaler, a multi-device step follows the
//! gradient's device, clipping f16 gradients applies its coefficient in f32, and an
//! accumulated f16 gradient of an f32 parameter is not narrowed back to f16.

mod common;

use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::grads::GradList;
use burn_amp::optim::{FusedAdamWConfig, FusedSgdConfig, OptimError};
use burn_amp::scaler::{GradScaler, GradScalerConfig, ScalerError, ScalerKernels, Unfused};
use burn_amp::{Amp, GradientAccumulation, Precision, autocast};

type B = Amp<Autodiff<Flex>>;

/// Two vector parameters.
#[derive(Module, Debug)]
struct Two<B: Backend> {
    a: Param<Tensor<B, 1>>,
    b: Param<Tensor<B, 1>>,
}

impl<B: Backend> Two<B> {
    fn new(value: f32, dtype: DType, device: &B::Device) -> Self {
        let p = || Param::from_tensor(Tensor::full([4], value, (device, dtype)));
        Self { a: p(), b: p() }
    }
}

fn values<B: Backend>(p: &Param<Tensor<B, 1>>) -> Vec<f32> {
    p.val()
        .cast(DType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap()
}

/// Gradients of `value` for the listed parameters, in each parameter's dtype.
fn grads_for<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    ids: &[ParamId],
    value: f32,
) -> GradientsParams {
    struct Fill<'a> {
        ids: &'a [ParamId],
        value: f32,
        out: GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Fill<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.ids.contains(&param.id) {
                let p = param.val().inner();
                let g = p.ones_like().mul_scalar(self.value);
                self.out.register::<B::InnerBackend, D>(param.id, g);
            }
        }
    }
    let mut fill = Fill {
        ids,
        value,
        out: GradientsParams::new(),
    };
    module.visit(&mut fill);
    fill.out
}

/// A scaler for `precision` whose scale starts at `init_scale`.
fn scaler<AB: AutodiffBackend>(
    init_scale: f32,
    precision: Precision,
    device: &AB::Device,
) -> GradScaler<AB>
where
    AB::InnerBackend: ScalerKernels,
{
    GradScalerConfig::new()
        .with_init_scale(init_scale)
        .init::<AB>(device, precision)
        .unwrap()
}

/// AdamW keeps a step count per parameter: one that first gets a gradient after ten steps of
/// another gets AdamW's first update, `lr · g / (|g| + eps)`, not one bias-corrected as the
/// eleventh (half of it here; about 3× too large after many steps).
#[test]
fn a_late_parameter_gets_a_first_adamw_step() {
    let device = Default::default();
    let mut model = Two::<B>::new(1.0, DType::F32, &device);
    let (a, b) = (model.a.id, model.b.id);
    let mut optim = FusedAdamWConfig::new()
        .with_weight_decay(0.0)
        .init::<B, Two<B>>()
        .unwrap();
    let lr = 1e-2;
    for _ in 0..10 {
        let grads = grads_for::<B, _>(&model, &[a], 0.3);
        model = optim.step(lr, model, grads);
    }
    assert_eq!(values(&model.b), vec![1.0; 4], "b had no gradient yet");
    let grads = grads_for::<B, _>(&model, &[a, b], 0.3);
    model = optim.step(lr, model, grads);
    let expected = 1.0 - lr as f32 * 0.3 / (0.3 + 1e-8);
    for v in values(&model.b) {
        assert!((v - expected).abs() < 1e-6, "b = {v}, expected {expected}");
    }
    // The counts travel in the record, one per parameter.
    let record = Optimizer::<Two<B>, B>::to_record(&optim);
    let count = |id: ParamId| {
        let state = record[&id].clone().into_state::<1>();
        state.step.0.into_scalar().elem::<f32>()
    };
    assert_eq!((count(a), count(b)), (11.0, 1.0));
}

/// f16 gradients are unscaled in f32, inside the fused kernel: a true gradient of 1e-8 (below
/// f16's smallest subnormal, 6e-8) scaled by 65536 still moves its parameter. Unscaling into
/// f16 first flushed it to zero and the parameter never moved.
#[test]
fn tiny_f16_gradients_survive_unscaling() {
    let device = Default::default();
    let scale = 65536.0;
    let g16 = half::f16::from_f32(1e-8 * scale).to_f32();
    let g = g16 / scale;
    let expected = 0.5 - 1e-2 * g / (g + 1e-8);

    // One step, then a window of two micro-steps: both hand the kernel f16/f32 gradients
    // still scaled, with the real inv_scale.
    for micro_batches in [1, 2] {
        let model = Two::<B>::new(0.5, DType::F16, &device);
        let ids = [model.a.id, model.b.id];
        let mut scaler = scaler::<B>(scale, Precision::F16, &device);
        let adamw = FusedAdamWConfig::new()
            .with_weight_decay(0.0)
            .init::<B, Two<B>>()
            .unwrap();
        let mut optim = GradientAccumulation::new(adamw, micro_batches).unwrap();
        let mut model = model;
        for _ in 0..micro_batches {
            let grads = grads_for::<B, _>(&model, &ids, g16);
            let (m, report) = scaler.step(&mut optim, 1e-2, model, grads).unwrap();
            model = m;
            assert!(!report.skipped());
            scaler.update().unwrap();
        }
        let a = values(&model.a);
        let rounded = half::f16::from_f32(expected).to_f32();
        assert!(
            a.iter().all(|&v| v == rounded),
            "N = {micro_batches}: a = {a:?}, expected {rounded} (0.5 means the gradient flushed)"
        );
    }
}

/// SGD with momentum whose first step is skipped: the next step still starts the buffer
/// with the gradient itself, as PyTorch does (not `(1 - dampening) · g` on a zero buffer).
#[test]
fn sgd_momentum_starts_after_a_skipped_first_step() {
    let device = Default::default();
    let model = Two::<B>::new(1.0, DType::F32, &device);
    let ids = [model.a.id, model.b.id];
    let mut scaler = scaler::<B>(1024.0, Precision::F16, &device);
    let mut optim = FusedSgdConfig::new()
        .with_momentum(0.9)
        .with_dampening(0.5)
        .init::<B, Two<B>>()
        .unwrap();
    let grads = grads_for::<B, _>(&model, &ids, f32::NAN);
    let (model, report) = scaler.step(&mut optim, 0.1, model, grads).unwrap();
    assert!(report.skipped());
    scaler.update().unwrap();
    let scale = scaler.scale_value();
    let grads = grads_for::<B, _>(&model, &ids, 0.2 * scale);
    let (model, _) = scaler.step(&mut optim, 0.1, model, grads).unwrap();
    scaler.update().unwrap();
    for v in values(&model.a) {
        assert!((v - 0.98).abs() < 1e-6, "a = {v}: expected 1 - 0.1 * 0.2");
    }
}

#[test]
fn nesterov_needs_momentum_and_no_dampening() {
    let field = |c: FusedSgdConfig| match c.init::<B, Two<B>>() {
        Err(OptimError::InvalidConfig { field, .. }) => field,
        Err(other) => panic!("not a field's range: {other}"),
        Ok(_) => "accepted",
    };
    assert_eq!(field(FusedSgdConfig::new().with_nesterov(true)), "momentum");
    let damped = FusedSgdConfig::new()
        .with_nesterov(true)
        .with_momentum(0.9)
        .with_dampening(0.1);
    assert_eq!(field(damped), "dampening");
    let ok = FusedSgdConfig::new().with_nesterov(true).with_momentum(0.9);
    assert_eq!(field(ok), "accepted");
    let beta = FusedAdamWConfig::new().with_beta_1(1.0).init::<B, Two<B>>();
    assert!(matches!(
        beta,
        Err(OptimError::InvalidConfig {
            field: "beta_1",
            ..
        })
    ));
}

/// AMSGrad keeps an f32 maximum beside the moments; with 8-bit moments the config is refused
/// with an error that says what to do, not quantized in part. So is cautious decay of Adam.
#[test]
fn combinations_that_cannot_run_are_refused() {
    let refused = FusedAdamWConfig::memory_saving()
        .with_amsgrad(true)
        .init::<B, Two<B>>();
    let Err(err) = refused else {
        panic!("AMSGrad with 8-bit moments was accepted")
    };
    assert!(matches!(err, OptimError::Unsupported { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("amsgrad") && message.contains("MomentStorage::F32"),
        "{message}"
    );
    let f32_moments = FusedAdamWConfig::new().with_amsgrad(true);
    assert!(f32_moments.init::<B, Two<B>>().is_ok());
    let cautious = FusedAdamWConfig::memory_saving().with_cautious_weight_decay(true);
    assert!(cautious.init::<B, Two<B>>().is_ok());
    // Cautious decay masks AdamW's decoupled decay; Adam's L2 penalty has none to mask.
    let l2 = FusedAdamWConfig::adam()
        .with_weight_decay(1e-2)
        .with_cautious_weight_decay(true)
        .init::<B, Two<B>>();
    let Err(err) = l2 else {
        panic!("cautious decay with an L2 penalty was accepted")
    };
    assert!(err.to_string().contains("decoupled_weight_decay"), "{err}");
}

/// A GAN's generator and discriminator, two optimizers, one scaler: each steps once, each
/// skip is decided on its own gradients, and one `update` backs off if either overflowed.
#[test]
fn several_modules_share_one_scaler() {
    let device = Default::default();
    let generator = Two::<B>::new(1.0, DType::F32, &device);
    let discriminator = Two::<B>::new(2.0, DType::F32, &device);
    let gen_ids = [generator.a.id, generator.b.id];
    let disc_ids = [discriminator.a.id, discriminator.b.id];
    let mut scaler = scaler::<B>(1024.0, Precision::F16, &device);
    let sgd = || FusedSgdConfig::new().init::<B, Two<B>>().unwrap();
    let (mut gen_optim, mut disc_optim) = (sgd(), sgd());

    let grads = grads_for::<B, _>(&generator, &gen_ids, 1024.0);
    let (generator, gen_report) = scaler.step(&mut gen_optim, 0.1, generator, grads).unwrap();
    let grads = grads_for::<B, _>(&discriminator, &disc_ids, f32::INFINITY);
    let (discriminator, disc_report) = scaler
        .step(&mut disc_optim, 0.1, discriminator, grads)
        .unwrap();
    assert!(!gen_report.skipped() && disc_report.skipped());
    assert_eq!(values(&generator.a), vec![0.9; 4]);
    assert_eq!(values(&discriminator.a), vec![2.0; 4]);
    let grads = grads_for::<B, _>(&generator, &gen_ids, 1.0);
    assert_eq!(
        scaler
            .step(&mut gen_optim, 0.1, generator.clone(), grads)
            .err(),
        Some(ScalerError::StepTwice),
        "one module still steps once per update"
    );
    scaler.update().unwrap();
    assert_eq!(scaler.scale_value(), 512.0, "backed off once for both");
}

/// Records the dtype of every gradient it is given.
#[derive(Clone, Default)]
struct Probe {
    dtypes: Arc<Mutex<Vec<DType>>>,
}

impl<M: AutodiffModule<AB>, AB: AutodiffBackend> Optimizer<M, AB> for Probe {
    type Record = ();

    fn step(&mut self, _lr: LearningRate, module: M, grads: GradientsParams) -> M {
        let list = GradList::<AB::InnerBackend>::peek::<AB, M>(&module, &grads);
        let mut dtypes = self.dtypes.lock().unwrap();
        dtypes.extend(list.entries().iter().map(|e| {
            use burn_backend::TensorMetadata;
            e.grad.dtype()
        }));
        module
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, _: MultiGradientsParams) -> M {
        Optimizer::<M, AB>::step(self, lr, module, GradientsParams::new())
    }

    fn to_record(&self) -> Self::Record {}

    fn load_record(self, _: Self::Record) -> Self {
        self
    }
}

/// A parameter used by a raw `matmul`.
#[derive(Module, Debug)]
struct RawMatmul<B: Backend> {
    w: Param<Tensor<B, 2>>,
}

/// The dtypes the optimizer sees for a raw-matmul parameter, on stack `AB`, at `precision`,
/// and those `GradientsParams` holds before any burn-amp step.
fn grad_dtypes<AB: AutodiffBackend>(precision: Precision) -> (Vec<DType>, DType)
where
    AB::InnerBackend: burn_amp::AmpKernels,
{
    let device = Default::default();
    let _amp = autocast(precision);
    let model = RawMatmul::<AB> {
        w: Param::from_tensor(Tensor::random(
            [8, 8],
            burn::tensor::Distribution::Default,
            &device,
        )),
    };
    let x = Tensor::<AB, 2>::ones([4, 8], &device);
    let loss_of = |m: &RawMatmul<AB>| x.clone().matmul(m.w.val()).sum();
    // A scale whose gradients fit f16 (65536 × 4 would not).
    let mut scaler = scaler::<AB>(1024.0, precision, &device);
    let grads = GradientsParams::from_grads(scaler.scale(loss_of(&model)).backward(), &model);
    let raw = grads
        .get::<AB::InnerBackend, 2>(model.w.id)
        .unwrap()
        .dtype();
    let mut probe = Unfused(Probe::default());
    let (_, _) = scaler.step(&mut probe, 1e-3, model, grads).unwrap();
    let seen = probe.0.dtypes.lock().unwrap().clone();
    (seen, raw)
}

/// A parameter's gradient has the parameter's dtype on both stacks, whatever the precision:
/// `Amp<Autodiff<B>>` records the casts, and under `Autodiff<Amp<B>>` (where autodiff
/// registers the f16 gradient of the lowered matmul as it is) every burn-amp step casts it.
#[test]
fn a_raw_matmul_parameter_gets_an_f32_gradient_on_both_stacks() {
    for precision in [Precision::F16, Precision::Bf16] {
        let (seen, raw) = grad_dtypes::<Amp<Autodiff<Flex>>>(precision);
        assert_eq!((seen, raw), (vec![DType::F32], DType::F32), "{precision}");
        let (seen, raw) = grad_dtypes::<Autodiff<Amp<Flex>>>(precision);
        assert_eq!(seen, vec![DType::F32], "{precision}, Autodiff<Amp<Flex>>");
        let low = precision.low_dtype().unwrap();
        assert_eq!(raw, low.into(), "what autodiff registers below Amp");
    }
}

/// `unscale` hands back gradients in their parameters' dtypes too (for user clipping).
#[test]
fn unscale_casts_to_the_parameter_dtype() {
    type AB = Autodiff<Amp<Flex>>;
    let device = Default::default();
    let _amp = autocast(Precision::F16);
    let model = RawMatmul::<AB> {
        w: Param::from_tensor(Tensor::ones([8, 8], &device)),
    };
    let x = Tensor::<AB, 2>::ones([4, 8], &device);
    let mut scaler = scaler::<AB>(1024.0, Precision::F16, &device);
    let loss = x.matmul(model.w.val()).sum();
    let mut grads = GradientsParams::from_grads(scaler.scale(loss).backward(), &model);
    scaler.unscale(&model, &mut grads).unwrap();
    let g = grads.get::<Amp<Flex>, 2>(model.w.id).unwrap();
    assert_eq!(g.dtype(), DType::F32);
    let g = g.into_data().to_vec::<f32>().unwrap();
    assert!(g.iter().all(|&v| v == 4.0), "d(sum(x w))/dw = 4: {g:?}");
}

/// A multi-device step sums each parameter's gradients onto one device and steps there,
/// with the fused optimizer and through accumulation, as Burn's adaptor does.
///
/// Only one device is exercised: Flex has one, and CubeCL 0.10's wgpu runtime cannot move a
/// tensor between two devices (its peer `send`/`recv` are unimplemented: the move panics in
/// the server's thread, and the reader gets zeros), so the "parameter follows its gradient's
/// device" path, the check of each device's gradients on that device (`GradList`) and an
/// accumulation sum kept on one device are untested across devices here.
#[test]
fn step_multi_sums_devices_and_steps() {
    let device = Default::default();
    let id = burn_backend::DeviceOps::id(&device);
    let model = Two::<B>::new(1.0, DType::F32, &device);
    let ids = [model.a.id, model.b.id];
    let multi = |model: &Two<B>| MultiGradientsParams {
        grads: vec![
            (grads_for::<B, _>(model, &ids, 0.25), id),
            (grads_for::<B, _>(model, &ids, 0.25), id),
        ],
    };
    let sgd = || {
        FusedSgdConfig::new()
            .with_momentum(0.9)
            .init::<B, Two<B>>()
            .unwrap()
    };
    let mut optim = sgd();
    let grads = multi(&model);
    let stepped = optim.step_multi(0.1, model.clone(), grads);
    assert_eq!(values(&stepped.a), vec![0.95; 4], "1 - 0.1 × (0.25 + 0.25)");
    let mut accum = GradientAccumulation::new(sgd(), 2).unwrap();
    let grads = multi(&model);
    let model = accum.step_multi(0.1, model, grads);
    assert_eq!(values(&model.b), vec![1.0; 4], "mid-window");
    let grads = multi(&model);
    let model = accum.step_multi(0.1, model, grads);
    assert_eq!(
        values(&model.b),
        vec![0.95; 4],
        "the mean of two windows of 0.5"
    );
}

/// Clipping f16 gradients by a large norm: the coefficient (here 1.7e-7) is applied in f32.
/// Cast to f16 first it was a subnormal, 1.79e-7 (three of f16's smallest steps): every
/// clipped gradient 7% too large; under 6e-8 it was 0 and clipping zeroed them all.
#[test]
fn clipping_f16_gradients_by_a_large_norm_keeps_their_values() {
    type IB = Flex;
    let device = Default::default();
    let n = 10_000;
    for (value, max_norm) in [(60_000.0f32, 1.0f32), (60_000.0, 0.1)] {
        let g = Tensor::<IB, 1>::full([n], value, (&device, DType::F16));
        let mut list = GradList::<IB>::from_entries(vec![burn_amp::grads::GradEntry {
            id: ParamId::new(),
            grad: g.into_primitive().tensor(),
            param_dtype: DType::F16,
        }]);
        let norm = list.clip_by_global_norm(max_norm).unwrap();
        let norm = norm.into_data().to_vec::<f32>().unwrap()[0];
        let expected_norm = value * (n as f32).sqrt();
        assert!(
            (norm - expected_norm).abs() < 1e-3 * expected_norm,
            "{norm}"
        );
        let clipped: Tensor<IB, 1> = Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(
            list.tensors()[0].clone(),
        ));
        assert_eq!(clipped.dtype(), DType::F16);
        let clipped = clipped
            .cast(DType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let expected = max_norm / (n as f32).sqrt(); // each of n equal values
        for v in clipped {
            // f16 rounding of the result only (2^-11 relative).
            assert!((v - expected).abs() <= expected * 1e-3, "{v} vs {expected}");
        }
    }
}

/// Accumulated f16 gradients of f32 parameters (a raw matmul's under `Autodiff<Amp<B>>`) are
/// summed in f32 and stay f32 for the step. Cast back to f16 after the window, a `Sum` of eight
/// micro-batches' 10,000 (80,000) was inf, and with no loss scaler to catch it the parameters
/// went inf; a `Mean` was rounded to f16 (10,001 became 10,000).
#[test]
fn accumulated_f16_gradients_of_f32_parameters_are_not_narrowed_back() {
    use burn::optim::SgdConfig;
    use burn_amp::accumulate::{GradientAccumulationConfig, Reduction};
    type IB = <B as AutodiffBackend>::InnerBackend;
    let device = Default::default();
    // 10,008 once and 10,000 seven times (f16 values: its spacing there is 8): the sum
    // 80,008 is past f16's 65,504, the mean 10,001 between two f16 values.
    for (reduction, expected) in [(Reduction::Sum, 80_008.0f32), (Reduction::Mean, 10_001.0)] {
        let model = Two::<B>::new(0.0, DType::F32, &device);
        let mut accum = GradientAccumulationConfig::new(8)
            .with_reduction(reduction)
            .init::<B, _>(SgdConfig::new().init::<B, Two<B>>())
            .unwrap();
        let mut model = model;
        for i in 0..8 {
            let mut grads = GradientsParams::new();
            let v = if i == 0 { 10_008.0 } else { 10_000.0 };
            for id in [model.a.id, model.b.id] {
                let g = Tensor::<IB, 1>::full([4], v, (&device, DType::F16));
                grads.register::<IB, 1>(id, g);
            }
            model = accum.step(1.0, model, grads);
        }
        let a = values(&model.a);
        assert_eq!(model.a.val().dtype(), DType::F32);
        assert!(a.iter().all(|v| v.is_finite()), "{reduction:?}: {a:?}");
        assert_eq!(
            a,
            vec![-expected; 4],
            "{reduction:?}: one SGD step of lr 1 on the f32 sum"
        );
    }
}
