//! A training step run under a guard: an allocation failure, or a step over a byte budget,
//! becomes a typed [`OutOfMemory`] with advice, instead of an abort or silent zeros.
//!
//! How a failed allocation surfaces in Burn 0.21 (`shared/BURN_0_21_NOTES.md`): on wgpu it
//! panics on the device thread, the caller's op returns normally, `sync` then returns an
//! error ("server is in an invalid state") and `into_data` returns zeros. So a step counts
//! as done only once a sync says so; a panic in the caller's thread is caught as well.
//!
//! Nothing is lost: run the step on clones of the model and optimizer (Burn modules clone
//! by reference count) and keep the originals until the guard returns `Ok`.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use thiserror::Error;

use super::{DeviceMemory, MemoryReport, PeakMemory};

/// The step did not fit.
#[derive(Debug, Clone, PartialEq, Error)]
#[error(
    "out of memory: {cause}{}. Largest use: {dominant}. Try, in order: {}",
    needed.map(|n| format!(" (the step needs {:.1} MiB, budget {} )", n as f64 / 1048576.0,
        budget.map_or("none".to_string(), |b| format!("{:.1} MiB", b as f64 / 1048576.0)))).unwrap_or_default(),
    advice.join("; ")
)]
pub struct OutOfMemory {
    /// What failed: the allocator's message, or the budget that was exceeded.
    pub cause: String,
    /// The peak the step reached, where measured.
    pub needed: Option<u64>,
    /// The budget in force.
    pub budget: Option<u64>,
    /// The last memory report given to the guard.
    pub report: Option<MemoryReport>,
    /// The category using the most memory.
    pub dominant: &'static str,
    /// The switches that would help, largest saving first, each with its estimated saving.
    pub advice: Vec<String>,
}

/// A guarded step that failed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum GuardError {
    /// It ran out of memory.
    #[error(transparent)]
    OutOfMemory(Box<OutOfMemory>),
    /// The device failed for another reason.
    #[error("the device failed during the step: {0}")]
    Device(String),
}

impl From<OutOfMemory> for GuardError {
    fn from(oom: OutOfMemory) -> Self {
        GuardError::OutOfMemory(Box::new(oom))
    }
}

/// Runs steps under a byte budget and turns allocation failures into [`OutOfMemory`].
#[derive(Debug, Clone, Default)]
pub struct MemoryGuard {
    budget: Option<u64>,
    report: Option<MemoryReport>,
    last_peak: Option<u64>,
}

/// Whether a message reads like an allocation failure.
fn is_allocation_failure(msg: &str) -> bool {
    let msg = msg.to_ascii_lowercase();
    [
        "out of memory",
        "outofmemory",
        "alloc",
        "max_page_size",
        "memory",
        "invalid state",
    ]
    .iter()
    .any(|k| msg.contains(k))
}

fn panic_message(e: &(dyn core::any::Any + Send)) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without message".into())
}

/// The budget to use when none is given: the device's free memory less a margin (a tenth,
/// at least 256 MiB: the allocator's padding, the driver, other processes starting); `None`
/// where the free memory is unknown (wgpu, Flex).
pub fn budget_from_free(free: Option<super::FreeMemory>) -> Option<u64> {
    let free = free?.free;
    let margin = (free / 10).max(256 << 20);
    Some(free.saturating_sub(margin))
}

impl MemoryGuard {
    /// A guard; `budget` caps the peak bytes in use of a step (a cap lets CPU machines,
    /// which have no real limit, test the out-of-memory path).
    pub fn new(budget: Option<u64>) -> Self {
        Self {
            budget,
            ..Self::default()
        }
    }

    /// A guard for `device`: `budget`, or else the device's free memory less a margin
    /// ([`budget_from_free`], CUDA), or else no budget (allocation failures are still caught).
    pub fn for_device<B: DeviceMemory>(device: &B::Device, budget: Option<u64>) -> Self {
        Self::new(budget.or_else(|| budget_from_free(B::free_memory(device))))
    }

    /// The budget in force.
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// The last report of a successful step, attached to later errors.
    pub fn set_report(&mut self, report: MemoryReport) {
        self.report = Some(report);
    }

    /// The peak in use of the last step that ran, where measured.
    pub fn last_peak(&self) -> Option<u64> {
        self.last_peak
    }

    fn oom(&self, cause: String, needed: Option<u64>) -> OutOfMemory {
        let report = self.report.unwrap_or_default();
        OutOfMemory {
            cause,
            needed,
            budget: self.budget,
            report: self.report,
            dominant: report.largest().0,
            advice: report.advice().iter().map(ToString::to_string).collect(),
        }
    }

    /// Runs `step`, then syncs the device; the step's peak is sampled through the
    /// [`PeakMemory`] it is given (sample after forward and after backward).
    pub fn run<B: DeviceMemory, T>(
        &mut self,
        device: &B::Device,
        step: impl FnOnce(&mut PeakMemory) -> T,
    ) -> Result<T, GuardError> {
        let mut peak = PeakMemory::default();
        peak.sample::<B>(device);
        self.last_peak = None;
        let out = match catch_unwind(AssertUnwindSafe(|| step(&mut peak))) {
            Ok(out) => out,
            Err(panic) => {
                let msg = panic_message(panic.as_ref());
                if is_allocation_failure(&msg) {
                    return Err(self.oom(msg, None).into());
                }
                resume_unwind(panic);
            }
        };
        if let Err(e) = B::sync(device) {
            let msg = e.to_string();
            return Err(if is_allocation_failure(&msg) {
                self.oom(msg, None).into()
            } else {
                GuardError::Device(msg)
            });
        }
        peak.sample::<B>(device);
        let measured = (peak.peak > 0).then_some(peak.peak);
        self.last_peak = measured;
        match (self.budget, measured) {
            (Some(budget), Some(needed)) if needed > budget => Err(self
                .oom(
                    format!("the step's peak exceeds the budget of {budget} bytes"),
                    Some(needed),
                )
                .into()),
            _ => Ok(out),
        }
    }
}
