//! 8-bit AdamW and stochastic rounding composed with the rest of burn-amp: the loss scaler's
//! skip, records, accumulation, frozen parts and the memory report.

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, HalfPrecisionSettings, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn_amp::memory::StepMemory;
use burn_amp::optim::{
    AdamWMomentState, F32Moments, FusedAdamW, FusedAdamWConfig, FusedAdamWState, FusedSgdState,
    MomentStorage, QuantMap, ScaledAdaptor,
};
use burn_amp::record::ExactTensor;
use burn_amp::scaler::GradScalerConfig;
use burn_amp::{
    Amp, AmpOptimizer, Frozen, GradientAccumulation, MemorySaving, Precision, autocast,
};
use burn_std::FloatDType;

use crate::common::models::{DeepMlp, Mlp};
use crate::{common, raw, serial};

type B = Amp<Autodiff<Flex>>;
type Adaptor<M> = ScaledAdaptor<FusedAdamW, M, B>;

/// 8-bit moments for every tensor of 64 values or more (the tests' models are small).
fn int8_everywhere() -> MomentStorage {
    MomentStorage::Int8 {
        block: 256,
        map: QuantMap::Dynamic,
        min_numel: 64,
    }
}

fn batch(
    step: usize,
    rows: usize,
    d_in: usize,
    poison: bool,
    device: &burn::tensor::Device<B>,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let mut x: Vec<f32> = (0..rows * d_in)
        .map(|i| ((i * 7 + step * 13) % 23) as f32 / 23.0 - 0.5)
        .collect();
    if poison {
        x[5] = f32::NAN;
    }
    let y: Vec<i64> = (0..rows).map(|i| ((i + step) % 4) as i64).collect();
    (
        Tensor::from_data(TensorData::new(x, [rows, d_in]), device),
        Tensor::from_data(TensorData::new(y, [rows]), device),
    )
}

/// The raw bytes of every tensor of every parameter's state, in the module's order.
fn state_raw<M: AutodiffModule<B>>(optim: &Adaptor<M>, module: &M) -> Vec<Vec<u8>> {
    type Record = <Adaptor<Mlp<B>> as Optimizer<Mlp<B>, B>>::Record;
    struct Visit {
        record: Record,
        out: Vec<Vec<u8>>,
    }
    impl burn::module::ModuleVisitor<B> for Visit {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<B, D>>) {
            let Some(r) = self.record.get(&p.id) else {
                return;
            };
            let s: FusedAdamWState<<B as AutodiffBackend>::InnerBackend, D> =
                r.clone().into_state();
            self.out.push(raw(s.step.0));
            match s.moments {
                AdamWMomentState::F32(m) => {
                    self.out.push(raw(m.exp_avg));
                    self.out.push(raw(m.exp_avg_sq));
                }
                AdamWMomentState::Int8(q) => {
                    self.out.push(raw(q.exp_avg.codes));
                    self.out.push(raw(q.exp_avg.absmax));
                    self.out.push(raw(q.exp_avg_sq_sqrt.codes));
                    self.out.push(raw(q.exp_avg_sq_sqrt.absmax));
                }
            }
        }
    }
    let mut v = Visit {
        record: optim.to_record(),
        out: Vec::new(),
    };
    module.visit(&mut v);
    v.out
}

fn weights_raw<M: Module<B>>(module: &M) -> Vec<Vec<u8>> {
    struct Raw(Vec<Vec<u8>>);
    impl burn::module::ModuleVisitor<B> for Raw {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<B, D>>) {
            self.0.push(raw(p.val()));
        }
    }
    let mut r = Raw(Vec::new());
    module.visit(&mut r);
    r.0
}

