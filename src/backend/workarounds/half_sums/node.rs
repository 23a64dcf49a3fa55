//! The ops that sum products, as one node of `Amp`'s own above a listed autodiff backend
//! (`Amp<Autodiff<X>>`), built as burn-autodiff builds its matmul, linear and convolutions
//! (compute-bound; the inputs the tracked inputs' gradients read are checkpointed), but whose
//! forward and backward run on the half inputs widened to f32, each result rounded to its
//! input's dtype.
//!
//! What the backward keeps is the half tensor the op was given, tracked or not. Widening each
//! input through a cast node of its own could not do that for an input autodiff does not
//! track (a data batch into a trained layer, a frozen weight under a trained input): a node
//! over an untracked tensor is never recomputed (burn-autodiff's `UntrackedParent`), so the
//! op kept the f32 copy, 4 bytes an element instead of 2.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::ops::{ConvOptions, ConvTransposeOptions};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};
use burn_std::{FloatDType, Shape};

use super::super::in_f32;
use crate::backend::concrete::{AutodiffTensor, Visit, dispatch, moved};

/// An op that sums products, with its options. Its inputs: `x`, `weight` (a matmul's
/// right-hand side) and an optional bias.
#[derive(Clone, Debug)]
pub(crate) enum Summed {
    Matmul,
    Linear,
    Conv1d(ConvOptions<1>),
    Conv2d(ConvOptions<2>),
    Conv3d(ConvOptions<3>),
    ConvTranspose1d(ConvTransposeOptions<1>),
    ConvTranspose2d(ConvTransposeOptions<2>),
    ConvTranspose3d(ConvTransposeOptions<3>),
}

/// `op` on `x`, `weight` and `bias` with its products summed in f32, the result in `x`'s
/// dtype: `Amp`'s node when `B` is a listed autodiff backend; otherwise the op on the inputs
/// widened to f32 (no graph, or below autodiff, where `half_sums`' backward ops widen the
/// backward kernels; under an autodiff backend `Amp` does not list, that backend's node
/// over the f32 copies).
pub(crate) fn summed<B: Backend>(
    op: Summed,
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    struct Build<P> {
        op: Summed,
        inputs: [P; 2],
        bias: Option<P>,
    }
    impl<P: 'static> Visit for Build<P> {
        type Out = P;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> P {
            let Build { op, inputs, bias } = self;
            let [x, weight] = inputs.map(moved::<P, AutodiffTensor<X>>);
            let out = match bias {
                Some(bias) => node::<X, C, 3>(op, [x, weight, moved(bias)]),
                None => node::<X, C, 2>(op, [x, weight]),
            };
            moved(out)
        }
    }
    let build = Build {
        op,
        inputs: [x, weight],
        bias,
    };
    match dispatch::<B, _>(build) {
        Ok(out) => out,
        Err(Build { op, inputs, bias }) => {
            let [x, weight] = inputs;
            op.in_f32::<B>(x, weight, bias)
        }
    }
}

impl Summed {
    /// The op as `B` runs it.
    fn forward<B: Backend>(
        self,
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
    ) -> FloatTensor<B> {
        use Summed::*;
        match self {
            Matmul => B::float_matmul(x, weight),
            Linear => B::linear(x, weight, bias),
            Conv1d(o) => B::conv1d(x, weight, bias, o),
            Conv2d(o) => B::conv2d(x, weight, bias, o),
            Conv3d(o) => B::conv3d(x, weight, bias, o),
            ConvTranspose1d(o) => B::conv_transpose1d(x, weight, bias, o),
            ConvTranspose2d(o) => B::conv_transpose2d(x, weight, bias, o),
            ConvTranspose3d(o) => B::conv_transpose3d(x, weight, bias, o),
        }
    }

    /// The op on its inputs widened to f32, the result rounded to `x`'s dtype.
    fn in_f32<B: Backend>(
        self,
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
    ) -> FloatTensor<B> {
        let bias = bias.map(|b| B::float_cast(b, FloatDType::F32));
        in_f32::<B, 2>([x, weight], |[x, weight]| {
            self.forward::<B>(x, weight, bias)
        })
    }

