//! The correctness part: the policy suite, the kernels against their fallbacks, a scaled f16
//! step with no host read, accumulation against one big batch. Each case is one JSON line;
//! a failing case is caught (its panic message becomes the line's `error`) and the rest run.

use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::backend::Op;
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::scaler::GradScalerConfig;
use burn_amp::{AmpKernels, AmpOptimizer, GradientAccumulation, Precision, autocast, host_reads};
use burn_std::{DType, FloatDType};
use serde_json::json;

use crate::common::harness::Harness;
use crate::common::models::{Mlp, params};
use crate::common::policy_ops;
use crate::common::tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};
use crate::report::Report;
use crate::{Device, Target, Train, kernel_cases};

/// Runs every case; returns how many failed.
pub fn run<T: Target>(device: &Device<T>, report: &mut Report) -> usize {
    let mut failed = 0;
    let mut record = |suite: &str, case: &str, variant: &str, dtype: &str, outcome: Outcome| {
        failed += usize::from(outcome.error.is_some());
        report.emit(json!({
            "kind": "correctness", "suite": suite, "case": case, "variant": variant,
            "dtype": dtype, "ok": outcome.error.is_none(), "error": outcome.error,
            "detail": outcome.detail, "ms": outcome.ms,
        }));
    };
    let lows = crate::low_precisions::<T>(device);

    // Progress on stderr: a run cut short by its time limit shows where it was.
    for &precision in &lows {
        eprintln!("gpu_check: policy suite at {precision}");
        let outcome = timed(|| policy_suite::<T::Fused>(device, precision));
        record(
            "policy",
            "every op",
            "fusion",
            &precision.to_string(),
            outcome,
        );
    }

    eprintln!("gpu_check: every op against Flex in f32");
    let outcome = timed(|| against_flex_suite::<T::Fused>(device, T::TF32));
    record(
        "policy",
        "every op against Flex, f32",
        "fusion",
        "f32",
        outcome,
    );

    let bf16 = Precision::Bf16.is_supported::<T::Fused>(device);
    eprintln!("gpu_check: kernels against their fallbacks (bf16: {bf16})");
    for (variant, cases) in [
        ("fusion", run_kernels::<T::Fused>(device, bf16)),
        ("cube", run_kernels::<T::Bare>(device, bf16)),
    ] {
        for (name, dtype, outcome) in cases {
            record("kernels", &name, variant, &dtype, outcome);
        }
    }

    eprintln!("gpu_check: scaled f16 step, accumulation");
    let outcome = timed(|| scaled_f16_step::<T>(device));
    record(
        "scaled_step",
        "f16 step: 0 host reads, overflow skipped",
        "fusion",
        "f16",
        outcome,
    );

    for precision in [Precision::F32, Precision::F16] {
        let outcome = timed(|| accumulation::<T>(device, precision));
        let case = "4 micro-batches of b == one batch of 4b";
        record(
            "accumulation",
            case,
            "fusion",
            &precision.to_string(),
            outcome,
        );
    }
    failed
}

/// A case's result: an error (the failure) or a detail (what was measured).
pub struct Outcome {
    pub error: Option<String>,
    pub detail: Option<String>,
    pub ms: f64,
}

/// Runs `f`, catching a panic: `Err` and panics are failures.
pub fn timed(f: impl FnOnce() -> Result<String, String>) -> Outcome {
    let start = Instant::now();
    let result =
        catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| Err(panic_message(panic)));
    let ms = start.elapsed().as_secs_f64() * 1e3;
    match result {
        Ok(detail) => Outcome {
            error: None,
            detail: Some(detail),
            ms,
        },
        Err(error) => {
            eprintln!("FAILED: {error}");
            Outcome {
                error: Some(error),
                detail: None,
                ms,
            }
        }
    }
}

pub fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panicked (no message)".into())
}

fn dtype_name(dtype: Option<FloatDType>) -> String {
    dtype.map_or_else(String::new, |d| format!("{d:?}").to_lowercase())
}

