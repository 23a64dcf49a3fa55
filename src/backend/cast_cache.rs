//! The cast cache: one low-precision copy of a tensor between two backward passes, shared by
//! all the ops that lower it.
//!
//! **Parameters.** Without the cache every use of an f32 parameter in a lowered op casts it
//! again, and autodiff saves each copy for that op's backward. A layer applied at every step
//! of a sequence (Burn's `Lstm` and `Gru` call their gates' `Linear` once per timestep) then
//! keeps one half-precision copy of its weights per timestep: an `Lstm` of 256 over 64 steps,
//! batch 16, kept 3.6× what f32 keeps (which saves a reference to the same f32 weight each
//! time), 1.26× with the cache. PyTorch caches these casts for the life of the autocast scope;
//! burn-amp caches them until the next backward.
//!
//! **Activations.** An f32 activation lowered by several ops was cast, and the copy kept, once
//! per op, as in PyTorch (whose cache holds leaves only): the normed input of attention's
//! query, key and value projections three times, of `SwiGlu`'s two linears twice, an `Lstm`'s
//! input and hidden state once per gate. Here one copy serves them all, when the op keeps it
//! anyway: a `Lower` op (matmul, linear, conv) keeps an input for its backward when its other
//! float inputs are tracked (burn-autodiff 0.21), and only then is the copy shared, so the
//! cache never holds a copy longer than the first op's backward would. A frozen layer's
//! matmul keeps nothing of its input, and its input casts per use (and is freed after it).
//! With both (and [recomputed widening](super::upcast)) the `Lstm` above keeps 0.88× f32's
//! bytes (1.10× with parameters alone), two pre-norm `TransformerEncoder` layers 0.73×
//! (0.77×), four Llama MLP blocks 0.78× (0.81×) (`cargo bench --bench saved_activations`,
//! Flex bf16).
//!
//! Each use still gets its own cast node in the graph, whose output is the cached copy: only
//! the memory is shared, never a node. Two graphs through one parameter (two forwards, then
//! two backwards) thus keep their own gradient paths, exactly as without the cache; one shared
//! node would be consumed by the first backward and drop the second one's gradient.
//!
//! What is cached: casts from f32 to f16 or bf16 of a leaf that requires a gradient (a
//! parameter being trained), by any op, and of any other tensor, by a `Lower` op whose other
//! float inputs autodiff tracks. An entry is dropped at the thread's next backward, when the
//! thread's outermost [`AutocastGuard`](crate::AutocastGuard) is dropped, or once its
//! tensor's node is gone (checked each time the cache doubles, from 16 entries).
//!
//! Reaching the autodiff node of a generic `B`'s tensor needs its concrete type: the backends
//! of this crate are listed ([`is_supported`]); on any other backend each use casts, as it
//! always did.

use core::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Arc, Weak};

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::ops::{Backward, OpsKind};
use burn_backend::ops::FloatTensorOps;
use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::FloatDType;

use super::concrete::{AutodiffTensor, CastBackward, NodeBuilder, build_node};

/// One tensor's low-precision copy.
struct Entry {
    /// The tensor's autodiff node: alive while its tensors hold it, and the graphs built on
    /// it until a backward frees them. (Its handle count, `AutodiffTensor::rc`, is also held by
    /// autodiff's graph until a backward, then not: no fixed count means dead.)
    source: Weak<dyn Any>,
    /// The inner backend's primitive, in the cached dtype.
    copy: Box<dyn Any>,
}

/// The smallest cache that is scanned for copies of parameters gone.
const PRUNE_FROM: usize = 16;

thread_local! {
    static ENTRIES: RefCell<HashMap<(NodeId, FloatDType), Entry>> = RefCell::new(HashMap::new());
    static ENABLED: Cell<bool> = const { Cell::new(true) };
    static ACTIVATIONS: Cell<bool> = const { Cell::new(true) };
}

/// Whether `B`'s casts are cached: `B` is `Autodiff<X>` (either checkpointing
/// strategy) over one of this crate's backends, Flex, Wgpu or (feature `cuda`) Cuda.
pub fn is_supported<B: Backend>() -> bool {
    super::concrete::is_listed::<B>()
}

/// Turns this thread's cache on or off (on by default); returns the previous setting. Off
/// drops what is cached. PyTorch's `torch.autocast(cache_enabled=False)`.
pub fn set_enabled(enabled: bool) -> bool {
    if !enabled {
        clear();
    }
    ENABLED.with(|e| e.replace(enabled))
}