    /// Which of `x` and the weight the gradients of the `tracked` inputs (`x`, weight, bias)
    /// read: a matmul's each needs the other operand; a convolution's input and weight
    /// gradients read both (the input gradient `x`'s shape only), a transposed one's input
    /// gradient the weight alone. A bias's gradient reads neither (burn-autodiff's
    /// convolutions keep all three inputs whatever is tracked).
    fn reads(&self, [x, weight, _]: [bool; 3]) -> [bool; 2] {
        use Summed::*;
        match self {
            Matmul | Linear => [weight, x],
            Conv1d(_) | Conv2d(_) | Conv3d(_) => [x || weight, x || weight],
            ConvTranspose1d(_) | ConvTranspose2d(_) | ConvTranspose3d(_) => [weight, x || weight],
        }
    }

    /// The gradients of the inputs `wanted`, in f32, from the f32 inputs the op [`reads`]
    /// (`None` for the others) and the f32 output gradient. `shapes`: the inputs' shapes.
    ///
    /// [`reads`]: Summed::reads
    fn gradients<X: Backend>(
        self,
        read: [Option<FloatTensor<X>>; 2],
        shapes: &[Shape; 3],
        grad: FloatTensor<X>,
        wanted: [bool; 3],
    ) -> [Option<FloatTensor<X>>; 3] {
        const READ: &str = "an input the gradients read, checkpointed by `reads`";
        let [x, w] = read.map(|t| move || t.clone().expect(READ));
        let g = || grad.clone();
        macro_rules! conv {
            ($o:ident, $x_backward:ident($($xa:ident),*), $w_backward:ident) => {
                [
                    wanted[0].then(|| X::$x_backward($($xa(),)* g(), $o.clone())),
                    wanted[1].then(|| X::$w_backward(x(), w(), g(), $o.clone())),
                    wanted[2].then(|| channel_sums::<X>(g(), &shapes[2])),
                ]
            };
        }
        use Summed::*;
        match self {
            Matmul => [
                wanted[0].then(|| {
                    let grad = X::float_matmul(g(), X::float_transpose(w()));
                    unbroadcast::<X>(grad, &shapes[0])
                }),
                wanted[1].then(|| {
                    let grad = X::float_matmul(X::float_transpose(x()), g());
                    unbroadcast::<X>(grad, &shapes[1])
                }),
                None,
            ],
            Linear => [
                wanted[0].then(|| X::linear_x_backward(w(), g())),
                wanted[1].then(|| X::linear_weight_backward(x(), g())),
                wanted[2].then(|| X::linear_bias_backward(g())),
            ],
            Conv1d(o) => conv!(o, conv1d_x_backward(x, w), conv1d_weight_backward),
            Conv2d(o) => conv!(o, conv2d_x_backward(x, w), conv2d_weight_backward),
            Conv3d(o) => conv!(o, conv3d_x_backward(x, w), conv3d_weight_backward),
            ConvTranspose1d(o) => conv!(
                o,
                conv_transpose1d_x_backward(w),
                conv_transpose1d_weight_backward
            ),
            ConvTranspose2d(o) => conv!(
                o,
                conv_transpose2d_x_backward(w),
                conv_transpose2d_weight_backward
            ),
            ConvTranspose3d(o) => conv!(
                o,
                conv_transpose3d_x_backward(w),
                conv_transpose3d_weight_backward
            ),
        }
    }
}

/// A convolution's bias gradient: the output gradient summed over all but its channel
/// dimension (as Burn's `conv*_bias_backward`, which read `x` and the bias for their shapes).
fn channel_sums<X: Backend>(grad: FloatTensor<X>, bias: &Shape) -> FloatTensor<X> {
    let rank = grad.shape().num_dims();
    let sums = (0..rank)
        .filter(|&d| d != 1)
        .fold(grad, |grad, d| X::float_sum_dim(grad, d));
    X::float_reshape(sums, bias.clone())
}

