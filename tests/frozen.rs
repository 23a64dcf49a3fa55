//! Frozen modules: the gradient flows through them to the inputs, their parameters get no
//! gradient and no optimizer state, half-precision storage halves their bytes, and records
//! are the inner module's.

mod common;

use std::collections::HashSet;

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Distribution, FloatDType};
use burn_amp::frozen::param_bytes;
use burn_amp::{Amp, Frozen, Precision, autocast, freeze};
use common::models::{Mlp, bits, ids, materialize};
use common::{big_stack, load, save};

type B = Autodiff<Flex>;
type A = Amp<Autodiff<Flex>>;

/// A frozen backbone before a trainable head.
#[derive(Module, Debug)]
struct BackboneHead<B: Backend> {
    backbone: Frozen<Mlp<B>>,
    head: Linear<B>,
}

impl<B: Backend> BackboneHead<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.head.forward(self.backbone.forward(x))
    }
}

/// A frozen part between trainable ones.
#[derive(Module, Debug)]
struct Sandwich<B: Backend> {
    first: Linear<B>,
    middle: Frozen<Mlp<B>>,
    last: Linear<B>,
}

impl<B: Backend> Sandwich<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.last
            .forward(self.middle.forward(self.first.forward(x).tanh()))
    }
}

/// The same, unfrozen: the reference.
#[derive(Module, Debug)]
struct PlainSandwich<B: Backend> {
    first: Linear<B>,
    middle: Mlp<B>,
    last: Linear<B>,
}

impl<B: Backend> PlainSandwich<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.last
            .forward(self.middle.forward(self.first.forward(x).tanh()))
    }
}

/// `(dtype, require_grad)` of every float parameter.
fn flags<B: Backend, M: Module<B>>(module: &M) -> Vec<(DType, bool)> {
    struct Flags(Vec<(DType, bool)>);
    impl<B: Backend> ModuleVisitor<B> for Flags {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push((param.dtype(), param.is_require_grad()));
        }
    }
    let mut v = Flags(Vec::new());
    module.visit(&mut v);
    v.0
}

fn to_vec<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap()
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn input<Bk: Backend>(rows: usize, cols: usize, device: &Bk::Device) -> Tensor<Bk, 2> {
    Tensor::random([rows, cols], Distribution::Normal(0.0, 1.0), device)
}

