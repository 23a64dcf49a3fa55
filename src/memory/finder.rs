//! The largest micro-batch that fits, and the accumulation that reaches the target batch:
//! doubling, then bisection, like Lightning's `BatchSizeFinder`.

use thiserror::Error;

use super::guard::GuardError;

/// A micro-batch and the accumulation that reaches the effective batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPlan {
    /// The largest micro-batch that fits.
    pub micro_batch: usize,
    /// Micro-batches per window (per optimizer step): `ceil(target / micro_batch)`, the
    /// `micro_batches` of a `GradientAccumulationConfig`.
    pub micro_batches: usize,
    /// The last micro-batch of each window: `target - micro_batch * (micro_batches - 1)`, so
    /// that a window covers exactly the target.
    pub last_micro_batch: usize,
    /// The peak measured at `micro_batch`, where known.
    pub peak_bytes: Option<u64>,
}

/// Why no plan was found.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum FinderError {
    /// The target batch is 0.
    #[error("the target batch must be at least 1")]
    TargetTooSmall,
    /// Even one sample does not fit.
    #[error("even a micro-batch of 1 does not fit: {0}")]
    NothingFits(GuardError),
}

/// Finds the largest micro-batch `<= target` for which `try_step` succeeds.
///
/// `try_step(b)` runs one training step at micro-batch `b` (under a
/// [`MemoryGuard`](super::MemoryGuard) with the budget) and returns the peak it measured.
/// Sizes are tried by doubling from 1, then by bisection between the last that fit and the
/// first that did not; `try_step` runs O(log target) times.
pub fn find_micro_batch(
    target: usize,
    mut try_step: impl FnMut(usize) -> Result<Option<u64>, GuardError>,
) -> Result<BatchPlan, FinderError> {
    if target == 0 {
        return Err(FinderError::TargetTooSmall);
    }
    let mut fit = match try_step(1) {
        Ok(peak) => (1, peak),
        Err(e) => return Err(FinderError::NothingFits(e)),
    };
    // Doubling: `fail` is the first size known not to fit (or target + 1).
    let mut fail = target + 1;
    while fit.0 < target {
        let next = (fit.0 * 2).min(target);
        match try_step(next) {
            Ok(peak) => fit = (next, peak),
            Err(_) => {
                fail = next;
                break;
            }
        }
    }
    // Bisection in (fit, fail).
    while fail - fit.0 > 1 {
        let mid = fit.0 + (fail - fit.0) / 2;
        match try_step(mid) {
            Ok(peak) => fit = (mid, peak),
            Err(_) => fail = mid,
        }
    }
    let micro_batch = fit.0;
    let micro_batches = target.div_ceil(micro_batch);
    Ok(BatchPlan {
        micro_batch,
        micro_batches,
        last_micro_batch: target - micro_batch * (micro_batches - 1),
        peak_bytes: fit.1,
    })
}
