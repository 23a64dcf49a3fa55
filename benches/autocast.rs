//! Autocast figures, measured side by side in one run:
//! - overhead: a forward+backward step under `Amp<Autodiff<Flex>>` with autocast off
//!   (`Precision::F32`) against `Autodiff<Flex>`, for an MLP and for the TinyLm
//!   transformer (target: ratio <= 1.03), and for the MLP with ELU (`exp`'s node of `Amp`'s
//!   own) and with ReLU (`relu`'s node, which keeps a NaN through recomputation);
//! - the price of summing f16 matmuls and convolutions in f32 (`half_sums`): a step of two
//!   3×3 convolutions on wgpu and of the MLP on Flex, against the half sums Burn runs;
//! - the price of right `deform_conv2d` offset and mask gradients on wgpu (composed from the
//!   forward) against plain Burn's (wrong ones);
//! - memory: the peak device memory in use of one training step of an activation-heavy MLP,
//!   `Amp<Autodiff<Wgpu>>` in f16 against `Autodiff<Wgpu>` in f32 on lavapipe (target <= 0.6).
//!
//! `cargo bench --bench autocast` (add `-- --quick` for a short run; `cargo test` runs it
//! quick, as a smoke test). Prints a table, then
//! one JSON line.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "common/mode.rs"]
mod mode;
#[path = "common/report.rs"]
mod report;

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::memory::{DeviceMemory, PeakMemory};
use burn_amp::optim::{FusedAdamW, ScaledAdaptor};
use burn_amp::{Amp, Precision, autocast};
use common::median;
use common::models::DeepMlp;
use common::tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};

/// Times `a` and `b` interleaved (a, b, a, b, ...) so that both see the same machine load.
fn side_by_side(iters: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (Duration, Duration) {
    for _ in 0..3 {
        a();
        b();
    }
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..iters {
        let t = Instant::now();
        a();
        ta.push(t.elapsed());
        let t = Instant::now();
        b();
        tb.push(t.elapsed());
    }
    (median(ta), median(tb))
}

fn mlp_step<B: AutodiffBackend>(model: &DeepMlp<B>, x: &Tensor<B, 2>) {
    let loss = model.forward(x.clone()).powi_scalar(2).mean();
    let _grads = loss.backward();
}

/// The same MLP with another activation: ELU, whose gradient runs through `exp`'s backward
/// behind a mask (under `Amp`, a node of its own: four more elementwise ops in the backward),
/// or ReLU (under `Amp`, a node of its own, so that a NaN survives the backward's
/// recomputation: one pass on Flex, its `clamp`, where Flex's `relu` hides the NaN).
fn activated_mlp_step<B: AutodiffBackend>(
    model: &DeepMlp<B>,
    x: &Tensor<B, 2>,
    activation: fn(Tensor<B, 2>) -> Tensor<B, 2>,
) {
    let mut h = x.clone();
    for layer in &model.layers {
        h = activation(layer.forward(h));
    }
    let _grads = h.powi_scalar(2).mean().backward();
}

fn elu<B: AutodiffBackend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    burn::tensor::activation::elu(x, 1.0)
}

fn lm_step<B: AutodiffBackend>(model: &TinyLm<B>, batch: &(Tensor<B, 2, Int>, Tensor<B, 2, Int>)) {
    let _grads = model.loss(batch.0.clone(), batch.1.clone()).backward();
}

