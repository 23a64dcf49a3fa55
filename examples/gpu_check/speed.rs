//! The speed part: training steps of a transformer and of a deep MLP at f32, bf16 and f16
//! (fused AdamW; the loss scaler at f16), the fused unscale + inf/NaN check's bandwidth, and
//! a weight average's update on the device and in host memory.
//!
//! A step is forward, backward and the optimizer step, timed from its start until the device
//! has finished it (`sync`), after untimed warm-up steps (kernel compilation, autotune); the
//! median of the timed steps is reported. CubeCL keeps no peak, so the peak memory is the
//! highest of the allocator's in-use bytes sampled on one extra step after forward (the saved
//! activations are live), after backward and after the optimizer step: a lower bound of the
//! true peak (PyTorch's `max_memory_allocated` is exact).

use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::{Distribution, TensorPrimitive};
use burn_amp::memory::{DeviceMemory, PeakMemory};
use burn_amp::optim::FusedAdamWConfig;
use burn_amp::scaler::GradScalerConfig;
use burn_amp::{AmpKernels, AmpOptimizer, Precision, autocast, host_reads};
use burn_std::{DType, FloatDType};
use serde_json::{Value, json};

use crate::common;
use crate::common::models::DeepMlp;
use crate::common::tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};
use crate::correctness::panic_message;
use crate::report::Report;
use crate::{Device, Target, Train};

/// The measured sizes.
pub struct Sizes {
    pub lm: TinyLmConfig,
    pub lm_batch: usize,
    pub mlp_width: usize,
    pub mlp_depth: usize,
    pub mlp_batch: usize,
    /// Gradient elements of the bandwidth measurement, in 16 tensors.
    pub bandwidth_elements: usize,
    /// The f16 model of the weight average's placements: `[width, layers]`.
    pub ema_model: [usize; 2],
}

impl Sizes {
    /// Compute-bound on an H200: the transformer of the issue (d_model 1024, 8 heads, seq 512,
    /// 8 layers, batch 16) and the MLP of `benches/autocast.rs` at width 4096.
    pub fn full() -> Self {
        Self {
            lm: TinyLmConfig::new()
                .with_vocab(256)
                .with_seq_len(512)
                .with_d_model(1024)
                .with_n_heads(8)
                .with_n_layers(8)
                .with_d_ff(4096)
                .with_dropout(0.0),
            lm_batch: 16,
            mlp_width: 4096,
            mlp_depth: 8,
            mlp_batch: 2048,
            bandwidth_elements: 1 << 28,
            // 134M parameters: 268 MB of f16 weights, a 537 MB f32 average.
            ema_model: [4096, 8],
        }
    }

    /// A smoke run of the same code.
    pub fn quick() -> Self {
        Self {
            lm: TinyLmConfig::new()
                .with_vocab(16)
                .with_seq_len(16)
                .with_d_model(64)
                .with_n_heads(4)
                .with_n_layers(2)
                .with_d_ff(128)
                .with_dropout(0.0),
            lm_batch: 4,
            mlp_width: 64,
            mlp_depth: 2,
            mlp_batch: 32,
            bandwidth_elements: 1 << 16,
            ema_model: [64, 2],
        }
    }
}