/// A matmul operand's gradient summed over the batch dimensions the operand broadcast along
/// (size 1 in `shape`, larger in the gradient).
fn unbroadcast<X: Backend>(grad: FloatTensor<X>, shape: &Shape) -> FloatTensor<X> {
    let full = grad.shape();
    let batch = shape.num_dims().saturating_sub(2);
    (0..batch)
        .filter(|&d| shape[d] == 1 && full[d] != 1)
        .fold(grad, |grad, d| X::float_sum_dim(grad, d))
}

/// What the backward needs: the op, the checkpointed inputs it reads, the inputs' shapes
/// (a matmul's broadcast, a bias's) and dtypes (each gradient's).
#[derive(Clone, Debug)]
struct State {
    op: Summed,
    read: [Option<NodeId>; 2],
    shapes: [Shape; 3],
    dtypes: [FloatDType; 3],
}

fn node<X: Backend, C: CheckpointStrategy, const N: usize>(
    op: Summed,
    inputs: [AutodiffTensor<X>; N],
) -> AutodiffTensor<X> {
    let tracked = core::array::from_fn(|i| inputs.get(i).is_some_and(|t| t.is_tracked()));
    // A missing bias: `x`'s, unused.
    let input = |i| inputs.get(i).unwrap_or(&inputs[0]);
    let dtypes = core::array::from_fn(|i| FloatDType::from(input(i).primitive.dtype()));
    let shapes = core::array::from_fn(|i| input(i).primitive.shape());
    let prepared = SummedBackward
        .prepare::<C>(inputs.each_ref().map(|t| t.node.clone()))
        .compute_bound()
        .stateful();
    // The inputs' handles live until the node is registered: a graph none of whose tensors
    // is held any more may be freed by a backward on another thread (burn-autodiff 0.21's
    // `cleanup_orphaned_entries`), and a parent's step with it: its gradient was lost.
    let [Some(x), Some(weight), bias] = split(inputs.each_ref()) else {
        unreachable!("`summed` builds nodes of two or three inputs")
    };
    let forward = |op: Summed| {
        let bias = bias.map(|b| b.primitive.clone());
        op.in_f32::<X>(x.primitive.clone(), weight.primitive.clone(), bias)
    };
    let out = match prepared {
        OpsKind::Tracked(mut prep) => {
            let reads = op.reads(tracked);
            let mut read = [None; 2];
            for (i, input) in [x, weight].into_iter().enumerate() {
                read[i] = reads[i].then(|| prep.checkpoint(input));
            }
            let out = forward(op.clone());
            let state = State {
                op,
                read,
                shapes,
                dtypes,
            };
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(op)),
    };
    drop(inputs);
    out
}

/// `x`, the weight and the bias, if any, of an op's `N` inputs.
fn split<T, const N: usize>(inputs: [T; N]) -> [Option<T>; 3] {
    let mut inputs = inputs.into_iter();
    core::array::from_fn(|_| inputs.next())
}

#[derive(Debug)]
struct SummedBackward;

impl<X: Backend, const N: usize> Backward<X, N> for SummedBackward {
    type State = State;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let State {
            op,
            read,
            shapes,
            dtypes,
        } = ops.state;
        let wide = |t: FloatTensor<X>| X::float_cast(t, FloatDType::F32);
        let inputs = read.map(|id| id.map(|id| wide(checkpointer.retrieve_node_output(id))));
        let grad = wide(grads.consume::<X>(&ops.node));
        let parents = split(ops.parents).map(Option::flatten);
        let wanted = parents.each_ref().map(Option::is_some);
        let gradients = op.gradients::<X>(inputs, &shapes, grad, wanted);
        for ((parent, gradient), dtype) in parents.into_iter().zip(gradients).zip(dtypes) {
            if let (Some(parent), Some(gradient)) = (parent, gradient) {
                grads.register::<X>(parent.id, X::float_cast(gradient, dtype));
            }
        }
    }
}
