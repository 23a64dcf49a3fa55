//! A module's gradients as one list: taken out of Burn's [`GradientsParams`] in the module's
//! visiting order, worked on as a whole (one kernel call sees every gradient), put back with
//! their ranks. The scaler, the optimizers, accumulation and the memory report all use it.
//!
//! ```ignore
//! use burn_amp::grads::GradList;
//! let mut list = GradList::take(&model, &mut grads);
//! let norm = list.clip_by_global_norm(1.0);   // like optax.clip_by_global_norm
//! let grads = list.into_params(&model);
//! ```

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, MultiGradientsParams};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, TensorPrimitive};
use burn_backend::TensorMetadata;
use burn_backend::tensor::FloatTensor;
use burn_std::FloatDType;

use crate::scaler::ScalerKernels;

/// One parameter's gradient in a [`GradList`].
#[derive(Debug, Clone)]
pub struct GradEntry<B: Backend> {
    /// The parameter.
    pub id: ParamId,
    /// Its gradient, any rank.
    pub grad: FloatTensor<B>,
    /// The parameter's dtype: a gradient may arrive in another (see [`GradList::to_param_dtypes`]).
    pub param_dtype: DType,
}

/// The gradients of a module's float parameters, in visiting order. `B` is the inner
/// (non-autodiff) backend, where gradients live.
#[derive(Debug, Clone)]
pub struct GradList<B: Backend> {
    entries: Vec<GradEntry<B>>,
}

impl<B: Backend> Default for GradList<B> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
        }
    }
}

/// Where a visitor finds each parameter's gradient.
trait Source<B: Backend> {
    fn grad<const D: usize>(&mut self, id: ParamId) -> Option<Tensor<B, D>>;
}

impl<B: Backend> Source<B> for &mut GradientsParams {
    fn grad<const D: usize>(&mut self, id: ParamId) -> Option<Tensor<B, D>> {
        self.remove::<B, D>(id)
    }
}

impl<B: Backend> Source<B> for &GradientsParams {
    fn grad<const D: usize>(&mut self, id: ParamId) -> Option<Tensor<B, D>> {
        self.get::<B, D>(id)
    }
}

impl<B: Backend> Source<B> for &mut MultiGradientsParams {
    fn grad<const D: usize>(&mut self, id: ParamId) -> Option<Tensor<B, D>> {
        // Summed onto the device Burn's adaptor would pick for this parameter; the gradient
        // keeps that device, and the optimizers move the parameter to it.
        self.remove::<B, D>(id).map(|(grad, _device)| grad)
    }
}

struct Collect<S, B: Backend> {
    source: S,
    entries: Vec<GradEntry<B>>,
}

impl<AB: AutodiffBackend, S: Source<AB::InnerBackend>> ModuleVisitor<AB>
    for Collect<S, AB::InnerBackend>
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        if let Some(grad) = self.source.grad::<D>(param.id) {
            self.entries.push(GradEntry {
                id: param.id,
                grad: grad.into_primitive().tensor(),
                param_dtype: param.val().dtype(),
            });
        }
    }
}

fn collect<AB, M, S>(module: &M, source: S) -> GradList<AB::InnerBackend>
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
    S: Source<AB::InnerBackend>,
{
    let mut visitor = Collect {
        source,
        entries: Vec::new(),
    };
    module.visit(&mut visitor);
    GradList {
        entries: visitor.entries,
    }
}

