//! Trains the TinyLm transformer on sequence reversal with mixed precision.
//!
//! ```sh
//! cargo run --release --example train                         # Flex (CPU), bf16
//! cargo run --release --example train -- --precision f16 --inject-nan-at 30,31
//! cargo run --example train -- --precision f16 --inject-nan-at 5 --anomaly  # names the op
//! cargo run --release --example train -- --precision f16 --precision-report
//! cargo run --release --example train -- --accum 4 --micro-batch 16   # effective batch 64
//! cargo run --release --example train -- --freeze embeddings --checkpointing
//! cargo run --release --example train -- --steps 150 --save run    # writes run.mpk
//! cargo run --release --example train -- --steps 300 --resume run  # continues to step 300
//! cargo run --release --example train -- --precision f32 --plot plots/f32
//! cargo run --release --example train -- --plot plots/bf16 --compare plots/f32/history.json
//! cargo run --release --example train -- --backend wgpu --precision f16
//! cargo run --release --features cuda --example train -- --backend cuda
//! ```
//! A progress bar on stderr (when it is a terminal), then a short table and one JSON line on
//! stdout.

/// Exact memory figures on Flex: the heap, counted (CubeCL backends have their allocator's).
#[global_allocator]
static ALLOC: burn_amp::memory::CountingAlloc = burn_amp::memory::CountingAlloc::new();

// The shared model: each example uses part of its methods.
#[allow(dead_code)]
#[path = "../../tests/common/tiny_lm.rs"]
mod tiny_lm;

mod args;
mod batch;
mod json;
use args::{Args, FreezeArg, OptimArg};
use batch::{auto_batch, batch_plan};
use json::{Compared, json_array};
mod plots;

use std::error::Error;
use std::time::{Duration, Instant};

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex, Wgpu};
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Record, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Transaction};
use burn_amp::accumulate::GradientAccumulationRecord;
use burn_amp::doctor::AnomalyGuard;
use burn_amp::kernels::AmpKernels;
use burn_amp::memory::{
    DeviceMemory, MemoryReport, PeakMemory, StepMemory, parameter_bytes, trainable_values,
};
use burn_amp::optim::{FusedAdamW, FusedAdamWConfig, MomentStorage, ScaledAdaptor};
use burn_amp::scaler::{GradScalerConfig, GradScalerRecord};
use burn_amp::{
    Amp, AmpError, AmpOptimizer, GradientAccumulation, MemorySaving, Precision, PrecisionReport,
    autocast, detect_anomaly, freeze, host_reads,
};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use tiny_lm::{ReversalTask, TinyLm, TinyLmConfig, TinyLmRecord};

type Error2 = Box<dyn Error>;

