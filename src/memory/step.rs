//! [`StepMemory`]: samples memory around the phases of one training step and builds its
//! [`MemoryReport`].

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_backend::Backend;

use super::{
    DeviceMemory, MemoryReport, MemorySnapshot, MemorySource, PeakMemory, StepSettings,
    gradient_bytes, parameter_bytes,
};
use crate::Precision;

/// Samples memory around the phases of one training step: activations are the growth over
/// forward; parameters, gradients and optimizer state come from the tensors' own sizes. Where
/// the backend keeps a true peak (Flex with [`CountingAlloc`](super::CountingAlloc)) the peak
/// is exact, else the highest sample.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepMemory {
    before: Option<MemorySnapshot>,
    after_forward: Option<MemorySnapshot>,
    peak: PeakMemory,
    reserved: u64,
    source: Option<MemorySource>,
    micro_batch: Option<usize>,
}

impl StepMemory {
    fn sample<B: DeviceMemory>(&mut self, device: &B::Device) -> Option<MemorySnapshot> {
        let snapshot = B::memory_snapshot(device)?;
        self.peak.sample::<B>(device);
        self.source = Some(snapshot.source);
        self.reserved = self.reserved.max(snapshot.bytes_reserved);
        Some(snapshot)
    }

    /// Before the forward pass (a new peak starts here).
    pub fn begin<B: DeviceMemory>(device: &B::Device) -> Self {
        let mut this = Self::default();
        this.before = this.sample::<B>(device);
        this
    }

    /// The micro-batch of the step, so that the advice knows whether it can be split.
    pub fn with_micro_batch(mut self, micro_batch: usize) -> Self {
        self.micro_batch = Some(micro_batch);
        self
    }

    /// After the forward pass, before backward: the saved activations are live.
    pub fn after_forward<B: DeviceMemory>(&mut self, device: &B::Device) {
        self.after_forward = self.sample::<B>(device);
    }

    /// After backward (gradients live) or after the optimizer step.
    pub fn after<B: DeviceMemory>(&mut self, device: &B::Device) {
        self.sample::<B>(device);
    }

    /// The report. `optimizer_state` is the optimizer's state in bytes, where known. What the
    /// step already does is read from the model and the backend: the autocast precision in
    /// force, checkpointing (the autodiff backend's strategy), frozen parameters in half.
    pub fn report<B, M>(
        &self,
        module: &M,
        grads: Option<&GradientsParams>,
        optimizer_state: u64,
    ) -> MemoryReport
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
    {
        let (parameters, frozen_parameters) = parameter_bytes::<B, M>(module);
        let gradients = grads.map_or(0, |g| gradient_bytes::<B, M>(module, g));
        let activations = match (self.before, self.after_forward) {
            (Some(b), Some(f)) => Some(f.bytes_in_use.saturating_sub(b.bytes_in_use)),
            _ => None,
        };
        let peak = (self.peak.peak > 0).then_some(self.peak.peak);
        let other_in_use = self.before.map(|b| {
            b.bytes_in_use
                .saturating_sub(parameters + frozen_parameters + optimizer_state)
        });
        MemoryReport {
            other_in_use,
            parameters,
            trainable_values: super::trainable_values::<B, M>(module),
            frozen_parameters,
            gradients,
            optimizer_state,
            activations,
            peak_in_use: peak,
            reserve_and_fragmentation: (self.source == Some(MemorySource::Allocator))
                .then(|| self.reserved.saturating_sub(self.peak.peak)),
            source: self.source,
            settings: StepSettings {
                half_precision: half_precision::<B, M>(module),
                checkpointing: core::any::type_name::<B>().contains("BalancedCheckpointing"),
                micro_batch: self.micro_batch,
                frozen_storage_half: frozen_storage_half::<B, M>(module),
            },
        }
    }
}

/// Whether the step computes in half: `B` is an `Amp` stack and autocast lowers on this
/// thread for the device of `module`.
fn half_precision<B: Backend, M: Module<B>>(module: &M) -> bool {
    let amp = core::any::type_name::<B>().contains("Amp<");
    amp && first_device::<B, M>(module)
        .is_some_and(|device| Precision::effective::<B>(&device).is_low())
}

fn first_device<B: Backend, M: Module<B>>(module: &M) -> Option<B::Device> {
    module.devices().into_iter().next()
}

/// Whether every frozen parameter is stored in a 2-byte float (and there is one).
fn frozen_storage_half<B: Backend, M: Module<B>>(module: &M) -> bool {
    struct Frozen {
        any: bool,
        all_half: bool,
    }
    impl<B: Backend> ModuleVisitor<B> for Frozen {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let t = param.val();
            if !t.is_require_grad() {
                self.any = true;
                self.all_half &= t.dtype().size() == 2;
            }
        }
    }
    let mut frozen = Frozen {
        any: false,
        all_half: true,
    };
    module.visit(&mut frozen);
    frozen.any && frozen.all_half
}