/// At f16 with f16 weights (stochastic rounding) and 8-bit moments, behind the loss scaler:
/// an overflowing step changes no weight, no code, no block maximum and no step count (the
/// rounding stream is derived from the count), bit for bit; the steps around it train.
#[test]
fn a_skipped_step_leaves_weights_moments_and_the_stream_untouched() {
    let _s = serial();
    common::big_stack(|| {
        let device = Default::default();
        let _g = autocast(Precision::F16);
        B::seed(&device, 3);
        let preset = MemorySaving::new()
            .with_weights(FloatDType::F16)
            .with_optimizer(FusedAdamWConfig::memory_saving().with_moments(int8_everywhere()));
        let mut model = preset.prepare(Mlp::<B>::new(64, 128, 4, &device));
        let inner = preset.optimizer::<B, Mlp<B>>().unwrap();
        let mut optim = AmpOptimizer::new(inner, GradScalerConfig::new()).unwrap();
        let mut losses = Vec::new();
        for step in 0..6 {
            let poison = step == 3;
            let before = (weights_raw(&model), state_raw(optim.inner(), &model));
            // One batch throughout: the loss must fall.
            let (x, y) = batch(0, 16, 64, poison, &device);
            let loss = model.loss(x, y);
            losses.push(loss.clone().into_scalar().elem::<f32>());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads);
            let after = (weights_raw(&model), state_raw(optim.inner(), &model));
            if poison {
                let found = optim.last_found_inf().expect("a checked step");
                assert_eq!(
                    found.into_scalar().elem::<f32>(),
                    1.0,
                    "the NaN step is found"
                );
                assert_eq!(before, after, "a skipped step changes nothing, bit for bit");
            } else if step > 0 {
                assert_ne!(before.0, after.0, "step {step}: the weights moved");
            }
        }
        assert_eq!(model.l1.weight.val().dtype(), burn::tensor::DType::F16);
        // The l1 weight (64 x 128) has 8-bit moments; the biases (4 values) f32 ones.
        let record = optim.inner().to_record();
        let state: FusedAdamWState<<B as AutodiffBackend>::InnerBackend, 2> =
            record[&model.l1.weight.id].clone().into_state();
        assert!(matches!(state.moments, AdamWMomentState::Int8(_)));
        let state: FusedAdamWState<<B as AutodiffBackend>::InnerBackend, 1> = record
            [&model.l2.bias.as_ref().unwrap().id]
            .clone()
            .into_state();
        assert!(matches!(state.moments, AdamWMomentState::F32(_)));
        assert_eq!(
            state.step.0.into_data().to_vec::<f32>().unwrap(),
            vec![5.0],
            "six steps, one skipped"
        );
        assert!(losses[5] < losses[0], "it trains: {losses:?}");
    });
}

/// Train three steps, save the model (full precision) and the optimizer through Burn's
/// half-precision recorder (what `CompactRecorder` uses), train three more; load both into a
/// fresh model and optimizer and train the same three: bit for bit the same weights. The
/// 8-bit state keeps its bytes whatever the recorder; the rounding stream comes back with the
/// step counts and the configuration's seed.
#[test]
fn a_record_resumes_bit_for_bit_through_a_half_precision_recorder() {
    let _s = serial();
    common::big_stack(|| {
        let device = Default::default();
        let _g = autocast(Precision::Bf16);
        // Every tensor 8-bit: f32 state (counts aside) follows the recorder's precision.
        let everything = MomentStorage::Int8 {
            block: 256,
            map: QuantMap::Dynamic,
            min_numel: 1,
        };
        let preset = MemorySaving::new().with_optimizer(
            FusedAdamWConfig::memory_saving()
                .with_moments(everything)
                .with_seed(9),
        );
        let fresh = || {
            B::seed(&device, 5);
            preset.prepare(Mlp::<B>::new(64, 128, 4, &device))
        };
        let train =
            |mut model: Mlp<B>, optim: &mut Adaptor<Mlp<B>>, steps: std::ops::Range<usize>| {
                for step in steps {
                    let (x, y) = batch(step, 16, 64, false, &device);
                    let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                    model = optim.step(1e-2, model, grads);
                }
                model
            };
        let mut optim = preset.optimizer::<B, Mlp<B>>().unwrap();
        let model = train(fresh(), &mut optim, 0..3);
        let model_bytes = BinBytesRecorder::<FullPrecisionSettings>::default()
            .record(model.clone().into_record(), ())
            .unwrap();
        let optim_bytes = BinBytesRecorder::<HalfPrecisionSettings>::default()
            .record(optim.to_record(), ())
            .unwrap();
        let straight = train(model, &mut optim, 3..6);

        // Burn's recorders load floats at their settings' precision (f32 here): prepare
        // again to store the weights in bf16 (exact: they were bf16 values).
        let model = preset.prepare(
            fresh().load_record(
                BinBytesRecorder::<FullPrecisionSettings>::default()
                    .load(model_bytes, &device)
                    .unwrap(),
            ),
        );
        let mut resumed = preset.optimizer::<B, Mlp<B>>().unwrap().load_record(
            BinBytesRecorder::<HalfPrecisionSettings>::default()
                .load(optim_bytes, &device)
                .unwrap(),
        );
        let resumed_model = train(model, &mut resumed, 3..6);
        assert_eq!(straight.l1.weight.val().dtype(), burn::tensor::DType::BF16);
        assert_eq!(
            weights_raw(&straight),
            weights_raw(&resumed_model),
            "resumed bit for bit"
        );
        assert_eq!(
            state_raw(&optim, &straight),
            state_raw(&resumed, &resumed_model),
            "optimizer state bit for bit"
        );
    });
}