impl<B: Backend> GradList<B> {
    /// Takes `module`'s gradients out of `grads` (a gradient of another module stays there).
    pub fn take<AB, M>(module: &M, grads: &mut GradientsParams) -> Self
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        collect::<AB, M, _>(module, grads)
    }

    /// Takes `module`'s gradients out of several devices' gradients, each summed onto one
    /// device as Burn's optimizer adaptor does (the gradient keeps that device).
    pub fn take_multi<AB, M>(module: &M, grads: &mut MultiGradientsParams) -> Self
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        collect::<AB, M, _>(module, grads)
    }

    /// `module`'s gradients in `grads`, left there (tensors are shared, not copied).
    pub fn peek<AB, M>(module: &M, grads: &GradientsParams) -> Self
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        collect::<AB, M, _>(module, grads)
    }

    /// A list of the given entries.
    pub fn from_entries(entries: Vec<GradEntry<B>>) -> Self {
        Self { entries }
    }

    /// The entries, in visiting order.
    pub fn entries(&self) -> &[GradEntry<B>] {
        &self.entries
    }

    /// The entries, by value.
    pub fn into_entries(self) -> Vec<GradEntry<B>> {
        self.entries
    }

    /// Number of gradients.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is no gradient.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The gradients, in visiting order.
    pub fn tensors(&self) -> Vec<FloatTensor<B>> {
        self.entries.iter().map(|e| e.grad.clone()).collect()
    }

    /// Each gradient through `f`, handed over by value: unshared, so that a kernel may work
    /// in its buffer.
    pub fn map(self, mut f: impl FnMut(FloatTensor<B>) -> FloatTensor<B>) -> Self {
        self.map_entries(|grad, _| f(grad))
    }

    /// Each gradient cast to its parameter's dtype (no copy where it has it already).
    ///
    /// Under `Autodiff<Amp<B>>` the gradient of an f32 parameter used by a lowered op (a raw
    /// `matmul`) arrives in f16/bf16: autodiff registers it without a cast. Every burn-amp
    /// step path casts it back here before an optimizer sees it.
    pub fn to_param_dtypes(self) -> Self {
        self.map_entries(|grad, param_dtype| {
            if grad.dtype() != param_dtype && param_dtype.is_float() {
                B::float_cast(grad, param_dtype.into())
            } else {
                grad
            }
        })
    }

    /// Each gradient in the wider of its dtype and its parameter's: an f16 gradient of an f32
    /// parameter is cast up, an f32 gradient of an f16 parameter stays f32. Where gradients
    /// are still multiplied by the loss scale, this is the dtype to unscale them in: cast to
    /// an f16 parameter's dtype first, a scaled gradient of 2 (131072 at the initial scale)
    /// would be inf, and the step skipped for an overflow that unscaling removes.
    pub fn widened(self) -> Self {
        self.map_entries(|grad, param_dtype| {
            let dtype = wider(grad.dtype(), param_dtype);
            if grad.dtype() != dtype {
                B::float_cast(grad, dtype.into())
            } else {
                grad
            }
        })
    }

    fn map_entries(self, mut f: impl FnMut(FloatTensor<B>, DType) -> FloatTensor<B>) -> Self {
        let entries = self
            .entries
            .into_iter()
            .map(|e| GradEntry {
                grad: f(e.grad, e.param_dtype),
                ..e
            })
            .collect();
        Self { entries }
    }

    /// The gradients by value, and what puts them back ([`GradList::rejoin`]).
    fn split(self) -> (Vec<FloatTensor<B>>, Vec<(ParamId, DType)>) {
        self.entries
            .into_iter()
            .map(|e| (e.grad, (e.id, e.param_dtype)))
            .unzip()
    }

    fn rejoin(tensors: Vec<FloatTensor<B>>, rest: Vec<(ParamId, DType)>) -> Self {
        let entries = tensors
            .into_iter()
            .zip(rest)
            .map(|(grad, (id, param_dtype))| GradEntry {
                id,
                grad,
                param_dtype,
            })
            .collect();
        Self { entries }
    }

    /// Bytes held by the gradients.
    pub fn bytes(&self) -> u64 {
        self.entries
            .iter()
            .map(|e| (e.grad.shape().num_elements() * e.grad.dtype().size()) as u64)
            .sum()
    }

    /// The global L2 norm of all gradients, as an f32 `[1]` tensor on the first gradient's
    /// device (`None` for an empty list). Squares are summed in f32 whatever the dtypes.
    pub fn global_norm(&self) -> Option<Tensor<B, 1>> {
        let first = self.entries.first()?;
        let device = B::float_device(&first.grad);
        let sum_sq = self
            .entries
            .iter()
            .map(|e| {
                let g: Tensor<B, 1> = flat(e.grad.clone());
                g.cast(FloatDType::F32).square().sum().to_device(&device)
            })
            .reduce(|a, b| a + b)?;
        Some(sum_sq.sqrt())
    }

    /// Scales every gradient by `min(1, max_norm / (norm + 1e-6))`, as
    /// `torch.nn.utils.clip_grad_norm_` and `optax.clip_by_global_norm`, on the device (no
    /// host read). Returns the norm before clipping (`None` for an empty list).
    pub fn clip_by_global_norm(&mut self, max_norm: f32) -> Option<Tensor<B, 1>> {
        let norm = self.global_norm()?;
        let coef = norm
            .clone()
            .add_scalar(1e-6)
            .recip()
            .mul_scalar(max_norm)
            .clamp_max(1.0);
        *self = core::mem::take(self).map(|grad| {
            let shape = grad.shape();
            let g: Tensor<B, 1> = flat(grad);
            // In f32: a coefficient under f16's 6.1e-5 (a norm over 1.6e4 clipped to 1) would
            // lose bits as a subnormal, and under 6e-8 be 0.
            let dtype = g.dtype();
            let c = coef.clone().to_device(&g.device());
            let clipped = if dtype == DType::F64 {
                g * c.cast(FloatDType::F64)
            } else {
                (g.cast(FloatDType::F32) * c).cast(dtype)
            };
            B::float_reshape(clipped.into_primitive().tensor(), shape)
        });
        Some(norm)
    }

    /// Registers the gradients in a fresh [`GradientsParams`], with their parameters' ranks.
    pub fn into_params<AB, M>(self, module: &M) -> GradientsParams
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        let mut grads = GradientsParams::new();
        self.put::<AB, M>(module, &mut grads);
        grads
    }

    /// Puts the gradients into `grads`, with their parameters' ranks. A gradient whose
    /// parameter `module` no longer has is dropped.
    pub fn put<AB, M>(self, module: &M, grads: &mut GradientsParams)
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        struct Put<'a, B: Backend> {
            grads: &'a mut GradientsParams,
            list: HashMap<ParamId, FloatTensor<B>>,
        }
        impl<AB: AutodiffBackend> ModuleVisitor<AB> for Put<'_, AB::InnerBackend> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                if let Some(grad) = self.list.remove(&param.id) {
                    let grad =
                        Tensor::<AB::InnerBackend, D>::from_primitive(TensorPrimitive::Float(grad));
                    self.grads.register::<AB::InnerBackend, D>(param.id, grad);
                }
            }
        }
        let mut visitor = Put {
            grads,
            list: self.entries.into_iter().map(|e| (e.id, e.grad)).collect(),
        };
        module.visit(&mut visitor);
    }
}

