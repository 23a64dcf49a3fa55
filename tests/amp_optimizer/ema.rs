//! `ModelEma`: the average against an f64 reference of the same updates (plain, warmup, bf16
//! weights), the steps an `AmpOptimizer` did not take passed over (a micro-step of an
//! accumulation window, a step skipped on an overflow) with no host read, tensors that are
//! not trained taken as they are, a record resuming bitwise, and misuse as typed errors with
//! nothing changed; each with the average on the device and in host memory (bit for bit the
//! same), and `update_every`.

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Linear, LinearConfig};
use burn_amp::ema::{EmaConfig, EmaError, EmaPlacement, ModelEma};
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::scaler::GradScaler;
use burn_amp::{Frozen, MemorySaving, freeze};
use common::{ema_reference as reference, largest_error};

use super::*;

/// Every float parameter moved to `w0 + t · 0.01 · sin(i)`, as a training run would move it.
struct Moved {
    t: f32,
    index: usize,
}

impl<B2: Backend> ModuleMapper<B2> for Moved {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B2, D>>) -> Param<Tensor<B2, D>> {
        let (id, value, mapper) = param.consume();
        let (dtype, device, shape) = (value.dtype(), value.device(), value.shape());
        let trained = value.is_require_grad();
        let values = value
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let moved: Vec<f32> = values
            .iter()
            .enumerate()
            .map(|(i, v)| v + self.t * 0.01 * ((i + 31 * self.index) as f32).sin())
            .collect();
        self.index += 1;
        let moved = Tensor::<B2, D>::from_data(TensorData::new(moved, shape), &device).cast(dtype);
        let moved = if trained { moved.require_grad() } else { moved };
        Param::from_mapped_value(id, moved, mapper)
    }
}

const PLACEMENTS: [EmaPlacement; 2] = [EmaPlacement::Device, EmaPlacement::Host];

fn moved<M: Module<B>>(module: M, t: usize) -> M {
    module.map(&mut Moved {
        t: t as f32,
        index: 0,
    })
}

/// The average of `steps` moves of `start`, and the weights it saw (the start first).
fn averaged(start: Mlp<B>, config: EmaConfig, steps: usize) -> (Vec<f32>, Vec<Vec<f32>>, u64) {
    let mut ema = ModelEma::new(&start, config).unwrap();
    let mut seen = vec![params(&start)];
    for t in 1..=steps {
        let m = moved(start.clone(), t);
        ema.update(&m).unwrap();
        seen.push(params(&m));
    }
    (params(&ema.module()), seen, ema.updates())
}

#[test]
fn the_average_follows_an_f64_reference() {
    let _s = serial();
    let device = Default::default();
    let cases = [(0.9, false), (0.99, true), (0.0, false)];
    for ((decay, warmup), placement) in cases.into_iter().flat_map(|c| PLACEMENTS.map(|p| (c, p))) {
        let config = EmaConfig::new()
            .with_decay(decay)
            .with_warmup(warmup)
            .with_placement(placement);
        let (got, seen, updates) = averaged(model(&device), config, 30);
        assert_eq!(updates, 30);
        let want = reference(&seen, decay, warmup);
        let err = largest_error(&got, &want);
        // 30 f32 updates of values below 1: a few ulps each.
        assert!(
            err < 2e-6,
            "decay {decay}, warmup {warmup}, {placement:?}: off by {err}"
        );
        // It moved: not the start, not the last weights (but at decay 0, the last).
        let last = seen.last().unwrap();
        let to_last = largest_error(last, &want);
        if decay == 0.0 {
            assert_eq!(&got, last, "decay 0 is the weights");
        } else {
            assert!(to_last > 1e-3, "decay {decay}: the average is the weights");
        }
    }
}

