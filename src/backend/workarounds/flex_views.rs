//! Flex 0.21's sum along a dimension of a strided view: `sum_dim` and `mean_dim` read the
//! rows of a view whose reduced dimension has stride 1 and whose other dimension does not
//! (a transposed view: `x.narrow(1, 0, 4).swap_dims(0, 1)`) as if they were packed one after
//! the other, in f32: wrong sums, silently (`[6, 22, 38, 54]` for `[6, 38, 70, 102]`), or
//! a panic past the buffer's end when the view is also flipped ("src too short"). Its f32
//! kernel takes that path when only size-1 dimensions precede the summed one and at most one
//! follows it (`[k, m]` along 0, `[1, k, m]` along 1); views of more dimensions it copies.
//!
//! Two places meet such views:
//! - **the forward**: `Amp`'s own `sum_dim` and `mean_dim`; the view is copied into a packed
//!   tensor first, on `Flex` and `Autodiff<Flex>`;
//! - **burn-autodiff's backward**, which sums a gradient over the dimensions an op broadcast
//!   (`x + bias`, `expand`) with the inner backend's `sum_dim`, out of `Amp`'s reach. A
//!   gradient becomes such a view where the backward of a transposition (`swap_dims`,
//!   `permute`, `transpose`) meets one of a `cat` (which narrows): `cat([(x + b).swap_dims(0,
//!   1), c], 1)` gave `b` a wrong gradient, silently, and a panic once flipped. Under `Amp` on
//!   `Autodiff<Flex>`, a transposition is a node of its own whose backward packs the gradient
//!   it hands back (of at most 3 dimensions), so no gradient downstream is such a view.
//!
//! A sum copies only a view whose elements are not packed in some order of its dimensions: a
//! full transposition Flex sums right, and leaving it alone keeps Burn's order of summation.
//! A gradient is packed even when it is a full transposition, as a cat's backward may narrow
//! it next (`cat([x + b, c], 0).swap_dims(0, 1)`).
//!
//! Other backends are handed the tensor as is.

use core::any::TypeId;
use core::marker::PhantomData;

use burn::backend::Flex;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};

use crate::backend::concrete::{AutodiffTensor, Visit, dispatch, moved};

/// `B`'s sum along `dim`, a strided Flex view packed first.
pub(crate) fn float_sum_dim<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    B::float_sum_dim(packed::<B>(tensor, is_permuted_packed), dim)
}

/// `B`'s mean along `dim`, a strided Flex view packed first.
pub(crate) fn float_mean_dim<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    B::float_mean_dim(packed::<B>(tensor, is_permuted_packed), dim)
}

/// `tensor` with its Flex storage packed unless `keep` says its layout is safe; the same
/// values, and under autodiff the same node. Other backends' tensors are left alone.
fn packed<B: Backend>(tensor: FloatTensor<B>, keep: fn(&FlexTensor) -> bool) -> FloatTensor<B> {
    let pack = |t: FlexTensor| {
        if keep(&t) { t } else { t.to_contiguous() }
    };
    let ty = TypeId::of::<FloatTensor<B>>();
    if ty == TypeId::of::<FlexTensor>() {
        return moved(pack(moved(tensor)));
    }
    if ty == TypeId::of::<AutodiffTensor<Flex>>() {
        let mut t: AutodiffTensor<Flex> = moved(tensor);
        t.primitive = pack(t.primitive);
        return moved(t);
    }
    tensor
}

/// Whether a gradient a transposition hands back is safe as it is: packed, or of more than 3
/// dimensions (Flex copies those before a sum itself; packing them too would only add a
/// copy). A full transposition is not: a `cat`'s backward after it may narrow it.
fn safe_gradient(t: &FlexTensor) -> bool {
    t.is_contiguous() || t.layout().shape().num_dims() > 3
}

/// Whether `t`'s elements are packed in some order of its dimensions (contiguous, or a full
/// transposition of a contiguous tensor). Flex sums those right; only the others (a
/// transposition of a narrowed or flipped view) need a copy before a sum. Leaving the full
/// transpositions alone also keeps Burn's order of summation.
fn is_permuted_packed(t: &FlexTensor) -> bool {
    if t.is_contiguous() {
        return true;
    }
    let layout = t.layout();
    let mut dims: Vec<(isize, usize)> = layout
        .strides()
        .iter()
        .zip(layout.shape().iter())
        .filter(|&(_, &size)| size > 1)
        .map(|(&stride, &size)| (stride, size))
        .collect();
    dims.sort_unstable();
    let mut packed = 1;
    for (stride, size) in dims {
        if stride != packed {
            return false;
        }
        packed *= size as isize;
    }
    true
}

