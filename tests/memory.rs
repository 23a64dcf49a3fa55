//! Memory figures on wgpu (CubeCL's allocator) against hand-computed byte counts; the
//! out-of-memory guard, the micro-batch finder, the default budget. The Flex figures (counting
//! allocator) are in `memory_counting.rs`: lavapipe allocates device memory from the process
//! heap, so the two cannot share a process.

mod common;

use std::sync::{Mutex, MutexGuard};

/// The wgpu tests take turns: a backward on any thread frees the graphs every thread's
/// forwards left (burn-autodiff's cleanup is process-wide), and the validation-loop test
/// counts those.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::prelude::*;
use burn_amp::memory::DeviceMemory;
use burn_amp::memory::{FreeMemory, MemorySource, budget_from_free, parameter_bytes};
use common::memory::{BATCH, DEPTH, PARAM_BYTES, SAVED, WIDTH, assert_measured, step_report};
use common::models::DeepMlp;

#[test]
fn activations_are_measured_on_wgpu() {
    let _s = serial();
    if common::wgpu_device().is_none() {
        return;
    }
    // Memory is counted per thread: measure on a thread of its own.
    let report = std::thread::spawn(step_report::<Autodiff<Wgpu>>)
        .join()
        .unwrap();
    assert_measured(&report, MemorySource::Allocator);
    // On the device allocator the saved activations dominate this step.
    let text = report.to_string();
    assert!(text.contains("largest: activations"), "{text}");
}

#[test]
fn the_default_budget_is_the_free_memory_less_a_margin() {
    let gib = 1u64 << 30;
    let free = |free| {
        Some(FreeMemory {
            free,
            total: 80 * gib,
        })
    };
    assert_eq!(budget_from_free(free(10 * gib)), Some(9 * gib));
    // At least 256 MiB are kept back.
    assert_eq!(budget_from_free(free(gib)), Some(gib - (256 << 20)));
    assert_eq!(budget_from_free(free(100 << 20)), Some(0));
    assert_eq!(budget_from_free(None), None, "no figure, no budget");
    // wgpu and Flex report no free memory: the guard then has no budget unless given one.
    assert_eq!(Flex::free_memory(&Default::default()), None);
    assert_eq!(
        burn_amp::memory::MemoryGuard::for_device::<Flex>(&Default::default(), None).budget(),
        None
    );
    assert_eq!(
        burn_amp::memory::MemoryGuard::for_device::<Flex>(&Default::default(), Some(5)).budget(),
        Some(5)
    );
}

use burn_amp::memory::{FinderError, GuardError, MemoryGuard, find_micro_batch};

#[test]
fn finder_doubles_then_bisects() {
    // A step at micro-batch b peaks at 1000 + 100 b bytes; the budget is 5000: b <= 40.
    let mut tried = Vec::new();
    let mut guard = MemoryGuard::new(Some(5000));
    let plan = find_micro_batch(100, |b| {
        tried.push(b);
        let peak = 1000 + 100 * b as u64;
        if peak > 5000 {
            // What the guard reports for a step over the budget.
            Err(GuardError::Device(format!("{peak} > 5000")))
        } else {
            guard.set_report(Default::default());
            Ok(Some(peak))
        }
    })
    .unwrap();
    assert_eq!(plan.micro_batch, 40);
    assert_eq!(plan.micro_batches, 3, "ceil(100 / 40)");
    assert_eq!(plan.last_micro_batch, 20, "40 + 40 + 20 = 100");
    assert_eq!(plan.peak_bytes, Some(5000));
    assert_eq!(&tried[..7], &[1, 2, 4, 8, 16, 32, 64], "doubling first");
    assert!(tried.len() <= 14, "O(log target) steps: {tried:?}");

    // Everything fits: one window of the target itself.
    let plan = find_micro_batch(30, |b| Ok(Some(b as u64))).unwrap();
    assert_eq!(
        (plan.micro_batch, plan.micro_batches, plan.last_micro_batch),
        (30, 1, 30)
    );
    assert_eq!(
        find_micro_batch(0, |_| Ok(None)),
        Err(FinderError::TargetTooSmall)
    );
    let nothing = find_micro_batch(8, |_| Err(GuardError::Device("no".into())));
    assert!(matches!(nothing, Err(FinderError::NothingFits(_))));
}

