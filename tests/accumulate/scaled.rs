//! Loss scaling (f16): the scaler skips an overflowing window once, unscales before
//! clipping, and refuses to be touched mid-window.

use burn::optim::{AdamConfig, GradientsParams, SgdConfig};
use burn::tensor::backend::AutodiffBackend;
use burn_amp::accumulate::{AccumulationError, GradientAccumulation, GradientAccumulationConfig};
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::scaler::{GradScaler, GradScalerConfig, ScaledStep, ScalerError, Stage};
use burn_amp::{Precision, autocast};

use super::common::big_stack;
use super::*;

type Inner = <A as AutodiffBackend>::InnerBackend;

pub(super) fn scaler(init_scale: f32, growth_interval: u32) -> GradScaler<A> {
    GradScalerConfig::new()
        .with_init_scale(init_scale)
        .with_growth_interval(growth_interval)
        .init::<A>(&Default::default(), Precision::F16)
        .unwrap()
}

/// The scaled gradients of micro-batch `(step, i)`, with NaN in l2's weight when `poison`.
pub(super) fn scaled_grads(
    model: &Mlp<A>,
    scaler: &GradScaler<A>,
    step: usize,
    i: usize,
    poison: bool,
) -> GradientsParams {
    let loss = model.batch_loss(micro(step, i, MICRO, &Default::default()));
    let mut grads = GradientsParams::from_grads(scaler.scale(loss).backward(), model);
    if poison {
        let id = model.l2.weight.id;
        let g = grads.remove::<Inner, 2>(id).unwrap();
        grads.register::<Inner, 2>(id, g.mul_scalar(f32::NAN));
    }
    grads
}

/// Runs `test` under f16 autocast, on a large stack.
pub(super) fn under_f16(test: impl FnOnce() + Send + 'static) {
    big_stack(move || {
        let _g = autocast(Precision::F16);
        test()
    });
}

/// A scaled step that must be refused: its error (the model stays the caller's).
pub(super) fn refused_step<O: ScaledStep<Mlp<A>, A>>(
    scaler: &mut GradScaler<A>,
    accum: &mut GradientAccumulation<O, A>,
    model: &Mlp<A>,
    grads: GradientsParams,
) -> ScalerError {
    scaler
        .step(accum, 1e-2, model.clone(), grads)
        .map(|_| ())
        .unwrap_err()
}

/// Three windows of N; micro-step 2 of window 1 overflows.
fn overflow_skips_the_window_once(fused: bool) {
    under_f16(move || {
        let device = Default::default();
        let mut model = seeded_mlp::<A>(12, &device);
        let mut scaler = scaler(1024.0, 1000);
        let fused_adamw = FusedAdamWConfig::new().init::<A, Mlp<A>>().unwrap();
        let mut accum_fused = GradientAccumulation::new(fused_adamw, N).unwrap();
        let mut accum = adam_accumulation::<A>();
        let mut skipped = Vec::new();
        let mut scales = Vec::new();
        for window in 0..3 {
            let before = bits(&model);
            for i in 0..N {
                let grads = scaled_grads(&model, &scaler, window, i, window == 1 && i == 2);
                let (m, report) = if fused {
                    scaler.step(&mut accum_fused, 1e-2, model, grads).unwrap()
                } else {
                    scaler.step(&mut accum, 1e-2, model, grads).unwrap()
                };
                model = m;
                scaler.update().unwrap();
                assert_eq!(
                    !report.accumulated(),
                    i == N - 1,
                    "an optimizer step only at the boundary"
                );
                assert_eq!(scaler.stage(), Stage::Ready);
                if !report.accumulated() && report.skipped() {
                    skipped.push(window);
                }
            }
            scales.push(scaler.scale_value());
            if window == 1 {
                assert_eq!(
                    bits(&model),
                    before,
                    "the overflowing window changed the model"
                );
            } else {
                assert_ne!(bits(&model), before, "a clean window did not step");
            }
        }
        assert_eq!(skipped, [1], "exactly the overflowing window is skipped");
        assert_eq!(scales, [1024.0, 512.0, 512.0], "one back-off, once");
    });
}

#[test]
fn an_overflow_in_one_micro_step_skips_the_whole_window_once() {
    overflow_skips_the_window_once(false);
}

#[test]
fn an_overflow_in_one_micro_step_skips_the_whole_window_once_fused() {
    overflow_skips_the_window_once(true);
}

#[test]
fn scaled_windows_unscale_before_clipping() {
    under_f16(|| {
        let device = Default::default();
        let init = seeded_mlp::<A>(13, &device);
        let mut model = init.clone();
        let mut scaler = scaler(1024.0, 1000);
        let max_norm = 0.01;
        let mut accum = GradientAccumulationConfig::new(N)
            .with_max_grad_norm(Some(max_norm))
            .init(SgdConfig::new().init::<A, Mlp<A>>())
            .unwrap();
        for i in 0..N {
            let grads = scaled_grads(&model, &scaler, 0, i, false);
            model = scaler.step(&mut accum, 1.0, model, grads).unwrap().0;
            scaler.update().unwrap();
        }
        let norm = update_norm(&model, &init);
        // Clipping the still-scaled sum would give max_norm / 1024.
        assert!((norm - max_norm as f64).abs() < 1e-4, "update norm {norm}");
        // The norm before clipping, unscaled: the update of the same window unclipped.
        let reported = accum.last_grad_norm().unwrap().into_scalar().elem::<f32>() as f64;
        let mut scaler = self::scaler(1024.0, 1000);
        let mut unclipped = GradientAccumulationConfig::new(N)
            .init(SgdConfig::new().init::<A, Mlp<A>>())
            .unwrap();
        let mut model = init.clone();
        for i in 0..N {
            let grads = scaled_grads(&model, &scaler, 0, i, false);
            model = scaler.step(&mut unclipped, 1.0, model, grads).unwrap().0;
            scaler.update().unwrap();
        }
        let want = update_norm(&model, &init);
        assert_norm_before_clipping(reported, want, max_norm, 1e-3);
    });
}

