//! Frozen modules: parameters that take no gradient, no optimizer state and, optionally,
//! half the memory, while the gradient still flows through them to earlier layers.
//!
//! [`Frozen<M>`] wraps any Burn module and is itself one, so it sits as a field of a
//! `#[derive(Module)]` parent (a frozen backbone before a trainable head, a frozen block
//! between trainable ones). Its parameters are leaves that do not require gradients
//! (`requires_grad=False` in PyTorch's words), so:
//! - autodiff computes no gradient for them (burn-autodiff skips untracked parents) and
//!   `GradientsParams` holds none;
//! - Burn's optimizers create no state for them (they update, and keep state for, only the
//!   parameters that have a gradient; checked in `tests/frozen.rs`);
//! - the gradient of the activations still flows through the frozen ops to the inputs.
//!
//! The freeze holds: `map` (an optimizer step, a device move), `load_record` and
//! `valid()`/`train()` all leave the parameters frozen. Records are the inner module's own
//! ([`Module::Record`] is `M::Record`): a checkpoint of `M` loads into `Frozen<M>` and back.
//!
//! # Storage precision
//! [`with_storage`](Frozen::with_storage) keeps the frozen weights in bf16 or f16: half the
//! bytes of f32, and no master copy is needed because they are never updated. The ops mix a
//! half weight with f32 activations, which the [`Amp`](crate::Amp) backend promotes (or
//! lowers, under autocast); run such a model on `Amp<..>`, since a plain backend rejects
//! mixed dtypes. [`unfreeze`](Frozen::unfreeze) gives back f32 trainable parameters (the
//! values rounded to the storage dtype).

use core::ops::Deref;

use burn::module::{
    AutodiffModule, Content, Devices, HasAutodiffModule, Module, ModuleDisplay,
    ModuleDisplayDefault, ModuleMapper, ModuleVisitor, Param,
};
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use burn_std::FloatDType;

/// A module whose parameters are frozen. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Frozen<M> {
    inner: M,
    /// The dtype the parameters are stored in; `None`: the dtype they came with.
    storage: Option<FloatDType>,
}

/// Freezes `module` in its current dtype: shorthand for [`Frozen::new`].
pub fn freeze<B: Backend, M: Module<B>>(module: M) -> Frozen<M> {
    Frozen::new(module)
}

/// Sets every float parameter to not require gradients and, with `dtype`, casts it.
struct Freeze {
    dtype: Option<FloatDType>,
}

impl<B: Backend> ModuleMapper<B> for Freeze {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        // A fresh leaf first, so that the cast is not recorded by autodiff.
        let mut tensor = tensor.set_require_grad(false);
        if let Some(dtype) = self.dtype
            && !matches!(tensor.dtype(), DType::QFloat(_))
        {
            tensor = tensor.cast(dtype);
        }
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Casts every float parameter to f32 and makes it require gradients again.
struct Thaw;

impl<B: Backend> ModuleMapper<B> for Thaw {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor = tensor
            .set_require_grad(false)
            .cast(FloatDType::F32)
            .require_grad();
        Param::from_mapped_value(id, tensor, mapper)
    }
}

fn frozen<B: Backend, M: Module<B>>(module: M, dtype: Option<FloatDType>) -> M {
    module.map(&mut Freeze { dtype })
}

impl<M> Frozen<M> {
    /// Freezes `module` in its current dtype.
    pub fn new<B: Backend>(module: M) -> Self
    where
        M: Module<B>,
    {
        Self {
            inner: frozen(module, None),
            storage: None,
        }
    }

    /// Stores the frozen parameters in `dtype`: `BF16` or `F16` halve the bytes of f32
    /// weights; `F32` casts half-precision ones back.
    pub fn with_storage<B: Backend>(self, dtype: FloatDType) -> Self
    where
        M: Module<B>,
    {
        Self {
            inner: frozen(self.inner, Some(dtype)),
            storage: Some(dtype),
        }
    }

    /// The storage dtype set by [`with_storage`](Self::with_storage); `None`: the parameters'
    /// own dtype.
    pub fn storage(&self) -> Option<FloatDType> {
        self.storage
    }

    /// The frozen module.
    pub fn module(&self) -> &M {
        &self.inner
    }

    /// The module, still frozen and in its storage dtype.
    pub fn into_inner(self) -> M {
        self.inner
    }

    /// The module made trainable again: every float parameter in f32, requiring gradients,
    /// with its [`ParamId`](burn::module::ParamId) kept (so an optimizer's state, if any,
    /// still matches). Half-precision storage has rounded the values.
    pub fn unfreeze<B: Backend>(self) -> M
    where
        M: Module<B>,
    {
        self.inner.map(&mut Thaw)
    }
}

impl<M> Deref for Frozen<M> {
    type Target = M;

    /// The frozen module: call its `forward` through the wrapper.
    fn deref(&self) -> &M {
        &self.inner
    }
}

impl<B: Backend, M: Module<B>> Module<B> for Frozen<M> {
    type Record = M::Record;

    fn collect_devices(&self, devices: Devices<B>) -> Devices<B> {
        self.inner.collect_devices(devices)
    }

    fn fork(self, device: &B::Device) -> Self {
        Self {
            inner: frozen(self.inner.fork(device), None),
            storage: self.storage,
        }
    }

    fn to_device(self, device: &B::Device) -> Self {
        Self {
            inner: frozen(self.inner.to_device(device), None),
            storage: self.storage,
        }
    }

    fn visit<V: ModuleVisitor<B>>(&self, visitor: &mut V) {
        self.inner.visit(visitor)
    }

    /// Maps the inner module, then freezes again whatever the mapper returned (an optimizer
    /// leaves frozen parameters alone anyway). The dtype the mapper chose is kept.
    fn map<Mapper: ModuleMapper<B>>(self, mapper: &mut Mapper) -> Self {
        Self {
            inner: frozen(self.inner.map(mapper), None),
            storage: self.storage,
        }
    }

    /// Loads the inner module's record, then freezes and casts to the storage dtype.
    fn load_record(self, record: Self::Record) -> Self {
        Self {
            inner: frozen(self.inner.load_record(record), self.storage),
            storage: self.storage,
        }
    }

    fn into_record(self) -> Self::Record {
        self.inner.into_record()
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> AutodiffModule<B> for Frozen<M> {
    type InnerModule = Frozen<M::InnerModule>;

    fn valid(&self) -> Self::InnerModule {
        Frozen {
            inner: self.inner.valid(),
            storage: self.storage,
        }
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        Frozen {
            inner: frozen(M::from_inner(module.inner), None),
            storage: module.storage,
        }
    }
}

impl<B: AutodiffBackend, M: HasAutodiffModule<B>> HasAutodiffModule<B> for Frozen<M>
where
    M: Module<B::InnerBackend>,
{
    type TrainModule = Frozen<M::TrainModule>;
}

impl<M: ModuleDisplay> ModuleDisplayDefault for Frozen<M> {
    fn content(&self, content: Content) -> Option<Content> {
        content
            .set_top_level_type("Frozen")
            .add("module", &self.inner)
            .add_debug_attribute("storage", &self.storage)
            .optional()
    }
}

impl<M: ModuleDisplay> ModuleDisplay for Frozen<M> {}

/// Bytes of the float parameters of `module` (elements × dtype size): what the weights
/// occupy, frozen or not.
pub fn param_bytes<B: Backend, M: Module<B>>(module: &M) -> usize {
    let (trainable, frozen) = crate::memory::parameter_bytes::<B, M>(module);
    (trainable + frozen) as usize
}