/// Measures every model at every precision the device has, then the bandwidth; `false` if a
/// measurement failed.
pub fn run<T: Target>(
    device: &Device<T>,
    sizes: &Sizes,
    steps: usize,
    warmup: usize,
    report: &mut Report,
) -> bool {
    let mut ok = true;
    let precisions = [Precision::F32, Precision::Bf16, Precision::F16];
    for model in ["transformer", "mlp"] {
        for precision in precisions {
            if !precision.is_supported::<T::Fused>(device) {
                report.emit(
                    json!({"kind": "skipped", "what": format!("{model} {precision}"),
                    "why": format!("{} has no {precision}", T::NAME)}),
                );
                continue;
            }
            eprintln!("gpu_check: {model} at {precision}");
            let timing = Timing { steps, warmup };
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _g = autocast(precision);
                match model {
                    "transformer" => transformer::<T>(device, sizes, timing),
                    _ => mlp::<T>(device, sizes, timing),
                }
            }))
            .unwrap_or_else(|p| Err(panic_message(p)));
            match result {
                Ok(measured) => {
                    report.emit(
                        json!({"kind": "warmup", "what": format!("{model} {precision}"),
                        "seconds": measured.warmup_s}),
                    );
                    let mut record = measured.record;
                    record["model"] = json!(model);
                    record["precision"] = json!(precision.to_string());
                    report.emit(record);
                }
                Err(error) => {
                    ok = false;
                    eprintln!("FAILED: {model} {precision}: {error}");
                    report.emit(json!({"kind": "error", "impl": "burn-amp", "model": model,
                        "precision": precision.to_string(), "error": error}));
                }
            }
            <T::Fused as Backend>::memory_cleanup(device);
        }
    }
    // What "f32" measured: f32 matmuls at the transformer's feed-forward size, after its
    // autotune, against an f64 reference.
    let m = sizes.lm_batch * sizes.lm.seq_len;
    let (k, n) = (sizes.lm.d_model, sizes.lm.d_ff);
    let probe = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        f32_matmul_error::<T::Fused>(device, [m, k, n])
    }))
    .unwrap_or_else(|p| Err(panic_message(p)));
    match probe {
        Ok(rel_l2) => report.emit(json!({"kind": "probe", "impl": "burn-amp",
            "what": "f32 matmul", "shape": [m, k, n], "rel_l2": rel_l2,
            "tf32": rel_l2 > F32_MATMUL_BOUND})),
        Err(error) => report.emit(json!({"kind": "error", "impl": "burn-amp",
            "what": "f32 matmul probe", "error": error})),
    }

    let mut dtypes = vec![FloatDType::F32, FloatDType::F16];
    if Precision::Bf16.is_supported::<T::Fused>(device) {
        dtypes.push(FloatDType::BF16);
    }
    for dtype in dtypes {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            bandwidth::<T::Fused>(device, dtype, sizes.bandwidth_elements, steps.max(5))
        }))
        .unwrap_or_else(|p| Err(panic_message(p)));
        match result {
            Ok(record) => report.emit(record),
            Err(error) => {
                ok = false;
                report.emit(
                    json!({"kind": "error", "impl": "burn-amp", "model": "bandwidth",
                    "precision": format!("{dtype:?}"), "error": error}),
                );
            }
        }
        <T::Fused as Backend>::memory_cleanup(device);
    }

    // A weight average on the device and in host memory (`EmaPlacement`): what the host one
    // costs per step, against the device bytes it saves.
    let [width, layers] = sizes.ema_model;
    let in_use = || T::Fused::memory_snapshot(device).map_or(0, |s| s.bytes_in_use);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        common::ema_placements::measure::<Train<T>>(device, width, layers, 5, in_use)
    }))
    .map_err(panic_message);
    match result {
        Ok(placements) => {
            for p in placements {
                report.emit(json!({"kind": "ema", "impl": "burn-amp", "average": p.name,
                    "placement": format!("{:?}", p.placement).to_lowercase(),
                    "every": p.every, "overflow_flag": p.flagged, "ms_per_step": p.ms_per_step,
                    "device_bytes": p.device_bytes,
                    "weight_bytes": common::ema_placements::weight_bytes(width, layers),
                    "model": format!("f16, {layers} x {width}^2")}));
            }
        }
        Err(error) => {
            ok = false;
            report.emit(json!({"kind": "error", "impl": "burn-amp", "model": "ema",
                "error": error}));
        }
    }
    <T::Fused as Backend>::memory_cleanup(device);
    ok
}

/// Above this relative L2 error an f32 matmul of depth ~1000 did not run in f32: f32
/// accumulation lands near 1e-7, TF32 operands (10-bit mantissa) near 3e-4.
const F32_MATMUL_BOUND: f64 = 1e-5;

