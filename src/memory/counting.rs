//! Exact memory figures for CPU backends: a counting global allocator.

use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::alloc::{GlobalAlloc, Layout, System};

static IN_USE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting: exact memory figures for CPU backends.
///
/// Flex and ndarray allocate their tensors from the process heap and keep no counters, and the
/// resident set of the process does not fall when the system allocator keeps freed pages, so
/// neither tells how much a step's activations take. Installed in one line, this allocator
/// counts the bytes the heap hands out and takes back, and keeps the highest figure since the
/// last reset: a true peak, not a sample.
///
/// ```no_run
/// #[global_allocator]
/// static ALLOC: burn_amp::memory::CountingAlloc = burn_amp::memory::CountingAlloc::new();
/// ```
///
/// Cost: two relaxed atomic operations per allocation and one per free, on top of the system
/// allocator. The figures are the whole process's heap (data loaders and other threads
/// included): measure a step with nothing else running, as the examples do.
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAlloc;

impl CountingAlloc {
    /// The allocator, for a `#[global_allocator]` static.
    pub const fn new() -> Self {
        CountingAlloc
    }

    /// Whether a `CountingAlloc` is the global allocator of this process.
    pub fn is_installed() -> bool {
        INSTALLED.load(Ordering::Relaxed)
    }

    /// Heap bytes in use now; `None` when the allocator is not installed.
    pub fn bytes_in_use() -> Option<u64> {
        Self::is_installed().then(|| IN_USE.load(Ordering::Relaxed))
    }

    /// The highest figure of [`bytes_in_use`](Self::bytes_in_use) since the last
    /// [`reset_peak`](Self::reset_peak) (or the start).
    pub fn peak() -> Option<u64> {
        Self::is_installed().then(|| PEAK.load(Ordering::Relaxed))
    }

    /// Live allocations now.
    pub fn allocations() -> Option<u64> {
        Self::is_installed().then(|| ALLOCATIONS.load(Ordering::Relaxed))
    }

    /// Starts a new peak from what is in use now (per phase: before a step).
    pub fn reset_peak() {
        PEAK.store(IN_USE.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Counts a block the system allocator handed out (`ptr` null: nothing was).
    fn handed_out(ptr: *mut u8, size: usize) -> *mut u8 {
        if !ptr.is_null() {
            if !INSTALLED.load(Ordering::Relaxed) {
                INSTALLED.store(true, Ordering::Relaxed);
            }
            Self::added(size);
        }
        ptr
    }

    fn added(size: usize) {
        let now = IN_USE.fetch_add(size as u64, Ordering::Relaxed) + size as u64;
        PEAK.fetch_max(now, Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }

    fn removed(size: usize) {
        IN_USE.fetch_sub(size as u64, Ordering::Relaxed);
        ALLOCATIONS.fetch_sub(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to `System` with the caller's layout; the counters only
// observe sizes.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        Self::handed_out(unsafe { System.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        Self::handed_out(unsafe { System.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        Self::removed(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            Self::removed(layout.size());
            Self::added(new_size);
        }
        new
    }
}
