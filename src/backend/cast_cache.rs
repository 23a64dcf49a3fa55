//! The weight-cast cache: one low-precision copy of each trained parameter between two
//! backward passes, shared by all its uses.
//!
//! Without it every use of an f32 parameter in a lowered op casts it again, and autodiff saves
//! each copy for that op's backward. A layer applied at every step of a sequence (Burn's `Lstm`
//! and `Gru` call their gates' `Linear` once per timestep) then keeps one half-precision copy
//! of its weights per timestep: an `Lstm` of 256 over 64 steps, batch 16, kept 3.6× what f32
//! keeps (which saves a reference to the same f32 weight each time), 1.26× with the cache, 1.10×
//! with the [recomputed widening casts](super::upcast) too (`cargo bench --bench
//! saved_activations`). PyTorch caches these casts for the life of the autocast
//! scope; burn-amp caches them until the next backward.
//!
//! Each use still gets its own cast node in the graph, whose output is the cached copy: only
//! the memory is shared, never a node. Two graphs through one parameter (two forwards, then
//! two backwards) thus keep their own gradient paths, exactly as without the cache; one shared
//! node would be consumed by the first backward and drop the second one's gradient.
//!
//! What is cached (PyTorch's rule): f32 leaf tensors that require a gradient (the parameters
//! being trained), cast to the low dtype. Everything else casts per use. An entry is dropped at
//! the thread's next backward, when the thread's outermost
//! [`AutocastGuard`](crate::AutocastGuard) is dropped, or once its parameter's node is gone
//! (checked each time the cache doubles, from 16 entries).
//!
//! Reaching the autodiff node of a generic `B`'s tensor needs its concrete type: the backends
//! of this crate are listed ([`is_supported`]); on any other backend each use casts, as it
//! always did.

use core::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Arc, Weak};

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::ops::{Backward, OpsKind};
use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::FloatDType;

use super::concrete::{AutodiffTensor, CastBackward, NodeBuilder, build_node};

/// One parameter's low-precision copy.
struct Entry {
    /// The parameter's autodiff node: alive while its tensors hold it, and the graphs built on
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
}

/// Whether `B`'s parameter casts are cached: `B` is `Autodiff<X>` (either checkpointing
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

/// Casts a trained f32 parameter to `target` through the cache; `Err` gives the tensor back
/// when the cache does not apply (another tensor or dtype, an unsupported backend, off).
#[inline]
pub(crate) fn cast<B: Backend>(
    tensor: B::FloatTensorPrimitive,
    target: FloatDType,
) -> Result<B::FloatTensorPrimitive, B::FloatTensorPrimitive> {
    if target == FloatDType::F32
        || tensor.dtype() != DType::F32
        || !ENABLED.with(|e| e.get())
        || !B::float_is_require_grad(&tensor)
    {
        return Err(tensor);
    }
    build_node::<B, _>(tensor, CachedCast(target))
}

/// A cast of a trained parameter through the cache.
struct CachedCast(FloatDType);

impl NodeBuilder for CachedCast {
    fn build<X: Backend, C: CheckpointStrategy>(
        self,
        tensor: AutodiffTensor<X>,
    ) -> AutodiffTensor<X> {
        cast_parameter::<X, C>(tensor, self.0)
    }
}

/// A fresh cast node over `tensor` whose output is the cached copy (made on a miss).
fn cast_parameter<X: Backend, C: CheckpointStrategy>(
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
                // Parameters replaced without a backward on this thread: their copies go
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