/// `Amp<Autodiff<Flex>>` at F32 against `Autodiff<Flex>`, (Amp, plain) medians: the MLP, the
/// MLP with ELU, the MLP with ReLU, TinyLm.
fn overhead(iters: usize) -> [(Duration, Duration); 4] {
    type Plain = Autodiff<Flex>;
    type WithAmp = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let _off = autocast(Precision::F32);

    let mlp_plain = DeepMlp::<Plain>::new(256, 4, &device);
    let mlp_amp = DeepMlp::<WithAmp>::new(256, 4, &device);
    let x_plain =
        Tensor::<Plain, 2>::random([64, 256], burn::tensor::Distribution::Default, &device);
    let x_amp = Tensor::<WithAmp, 2>::from_data(x_plain.to_data(), &device);
    let (mlp_a, mlp_p) = side_by_side(
        iters,
        || mlp_step(&mlp_amp, &x_amp),
        || mlp_step(&mlp_plain, &x_plain),
    );
    // Control: the same model against itself, to show the method's own bias and noise.
    let (c1, c2) = side_by_side(
        iters,
        || mlp_step(&mlp_plain, &x_plain),
        || mlp_step(&mlp_plain, &x_plain),
    );
    eprintln!(
        "control (Autodiff<Flex> MLP against itself): ratio {:.3}",
        c1.as_secs_f64() / c2.as_secs_f64()
    );
    let elu = side_by_side(
        iters,
        || activated_mlp_step(&mlp_amp, &x_amp, elu),
        || activated_mlp_step(&mlp_plain, &x_plain, elu),
    );
    let relu = side_by_side(
        iters,
        || activated_mlp_step(&mlp_amp, &x_amp, burn::tensor::activation::relu),
        || activated_mlp_step(&mlp_plain, &x_plain, burn::tensor::activation::relu),
    );

    let config = TinyLmConfig::new().with_dropout(0.0);
    let lm_plain = config.init::<Plain>(&device);
    let lm_amp = config.init::<WithAmp>(&device);
    let mut task = ReversalTask::new(config.vocab, config.seq_len, 1);
    let batch_plain = task.batch::<Plain>(32, &device);
    let batch_amp = (
        Tensor::<WithAmp, 2, Int>::from_data(batch_plain.0.to_data(), &device),
        Tensor::<WithAmp, 2, Int>::from_data(batch_plain.1.to_data(), &device),
    );
    let (lm_a, lm_p) = side_by_side(
        iters,
        || lm_step(&lm_amp, &batch_amp),
        || lm_step(&lm_plain, &batch_plain),
    );
    [(mlp_a, mlp_p), elu, relu, (lm_a, lm_p)]
}

/// Peak bytes in use over one training step, sampled after forward and after backward.
fn step_peak<B: AutodiffBackend + DeviceMemory>(
    precision: Precision,
    batch: usize,
    width: usize,
    depth: usize,
) -> Option<(u64, u64)> {
    let device = Default::default();
    let _g = autocast(precision);
    let model = DeepMlp::<B>::new(width, depth, &device);
    let x = Tensor::<B, 2>::random([batch, width], burn::tensor::Distribution::Default, &device);
    let mut peak = PeakMemory::default();
    peak.sample::<B>(&device)?; // params and input: what persists
    let loss = model.forward(x).powi_scalar(2).mean();
    peak.sample::<B>(&device)?; // + activations saved for backward
    let grads = loss.backward();
    peak.sample::<B>(&device)?; // + gradients
    drop(grads);
    Some((peak.peak, peak.baseline.unwrap_or(0)))
}

/// One scaled training step of TinyLm (forward, backward, scaler, optimizer, update);
/// returns the host reads it made.
fn scaled_step<B>(
    model: TinyLm<B>,
    batch: &(Tensor<B, 2, Int>, Tensor<B, 2, Int>),
    scaler: &mut burn_amp::scaler::GradScaler<B>,
    fused: &mut ScaledAdaptor<FusedAdamW, TinyLm<B>, B>,
    adam: &mut burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, TinyLm<B>, B>,
    use_fused: bool,
) -> (TinyLm<B>, u64)
where
    B: AutodiffBackend,
    B::InnerBackend: burn_amp::kernels::AmpKernels,
{
    let reads = burn_amp::host_reads();
    let loss = model.loss(batch.0.clone(), batch.1.clone());
    let grads = burn::optim::GradientsParams::from_grads(scaler.scale(loss).backward(), &model);
    let (model, _) = if use_fused {
        scaler.step(fused, 1e-3, model, grads).unwrap()
    } else {
        scaler.step(adam, 1e-3, model, grads).unwrap()
    };
    scaler.update().unwrap();
    (model, burn_amp::host_reads() - reads)
}

