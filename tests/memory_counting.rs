//! Exact memory figures on Flex through the counting allocator this binary installs: the
//! activations of a known step against the hand count, the peak with and without
//! checkpointing, rows that add up to the peak, advice that follows what the step already does.
//!
//! The allocator counts the whole process: the tests take turns ([`serial`]), and nothing here
//! runs wgpu (lavapipe's device memory is process heap too).

mod common;

use std::sync::{Mutex, MutexGuard};

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::FloatDType;
use burn_amp::memory::{CountingAlloc, MemoryReport, MemorySource, StepMemory};
use burn_amp::{Amp, Frozen, freeze};
use common::memory::{assert_measured, step_report};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn flex_activations_are_exact_with_the_counting_allocator() {
    let _s = serial();
    assert!(CountingAlloc::is_installed());
    let report = step_report::<Autodiff<Flex>>();
    assert_measured(&report, MemorySource::CountingAllocator);
    // The true peak: at least everything live after forward (parameters, input, activations).
    assert!(report.to_string().contains("CountingAlloc"));
}

#[test]
fn the_rows_add_up_to_the_peak() {
    let _s = serial();
    let report = step_report::<Autodiff<Flex>>();
    let rows = report.parameters
        + report.frozen_parameters
        + report.gradients
        + report.optimizer_state
        + report.activations.unwrap()
        + report.other_in_use.unwrap();
    let unexplained = report.unexplained().expect("a peak");
    assert_eq!(
        rows as i64 + unexplained,
        report.peak_in_use.unwrap() as i64
    );
    // What is left is the step's own temporaries (backward's intermediates): positive, and
    // its own row, beside what the process held before the step.
    assert!(unexplained > 0, "{report}");
    assert!(report.other_in_use.unwrap() > 0, "{report}");
    let text = report.to_string();
    assert!(
        text.contains("workspace / temporaries") && text.contains("= peak in use"),
        "{text}"
    );
}

#[test]
fn checkpointing_lowers_the_peak_and_is_not_advised_again() {
    let _s = serial();
    let plain = step_report::<Autodiff<Flex>>();
    let checkpointed = step_report::<Autodiff<Flex, BalancedCheckpointing>>();
    let (a, b) = (
        plain.activations.unwrap(),
        checkpointed.activations.unwrap(),
    );
    eprintln!(
        "activations plain {a}, checkpointed {b}; peak {} / {}",
        plain.peak_in_use.unwrap(),
        checkpointed.peak_in_use.unwrap()
    );
    assert!(b < a, "checkpointing kept more: {b} >= {a}");
    assert!(checkpointed.peak_in_use < plain.peak_in_use);
    let mentions = |r: &MemoryReport| {
        r.advice()
            .iter()
            .any(|a| a.action.contains("checkpointing"))
    };
    assert!(mentions(&plain), "{plain}");
    assert!(!mentions(&checkpointed), "{checkpointed}");
    assert!(checkpointed.settings.checkpointing);
}

/// A large frozen layer (stored in `storage`) before a small trainable one: parameters are
/// the largest category.
#[derive(Module, Debug)]
struct FrozenBig<B: Backend> {
    backbone: Frozen<Linear<B>>,
    head: Linear<B>,
}

fn frozen_report(storage: FloatDType) -> MemoryReport {
    // Under `Amp`: a bf16 frozen layer takes the f32 input through autocast's promotion.
    type B = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let model = FrozenBig::<B> {
        backbone: freeze(LinearConfig::new(2048, 2048).init(&device)).with_storage::<B>(storage),
        head: LinearConfig::new(2048, 2).init(&device),
    };
    // The exact rows only (no measurement): parameters are the largest of them.
    StepMemory::default().report::<B, _>(&model, None, 0)
}

#[test]
fn half_frozen_storage_is_never_advised_twice() {
    let _s = serial();
    let f32_frozen = frozen_report(FloatDType::F32);
    let half_frozen = frozen_report(FloatDType::BF16);
    for r in [&f32_frozen, &half_frozen] {
        assert_eq!(r.largest().0, "parameters", "{r}");
    }
    let advises = |r: &MemoryReport| {
        r.advice()
            .iter()
            .find(|a| a.action.contains("Frozen::with_storage"))
            .map(|a| a.saving)
    };
    // f32 frozen: store it in half, saving half its bytes.
    assert_eq!(
        advises(&f32_frozen),
        Some(Some(f32_frozen.frozen_parameters / 2))
    );
    assert!(!half_frozen.settings.frozen_storage_half || advises(&half_frozen).is_none());
    assert!(half_frozen.settings.frozen_storage_half);
    assert_eq!(advises(&half_frozen), None, "{half_frozen}");
}
