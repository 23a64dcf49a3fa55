//! Reads back to the host made through [`Amp`](super::Amp): every `*_into_data`, transaction
//! and `sync`. Each one stalls the device pipeline, so a training step should make none; the
//! scaler's tests count them.

use core::cell::Cell;

thread_local! {
    static HOST_READS: Cell<u64> = const { Cell::new(0) };
}

#[inline]
pub(crate) fn count_host_read() {
    HOST_READS.with(|c| c.set(c.get() + 1));
}

/// Reads to the host made through `Amp` on this thread: every `*_into_data`, transaction
/// and `sync`. Each one stalls the device pipeline; a training step should make none.
pub fn host_reads() -> u64 {
    HOST_READS.with(|c| c.get())
}
