//! Reaching burn-autodiff's graph from a generic `B`: the node-level tools of `Amp`
//! ([`cast_cache`](super::cast_cache), [`upcast`](super::upcast)) build their own autodiff
//! nodes, which needs the concrete `Autodiff<X, C>` that `B` is. Rust has no specialization,
//! so the backends of this crate are listed by `TypeId`; a value crosses from `B`'s name to
//! the concrete one through `Any` (no `unsafe`).

use core::any::{Any, TypeId};

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn_backend::Backend;
use burn_backend::tensor::FloatTensor;
use burn_std::FloatDType;

/// burn-autodiff's tensor (its type is not exported; its fields are).
pub(crate) type AutodiffTensor<X> = FloatTensor<Autodiff<X>>;

/// A node built over one tensor of the concrete `Autodiff<X, C>` that a generic `B` is.
pub(crate) trait NodeBuilder: 'static {
    fn build<X: Backend, C: CheckpointStrategy>(
        self,
        tensor: AutodiffTensor<X>,
    ) -> AutodiffTensor<X>;
}

/// Runs `builder` on `tensor` when `B` is a listed autodiff backend; gives the tensor back
/// otherwise.
pub(crate) fn build_node<B: Backend, N: NodeBuilder>(
    tensor: B::FloatTensorPrimitive,
    builder: N,
) -> Result<B::FloatTensorPrimitive, B::FloatTensorPrimitive> {
    struct Build<P, N> {
        tensor: P,
        builder: N,
    }
    impl<P: 'static, N: NodeBuilder> Visit for Build<P, N> {
        type Out = P;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> P {
            // `dispatch` matched `B` to `Autodiff<X, C>`: `P` is `AutodiffTensor<X>`.
            moved(self.builder.build::<X, C>(moved(self.tensor)))
        }
    }
    dispatch::<B, _>(Build { tensor, builder }).map_err(|b| b.tensor)
}

/// A computation over the concrete `Autodiff<X, C>` that a generic `B` turned out to be.
pub(crate) trait Visit: Sized {
    type Out;
    fn visit<X: Backend, C: CheckpointStrategy>(self) -> Self::Out;
}

/// Runs `visit` with `B`'s inner backend and strategy when `B` is a listed autodiff backend;
/// gives it back otherwise.
pub(crate) fn dispatch<B: Backend, V: Visit>(visit: V) -> Result<V::Out, V> {
    let backend = TypeId::of::<B>();
    macro_rules! listed {
        ($($inner:ty),* $(,)?) => {$(
            if backend == TypeId::of::<Autodiff<$inner, NoCheckpointing>>() {
                return Ok(visit.visit::<$inner, NoCheckpointing>());
            }
            if backend == TypeId::of::<Autodiff<$inner, BalancedCheckpointing>>() {
                return Ok(visit.visit::<$inner, BalancedCheckpointing>());
            }
        )*};
    }
    listed!(burn::backend::Flex, burn::backend::Wgpu);
    #[cfg(feature = "cuda")]
    listed!(burn_cuda::Cuda);
    Err(visit)
}

/// Whether `B` is `Autodiff<X>` (either checkpointing strategy) over one of this crate's
/// backends: Flex, Wgpu or (feature `cuda`) Cuda.
pub(crate) fn is_listed<B: Backend>() -> bool {
    struct Probe;
    impl Visit for Probe {
        type Out = ();
        fn visit<X: Backend, C: CheckpointStrategy>(self) {}
    }
    dispatch::<B, _>(Probe).is_ok()
}

/// Whether autodiff records ops on `tensor` (a parameter, or computed from one), when `B` is a
/// listed autodiff backend.
pub(crate) fn is_tracked<B: Backend>(tensor: &B::FloatTensorPrimitive) -> Option<bool> {
    struct Tracked<'a, P>(&'a P);
    impl<P: 'static> Visit for Tracked<'_, P> {
        type Out = bool;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> bool {
            (self.0 as &dyn Any)
                .downcast_ref::<AutodiffTensor<X>>()
                .expect("the backend's tensor type, as matched by its TypeId")
                .is_tracked()
        }
    }
    dispatch::<B, _>(Tracked(tensor)).ok()
}

/// Moves a value between two names of one type (`dispatch` proved them equal).
pub(crate) fn moved<T: 'static, U: 'static>(value: T) -> U {
    let mut slot = Some(value);
    (&mut slot as &mut dyn Any)
        .downcast_mut::<Option<U>>()
        .and_then(Option::take)
        .expect("the backend's tensor type, as matched by its TypeId")
}

/// Autodiff's own cast backward: the gradient goes back to the source dtype.
#[derive(Debug)]
pub(crate) struct CastBackward;

impl<X: Backend> Backward<X, 1> for CastBackward {
    type State = FloatDType;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dtype = ops.state;
        unary::<X, _>(ops.parents, ops.node, grads, |grad| {
            X::float_cast(grad, dtype)
        });
    }
}
