//! Six bytes per parameter: AdamW with f32 or 8-bit moments, f32 or bf16 weights (rounded to
//! nearest or stochastically), and AMSGrad's 20, trained side by side on the same TinyLm,
//! data and seeds.
//! Per variant: bytes per parameter (weights + gradients + optimizer state, from the
//! `MemoryReport`), the peak of a measured step (Flex, `CountingAlloc`), final loss, and time
//! per step against f32 AdamW. One table, then one JSON line.
//!
//! `cargo bench --bench low_bit` (`cargo test` runs it small, as a smoke test; `-- --kernels`
//! times the optimizer kernels alone, `-- --ema` the weight average's placements and its
//! update's kernels against their burn ops, alone).

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "common/report.rs"]
mod report;

use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::memory::{CountingAlloc, MemoryReport, StepMemory};
use burn_amp::optim::{FusedAdamWConfig, MomentStorage, QuantMap, WeightRounding};
use burn_amp::{Amp, EmaConfig, MemorySaving, ModelEma, Precision, autocast};
use burn_std::FloatDType;
use common::tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

type B = Amp<Autodiff<Flex>>;
type Inner = <B as AutodiffBackend>::InnerBackend;

/// One way to store the step's state.
#[derive(Clone, Copy)]
struct Variant {
    name: &'static str,
    moments: MomentStorage,
    weights: FloatDType,
    rounding: WeightRounding,
    amsgrad: bool,
    /// A weight average (`ModelEma`, warmup on) of this decay, updated after every step.
    ema: Option<f64>,
}

const F32: FloatDType = FloatDType::F32;
const BF16: FloatDType = FloatDType::BF16;

fn variants() -> Vec<Variant> {
    let int8 = MomentStorage::int8();
    let linear = MomentStorage::Int8 {
        block: 256,
        map: QuantMap::Linear,
        min_numel: 4096,
    };
    let v = |name, moments, weights, rounding| Variant {
        name,
        moments,
        weights,
        rounding,
        amsgrad: false,
        ema: None,
    };
    use WeightRounding::{Nearest, Stochastic};
    vec![
        v("f32 AdamW", MomentStorage::F32, F32, Nearest),
        Variant {
            amsgrad: true,
            ..v("f32 AdamW + AMSGrad", MomentStorage::F32, F32, Nearest)
        },
        v("8-bit AdamW (dynamic map)", int8, F32, Nearest),
        v("8-bit AdamW (linear map)", linear, F32, Nearest),
        v(
            "8-bit + bf16 weights, stochastic (MemorySaving)",
            int8,
            BF16,
            Stochastic,
        ),
        v("8-bit + bf16 weights, nearest", int8, BF16, Nearest),
        Variant {
            ema: Some(0.99),
            ..v("f32 AdamW + EMA 0.99", MomentStorage::F32, F32, Nearest)
        },
        Variant {
            ema: Some(0.99),
            ..v(
                "MemorySaving + EMA 0.99 (f32 average)",
                int8,
                BF16,
                Stochastic,
            )
        },
        v(
            "f32 AdamW + bf16 weights, nearest",
            MomentStorage::F32,
            BF16,
            Nearest,
        ),
    ]
}

struct Row {
    variant: Variant,
    report: MemoryReport,
    first_loss: f32,
    final_loss: f32,
    ms_per_step: f64,
    /// Loss on a held-out batch of the model, and of its average (with `ema`).
    held_out: (f32, Option<f32>),
}