/// f32 against AMP: a full training step of TinyLm, `Autodiff<B>` at f32 against
/// `Amp<Autodiff<B>>` at `precision` (fused AdamW, scaler), side by side; and the host
/// reads of one scaled step with the fused optimizer and with Burn's Adam.
fn f32_vs_amp<P, A>(
    iters: usize,
    precision: Precision,
    config: &TinyLmConfig,
    batch: usize,
) -> (Duration, Duration, u64, u64)
where
    P: AutodiffBackend,
    A: AutodiffBackend<Device = P::Device>,
    P::InnerBackend: burn_amp::kernels::AmpKernels,
    A::InnerBackend: burn_amp::kernels::AmpKernels,
{
    use burn_amp::optim::FusedAdamWConfig;
    use burn_amp::scaler::GradScalerConfig;
    let device = Default::default();
    let mut task = ReversalTask::new(config.vocab, config.seq_len, 5);
    let batch_p = task.batch::<P>(batch, &device);
    let batch_a = task.batch::<A>(batch, &device);
    let mut model_p = Some(config.init::<P>(&device));
    let mut model_a = Some(config.init::<A>(&device));
    let mut scaler_p = GradScalerConfig::new()
        .init::<P>(&device, Precision::F32)
        .unwrap();
    let mut scaler_a = GradScalerConfig::new()
        .init::<A>(&device, precision)
        .unwrap();
    let (mut fused_p, mut fused_a) = (
        FusedAdamWConfig::new().init::<P, TinyLm<P>>().unwrap(),
        FusedAdamWConfig::new().init::<A, TinyLm<A>>().unwrap(),
    );
    let mut adam_p = burn::optim::AdamConfig::new().init::<P, TinyLm<P>>();
    let mut adam_a = burn::optim::AdamConfig::new().init::<A, TinyLm<A>>();
    let sync_p = |d: &P::Device| P::sync(d).unwrap();
    let sync_a = |d: &A::Device| A::sync(d).unwrap();
    let (t_p, t_a) = side_by_side(
        iters,
        || {
            let _f32 = autocast(Precision::F32);
            let (m, _) = scaled_step(
                model_p.take().unwrap(),
                &batch_p,
                &mut scaler_p,
                &mut fused_p,
                &mut adam_p,
                true,
            );
            model_p = Some(m);
            sync_p(&device);
        },
        || {
            let _amp = autocast(precision);
            let (m, _) = scaled_step(
                model_a.take().unwrap(),
                &batch_a,
                &mut scaler_a,
                &mut fused_a,
                &mut adam_a,
                true,
            );
            model_a = Some(m);
            sync_a(&device);
        },
    );
    // Host reads at f16, where the scaler is active.
    let _f16 = autocast(Precision::F16);
    let mut scaler_16 = GradScalerConfig::new()
        .init::<A>(&device, Precision::F16)
        .unwrap();
    let (m, fused_reads) = scaled_step(
        model_a.take().unwrap(),
        &batch_a,
        &mut scaler_16,
        &mut fused_a,
        &mut adam_a,
        true,
    );
    let (_, adam_reads) = scaled_step(
        m,
        &batch_a,
        &mut scaler_16,
        &mut fused_a,
        &mut adam_a,
        false,
    );
    (t_p, t_a, fused_reads, adam_reads)
}

/// A step of two 3×3 convolutions (wgpu) and of the MLP (Flex), f16 under `Amp`, with the
/// sums of matmuls and convolutions in f32 (default) / in f16 as Burn runs them
/// (`half_sums::set_enabled(false)`).
fn half_sums_cost(iters: usize, quick: bool) -> [Option<(Duration, Duration)>; 2] {
    use burn::tensor::module::conv2d;
    use burn::tensor::ops::ConvOptions;
    use burn_amp::backend::half_sums;
    type W = Amp<Autodiff<Wgpu>>;
    type F = Amp<Autodiff<Flex>>;
    let _autocast = autocast(Precision::F16);
    let timed = |step: &dyn Fn()| {
        side_by_side(
            iters.min(10),
            || {
                half_sums::set_enabled(true);
                step()
            },
            || {
                half_sums::set_enabled(false);
                step()
            },
        )
    };
    let conv = common::wgpu_device().map(|device| {
        let (batch, channels, side) = if quick { (2, 8, 8) } else { (8, 64, 32) };
        let x = Tensor::<W, 4>::random(
            [batch, channels, side, side],
            burn::tensor::Distribution::Default,
            &device,
        );
        let w = |std| {
            Tensor::<W, 4>::random(
                [channels, channels, 3, 3],
                burn::tensor::Distribution::Normal(0.0, std),
                &device,
            )
            .require_grad()
        };
        let (w1, w2) = (w(0.05), w(0.06));
        let options = ConvOptions::new([1, 1], [1, 1], [1, 1], 1);
        timed(&|| {
            let h = conv2d(x.clone(), w1.clone(), None, options.clone());
            let y = conv2d(
                burn::tensor::activation::relu(h),
                w2.clone(),
                None,
                options.clone(),
            );
            let _grads = y.powi_scalar(2).mean().backward();
            W::sync(&device).unwrap();
        })
    });
    let device = Default::default();
    let (batch, width, depth) = if quick { (64, 64, 2) } else { (512, 256, 4) };
    let model = DeepMlp::<F>::new(width, depth, &device);
    let x = Tensor::<F, 2>::random([batch, width], burn::tensor::Distribution::Default, &device);
    let mlp = timed(&|| mlp_step(&model, &x));
    half_sums::set_enabled(true);
    [conv, Some(mlp)]
}

