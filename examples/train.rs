//! Trains the TinyLm transformer on sequence reversal with mixed precision.
//!
//! ```sh
//! cargo run --release --example train                         # Flex (CPU), bf16
//! cargo run --release --example train -- --precision f16 --inject-nan-at 30,31
//! cargo run --release --example train -- --backend wgpu --precision f16
//! cargo run --release --features cuda --example train -- --backend cuda
//! ```
//! Prints a short table, then one JSON line.

use std::time::Instant;

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::demo::{ReversalTask, TinyLmConfig};
use burn_amp::kernels::AmpKernels;
use burn_amp::memory::{DeviceMemory, PeakMemory};
use burn_amp::scaler::{FusedAdamWConfig, GradScalerConfig};
use burn_amp::{Amp, Precision, autocast};
use clap::Parser;

#[derive(Parser, Debug, Clone)]
#[command(about = "Train a small transformer with burn-amp")]
struct Args {
    /// flex (CPU), wgpu, or cuda (needs --features cuda).
    #[arg(long, default_value = "flex")]
    backend: String,
    /// f32, f16 or bf16; the default is the device's best (bf16 where supported, else f16).
    #[arg(long)]
    precision: Option<Precision>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seed of the model and the data.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Steps whose gradients get a NaN, to show the scaler skipping them (f16).
    #[arg(long, value_delimiter = ',')]
    inject_nan_at: Vec<usize>,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    d_model: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    layers: usize,
}

fn main() {
    let args = Args::parse();
    match args.backend.as_str() {
        "flex" => run::<Amp<Autodiff<Flex>>>(&args, "flex"),
        "wgpu" => run::<Amp<Autodiff<Wgpu>>>(&args, "wgpu"),
        #[cfg(feature = "cuda")]
        "cuda" => run::<Amp<Autodiff<burn_cuda::Cuda>>>(&args, "cuda"),
        #[cfg(not(feature = "cuda"))]
        "cuda" => {
            eprintln!("error: --backend cuda needs `--features cuda`");
            std::process::exit(2);
        }
        other => {
            eprintln!("error: unknown backend `{other}`: expected flex, wgpu or cuda");
            std::process::exit(2);
        }
    }
}

fn run<B>(args: &Args, backend: &str)
where
    B: AutodiffBackend + DeviceMemory,
    B::InnerBackend: AmpKernels,
{
    let device = B::Device::default();
    let precision = args
        .precision
        .unwrap_or_else(|| Precision::default_for::<B>(&device));
    if !precision.is_supported::<B>(&device) {
        eprintln!(
            "error: {precision} is not supported on {backend} ({device:?}); try --precision f16"
        );
        std::process::exit(2);
    }
    let _amp = autocast(precision);
    B::seed(&device, args.seed);
    let config = TinyLmConfig::new()
        .with_d_model(args.d_model)
        .with_d_ff(args.d_model * 2)
        .with_n_layers(args.layers)
        .with_dropout(0.0);
    let mut model = config.init::<B>(&device);
    let mut task = ReversalTask::new(config.vocab, config.seq_len, args.seed);
    let mut scaler = GradScalerConfig::new()
        .with_growth_interval(200)
        .init::<B>(&device, precision)
        .expect("valid scaler config");
    let mut optim = FusedAdamWConfig::new().with_weight_decay(0.0).init::<B>();
    let mut peak = PeakMemory::default();

    let start = Instant::now();
    let mut losses = Vec::with_capacity(args.steps);
    let mut skipped = 0;
    for step in 0..args.steps {
        let (x, y) = task.batch::<B>(args.batch, &device);
        let loss = model.loss(x, y);
        let mut grads = GradientsParams::from_grads(scaler.scale(loss.clone()).backward(), &model);
        peak.sample::<B>(&device);
        if args.inject_nan_at.contains(&step) {
            let id = model.head.weight.id;
            if let Some(g) = grads.remove::<B::InnerBackend, 2>(id) {
                grads.register::<B::InnerBackend, 2>(id, g.mul_scalar(f32::NAN));
            }
        }
        let (m, report) = scaler
            .step_fused(&mut optim, args.lr, model, grads)
            .expect("scaler used in order");
        model = m;
        scaler.update().expect("scaler used in order");
        // Reading the loss and the skip flag costs two host reads; a real loop would read
        // them every few steps only.
        losses.push(loss.into_scalar().elem::<f32>());
        if report.skipped() {
            skipped += 1;
        }
        if step % 50 == 0 || step + 1 == args.steps {
            eprintln!(
                "step {step:>5}  loss {:.4}  scale {}  skipped {skipped}",
                losses[step],
                scaler.scale_value()
            );
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let tail = &losses[losses.len().saturating_sub(20)..];
    let final_loss = tail.iter().sum::<f32>() / tail.len().max(1) as f32;
    let tokens = (args.steps * args.batch * config.seq_len) as f64;
    let peak_bytes = (peak.peak > 0).then_some(peak.peak);

    println!(
        "| backend | precision | steps | final loss | skipped | scale | peak MiB | tokens/s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {backend} | {precision} | {} | {final_loss:.4} | {skipped} | {} | {} | {:.0} |",
        args.steps,
        scaler.scale_value(),
        peak_bytes.map_or("n/a".into(), |p| format!("{:.1}", p as f64 / 1048576.0)),
        tokens / wall
    );
    println!(
        "{{\"precision\":\"{precision}\",\"backend\":\"{backend}\",\"steps\":{},\"final_loss\":{final_loss},\"skipped_steps\":{skipped},\"final_scale\":{},\"peak_bytes\":{},\"tokens_per_s\":{:.1},\"wall_s\":{wall:.3}}}",
        args.steps,
        scaler.scale_value(),
        peak_bytes.map_or("null".into(), |p| p.to_string()),
        tokens / wall
    );
}