/// bf16 weights averaged in f32 follow the reference; the same average kept in bf16 never
/// leaves the start (each update is below half an ulp of it).
#[test]
fn a_bf16_model_is_averaged_in_f32() {
    let _s = serial();
    let device = Default::default();
    let start = MemorySaving::new()
        .with_weights(FloatDType::BF16)
        .prepare(model(&device));
    let config = EmaConfig::new().with_decay(0.999);
    let (got, seen, _) = averaged(start.clone(), config.clone(), 60);
    let ema = ModelEma::new(&start, config.clone()).unwrap();
    assert_eq!(ema.module().l1.weight.val().dtype(), DType::F32);
    let want = reference(&seen, 0.999, false);
    let err = largest_error(&got, &want);
    assert!(err < 1e-6, "off by {err}");
    // On the host, widened there: the same bits.
    let on_host = config.with_placement(EmaPlacement::Host);
    let (host, _, _) = averaged(start.clone(), on_host.clone(), 60);
    assert_eq!(bits(&host), bits(&got), "the host average of bf16 weights");
    let ema = ModelEma::new(&start, on_host).unwrap();
    assert_eq!(ema.module().l1.weight.val().dtype(), DType::F32);
    let from_start = largest_error(&seen[0], &want);
    assert!(
        from_start > 5e-3,
        "the reference moved {from_start}: too little to tell"
    );

    // The canary: the same updates in bf16.
    let mut in_bf16: Vec<Tensor<Inner, 2>> = vec![start.l1.weight.val().inner()];
    for t in 1..=60 {
        let w = moved(start.clone(), t).l1.weight.val().inner();
        let e = in_bf16.pop().unwrap();
        in_bf16.push(e.clone() + (w - e) * 0.001);
    }
    let stalled = in_bf16.pop().unwrap();
    assert_eq!(stalled.dtype(), DType::BF16);
    let stalled = stalled
        .cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let first = start.l1.weight.val().cast(FloatDType::F32);
    let first = first.into_data().to_vec::<f32>().unwrap();
    let n = first.len();
    let unmoved = stalled.iter().zip(&first).filter(|(a, b)| a == b).count();
    let bf16_err = largest_error(&stalled, &want[..n]);
    let travelled = largest_error(&first, &want[..n]);
    eprintln!(
        "bf16 average: {unmoved} of {n} never moved, off by {bf16_err} of {travelled} \
         travelled; f32: off by {err}"
    );
    assert!(
        unmoved * 2 > n && bf16_err > travelled / 4.0,
        "the bf16 average kept up ({unmoved} of {n} unmoved, off by {bf16_err}): the canary \
         no longer shows why f32"
    );
}

#[derive(Module, Debug)]
struct HalfFrozen<B: Backend> {
    backbone: Frozen<Linear<B>>,
    head: Linear<B>,
}

/// Tensors that are not trained are the model's, in their dtype, at each update.
#[test]
fn tensors_not_trained_are_taken_as_they_are() {
    let _s = serial();
    let device = Default::default();
    B::seed(&device, 9);
    let start = HalfFrozen::<B> {
        backbone: freeze(LinearConfig::new(8, 8).init(&device)).with_storage(FloatDType::BF16),
        head: LinearConfig::new(8, 4).init(&device),
    };
    for placement in PLACEMENTS {
        let config = EmaConfig::new().with_decay(0.5).with_placement(placement);
        let mut ema: ModelEma<B, _> = ModelEma::new(&start, config).unwrap();
        let backbone = ema.module().backbone.weight.val();
        assert_eq!(
            backbone.dtype(),
            DType::BF16,
            "{placement:?}: a frozen bf16 tensor widened"
        );
        // The model's frozen tensor replaced (as a loaded checkpoint would): taken, not
        // averaged.
        let replaced = HalfFrozen {
            backbone: moved(start.backbone.clone(), 7),
            head: start.head.clone(),
        };
        ema.update(&replaced).unwrap();
        assert_eq!(
            params(&ema.module().backbone),
            params(&replaced.backbone),
            "{placement:?}: the frozen tensor was averaged"
        );
        assert_eq!(params(&ema.module().head), params(&start.head));
    }
}

type Window = GradientAccumulation<super::shared_scaler::Fused, B>;