/// A step of a 3×3 deformable convolution with a mask (wgpu, f32): under `Amp`, whose offset
/// and mask gradients are composed from the forward, against plain Burn (whose are wrong).
fn deform_conv_cost(iters: usize, quick: bool) -> Option<(Duration, Duration)> {
    use burn::tensor::Distribution;
    use burn::tensor::module::deform_conv2d;
    use burn::tensor::ops::DeformConvOptions;
    let device = common::wgpu_device()?;
    let _f32 = autocast(Precision::F32);
    let (batch, channels, side) = if quick { (2, 4, 8) } else { (8, 32, 32) };
    let out = side - 2;
    fn step<B: AutodiffBackend>(
        device: &B::Device,
        [batch, channels, side, out]: [usize; 4],
    ) -> impl FnMut() + use<B> {
        let t = |shape: [usize; 4], d| Tensor::<B, 4>::random(shape, d, device).require_grad();
        let x = t([batch, channels, side, side], Distribution::Default);
        let offset = t([batch, 18, out, out], Distribution::Uniform(-1.5, 1.5));
        let weight = t([channels, channels, 3, 3], Distribution::Normal(0.0, 0.05));
        let mask = t([batch, 9, out, out], Distribution::Default);
        let device = device.clone();
        move || {
            let y = deform_conv2d(
                x.clone(),
                offset.clone(),
                weight.clone(),
                Some(mask.clone()),
                None,
                DeformConvOptions::new([1, 1], [0, 0], [1, 1], 1, 1),
            );
            let _grads = y.powi_scalar(2).mean().backward();
            B::sync(&device).unwrap();
        }
    }
    let dims = [batch, channels, side, out];
    Some(side_by_side(
        iters.min(10),
        step::<Amp<Autodiff<Wgpu>>>(&device, dims),
        step::<Autodiff<Wgpu>>(&device, dims),
    ))
}

/// A GELU MLP's step on wgpu in f32 (256 wide, 4 layers, batch 64): under `Amp` at F32,
/// whose `gelu` is its own node with the exact derivative, against plain Burn (the tanh
/// approximation's derivative).
fn wgpu_gelu_cost(iters: usize, quick: bool) -> Option<(Duration, Duration)> {
    let device = common::wgpu_device()?;
    let _f32 = autocast(Precision::F32);
    let (batch, width) = if quick { (8, 32) } else { (64, 256) };
    fn step<B: AutodiffBackend>(device: &B::Device, batch: usize, width: usize) -> impl FnMut() {
        let model = DeepMlp::<B>::new(width, 4, device);
        let x = Tensor::<B, 2>::random([batch, width], burn::tensor::Distribution::Default, device);
        let device = device.clone();
        move || {
            mlp_step(&model, &x);
            B::sync(&device).unwrap();
        }
    }
    Some(side_by_side(
        iters.min(20),
        step::<Amp<Autodiff<Wgpu>>>(&device, batch, width),
        step::<Autodiff<Wgpu>>(&device, batch, width),
    ))
}

