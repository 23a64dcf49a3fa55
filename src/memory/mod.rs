//! What uses the device's memory: allocator figures where the backend has them, and a peak
//! that CubeCL does not keep.
//!
//! `empty_cache` (the backend's `memory_cleanup`) returns cached pages to the driver; it
//! cannot lower what live tensors use. Parameters, gradients, optimizer state and the
//! activations autodiff saves are what fill memory.

use burn_backend::Backend;
use serde::{Deserialize, Serialize};

/// Where the measured figures (activations, peak) come from. Parameters, gradients and
/// optimizer state are always exact: they are counted from the tensors' sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemorySource {
    /// The device allocator's counters (CubeCL: wgpu, cuda), sampled at the step's phases.
    Allocator,
    /// The process heap, counted by [`CountingAlloc`] (Flex): exact, with a true peak.
    CountingAllocator,
}

/// Device memory at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemorySnapshot {
    /// Where the figures come from.
    pub source: MemorySource,
    /// Bytes held by live tensors.
    pub bytes_in_use: u64,
    /// Bytes the allocator holds from the driver (in use, padding and cached pages).
    pub bytes_reserved: u64,
    /// Live allocations.
    pub allocations: u64,
}

/// Backends whose device memory can be read. The default reads nothing.
pub trait DeviceMemory: Backend {
    /// The allocator's figures for `device`, after the queued work has run; `None` where
    /// the backend has no allocator counters.
    ///
    /// CubeCL counts per stream, and streams are per thread: call this on the thread that
    /// runs the model.
    fn memory_snapshot(device: &Self::Device) -> Option<MemorySnapshot> {
        let _ = device;
        None
    }

    /// The highest bytes in use since [`reset_peak`](Self::reset_peak), where the backend
    /// keeps one (Flex with [`CountingAlloc`]); CubeCL keeps none: sample instead.
    fn peak_in_use(device: &Self::Device) -> Option<u64> {
        let _ = device;
        None
    }

    /// Starts a new peak (see [`peak_in_use`](Self::peak_in_use)).
    fn reset_peak(device: &Self::Device) {
        let _ = device;
    }

    /// Free and total device memory, from the driver (CUDA); `None` where unknown.
    fn free_memory(device: &Self::Device) -> Option<FreeMemory> {
        let _ = device;
        None
    }

    /// Returns cached, unused pages to the driver (PyTorch's `empty_cache`). Live tensors
    /// keep their memory: this does not make a model fit.
    fn empty_cache(device: &Self::Device) {
        Self::memory_cleanup(device)
    }

    /// Backward passes run in this process, where this backend sees them: `Amp<B>` over an
    /// autodiff backend counts its own; `None` elsewhere. [`GrowthWatch`] tells graphs kept
    /// without a backward from tensors kept across steps with it.
    fn backward_passes(device: &Self::Device) -> Option<u64> {
        let _ = device;
        None
    }
}

/// Free and total memory of a device, as its driver reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreeMemory {
    /// Bytes free now (other processes' use excluded).
    pub free: u64,
    /// Bytes on the device.
    pub total: u64,
}

/// Free and total memory of CUDA device `index`, from the driver (`cuMemGetInfo`).
#[cfg(feature = "cuda")]
fn cuda_free_memory(index: usize) -> Option<FreeMemory> {
    // The device's primary context: the one CubeCL runs on, so binding it changes nothing.
    let context = cudarc::driver::CudaContext::new(index).ok()?;
    let (free, total) = context.mem_get_info().ok()?;
    Some(FreeMemory {
        free: free as u64,
        total: total as u64,
    })
}

/// Flex allocates from the process heap: its figures are [`CountingAlloc`]'s, when installed.
impl DeviceMemory for burn::backend::Flex {
    fn memory_snapshot(_device: &Self::Device) -> Option<MemorySnapshot> {
        let bytes_in_use = CountingAlloc::bytes_in_use()?;
        Some(MemorySnapshot {
            source: MemorySource::CountingAllocator,
            bytes_in_use,
            bytes_reserved: bytes_in_use,
            allocations: CountingAlloc::allocations().unwrap_or(0),
        })
    }

    fn peak_in_use(_device: &Self::Device) -> Option<u64> {
        CountingAlloc::peak()
    }

    fn reset_peak(_device: &Self::Device) {
        CountingAlloc::reset_peak()
    }
}

impl<R, F, I, BT> DeviceMemory for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    fn free_memory(device: &Self::Device) -> Option<FreeMemory> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = (device as &dyn core::any::Any).downcast_ref::<burn_cuda::CudaDevice>()
        {
            return cuda_free_memory(cuda.index);
        }
        // wgpu reports no free memory (nor does CubeCL 0.10 for any runtime).
        let _ = device;
        None
    }

    fn memory_snapshot(device: &Self::Device) -> Option<MemorySnapshot> {
        let usage = R::client(device).memory_usage().ok()?;
        Some(MemorySnapshot {
            source: MemorySource::Allocator,
            bytes_in_use: usage.bytes_in_use,
            bytes_reserved: usage.bytes_reserved,
            allocations: usage.number_allocs,
        })
    }
}