/// Every op of the policy table through `Amp<B>` against `B` in f32 (`tests/autocast_ops.rs`).
fn policy_suite<B: burn_backend::Backend>(
    device: &B::Device,
    precision: Precision,
) -> Result<String, String> {
    let mut h = Harness::<B>::new(device.clone(), precision);
    policy_ops::every_op(&mut h);
    let all: BTreeSet<_> = Op::ALL.iter().map(|op| op.name()).collect();
    let missing: Vec<_> = all.difference(&h.exercised).collect();
    if !h.failures.is_empty() {
        return Err(format!(
            "{} ops broke the policy: {}",
            h.failures.len(),
            h.failures.join("; ")
        ));
    }
    if !missing.is_empty() {
        return Err(format!("ops of the table never exercised: {missing:?}"));
    }
    Ok(format!(
        "{} ops exercised; {} not implemented by the backend itself (fail alike through Amp)",
        h.exercised.len(),
        h.unsupported.len()
    ))
}

/// Every op of the policy table through `Amp<B>`, autocast off, against Flex's in f32
/// (`policy_ops::agree_with_flex`); `tf32`: matmuls may run in TF32.
fn against_flex_suite<B: burn_backend::Backend>(
    device: &B::Device,
    tf32: bool,
) -> Result<String, String> {
    let agreed = policy_ops::agree_with_flex::<B>(device, tf32)?;
    Ok(format!(
        "{} ops on [0.1, 0.9], {} on [-4, 4] within 1e-5 + 1e-4 |Flex's| of Flex's{}",
        agreed[0],
        agreed[1],
        if tf32 { " (matmuls 2e-3: TF32)" } else { "" },
    ))
}

/// Every kernel case on `B`; bf16 cases only where the device has bf16.
fn run_kernels<B: AmpKernels>(device: &B::Device, bf16: bool) -> Vec<(String, String, Outcome)> {
    kernel_cases::all::<B>()
        .into_iter()
        .filter(|case| bf16 || case.dtype != Some(FloatDType::BF16))
        .map(|case| {
            let outcome = timed(|| {
                (case.run)(device);
                Ok("kernel == fallback within the tests' tolerances".into())
            });
            (case.name, dtype_name(case.dtype), outcome)
        })
        .collect()
}

/// The backend under autodiff, where gradients live.
type Inner<T> = <Train<T> as AutodiffBackend>::InnerBackend;

/// Six f16 steps of a small transformer under the loss scaler with the fused AdamW: after the
/// first (kernels compiled, state made) none reads the device, an overflow planted in step 3
/// is skipped on the device and halves the scale, and the weights stay f32 and move.
fn scaled_f16_step<T: Target>(device: &Device<T>) -> Result<String, String> {
    let _g = autocast(Precision::F16);
    Train::<T>::seed(device, 7);
    let config = TinyLmConfig::new()
        .with_d_model(64)
        .with_seq_len(16)
        .with_d_ff(128)
        .with_dropout(0.0);
    let mut model: TinyLm<Train<T>> = config.init(device);
    let mut task = ReversalTask::new(config.vocab, config.seq_len, 7);
    let adamw = FusedAdamWConfig::new()
        .init::<Train<T>, TinyLm<Train<T>>>()
        .map_err(|e| e.to_string())?;
    let mut optim = AmpOptimizer::new(adamw, GradScalerConfig::new()).map_err(|e| e.to_string())?;
    let mut step = |model: TinyLm<Train<T>>, poison: bool| -> Result<TinyLm<Train<T>>, String> {
        let (x, y) = task.batch::<Train<T>>(8, device);
        let loss = model.loss(x, y);
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        if poison {
            let id = model.head.weight.id;
            let g = grads
                .remove::<Inner<T>, 2>(id)
                .ok_or("no gradient of head")?;
            grads.register::<Inner<T>, 2>(id, g.mul_scalar(f32::NAN));
        }
        optim
            .try_step(1e-3, model, grads)
            .map_err(|e| e.to_string())
    };
    model = step(model, false)?;
    let before = model.head.weight.val().into_data();
    let reads = host_reads();
    for i in 1..6 {
        model = step(model, i == 3)?;
    }
    let reads = host_reads() - reads;
    let snapshot = optim.monitor().snapshot();
    let weight = model.head.weight.val();
    let dtype = weight.dtype();
    let after = weight.into_data().convert::<f32>().to_vec::<f32>().unwrap();
    let before = before.convert::<f32>().to_vec::<f32>().unwrap();
    let moved = after.iter().zip(&before).filter(|(a, b)| a != b).count();
    let mut problems = Vec::new();
    if reads != 0 {
        problems.push(format!("{reads} host reads in 5 scaled steps (expected 0)"));
    }
    if (snapshot.skipped_steps, snapshot.optimizer_steps) != (1, 6) {
        problems.push(format!(
            "skipped {} of {} steps (expected 1 of 6)",
            snapshot.skipped_steps, snapshot.optimizer_steps
        ));
    }
    if snapshot.scale != 32768.0 {
        problems.push(format!(
            "scale {} (expected 32768 after one overflow)",
            snapshot.scale
        ));
    }
    if dtype != DType::F32 {
        problems.push(format!("head weight stored as {dtype:?} (expected F32)"));
    }
    if !after.iter().all(|v| v.is_finite()) || moved * 2 < after.len() {
        problems.push(format!(
            "head weight: {moved} of {} moved, finite: {}",
            after.len(),
            after.iter().all(|v| v.is_finite())
        ));
    }
    if problems.is_empty() {
        Ok(format!(
            "0 host reads in 5 steps; 1 of 6 skipped; scale 32768; {moved}/{} weights moved",
            after.len()
        ))
    } else {
        Err(problems.join("; "))
    }
}

