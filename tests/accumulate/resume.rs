//! Save and resume: a run stopped mid-window resumes bit for bit, plain and scaled; a
//! record of another scale or window size is refused.

use burn::optim::{Optimizer, SgdConfig};
use burn_amp::accumulate::{AccumulationError, GradientAccumulation};
use burn_amp::scaler::{GradScaler, GradScalerRecord, ScaledStep, ScalerError};

use super::scaled::{refused_step, scaled_grads, scaler, under_f16};
use super::*;

const WINDOWS: usize = 3;

/// Micro-steps `range` (numbered over the whole run) of unscaled training.
fn run_plain(
    mut model: Mlp<F>,
    accum: &mut GradientAccumulation<impl Optimizer<Mlp<F>, F>, F>,
    range: std::ops::Range<usize>,
) -> Mlp<F> {
    let device = Default::default();
    for k in range {
        let grads = micro_grads(&model, k / N, k % N, &device);
        model = accum.step(1e-2, model, grads);
    }
    model
}

#[test]
fn resume_after_micro_step_k_is_bit_identical() {
    let device = Default::default();
    let init = seeded_mlp::<F>(14, &device);
    let total = WINDOWS * N;

    let mut accum = adam_accumulation::<F>();
    let straight = run_plain(init.clone(), &mut accum, 0..total);

    for stop in [1, N + 2, 2 * N - 1] {
        let mut accum = adam_accumulation::<F>();
        let half = run_plain(init.clone(), &mut accum, 0..stop);
        let model_bytes = common::save::<F, _>(half.into_record());
        let accum_bytes = common::save::<F, _>(Optimizer::<Mlp<F>, F>::to_record(&accum));

        let model = mlp::<F>(&device).load_record(common::load::<F, _>(model_bytes, &device));
        let mut accum = Optimizer::<Mlp<F>, F>::load_record(
            adam_accumulation::<F>(),
            common::load::<F, _>(accum_bytes, &device),
        );
        assert_eq!(accum.micro_step(), stop % N);
        let resumed = run_plain(model, &mut accum, stop..total);
        assert_eq!(
            bits(&resumed),
            bits(&straight),
            "resumed after micro-step {stop}"
        );
        assert_eq!(accum.optimizer_steps(), WINDOWS as u64);
    }
}

/// Micro-steps `range` of f16 loss-scaled training; micro-step 5 (window 1) overflows.
fn run_scaled<O: ScaledStep<Mlp<A>, A>>(
    mut model: Mlp<A>,
    scaler: &mut GradScaler<A>,
    accum: &mut GradientAccumulation<O, A>,
    range: std::ops::Range<usize>,
) -> Mlp<A> {
    for k in range {
        let grads = scaled_grads(&model, scaler, k / N, k % N, k == 5);
        model = scaler.step(accum, 1e-2, model, grads).unwrap().0;
        scaler.update().unwrap();
    }
    model
}

#[test]
fn resume_after_micro_step_k_is_bit_identical_scaled() {
    under_f16(|| {
        let device = Default::default();
        let init = seeded_mlp::<A>(15, &device);
        let total = WINDOWS * N;

        let mut scaler_a = scaler(1024.0, 1);
        let mut accum = adam_accumulation::<A>();
        let straight = run_scaled(init.clone(), &mut scaler_a, &mut accum, 0..total);
        let straight_scaler = scaler_a.record();
        // The overflow and the growth moved the scale: the trajectory was exercised.
        assert_eq!(straight_scaler.scale, 1024.0 * 2.0 / 2.0 * 2.0);

        // Stopped inside the overflowing window, after the overflow, and in the last one.
        for stop in [6, 2 * N + 1] {
            let mut scaler_b = scaler(1024.0, 1);
            let mut accum = adam_accumulation::<A>();
            let half = run_scaled(init.clone(), &mut scaler_b, &mut accum, 0..stop);
            let model_bytes = common::save::<A, _>(half.into_record());
            let accum_bytes = common::save::<A, _>(Optimizer::<Mlp<A>, A>::to_record(&accum));
            let scaler_bytes = common::save::<A, _>(scaler_b.record());

            let model = mlp::<A>(&device).load_record(common::load::<A, _>(model_bytes, &device));
            let mut accum = Optimizer::<Mlp<A>, A>::load_record(
                adam_accumulation::<A>(),
                common::load::<A, _>(accum_bytes, &device),
            );
            let scaler_record: GradScalerRecord = common::load::<A, _>(scaler_bytes, &device);
            let mut scaler_b = scaler(1024.0, 1).load_record(scaler_record);
            let resumed = run_scaled(model, &mut scaler_b, &mut accum, stop..total);
            assert_eq!(
                bits(&resumed),
                bits(&straight),
                "resumed after micro-step {stop}"
            );
            assert_eq!(scaler_b.record(), straight_scaler);
        }
    });
}