/// The relative L2 error of an f32 `[m, k] x [k, n]` matmul on `B` (its second call, after
/// any autotune) against f64 arithmetic on the host, over its first 8 rows.
fn f32_matmul_error<B: Backend>(device: &B::Device, [m, k, n]: [usize; 3]) -> Result<f64, String> {
    let mut rng = crate::common::Rng::new(5);
    // Full 24-bit mantissas: TF32 keeps 10 of them.
    let a: Vec<f32> = (0..m * k).map(|_| rng.unit() * 2.0 - 1.0).collect();
    let b: Vec<f32> = (0..k * n).map(|_| rng.unit() * 2.0 - 1.0).collect();
    let lhs = Tensor::<B, 2>::from_data(TensorData::new(a.clone(), [m, k]), device);
    let rhs = Tensor::<B, 2>::from_data(TensorData::new(b.clone(), [k, n]), device);
    let _ = lhs.clone().matmul(rhs.clone()).into_data();
    let rows = m.min(8);
    let got = lhs.matmul(rhs).slice([0..rows, 0..n]).into_data();
    let got = got.to_vec::<f32>().map_err(|e| format!("{e:?}"))?;
    let (mut err, mut norm) = (0f64, 0f64);
    for i in 0..rows {
        for j in 0..n {
            let want: f64 = (0..k)
                .map(|l| a[i * k + l] as f64 * b[l * n + j] as f64)
                .sum();
            err += (got[i * n + j] as f64 - want).powi(2);
            norm += want * want;
        }
    }
    Ok((err / norm.max(1e-300)).sqrt())
}

#[derive(Clone, Copy)]
struct Timing {
    steps: usize,
    warmup: usize,
}

struct Measured {
    record: Value,
    warmup_s: f64,
}

fn transformer<T: Target>(
    device: &Device<T>,
    sizes: &Sizes,
    timing: Timing,
) -> Result<Measured, String> {
    Train::<T>::seed(device, 42);
    let config = &sizes.lm;
    let model: TinyLm<Train<T>> = config.init(device);
    let mut task = ReversalTask::new(config.vocab, config.seq_len, 42);
    // A few batches made up front and cycled: the step, not the host's data, is measured.
    let batches: Vec<_> = (0..4)
        .map(|_| task.batch::<Train<T>>(sizes.lm_batch, device))
        .collect();
    let mut measured = train_steps::<T, _>(device, model, timing, |m, i| {
        let (x, y) = batches[i % batches.len()].clone();
        m.loss(x, y)
    })?;
    let tokens = sizes.lm_batch * config.seq_len;
    measured.set_tokens(tokens);
    measured.record["sizes"] = json!({
        "vocab": config.vocab, "seq": config.seq_len, "d_model": config.d_model,
        "heads": config.n_heads, "layers": config.n_layers, "d_ff": config.d_ff,
        "batch": sizes.lm_batch,
    });
    Ok(measured)
}

fn mlp<T: Target>(device: &Device<T>, sizes: &Sizes, timing: Timing) -> Result<Measured, String> {
    Train::<T>::seed(device, 42);
    let model: DeepMlp<Train<T>> = DeepMlp::new(sizes.mlp_width, sizes.mlp_depth, device);
    let x = Tensor::<Train<T>, 2>::random(
        [sizes.mlp_batch, sizes.mlp_width],
        Distribution::Default,
        device,
    );
    let mut measured = train_steps::<T, _>(device, model, timing, |m, _| {
        m.forward(x.clone()).powi_scalar(2).mean()
    })?;
    measured.set_tokens(sizes.mlp_batch);
    measured.record["sizes"] = json!({
        "width": sizes.mlp_width, "depth": sizes.mlp_depth, "batch": sizes.mlp_batch,
    });
    Ok(measured)
}

impl Measured {
    /// Tokens (samples for the MLP) per step, and their rate at the median step time.
    fn set_tokens(&mut self, tokens: usize) {
        let ms = self.record["ms_per_step"].as_f64().unwrap_or(f64::NAN);
        self.record["tokens_per_step"] = json!(tokens);
        self.record["tokens_per_s"] = json!(tokens as f64 / (ms / 1e3));
    }
}

