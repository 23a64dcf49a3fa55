//! Backward passes run through [`Amp`](super::Amp), counted for the whole process: autodiff
//! frees the graphs of forward passes that never reached a backward only when the next
//! backward runs, so "no backward while memory climbed" names that leak
//! ([`GrowthWatch`](crate::memory::GrowthWatch)).

use core::sync::atomic::{AtomicU64, Ordering};

static BACKWARD_PASSES: AtomicU64 = AtomicU64::new(0);

#[inline]
pub(crate) fn count_backward_pass() {
    BACKWARD_PASSES.fetch_add(1, Ordering::Relaxed);
}

/// Backward passes run through `Amp` in this process, on any thread.
pub fn backward_passes() -> u64 {
    BACKWARD_PASSES.load(Ordering::Relaxed)
}
