//! Widening casts that autodiff recomputes in the backward instead of saving.
//!
//! Autocast widens a half-precision activation to f32 for the ops of the `F32` category and
//! for `Promote` ops that meet an f32 operand. When that op keeps its input for its backward
//! (`sigmoid`, `log`, `mul`, ...), autodiff saved the f32 copy: 4 bytes per element where the
//! half tensor it came from holds 2, and a second f32 copy when a second op widens the same
//! tensor. SiLU is `x * sigmoid(x)` in Burn: under autocast it kept x twice in f32, and four
//! Llama MLP blocks (`RmsNorm`, `SwiGlu`, a down `Linear`) kept 1.15× the bytes of f32
//! training; with this module 0.81× (`cargo bench --bench saved_activations`).
//!
//! A widening cast is exact, so its output can be recomputed from its input at no loss. This
//! module's cast node is *memory-bound* (burn-autodiff's term for an op worth recomputing)
//! whatever the graph's checkpointing strategy: an op that keeps the widened tensor keeps a
//! recipe and the half-precision source, and the backward casts again when it needs the f32
//! values. Gradients are bitwise those of a saved cast.
//!
//! The node itself keeps its source until the backward, even when no op needed the widened
//! tensor, so it is used only for the ops that keep that input ([`keeps_widened_input`]); the
//! others (`add`, `sum`, softmax's composition) cast as before and keep nothing.
//!
//! Like the [cast cache](super::cast_cache), this needs the concrete autodiff backend:
//! `Autodiff<Flex | Wgpu | Cuda>`, either checkpointing ([`is_supported`]); other backends save
//! the cast's output as before.

use core::marker::PhantomData;
use std::cell::Cell;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::ops::{Backward, OpsKind};
use burn_backend::ops::FloatTensorOps;
use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::FloatDType;

use super::concrete::{AutodiffTensor, CastBackward, NodeBuilder, build_node};
use super::policy::Op;

thread_local! {
    static ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether `B`'s widening casts are recomputed: `B` is `Autodiff<X>` (either checkpointing
/// strategy) over one of this crate's backends, Flex, Wgpu or (feature `cuda`) Cuda.
pub fn is_supported<B: Backend>() -> bool {
    super::concrete::is_listed::<B>()
}

/// Turns recomputation on or off for this thread (on by default); returns the previous
/// setting. Off, autodiff saves the f32 copies, as a plain cast does.
pub fn set_enabled(enabled: bool) -> bool {
    ENABLED.with(|e| e.replace(enabled))
}

/// The autocast ops whose burn-autodiff backward keeps a float input (checkpointed, so
/// recomputable): a widened input of these would be saved in f32. From burn-autodiff 0.21's
/// ops; the `pow`s and `prod`s reach its `powf`, `mul`, `recip` and `log`. (Softmax and
/// log-softmax keep theirs too while [`recompute`](super::recompute) builds their node.)
pub const fn keeps_widened_input(op: Op) -> bool {
    use Op::*;
    matches!(
        op,
        float_exp
            | float_log
            | float_log1p
            | float_powf
            | float_powf_scalar
            | float_powf_scalar_impl
            | float_powi
            | float_powi_scalar
            | float_powi_scalar_impl
            | float_recip
            | float_erf
            | float_tan
            | float_sinh
            | float_cosh
            | float_asin
            | float_acos
            | float_atanh
            | float_prod
            | float_prod_dim
            | avg_pool1d
            | avg_pool2d
            | adaptive_avg_pool1d
            | adaptive_avg_pool2d
            | deform_conv2d
            | ctc_loss
            | interpolate
            | sigmoid
            | log_sigmoid
            | float_mul
            | float_div
            | float_remainder
            | float_atan2
            | float_cross
    )
}

/// Widens `tensor` to `target` through a recomputed cast node; `Err` gives the tensor back
/// when it does not apply (not a widening, an op that keeps nothing, another backend, off).
#[inline]
pub(crate) fn cast<B: Backend>(
    tensor: B::FloatTensorPrimitive,
    target: FloatDType,
    op: Op,
) -> Result<B::FloatTensorPrimitive, B::FloatTensorPrimitive> {
    let keeps = keeps_widened_input(op) || super::recompute::keeps_input(op);
    if !keeps || !widens(tensor.dtype(), target) || !ENABLED.with(|e| e.get()) {
        return Err(tensor);
    }
    build_node::<B, _>(tensor, Upcast(target))
}

/// A widening to the given dtype, recomputed in the backward.
struct Upcast(FloatDType);

impl NodeBuilder for Upcast {
    fn build<X: Backend, C: CheckpointStrategy>(
        self,
        tensor: AutodiffTensor<X>,
    ) -> AutodiffTensor<X> {
        upcast::<X>(tensor, self.0)
    }
}

/// Whether a cast from `from` to `to` is exact and larger (recomputing it loses nothing, and
/// keeping its source instead saves memory).
fn widens(from: DType, to: FloatDType) -> bool {
    match to {
        FloatDType::F64 => matches!(from, DType::F32 | DType::F16 | DType::BF16),
        FloatDType::F32 => matches!(from, DType::F16 | DType::BF16),
        FloatDType::Flex32 | FloatDType::F16 | FloatDType::BF16 => false,
    }
}

/// A cast node that is memory-bound under any checkpointing strategy: `Balanced`'s rule is
/// asked for it alone, so that ops keeping its output keep a recipe, and its parent (the
/// source) is kept in its place.
fn upcast<X: Backend>(tensor: AutodiffTensor<X>, target: FloatDType) -> AutodiffTensor<X> {
    // No graph: nothing is kept either way. Past the longest chain of recomputed nodes (the
    // source is one, at its end), a plain cast.
    let depth = match tensor.is_tracked() {
        true => super::recompute::chain_depth::<X>([&tensor]),
        false => None,
    };
    let Some(depth) = depth else {
        return Autodiff::<X>::float_cast(tensor, target);
    };
    let source = FloatDType::from(tensor.primitive.dtype());
    let out = match CastBackward
        .prepare::<BalancedCheckpointing>([tensor.node.clone()])
        .memory_bound()
        .retro_forward(RetroUpcast::<X> {
            source: tensor.node.id,
            target,
            _backend: PhantomData,
        })
        .parents([&tensor])
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(source, X::float_cast(tensor.primitive, target)),
        OpsKind::UnTracked(prep) => prep.finish(X::float_cast(tensor.primitive, target)),
    };
    super::recompute::record(&out, depth);
    out
}

/// The cast again, in the backward, from the kept source.
#[derive(Debug)]
struct RetroUpcast<X> {
    source: NodeId,
    target: FloatDType,
    _backend: PhantomData<fn() -> X>,
}

impl<X: Backend> RetroForward for RetroUpcast<X> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let source = states.get_state::<X::FloatTensorPrimitive>(&self.source);
        states.save(out_node, X::float_cast(source, self.target));
    }
}