/// A step count is exact state: Burn's half-precision recorder would save it as f16, which
/// holds integers exactly up to 2048 and none above 65504 (3001 came back 3000, and 70,001 as
/// inf: the count stopped there, and with it the stochastic rounding's stream). The counts of
/// both fused optimizers come back as saved, in f32, whatever the recorder.
#[test]
fn step_counts_come_back_exact_through_a_half_precision_recorder() {
    type IB = <B as AutodiffBackend>::InnerBackend;
    let device = Default::default();
    let recorder = BinBytesRecorder::<HalfPrecisionSettings>::default();
    for count in [3001.0f32, 70001.0] {
        let count_tensor = || ExactTensor(Tensor::<IB, 1>::from_floats([count], &device));
        let adamw = FusedAdamWState::<IB, 1> {
            moments: AdamWMomentState::F32(F32Moments {
                exp_avg: Tensor::zeros([4], &device),
                exp_avg_sq: Tensor::zeros([4], &device),
                max_exp_avg_sq: None,
            }),
            step: count_tensor(),
        };
        let sgd = FusedSgdState::<IB, 1> {
            velocity: Tensor::zeros([4], &device),
            step: count_tensor(),
        };
        let adamw: FusedAdamWState<IB, 1> = recorder
            .load(recorder.record(adamw, ()).unwrap(), &device)
            .unwrap();
        let sgd: FusedSgdState<IB, 1> = recorder
            .load(recorder.record(sgd, ()).unwrap(), &device)
            .unwrap();
        for (name, step) in [("adamw", adamw.step.0), ("sgd", sgd.step.0)] {
            assert_eq!(step.dtype(), burn::tensor::DType::F32, "{name}");
            assert_eq!(step.into_data().to_vec::<f32>().unwrap(), [count], "{name}");
        }
    }
}

/// A frozen layer and a trainable head.
#[derive(Module, Debug)]
struct Backbone<B: Backend> {
    frozen: Frozen<Linear<B>>,
    head: Linear<B>,
}