/// The training loop under measurement: `loss(model, step)` then a plain backward and
/// `AmpOptimizer::try_step` with the fused AdamW, as a user's loop writes it.
fn train_steps<T: Target, M>(
    device: &Device<T>,
    mut model: M,
    timing: Timing,
    loss: impl Fn(&M, usize) -> Tensor<Train<T>, 1>,
) -> Result<Measured, String>
where
    M: AutodiffModule<Train<T>>,
{
    let adamw = FusedAdamWConfig::new()
        .with_weight_decay(0.0)
        .init::<Train<T>, M>()
        .map_err(|e| e.to_string())?;
    let mut optim = AmpOptimizer::new(adamw, GradScalerConfig::new()).map_err(|e| e.to_string())?;
    let sync = || <T::Fused as Backend>::sync(device).map_err(|e| format!("sync: {e:?}"));
    let mut last_loss = None;
    let mut step = |model: M, i: usize, peak: Option<&mut PeakMemory>| {
        let l = loss(&model, i);
        let mut peak = peak;
        let mut sample = || {
            if let Some(p) = peak.as_deref_mut() {
                p.sample::<T::Fused>(device);
            }
        };
        sample();
        let grads = GradientsParams::from_grads(l.backward(), &model);
        sample();
        last_loss = Some(l.inner());
        let model = optim
            .try_step(1e-4, model, grads)
            .map_err(|e| e.to_string());
        sample();
        model
    };

    let start = Instant::now();
    for i in 0..timing.warmup {
        model = step(model, i, None)?;
    }
    sync()?;
    let warmup_s = start.elapsed().as_secs_f64();

    let reads = host_reads();
    let mut times = Vec::with_capacity(timing.steps);
    for i in 0..timing.steps {
        let t = Instant::now();
        model = step(model, timing.warmup + i, None)?;
        sync()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let reads = host_reads() - reads;

    // One more step, sampled: the memory figures wait for the device.
    let mut peak = PeakMemory::default();
    peak.sample::<T::Fused>(device);
    model = step(model, timing.warmup + timing.steps, Some(&mut peak))?;
    let peak_bytes = <T::Fused as DeviceMemory>::memory_snapshot(device).map(|_| peak.peak);
    let final_loss = last_loss
        .map(|l| l.into_scalar().elem::<f32>())
        .unwrap_or(f32::NAN);
    let skipped = optim.monitor().snapshot().skipped_steps;
    drop(model);

    times.sort_by(f64::total_cmp);
    let pick = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    Ok(Measured {
        record: json!({
            "kind": "speed", "impl": "burn-amp", "backend": T::NAME,
            "ms_per_step": pick(0.5), "ms_p10": pick(0.1), "ms_p90": pick(0.9),
            "steps": timing.steps, "warmup_steps": timing.warmup, "warmup_s": warmup_s,
            "peak_bytes": peak_bytes, "peak_kind": "sampled: after forward, backward, step",
            "final_loss": final_loss, "skipped_steps": skipped,
            "host_reads_per_step": reads as f64 / timing.steps.max(1) as f64,
            "optimizer": "fused AdamW (burn-amp)",
        }),
        warmup_s,
    })
}

/// The fused unscale + inf/NaN check over 16 gradients of `elements / 16` each: bytes read
/// and written per call against the time, the median of `iters` calls after 3 untimed.
fn bandwidth<B: AmpKernels>(
    device: &B::Device,
    dtype: FloatDType,
    elements: usize,
    iters: usize,
) -> Result<Value, String> {
    let each = elements / 16;
    let primitive = |t: Tensor<B, 1>| t.into_primitive().tensor();
    let mut grads: Vec<_> = (0..16)
        .map(|_| {
            let t = Tensor::<B, 1>::random([each], Distribution::Uniform(-1.0, 1.0), device);
            primitive(t.cast(dtype))
        })
        .collect();
    let one = || primitive(Tensor::<B, 1>::ones([1], device));
    let mut found = primitive(Tensor::<B, 1>::zeros([1], device));
    let sync = || B::sync(device).map_err(|e| format!("sync: {e:?}"));
    let mut times = Vec::new();
    for i in 0..iters + 3 {
        let t = Instant::now();
        // An inverse scale of 1 leaves the values as they are, call after call.
        (grads, found) = B::unscale_and_check(grads, one(), found);
        sync()?;
        if i >= 3 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let found_inf = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(found))
        .into_scalar()
        .elem::<f32>();
    if found_inf != 0.0 {
        return Err(format!("finite gradients raised found_inf to {found_inf}"));
    }
    times.sort_by(f64::total_cmp);
    let seconds = times[times.len() / 2];
    let bytes = 2 * 16 * each * DType::from(dtype).size();
    let gb_per_s = bytes as f64 / seconds / 1e9;
    Ok(json!({
        "kind": "bandwidth", "impl": "burn-amp", "kernel": "unscale_check",
        "dtype": format!("{dtype:?}").to_lowercase(), "elements": 16 * each, "bytes": bytes,
        "ms": seconds * 1e3, "gb_per_s": gb_per_s, "reference_gb_per_s": 4300.0,
    }))
}