/// An `AmpOptimizer` around a window of 2 at f16, micro-batch 5 poisoned: the average takes
/// the steps at micro-batches 1, 3 and 7, not the window that overflowed, with no host read.
#[test]
fn steps_not_taken_are_not_averaged() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let device = Default::default();
    let mut averages = Vec::new();
    for placement in PLACEMENTS {
        let fused = FusedAdamWConfig::new().init::<B, Mlp<B>>().unwrap();
        let window: Window = GradientAccumulation::new(fused, 2).unwrap();
        let mut optim = AmpOptimizer::new(window, GradScalerConfig::new()).unwrap();
        let mut m = model(&device);
        let config = EmaConfig::new()
            .with_decay(0.8)
            .with_warmup(true)
            .with_placement(placement);
        let mut ema = ModelEma::new(&m, config).unwrap();
        let mut taken = vec![params(&m)];
        let mut reads = 0;
        for i in 0..8 {
            m = step(m, &mut optim, i, i == 5);
            let before = host_reads();
            ema.update_after(&m, &optim).unwrap();
            reads += host_reads() - before;
            assert_eq!(optim.last_step_taken(), i % 2 == 1, "micro-batch {i}");
            if i % 2 == 1 && i != 5 {
                taken.push(params(&m));
            }
        }
        if placement == EmaPlacement::Device {
            assert_eq!(reads, 0, "host reads in update_after");
        }
        assert_eq!(ema.updates(), 3, "{placement:?}: updates counted");
        let got = params(&ema.module());
        let err = largest_error(&got, &reference(&taken, 0.8, true));
        assert!(err < 1e-6, "{placement:?}: off by {err}");
        averages.push(bits(&got));
    }
    assert_eq!(averages[0], averages[1], "host and device averages differ");
}

/// A loop with a `GradScaler` by hand: `update_unless(report.found_inf())` passes over the
/// step skipped at 2.
#[test]
fn a_hand_loop_passes_its_overflow_flag() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let device = Default::default();
    let mut scaler: GradScaler<B> = GradScalerConfig::new()
        .init(&device, Precision::F16)
        .unwrap();
    let mut optim = super::shared_scaler::fused();
    let mut m = model(&device);
    let mut ema = ModelEma::new(&m, EmaConfig::new().with_decay(0.7)).unwrap();
    let mut taken = vec![params(&m)];
    for i in 0..5 {
        let (x, y) = batch(i, i == 2, &device);
        let loss = scaler.scale(m.loss(x, y));
        let grads = GradientsParams::from_grads(loss.backward(), &m);
        let (stepped, report) = scaler.step(&mut optim, 1e-2, m, grads).unwrap();
        m = stepped;
        scaler.update().unwrap();
        ema.update_unless(&m, report.found_inf()).unwrap();
        if i != 2 {
            taken.push(params(&m));
        }
    }
    assert_eq!(ema.updates(), 4);
    let err = largest_error(&params(&ema.module()), &reference(&taken, 0.7, false));
    assert!(err < 1e-6, "off by {err}");
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Saved after 5 calls (every 2nd averaged: 2 updates, one call into the third), resumed in
/// either placement from either: the same bits as the run that went on, the phase of
/// `update_every` kept.
#[test]
fn a_record_resumes_the_average_bitwise_in_either_placement() {
    let _s = serial();
    let device = Default::default();
    let config = |placement| {
        EmaConfig::new()
            .with_decay(0.95)
            .with_warmup(true)
            .with_update_every(2)
            .with_placement(placement)
    };
    let start = model(&device);
    let run = |ema: &mut ModelEma<B, Mlp<B>>, steps: core::ops::Range<usize>| {
        for t in steps {
            ema.update(&moved(start.clone(), t)).unwrap();
        }
    };
    for saved_in in PLACEMENTS {
        let mut whole = ModelEma::new(&start, config(saved_in)).unwrap();
        run(&mut whole, 1..6);
        let saved = common::save::<Inner, _>(whole.to_record());
        run(&mut whole, 6..14);
        assert_eq!(whole.updates(), 6);
        for loaded_in in PLACEMENTS {
            let mut resumed = ModelEma::new(&model(&device), config(loaded_in))
                .unwrap()
                .load_record(common::load::<Inner, _>(saved.clone(), &device));
            assert_eq!(resumed.updates(), 2);
            run(&mut resumed, 6..14);
            assert_eq!(
                bits(&params(&resumed.module())),
                bits(&params(&whole.module())),
                "saved {saved_in:?}, loaded {loaded_in:?}"
            );
            assert_eq!(resumed.updates(), 6);
        }
    }
}

