//! # burn-amp
//!
//! Mixed precision and memory tools for [Burn](https://burn.dev): train any Burn model
//! unchanged, in less memory and less time.
//!
//! - [`Amp<B>`]: a decorator backend applying autocast (f16/bf16 for matmul, conv and
//!   attention; f32 for exp, log, softmax, reductions and norms; promotion for mixed dtypes).
//!   The policy is one table: [`autocast::policy`].
//! - [`Precision`] and [`autocast()`]: the per-thread precision, with a scoped override.
//!
//! ```no_run
//! use burn::backend::{Autodiff, Flex};
//! use burn_amp::{Amp, Precision, autocast};
//!
//! type B = Amp<Autodiff<Flex>>; // instead of Autodiff<Flex>; nothing else changes
//! let _amp = autocast(Precision::Bf16);
//! // ... build the model on B and train as usual ...
//! ```
#![warn(missing_docs)]

pub mod autocast;
pub mod demo;
pub mod error;
pub mod kernels;
pub mod precision;
pub mod scaler;

pub use autocast::{Amp, host_reads};
pub use error::AmpError;
pub use precision::{AutocastGuard, Precision, autocast};