/// Turns the sharing of activation casts on or off for this thread (on by default; the
/// parameters stay cached while the cache is on); returns the previous setting.
pub fn set_activations_enabled(enabled: bool) -> bool {
    ACTIVATIONS.with(|e| e.replace(enabled))
}

/// Drops this thread's cached copies (the graphs that use them keep theirs).
pub fn clear() {
    // Taken out before dropping: a copy's drop must not find the map borrowed.
    let entries = ENTRIES.with(|e| core::mem::take(&mut *e.borrow_mut()));
    drop(entries);
}

/// The number of copies this thread holds.
pub fn len() -> usize {
    ENTRIES.with(|e| e.borrow().len())
}

/// Casts an f32 tensor to `target` (f16 or bf16) through the cache, for an op with
/// `untracked` float inputs that autodiff does not track when it is a `Lower` op; `Err` gives
/// the tensor back when the cache does not apply (another dtype, an unsupported backend,
/// off). A tensor that is not cached gets a plain cast.
#[inline]
pub(crate) fn cast<B: Backend>(
    tensor: B::FloatTensorPrimitive,
    target: FloatDType,
    untracked: Option<u8>,
) -> Result<B::FloatTensorPrimitive, B::FloatTensorPrimitive> {
    if !matches!(target, FloatDType::F16 | FloatDType::BF16)
        || tensor.dtype() != DType::F32
        || !ENABLED.with(|e| e.get())
    {
        return Err(tensor);
    }
    // Activations only where the op's other inputs are all tracked (one: the tensor itself).
    let lowered_with_tracked = untracked.filter(|n| *n <= 1 && ACTIVATIONS.with(|e| e.get()));
    if lowered_with_tracked.is_none() && !B::float_is_require_grad(&tensor) {
        return Err(tensor);
    }
    build_node::<B, _>(
        tensor,
        CachedCast {
            target,
            untracked: lowered_with_tracked,
        },
    )
}

/// A cast through the cache; `untracked` as in [`cast`], `None` for parameters only.
struct CachedCast {
    target: FloatDType,
    untracked: Option<u8>,
}

impl NodeBuilder for CachedCast {
    fn build<X: Backend, C: CheckpointStrategy>(
        self,
        tensor: AutodiffTensor<X>,
    ) -> AutodiffTensor<X> {
        let parameter = Autodiff::<X, C>::float_is_require_grad(&tensor);
        // The op keeps this input when every other one is tracked.
        let others_tracked = self
            .untracked
            .is_some_and(|n| n == u8::from(!tensor.is_tracked()));
        if parameter || others_tracked {
            cast_shared::<X, C>(tensor, self.target)
        } else {
            Autodiff::<X, C>::float_cast(tensor, self.target)
        }
    }
}

/// A fresh cast node over `tensor` whose output is the cached copy (made on a miss).
fn cast_shared<X: Backend, C: CheckpointStrategy>(
    tensor: AutodiffTensor<X>,
    target: FloatDType,
) -> AutodiffTensor<X> {
    let key = (tensor.node.id, target);
    let cached = ENTRIES.with(|e| {
        e.borrow()
            .get(&key)
            .and_then(|entry| entry.copy.downcast_ref::<X::FloatTensorPrimitive>())
            .cloned()
    });
    let copy = match cached {
        Some(copy) => copy,
        None => {
            let copy = X::float_cast(tensor.primitive.clone(), target);
            let node = Arc::downgrade(&tensor.node);
            let entry = Entry {
                source: node,
                copy: Box::new(copy.clone()),
            };
            let dead = ENTRIES.with(|e| {
                let mut entries = e.borrow_mut();
                // Tensors gone without a backward on this thread: their copies go
                // when the map doubles (a scan per new cast would cost O(n²) a forward).
                let len = entries.len();
                let dead: Vec<Entry> = if len >= PRUNE_FROM && len.is_power_of_two() {
                    entries
                        .extract_if(|_, entry| entry.source.strong_count() == 0)
                        .map(|(_, entry)| entry)
                        .collect()
                } else {
                    Vec::new()
                };
                entries.insert(key, entry);
                dead
            });
            drop(dead);
            copy
        }
    };
    match CastBackward
        .prepare::<C>([tensor.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(FloatDType::F32, copy),
        OpsKind::UnTracked(prep) => prep.finish(copy),
    }
}
