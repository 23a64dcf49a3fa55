//! `Amp<B>`: a decorator backend that applies mixed-precision autocast to any Burn backend.
//!
//! Its tensor primitives are `B`'s own, so wrapping costs no copy; each float op asks the
//! [policy table](policy) which dtype its inputs must be in, casts those that are not
//! (through `B::float_cast`, so autodiff records the cast), and runs `B`'s op.
//!
//! Stack it above autodiff, `Amp<Autodiff<B>>`: the casts are then part of the graph, f32
//! parameters get f32 gradients, and the activations autodiff saves are in f16/bf16.

mod attention;
mod backward_passes;
pub mod cast_cache;
pub(crate) mod concrete;
#[cfg(feature = "ddp")]
mod distributed;
mod host_reads;
mod macros;
mod ops;
pub mod policy;
pub mod recompute;
pub mod upcast;
mod workarounds;

use core::marker::PhantomData;

use burn_backend::tensor::{BoolTensor, FloatTensor, IntTensor, QuantizedTensor};
use burn_backend::{AutodiffBackend, Backend, BackendTypes, DType, DTypeUsageSet, ExecutionError};

pub use backward_passes::backward_passes;
pub(crate) use backward_passes::count_backward_pass;
pub(crate) use host_reads::count_host_read;
pub use host_reads::host_reads;
pub use policy::{Category, Op};
pub use workarounds::half_sums;

/// The autocast decorator backend. See the [module docs](self).
#[derive(Debug, Clone, Copy, Default)]
pub struct Amp<B> {
    _inner: PhantomData<B>,
}

impl<B: Backend> BackendTypes for Amp<B> {
    type Device = B::Device;
    type FloatTensorPrimitive = B::FloatTensorPrimitive;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

impl<B: Backend> Backend for Amp<B> {
    fn ad_enabled(device: &Self::Device) -> bool {
        B::ad_enabled(device)
    }

    fn memory_persistent_allocations<
        Output: Send,
        Input: Send,
        Func: Fn(Input) -> Output + Send,
    >(
        device: &Self::Device,
        input: Input,
        func: Func,
    ) -> Output {
        B::memory_persistent_allocations(device, input, func)
    }

    fn memory_cleanup(device: &Self::Device) {
        B::memory_cleanup(device)
    }

    fn name(device: &Self::Device) -> String {
        format!("amp<{}>", B::name(device))
    }

    fn seed(device: &Self::Device, seed: u64) {
        B::seed(device, seed)
    }

    fn sync(device: &Self::Device) -> Result<(), ExecutionError> {
        count_host_read();
        B::sync(device)
    }

    fn staging<'a, Iter>(data: Iter, device: &Self::Device)
    where
        Iter: Iterator<Item = &'a mut burn_backend::TensorData>,
    {
        B::staging(data, device)
    }

    fn supports_dtype(device: &Self::Device, dtype: DType) -> bool {
        B::supports_dtype(device, dtype)
    }

    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet {
        B::dtype_usage(device, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        B::device_count(type_id)
    }
}

impl<B: AutodiffBackend> AutodiffBackend for Amp<B> {
    type InnerBackend = Amp<B::InnerBackend>;
    type Gradients = B::Gradients;

    fn backward(tensor: FloatTensor<Self>) -> Self::Gradients {
        // The graph keeps the copies it saved; the cache's are not needed past a forward.
        cast_cache::clear();
        // × the loss scale when an `AmpOptimizer` is installed and the precision is f16.
        let grads = B::backward(crate::amp_optimizer::registry::scale_root::<B>(tensor));
        // Counted once done: autodiff has then freed the graphs no backward can reach.
        count_backward_pass();
        grads
    }

    fn grad(
        tensor: &FloatTensor<Self>,
        grads: &Self::Gradients,
    ) -> Option<FloatTensor<Self::InnerBackend>> {
        B::grad(tensor, grads)
    }

    fn grad_remove(
        tensor: &FloatTensor<Self>,
        grads: &mut Self::Gradients,
    ) -> Option<FloatTensor<Self::InnerBackend>> {
        B::grad_remove(tensor, grads)
    }

    fn grad_replace(
        tensor: &FloatTensor<Self>,
        grads: &mut Self::Gradients,
        grad: FloatTensor<Self::InnerBackend>,
    ) {
        B::grad_replace(tensor, grads, grad)
    }

    fn inner(tensor: FloatTensor<Self>) -> FloatTensor<Self::InnerBackend> {
        B::inner(tensor)
    }

    fn int_inner(tensor: IntTensor<Self>) -> IntTensor<Self::InnerBackend> {
        B::int_inner(tensor)
    }

    fn bool_inner(tensor: BoolTensor<Self>) -> BoolTensor<Self::InnerBackend> {
        B::bool_inner(tensor)
    }

    fn q_inner(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self::InnerBackend> {
        B::q_inner(tensor)
    }

    fn from_inner(tensor: FloatTensor<Self::InnerBackend>) -> FloatTensor<Self> {
        B::from_inner(tensor)
    }

    fn int_from_inner(tensor: IntTensor<Self::InnerBackend>) -> IntTensor<Self> {
        B::int_from_inner(tensor)
    }

    fn bool_from_inner(tensor: BoolTensor<Self::InnerBackend>) -> BoolTensor<Self> {
        B::bool_from_inner(tensor)
    }

    fn q_from_inner(tensor: QuantizedTensor<Self::InnerBackend>) -> QuantizedTensor<Self> {
        B::q_from_inner(tensor)
    }
}