impl<B: ScalerKernels> GradList<B> {
    /// Raises `found_inf` (f32 `[1]`) if any gradient holds inf or NaN; reads every gradient
    /// once and writes nothing else ([`ScalerKernels::check_finite`]).
    ///
    /// Gradients on several devices (Burn's `MultiGradientsParams` sums each parameter's on a
    /// device of its own) are checked on theirs, and the flags gathered on `found_inf`'s.
    pub fn check_finite(&self, found_inf: Tensor<B, 1>) -> Tensor<B, 1> {
        let home = found_inf.device();
        let groups = by_device::<B>(&self.entries, &home);
        if let [(device, _)] = groups.as_slice()
            && *device == home
        {
            return tensor(B::check_finite(self.tensors(), primitive(found_inf)));
        }
        gather_flags::<B>(found_inf, &groups, |device, indices| {
            let tensors = indices
                .iter()
                .map(|&i| self.entries[i].grad.clone())
                .collect();
            B::check_finite(tensors, primitive(f32_scalar::<B>(0.0, device)))
        })
    }

    /// Multiplies every gradient by `inv_scale` and raises `found_inf` on inf or NaN, in one
    /// pass ([`ScalerKernels::unscale_and_check`]), on each gradient's device as
    /// [`check_finite`](Self::check_finite).
    pub fn unscale_and_check(
        self,
        inv_scale: Tensor<B, 1>,
        found_inf: Tensor<B, 1>,
    ) -> (Self, Tensor<B, 1>) {
        let home = found_inf.device();
        let groups = by_device::<B>(&self.entries, &home);
        // By value: the kernel unscales in place where nothing else holds a gradient.
        let (tensors, rest) = self.split();
        if let [(device, _)] = groups.as_slice()
            && *device == home
        {
            let (tensors, found) =
                B::unscale_and_check(tensors, primitive(inv_scale), primitive(found_inf));
            return (Self::rejoin(tensors, rest), tensor(found));
        }
        let mut slots: Vec<Option<FloatTensor<B>>> = tensors.into_iter().map(Some).collect();
        let found = gather_flags::<B>(found_inf, &groups, |device, indices| {
            let group = indices.iter().map(|&i| slots[i].take().unwrap()).collect();
            let inv = primitive(inv_scale.clone().to_device(device));
            let zero = primitive(f32_scalar::<B>(0.0, device));
            let (group, there) = B::unscale_and_check(group, inv, zero);
            for (&i, g) in indices.iter().zip(group) {
                slots[i] = Some(g);
            }
            there
        });
        let tensors = slots.into_iter().map(|g| g.unwrap()).collect();
        (Self::rejoin(tensors, rest), found)
    }
}