/// `B`'s `swap_dims`; on `Autodiff<Flex>`, a node whose backward packs the gradient.
pub(crate) fn float_swap_dims<B: Backend>(
    tensor: FloatTensor<B>,
    dim1: usize,
    dim2: usize,
) -> FloatTensor<B> {
    relayout::<B>(tensor, Relayout::Swap(dim1, dim2))
}

/// `B`'s `transpose` (of the last two dimensions), as [`float_swap_dims`].
pub(crate) fn float_transpose<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    let dims = tensor.shape().num_dims();
    if dims < 2 {
        return B::float_transpose(tensor);
    }
    relayout::<B>(tensor, Relayout::Swap(dims - 2, dims - 1))
}

/// `B`'s `permute`; on `Autodiff<Flex>`, a node whose backward packs the gradient.
pub(crate) fn float_permute<B: Backend>(tensor: FloatTensor<B>, axes: &[usize]) -> FloatTensor<B> {
    relayout::<B>(tensor, Relayout::Permute(axes.to_vec()))
}

/// A transposition: a new view of the same elements.
#[derive(Debug, Clone)]
enum Relayout {
    Swap(usize, usize),
    Permute(Vec<usize>),
}

impl Relayout {
    fn forward<X: Backend>(&self, tensor: FloatTensor<X>) -> FloatTensor<X> {
        match self {
            Relayout::Swap(dim1, dim2) => X::float_swap_dims(tensor, *dim1, *dim2),
            Relayout::Permute(axes) => X::float_permute(tensor, axes),
        }
    }

    /// The transposition that undoes this one (the backward's).
    fn inverse(&self) -> Relayout {
        match self {
            Relayout::Swap(dim1, dim2) => Relayout::Swap(*dim2, *dim1),
            Relayout::Permute(axes) => {
                let mut inverse = vec![0; axes.len()];
                for (i, &axis) in axes.iter().enumerate() {
                    inverse[axis] = i;
                }
                Relayout::Permute(inverse)
            }
        }
    }
}

fn relayout<B: Backend>(tensor: FloatTensor<B>, kind: Relayout) -> FloatTensor<B> {
    struct Call<P> {
        tensor: P,
        kind: Relayout,
    }
    impl<P: 'static> Visit for Call<P> {
        type Out = Result<P, Self>;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> Result<P, Self> {
            if TypeId::of::<X>() != TypeId::of::<Flex>() {
                return Err(self);
            }
            Ok(moved(relayout_node::<X, C>(moved(self.tensor), self.kind)))
        }
    }
    match dispatch::<B, _>(Call { tensor, kind }) {
        Ok(Ok(out)) => out,
        // Not `Autodiff<Flex>`: burn-autodiff's own node, or the backend's view.
        Ok(Err(call)) | Err(call) => call.kind.forward::<B>(call.tensor),
    }
}

/// burn-autodiff's transposition node (memory-bound: recomputed under balanced
/// checkpointing), with a backward that packs the gradient.
fn relayout_node<X: Backend, C: CheckpointStrategy>(
    tensor: AutodiffTensor<X>,
    kind: Relayout,
) -> AutodiffTensor<X> {
    match RelayoutBackward
        .prepare::<C>([tensor.node.clone()])
        .memory_bound()
        .retro_forward(RetroRelayout::<X> {
            input: tensor.node.id,
            kind: kind.clone(),
            _backend: PhantomData,
        })
        .parents([&tensor])
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let out = kind.forward::<X>(tensor.primitive);
            prep.finish(kind, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(kind.forward::<X>(tensor.primitive)),
    }
}

#[derive(Debug)]
struct RelayoutBackward;

impl<X: Backend> Backward<X, 1> for RelayoutBackward {
    type State = Relayout;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let inverse = ops.state.inverse();
        unary::<X, _>(ops.parents, ops.node, grads, |grad| {
            packed::<X>(inverse.forward::<X>(grad), safe_gradient)
        });
    }
}

#[derive(Debug)]
struct RetroRelayout<X> {
    input: NodeId,
    kind: Relayout,
    _backend: PhantomData<X>,
}

impl<X: Backend> RetroForward for RetroRelayout<X> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input = states.get_state::<FloatTensor<X>>(&self.input);
        states.save(out_node, self.kind.forward::<X>(input));
    }
}