impl<B: burn_fusion::FusionBackend + DeviceMemory> DeviceMemory for burn_fusion::Fusion<B> {
    fn memory_snapshot(device: &Self::Device) -> Option<MemorySnapshot> {
        // Queued operations (and the drops behind them) only run on a sync.
        Self::sync(device).ok()?;
        B::memory_snapshot(device)
    }

    fn free_memory(device: &Self::Device) -> Option<FreeMemory> {
        B::free_memory(device)
    }
}

/// `DeviceMemory` for a decorator backend whose device is its inner `B`'s: every figure is
/// `B`'s.
macro_rules! forward_device_memory {
    (impl<$($g:ident),*> for $ty:ty where [$($bounds:tt)*] { $($extra:item)* }) => {
        impl<$($g),*> DeviceMemory for $ty
        where
            $($bounds)*
        {
            fn memory_snapshot(device: &Self::Device) -> Option<MemorySnapshot> {
                B::memory_snapshot(device)
            }

            fn peak_in_use(device: &Self::Device) -> Option<u64> {
                B::peak_in_use(device)
            }

            fn reset_peak(device: &Self::Device) {
                B::reset_peak(device)
            }

            fn free_memory(device: &Self::Device) -> Option<FreeMemory> {
                B::free_memory(device)
            }

            $($extra)*
        }
    };
}

// Not `B`'s backward count: an `Amp` below autodiff never sees a backward.
forward_device_memory!(impl<B, C> for burn::backend::Autodiff<B, C> where [
    B: DeviceMemory,
    C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy,
] {});
forward_device_memory!(impl<B> for crate::Amp<B> where [B: DeviceMemory] {
    fn backward_passes(device: &Self::Device) -> Option<u64> {
        B::ad_enabled(device).then(crate::backend::backward_passes)
    }
});

/// The highest `bytes_in_use` seen across samples: CubeCL keeps no peak, so sample at the
/// points where memory is highest (after forward, after backward).
#[derive(Debug, Clone, Copy, Default)]
pub struct PeakMemory {
    /// The highest in-use figure sampled.
    pub peak: u64,
    /// The first sample: what was live before the measured work.
    pub baseline: Option<u64>,
    /// The last sample.
    pub last: u64,
}

impl PeakMemory {
    /// Samples `device`; returns the in-use bytes, or `None` without figures. Where the
    /// backend keeps a true peak (Flex with [`CountingAlloc`]) it counts too.
    pub fn sample<B: DeviceMemory>(&mut self, device: &B::Device) -> Option<u64> {
        let now = B::memory_snapshot(device)?.bytes_in_use;
        if self.baseline.is_none() {
            self.baseline = Some(now);
            B::reset_peak(device);
        }
        let kept = B::peak_in_use(device).unwrap_or(0);
        self.peak = self.peak.max(now).max(kept);
        self.last = now;
        Some(now)
    }

    /// Peak minus baseline: what the measured work added at its highest.
    pub fn added(&self) -> u64 {
        self.peak.saturating_sub(self.baseline.unwrap_or(0))
    }
}

/// Bytes of a module's float parameters: `(trainable, frozen)`, from the tensors' sizes and
/// dtypes (exact, whatever the backend).
pub fn parameter_bytes<B: Backend, M: burn::module::Module<B>>(module: &M) -> (u64, u64) {
    use burn::module::{ModuleVisitor, Param};
    use burn::tensor::Tensor;
    struct Count {
        trainable: u64,
        frozen: u64,
    }
    impl<B: Backend> ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let t = param.val();
            let bytes = (t.shape().num_elements() * t.dtype().size()) as u64;
            if t.is_require_grad() {
                self.trainable += bytes;
            } else {
                self.frozen += bytes;
            }
        }
    }
    let mut count = Count {
        trainable: 0,
        frozen: 0,
    };
    module.visit(&mut count);
    (count.trainable, count.frozen)
}

/// Values (elements) of a module's trainable float parameters.
pub fn trainable_values<B: Backend, M: burn::module::Module<B>>(module: &M) -> u64 {
    use burn::module::{ModuleVisitor, Param};
    use burn::tensor::Tensor;
    struct Count(u64);
    impl<B: Backend> ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let t = param.val();
            if t.is_require_grad() {
                self.0 += t.shape().num_elements() as u64;
            }
        }
    }
    let mut count = Count(0);
    module.visit(&mut count);
    count.0
}

pub use crate::grads::gradient_bytes;

/// Bytes as MiB, for the reports' text.
pub(crate) fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1048576.0
}

mod counting;
mod finder;
mod growth;
mod guard;
mod report;
mod step;

pub use counting::CountingAlloc;
pub use finder::{BatchPlan, FinderError, find_micro_batch};
pub use growth::{GrowthCause, GrowthWatch, GrowthWatchConfig, GrowthWatchError, MemoryGrowth};
pub use guard::{GuardError, MemoryGuard, OutOfMemory, budget_from_free};
pub use report::{Advice, MemoryReport, StepSettings};
pub use step::StepMemory;
