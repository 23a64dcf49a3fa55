//! The micro-batch and the accumulation: from the flags, or the largest micro-batch that fits
//! a memory budget (`--target-batch auto`).

use burn::tensor::backend::AutodiffBackend;
use burn_amp::memory::{DeviceMemory, MemoryGuard, budget_from_free, find_micro_batch};
use burn_amp::{Precision, autocast};

use super::tiny_lm::{ReversalTask, TinyLm};
use super::{Args, Error2, model_config};

/// The micro-batch and the accumulation from `--batch`, `--accum` and `--micro-batch`.
pub fn batch_plan(args: &Args) -> Result<(usize, usize), Error2> {
    let accum = args.accum;
    if accum == 0 {
        return Err("--accum must be at least 1".into());
    }
    let micro = match (args.batch, args.micro_batch) {
        (Some(batch), Some(micro)) if batch != micro * accum => {
            return Err(format!(
                "--batch {batch} is not --micro-batch {micro} × --accum {accum}: give two of them"
            )
            .into());
        }
        (_, Some(micro)) => micro,
        (batch, None) => {
            let batch = batch.unwrap_or(64);
            if batch % accum != 0 {
                return Err(format!(
                    "--batch {batch} does not split into --accum {accum} micro-batches: \
                     give --micro-batch"
                )
                .into());
            }
            batch / accum
        }
    };
    if micro == 0 {
        return Err("the micro-batch must hold at least one sequence".into());
    }
    Ok((micro, accum))
}

/// `--target-batch auto`: the largest micro-batch whose forward+backward stays within the
/// budget (doubling, then bisection, each size measured once under a `MemoryGuard`), and
/// the accumulation that reaches the effective batch.
pub fn auto_batch<B, Mem>(
    args: &Args,
    device: &B::Device,
    precision: Precision,
) -> Result<(usize, usize), Error2>
where
    B: AutodiffBackend,
    Mem: DeviceMemory<Device = B::Device>,
{
    let target = args.batch.unwrap_or(64);
    // The budget: given, or the device's free memory less a margin (CUDA's driver reports
    // it; wgpu and the CPU do not).
    let budget = match args.memory_budget {
        Some(mib) => (mib * 1048576.0) as u64,
        None => budget_from_free(Mem::free_memory(device)).ok_or(
            "--target-batch auto needs --memory-budget MIB on this backend: only CUDA reports \
             its free memory (wgpu and the CPU do not)",
        )?,
    };
    if Mem::memory_snapshot(device).is_none() {
        return Err(
            "--target-batch auto needs memory figures: a CubeCL backend (wgpu, cuda), \
                    or Flex with burn_amp::memory::CountingAlloc installed"
                .into(),
        );
    }
    let _amp = autocast(precision);
    let config = model_config(args);
    let model: TinyLm<B> = config.init::<B>(device);
    let mut task = ReversalTask::new(config.vocab, config.seq_len, args.seed ^ 0xA5);
    let mut guard = MemoryGuard::new(Some(budget));
    let plan = find_micro_batch(target, |b| {
        let model = model.clone();
        let (x, y) = task.batch::<B>(b, device);
        guard
            .run::<Mem, _>(device, |peak| {
                let loss = model.loss(x, y);
                peak.sample::<Mem>(device);
                let grads = loss.backward();
                peak.sample::<Mem>(device);
                drop(grads);
            })
            .map(|_| guard.last_peak())
    })?;
    // Equal micro-batches as close to the target as the window allows: ceil(target / N)
    // is at most the largest that fits.
    let accum = plan.micro_batches;
    let micro = target.div_ceil(accum);
    eprintln!(
        "--target-batch auto: largest fitting micro-batch {} (forward+backward peak {:.1} of {:.1} MiB); \
         training {micro} x {accum} = {} (target {target})",
        plan.micro_batch,
        plan.peak_bytes.unwrap_or(0) as f64 / 1048576.0,
        budget as f64 / 1048576.0,
        micro * accum
    );
    Ok((micro, accum))
}