fn main() {
    let args = Args::parse();
    let ckpt = args.checkpointing;
    let result = match args.backend.as_str() {
        "flex" if ckpt => run::<Amp<Autodiff<Flex, BalancedCheckpointing>>, Flex>(&args, "flex"),
        "flex" => run::<Amp<Autodiff<Flex>>, Flex>(&args, "flex"),
        "wgpu" if ckpt => run::<Amp<Autodiff<Wgpu, BalancedCheckpointing>>, Wgpu>(&args, "wgpu"),
        "wgpu" => run::<Amp<Autodiff<Wgpu>>, Wgpu>(&args, "wgpu"),
        #[cfg(feature = "cuda")]
        "cuda" if ckpt => {
            use burn_cuda::Cuda;
            run::<Amp<Autodiff<Cuda, BalancedCheckpointing>>, Cuda>(&args, "cuda")
        }
        #[cfg(feature = "cuda")]
        "cuda" => run::<Amp<Autodiff<burn_cuda::Cuda>>, burn_cuda::Cuda>(&args, "cuda"),
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err("--backend cuda needs `--features cuda`".into()),
        other => Err(format!("unknown backend `{other}`: expected flex, wgpu or cuda").into()),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

/// The fused AdamW for TinyLm.
type AdamW<B> = ScaledAdaptor<FusedAdamW, TinyLm<B>, B>;

/// The loss scaling around gradient accumulation around the fused AdamW (a one-step window
/// at `--accum 1`; the scaling a pass-through at bf16/f32).
type Optim<B> = AmpOptimizer<GradientAccumulation<AdamW<B>, B>, B>;

/// The fused AdamW's record (its moments and step counts, per parameter).
type AdamWRecord<B> = <AdamW<B> as Optimizer<TinyLm<B>, B>>::Record;

/// Everything a run needs to continue where it stopped, as one Burn record; `R` is the
/// wrapped optimizer's record ([`AdamWRecord`]).
#[derive(Record)]
struct TrainState<B: Backend, R: Record<B>> {
    model: TinyLmRecord<B>,
    /// The accumulation window (partial sums, position) and the AdamW moments inside it.
    optim: GradientAccumulationRecord<B, R>,
    /// `None` when the run never scaled (bf16/f32).
    scaler: Option<GradScalerRecord>,
    /// Optimizer steps done.
    step: usize,
    /// Sequences drawn from the data generator: its position.
    samples_drawn: u64,
    micro_batch: usize,
    precision: String,
    history: HistoryRecord,
}

/// What the plots and the final figures are made of.
#[derive(Record, Default, Clone)]
struct HistoryRecord {
    /// Loss per optimizer step (mean over its micro-batches).
    losses: Vec<f32>,
    /// Steps skipped for inf/NaN gradients.
    skipped: Vec<usize>,
    /// The loss scale was read after this many optimizer steps...
    scale_steps: Vec<usize>,
    /// ...and was this.
    scale_values: Vec<f32>,
}

type FileRecorder = NamedMpkFileRecorder<FullPrecisionSettings>;

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1048576.0
}

fn model_config(args: &Args) -> TinyLmConfig {
    TinyLmConfig::new()
        .with_d_model(args.d_model)
        .with_d_ff(args.d_model * 2)
        .with_n_layers(args.layers)
        .with_dropout(0.0)
}

fn run<B, Mem>(args: &Args, backend: &str) -> Result<(), Error2>
where
    B: AutodiffBackend,
    B::InnerBackend: AmpKernels,
    // The memory figures are read through the backend under autodiff (same device type):
    // burn-amp implements `DeviceMemory` for `Autodiff<B>` without checkpointing only.
    Mem: DeviceMemory<Device = B::Device>,
{
    let device = B::Device::default();
    let precision = args
        .precision
        .unwrap_or_else(|| Precision::default_for::<B>(&device));
    if !precision.is_supported::<B>(&device) {
        return Err(format!(
            "{precision} is not supported on {backend} ({device:?}); try --precision f16"
        )
        .into());
    }
    let weights = args.weights.dtype();
    if weights != FloatDType::F32 && precision.low_dtype() != Some(weights) {
        return Err(format!(
            "--weights {} stores the weights in {weights:?}: train at that precision \
             (--precision {}), so the ops run in the weights' dtype",
            args.weights.name(),
            if weights == FloatDType::BF16 {
                "bf16"
            } else {
                "f16"
            }
        )
        .into());
    }
    if !args.inject_nan_at.is_empty() && !precision.needs_loss_scaling() && !args.anomaly {
        return Err(format!(
            "--inject-nan-at shows the loss scaler skipping steps, and the scaler only runs at \
             f16 (at {precision} a NaN would reach the weights): add --precision f16, or \
             --anomaly to see the op that makes it named"
        )
        .into());
    }
    let (micro_batch, accum) = match args.target_batch.as_deref() {
        None => batch_plan(args)?,
        Some("auto") => auto_batch::<B, Mem>(args, &device, precision)?,
        Some(other) => return Err(format!("--target-batch takes `auto`, not `{other}`").into()),
    };
    let log_every = args.log_every.max(1);
    let _amp = autocast(precision);
    B::seed(&device, args.seed);
    let config = model_config(args);
    let mut model: TinyLm<B> = config.init::<B>(&device);
    let mut task = ReversalTask::new(config.vocab, config.seq_len, args.seed);
    let moments = match args.optim {
        OptimArg::Adamw => MomentStorage::F32,
        OptimArg::Adamw8bit => MomentStorage::int8(),
    };
    // The weights' storage and the optimizer, as one preset (`MemorySaving`).
    let storage = MemorySaving::new()
        .with_weights(args.weights.dtype())
        .with_optimizer(
            FusedAdamWConfig::new()
                .with_weight_decay(0.0)
                .with_moments(moments)
                .with_weight_rounding(args.weights.rounding())
                .with_seed(args.seed),
        );
    if args.precision_report {
        return precision_report(&model, &task, precision, micro_batch);
    }
    let adamw = storage.optimizer()?;
    // The one front door: at f16 `backward` scales the loss and `step` unscales, checks,
    // skips and updates the scale on the device; at bf16/f32 it passes through.
    let scaling = GradScalerConfig::new().with_growth_interval(200);
    let mut optim: Optim<B> = AmpOptimizer::new(GradientAccumulation::new(adamw, accum)?, scaling)?;
    let mut history = HistoryRecord::default();
    let mut start_step = 0;
    let mut samples_drawn = 0u64;

    if let Some(path) = &args.resume {
        let state: TrainState<B, AdamWRecord<B>> = FileRecorder::new()
            .load(path.clone(), &device)
            .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
        if state.micro_batch != micro_batch || state.precision != precision.to_string() {
            eprintln!(
                "warning: the run was saved with micro-batch {} at {}, resumed with {micro_batch} \
                 at {precision}",
                state.micro_batch, state.precision
            );
        }
        model = model.load_record(state.model);
        let window = optim
            .inner()
            .clone()
            .try_load_record::<TinyLm<B>>(state.optim)?;
        *optim.inner_mut() = window;
        if let Some(scaler) = state.scaler {
            optim.load_scaler_record(scaler);
        }
        start_step = state.step;
        samples_drawn = state.samples_drawn;
        history = state.history;
        // The generator draws one number per token: one batch of every sequence drawn so far
        // (on the CPU) moves it to where the saved run stopped.
        if samples_drawn > 0 {
            let _ = task.batch::<Flex>(samples_drawn as usize, &Default::default());
        }
        eprintln!("resumed {} at step {start_step}", path.display());
    }
    if start_step >= args.steps {
        return Err(format!(
            "nothing to do: the run is at step {start_step}, --steps is {}",
            args.steps
        )
        .into());
    }
    // Half-precision weights after the resume too: Burn's recorder loads them as f32.
    model = storage.prepare(model);
    if args.freeze == FreezeArg::Embeddings {
        // `TinyLm::tokens` is an `Embedding<B>`, so the module is frozen through `Frozen`
        // and unwrapped again: a leaf that requires no gradient, in the training precision
        // (Burn's `load_record` and the optimizers keep it frozen). After the resume, so
        // that loading a checkpoint does not bring back f32 weights.
        let storage = precision.low_dtype().unwrap_or(FloatDType::F32);
        model.tokens = freeze::<B, _>(model.tokens)
            .with_storage::<B>(storage)
            .into_inner();
    }

    let bar = ProgressBar::new(args.steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} {bar:30} {pos}/{len} steps  {msg}")
            .expect("valid template"),
    );
    bar.set_position(start_step as u64);
    bar.enable_steady_tick(Duration::from_millis(200));

    // The memory of one step by category, for the bar chart: measured on the second step,
    // when the optimizer state exists.
    let measure_at = (start_step + 1).min(args.steps - 1);
    let mut step_report: Option<(MemoryReport, u64)> = None;
    let mut peak = PeakMemory::default();
    // Losses and overflow flags stay on the device until the next read.
    let mut pending_losses: Vec<Tensor<B::InnerBackend, 1>> = Vec::new();
    let mut pending_infs: Vec<(usize, Tensor<B::InnerBackend, 1>)> = Vec::new();
    let mut last_printed = start_step;
    if history.scale_steps.is_empty() {
        // The starting scale, so that the plot begins at step 0 (one read, before timing).
        history.scale_steps.push(0);
        let scale = if precision.needs_loss_scaling() {
            optim.scale()
        } else {
            1.0
        };
        history.scale_values.push(scale);
    }
    let reads_before = host_reads();
    let start = Instant::now();
    // Checks every op from here on (one read back per op: slower, see README).
    let anomaly = args.anomaly.then(detect_anomaly);

    for step in start_step..args.steps {
        // Reading a value back stalls the device until all queued work is done, so the loss,
        // the skip flags, the scale and the memory are read only every `log_every` steps
        // (one transaction for all the losses and flags since the last read, one read of the
        // scaler's state). Between reads, nothing here waits for the device.
        let read_now = (step + 1 - start_step) % log_every == 0 || step + 1 == args.steps;
        let mut window_loss: Option<Tensor<B::InnerBackend, 1>> = None;
        for micro in 0..accum {
            let mut measure =
                (args.plot.is_some() && step == measure_at && micro == 0).then(|| {
                    // Memory before the step: parameters, optimizer state, partial sums.
                    StepMemory::begin::<Mem>(&device).with_micro_batch(micro_batch)
                });
            let sample_peak = read_now && micro + 1 == accum;
            let (x, y) = task.batch::<B>(micro_batch, &device);
            samples_drawn += micro_batch as u64;
            let loss = model.loss(x, y);
            if let Some(m) = measure.as_mut() {
                m.after_forward::<Mem>(&device);
            }
            if sample_peak {
                // After forward: the saved activations are live.
                peak.sample::<Mem>(&device);
            }
            // A plain backward: at f16 the optimizer's installed scale multiplies the loss.
            let mut grads = GradientsParams::from_grads(loss.clone().backward(), &model);
            if sample_peak {
                peak.sample::<Mem>(&device);
            }
            if let Some(m) = measure.as_mut() {
                m.after::<Mem>(&device);
                let state = optim.inner().inner().state_bytes(&model);
                let report = m.report::<B, TinyLm<B>>(&model, Some(&grads), state);
                step_report = Some((report, 0));
            }
            if micro == 0 && args.inject_nan_at.contains(&step) {
                let id = model.head.weight.id;
                if let Some(g) = grads.remove::<B::InnerBackend, 2>(id) {
                    grads.register::<B::InnerBackend, 2>(id, g.mul_scalar(f32::NAN));
                }
            }
            let loss = loss.inner();
            window_loss = Some(match window_loss {
                Some(sum) => sum + loss,
                None => loss,
            });
            // Mid-window this adds the still-scaled gradients to f32 sums (and `update` leaves
            // the scale alone); at the boundary it checks, unscales, steps (or skips the whole
            // window), and `update` moves the scale, all on the device.
            if step == measure_at
                && let Some((_, sums)) = step_report.as_mut()
            {
                // The partial sums are largest just before the boundary call.
                *sums = (*sums).max(optim.inner().buffer_bytes() as u64);
            }
            if let Some(found) = anomaly.as_ref().and_then(AnomalyGuard::report) {
                bar.finish_and_clear();
                println!("anomaly at step {step}:\n{found}");
                println!("{}", serde_json::to_string(&found)?);
                return Err(AmpError::Anomaly(Box::new(found)).into());
            }
            model = optim.try_step(args.lr, model, grads)?;
            if let Some(found_inf) = optim.last_found_inf() {
                pending_infs.push((step, found_inf));
            }
        }
        let window_loss = window_loss.expect("accum >= 1");
        pending_losses.push(if accum == 1 {
            window_loss
        } else {
            window_loss.div_scalar(accum as f32)
        });
        bar.inc(1);

        if read_now {
            let (losses, skipped) = read_pending(&mut pending_losses, &mut pending_infs);
            history.losses.extend(losses);
            history.skipped.extend(skipped);
            let scale = match optim.scaler_record() {
                Some(record) => {
                    if record.floor_overflows >= optim.config().max_floor_overflows as f32 {
                        optim.check()?;
                    }
                    record.scale
                }
                None => 1.0, // nothing scaled yet: bf16/f32
            };
            history.scale_steps.push(step + 1);
            history.scale_values.push(scale);
            let memory = match Mem::memory_snapshot(&device) {
                Some(s) => format!("mem {:.1} MiB in use", mib(s.bytes_in_use)),
                None => {
                    // No allocator figures (Flex): what the training state holds, exactly.
                    let (trainable, frozen) = parameter_bytes::<B, TinyLm<B>>(&model);
                    let state = trainable
                        + frozen
                        + optim.inner().inner().state_bytes(&model)
                        + optim.inner().buffer_bytes() as u64;
                    format!("state {:.2} MiB", mib(state))
                }
            };
            let loss = history.losses.last().copied().unwrap_or(f32::NAN);
            let message = format!(
                "loss {loss:.4}  scale {scale}  skipped {}  {memory}",
                history.skipped.len()
            );
            if bar.is_hidden() {
                // Not a terminal: a plain line now and then instead of the bar.
                if step + 1 - last_printed >= 50 || step + 1 == args.steps {
                    eprintln!("step {:>5}  {message}", step + 1);
                    last_printed = step + 1;
                }
            } else {
                bar.set_message(message);
            }
        }
    }
    bar.finish();
    let wall = start.elapsed().as_secs_f64();
    let reads = host_reads() - reads_before;

    let tail = &history.losses[history.losses.len().saturating_sub(20)..];
    let final_loss = tail.iter().sum::<f32>() / tail.len().max(1) as f32;
    let final_scale = history.scale_values.last().copied().unwrap_or(1.0);
    let skipped = history.skipped.len();
    let batch = micro_batch * accum;
    let tokens = ((args.steps - start_step) * batch * config.seq_len) as f64;
    let peak_bytes = (peak.peak > 0).then_some(peak.peak);
    // Weights, their gradients (same dtype) and the optimizer state, per trainable value.
    let (trainable, _) = parameter_bytes::<B, TinyLm<B>>(&model);
    let values = trainable_values::<B, TinyLm<B>>(&model).max(1);
    let state_bytes = optim.inner().inner().state_bytes(&model);
    let bytes_per_param = (2 * trainable + state_bytes) as f64 / values as f64;

    if let Some(path) = &args.save {
        let state = TrainState {
            model: model.clone().into_record(),
            optim: Optimizer::<TinyLm<B>, B>::to_record(optim.inner()),
            scaler: optim.scaler_record(),
            step: args.steps,
            samples_drawn,
            micro_batch,
            precision: precision.to_string(),
            history: history.clone(),
        };
        FileRecorder::new()
            .record(state, path.clone())
            .map_err(|e| format!("cannot save {}: {e}", path.display()))?;
        eprintln!("saved the training state to {}.mpk", path.display());
    }

    let freeze = match args.freeze {
        FreezeArg::None => "none",
        FreezeArg::Embeddings => "embeddings",
    };
    println!(
        "| backend | precision | optimizer | weights | bytes / param | steps | batch (micro × accum) | final loss | skipped | scale | peak MiB | tokens/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let optim_name = match args.optim {
        OptimArg::Adamw => "adamw",
        OptimArg::Adamw8bit => "adamw8bit",
    };
    let weights_name = args.weights.name();
    println!(
        "| {backend} | {precision} | {optim_name} | {weights_name} | {bytes_per_param:.2} | {} | {batch} ({micro_batch} × {accum}) | {final_loss:.4} | {skipped} | {final_scale} | {} | {:.0} |",
        args.steps,
        peak_bytes.map_or("n/a".into(), |p| format!("{:.1}", mib(p))),
        tokens / wall
    );
    println!(
        "{{\"precision\":\"{precision}\",\"backend\":\"{backend}\",\"optim\":\"{optim_name}\",\"weights\":\"{weights_name}\",\"bytes_per_param\":{bytes_per_param:.4},\"steps\":{},\"final_loss\":{final_loss},\"skipped_steps\":{skipped},\"final_scale\":{final_scale},\"peak_bytes\":{},\"tokens_per_s\":{:.1},\"wall_s\":{wall:.3},\"batch\":{batch},\"micro_batch\":{micro_batch},\"accum\":{accum},\"freeze\":\"{freeze}\",\"checkpointing\":{},\"resumed_at\":{start_step},\"host_reads\":{reads}}}",
        args.steps,
        peak_bytes.map_or("null".into(), |p| p.to_string()),
        tokens / wall,
        args.checkpointing,
    );

    if let Some(dir) = &args.plot {
        std::fs::create_dir_all(dir)?;
        let label = format!("{precision} ({backend})");
        let history_json = format!(
            "{{\"precision\":\"{precision}\",\"backend\":\"{backend}\",\"final_loss\":{final_loss},\"losses\":{},\"skipped\":{},\"scale_steps\":{},\"scale_values\":{}}}\n",
            json_array(&history.losses),
            json_array(&history.skipped),
            json_array(&history.scale_steps),
            json_array(&history.scale_values),
        );
        std::fs::write(dir.join("history.json"), history_json)?;
        let compare = args.compare.as_deref().map(Compared::read).transpose()?;
        plots::loss(
            &dir.join("loss.svg"),
            &label,
            &history.losses,
            compare.as_ref(),
        )?;
        plots::scale(
            &dir.join("scale.svg"),
            &history,
            precision.needs_loss_scaling(),
        )?;
        if let Some((report, accum_bytes)) = step_report {
            eprint!("{report}");
            plots::memory(&dir.join("memory.svg"), &report, accum_bytes)?;
        }
        eprintln!("plots in {}", dir.display());
    }
    Ok(())
}