/// `found` raised by each device's flag: `check` runs on a device's gradients (by index) with
/// a flag of its own there, which is gathered on `found`'s device.
fn gather_flags<B: Backend>(
    found: Tensor<B, 1>,
    groups: &[(B::Device, Vec<usize>)],
    mut check: impl FnMut(&B::Device, &[usize]) -> FloatTensor<B>,
) -> Tensor<B, 1> {
    let home = found.device();
    groups.iter().fold(found, |found, (device, indices)| {
        let there: Tensor<B, 1> = tensor(check(device, indices));
        found.max_pair(there.to_device(&home))
    })
}

/// The entries' indices by device, in order of first appearance; `home` first if it holds any.
fn by_device<B: Backend>(
    entries: &[GradEntry<B>],
    home: &B::Device,
) -> Vec<(B::Device, Vec<usize>)> {
    let mut groups: Vec<(B::Device, Vec<usize>)> = vec![(home.clone(), Vec::new())];
    for (i, e) in entries.iter().enumerate() {
        let device = B::float_device(&e.grad);
        match groups.iter_mut().find(|(d, _)| *d == device) {
            Some((_, indices)) => indices.push(i),
            None => groups.push((device, vec![i])),
        }
    }
    // An empty list still goes through the kernels once, on `home`.
    if groups.len() > 1 && groups[0].1.is_empty() {
        groups.remove(0);
    }
    groups
}

/// The wider of two float dtypes (f64 > f32 > half); two different half dtypes meet in f32.
fn wider(a: DType, b: DType) -> DType {
    let width = |d: DType| match d {
        DType::F64 => 3,
        DType::F32 | DType::Flex32 => 2,
        DType::F16 | DType::BF16 => 1,
        _ => 0,
    };
    match width(a).cmp(&width(b)) {
        std::cmp::Ordering::Greater => a,
        std::cmp::Ordering::Less => b,
        std::cmp::Ordering::Equal if a == b => a,
        std::cmp::Ordering::Equal => DType::F32,
    }
}

/// Bytes of `module`'s gradients in `grads`.
pub fn gradient_bytes<AB, M>(module: &M, grads: &GradientsParams) -> u64
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
    GradList::<AB::InnerBackend>::peek::<AB, M>(module, grads).bytes()
}

/// Clips `module`'s gradients in `grads` to a global L2 norm of `max_norm`, on the device;
/// returns the norm before clipping. See [`GradList::clip_by_global_norm`].
pub fn clip_by_global_norm<AB, M>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f32,
) -> Option<Tensor<AB::InnerBackend, 1>>
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
    let mut list = GradList::take::<AB, M>(module, grads);
    let norm = list.clip_by_global_norm(max_norm);
    list.put::<AB, M>(module, grads);
    norm
}

/// `t` flattened to one dimension.
pub(crate) fn flat<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    let n = t.shape().num_elements();
    tensor(B::float_reshape(t, [n].into()))
}

/// An f32 `[1]` device scalar (a flag, a scale, a count), f32 whatever the device's default
/// float dtype.
pub(crate) fn f32_scalar<B: Backend>(value: f32, device: &B::Device) -> Tensor<B, 1> {
    Tensor::full([1], value, (device, DType::F32))
}

pub(crate) fn primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

pub(crate) fn tensor<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}