/// Every 3rd call averages, with the decay per update: 9 calls are the reference of the
/// weights at 3, 6 and 9; an overflow at the 6th passes that update over (not to the 7th).
#[test]
fn update_every_averages_every_nth_step() {
    let _s = serial();
    let device = Default::default();
    let start = model(&device);
    for placement in PLACEMENTS {
        let config = EmaConfig::new()
            .with_decay(0.6)
            .with_update_every(3)
            .with_placement(placement);
        let mut ema = ModelEma::new(&start, config).unwrap();
        let mut taken = vec![params(&start)];
        for t in 1..=9 {
            let m = moved(start.clone(), t);
            let found_inf = Tensor::<Inner, 1>::from_floats([(t == 6) as u8 as f32], &device);
            ema.update_unless(&m, Some(found_inf)).unwrap();
            if t % 3 == 0 && t != 6 {
                taken.push(params(&m));
            }
        }
        assert_eq!(ema.updates(), 2, "{placement:?}");
        let err = largest_error(&params(&ema.module()), &reference(&taken, 0.6, false));
        assert!(err < 1e-6, "{placement:?}: off by {err}");
    }
}

#[test]
fn misuse_is_a_typed_error_and_changes_nothing() {
    let _s = serial();
    let device = Default::default();
    let m = model(&device);
    for decay in [1.0, -0.1, f64::NAN] {
        let err = ModelEma::new(&m, EmaConfig::new().with_decay(decay)).unwrap_err();
        assert!(matches!(err, EmaError::InvalidDecay(_)), "{decay}: {err}");
    }
    let err = ModelEma::new(&m, EmaConfig::new().with_update_every(0)).unwrap_err();
    assert_eq!(err, EmaError::InvalidUpdateEvery);
    assert!(
        err.to_string().contains("1 to average after every step"),
        "{err}"
    );
    let mut ema = ModelEma::new(&m, EmaConfig::new().with_decay(0.5)).unwrap();
    let before = params(&ema.module());
    let wider = Mlp::<B>::new(D_IN, 32, CLASSES, &device);
    let err = ema.update(&wider).unwrap_err();
    assert_eq!(
        err,
        EmaError::ModelMismatch {
            index: 0,
            expected: vec![D_IN, 16],
            found: vec![D_IN, 32],
            count: 4,
        }
    );
    assert!(
        err.to_string().contains("the model it was made from"),
        "{err}"
    );
    assert_eq!(params(&ema.module()), before, "an update half applied");
    assert_eq!(ema.updates(), 0);
}

/// Found writing these tests: Burn 0.21's `#[derive(Module)]` takes a struct whose backend
/// parameter is not named `B` for a module without parameters (as it takes a constant), and
/// says nothing: its visit and map skip every field, so an optimizer, a record or an average
/// would see no tensor. A canary: it fails once Burn sees the fields.
#[derive(Module, Debug, Clone)]
struct OtherName<B2: Backend> {
    head: Linear<B2>,
}

#[test]
fn burn_derive_module_sees_no_parameter_under_another_backend_name() {
    let device = Default::default();
    let named_b = LinearConfig::new(8, 4).init::<B>(&device);
    let other = OtherName {
        head: named_b.clone(),
    };
    assert_eq!(params(&named_b).len(), 36);
    assert_eq!(
        params::<B, _>(&other).len(),
        0,
        "Burn's derive now sees the fields"
    );
}

/// Found writing the wgpu memory test: Burn 0.21 initializes a parameter at its first use,
/// and a clone of a module made before that use carries the initializer, not the values: the
/// clone draws its own random weights. An average (or any copy) made from a clone of a fresh
/// model starts elsewhere than the model. A canary: it fails once a clone shares the values.
#[test]
fn burn_clone_of_a_fresh_module_draws_other_weights() {
    let _s = serial();
    let device = Default::default();
    let fresh = LinearConfig::new(8, 4).init::<B>(&device);
    let copy = fresh.clone();
    assert_ne!(
        params(&fresh),
        params(&copy),
        "Burn's clone of a fresh module now has its values"
    );
    let used = LinearConfig::new(8, 4).init::<B>(&device);
    let values = params(&used);
    assert_eq!(params(&used.clone()), values, "a clone after a use");
}

