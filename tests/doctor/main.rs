//! The precision doctor on Flex (f16, bf16) and Wgpu on lavapipe (f16), with `Amp` above
//! autodiff (`Amp<Autodiff<B>>`: forward ops) and below it (`Autodiff<Amp<B>>`: forward and
//! backward ops).
//!
//! - `anomaly.rs`: the op that creates the first inf/NaN is named (an f16 matmul whose sum
//!   exceeds 65504, autocast's cast of an input above 65504, an `exp` in f16, `log` of a
//!   negative, a NaN scalar, a gradient in the backward pass) with its dtype and a frame of
//!   the test's own code; the ops that pass it on are not blamed; a `-inf` mask is not an
//!   anomaly; a healthy step reports nothing. A value no watched op made (host data with a
//!   NaN, an additive mask, a batch built on another thread) is told as entered, not blamed,
//!   step by step, and after a `-inf` mask placed and passed on in the same step.
//! - `precision_report.rs`: on TinyLm the report ranks op calls by what they lose in half
//!   precision, a planted catastrophic-cancellation matmul is at the top, gradients'
//!   underflow follows the loss scale, the JSON parses.
//! - `choices.rs`: a router's argmax, top-2 and sort in half precision against f32: the
//!   share of choices that differ, as the test computes it from the two runs.
//!
//! Tests that seed the backend or initialise a model take turns ([`serial`]).

#[path = "../common/mod.rs"]
mod common;

mod anomaly;
mod choices;
mod precision_report;

use std::sync::{Mutex, MutexGuard};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}
