//! The example's command line.

use std::path::PathBuf;

use burn::tensor::FloatDType;
use burn_amp::Precision;
use burn_amp::optim::WeightRounding;
use clap::{Parser, ValueEnum};

#[derive(Parser, Debug, Clone)]
#[command(about = "Train a small transformer with burn-amp")]
pub struct Args {
    /// flex (CPU), wgpu, or cuda (needs --features cuda).
    #[arg(long, default_value = "flex")]
    pub backend: String,
    /// f32, f16 or bf16; the default is the device's best (bf16 where supported, else f16).
    #[arg(long)]
    pub precision: Option<Precision>,
    /// Optimizer steps (the total, counting those of a resumed run).
    #[arg(long, default_value_t = 300)]
    pub steps: usize,
    /// Sequences per optimizer step: the effective batch [default: 64, or micro-batch × accum].
    #[arg(long)]
    pub batch: Option<usize>,
    /// Micro-batches per optimizer step (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    pub accum: usize,
    /// Sequences per micro-batch [default: batch / accum].
    #[arg(long)]
    pub micro_batch: Option<usize>,
    /// Learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Seed of the model and the data.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Steps whose gradients get a NaN, to show the scaler skipping them (needs f16), or with
    /// --anomaly, to show anomaly mode naming the op that made it (any precision).
    #[arg(long, value_delimiter = ',')]
    pub inject_nan_at: Vec<usize>,
    /// Anomaly mode: every float op's output is checked for inf/NaN; the run stops at the first
    /// op that creates one and names it (op, dtype, shapes, the line that called it).
    #[arg(long)]
    pub anomaly: bool,
    /// Print the precision report of one step (f32 against --precision, op by op, and the
    /// gradients' underflow at the initial loss scale) as a table and a JSON line, and exit.
    #[arg(long)]
    pub precision_report: bool,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    pub d_model: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// Parts to freeze: the token embedding is then stored in the training precision and
    /// gets no gradient and no optimizer state.
    #[arg(long, value_enum, default_value_t = FreezeArg::None)]
    pub freeze: FreezeArg,
    /// Activation checkpointing: `Autodiff<B, BalancedCheckpointing>` recomputes cheap
    /// activations in backward instead of saving them.
    #[arg(long)]
    pub checkpointing: bool,
    /// Continue a run saved with --save (the recorder adds the .mpk extension).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Save the whole training state at the end (model, optimizer, scaler, accumulation
    /// window, step, data position, history); the recorder adds the .mpk extension.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Read the loss, scale and memory back from the device every this many steps.
    #[arg(long, default_value_t = 10)]
    pub log_every: usize,
    /// Write SVG plots (loss, loss scale, memory of one step) and history.json to this folder.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// A history.json of an earlier run (say at --precision f32) to overlay on the loss plot;
    /// the JSON line this example prints works too (its final loss is drawn as a line).
    #[arg(long, requires = "plot")]
    pub compare: Option<PathBuf>,
    /// `auto`: pick the largest micro-batch whose training step fits --memory-budget, and
    /// accumulate to reach --batch (rounded up to whole micro-batches). Needs memory figures
    /// (wgpu, cuda; Flex through the counting allocator this example installs).
    #[arg(long)]
    pub target_batch: Option<String>,
    /// Memory budget in MiB for --target-batch auto [default on CUDA: the free memory less a
    /// margin; required elsewhere]. It bounds a micro-batch's forward+backward; optimizer
    /// state and accumulation sums come on top.
    #[arg(long)]
    pub memory_budget: Option<f64>,
    /// AdamW's moments: f32 (`adamw`, 8 bytes per parameter) or 8-bit blocks (`adamw8bit`,
    /// about 2).
    #[arg(long, value_enum, default_value_t = OptimArg::Adamw)]
    pub optim: OptimArg,
    /// The trainable weights: f32, or half precision with stochastic rounding and no f32
    /// master copy (`bf16-sr`, `f16-sr`; `bf16` rounds to nearest, to show why not).
    #[arg(long, value_enum, default_value_t = WeightsArg::F32)]
    pub weights: WeightsArg,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimArg {
    /// f32 moments.
    Adamw,
    /// 8-bit block-wise moments (`MomentStorage::int8()`).
    Adamw8bit,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsArg {
    /// f32 weights.
    F32,
    /// bf16 weights, stochastic rounding.
    Bf16Sr,
    /// bf16 weights, rounded to nearest.
    Bf16,
    /// f16 weights, stochastic rounding (with f16 autocast and the loss scaler).
    F16Sr,
}

impl WeightsArg {
    pub fn dtype(self) -> FloatDType {
        match self {
            Self::F32 => FloatDType::F32,
            Self::Bf16Sr | Self::Bf16 => FloatDType::BF16,
            Self::F16Sr => FloatDType::F16,
        }
    }

    pub fn rounding(self) -> WeightRounding {
        match self {
            Self::Bf16 | Self::F32 => WeightRounding::Nearest,
            Self::Bf16Sr | Self::F16Sr => WeightRounding::Stochastic,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16Sr => "bf16-sr",
            Self::Bf16 => "bf16",
            Self::F16Sr => "f16-sr",
        }
    }
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreezeArg {
    /// Train everything.
    None,
    /// Freeze the token embedding.
    Embeddings,
}