/// A tensor above 2^18 values is averaged in host memory on several threads, read in its own
/// dtype (f16, bf16, f32): the same bits as on the device.
#[test]
fn a_large_host_average_is_the_device_average() {
    let _s = serial();
    let device = Default::default();
    for weights in [FloatDType::F16, FloatDType::BF16, FloatDType::F32] {
        B::seed(&device, 4);
        let start = MemorySaving::new()
            .with_weights(weights)
            .prepare(LinearConfig::new(600, 600).init::<B>(&device));
        let mut averages = Vec::new();
        for placement in PLACEMENTS {
            let config = EmaConfig::new().with_decay(0.9).with_placement(placement);
            let mut ema = ModelEma::new(&start, config).unwrap();
            for t in 1..=3 {
                ema.update(&moved(start.clone(), t)).unwrap();
            }
            averages.push(bits(&params(&ema.module())));
        }
        assert!(averages[0].len() > 1 << 18);
        assert!(
            averages[0] == averages[1],
            "{weights:?}: host and device differ"
        );
    }
}

/// A record of another model (a narrower hidden layer), saved and loaded in either placement:
/// a typed error naming the first tensor that differs, and the average as it was (Burn's
/// `load_record` takes any shapes, and the next update failed inside Burn's `sub`).
#[test]
fn a_record_of_another_model_is_refused() {
    let _s = serial();
    let device = Default::default();
    let wide_model = Mlp::<B>::new(D_IN, 32, CLASSES, &device);
    for saved_in in PLACEMENTS {
        let narrow = ModelEma::new(&model(&device), EmaConfig::new().with_placement(saved_in));
        let saved = common::save::<Inner, _>(narrow.unwrap().to_record());
        for loaded_in in PLACEMENTS {
            let config = EmaConfig::new().with_decay(0.5).with_placement(loaded_in);
            let mut wide = ModelEma::new(&wide_model, config).unwrap();
            let before = params(&wide.module());
            let err = wide
                .try_load_record(common::load::<Inner, _>(saved.clone(), &device))
                .unwrap_err();
            let want = EmaError::RecordMismatch {
                index: 0,
                expected: vec![D_IN, 32],
                found: vec![D_IN, 16],
                count: 4,
            };
            assert_eq!(err, want, "saved {saved_in:?}, loaded {loaded_in:?}");
            assert!(
                err.to_string().contains("saved from the same model"),
                "{err}"
            );
            assert_eq!(params(&wide.module()), before, "the average changed");
            wide.update(&wide_model).unwrap();
            assert_eq!(wide.updates(), 1);
        }
    }
}

/// A backend without burn-amp's kernels (ndarray): `ModelEma` needs none of them, and the
/// average is the reference through the burn-op fallback. `has_kernels` names the backends
/// whose updates are the CubeCL kernels.
#[test]
fn a_backend_without_kernels_averages_through_the_burn_ops() {
    use burn::backend::{Autodiff, Flex, Wgpu};
    use burn_amp::Amp;
    use burn_amp::ema::kernels::has_kernels;
    use burn_ndarray::NdArray;
    let _s = serial();
    assert!(has_kernels::<Wgpu>() && has_kernels::<Amp<Wgpu>>());
    assert!(!has_kernels::<NdArray>() && !has_kernels::<Flex>() && !has_kernels::<Amp<Flex>>());
    type N = Autodiff<NdArray>;
    fn values<B2: Backend>(l: &Linear<B2>) -> Vec<f32> {
        let bias = l.bias.as_ref().unwrap().val();
        let mut v = l.weight.val().into_data().to_vec::<f32>().unwrap();
        v.extend(bias.into_data().to_vec::<f32>().unwrap());
        v
    }
    let start = LinearConfig::new(8, 4).init::<N>(&Default::default());
    for placement in PLACEMENTS {
        let config = EmaConfig::new().with_decay(0.9).with_placement(placement);
        let mut ema = ModelEma::new(&start, config).unwrap();
        let mut seen = vec![values(&start)];
        for t in 1..=10 {
            let m = start.clone().map(&mut Moved {
                t: t as f32,
                index: 0,
            });
            ema.update(&m).unwrap();
            seen.push(values(&m));
        }
        let average = values(&ema.module());
        let err = largest_error(&average, &reference(&seen, 0.9, false));
        assert!(err < 2e-6, "{placement:?}: off by {err}");
        assert!(
            largest_error(&average, &reference(&seen[..1], 0.9, false)) > 1e-3,
            "{placement:?}: the average did not move"
        );
    }
}
