//! [`ScaledAdaptor`]: a [`ScaledSimpleOptimizer`] made a Burn [`Optimizer`] and a
//! [`ScaledStep`], as burn-optim's `OptimizerAdaptor` makes a `SimpleOptimizer` an
//! `Optimizer`: traversal, devices, gradient clipping and records here, once; per-tensor
//! math in the optimizer.

use core::marker::PhantomData;
use std::collections::HashMap as StdHashMap;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::grad_clipping::GradientClipping;
use burn::optim::record::AdaptorRecord;
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_backend::tensor::FloatTensor;
use hashbrown::HashMap;

use super::groups::{ModulePath, group_of, param_groups_of};
use super::{ScaledSimpleOptimizer, Scaling};
use crate::grads::{GradList, primitive, tensor};
use crate::scaler::{ScaleSignals, ScaledStep, ScalerError, ScalerKernels, StepOutcome};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// A [`ScaledSimpleOptimizer`] as a Burn [`Optimizer`] (for burn-train's `Learner` and any
/// loop) and as a [`ScaledStep`] (for [`GradScaler::step`](crate::scaler::GradScaler::step):
/// the check, the unscale and the skip happen on the device, no host read). Its record is
/// Burn's own `OptimizerAdaptor` record.
#[derive(Clone)]
pub struct ScaledAdaptor<O, M, B>
where
    O: ScaledSimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    optim: O,
    records: HashMap<ParamId, AdaptorRecord<O, B>>,
    grad_clipping: Option<GradientClipping>,
    /// Whether the parameter groups were matched against the module (at its first step).
    groups_checked: bool,
    _module: PhantomData<M>,
}

impl<O, M, B> ScaledAdaptor<O, M, B>
where
    O: ScaledSimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    /// Wraps `optim`, with empty state.
    pub fn new(optim: O) -> Self {
        Self {
            optim,
            records: HashMap::new(),
            grad_clipping: None,
            groups_checked: false,
            _module: PhantomData,
        }
    }

    /// Sets (or removes) the per-parameter gradient clipping, applied to unscaled gradients.
    pub fn with_grad_clipping(mut self, clipping: Option<GradientClipping>) -> Self {
        self.grad_clipping = clipping;
        self
    }

    /// The wrapped per-tensor optimizer.
    pub fn optim(&self) -> &O {
        &self.optim
    }

    /// The gradient clipping.
    pub fn grad_clipping(&self) -> Option<&GradientClipping> {
        self.grad_clipping.as_ref()
    }

    /// Each float parameter of `module`: its path (what a [`ParamGroup`](super::ParamGroup)'s
    /// pattern matches) and the index of the group whose options it steps with, if any.
    pub fn param_groups(&self, module: &M) -> Vec<(String, Option<usize>)> {
        param_groups_of::<B, M>(module, self.optim.param_groups())
    }

    /// The parameter groups (indices) that match no parameter of `module`: a typo, which
    /// would otherwise train those parameters with the optimizer's options, silently. The
    /// first step warns of each in the log.
    pub fn unmatched_groups(&self, module: &M) -> Vec<usize> {
        unmatched(&self.param_groups(module), self.optim.param_groups().len())
    }

    /// Warns once of the groups that match no parameter of `module`.
    fn check_groups(&mut self, module: &M) {
        if core::mem::replace(&mut self.groups_checked, true) {
            return;
        }
        let placed = self.param_groups(module);
        let Some((example, _)) = placed.first() else {
            return;
        };
        for index in unmatched(&placed, self.optim.param_groups().len()) {
            log::warn!(
                "burn-amp: parameter group {index} (`{}`) matches no parameter of the module, \
                 so it sets the options of none. Paths are field names and indices joined by \
                 dots, e.g. `{example}`",
                self.optim.param_groups()[index].path
            );
        }
    }

    /// Bytes of the optimizer state of `module`'s parameters (those that had a step).
    pub fn state_bytes(&self, module: &M) -> u64 {
        struct Count<'a, O, B: AutodiffBackend>
        where
            O: ScaledSimpleOptimizer<B::InnerBackend>,
        {
            records: &'a HashMap<ParamId, AdaptorRecord<O, B>>,
            bytes: u64,
        }
        impl<O, B> ModuleVisitor<B> for Count<'_, O, B>
        where
            O: ScaledSimpleOptimizer<B::InnerBackend>,
            B: AutodiffBackend,
        {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if let Some(record) = self.records.get(&param.id) {
                    self.bytes += O::state_bytes(&record.clone().into_state::<D>());
                }
            }
        }
        let mut count = Count {
            records: &self.records,
            bytes: 0,
        };
        module.visit(&mut count);
        count.bytes
    }

    /// Updates every parameter of `module` that has a gradient in `grads`, with `scaling`
    /// (`None`: unscaled, never skipped).
    fn step_list(
        &mut self,
        lr: LearningRate,
        module: M,
        grads: GradList<Inner<B>>,
        scaling: Option<Scaling<FloatTensor<Inner<B>>>>,
    ) -> M {
        self.check_groups(&module);
        let grads = grads
            .into_entries()
            .into_iter()
            .map(|e| (e.id, e.grad))
            .collect();
        module.map(&mut Mapper::<O, B> {
            optim: &self.optim,
            records: &mut self.records,
            grads,
            lr,
            clipping: self.grad_clipping.as_ref(),
            signals: DeviceSignals {
                base: scaling,
                maximize: self.optim.maximize(),
                per_device: Vec::new(),
            },
            visited: 0,
            path: ModulePath::default(),
        })
    }
}

