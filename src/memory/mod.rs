//! What uses the device's memory: allocator figures where the backend has them, and a peak
//! that CubeCL does not keep.
//!
//! `empty_cache` (the backend's `memory_cleanup`) returns cached pages to the driver; it
//! cannot lower what live tensors use. Parameters, gradients, optimizer state and the
//! activations autodiff saves are what fill memory.

use burn_backend::Backend;
use serde::{Deserialize, Serialize};

/// Where a figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemorySource {
    /// Read from the backend's allocator (CubeCL: wgpu, cuda).
    Allocator,
    /// The backend exposes no allocator (Flex, ndarray): activations and peak estimated
    /// from the process resident memory; parameters, gradients and state stay exact.
    Estimate,
}

/// Device memory at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemorySnapshot {
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

    /// Returns cached, unused pages to the driver (PyTorch's `empty_cache`). Live tensors
    /// keep their memory: this does not make a model fit.
    fn empty_cache(device: &Self::Device) {
        Self::memory_cleanup(device)
    }
}

impl DeviceMemory for burn::backend::Flex {}

impl<R, F, I, BT> DeviceMemory for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    fn memory_snapshot(device: &Self::Device) -> Option<MemorySnapshot> {
        let usage = R::client(device).memory_usage().ok()?;
        Some(MemorySnapshot {
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
}

impl<B, C> DeviceMemory for burn::backend::Autodiff<B, C>
where
    B: DeviceMemory,
    C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy,
{
    fn memory_snapshot(device: &Self::Device) -> Option<MemorySnapshot> {
        B::memory_snapshot(device)
    }
}

impl<B: DeviceMemory> DeviceMemory for crate::Amp<B> {
    fn memory_snapshot(device: &Self::Device) -> Option<MemorySnapshot> {
        B::memory_snapshot(device)
    }
}

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
    /// Samples `device`; returns the in-use bytes, or `None` without allocator figures.
    pub fn sample<B: DeviceMemory>(&mut self, device: &B::Device) -> Option<u64> {
        let now = B::memory_snapshot(device)?.bytes_in_use;
        self.baseline.get_or_insert(now);
        self.peak = self.peak.max(now);
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

pub use crate::grads::gradient_bytes;

/// Where the memory of one training step goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemoryReport {
    /// Trainable parameters (exact).
    pub parameters: u64,
    /// Frozen parameters (exact).
    pub frozen_parameters: u64,
    /// Gradients of the step (exact).
    pub gradients: u64,
    /// Optimizer state (exact where the optimizer says, else measured).
    pub optimizer_state: u64,
    /// What autodiff saved for backward: in use after forward minus before it (measured).
    pub activations: u64,
    /// The highest in-use figure sampled during the step.
    pub peak_in_use: u64,
    /// The allocator's reserve beyond what is in use: padding, cached pages, fragmentation.
    pub reserve_and_fragmentation: u64,
    /// Allocator figures, or estimates from tensor sizes.
    pub source: Option<MemorySource>,
}

impl MemoryReport {
    /// The category that uses the most, and the switches that would shrink it, in order of
    /// expected saving.
    pub fn advice(&self) -> (&'static str, &'static [&'static str]) {
        let categories = [
            ("activations", self.activations),
            ("parameters", self.parameters + self.frozen_parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
        ];
        let (name, _) = categories
            .into_iter()
            .max_by_key(|(_, b)| *b)
            .unwrap_or(("activations", 0));
        let switches: &'static [&'static str] = match name {
            "activations" => &[
                "autocast: Precision::Bf16 or F16 halves saved activations",
                "a smaller micro-batch with gradient accumulation",
                "activation checkpointing (Autodiff<B, BalancedCheckpointing>)",
            ],
            "optimizer state" => &[
                "freeze the parts that need no training (no grads, no state)",
                "SGD with momentum keeps 1 buffer per parameter, Adam 2",
            ],
            "gradients" => &[
                "freeze the parts that need no training",
                "Precision::Bf16 or F16 for the activations' share of the step",
            ],
            _ if self.frozen_parameters > self.parameters => &[
                "store the frozen parts in bf16/f16 (Frozen::with_storage: half the bytes)",
                "a smaller model",
            ],
            _ => &[
                "freeze a backbone and store it in bf16 (half the bytes)",
                "a smaller model",
            ],
        };
        (name, switches)
    }
}

fn mib(b: u64) -> String {
    format!("{:>10.2} MiB", b as f64 / 1048576.0)
}

impl core::fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let source = match self.source {
            Some(MemorySource::Allocator) => "allocator",
            Some(MemorySource::Estimate) => {
                "activations and peak: an estimate from the process resident memory"
            }
            None => "tensor sizes only",
        };
        writeln!(f, "memory of one training step ({source})")?;
        writeln!(f, "  parameters         {}", mib(self.parameters))?;
        writeln!(f, "  frozen parameters  {}", mib(self.frozen_parameters))?;
        writeln!(f, "  gradients          {}", mib(self.gradients))?;
        writeln!(f, "  optimizer state    {}", mib(self.optimizer_state))?;
        writeln!(f, "  activations        {}", mib(self.activations))?;
        writeln!(
            f,
            "  reserve + frag.    {}",
            mib(self.reserve_and_fragmentation)
        )?;
        writeln!(f, "  peak in use        {}", mib(self.peak_in_use))?;
        let (name, switches) = self.advice();
        writeln!(f, "  largest: {name}; to shrink it:")?;
        for s in switches {
            writeln!(f, "    - {s}")?;
        }
        Ok(())
    }
}

/// Samples the allocator around the phases of one training step and builds its
/// [`MemoryReport`]: activations as the growth over forward, parameters and gradients
/// from the tensors' own sizes.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepMemory {
    before: Option<MemorySnapshot>,
    after_forward: Option<MemorySnapshot>,
    peak: PeakMemory,
    reserved: u64,
    source: Option<MemorySource>,
}