type W = Autodiff<Wgpu>;

/// One guarded training step of the MLP at `batch`; the model is cloned in, so a failure
/// leaves the caller's model as it was.
fn guarded_step(
    guard: &mut MemoryGuard,
    model: &DeepMlp<W>,
    batch: usize,
) -> Result<Option<u64>, GuardError> {
    let device = Default::default();
    let model = model.clone();
    guard
        .run::<W, _>(&device, |peak| {
            let x = Tensor::<W, 2>::ones([batch, WIDTH], &device);
            let loss = model.forward(x).mean();
            peak.sample::<W>(&device);
            let grads = loss.backward();
            peak.sample::<W>(&device);
            drop(grads);
        })
        .map(|_| guard.last_peak())
}

#[test]
fn out_of_memory_under_a_cap_is_typed_and_training_continues_smaller() {
    let _s = serial();
    if common::wgpu_device().is_none() {
        return;
    }
    std::thread::spawn(|| {
        let device = Default::default();
        let model = DeepMlp::<W>::new(WIDTH, DEPTH, &device);
        let _ = parameter_bytes::<W, _>(&model);
        let before: Vec<f32> = model.layers[0].weight.val().into_data().to_vec().unwrap();

        // Measure the step at 512 and at 64 without a cap.
        let mut free = MemoryGuard::new(None);
        let big = guarded_step(&mut free, &model, 512).unwrap().unwrap();
        let small = guarded_step(&mut free, &model, 64).unwrap().unwrap();
        assert!(small < big);

        // A cap between the two: 512 fails with a typed error, 64 still trains.
        let cap = (small + big) / 2;
        let mut guard = MemoryGuard::new(Some(cap));
        guard.set_report(step_report::<W>());
        match guarded_step(&mut guard, &model, 512) {
            Err(GuardError::OutOfMemory(oom)) => {
                assert_eq!(oom.needed, Some(big));
                assert_eq!(oom.budget, Some(cap));
                assert_eq!(oom.dominant, "activations");
                assert!(
                    oom.advice[0].contains("Precision::Bf16"),
                    "{:?}",
                    oom.advice
                );
                assert!(oom.to_string().contains("out of memory"));
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        assert!(
            guarded_step(&mut guard, &model, 64).is_ok(),
            "a smaller micro-batch fits"
        );
        let after: Vec<f32> = model.layers[0].weight.val().into_data().to_vec().unwrap();
        assert_eq!(before, after, "the failed step changed nothing");

        // The finder picks, under several caps, the largest batch whose measured peak fits.
        for cap in [small, (small + big) / 2, big] {
            let mut guard = MemoryGuard::new(Some(cap));
            let mut peaks = std::collections::BTreeMap::new();
            let plan = find_micro_batch(512, |b| {
                let r = guarded_step(&mut guard, &model, b);
                peaks.insert(b, guard.last_peak());
                r
            })
            .unwrap();
            let fit = plan.peak_bytes.unwrap();
            assert!(
                fit <= cap,
                "cap {cap}: chosen {} peaks at {fit}",
                plan.micro_batch
            );
            if plan.micro_batch < 512 {
                let next = peaks.get(&(plan.micro_batch + 1)).copied().flatten();
                assert!(
                    next.is_some_and(|p| p > cap),
                    "cap {cap}: {} + 1 would fit too",
                    plan.micro_batch
                );
            }
            assert_eq!(plan.micro_batches, 512usize.div_ceil(plan.micro_batch));
        }
    })
    .join()
    .unwrap();
}

/// A validation loop on the autodiff model, on the device allocator: each forward's graph is
/// kept until a backward, which frees them all; the watch reports them, at the rate the
/// backward then frees. On `model.valid()` nothing is kept.
#[test]
fn a_validation_loop_without_valid_is_reported_on_wgpu() {
    let _s = serial();
    use burn::module::AutodiffModule;
    use burn_amp::memory::{GrowthCause, GrowthWatch};
    use burn_amp::{Amp, Precision, autocast};
    type B = Amp<Autodiff<Wgpu>>;
    if common::wgpu_device().is_none() {
        return;
    }
    // Memory is counted per thread: on a thread of its own.
    std::thread::spawn(|| {
        let _f32 = autocast(Precision::F32);
        let device = Default::default();
        let in_use = || B::memory_snapshot(&device).unwrap().bytes_in_use;
        let model = DeepMlp::<B>::new(WIDTH, DEPTH, &device);
        let x = Tensor::<B, 2>::ones([BATCH, WIDTH], &device);
        let _ = model.forward(x.clone()).mean().backward();
        let mut watch = GrowthWatch::default();
        let mut forwards = 0;
        let growth = loop {
            drop(model.forward(x.clone()));
            forwards += 1;
            if let Err(growth) = watch.sample::<B>(&device) {
                break growth;
            }
            assert!(forwards < 10, "no report after 10 samples");
        };
        assert_eq!(forwards, 10, "2 samples skipped and a window of 8");
        assert_eq!(growth.cause, GrowthCause::GraphsWithoutBackward, "{growth}");
        // What one backward frees is what the forwards kept.
        let held = in_use();
        let _ = model.forward(x.clone()).mean().backward();
        let per_forward = (held - in_use()) / forwards;
        eprintln!("{growth}\nfreed by the next backward: {per_forward} bytes a forward");
        assert!(
            growth.bytes_per_step.abs_diff(per_forward) < per_forward / 20,
            "reported {} bytes a step, a backward freed {per_forward} a forward",
            growth.bytes_per_step
        );
        // What autodiff saves for backward: the hand count, as on Flex.
        assert!(
            (SAVED..=SAVED + SAVED / 10).contains(&per_forward),
            "{per_forward} bytes a forward, saved activations {SAVED}"
        );

        let valid = model.valid();
        let x = x.inner();
        let mut watch = GrowthWatch::default();
        for _ in 0..20 {
            drop(valid.forward(x.clone()));
            assert_eq!(watch.sample::<B>(&device).err(), None);
        }
    })
    .join()
    .unwrap();
}

/// The weight-cast cache on CubeCL's allocator: an `Lstm` forward at f16 keeps one half copy
/// of its weights, not one per timestep (the exact count is in `tests/memory_counting.rs`).
#[test]
fn a_recurrent_layer_keeps_one_half_copy_of_its_weights_on_wgpu() {
    let _s = serial();
    use burn_amp::{Amp, Precision, autocast};
    use common::memory::{assert_cache_saves, lstm_forward_keeps};
    type B = Amp<Autodiff<Wgpu>>;
    if common::wgpu_device().is_none() {
        return;
    }
    std::thread::spawn(|| {
        let _f16 = autocast(Precision::F16);
        let device = Default::default();
        let in_use = || B::memory_snapshot(&device).unwrap().bytes_in_use;
        let cached = lstm_forward_keeps::<B>(&device, true, in_use);
        let per_use = lstm_forward_keeps::<B>(&device, false, in_use);
        eprintln!("forward keeps: f16 cached {cached}, f16 cast per use {per_use}");
        assert_cache_saves(per_use, cached);
    })
    .join()
    .unwrap();
}

/// Recomputed widening casts and outputs on CubeCL's allocator: SiLU (`x * sigmoid(x)`,
/// sigmoid in f32) over an f16 activation keeps x alone, 2 bytes per element; 6 with
/// sigmoid(x) kept in f32 (outputs not recomputed), 12 with the f32 copies of x kept too (the
/// exact counts on Flex are in `tests/autocast_numerics/{upcast,recompute}.rs`).
#[test]
fn silu_keeps_its_half_input_alone_on_wgpu() {
    let _s = serial();
    use burn::tensor::DType;
    use burn::tensor::activation::silu;
    use burn_amp::backend::{recompute, upcast};
    use burn_amp::{Amp, Precision, autocast};
    type B = Amp<Autodiff<Wgpu>>;
    if common::wgpu_device().is_none() {
        return;
    }
    const N: usize = 1 << 18;
    std::thread::spawn(|| {
        let _f16 = autocast(Precision::F16);
        let device = Default::default();
        let in_use = || B::memory_snapshot(&device).unwrap().bytes_in_use;
        let x = Tensor::<B, 1>::random([N], burn::tensor::Distribution::Default, &device)
            .require_grad();
        let kept_per_element = |widening: bool, outputs: bool| {
            let previous = (upcast::set_enabled(widening), recompute::set_enabled(outputs));
            let _ = silu(x.clone().cast(DType::F16)).sum().backward(); // kernels, pools
            let before = in_use();
            let y = silu(x.clone().cast(DType::F16));
            let kept = in_use() - before - (N * y.dtype().size()) as u64;
            let _ = y.sum().backward();
            upcast::set_enabled(previous.0);
            recompute::set_enabled(previous.1);
            kept as f64 / N as f64
        };
        let both = kept_per_element(true, true);
        let widening = kept_per_element(true, false);
        let none = kept_per_element(false, false);
        eprintln!(
            "silu keeps {both:.2} bytes/element in f16, {widening:.2} with outputs kept, {none:.2} with widened copies kept too"
        );
        for (got, want, what) in [
            (both, 2.0, "recomputed"),
            (widening, 6.0, "outputs kept"),
            (none, 12.0, "widened copies and outputs kept"),
        ] {
            assert!(
                (got - want).abs() < 0.05 * want,
                "{what}: {got:.2} bytes/element, by hand {want}"
            );
        }
    })
    .join()
    .unwrap();
}

/// Adds a constant to every float parameter (a trained model's move).
struct AddToFloats(f32);

impl<B2: burn::tensor::backend::AutodiffBackend> burn::module::ModuleMapper<B2> for AddToFloats {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<B2, D>>,
    ) -> burn::module::Param<Tensor<B2, D>> {
        let (id, value, mapper) = param.consume();
        // A new leaf, as an optimizer's step makes.
        let moved = Tensor::from_inner(value.inner() + self.0).require_grad();
        burn::module::Param::from_mapped_value(id, moved, mapper)
    }
}

/// A weight average on the device costs the model's f32 bytes of device memory; in host
/// memory (`EmaPlacement::Host`) a placeholder per trained tensor, before and after updates;
/// `module()` brings it to the device for as long as the module lives.
#[test]
fn a_host_average_holds_no_device_memory_on_wgpu() {
    let _s = serial();
    use burn_amp::{Amp, EmaConfig, ModelEma, ema::EmaPlacement};
    type B = Amp<Autodiff<Wgpu>>;
    if common::wgpu_device().is_none() {
        return;
    }
    std::thread::spawn(|| {
        let device = Default::default();
        let in_use = || B::memory_snapshot(&device).unwrap().bytes_in_use;
        let model = DeepMlp::<B>::new(WIDTH, DEPTH, &device);
        // Burn initializes a parameter at its first use, and a clone made before draws its
        // own values: read them all first.
        let start = common::models::params(&model);
        let moved = model.clone().map(&mut AddToFloats(0.5));
        let mut held = Vec::new();
        for placement in [EmaPlacement::Device, EmaPlacement::Host] {
            let before = in_use();
            let config = EmaConfig::new().with_decay(0.5).with_placement(placement);
            let mut ema = ModelEma::<B, _>::new(&model, config).unwrap();
            ema.update(&moved).unwrap();
            let kept = in_use() - before;
            let module = ema.module();
            let evaluated = in_use() - before;
            // The update happened: halfway to the moved weights.
            let average = common::models::params(&module);
            let off = average
                .iter()
                .zip(&start)
                .fold(0f32, |m, (a, w)| m.max((a - (w + 0.25)).abs()));
            assert!(off < 1e-6, "{placement:?}: off by {off}");
            eprintln!(
                "{placement:?}: {kept} device bytes kept, {evaluated} with module(); \
                 parameters {PARAM_BYTES}"
            );
            held.push((kept, evaluated));
            drop(module);
        }
        let [(device_kept, _), (host_kept, host_evaluated)] = held[..] else {
            unreachable!()
        };
        assert!(
            (PARAM_BYTES..PARAM_BYTES + PARAM_BYTES / 20).contains(&device_kept),
            "a device average keeps {device_kept} bytes, parameters {PARAM_BYTES}"
        );
        assert!(
            host_kept < PARAM_BYTES / 50,
            "a host average keeps {host_kept} device bytes"
        );
        assert!(
            host_evaluated >= PARAM_BYTES,
            "module() of a host average: {host_evaluated} device bytes"
        );
    })
    .join()
    .unwrap();
}