/// Reads the pending losses and overflow flags in one transaction: the losses in order, and
/// the steps whose window was skipped.
fn read_pending<B: Backend>(
    losses: &mut Vec<Tensor<B, 1>>,
    infs: &mut Vec<(usize, Tensor<B, 1>)>,
) -> (Vec<f32>, Vec<usize>) {
    if losses.is_empty() && infs.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let mut transaction = Transaction::default();
    if !losses.is_empty() {
        transaction = transaction.register(Tensor::cat(std::mem::take(losses), 0));
    }
    let steps: Vec<usize> = infs.iter().map(|(s, _)| *s).collect();
    if !infs.is_empty() {
        let flags = std::mem::take(infs).into_iter().map(|(_, f)| f).collect();
        transaction = transaction.register(Tensor::cat(flags, 0));
    }
    let mut data = transaction.execute().into_iter();
    let losses = data
        .next()
        .map(|d| d.iter::<f32>().collect())
        .unwrap_or_default();
    let skipped = match data.next() {
        Some(d) => steps
            .into_iter()
            .zip(d.iter::<f32>())
            .filter(|(_, f)| *f != 0.0)
            .map(|(s, _)| s)
            .collect(),
        None => Vec::new(),
    };
    (losses, skipped)
}

/// `--precision-report`: one step of the first batch at f32 and at `precision`, op by op.
fn precision_report<B: AutodiffBackend>(
    model: &TinyLm<B>,
    task: &ReversalTask,
    precision: Precision,
    micro_batch: usize,
) -> Result<(), Error2> {
    if !precision.is_low() {
        return Err(
            "--precision-report compares f32 with a half precision: add --precision \
                    f16 or bf16"
                .into(),
        );
    }
    let device = model.devices()[0].clone();
    // A copy of the task: the report's batch is the run's first.
    let (x, y) = task.clone().batch::<B>(micro_batch, &device);
    let scale = GradScalerConfig::new().init_scale;
    let report = PrecisionReport::measure(model, precision, scale, |m: &TinyLm<B>| {
        m.loss(x.clone(), y.clone())
    })?;
    println!("{}", report.table(12));
    println!("{}", report.to_json());
    Ok(())
}
