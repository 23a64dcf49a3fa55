//! # burn-amp
//!
//! Mixed precision and memory tools for [Burn](https://burn.dev): train any Burn model
//! unchanged, in less memory and less time.
//!
//! - [`Amp<B>`]: a decorator backend applying autocast (f16/bf16 for matmul, conv and
//!   attention; f32 for exp, log, softmax, reductions and norms; promotion for mixed dtypes).
//!   The policy is one table: [`backend::policy`].
//! - [`Precision`] and [`autocast()`]: the per-thread precision, with a scoped override.
//! - [`AmpOptimizer`]: the front door. Wrap any optimizer once; at f16 `backward` scales the
//!   loss and `step` unscales, checks, skips on inf/NaN and updates the scale on the device; at
//!   bf16/f32 it passes through. Works in a hand-written loop and under burn-train's `Learner`
//!   (one or several devices) with the `TrainStep` unchanged ([`amp_optimizer`]).
//! - [`GradScaler`](scaler::GradScaler): the dynamic loss scaler underneath (PyTorch's state
//!   machine, the skip and update on the device), for loops that scale by hand.
//! - [`optim`]: fused AdamW and SGD (one kernel per parameter, no host read per step).
//! - [`GradientAccumulation`]: any optimizer made to step once per N micro-batches, on
//!   their mean (f32 sums), loss-scaling aware, resumable mid-window ([`accumulate`]).
//! - [`grads::GradList`]: a module's gradients as one list (global norm, clipping, unscale).
//! - [`custom_op::CustomOp`]: autocast for an op of your own backend trait (a custom
//!   kernel): how the policy treats it and which dtypes its kernel reads.
//! - [`Frozen`]: a module whose parameters take no gradient and no optimizer state, and can
//!   be stored in bf16/f16, while the gradient flows through it ([`frozen`]).
//!
//! ```no_run
//! use burn::backend::{Autodiff, Flex};
//! use burn_amp::{Amp, Precision, autocast};
//!
//! type B = Amp<Autodiff<Flex>>; // instead of Autodiff<Flex>
//! let _amp = autocast(Precision::F16);
//! // ... build the model on B, wrap the optimizer once:
//! // let optim = AmpOptimizer::new(adam, GradScalerConfig::new())?;
//! // and train as usual (`loss.backward()`, `optim.step(..)`, or burn-train's Learner).
//! ```
#![warn(missing_docs)]

pub mod accumulate;
pub mod amp_optimizer;
pub mod backend;
pub mod custom_op;
pub mod doctor;
pub mod ema;
pub mod error;
pub mod frozen;
pub mod grads;
pub mod kernels;
pub mod memory;
pub mod optim;
pub mod precision;
pub mod record;
pub mod scaler;

pub use accumulate::{GradientAccumulation, GradientAccumulationConfig, Reduction};
pub use amp_optimizer::{AmpOptimizer, AmpOptimizerError};
pub use backend::{Amp, host_reads};
pub use doctor::{PrecisionReport, detect_anomaly, detect_nan};
pub use ema::{Averaged, EmaConfig, EmaOptimizer, EmaPlacement, ModelEma};
pub use error::AmpError;
pub use frozen::{Frozen, freeze};
pub use kernels::AmpKernels;
pub use optim::MemorySaving;
pub use precision::{AutocastGuard, Precision, autocast, set_default_precision};
