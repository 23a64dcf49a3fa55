//! `log_sigmoid` at `-inf`: `-inf`, with a gradient of 1 (Flex's and PyTorch's). Burn's
//! default composition, which CubeCL runs (so CUDA too), makes a NaN there of the value and of
//! the gradient (`exp(inf - inf)`): a `-inf` put in on purpose (a mask) then leaves a NaN
//! gradient even where a `mask_where` drops the value, and the scaler skips every step.
//!
//! The op runs on a finite stand-in where the input is `-inf`, and its output is set to `-inf`
//! there; its backward gets the same stand-in. Above a listed autodiff backend the op is a node
//! of `Amp`'s own, built as burn-autodiff's `log_sigmoid` is (it keeps its input, memory-bound,
//! its output recomputable by a later op), whose backward puts the stand-in into the input it
//! reads back. Filling the input before Burn's node instead (in its value only) was measured to
//! leave the NaN where another op keeps the same input (`log_sigmoid(x) + x · c`): the
//! checkpointer keeps one copy per node, and that copy held the `-inf`.

use core::marker::PhantomData;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn_backend::tensor::{BoolTensor, FloatTensor};
use burn_backend::{Backend, Scalar, get_device_settings};

use crate::backend::concrete::{AutodiffTensor, NodeBuilder, build_node};
use crate::backend::recompute;

/// A finite stand-in for `-inf` in every float dtype (f16's lowest): `log_sigmoid` of it is
/// itself, its gradient 1, as at `-inf`.
const LOWEST_HALF: f64 = -65504.0;

/// `log_sigmoid` (see the module docs).
pub(crate) fn log_sigmoid<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    match build_node::<B, _>(tensor, LogSigmoid) {
        Ok(out) => out,
        // Below autodiff, or under an autodiff backend `Amp` does not list: there the fills are
        // ops of their own, whose gradient is 0 where they fill (at `-inf` only).
        Err(tensor) => forward::<B>(tensor),
    }
}

/// `log_sigmoid`'s backward at `x` (where `Amp` runs below autodiff, and in `Amp`'s node): the
/// stand-in's, 1 at `-inf`.
pub(crate) fn log_sigmoid_backward<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let at = minus_infinity_at::<B>(&x);
    B::log_sigmoid_backward(B::float_mask_fill(x, at, Scalar::Float(LOWEST_HALF)), grad)
}

/// The backend's `log_sigmoid` on the stand-in, `-inf` where the input is.
fn forward<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let at = minus_infinity_at::<B>(&x);
    let y = B::log_sigmoid(B::float_mask_fill(
        x,
        at.clone(),
        Scalar::Float(LOWEST_HALF),
    ));
    B::float_mask_fill(y, at, Scalar::Float(f64::NEG_INFINITY))
}

fn minus_infinity_at<B: Backend>(x: &FloatTensor<B>) -> BoolTensor<B> {
    let bools = get_device_settings::<B>(&B::float_device(x)).bool_dtype;
    B::float_equal_elem(x.clone(), Scalar::Float(f64::NEG_INFINITY), bools)
}

/// Builds the node on the concrete autodiff backend, under the strategy
/// [`recompute`] would give burn-autodiff's node: memory-bound whatever the graph's while
/// autocast lowers and the chain is short, the graph's otherwise.
struct LogSigmoid;

impl NodeBuilder for LogSigmoid {
    fn build<X: Backend, C: CheckpointStrategy>(
        self,
        tensor: AutodiffTensor<X>,
    ) -> AutodiffTensor<X> {
        match recompute::chain_depth::<X>([&tensor]).filter(|_| recompute::active()) {
            Some(depth) => {
                let out = node::<X, BalancedCheckpointing>(tensor);
                recompute::record(&out, depth);
                out
            }
            None => node::<X, C>(tensor),
        }
    }
}

fn node<X: Backend, S: CheckpointStrategy>(tensor: AutodiffTensor<X>) -> AutodiffTensor<X> {
    match LogSigmoidBackward
        .prepare::<S>([tensor.node.clone()])
        .memory_bound()
        .retro_forward(RetroLogSigmoid::<X> {
            input: tensor.node.id,
            _backend: PhantomData,
        })
        .parents([&tensor])
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let input = prep.checkpoint(&tensor);
            prep.finish(input, forward::<X>(tensor.primitive))
        }
        OpsKind::UnTracked(prep) => prep.finish(forward::<X>(tensor.primitive)),
    }
}

#[derive(Debug)]
struct LogSigmoidBackward;

impl<X: Backend> Backward<X, 1> for LogSigmoidBackward {
    /// The input's node: its value read back from the checkpointer, `-inf` and all.
    type State = NodeId;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let x = checkpointer.retrieve_node_output(ops.state);
        unary::<X, _>(ops.parents, ops.node, grads, |grad| {
            log_sigmoid_backward::<X>(x, grad)
        });
    }
}

/// The forward again, in the backward, for an op that kept this node's output.
#[derive(Debug)]
struct RetroLogSigmoid<X> {
    input: NodeId,
    _backend: PhantomData<fn() -> X>,
}

impl<X: Backend> RetroForward for RetroLogSigmoid<X> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input: FloatTensor<X> = states.get_state(&self.input);
        states.save(out_node, forward::<X>(input));
    }
}
