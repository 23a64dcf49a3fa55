//! The three tensor kinds, as the empty-tensor rules see them: how an empty result is made,
//! and what a write of nothing leaves.

use burn_backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn_backend::{Backend, TensorMetadata};
use burn_std::Shape;

use super::{Fill, constant, float_dtype, unchanged};

/// A tensor kind of `B`.
pub(super) trait Kind<B: Backend> {
    type Tensor: TensorMetadata;
    /// An empty tensor of `shape` over `inputs` (not none): in the first one's dtype, on its
    /// device; a float one keeps all of them in the graph, each given a zero gradient.
    fn empty_over(inputs: Vec<Self::Tensor>, shape: Shape) -> Self::Tensor;
    /// `tensor` after a write of the empty `value` into it: `tensor` itself; a float one keeps
    /// `value` in the graph.
    fn written(tensor: Self::Tensor, value: Self::Tensor) -> Self::Tensor;
}

pub(super) struct Float;
pub(super) struct Int;
pub(super) struct Bool;

impl<B: Backend> Kind<B> for Float {
    type Tensor = FloatTensor<B>;
    fn empty_over(inputs: Vec<FloatTensor<B>>, shape: Shape) -> FloatTensor<B> {
        let dtype = float_dtype(inputs[0].dtype());
        constant::<B>(inputs, shape, dtype, Fill::Empty)
    }
    fn written(tensor: FloatTensor<B>, value: FloatTensor<B>) -> FloatTensor<B> {
        unchanged::<B>(tensor, value)
    }
}

impl<B: Backend> Kind<B> for Int {
    type Tensor = IntTensor<B>;
    fn empty_over(inputs: Vec<IntTensor<B>>, shape: Shape) -> IntTensor<B> {
        B::int_empty(shape, &B::int_device(&inputs[0]), inputs[0].dtype().into())
    }
    fn written(tensor: IntTensor<B>, _: IntTensor<B>) -> IntTensor<B> {
        tensor
    }
}

impl<B: Backend> Kind<B> for Bool {
    type Tensor = BoolTensor<B>;
    fn empty_over(inputs: Vec<BoolTensor<B>>, shape: Shape) -> BoolTensor<B> {
        B::bool_empty(shape, &B::bool_device(&inputs[0]), inputs[0].dtype().into())
    }
    fn written(tensor: BoolTensor<B>, _: BoolTensor<B>) -> BoolTensor<B> {
        tensor
    }
}