/// The process's resident memory (Linux), the estimate used where the backend has no
/// allocator counters: it also counts whatever else the process holds, and freed memory
/// the system allocator keeps.
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

impl StepMemory {
    fn sample<B: DeviceMemory>(&mut self, device: &B::Device) -> Option<MemorySnapshot> {
        let snapshot = match B::memory_snapshot(device) {
            Some(snapshot) => {
                self.peak.sample::<B>(device);
                self.source = Some(MemorySource::Allocator);
                snapshot
            }
            None => {
                // No allocator figures (Flex, ndarray): the resident set, labelled an estimate.
                let rss = resident_bytes()?;
                self.source = Some(MemorySource::Estimate);
                self.peak.peak = self.peak.peak.max(rss);
                self.peak.baseline.get_or_insert(rss);
                MemorySnapshot {
                    bytes_in_use: rss,
                    bytes_reserved: rss,
                    allocations: 0,
                }
            }
        };
        self.reserved = self.reserved.max(snapshot.bytes_reserved);
        Some(snapshot)
    }

    /// Before the forward pass.
    pub fn begin<B: DeviceMemory>(device: &B::Device) -> Self {
        let mut this = Self::default();
        this.before = this.sample::<B>(device);
        this
    }

    /// After the forward pass, before backward: the saved activations are live.
    pub fn after_forward<B: DeviceMemory>(&mut self, device: &B::Device) {
        self.after_forward = self.sample::<B>(device);
    }

    /// After backward (gradients live) or after the optimizer step.
    pub fn after<B: DeviceMemory>(&mut self, device: &B::Device) {
        self.sample::<B>(device);
    }

    /// The report. `optimizer_state` is the optimizer's state in bytes, where known.
    pub fn report<B, M>(
        &self,
        module: &M,
        grads: Option<&burn::optim::GradientsParams>,
        optimizer_state: u64,
    ) -> MemoryReport
    where
        B: burn::tensor::backend::AutodiffBackend,
        M: burn::module::AutodiffModule<B>,
    {
        let (parameters, frozen_parameters) = parameter_bytes::<B, M>(module);
        let gradients = grads.map_or(0, |g| gradient_bytes::<B, M>(module, g));
        let activations = match (self.before, self.after_forward) {
            (Some(b), Some(f)) => f.bytes_in_use.saturating_sub(b.bytes_in_use),
            _ => 0,
        };
        MemoryReport {
            parameters,
            frozen_parameters,
            gradients,
            optimizer_state,
            activations,
            peak_in_use: self.peak.peak,
            reserve_and_fragmentation: self.reserved.saturating_sub(self.peak.peak),
            source: self.source,
        }
    }
}

mod finder;
mod guard;

pub use finder::{BatchPlan, FinderError, find_micro_batch};
pub use guard::{GuardError, MemoryGuard, OutOfMemory};
