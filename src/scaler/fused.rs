//! Fused optimizers: unscale, skip-on-overflow and the update in one kernel per parameter
//! ([`AmpKernels::adamw_step`], [`AmpKernels::sgd_step`]), reading the scaler's device
//! tensors there, so a scaled step makes no host read. The moments are f32 whatever the
//! parameters' dtype (f32 master math for half-precision parameters).
//!
//! Both also implement Burn's [`Optimizer`], so they work unscaled anywhere an optimizer
//! does (burn-train's `Learner` included).

use std::collections::HashMap;

use hashbrown::HashMap as RecordMap;

use burn::config::Config;
use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::Record;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;
use burn_std::FloatDType;

use crate::kernels::{AdamWHyper, AmpKernels, SgdHyper};

/// An optimizer that takes the scaler's `inv_scale` and `found_inf` as device tensors.
pub trait FusedOptimizer<B: AutodiffBackend>
where
    B::InnerBackend: AmpKernels,
{
    /// One step: gradients are multiplied by `inv_scale[0]`, and nothing changes (parameters
    /// and state bit for bit) when `found_inf[0] != 0`. `None` means 1 and 0.
    fn step_scaled<M: AutodiffModule<B>>(
        &mut self,
        lr: LearningRate,
        module: M,
        grads: GradientsParams,
        inv_scale: Option<Tensor<B::InnerBackend, 1>>,
        found_inf: Option<Tensor<B::InnerBackend, 1>>,
    ) -> M;
}

/// Configuration of [`FusedAdamW`]; the defaults are PyTorch's `AdamW`.
#[derive(Config, Debug)]
pub struct FusedAdamWConfig {
    /// First moment decay.
    #[config(default = 0.9)]
    pub beta1: f32,
    /// Second moment decay.
    #[config(default = 0.999)]
    pub beta2: f32,
    /// Denominator epsilon.
    #[config(default = 1e-8)]
    pub epsilon: f32,
    /// Decoupled weight decay.
    #[config(default = 0.01)]
    pub weight_decay: f32,
}

/// Configuration of [`FusedSgd`].
#[derive(Config, Debug)]
pub struct FusedSgdConfig {
    /// Momentum (0 for plain SGD).
    #[config(default = 0.0)]
    pub momentum: f32,
    /// Dampening of the momentum.
    #[config(default = 0.0)]
    pub dampening: f32,
    /// L2 weight decay.
    #[config(default = 0.0)]
    pub weight_decay: f32,
    /// Nesterov momentum.
    #[config(default = false)]
    pub nesterov: bool,
}

type Prim<B> = FloatTensor<<B as AutodiffBackend>::InnerBackend>;

/// AdamW whose step is one [`AmpKernels::adamw_step`] per parameter.
#[derive(Clone)]
pub struct FusedAdamW<B: AutodiffBackend> {
    config: FusedAdamWConfig,
    /// `(exp_avg, exp_avg_sq)` per parameter, f32.
    moments: HashMap<ParamId, (Prim<B>, Prim<B>)>,
    /// Steps applied, f32 `[1]` on the device: skipped steps do not count.
    steps: Option<Tensor<B::InnerBackend, 1>>,
}

/// State of one parameter under a fused optimizer, as a record (flattened tensors).
#[derive(Record)]
pub struct ParamStateRecord<B: Backend> {
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// First state tensor (AdamW: `exp_avg`; SGD: the momentum buffer), flattened.
    pub first: Tensor<B, 1>,
    /// Second state tensor (AdamW: `exp_avg_sq`), flattened.
    pub second: Option<Tensor<B, 1>>,
}

/// The record of a fused optimizer: per-parameter state and the applied step count.
#[derive(Record)]
pub struct FusedRecord<B: Backend> {
    /// Per-parameter state.
    pub params: RecordMap<ParamId, ParamStateRecord<B>>,
    /// Steps applied (AdamW's bias correction).
    pub steps: Option<Tensor<B, 1>>,
}

impl FusedAdamWConfig {
    /// The optimizer, with empty state.
    pub fn init<B: AutodiffBackend>(&self) -> FusedAdamW<B> {
        FusedAdamW {
            config: self.clone(),
            moments: HashMap::new(),
            steps: None,
        }
    }
}

impl FusedSgdConfig {
    /// The optimizer, with empty state.
    pub fn init<B: AutodiffBackend>(&self) -> FusedSgd<B> {
        FusedSgd {
            config: self.clone(),
            momentum: HashMap::new(),
        }
    }
}

