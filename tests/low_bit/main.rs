//! Six bytes per parameter: 8-bit AdamW moments and stochastic rounding into bf16/f16
//! parameters, on Flex (the burn-op fallbacks; bf16 and f16) and Wgpu on lavapipe (the CubeCL
//! kernels; f16, WGSL has no bf16). The kernels against the fallbacks, step by step, are in
//! `tests/kernels/optim/quantized.rs`.
//!
//! - `quantize.rs`: block quantization round trips within the map's spacing, for random,
//!   all-zero, tiny, huge and outlier blocks; codes equal a host encoder's.
//! - `rounding.rs`: stochastic rounding is unbiased (mean of 65,536 roundings of one value),
//!   reproducible for a seed, and rounding to nearest loses updates under half a spacing.
//! - `composition.rs`: a skipped step (loss scaler) leaves weights, moments and the rounding
//!   stream bit for bit; records resume bit for bit through a half-precision recorder;
//!   accumulation; bytes per parameter from the `MemoryReport`.
//! - `training.rs`: TinyLm on reversal and a small conv net, f32 AdamW against 8-bit AdamW
//!   and 8-bit AdamW with bf16 weights, same seeds; bf16 weights rounded to nearest fall
//!   behind.
//!
//! The tests that install an `AmpOptimizer` (one per backend type, process-wide) or draw from
//! the backend's seeded generator (process-wide too: a model initialised on another thread
//! between a seed and its model would change that model) take turns ([`serial`]).

#[path = "../common/mod.rs"]
mod common;

mod composition;
mod ema;
mod quantize;
mod rounding;
mod training;

use std::sync::{Mutex, MutexGuard};

use burn::prelude::*;

static SERIAL: Mutex<()> = Mutex::new(());

/// One test at a time where an `AmpOptimizer` is installed or a model is initialised.
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

use common::Rng;

/// A tensor's values as f32.
fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(burn::tensor::DType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap()
}

/// A tensor's raw bytes, in its own dtype.
fn raw<B: Backend, const D: usize, K: burn::tensor::BasicOps<B>>(t: Tensor<B, D, K>) -> Vec<u8> {
    t.into_data().as_bytes().to_vec()
}
