//! Elementwise nodes of `Amp`'s own above a listed autodiff backend: built as burn-autodiff
//! builds its unary and binary ops (the inputs kept, memory-bound, the output recomputable by
//! a later op; under [`recompute`]'s strategy), with the forward and the backward an
//! [`Elementwise`] or [`BinaryElementwise`] rule gives. For ops whose burn-autodiff backward
//! makes a NaN the math does not (see [`infinities`](super::infinities)), whose value `Amp`
//! mends and whose recomputation must be mended too ([`nan`](super::nan)), or whose backward
//! lacks PyTorch's special cases ([`powers`](super::powers)); a rule applies to the inputs
//! the backward reads back from the checkpointer, whichever op kept them.

use core::fmt::Debug;
use core::marker::PhantomData;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary, unary};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};
use burn_std::Shape;

use crate::backend::concrete::{AutodiffTensor, NodeBuilder, Visit, build_node, dispatch, moved};
use crate::backend::recompute;

/// An elementwise op's value and its input's gradient, on any backend.
pub(crate) trait Elementwise: Copy + Debug + Send + 'static {
    fn forward<X: Backend>(self, x: FloatTensor<X>) -> FloatTensor<X>;
    fn backward<X: Backend>(self, x: FloatTensor<X>, grad: FloatTensor<X>) -> FloatTensor<X>;
}

/// `op` on `tensor`: its own node when `B` is a listed autodiff backend, its forward on `B`
/// otherwise (below autodiff; or under an autodiff backend `Amp` does not list, where the
/// forward's ops build their own nodes).
pub(crate) fn elementwise_node<B: Backend, E: Elementwise>(
    tensor: FloatTensor<B>,
    op: E,
) -> FloatTensor<B> {
    match build_node::<B, _>(tensor, Build(op)) {
        Ok(out) => out,
        Err(tensor) => op.forward::<B>(tensor),
    }
}

/// The strategy [`recompute`] gives burn-autodiff's nodes: memory-bound whatever the graph's
/// while autocast lowers and the chain is short, the graph's otherwise.
struct Build<E>(E);

impl<E: Elementwise> NodeBuilder for Build<E> {
    fn build<X: Backend, C: CheckpointStrategy>(
        self,
        tensor: AutodiffTensor<X>,
    ) -> AutodiffTensor<X> {
        match recompute::chain_depth::<X>([&tensor]).filter(|_| recompute::active()) {
            Some(depth) => {
                let out = node::<X, BalancedCheckpointing, E>(tensor, self.0);
                recompute::record(&out, depth);
                out
            }
            None => node::<X, C, E>(tensor, self.0),
        }
    }
}

fn node<X: Backend, S: CheckpointStrategy, E: Elementwise>(
    tensor: AutodiffTensor<X>,
    op: E,
) -> AutodiffTensor<X> {
    match ElementwiseBackward(op)
        .prepare::<S>([tensor.node.clone()])
        .memory_bound()
        .retro_forward(RetroElementwise::<X, E> {
            input: tensor.node.id,
            op,
            _backend: PhantomData,
        })
        .parents([&tensor])
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let input = prep.checkpoint(&tensor);
            prep.finish(input, op.forward::<X>(tensor.primitive))
        }
        OpsKind::UnTracked(prep) => prep.finish(op.forward::<X>(tensor.primitive)),
    }
}

#[derive(Debug)]
struct ElementwiseBackward<E>(E);

impl<X: Backend, E: Elementwise> Backward<X, 1> for ElementwiseBackward<E> {
    /// The input's node: its value read back from the checkpointer.
    type State = NodeId;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let x = checkpointer.retrieve_node_output(ops.state);
        unary::<X, _>(ops.parents, ops.node, grads, |grad| {
            self.0.backward::<X>(x, grad)
        });
    }
}

/// The forward again, in the backward, for an op that kept this node's output.
#[derive(Debug)]
struct RetroElementwise<X, E> {
    input: NodeId,
    op: E,
    _backend: PhantomData<fn() -> X>,
}

impl<X: Backend, E: Elementwise> RetroForward for RetroElementwise<X, E> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input: FloatTensor<X> = states.get_state(&self.input);
        states.save(out_node, self.op.forward::<X>(input));
    }
}

/// A binary elementwise op's value and its inputs' gradients, on any backend. The inputs
/// broadcast to the output's shape; a gradient is given at that shape (the node sums it back
/// over the broadcast dimensions).
pub(crate) trait BinaryElementwise: Copy + Debug + Send + 'static {
    fn forward<X: Backend>(self, lhs: FloatTensor<X>, rhs: FloatTensor<X>) -> FloatTensor<X>;
    fn backward_lhs<X: Backend>(
        self,
        lhs: FloatTensor<X>,
        rhs: FloatTensor<X>,
        grad: FloatTensor<X>,
    ) -> FloatTensor<X>;
    fn backward_rhs<X: Backend>(
        self,
        lhs: FloatTensor<X>,
        rhs: FloatTensor<X>,
        grad: FloatTensor<X>,
    ) -> FloatTensor<X>;
}