fn main() {
    mode::ensure_runtime_dir();
    let quick = mode::quick();
    let iters = if quick { 3 } else { 40 };

    let [
        (mlp_a, mlp_p),
        (elu_a, elu_p),
        (relu_a, relu_p),
        (lm_a, lm_p),
    ] = overhead(iters);
    let [conv_sums, mlp_sums] = half_sums_cost(iters, quick);
    let deform = deform_conv_cost(iters, quick);
    let gelu = wgpu_gelu_cost(iters, quick);
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    let (mlp_ratio, elu_ratio, relu_ratio, lm_ratio) = (
        ratio(mlp_a, mlp_p),
        ratio(elu_a, elu_p),
        ratio(relu_a, relu_p),
        ratio(lm_a, lm_p),
    );

    // Activation-heavy: a large batch through narrow layers, so that saved activations, not
    // parameters, dominate the step (as in real training).
    let (batch, width, depth) = if quick { (256, 64, 2) } else { (8192, 256, 8) };
    // Each measurement on a fresh thread: CubeCL counts memory per stream, per thread.
    let f32_peak = std::thread::spawn(move || {
        step_peak::<Autodiff<Wgpu>>(Precision::F32, batch, width, depth)
    })
    .join()
    .unwrap();
    let f16_peak = std::thread::spawn(move || {
        step_peak::<Amp<Autodiff<Wgpu>>>(Precision::F16, batch, width, depth)
    })
    .join()
    .unwrap();

    println!(
        "burn-amp autocast figures ({} iterations, medians, side by side)",
        iters
    );
    println!("| measure | burn-amp | baseline | ratio | target |");
    println!("|---|---|---|---|---|");
    println!(
        "| MLP fwd+bwd, Amp<Autodiff<Flex>> F32 vs Autodiff<Flex> | {:.3} ms | {:.3} ms | {:.3} | <= 1.03 |",
        mlp_a.as_secs_f64() * 1e3,
        mlp_p.as_secs_f64() * 1e3,
        mlp_ratio
    );
    println!(
        "| ELU MLP fwd+bwd (exp's own node), same | {:.3} ms | {:.3} ms | {:.3} | <= 1.03 |",
        elu_a.as_secs_f64() * 1e3,
        elu_p.as_secs_f64() * 1e3,
        elu_ratio
    );
    println!(
        "| ReLU MLP fwd+bwd (relu's own node, NaN kept through recomputation), same | {:.3} ms | {:.3} ms | {:.3} | <= 1.03 |",
        relu_a.as_secs_f64() * 1e3,
        relu_p.as_secs_f64() * 1e3,
        relu_ratio
    );
    println!(
        "| TinyLm fwd+bwd, Amp<Autodiff<Flex>> F32 vs Autodiff<Flex> | {:.3} ms | {:.3} ms | {:.3} | <= 1.03 |",
        lm_a.as_secs_f64() * 1e3,
        lm_p.as_secs_f64() * 1e3,
        lm_ratio
    );
    let step_config = if quick {
        TinyLmConfig::new().with_dropout(0.0)
    } else {
        TinyLmConfig::new()
            .with_d_model(128)
            .with_d_ff(256)
            .with_seq_len(32)
            .with_dropout(0.0)
    };
    let step_batch = if quick { 8 } else { 64 };
    let flex = f32_vs_amp::<Autodiff<Flex>, Amp<Autodiff<Flex>>>(
        iters.min(20),
        Precision::Bf16,
        &step_config,
        step_batch,
    );
    #[cfg(feature = "cuda")]
    let cuda = Some(f32_vs_amp::<
        Autodiff<burn_cuda::Cuda>,
        Amp<Autodiff<burn_cuda::Cuda>>,
    >(
        iters.min(20),
        Precision::Bf16,
        &TinyLmConfig::new()
            .with_d_model(512)
            .with_d_ff(2048)
            .with_seq_len(128)
            .with_n_layers(4)
            .with_dropout(0.0),
        256,
    ));
    #[cfg(not(feature = "cuda"))]
    let cuda: Option<(Duration, Duration, u64, u64)> = None;
    for (name, r) in [("Flex", Some(flex)), ("Cuda", cuda)] {
        if let Some((t32, tamp, _, _)) = r {
            println!(
                "| TinyLm training step, {name}: Amp bf16 vs f32 (fused AdamW, scaler) | {:.3} ms | {:.3} ms | {:.3} | (speed-up needs a GPU) |",
                tamp.as_secs_f64() * 1e3,
                t32.as_secs_f64() * 1e3,
                tamp.as_secs_f64() / t32.as_secs_f64()
            );
        }
    }
    for (name, r) in [
        ("two 3x3 convs 64 ch, 8x32x32, fwd+bwd, Wgpu f16", conv_sums),
        ("MLP fwd+bwd, Flex f16", mlp_sums),
    ] {
        match r {
            Some((f32_sums, half)) => println!(
                "| {name}: sums in f32 vs in f16 (`half_sums`) | {:.3} ms | {:.3} ms | {:.3} | (the price of f32 sums) |",
                f32_sums.as_secs_f64() * 1e3,
                half.as_secs_f64() * 1e3,
                ratio(f32_sums, half)
            ),
            None => println!("| {name}: no wgpu adapter | | | | |"),
        }
    }
    for (name, r, target) in [
        (
            "deform_conv2d 3x3 with mask, 32 ch, 8x32x32, fwd+bwd, Wgpu f32: Amp (right offset and mask gradients) vs plain Burn (wrong)",
            deform,
            "(the price of right gradients)",
        ),
        (
            "GELU MLP fwd+bwd, Wgpu f32: Amp at F32 (gelu's exact derivative, its own node) vs plain Burn (the tanh approximation's)",
            gelu,
            "<= 1.03",
        ),
    ] {
        match r {
            Some((amp, plain)) => println!(
                "| {name} | {:.3} ms | {:.3} ms | {:.3} | {target} |",
                amp.as_secs_f64() * 1e3,
                plain.as_secs_f64() * 1e3,
                ratio(amp, plain)
            ),
            None => println!("| {name}: no wgpu adapter | | | | |"),
        }
    }
    println!(
        "| host reads per f16 scaled step: fused AdamW / Burn's Adam | {} | {} | | 0 fused |",
        flex.2, flex.3
    );
    let memory_ratio = match (f16_peak, f32_peak) {
        (Some((f16, base16)), Some((f32, base32))) => {
            let ratio = f16 as f64 / f32 as f64;
            println!(
                "| peak memory of a step, MLP {batch}x{width}x{depth}, Amp f16 vs f32 (Wgpu) | {:.1} MiB | {:.1} MiB | {:.3} | <= 0.6 |",
                f16 as f64 / 1048576.0,
                f32 as f64 / 1048576.0,
                ratio
            );
            println!(
                "|   (of which params+input before the step) | {:.1} MiB | {:.1} MiB | | |",
                base16 as f64 / 1048576.0,
                base32 as f64 / 1048576.0
            );
            Some(ratio)
        }
        _ => {
            println!("| peak memory: no wgpu allocator figures on this machine | | | | |");
            None
        }
    };
    report::emit(&format!(
        "{{\"bench\":\"autocast\",\"iterations\":{iters},\"overhead_mlp_ratio\":{mlp_ratio:.4},\"overhead_transformer_ratio\":{lm_ratio:.4},\"overhead_elu_mlp_ratio\":{elu_ratio:.4},\"overhead_relu_mlp_ratio\":{relu_ratio:.4},\"peak_memory_f16_over_f32\":{},\"peak_f16_bytes\":{},\"peak_f32_bytes\":{},\"flex_step_amp_over_f32\":{:.4},\"cuda_step_amp_over_f32\":{},\"host_reads_fused\":{},\"host_reads_adam\":{},\"conv_f32_sums_over_half_sums\":{},\"flex_f16_mlp_f32_sums_over_half_sums\":{},\"deform_conv_amp_over_plain\":{},\"wgpu_gelu_mlp_amp_over_plain\":{}}}",
        memory_ratio.map_or("null".to_string(), |r| format!("{r:.4}")),
        f16_peak.map_or("null".to_string(), |p| p.0.to_string()),
        f32_peak.map_or("null".to_string(), |p| p.0.to_string()),
        flex.1.as_secs_f64() / flex.0.as_secs_f64(),
        cuda.map_or("null".to_string(), |c| format!(
            "{:.4}",
            c.1.as_secs_f64() / c.0.as_secs_f64()
        )),
        flex.2,
        flex.3,
        conv_sums.map_or("null".to_string(), |(a, b)| format!("{:.4}", ratio(a, b))),
        mlp_sums.map_or("null".to_string(), |(a, b)| format!("{:.4}", ratio(a, b))),
        deform.map_or("null".to_string(), |(a, b)| format!("{:.4}", ratio(a, b))),
        gelu.map_or("null".to_string(), |(a, b)| format!("{:.4}", ratio(a, b))),
    ));
}