/// A frozen first layer and a trainable head, f16 behind the loss scaler, two accumulated
/// micro-batches per step, 8-bit moments and f16 weights: it trains, the frozen layer keeps
/// its bits and gets no state, and the state is exactly the 8-bit layout's size.
#[test]
fn composes_with_accumulation_frozen_parts_and_the_scaler() {
    let _s = serial();
    common::big_stack(|| {
        let device = Default::default();
        let _g = autocast(Precision::F16);
        B::seed(&device, 2);
        let preset = MemorySaving::new().with_weights(FloatDType::F16);
        let model = Backbone {
            frozen: Frozen::new(LinearConfig::new(32, 128).init::<B>(&device)),
            head: preset.prepare(LinearConfig::new(128, 64).init::<B>(&device)),
        };
        let frozen_before = weights_raw(&model.frozen);
        let optim =
            GradientAccumulation::new(preset.optimizer::<B, Backbone<B>>().unwrap(), 2).unwrap();
        let mut optim = AmpOptimizer::new(optim, GradScalerConfig::new()).unwrap();
        let target = |step: usize| Tensor::<B, 2>::full([8, 64], (step % 3) as f32 * 0.1, &device);
        let input = |step: usize| {
            let x: Vec<f32> = (0..8 * 32)
                .map(|i| ((i * 5 + step) % 17) as f32 / 17.0)
                .collect();
            Tensor::<B, 2>::from_data(TensorData::new(x, [8, 32]), &device)
        };
        let mut model = model;
        let mut losses = Vec::new();
        for step in 0..40 {
            let h = model.frozen.forward(input(step));
            let loss = (model.head.forward(h) - target(step)).powi_scalar(2).mean();
            losses.push(loss.clone().into_scalar().elem::<f32>());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        let first: f32 = losses[..4].iter().sum();
        let last: f32 = losses[36..].iter().sum();
        assert!(last < 0.5 * first, "it trains: {first} -> {last}");
        assert_eq!(
            weights_raw(&model.frozen),
            frozen_before,
            "the frozen layer keeps its bits"
        );
        // Head: 8192 weights (8-bit: 8192 codes + 32 maxima, each moment) and 64 biases (f32
        // moments: under 4096 values), one f32 count each. Nothing for the frozen layer.
        let bytes = optim.inner().inner().state_bytes(&model);
        let weight = 2 * (8192 + 32 * 4) + 4;
        let bias = 2 * 64 * 4 + 4;
        assert_eq!(bytes, (weight + bias) as u64, "state bytes");
    });
}

/// Bytes per trainable parameter from the `MemoryReport` (weights + gradients + optimizer
/// state over the trainable values), on three 256 x 256 layers with biases:
/// f32 AdamW 16; 8-bit moments 10 + 8/256 (the block maxima); bf16 weights and gradients with
/// 8-bit moments 6 + 8/256. The step counts and the biases' f32 moments add the rest, computed
/// here exactly.
#[test]
fn bytes_per_parameter_from_the_memory_report() {
    let _s = serial();
    common::big_stack(|| {
        let (weights, biases, tensors) = (3 * 65536u64, 3 * 256u64, 6u64);
        let n = weights + biases;
        let counts = 4 * tensors;
        let int8_state = 2 * (weights + weights / 256 * 4) + 2 * biases * 4 + counts;
        let cases = [
            (
                "f32 AdamW",
                MomentStorage::F32,
                FloatDType::F32,
                8 * n + counts,
                4,
            ),
            (
                "8-bit AdamW",
                MomentStorage::int8(),
                FloatDType::F32,
                int8_state,
                4,
            ),
            (
                "MemorySaving",
                MomentStorage::int8(),
                FloatDType::BF16,
                int8_state,
                2,
            ),
        ];
        let mut figures = Vec::new();
        for (name, moments, weights_dtype, state, width) in cases {
            let device = Default::default();
            let _g = autocast(if width == 2 {
                Precision::Bf16
            } else {
                Precision::F32
            });
            let preset = MemorySaving::new()
                .with_weights(weights_dtype)
                .with_optimizer(FusedAdamWConfig::memory_saving().with_moments(moments));
            let mut model = preset.prepare(DeepMlp::<B>::new(256, 3, &device));
            let mut optim = preset.optimizer::<B, DeepMlp<B>>().unwrap();
            let x = Tensor::<B, 2>::ones([4, 256], &device);
            let mut report = None;
            for _ in 0..2 {
                let memory = StepMemory::begin::<B>(&device);
                let grads =
                    GradientsParams::from_grads(model.forward(x.clone()).mean().backward(), &model);
                report =
                    Some(memory.report::<B, _>(&model, Some(&grads), optim.state_bytes(&model)));
                model = optim.step(1e-3, model, grads);
            }
            let report = report.unwrap();
            assert_eq!(report.trainable_values, n, "{name}: trainable values");
            assert_eq!(report.parameters, width * n, "{name}: weights");
            assert_eq!(report.gradients, width * n, "{name}: gradients");
            assert_eq!(report.optimizer_state, state, "{name}: optimizer state");
            let bpp = report.bytes_per_parameter().unwrap();
            let want = (2 * width * n + state) as f64 / n as f64;
            assert!(
                (bpp - want).abs() < 1e-9,
                "{name}: {bpp} bytes per parameter, want {want}"
            );
            // The advice proposes what is not on yet, for the largest row.
            let advice: Vec<String> = report.advice().into_iter().map(|a| a.action).collect();
            let proposes = |what: &str| advice.iter().any(|a| a.contains(what));
            match name {
                "f32 AdamW" => assert!(proposes("8-bit AdamW"), "{name}: {advice:?}"),
                "8-bit AdamW" => assert!(proposes("bf16 weights"), "{name}: {advice:?}"),
                _ => assert!(
                    !proposes("8-bit AdamW") && !proposes("bf16 weights"),
                    "{name}: {advice:?}"
                ),
            }
            figures.push((name, bpp));
            eprintln!("{name}: {bpp:.4} bytes per parameter\n{report}");
        }
        assert!((figures[0].1 - 16.0).abs() < 0.01, "f32 AdamW: 16");
        assert!(
            (figures[1].1 - 10.0).abs() < 0.06,
            "8-bit AdamW: 10 and the maxima"
        );
        // 6 + 8/256 for the weight matrices; the target of 6 is missed by the block maxima.
        assert!(figures[2].1 <= 6.06, "MemorySaving: {}", figures[2].1);
    });
}
