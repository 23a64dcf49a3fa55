//! One way to put a kernel trait's method on `Fusion<B>`, the default `Wgpu` and `Cuda`
//! backends: as a fusion custom op (`OperationIr::Custom`), the way burn-vision registers its
//! kernels. The op stays lazy in the fusion stream (no host sync, no drain); when the stream
//! runs it, it fetches `B`'s tensors and calls `B`'s own implementation. Inputs consumed for
//! the last time reach `B` as mutable, so the CubeCL kernels can work in place there too.

use core::marker::PhantomData;

use burn_backend::DType;
use burn_backend::TensorMetadata;
use burn_backend::tensor::FloatTensor;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};
use burn_std::Shape;

type Handles<B> =
    HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// A custom op that runs `run` on `B`'s tensors.
struct CustomOp<B, F> {
    desc: CustomOpIr,
    run: F,
    _backend: PhantomData<B>,
}

impl<B, F> core::fmt::Debug for CustomOp<B, F> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CustomOp")
            .field("desc", &self.desc)
            .finish()
    }
}

impl<B, F> Operation<B::FusionRuntime> for CustomOp<B, F>
where
    B: FusionBackend,
    F: Fn(Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync,
{
    fn execute(&self, handles: &mut Handles<B>) {
        // Fetched in the order the descriptions were made, all before the run, so a tensor
        // given twice is read before its last (mutable) use removes it.
        let inputs = self
            .desc
            .inputs
            .iter()
            .map(|t| handles.get_float_tensor::<B>(t))
            .collect();
        let outputs = (self.run)(inputs);
        assert_eq!(
            outputs.len(),
            self.desc.outputs.len(),
            "custom op {} returned another number of outputs than it declared",
            self.desc.id
        );
        for (desc, tensor) in self.desc.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(&desc.id, tensor);
        }
    }
}

/// Registers `run` as the lazy custom op `name`: it receives `B`'s tensors for `inputs`, in
/// order, and must return one tensor per `(shape, dtype)` in `outputs`, which come back as
/// `Fusion<B>` tensors. `inputs` must not be empty.
pub(crate) fn custom_op<B, F>(
    name: &'static str,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    outputs: &[(Shape, DType)],
    run: F,
) -> Vec<FloatTensor<Fusion<B>>>
where
    B: FusionBackend,
    F: Fn(Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync + 'static,
{
    let client = inputs
        .first()
        .expect("a custom op needs at least one input")
        .client
        .clone();
    let streams = OperationStreams::with_inputs(inputs.iter());
    let outputs: Vec<TensorIr> = outputs
        .iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape.clone(), *dtype))
        .collect();
    let inputs: Vec<TensorIr> = inputs.into_iter().map(|t| t.into_ir()).collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    let op = CustomOp::<B, F> {
        desc: desc.clone(),
        run,
        _backend: PhantomData,
    };
    client.register(streams, OperationIr::Custom(desc), op)
}

/// `(shape, dtype)` of a tensor, to declare an output like it.
pub(crate) fn like<B: FusionBackend>(t: &FloatTensor<Fusion<B>>) -> (Shape, DType) {
    (t.shape(), t.dtype())
}