/// Three SGD steps on batches of 4b against three windows of 4 micro-batches of b through
/// `GradientAccumulation`, under the `AmpOptimizer` (the scaler at f16). The parameters agree
/// to f32 summation order (f32: `1e-5 + 1e-3 · moved`, room for TF32 matmuls) or to f16
/// rounding of the matmul gradients (f16: `5e-3 · moved`), where `moved` is how far the run
/// moved the parameters.
fn accumulation<T: Target>(device: &Device<T>, precision: Precision) -> Result<String, String> {
    const N: usize = 4;
    const B: usize = 16;
    const D_IN: usize = 32;
    const CLASSES: usize = 8;
    let lr = 0.5;
    let _g = autocast(precision);
    Train::<T>::seed(device, 11);
    let init: Mlp<Train<T>> = Mlp::new(D_IN, 64, CLASSES, device);
    let data = |step: usize, rows: std::ops::Range<usize>| {
        let mut rng = crate::common::Rng::new(100 + step as u64);
        let x = rng.vec(N * B * D_IN, 1.0);
        let y: Vec<i64> = (0..N * B)
            .map(|i| ((i * 5 + step) % CLASSES) as i64)
            .collect();
        let n = rows.len();
        (
            Tensor::<Train<T>, 2>::from_data(
                TensorData::new(x[rows.start * D_IN..rows.end * D_IN].to_vec(), [n, D_IN]),
                device,
            ),
            Tensor::<Train<T>, 1, Int>::from_data(TensorData::new(y[rows].to_vec(), [n]), device),
        )
    };
    let grads_of = |model: &Mlp<Train<T>>, (x, y)| {
        GradientsParams::from_grads(model.loss(x, y).backward(), model)
    };

    let mut one = init.clone();
    {
        let sgd = SgdConfig::new().init::<Train<T>, Mlp<Train<T>>>();
        let mut optim =
            AmpOptimizer::new(sgd, GradScalerConfig::new()).map_err(|e| e.to_string())?;
        for step in 0..3 {
            let grads = grads_of(&one, data(step, 0..N * B));
            one = optim.step(lr, one, grads);
        }
    }
    let mut many = init.clone();
    {
        let sgd = SgdConfig::new().init::<Train<T>, Mlp<Train<T>>>();
        let window = GradientAccumulation::new(sgd, N).map_err(|e| e.to_string())?;
        let mut optim =
            AmpOptimizer::new(window, GradScalerConfig::new()).map_err(|e| e.to_string())?;
        for step in 0..3 {
            for i in 0..N {
                let grads = grads_of(&many, data(step, i * B..(i + 1) * B));
                many = optim.step(lr, many, grads);
            }
        }
    }
    let (a, b, start) = (
        params(&one.valid()),
        params(&many.valid()),
        params(&init.valid()),
    );
    let max_diff = |u: &[f32], v: &[f32]| {
        u.iter()
            .zip(v)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    let moved = max_diff(&a, &start);
    let err = max_diff(&a, &b);
    let tol = match precision {
        Precision::F32 => 1e-5 + 1e-3 * moved,
        _ => 5e-3 * moved,
    };
    let finite = a.iter().chain(&b).all(|v| v.is_finite());
    if !finite || moved < 1e-2 || err > tol {
        return Err(format!(
            "{precision}: micro-batches vs one batch differ by {err:.3e} (tolerance {tol:.3e}); \
             the run moved the parameters by {moved:.3e}; all finite: {finite}"
        ));
    }
    Ok(format!(
        "max |difference| {err:.3e} (tolerance {tol:.3e}), parameters moved {moved:.3e}"
    ))
}
