//! Elementwise nodes of `Amp`'s own above a listed autodiff backend: built as burn-autodiff
//! builds its unary ops (the input kept, memory-bound, the output recomputable by a later op;
//! under [`recompute`]'s strategy), with the forward and the backward an [`Elementwise`] rule
//! gives. For ops whose burn-autodiff backward makes a NaN the math does not (see
//! [`infinities`](super::infinities)); a rule applies to the input the backward reads back from
//! the checkpointer, whichever op kept it.

use core::fmt::Debug;
use core::marker::PhantomData;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn_backend::Backend;
use burn_backend::tensor::FloatTensor;

use crate::backend::concrete::{AutodiffTensor, NodeBuilder, build_node};
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