/// SGD (with optional momentum) whose step is one [`AmpKernels::sgd_step`] per parameter.
#[derive(Clone)]
pub struct FusedSgd<B: AutodiffBackend> {
    config: FusedSgdConfig,
    momentum: HashMap<ParamId, Prim<B>>,
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn from_prim<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// The scaler's device tensors for one step: `(device, inv_scale, found_inf)`.
type Scaling<B> = (
    <B as burn::tensor::backend::BackendTypes>::Device,
    Tensor<<B as AutodiffBackend>::InnerBackend, 1>,
    Tensor<<B as AutodiffBackend>::InnerBackend, 1>,
);

/// The module's device and the scaler tensors (or their neutral values there); `None` for a
/// module without parameters, which has nothing to step.
fn scaling<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    inv_scale: Option<Tensor<B::InnerBackend, 1>>,
    found_inf: Option<Tensor<B::InnerBackend, 1>>,
) -> Option<Scaling<B>> {
    let device = module.devices().into_iter().next()?;
    let inv_scale = inv_scale.unwrap_or_else(|| Tensor::ones([1], &device));
    let found_inf = found_inf.unwrap_or_else(|| Tensor::zeros([1], &device));
    Some((device, inv_scale, found_inf))
}

/// Maps every parameter that has a gradient through `update(param, grad, id)`.
struct FusedMapper<'a, B: AutodiffBackend, F> {
    grads: &'a mut GradientsParams,
    update: F,
    _backend: core::marker::PhantomData<B>,
}

impl<B, F> ModuleMapper<B> for FusedMapper<'_, B, F>
where
    B: AutodiffBackend,
    F: FnMut(ParamId, Prim<B>, Prim<B>) -> Prim<B>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let updated = (self.update)(id, prim(tensor.inner()), prim(grad));
        let mut tensor = Tensor::<B, D>::from_inner(from_prim(updated));
        if require_grad {
            tensor = tensor.require_grad();
        }
        Param::from_mapped_value(id, tensor, mapper)
    }
}

fn map_params<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: M,
    grads: &mut GradientsParams,
    update: impl FnMut(ParamId, Prim<B>, Prim<B>) -> Prim<B>,
) -> M {
    module.map(&mut FusedMapper {
        grads,
        update,
        _backend: core::marker::PhantomData,
    })
}

fn zeros_f32<B: Backend>(like: &FloatTensor<B>) -> FloatTensor<B> {
    use burn_backend::TensorMetadata;
    B::float_zeros(like.shape(), &B::float_device(like), FloatDType::F32)
}

impl<B: AutodiffBackend> FusedOptimizer<B> for FusedAdamW<B>
where
    B::InnerBackend: AmpKernels,
{
    fn step_scaled<M: AutodiffModule<B>>(
        &mut self,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
        inv_scale: Option<Tensor<B::InnerBackend, 1>>,
        found_inf: Option<Tensor<B::InnerBackend, 1>>,
    ) -> M {
        let Some((device, inv_scale, found_inf)) = scaling(&module, inv_scale, found_inf) else {
            return module;
        };
        // Count this step unless it is skipped: t += 1 - found_inf, on the device.
        let steps = self
            .steps
            .take()
            .unwrap_or_else(|| Tensor::zeros([1], &device));
        let steps = steps + found_inf.clone().neg().add_scalar(1.0);
        self.steps = Some(steps.clone());
        let hyper = AdamWHyper {
            lr: lr as f32,
            beta1: self.config.beta1,
            beta2: self.config.beta2,
            epsilon: self.config.epsilon,
            weight_decay: self.config.weight_decay,
        };
        let (steps, inv_scale, found_inf) = (prim(steps), prim(inv_scale), prim(found_inf));
        let moments = &mut self.moments;
        map_params(module, &mut grads, |id, param, grad| {
            let (m, v) = moments.remove(&id).unwrap_or_else(|| {
                (
                    zeros_f32::<B::InnerBackend>(&param),
                    zeros_f32::<B::InnerBackend>(&param),
                )
            });
            let (param, m, v) = B::InnerBackend::adamw_step(
                param,
                grad,
                m,
                v,
                steps.clone(),
                inv_scale.clone(),
                found_inf.clone(),
                hyper,
            );
            moments.insert(id, (m, v));
            param
        })
    }
}

impl<B: AutodiffBackend> FusedOptimizer<B> for FusedSgd<B>
where
    B::InnerBackend: AmpKernels,
{
    fn step_scaled<M: AutodiffModule<B>>(
        &mut self,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
        inv_scale: Option<Tensor<B::InnerBackend, 1>>,
        found_inf: Option<Tensor<B::InnerBackend, 1>>,
    ) -> M {
        let Some((_, inv_scale, found_inf)) = scaling(&module, inv_scale, found_inf) else {
            return module;
        };
        let hyper = SgdHyper {
            lr: lr as f32,
            momentum: self.config.momentum,
            dampening: self.config.dampening,
            weight_decay: self.config.weight_decay,
            nesterov: self.config.nesterov,
        };
        let (inv_scale, found_inf) = (prim(inv_scale), prim(found_inf));
        let buffers = &mut self.momentum;
        map_params(module, &mut grads, |id, param, grad| {
            let buffer = buffers.remove(&id);
            let (param, buffer) = B::InnerBackend::sgd_step(
                param,
                grad,
                buffer,
                inv_scale.clone(),
                found_inf.clone(),
                hyper,
            );
            if let Some(buffer) = buffer {
                buffers.insert(id, buffer);
            }
            param
        })
    }
}