/// `steps` optimizer steps (lr 1e-2) on the mean square of `forward`'s output, each on a fresh
/// `[rows, 8]` input.
fn train<Bk: AutodiffBackend, M: AutodiffModule<Bk>>(
    mut model: M,
    optim: &mut impl Optimizer<M, Bk>,
    steps: usize,
    rows: usize,
    forward: impl Fn(&M, Tensor<Bk, 2>) -> Tensor<Bk, 2>,
    device: &Bk::Device,
) -> M {
    for _ in 0..steps {
        let loss = forward(&model, input(rows, 8, device))
            .powi_scalar(2)
            .mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    model
}

#[test]
fn input_gradient_through_frozen_equals_unfrozen() {
    let device = Default::default();
    B::seed(&device, 11);
    let mlp = Mlp::<B>::new(8, 16, 4, &device);
    let frozen = freeze(mlp.clone());
    let x = input::<B>(5, 8, &device);

    let gx = |f: &dyn Fn(Tensor<B, 2>) -> Tensor<B, 2>| {
        let x = x.clone().detach().require_grad();
        let grads = f(x.clone()).powi_scalar(2).mean().backward();
        (to_vec(x.grad(&grads).unwrap()), grads)
    };
    let (reference, grads_plain) = gx(&|x| mlp.forward(x));
    let (through_frozen, grads_frozen) = gx(&|x| frozen.forward(x));

    assert!(
        max_rel_diff(&through_frozen, &reference) < 1e-6,
        "the input gradient through Frozen differs"
    );
    assert!(reference.iter().any(|v| *v != 0.0));
    // The unfrozen module's weights have gradients; the frozen ones none.
    assert!(mlp.l1.weight.grad(&grads_plain).is_some());
    assert!(frozen.l1.weight.grad(&grads_frozen).is_none());
    assert!(
        frozen
            .l2
            .bias
            .as_ref()
            .unwrap()
            .grad(&grads_frozen)
            .is_none()
    );
    let mut grads_frozen = grads_frozen;
    assert!(GradientsParams::from_module(&mut grads_frozen, &frozen).is_empty());
}

#[test]
fn a_frozen_backbone_gets_no_grads_and_no_optimizer_state() {
    let device = Default::default();
    B::seed(&device, 12);
    let mut model = BackboneHead::<B> {
        backbone: Frozen::new(Mlp::new(8, 16, 8, &device)),
        head: LinearConfig::new(8, 3).init(&device),
    };
    let backbone_ids: HashSet<_> = ids(&model.backbone).into_iter().collect();
    let head_ids: HashSet<_> = ids(&model.head).into_iter().collect();
    let backbone_before = bits(&model.backbone);
    let head_before = bits(&model.head);
    let mut optim = AdamConfig::new().init::<B, BackboneHead<B>>();
    for _ in 0..5 {
        let loss = model.forward(input(6, 8, &device)).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        assert_eq!(grads.len(), head_ids.len(), "only the head has gradients");
        for id in &backbone_ids {
            assert!(grads.get::<Flex, 2>(*id).is_none() && grads.get::<Flex, 1>(*id).is_none());
        }
        model = optim.step(1e-2, model, grads);
    }
    let state: HashSet<ParamId> = optim.to_record().keys().copied().collect();
    assert_eq!(
        state, head_ids,
        "optimizer state exists for exactly the head"
    );
    assert_eq!(bits(&model.backbone), backbone_before, "the backbone moved");
    assert_ne!(bits(&model.head), head_before, "the head did not train");
    assert!(flags(&model.backbone).iter().all(|(_, rg)| !rg));
    assert!(flags(&model.head).iter().all(|(_, rg)| *rg));
}

#[test]
fn a_frozen_middle_passes_the_gradient_to_earlier_layers() {
    let device = Default::default();
    B::seed(&device, 13);
    let plain = materialize(PlainSandwich::<B> {
        first: LinearConfig::new(8, 16).init(&device),
        middle: Mlp::new(16, 16, 16, &device),
        last: LinearConfig::new(16, 2).init(&device),
    });
    let mut model = Sandwich {
        first: plain.first.clone(),
        middle: Frozen::new(plain.middle.clone()),
        last: plain.last.clone(),
    };
    let x = input::<B>(4, 8, &device);

    // The first layer's gradient is the one an unfrozen middle gives.
    let g_plain = plain.forward(x.clone()).powi_scalar(2).mean().backward();
    let g_frozen = model.forward(x.clone()).powi_scalar(2).mean().backward();
    let reference = to_vec(plain.first.weight.grad(&g_plain).unwrap());
    let got = to_vec(model.first.weight.grad(&g_frozen).unwrap());
    assert!(max_rel_diff(&got, &reference) < 1e-6);
    assert!(model.middle.l1.weight.grad(&g_frozen).is_none());

    let middle_ids: HashSet<_> = ids(&model.middle).into_iter().collect();
    let middle_before = bits(&model.middle);
    let first_before = bits(&model.first);
    let mut optim = AdamConfig::new().init::<B, Sandwich<B>>();
    model = train(model, &mut optim, 4, 4, Sandwich::forward, &device);
    let state: HashSet<ParamId> = optim.to_record().keys().copied().collect();
    assert!(state.is_disjoint(&middle_ids));
    assert_eq!(state.len(), 4, "first and last: weight and bias each");
    assert_eq!(bits(&model.middle), middle_before);
    assert_ne!(
        bits(&model.first),
        first_before,
        "the first layer did not train"
    );
}

#[test]
fn bf16_storage_is_bf16_halves_the_bytes_and_still_trains_the_rest() {
    big_stack(|| {
        let device = Default::default();
        A::seed(&device, 14);
        let _g = autocast(Precision::F32);
        let mlp = Mlp::<A>::new(8, 32, 8, &device);
        let f32_bytes = param_bytes(&mlp);
        let frozen = Frozen::new(mlp.clone()).with_storage(FloatDType::BF16);
        assert_eq!(frozen.storage(), Some(FloatDType::BF16));
        assert!(
            flags(&*frozen)
                .iter()
                .all(|&(dtype, rg)| dtype == DType::BF16 && !rg),
            "{:?}",
            flags(&*frozen)
        );
        assert_eq!(param_bytes(&frozen) * 2, f32_bytes);

        // A bf16 weight in an f32 graph: Amp promotes, and the input gradient is the f32
        // one within bf16 rounding of the weights.
        let x = input::<A>(4, 8, &device);
        let grad_of = |f: &dyn Fn(Tensor<A, 2>) -> Tensor<A, 2>| {
            let x = x.clone().detach().require_grad();
            let grads = f(x.clone()).powi_scalar(2).mean().backward();
            let g = x.grad(&grads).unwrap();
            assert_eq!(g.dtype(), DType::F32);
            to_vec(g)
        };
        let reference = grad_of(&|x| mlp.forward(x));
        let got = grad_of(&|x| frozen.forward(x));
        let err = max_rel_diff(&got, &reference);
        assert!(err < 2e-2, "bf16-stored input gradient off by {err}");

        // Under bf16 autocast too, and the head trains while the backbone stays bf16.
        let _bf16 = autocast(Precision::Bf16);
        let mut model = BackboneHead::<A> {
            backbone: frozen,
            head: LinearConfig::new(8, 3).init(&device),
        };
        let backbone_before = bits(&model.backbone);
        let head_before = bits(&model.head);
        let mut optim = AdamConfig::new().init::<A, BackboneHead<A>>();
        model = train(model, &mut optim, 3, 6, BackboneHead::forward, &device);
        assert_eq!(optim.to_record().len(), 2);
        assert_eq!(bits(&model.backbone), backbone_before);
        assert!(
            flags(&model.backbone)
                .iter()
                .all(|(d, _)| *d == DType::BF16)
        );
        assert_ne!(bits(&model.head), head_before);

        // Unfreezing gives f32 trainable parameters with the bf16-rounded values.
        let thawed = model.backbone.unfreeze();
        assert!(
            flags(&thawed)
                .iter()
                .all(|&(dtype, rg)| dtype == DType::F32 && rg)
        );
        assert_eq!(bits(&thawed), backbone_before);
        assert_eq!(param_bytes(&thawed), f32_bytes);
    });
}

#[test]
fn records_save_and_load_as_the_inner_modules() {
    let device = Default::default();
    B::seed(&device, 15);
    let frozen = Frozen::new(Mlp::<B>::new(8, 16, 4, &device));
    let values = bits(&frozen);

    // Frozen -> bytes -> a fresh Frozen: same values, still frozen.
    let bytes = save::<B, _>(frozen.clone().into_record());
    let loaded = Frozen::new(Mlp::<B>::new(8, 16, 4, &device)).load_record(load(bytes, &device));
    assert_eq!(bits(&loaded), values);
    assert!(flags(&loaded).iter().all(|(_, rg)| !rg));
    assert_eq!(ids(&loaded), ids(&frozen));

    // The record is the inner module's: it loads into the plain module, and back.
    let bytes = save::<B, _>(frozen.clone().into_record());
    let plain = Mlp::<B>::new(8, 16, 4, &device).load_record(load(bytes, &device));
    assert_eq!(bits(&plain), values);
    assert!(
        flags(&plain).iter().all(|(_, rg)| *rg),
        "plain stays trainable"
    );
    let bytes = save::<B, _>(plain.into_record());
    let refrozen = Frozen::new(Mlp::<B>::new(8, 16, 4, &device)).load_record(load(bytes, &device));
    assert_eq!(bits(&refrozen), values);
    assert!(flags(&refrozen).iter().all(|(_, rg)| !rg));

    // A bf16-stored module loads back into bf16 storage (the saved values are the rounded
    // ones, exact in f32).
    let half = Frozen::new(Mlp::<B>::new(8, 16, 4, &device)).with_storage(FloatDType::BF16);
    let half_values = bits(&half);
    let bytes = save::<B, _>(half.into_record());
    let loaded = Frozen::new(Mlp::<B>::new(8, 16, 4, &device))
        .with_storage(FloatDType::BF16)
        .load_record(load(bytes, &device));
    assert!(
        flags(&loaded)
            .iter()
            .all(|&(d, rg)| d == DType::BF16 && !rg)
    );
    assert_eq!(bits(&loaded), half_values);
}

#[test]
fn valid_and_train_keep_the_freeze() {
    let device = Default::default();
    let model = BackboneHead::<B> {
        backbone: Frozen::new(Mlp::new(8, 16, 8, &device)),
        head: LinearConfig::new(8, 3).init(&device),
    };
    let valid = model.valid();
    let _ = valid.forward(input(2, 8, &device));
    let back = valid.train::<B>();
    assert!(flags(&back.backbone).iter().all(|(_, rg)| !rg));
    assert!(flags(&back.head).iter().all(|(_, rg)| *rg));
    // Device moves too.
    let moved = back.fork(&device);
    assert!(flags(&moved.backbone).iter().all(|(_, rg)| !rg));
    assert!(format!("{moved}").contains("Frozen"));
}

/// Compile-time check: a derived parent holding a `Frozen` field is an autodiff module.
#[allow(dead_code)]
fn parent_is_an_autodiff_module<Bk: AutodiffBackend>(
    m: BackboneHead<Bk>,
) -> impl AutodiffModule<Bk> {
    m
}