/// The indices of `count` groups that no parameter of `placed` (path, group) is in.
fn unmatched(placed: &[(String, Option<usize>)], count: usize) -> Vec<usize> {
    (0..count)
        .filter(|&index| !placed.iter().any(|(_, g)| *g == Some(index)))
        .collect()
}

/// The step's signals on each device a parameter lives on.
struct DeviceSignals<B: Backend> {
    base: Option<Scaling<FloatTensor<B>>>,
    /// `inv_scale` negated (the optimizer maximizes): once per device and step.
    maximize: bool,
    per_device: Vec<(B::Device, Scaling<FloatTensor<B>>)>,
}

impl<B: Backend> DeviceSignals<B> {
    fn on(&mut self, device: &B::Device) -> Scaling<FloatTensor<B>> {
        if let Some((_, s)) = self.per_device.iter().find(|(d, _)| d == device) {
            return s.clone();
        }
        let s = match &self.base {
            Some(base) => {
                let inv_scale = B::float_to_device(base.inv_scale.clone(), device);
                Scaling {
                    inv_scale: match self.maximize {
                        true => B::float_neg(inv_scale),
                        false => inv_scale,
                    },
                    found_inf: B::float_to_device(base.found_inf.clone(), device),
                }
            }
            None => super::unscaled::<B>(device, self.maximize),
        };
        self.per_device.push((device.clone(), s.clone()));
        s
    }
}

struct Mapper<'a, O, B>
where
    O: ScaledSimpleOptimizer<B::InnerBackend>,
    B: AutodiffBackend,
{
    optim: &'a O,
    records: &'a mut HashMap<ParamId, AdaptorRecord<O, B>>,
    grads: StdHashMap<ParamId, FloatTensor<Inner<B>>>,
    lr: LearningRate,
    clipping: Option<&'a GradientClipping>,
    signals: DeviceSignals<Inner<B>>,
    /// Float parameters visited so far, with or without a gradient: each parameter's index.
    visited: usize,
    /// Where in the module the mapper is: each parameter's path, for its group.
    path: ModulePath,
}

