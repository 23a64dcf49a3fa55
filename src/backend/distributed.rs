//! `Amp<B>` as a Burn [`DistributedBackend`] when `B` is one (feature `ddp`): every method
//! forwards to `B` (the primitives are `B`'s own), so burn-train's
//! `ExecutionStrategy::ddp` runs under autocast. The gradients are all-reduced inside
//! backward, before any optimizer sees them: each worker's
//! [`AmpOptimizer`](crate::AmpOptimizer) clone checks the same sums and so takes the same
//! skip decision and reaches the same scale.

use burn_backend::DeviceId;
use burn_backend::distributed::{
    CollectiveTensor, DistributedBackend, DistributedConfig, DistributedParams, ReduceOperation,
    TensorRef,
};
use burn_backend::tensor::{Device, FloatTensor};

use super::Amp;

impl<B: DistributedBackend> DistributedBackend for Amp<B> {
    fn start_communication_server(devices: &[B::Device], config: DistributedConfig) {
        B::start_communication_server(devices, config)
    }

    fn close_communication_server(device: &B::Device) {
        B::close_communication_server(device)
    }

    fn register_sync_parameters(device: &B::Device, distributed_params: Vec<DistributedParams>) {
        B::register_sync_parameters(device, distributed_params)
    }

    fn submit_sync_collective(device: &B::Device) {
        B::submit_sync_collective(device)
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, distributed_params: DistributedParams) {
        B::submit_gradient_sync(TensorRef(tensor.0), distributed_params)
    }

    fn all_reduce(
        tensor: FloatTensor<Self>,
        op: ReduceOperation,
        device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        // SAFETY: the handle is wrapped again at once, unresolved, for the caller to resolve.
        let handle = unsafe { B::all_reduce(tensor, op, device_ids).assume_resolved() };
        CollectiveTensor::new(handle)
    }

    fn sync_collective(device: &B::Device) {
        B::sync_collective(device)
    }

    unsafe fn comm_device(tensor: &TensorRef<Self>) -> Device<Self> {
        // SAFETY: the caller's guarantee on `tensor` is forwarded unchanged.
        unsafe { B::comm_device(&TensorRef(tensor.0)) }
    }

    unsafe fn float_from_ref(tensor: &TensorRef<Self>) -> FloatTensor<Self> {
        // SAFETY: as above.
        unsafe { B::float_from_ref(&TensorRef(tensor.0)) }
    }
}