/// A partial window remembers the loss scale its sums carry: resumed beside a scaler of
/// another scale it refuses the micro-step (nothing accumulated, nothing lost) instead of
/// summing gradients of two scales.
#[test]
fn a_resumed_window_refuses_another_scale() {
    under_f16(|| {
        let device = Default::default();
        let init = seeded_mlp::<A>(18, &device);
        let mut scaler_a = scaler(1024.0, 1000);
        let mut accum = adam_accumulation::<A>();
        let model = run_scaled(init, &mut scaler_a, &mut accum, 0..2);
        let record = Optimizer::<Mlp<A>, A>::to_record(&accum);
        assert_eq!(record.window_scale, Some(1024.0));
        let bytes = common::save::<A, _>(record);

        let mut resumed = Optimizer::<Mlp<A>, A>::load_record(
            adam_accumulation::<A>(),
            common::load::<A, _>(bytes, &device),
        );
        let mut other = scaler(2048.0, 1000);
        let grads = scaled_grads(&model, &other, 0, 2, false);
        let err = refused_step(&mut other, &mut resumed, &model, grads);
        assert_eq!(
            err,
            ScalerError::Accumulation(AccumulationError::WindowScaleMismatch {
                window_scale: 1024.0,
                scaler_scale: 2048.0
            })
        );
        assert_eq!(
            resumed.micro_step(),
            2,
            "the refused micro-step added nothing"
        );
        // With the scaler it was saved beside, the window goes on.
        let model = run_scaled(model, &mut scaler_a, &mut resumed, 2..N);
        assert_eq!(resumed.optimizer_steps(), 1);
        let _ = model;
    });
}

#[test]
fn a_record_of_another_window_size_is_refused() {
    let accum = GradientAccumulation::new(SgdConfig::new().init::<F, Mlp<F>>(), 4).unwrap();
    let record = Optimizer::<Mlp<F>, F>::to_record(&accum);
    let other = GradientAccumulation::new(SgdConfig::new().init::<F, Mlp<F>>(), 2).unwrap();
    let err = other
        .try_load_record::<Mlp<F>>(record)
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(
        err,
        AccumulationError::RecordMismatch {
            saved_micro_batches: 4,
            micro_batches: 2,
            ..
        }
    ));
}

/// A scaled window's partial sums carry the loss scale (65536 here): through Burn's
/// half-precision recorder (`CompactRecorder`'s) they would be saved as f16, rounded (and
/// inf above 65504, the resumed window then skipped for an overflow it never had). They come
/// back as saved: the run resumes bit for bit, the scale's trajectory too.
#[test]
fn a_scaled_window_resumes_exactly_through_a_half_precision_recorder() {
    use burn::record::{BinBytesRecorder, HalfPrecisionSettings, Recorder};
    under_f16(|| {
        let device = Default::default();
        let init = seeded_mlp::<A>(16, &device);
        // Plain SGD: no state of its own, which the half-precision recorder would round.
        let sgd = || GradientAccumulation::new(SgdConfig::new().init::<A, Mlp<A>>(), N).unwrap();
        let run = |mut model: Mlp<A>,
                   scaler: &mut GradScaler<A>,
                   accum: &mut GradientAccumulation<_, A>,
                   range: std::ops::Range<usize>| {
            for k in range {
                let grads = scaled_grads(&model, scaler, k / N, k % N, false);
                model = scaler.step(accum, 1e-2, model, grads).unwrap().0;
                scaler.update().unwrap();
            }
            model
        };
        let total = 2 * N;
        let mut scaler_a = scaler(65536.0, 1000);
        let mut accum = sgd();
        let straight = run(init.clone(), &mut scaler_a, &mut accum, 0..total);
        assert_eq!(
            scaler_a.record().scale,
            65536.0,
            "no overflow in the straight run"
        );

        let stop = N + 3;
        let mut scaler_b = scaler(65536.0, 1000);
        let mut accum = sgd();
        let half = run(init.clone(), &mut scaler_b, &mut accum, 0..stop);
        let recorder = BinBytesRecorder::<HalfPrecisionSettings>::default();
        let record = Optimizer::<Mlp<A>, A>::to_record(&accum);
        let largest = record
            .buffers
            .values()
            .flat_map(|b| b.acc.0.clone().into_data().to_vec::<f32>().unwrap())
            .fold(0f32, |m, v| m.max(v.abs()));
        eprintln!("largest partial sum saved: {largest}");
        let accum_bytes = recorder.record(record, ()).unwrap();
        let mut accum = Optimizer::<Mlp<A>, A>::load_record(
            sgd(),
            recorder.load(accum_bytes, &device).unwrap(),
        );
        assert_eq!(accum.micro_step(), stop % N);
        let resumed = run(half, &mut scaler_b, &mut accum, stop..total);
        assert_eq!(
            bits(&resumed),
            bits(&straight),
            "resumed after micro-step {stop}"
        );
        assert_eq!(scaler_b.record(), scaler_a.record());
    });
}