/// A tracked norm in a scaled window (the scaled sums' norm times `1/scale`) is the norm
/// the clipping computes after unscaling, bit for bit (the scale is a power of two), and
/// tracking changes no step; through Burn's SGD and the fused AdamW.
#[test]
fn a_scaled_windows_tracked_norm_is_unscaled() {
    under_f16(|| {
        let device = Default::default();
        let init = seeded_mlp::<A>(13, &device);
        for fused in [false, true] {
            let run = |config: GradientAccumulationConfig| {
                let mut scaler = scaler(1024.0, 1000);
                let model = init.clone();
                fn window<O>(
                    mut accum: GradientAccumulation<O, A>,
                    scaler: &mut GradScaler<A>,
                    mut model: Mlp<A>,
                ) -> (Mlp<A>, Option<f32>)
                where
                    GradientAccumulation<O, A>: ScaledStep<Mlp<A>, A>,
                {
                    for i in 0..N {
                        let grads = scaled_grads(&model, scaler, 0, i, false);
                        model = scaler.step(&mut accum, 1e-2, model, grads).unwrap().0;
                        scaler.update().unwrap();
                    }
                    let norm = accum.last_grad_norm();
                    (model, norm.map(|n| n.into_scalar().elem::<f32>()))
                }
                if fused {
                    let optim = FusedAdamWConfig::new().init::<A, Mlp<A>>().unwrap();
                    window(config.init(optim).unwrap(), &mut scaler, model)
                } else {
                    let optim = SgdConfig::new().init::<A, Mlp<A>>();
                    window(config.init(optim).unwrap(), &mut scaler, model)
                }
            };
            let (plain, none) = run(GradientAccumulationConfig::new(N));
            let (tracked, norm) =
                run(GradientAccumulationConfig::new(N).with_track_grad_norm(true));
            // A bound it never reaches: the clipped run's norm is computed after unscaling.
            let (_, unscaled) =
                run(GradientAccumulationConfig::new(N).with_max_grad_norm(Some(1e6)));
            assert_eq!(none, None, "a norm nobody asked for (fused {fused})");
            assert_eq!(
                bits(&tracked),
                bits(&plain),
                "tracking changed the step (fused {fused})"
            );
            let (norm, unscaled) = (norm.unwrap(), unscaled.unwrap());
            eprintln!("fused {fused}: tracked {norm}, clipping's {unscaled}");
            assert!(norm > 1e-3 && norm < 1e3, "still scaled? {norm}");
            assert_eq!(norm.to_bits(), unscaled.to_bits(), "fused {fused}");
        }
    });
}

#[test]
fn touching_the_scaler_mid_window_is_a_typed_error() {
    under_f16(|| {
        let device = Default::default();
        let mut model = mlp::<A>(&device);
        let mut scaler = scaler(1024.0, 1000);
        let mut accum = adam_accumulation::<A>();

        let grads = scaled_grads(&model, &scaler, 0, 0, false);
        model = scaler.step(&mut accum, 1e-2, model, grads).unwrap().0;
        scaler.update().unwrap();

        // unscale() mid-window.
        let mut grads = scaled_grads(&model, &scaler, 0, 1, false);
        let mut probe = scaler.clone();
        probe.unscale(&model, &mut grads).unwrap();
        let err = refused_step(&mut probe, &mut accum, &model, grads);
        assert_eq!(
            err,
            ScalerError::Accumulation(AccumulationError::ScalerNotReady {
                stage: Stage::Unscaled
            })
        );

        // A whole step + update elsewhere mid-window: the scale may have changed.
        let mut probe = scaler.clone();
        let mut other = AdamConfig::new().init::<A, Mlp<A>>();
        let grads = scaled_grads(&model, &probe, 0, 1, false);
        let (m, _) = probe.step(&mut other, 1e-2, model.clone(), grads).unwrap();
        probe.update().unwrap();
        let grads = scaled_grads(&m, &probe, 0, 1, false);
        let err = refused_step(&mut probe, &mut accum, &model, grads);
        assert_eq!(
            err,
            ScalerError::Accumulation(AccumulationError::ScaleChangedMidWindow { micro_step: 1 })
        );
        assert!(err.to_string().contains("discard_window"));

        // An unscaled step in a scaled window.
        let grads = scaled_grads(&model, &scaler, 0, 1, false);
        let err = accum
            .try_step(1e-2, model.clone(), grads)
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(err, AccumulationError::MixedScaling { .. }),
            "{err:?}"
        );

        // The window is intact: it finishes normally with the untouched scaler.
        assert_eq!(accum.micro_step(), 1);
        for i in 1..N {
            let grads = scaled_grads(&model, &scaler, 0, i, false);
            let (m, report) = scaler.step(&mut accum, 1e-2, model, grads).unwrap();
            model = m;
            scaler.update().unwrap();
            assert_eq!(!report.accumulated(), i == N - 1);
        }
        assert_eq!(accum.optimizer_steps(), 1);

        // And a discarded window starts over.
        let grads = scaled_grads(&model, &scaler, 1, 0, false);
        model = scaler.step(&mut accum, 1e-2, model, grads).unwrap().0;
        scaler.update().unwrap();
        accum.discard_window();
        assert_eq!((accum.micro_step(), accum.buffer_bytes()), (0, 0));
        let grads = scaled_grads(&model, &scaler, 1, 0, false);
        assert!(accum.try_step(1e-2, model, grads).is_ok());
    });
}