/// Optimizer state (inner backend) as a flat record tensor of the autodiff backend.
fn flat_record<B: AutodiffBackend>(t: &Prim<B>) -> (Vec<usize>, Tensor<B, 1>) {
    use burn_backend::TensorMetadata;
    let shape = t.shape();
    let n = shape.num_elements();
    let flat = B::InnerBackend::float_reshape(t.clone(), [n].into());
    (shape.to_vec(), Tensor::from_inner(from_prim(flat)))
}

fn unflatten<B: AutodiffBackend>(shape: &[usize], t: Tensor<B, 1>) -> Prim<B> {
    B::InnerBackend::float_reshape(prim(t.inner()), shape.to_vec().into())
}

/// Multi-device gradients summed onto one [`GradientsParams`], as Burn's adaptor does.
fn single_device<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    multi: MultiGradientsParams,
) -> GradientsParams {
    struct Gather {
        multi: MultiGradientsParams,
        out: GradientsParams,
    }
    impl<B: AutodiffBackend> burn::module::ModuleVisitor<B> for Gather {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some((grad, _)) = self.multi.remove::<B::InnerBackend, D>(param.id) {
                self.out.register::<B::InnerBackend, D>(param.id, grad);
            }
        }
    }
    let mut gather = Gather {
        multi,
        out: GradientsParams::new(),
    };
    module.visit(&mut gather);
    gather.out
}

macro_rules! unscaled_optimizer {
    ($name:ident) => {
        impl<M, B> Optimizer<M, B> for $name<B>
        where
            M: AutodiffModule<B>,
            B: AutodiffBackend,
            B::InnerBackend: AmpKernels,
        {
            type Record = FusedRecord<B>;

            fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
                self.step_scaled(lr, module, grads, None, None)
            }

            fn step_multi(
                &mut self,
                lr: LearningRate,
                module: M,
                grads: MultiGradientsParams,
            ) -> M {
                let grads = single_device::<B, M>(&module, grads);
                self.step_scaled(lr, module, grads, None, None)
            }

            fn to_record(&self) -> Self::Record {
                self.record()
            }

            fn load_record(self, record: Self::Record) -> Self {
                self.with_record(record)
            }
        }
    };
}

unscaled_optimizer!(FusedAdamW);
unscaled_optimizer!(FusedSgd);

impl<B: AutodiffBackend> FusedAdamW<B> {
    /// Bytes of the optimizer state: two f32 moments per parameter that has had a step.
    pub fn state_bytes(&self) -> u64 {
        use burn_backend::TensorMetadata;
        let bytes = |t: &Prim<B>| (t.shape().num_elements() * t.dtype().size()) as u64;
        self.moments
            .values()
            .map(|(m, v)| bytes(m) + bytes(v))
            .sum()
    }

    fn record(&self) -> FusedRecord<B> {
        let params = self
            .moments
            .iter()
            .map(|(id, (m, v))| {
                let (shape, first) = flat_record(m);
                let (_, second) = flat_record(v);
                (
                    *id,
                    ParamStateRecord {
                        shape,
                        first,
                        second: Some(second),
                    },
                )
            })
            .collect();
        FusedRecord {
            params,
            steps: self.steps.clone().map(Tensor::from_inner),
        }
    }

    fn with_record(mut self, record: FusedRecord<B>) -> Self {
        self.moments = record
            .params
            .into_iter()
            .filter_map(|(id, r)| {
                let second = r.second?;
                Some((
                    id,
                    (unflatten(&r.shape, r.first), unflatten(&r.shape, second)),
                ))
            })
            .collect();
        self.steps = record.steps.map(|s| s.inner());
        self
    }
}

impl<B: AutodiffBackend> FusedSgd<B> {
    /// Bytes of the optimizer state: one f32 momentum buffer per parameter (none without
    /// momentum).
    pub fn state_bytes(&self) -> u64 {
        use burn_backend::TensorMetadata;
        self.momentum
            .values()
            .map(|t| (t.shape().num_elements() * t.dtype().size()) as u64)
            .sum()
    }

    fn record(&self) -> FusedRecord<B> {
        let params = self
            .momentum
            .iter()
            .map(|(id, buf)| {
                let (shape, first) = flat_record(buf);
                (
                    *id,
                    ParamStateRecord {
                        shape,
                        first,
                        second: None,
                    },
                )
            })
            .collect();
        FusedRecord {
            params,
            steps: None,
        }
    }

    fn with_record(mut self, record: FusedRecord<B>) -> Self {
        self.momentum = record
            .params
            .into_iter()
            .map(|(id, r)| (id, unflatten(&r.shape, r.first)))
            .collect();
        self
    }
}