/// `op` on `lhs` and `rhs`: its own node when `B` is a listed autodiff backend, its forward on
/// `B` otherwise (as [`elementwise_node`]).
pub(crate) fn binary_node<B: Backend, E: BinaryElementwise>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    op: E,
) -> FloatTensor<B> {
    struct Call<P, E> {
        lhs: P,
        rhs: P,
        op: E,
    }
    impl<P: 'static, E: BinaryElementwise> Visit for Call<P, E> {
        type Out = P;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> P {
            let (lhs, rhs): (AutodiffTensor<X>, AutodiffTensor<X>) =
                (moved(self.lhs), moved(self.rhs));
            moved(
                match recompute::chain_depth::<X>([&lhs, &rhs]).filter(|_| recompute::active()) {
                    Some(depth) => {
                        let out = node_of_two::<X, BalancedCheckpointing, E>(lhs, rhs, self.op);
                        recompute::record(&out, depth);
                        out
                    }
                    None => node_of_two::<X, C, E>(lhs, rhs, self.op),
                },
            )
        }
    }
    match dispatch::<B, _>(Call { lhs, rhs, op }) {
        Ok(out) => out,
        Err(Call { lhs, rhs, op }) => op.forward::<B>(lhs, rhs),
    }
}

fn node_of_two<X: Backend, S: CheckpointStrategy, E: BinaryElementwise>(
    lhs: AutodiffTensor<X>,
    rhs: AutodiffTensor<X>,
    op: E,
) -> AutodiffTensor<X> {
    let shapes = (lhs.primitive.shape(), rhs.primitive.shape());
    match BinaryBackward(op)
        .prepare::<S>([lhs.node.clone(), rhs.node.clone()])
        .memory_bound()
        .retro_forward(RetroBinary::<X, E> {
            lhs: lhs.node.id,
            rhs: rhs.node.id,
            op,
            _backend: PhantomData,
        })
        .parents([&lhs, &rhs])
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let state = (prep.checkpoint(&lhs), prep.checkpoint(&rhs), shapes);
            prep.finish(state, op.forward::<X>(lhs.primitive, rhs.primitive))
        }
        OpsKind::UnTracked(prep) => prep.finish(op.forward::<X>(lhs.primitive, rhs.primitive)),
    }
}

#[derive(Debug)]
struct BinaryBackward<E>(E);

impl<X: Backend, E: BinaryElementwise> Backward<X, 2> for BinaryBackward<E> {
    /// The inputs' nodes (their values read back from the checkpointer) and shapes.
    type State = (NodeId, NodeId, (Shape, Shape));

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (lhs, rhs, (lhs_shape, rhs_shape)) = ops.state;
        let lhs: FloatTensor<X> = checkpointer.retrieve_node_output(lhs);
        let rhs: FloatTensor<X> = checkpointer.retrieve_node_output(rhs);
        let (lhs_4rhs, rhs_4rhs) = (lhs.clone(), rhs.clone());
        let op = self.0;
        binary::<X, _, _>(
            ops.parents,
            ops.node,
            grads,
            |grad| summed_to::<X>(op.backward_lhs::<X>(lhs, rhs, grad), &lhs_shape),
            |grad| summed_to::<X>(op.backward_rhs::<X>(lhs_4rhs, rhs_4rhs, grad), &rhs_shape),
        );
    }
}

/// `grad` summed over the dimensions `shape` broadcast (1 there, longer in `grad`).
fn summed_to<X: Backend>(grad: FloatTensor<X>, shape: &Shape) -> FloatTensor<X> {
    let broadcast = grad.shape();
    (0..shape.num_dims())
        .filter(|&d| shape[d] == 1 && broadcast[d] != 1)
        .fold(grad, |grad, d| X::float_sum_dim(grad, d))
}

/// The forward again, in the backward, for an op that kept this node's output.
#[derive(Debug)]
struct RetroBinary<X, E> {
    lhs: NodeId,
    rhs: NodeId,
    op: E,
    _backend: PhantomData<fn() -> X>,
}

impl<X: Backend, E: BinaryElementwise> RetroForward for RetroBinary<X, E> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let lhs: FloatTensor<X> = states.get_state(&self.lhs);
        let rhs: FloatTensor<X> = states.get_state(&self.rhs);
        states.save(out_node, self.op.forward::<X>(lhs, rhs));
    }
}