fn train(variant: Variant, config: &TinyLmConfig, steps: usize, batch: usize, lr: f64) -> Row {
    let device = Default::default();
    // bf16 weights compute in bf16 (no cast of the weights); f32 ones in f32.
    let precision = if variant.weights == BF16 {
        Precision::Bf16
    } else {
        Precision::F32
    };
    let _g = autocast(precision);
    B::seed(&device, 3);
    let preset = MemorySaving::new()
        .with_weights(variant.weights)
        .with_optimizer(
            FusedAdamWConfig::new()
                .with_moments(variant.moments)
                .with_weight_rounding(variant.rounding)
                .with_amsgrad(variant.amsgrad)
                .with_weight_decay(0.0),
        );
    let mut model = preset.prepare(config.init::<B>(&device));
    let mut optim = preset.optimizer::<B, TinyLm<B>>().expect("a valid config");
    let ema_config = |decay| EmaConfig::new().with_decay(decay).with_warmup(true);
    let mut ema = variant
        .ema
        .map(|decay| ModelEma::<B, _>::new(&model, ema_config(decay)).expect("a valid decay"));
    let mut task = ReversalTask::new(config.vocab, config.seq_len, 5);
    let mut losses = Vec::with_capacity(steps);
    let mut report = MemoryReport::default();
    let mut timed = Vec::new();
    for step in 0..steps {
        let (x, y) = task.batch::<B>(batch, &device);
        let start = Instant::now();
        // The third step is measured: the state exists, one-time buffers are made.
        let mut memory = (step == 2).then(|| StepMemory::begin::<B>(&device));
        let loss = model.loss(x, y);
        if let Some(m) = memory.as_mut() {
            m.after_forward::<B>(&device);
        }
        losses.push(loss.clone().into_scalar().elem::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        if let Some(m) = memory.as_mut() {
            m.after::<B>(&device);
            report = m.report::<B, _>(&model, Some(&grads), optim.state_bytes(&model));
        }
        model = optim.step(lr, model, grads);
        if let Some(ema) = ema.as_mut() {
            ema.update(&model).expect("the same model");
        }
        if let Some(mut m) = memory {
            m.after::<B>(&device);
            report.peak_in_use = m.report::<B, _>(&model, None, 0).peak_in_use;
        }
        if step >= 3 {
            timed.push(start.elapsed());
        }
    }
    let tail = &losses[steps - steps.min(20)..];
    let (x, y) = ReversalTask::new(config.vocab, config.seq_len, 99).batch::<Inner>(256, &device);
    let loss_of = |m: &TinyLm<Inner>| m.loss(x.clone(), y.clone()).into_scalar().elem::<f32>();
    let held_out = (
        loss_of(&model.valid()),
        ema.as_ref().map(|ema| loss_of(&ema.module())),
    );
    Row {
        variant,
        report,
        first_loss: losses[0],
        final_loss: tail.iter().sum::<f32>() / tail.len() as f32,
        ms_per_step: common::median(timed).as_secs_f64() * 1e3,
        held_out,
    }
}

/// One optimizer step on one parameter of `n` values through the kernels on wgpu (lavapipe):
/// f32 AdamW, with AMSGrad, with cautious weight decay, 8-bit AdamW, and f32 and 8-bit with an
/// f16 parameter rounded stochastically. Side by side, alternating, median of `rounds`, after
/// a warm-up (kernel compilation), each stepping its own state in place.
fn kernel_times(n: usize, rounds: usize) -> Option<Vec<(&'static str, f64)>> {
    use burn::backend::Wgpu;
    use burn_amp::optim::OptimKernels;
    use burn_amp::optim::kernels::{AdamWMoments, QuantizedMoments, Scaling};
    use burn_backend::Backend as _;
    use burn_backend::ops::IntTensorOps;
    use burn_std::{IntDType, Shape};
    type W = Wgpu;
    let device = common::wgpu_device()?;
    let p = |t: Tensor<W, 1>| t.into_primitive().tensor();
    let param = |dtype: FloatDType| p(Tensor::<W, 1>::ones([n], &device).cast(dtype));
    let scaling = || Scaling {
        inv_scale: p(Tensor::<W, 1>::ones([1], &device)),
        found_inf: p(Tensor::<W, 1>::zeros([1], &device)),
    };
    let f32_state = |amsgrad: bool| AdamWMoments {
        exp_avg: p(Tensor::<W, 1>::zeros([n], &device)),
        exp_avg_sq: p(Tensor::<W, 1>::zeros([n], &device)),
        max_exp_avg_sq: amsgrad.then(|| p(Tensor::<W, 1>::zeros([n], &device))),
        step: p(Tensor::<W, 1>::zeros([1], &device)),
    };
    let int8_state = || QuantizedMoments {
        exp_avg_codes: W::int_zeros(Shape::new([n / 4]), &device, IntDType::I32),
        exp_avg_absmax: p(Tensor::<W, 1>::zeros([n / 256], &device)),
        exp_avg_sq_codes: W::int_zeros(Shape::new([n / 4]), &device, IntDType::I32),
        exp_avg_sq_absmax: p(Tensor::<W, 1>::zeros([n / 256], &device)),
        step: p(Tensor::<W, 1>::zeros([1], &device)),
        block: 256,
        map: QuantMap::Dynamic,
    };
    let grad = p(Tensor::<W, 1>::ones([n], &device));
    let nearest = FusedAdamWConfig::new();
    let stochastic = FusedAdamWConfig::new().with_weight_rounding(WeightRounding::Stochastic);
    let amsgrad = FusedAdamWConfig::new().with_amsgrad(true);
    let cautious = FusedAdamWConfig::new().with_cautious_weight_decay(true);
    let adam = FusedAdamWConfig::adam().with_weight_decay(0.01);
    let cases: [(&'static str, FloatDType, bool, &FusedAdamWConfig); 7] = [
        ("f32 AdamW, f32 param", FloatDType::F32, false, &nearest),
        (
            "f32 AdamW + AMSGrad, f32 param",
            FloatDType::F32,
            false,
            &amsgrad,
        ),
        (
            "f32 AdamW, cautious weight decay, f32 param",
            FloatDType::F32,
            false,
            &cautious,
        ),
        (
            "Adam (L2 penalty), f32 param",
            FloatDType::F32,
            false,
            &adam,
        ),
        ("8-bit AdamW, f32 param", FloatDType::F32, true, &nearest),
        (
            "f32 AdamW, f16 param, stochastic",
            FloatDType::F16,
            false,
            &stochastic,
        ),
        (
            "8-bit AdamW, f16 param, stochastic",
            FloatDType::F16,
            true,
            &stochastic,
        ),
    ];
    // Each case's parameter and state live across the rounds and are stepped in place, as
    // in training (a fresh state each round timed its allocation too).
    enum State<S32, S8> {
        F32(S32),
        Int8(S8),
    }
    let mut live: Vec<_> = cases
        .iter()
        .map(|(_, dtype, int8, c)| {
            let state = match int8 {
                true => State::Int8(int8_state()),
                false => State::F32(f32_state(c.amsgrad)),
            };
            Some((param(*dtype), state))
        })
        .collect();
    let mut times = vec![Vec::new(); cases.len()];
    for round in 0..rounds + 2 {
        for (i, (.., c)) in cases.iter().enumerate() {
            let (pt, state) = live[i].take().expect("the case's state");
            let (g, sc) = (grad.clone(), scaling());
            W::sync(&device).unwrap();
            let start = Instant::now();
            let next = match state {
                State::F32(s) => {
                    let (pt, s) = W::adamw_step(pt, g, s, sc, 1e-3, c);
                    (pt, State::F32(s))
                }
                State::Int8(s) => {
                    let (pt, s) = W::adamw8bit_step(pt, g, s, sc, 1e-3, c);
                    (pt, State::Int8(s))
                }
            };
            W::sync(&device).unwrap();
            if round >= 2 {
                times[i].push(start.elapsed());
            }
            live[i] = Some(next);
        }
    }
    Some(
        cases
            .iter()
            .zip(times)
            .map(|((name, ..), t)| (*name, common::median(t).as_secs_f64() * 1e3))
            .collect(),
    )
}

/// One update of a weight average (f32, `n` values) from f16 weights on wgpu (lavapipe): the
/// `EmaKernels` kernels against their burn-op fallbacks (what `ModelEma` ran before them),
/// the rate on the device (an f16 run's, with its overflow flag) and on the host. Side by
/// side, alternating, median of `rounds`, after a warm-up, each average updated in place.
fn ema_kernel_times(n: usize, rounds: usize) -> Option<Vec<(&'static str, f64)>> {
    use burn::backend::Wgpu;
    use burn_amp::ema::EmaKernels;
    use burn_amp::ema::kernels::fallback;
    use burn_backend::Backend as _;
    type W = Wgpu;
    let device = common::wgpu_device()?;
    let p = |t: Tensor<W, 1>| t.into_primitive().tensor();
    let weights = p(Tensor::<W, 1>::ones([n], &device).cast(FloatDType::F16));
    let rate = p(Tensor::<W, 1>::full([1], 0.01, &device));
    let names = [
        "kernel, device rate",
        "burn ops, device rate",
        "kernel, host rate",
        "burn ops, host rate",
    ];
    let mut live: Vec<_> = names
        .iter()
        .map(|_| Some(p(Tensor::<W, 1>::zeros([n], &device))))
        .collect();
    let mut times = vec![Vec::new(); names.len()];
    for round in 0..rounds + 2 {
        for (i, slot) in live.iter_mut().enumerate() {
            let (average, w, r) = (slot.take().unwrap(), weights.clone(), rate.clone());
            W::sync(&device).unwrap();
            let start = Instant::now();
            let next = match i {
                0 => W::ema_update(average, w, r),
                1 => fallback::ema_update::<W>(average, w, r),
                2 => W::ema_update_scalar(average, w, 0.01),
                _ => fallback::ema_update_scalar::<W>(average, w, 0.01),
            };
            W::sync(&device).unwrap();
            if round >= 2 {
                times[i].push(start.elapsed());
            }
            *slot = Some(next);
        }
    }
    Some(
        names
            .into_iter()
            .zip(times)
            .map(|(name, t)| (name, common::median(t).as_secs_f64() * 1e3))
            .collect(),
    )
}

/// A weight average's placements on wgpu (lavapipe): `tests/common/ema_placements.rs`.
fn ema_placements(
    width: usize,
    layers: usize,
    rounds: usize,
) -> Option<Vec<common::ema_placements::Placement>> {
    use burn::backend::Wgpu;
    use burn_amp::memory::DeviceMemory;
    type W = Amp<Autodiff<Wgpu>>;
    let device = common::wgpu_device()?;
    let in_use = || W::memory_snapshot(&device).map_or(0, |s| s.bytes_in_use);
    Some(common::ema_placements::measure::<W>(
        &device, width, layers, rounds, in_use,
    ))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let full = args.iter().any(|a| a == "--bench" || a == "--full");
    let (config, steps, batch) = if full {
        (
            TinyLmConfig::new()
                .with_d_model(64)
                .with_d_ff(256)
                .with_seq_len(12)
                .with_dropout(0.0),
            400,
            32,
        )
    } else {
        (
            TinyLmConfig::new()
                .with_d_model(64)
                .with_d_ff(128)
                .with_dropout(0.0),
            6,
            8,
        )
    };
    let lr = 1e-3;
    let kernels_only = args.iter().any(|a| a == "--kernels");
    let ema_only = args.iter().any(|a| a == "--ema");
    let rows: Vec<Row> = variants()
        .into_iter()
        .filter(|_| !kernels_only && !ema_only)
        .map(|v| {
            let config = config.clone();
            std::thread::spawn(move || train(v, &config, steps, batch, lr))
                .join()
                .unwrap()
        })
        .collect();
    let mut json = Vec::new();
    // The training table (not with `--kernels`).
    if let Some(base) = rows.first() {
        println!(
            "TinyLm d_model {} d_ff {} seq {} layers {}, batch {batch}, {steps} steps of AdamW (lr {lr}), Flex",
            config.d_model, config.d_ff, config.seq_len, config.n_layers
        );
        println!(
            "| variant | bytes / param | optimizer state | peak of a step | loss first → last 20 | final / f32 | time / f32 | held-out loss (average) |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for r in &rows {
            let bpp = r.report.bytes_per_parameter().unwrap_or(f64::NAN);
            let peak = r.report.peak_in_use.unwrap_or(0);
            println!(
                "| {} | {bpp:.2}{} | {:.3} MiB | {:.2} MiB | {:.3} → {:.3} | {:.3} | {:.2} | {:.4}{} |",
                r.variant.name,
                if r.variant.ema.is_some() { " + 4" } else { "" },
                common::mib(r.report.optimizer_state),
                common::mib(peak),
                r.first_loss,
                r.final_loss,
                r.final_loss / base.final_loss,
                r.ms_per_step / base.ms_per_step,
                r.held_out.0,
                r.held_out.1.map_or(String::new(), |l| format!(" ({l:.4})")),
            );
            json.push(format!(
                "{{\"variant\":\"{}\",\"bytes_per_param\":{bpp:.4},\"optimizer_state\":{},\"peak\":{peak},\"final_loss\":{:.5},\"loss_ratio\":{:.4},\"time_ratio\":{:.4},\"held_out\":{:.5},\"held_out_average\":{}}}",
                r.variant.name,
                r.report.optimizer_state,
                r.final_loss,
                r.final_loss / base.final_loss,
                r.ms_per_step / base.ms_per_step,
                r.held_out.0,
                r.held_out.1.map_or("null".into(), |l| format!("{l:.5}")),
            ));
        }
    }
    let n = if full { 1 << 22 } else { 1 << 16 };
    let kernels = match ema_only {
        false => kernel_times(n, if full { 10 } else { 2 }).unwrap_or_default(),
        true => Vec::new(),
    };
    let mut kernel_json = Vec::new();
    if let Some((_, base)) = kernels.first().copied() {
        println!();
        println!(
            "One optimizer step on one parameter of {n} values, kernels on wgpu (lavapipe), median"
        );
        println!("| step | ms | / f32 AdamW |");
        println!("|---|---|---|");
        for (name, ms) in &kernels {
            println!("| {name} | {ms:.2} | {:.2} |", ms / base);
            kernel_json.push(format!(
                "{{\"step\":\"{name}\",\"ms\":{ms:.3},\"ratio\":{:.4}}}",
                ms / base
            ));
        }
    }
    let (width, layers) = if full { (1024, 8) } else { (64, 2) };
    let placements = match kernels_only {
        false => ema_placements(width, layers, if full { 10 } else { 1 }).unwrap_or_default(),
        true => Vec::new(),
    };
    let mut ema_json = Vec::new();
    if let Some(base) = placements.first().map(|p| p.ms_per_step) {
        let weights = common::ema_placements::weight_bytes(width, layers) as f64;
        println!();
        println!(
            "A weight average (f32) of an f16 model of {layers} × {width}² ({:.2} MiB of weights) on wgpu (lavapipe), per optimizer step, median",
            weights / (1 << 20) as f64
        );
        println!("| average | device bytes kept / weights | ms per step | / on the device |");
        println!("|---|---|---|---|");
        for p in &placements {
            let (name, ms, kept) = (p.name, p.ms_per_step, p.device_bytes);
            println!(
                "| {name} | {:.3} | {ms:.2} | {:.2} |",
                kept as f64 / weights,
                ms / base
            );
            ema_json.push(format!(
                "{{\"average\":\"{name}\",\"device_bytes\":{kept},\"kept_per_weight_byte\":{:.4},\"ms\":{ms:.3},\"ratio\":{:.4}}}",
                kept as f64 / weights,
                ms / base
            ));
        }
    }
    let ema_kernels = match kernels_only {
        false => ema_kernel_times(n, if full { 20 } else { 2 }).unwrap_or_default(),
        true => Vec::new(),
    };
    let mut ema_kernel_json = Vec::new();
    if let [(_, kd), (_, fd), (_, kh), (_, fh)] = ema_kernels[..] {
        println!();
        println!(
            "One update of a weight average of {n} values (f32) from f16 weights, wgpu (lavapipe), median"
        );
        println!("| update | ms | burn ops / kernel |");
        println!("|---|---|---|");
        for (name, ms) in &ema_kernels {
            let kernel = if name.ends_with("device rate") {
                kd
            } else {
                kh
            };
            println!("| {name} | {ms:.3} | {:.2} |", ms / kernel);
            ema_kernel_json.push(format!("{{\"update\":\"{name}\",\"ms\":{ms:.4}}}"));
        }
        ema_kernel_json.push(format!(
            "{{\"burn_ops_over_kernel_device_rate\":{:.4},\"burn_ops_over_kernel_host_rate\":{:.4}}}",
            fd / kd,
            fh / kh
        ));
    }
    report::emit(&format!(
        "{{\"bench\":\"low_bit\",\"steps\":{steps},\"rows\":[{}],\"kernel_values\":{n},\"kernels\":[{}],\"ema_placements\":[{}],\"ema_kernels\":[{}]}}",
        json.join(","),
        kernel_json.join(","),
        ema_json.join(","),
        ema_kernel_json.join(",")
    ));
}
