//! `EmaOptimizer`: the average kept by the optimizer is bit for bit the one `ModelEma` keeps
//! by hand (the steps not taken passed over, no host read on the device), clones average each
//! step once (burn-train's DDP workers), and its record resumes through a recorder, also when
//! loaded before the average exists. Under burn-train's `Learner`: `tests/learner`.

use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{Adam, AdamConfig};
use burn_amp::ema::{EmaConfig, EmaError, EmaOptimizer, EmaPlacement, ModelEma};
use burn_amp::optim::FusedAdamWConfig;
use common::{ema_reference as reference, largest_error};

use super::*;

type Window = GradientAccumulation<super::shared_scaler::Fused, B>;
type Scaled = AmpOptimizer<Window, B>;

fn scaled() -> Scaled {
    let fused = FusedAdamWConfig::new().init::<B, Mlp<B>>().unwrap();
    let window: Window = GradientAccumulation::new(fused, 2).unwrap();
    AmpOptimizer::new(window, GradScalerConfig::new()).unwrap()
}

fn config(placement: EmaPlacement) -> EmaConfig {
    EmaConfig::new()
        .with_decay(0.8)
        .with_warmup(true)
        .with_placement(placement)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// f16, a window of 2, micro-batch 5 poisoned: the average made at the first step, the steps
/// at micro-batches 1, 3 and 7 averaged (not the window that overflowed), the same bits as
/// `ModelEma::update_after` by hand, and no host read with the average on the device.
#[test]
fn the_optimizer_averages_as_update_after_does() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let device = Default::default();
    for placement in [EmaPlacement::Device, EmaPlacement::Host] {
        let by_hand = {
            let mut optim = scaled();
            let mut m = model(&device);
            let mut ema = ModelEma::new(&m, config(placement)).unwrap();
            let mut taken = vec![params(&m)];
            for i in 0..8 {
                m = step(m, &mut optim, i, i == 5);
                ema.update_after(&m, &optim).unwrap();
                if i % 2 == 1 && i != 5 {
                    taken.push(params(&m));
                }
            }
            let got = params(&ema.module());
            let err = largest_error(&got, &reference(&taken, 0.8, true));
            assert!(err < 1e-6, "{placement:?}: by hand off by {err}");
            got
        };
        let mut optim = EmaOptimizer::new(scaled(), config(placement)).unwrap();
        let average = optim.average();
        assert!(
            average.module().is_none(),
            "an average before the first step"
        );
        let mut m = model(&device);
        let before = host_reads();
        for i in 0..8 {
            m = step(m, &mut optim, i, i == 5);
        }
        let reads = host_reads() - before;
        if placement == EmaPlacement::Device {
            assert_eq!(reads, 0, "host reads in 8 steps with the average");
        }
        assert_eq!(average.updates(), 3, "{placement:?}");
        let got = params(&average.module().unwrap());
        assert_eq!(bits(&got), bits(&by_hand), "{placement:?}");
    }
}

type BurnAdam = OptimizerAdaptor<Adam, Mlp<B>, B>;

/// Two clones stepping the same weights with the same gradients, as DDP's workers do after
/// the all-reduce: each step averaged once, the same bits as one optimizer alone; with
/// Burn's own Adam (always a step).
#[test]
fn clones_average_each_step_once() {
    let _s = serial();
    let device = Default::default();
    let adam = || AdamConfig::new().init::<B, Mlp<B>>();
    let make = || EmaOptimizer::<BurnAdam, B, Mlp<B>>::new(adam(), config(EmaPlacement::Device));
    let mut alone = make().unwrap();
    let mut m = model(&device);
    let mut taken = vec![params(&m)];
    for i in 0..5 {
        m = step(m, &mut alone, i, false);
        taken.push(params(&m));
    }
    let want = params(&alone.average().module().unwrap());
    // Made from the weights of the first step's start.
    let err = largest_error(&want, &reference(&taken, 0.8, true));
    assert!(err < 1e-6, "off by {err}");

    let mut first = make().unwrap();
    let mut second = first.clone();
    let (mut a, mut b) = (model(&device), model(&device));
    for i in 0..5 {
        a = step(a, &mut first, i, false);
        b = step(b, &mut second, i, false);
    }
    assert_eq!(params(&a), params(&b), "the workers' weights");
    assert_eq!(first.average().updates(), 5, "each step once");
    let got = params(&second.average().module().unwrap());
    assert_eq!(bits(&got), bits(&want));
}