impl<O, B> ModuleMapper<B> for Mapper<'_, O, B>
where
    O: ScaledSimpleOptimizer<B::InnerBackend>,
    B: AutodiffBackend,
{
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.enter(name);
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, value, mapper) = param.consume();
        let index = self.visited;
        self.visited += 1;
        let Some(grad) = self.grads.remove(&id) else {
            return Param::from_mapped_value(id, value, mapper);
        };
        let grad: Tensor<Inner<B>, D> = tensor(grad);
        // As Burn's adaptor: the parameter and its state go to the gradient's device.
        let device = grad.device();
        let require_grad = value.is_require_grad();
        let value = if value.device() != device {
            value.to_device(&device)
        } else {
            value
        };
        let grad = match self.clipping {
            Some(clipping) => clipping.clip_gradient(grad),
            None => grad,
        };
        let state = self
            .records
            .remove(&id)
            .map(|r| O::to_device(r.into_state::<D>(), &device));
        let scaling = self.signals.on(&device);
        let group = match self.optim.param_groups() {
            [] => None,
            groups => group_of(groups, &self.path.joined()).map(|(_, group)| group),
        };
        let lr = self.lr * group.map_or(1.0, |g| g.lr_scale);
        let (value, state) = self.optim.for_parameter(index, group).step_scaled(
            lr,
            value.inner(),
            grad,
            state,
            scaling,
        );
        if let Some(state) = state {
            self.records.insert(id, AdaptorRecord::from_state(state));
        }
        let mut value = Tensor::from_inner(value);
        if require_grad {
            value = value.require_grad();
        }
        Param::from_mapped_value(id, value, mapper)
    }
}

impl<O, M, B> Optimizer<M, B> for ScaledAdaptor<O, M, B>
where
    O: ScaledSimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    type Record = HashMap<ParamId, AdaptorRecord<O, B>>;

    fn step(&mut self, lr: LearningRate, module: M, mut grads: GradientsParams) -> M {
        let list = GradList::take::<B, M>(&module, &mut grads);
        self.step_list(lr, module, list, None)
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, mut grads: MultiGradientsParams) -> M {
        let list = GradList::take_multi::<B, M>(&module, &mut grads);
        self.step_list(lr, module, list, None)
    }

    fn to_record(&self) -> Self::Record {
        self.records.clone()
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        self.records = record;
        self
    }
}

impl<O, M, B> ScaledStep<M, B> for ScaledAdaptor<O, M, B>
where
    O: ScaledSimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    B::InnerBackend: ScalerKernels,
{
    fn step_scaled(
        &mut self,
        lr: LearningRate,
        module: M,
        grads: GradList<Inner<B>>,
        scale: Option<&ScaleSignals<Inner<B>>>,
    ) -> Result<(M, StepOutcome<Inner<B>>), ScalerError> {
        let Some(scale) = scale else {
            let module = self.step_list(lr, module, grads, None);
            return Ok((module, StepOutcome::Stepped { found_inf: None }));
        };
        let (grads, found_inf, inv_scale) = match (&scale.inv_scale, &scale.found_inf) {
            // Clipping must see unscaled gradients: unscale (and check) in one pass first.
            (Some(inv), found) if self.grad_clipping.is_some() => {
                let found = found.clone().unwrap_or_else(|| scale.zero());
                // Widened, not cast to a half parameter's dtype: unscaled in f32, and the
                // kernels read any gradient dtype.
                let (grads, found) = grads.widened().unscale_and_check(inv.clone(), found);
                (grads, found, None)
            }
            // Checked already: the kernels unscale.
            (inv, Some(found)) => (grads, found.clone(), inv.clone()),
            // One read-only pass decides the skip for every parameter before any is updated;
            // the kernels then unscale in f32 as they update.
            (inv, None) => {
                let found = grads.check_finite(scale.zero());
                (grads, found, inv.clone())
            }
        };
        let scaling = Scaling {
            inv_scale: primitive(inv_scale.unwrap_or_else(|| scale.one())),
            found_inf: primitive(found_inf.clone()),
        };
        let module = self.step_list(lr, module, grads, Some(scaling));
        Ok((
            module,
            StepOutcome::Stepped {
                found_inf: Some(found_inf),
            },
        ))
    }
}