/// A window of 3 around Burn's Adam, unscaled (f32): averaged at each boundary only, as the
/// weights it closed with.
#[test]
fn an_unscaled_window_is_averaged_at_its_boundaries() {
    let _s = serial();
    let device = Default::default();
    let window = GradientAccumulation::new(AdamConfig::new().init::<B, Mlp<B>>(), 3).unwrap();
    let mut optim = EmaOptimizer::new(window, config(EmaPlacement::Device)).unwrap();
    let mut m = model(&device);
    let mut taken = vec![params(&m)];
    for i in 0..7 {
        m = step(m, &mut optim, i, false);
        if i % 3 == 2 {
            taken.push(params(&m));
        }
    }
    let average = optim.average();
    assert_eq!(average.updates(), 2);
    let err = largest_error(
        &params(&average.module().unwrap()),
        &reference(&taken, 0.8, true),
    );
    assert!(err < 1e-6, "off by {err}");
}

/// Saved after 3 micro-batches (one update, a window half full, the scale's state), loaded
/// into a new optimizer through a recorder: before its first step the average is pending (its
/// count readable, its record saved again whole), after it the run goes on bit for bit.
#[test]
fn a_record_resumes_through_a_recorder_also_before_the_first_step() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let device = Default::default();
    type Record = <EmaOptimizer<Scaled, B, Mlp<B>> as Optimizer<Mlp<B>, B>>::Record;
    for placement in [EmaPlacement::Device, EmaPlacement::Host] {
        let (saved, whole) = {
            let mut optim = EmaOptimizer::new(scaled(), config(placement)).unwrap();
            let mut m = model(&device);
            let mut saved = None;
            for i in 0..8 {
                if i == 3 {
                    saved = Some((common::save::<B, Record>(optim.to_record()), m.clone()));
                }
                m = step(m, &mut optim, i, i == 5);
            }
            (saved, params(&optim.average().module().unwrap()))
        };
        let (bytes, mut m) = saved.unwrap();
        let optim = EmaOptimizer::new(scaled(), config(placement)).unwrap();
        let optim = optim.load_record(common::load::<B, Record>(bytes, &device));
        assert_eq!(optim.average().updates(), 1, "pending: the count");
        assert!(optim.average().module().is_none());
        // Saved again while pending: the same record.
        let again = common::save::<B, Record>(optim.to_record());
        drop(optim); // one `AmpOptimizer` at a time
        let mut optim = EmaOptimizer::new(scaled(), config(placement))
            .unwrap()
            .load_record(common::load::<B, Record>(again, &device));
        for i in 3..8 {
            m = step(m, &mut optim, i, i == 5);
        }
        assert_eq!(optim.average().updates(), 3, "{placement:?}");
        let got = params(&optim.average().module().unwrap());
        assert_eq!(bits(&got), bits(&whole), "{placement:?}");
    }
}

#[test]
fn a_bad_config_is_refused_before_training() {
    let adam = AdamConfig::new().init::<B, Mlp<B>>();
    let refused = EmaOptimizer::<BurnAdam, B, Mlp<B>>::new(adam, EmaConfig::new().with_decay(1.0));
    assert!(matches!(refused, Err(EmaError::InvalidDecay(d)) if d == 1.0));
    let adam = AdamConfig::new().init::<B, Mlp<B>>();
    let refused =
        EmaOptimizer::<BurnAdam, B, Mlp<B>>::new(adam, EmaConfig::new().with_update_every(0));
    assert!(matches!(refused, Err(EmaError::InvalidUpdateEvery)));
}
