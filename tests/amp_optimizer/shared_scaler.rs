//! Two optimizers with one loss scale (`AmpOptimizer::share_scaler`): a fused AdamW and Burn's
//! Adam over two models, in PyTorch's loop for several losses (both backwards, then both
//! steps) and in a GAN's (a backward and a step, twice), against the same loops written by
//! hand with one `GradScaler` whose `update` runs where the shared scaler's does (at the first
//! backward after steps): weights bitwise, the scale after every iteration (the one the next
//! backward uses), each model's skipped steps; and a run resumed from the records of both.
//! Overflows: model 0's loss at iteration 2, model 1's at 5, both at 7.

use burn_amp::scaler::GradScaler;

use super::*;

const ITERATIONS: usize = 9;

pub(super) fn second_model(device: &burn::tensor::Device<B>) -> Mlp<B> {
    B::seed(device, 5);
    Mlp::new(D_IN, 16, CLASSES, device)
}

fn poisoned(iteration: usize, model: usize) -> bool {
    matches!((iteration, model), (2, 0) | (5, 1) | (7, _))
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Order {
    /// `backward` of both losses, then `step` of both (PyTorch's AMP example).
    BackwardsThenSteps,
    /// `backward` and `step` of one, then of the other (a GAN's).
    Interleaved,
}

/// Per iteration: both models' weights (bits), the scale after the iteration; and each
/// optimizer's skipped steps at the end.
#[derive(Debug, PartialEq)]
pub(super) struct Run {
    pub weights: Vec<[Vec<u32>; 2]>,
    pub scales: Vec<f32>,
    pub skipped: [u64; 2],
}

pub(super) type Fused = burn_amp::optim::ScaledAdaptor<burn_amp::optim::FusedAdamW, Mlp<B>, B>;
pub(super) type BurnAdam = burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, Mlp<B>, B>;

pub(super) fn fused() -> Fused {
    FusedAdamWConfig::new().init::<B, Mlp<B>>().unwrap()
}

pub(super) fn adam() -> BurnAdam {
    AdamConfig::new().init::<B, Mlp<B>>()
}

fn loss_of(model: &Mlp<B>, iteration: usize, which: usize) -> Tensor<B, 1> {
    let device = model.l1.weight.device();
    let (x, y) = batch(iteration + 100 * which, poisoned(iteration, which), &device);
    model.loss(x, y)
}

/// The gradients of a plain `backward` of `loss_of`.
fn grads_of(model: &Mlp<B>, iteration: usize, which: usize) -> GradientsParams {
    GradientsParams::from_grads(loss_of(model, iteration, which).backward(), model)
}

type Records = (
    <AmpOptimizer<Fused, B> as Optimizer<Mlp<B>, B>>::Record,
    <AmpOptimizer<BurnAdam, B> as Optimizer<Mlp<B>, B>>::Record,
);

/// Two models and their optimizers, sharing the scale.
struct Pair {
    models: (Mlp<B>, Mlp<B>),
    optims: (AmpOptimizer<Fused, B>, AmpOptimizer<BurnAdam, B>),
}

impl Pair {
    fn new() -> Self {
        let device = Default::default();
        let mut optim0 = AmpOptimizer::new(fused(), GradScalerConfig::new()).unwrap();
        let optim1 = optim0.share_scaler(adam());
        Self {
            models: (model(&device), second_model(&device)),
            optims: (optim0, optim1),
        }
    }

    fn records(&self) -> Records {
        (self.optims.0.to_record(), self.optims.1.to_record())
    }
}

/// The loop as a user writes it: plain `backward` and `step`.
fn shared(order: Order) -> Run {
    shared_from(Pair::new(), order, 0..ITERATIONS, |_, _| {})
}

/// Iterations `range` of the loop on `pair`, `after` told of each.
fn shared_from(
    pair: Pair,
    order: Order,
    range: core::ops::Range<usize>,
    mut after: impl FnMut(usize, &Pair),
) -> Run {
    let Pair {
        models: (mut m0, mut m1),
        optims: (mut optim0, mut optim1),
    } = pair;
    let mut run = Run {
        weights: Vec::new(),
        scales: Vec::new(),
        skipped: [0; 2],
    };
    for i in range {
        let grads = |model: &Mlp<B>, which| grads_of(model, i, which);
        match order {
            Order::BackwardsThenSteps => {
                let (g0, g1) = (grads(&m0, 0), grads(&m1, 1));
                m0 = optim0.step(1e-2, m0, g0);
                m1 = optim1.step(1e-2, m1, g1);
            }
            Order::Interleaved => {
                let g0 = grads(&m0, 0);
                m0 = optim0.step(1e-2, m0, g0);
                let g1 = grads(&m1, 1);
                m1 = optim1.step(1e-2, m1, g1);
            }
        }
        run.weights.push([weights_bits(&m0), weights_bits(&m1)]);
        assert_eq!(optim0.scale(), optim1.scale(), "iteration {i}: one scale");
        // The loss-scale metric of the optimizer that stepped last says it too.
        let snapshot = optim1.monitor().snapshot();
        assert_eq!(snapshot.scale, optim1.scale(), "iteration {i}: the metric");
        run.scales.push(optim0.scale());
        let pair = Pair {
            models: (m0, m1),
            optims: (optim0, optim1),
        };
        after(i, &pair);
        Pair {
            models: (m0, m1),
            optims: (optim0, optim1),
        } = pair;
    }
    run.skipped = [
        optim0.step_counts().skipped_steps,
        optim1.step_counts().skipped_steps,
    ];
    run
}

/// The same loop with one `GradScaler`, updated before each backward that follows a step.
fn by_hand(order: Order) -> Run {
    let device = Default::default();
    let mut scaler: GradScaler<B> = GradScalerConfig::new()
        .init(&device, Precision::F16)
        .unwrap();
    let (mut optim0, mut optim1) = (fused(), adam());
    let (mut m0, mut m1) = (model(&device), second_model(&device));
    let mut run = Run {
        weights: Vec::new(),
        scales: Vec::new(),
        skipped: [0; 2],
    };
    let mut pending = false;
    for i in 0..ITERATIONS {
        let grads = |model: &Mlp<B>, which, scaler: &mut GradScaler<B>, pending: &mut bool| {
            if core::mem::take(pending) {
                scaler.update().unwrap();
            }
            let loss = scaler.scale(loss_of(model, i, which));
            GradientsParams::from_grads(loss.backward(), model)
        };
        let mut skipped = [false; 2];
        match order {
            Order::BackwardsThenSteps => {
                let g0 = grads(&m0, 0, &mut scaler, &mut pending);
                let g1 = grads(&m1, 1, &mut scaler, &mut pending);
                let (m, report) = scaler.step(&mut optim0, 1e-2, m0, g0).unwrap();
                (m0, skipped[0]) = (m, report.skipped());
                let (m, report) = scaler.step(&mut optim1, 1e-2, m1, g1).unwrap();
                (m1, skipped[1]) = (m, report.skipped());
            }
            Order::Interleaved => {
                let g0 = grads(&m0, 0, &mut scaler, &mut pending);
                let (m, report) = scaler.step(&mut optim0, 1e-2, m0, g0).unwrap();
                (m0, skipped[0]) = (m, report.skipped());
                pending = true;
                let g1 = grads(&m1, 1, &mut scaler, &mut pending);
                let (m, report) = scaler.step(&mut optim1, 1e-2, m1, g1).unwrap();
                (m1, skipped[1]) = (m, report.skipped());
            }
        }
        pending = true;
        for (count, skipped) in run.skipped.iter_mut().zip(skipped) {
            *count += u64::from(skipped);
        }
        run.weights.push([weights_bits(&m0), weights_bits(&m1)]);
        // The scale the next backward uses.
        let mut next = scaler.clone();
        next.update().unwrap();
        run.scales.push(next.scale_value());
    }
    run
}

#[test]
fn two_optimizers_share_one_scale_in_either_order() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let s = 65536.0;
    // The scale the next backward uses, after each iteration.
    let half = |n: i32| s / 2f32.powi(n);
    for (order, scales) in [
        // One update per iteration, at the next one's first backward: 7's two overflows back
        // off once.
        (
            Order::BackwardsThenSteps,
            [0, 0, 1, 1, 1, 2, 2, 3, 3].map(half),
        ),
        // One update per step, at the next backward.
        (Order::Interleaved, [0, 0, 1, 1, 1, 2, 2, 4, 4].map(half)),
    ] {
        let reference = by_hand(order);
        let got = shared(order);
        assert_eq!(got.scales, scales, "{order:?}: the scale");
        assert_eq!(got.skipped, [2, 2], "{order:?}: skipped steps");
        // Each model skips on its own overflow only.
        for (i, pair) in got.weights.windows(2).enumerate() {
            let i = i + 1;
            for (which, (before, after)) in pair[0].iter().zip(&pair[1]).enumerate() {
                let moved = after != before;
                assert_eq!(moved, !poisoned(i, which), "{order:?}: model {which}, {i}");
            }
        }
        assert_eq!(
            got, reference,
            "{order:?}: the GradScaler loop by hand, update at the next backward"
        );
    }
}

#[test]
fn shared_scalers_install_once_and_pass_bf16_through() {
    let _s = serial();
    let _g = autocast(Precision::Bf16);
    let device = Default::default();
    let mut optim0 = AmpOptimizer::new(fused(), GradScalerConfig::new()).unwrap();
    let mut optim1 = optim0.share_scaler(adam());
    let (mut plain0, mut plain1) = (fused(), adam());
    let (mut a0, mut a1) = (model(&device), second_model(&device));
    let (mut b0, mut b1) = (model(&device), second_model(&device));
    for i in 0..3 {
        let grads = |m: &Mlp<B>, which| grads_of(m, i + 10, which);
        let (g0, g1) = (grads(&a0, 0), grads(&a1, 1));
        a0 = optim0.step(1e-2, a0, g0);
        a1 = optim1.step(1e-2, a1, g1);
        let (g0, g1) = (grads(&b0, 0), grads(&b1, 1));
        b0 = plain0.step(1e-2, b0, g0);
        b1 = plain1.step(1e-2, b1, g1);
    }
    assert_eq!(weights_bits(&a0), weights_bits(&b0));
    assert_eq!(weights_bits(&a1), weights_bits(&b1));
    // One installation for both: a third optimizer comes from them, not from `new`, and the
    // backend is free once both are dropped.
    assert!(AmpOptimizer::new(adam(), GradScalerConfig::new()).is_err());
    drop(optim0);
    assert!(AmpOptimizer::new(adam(), GradScalerConfig::new()).is_err());
    drop(optim1);
    AmpOptimizer::new(adam(), GradScalerConfig::new()).expect("free again");
}

/// Two fused optimizers sharing the scale step, skip and update with no host read.
#[test]
fn fused_optimizers_sharing_the_scale_read_nothing_back() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let device = Default::default();
    let mut optim0 = AmpOptimizer::new(fused(), GradScalerConfig::new()).unwrap();
    let sgd = burn_amp::optim::FusedSgdConfig::new()
        .with_momentum(0.9)
        .init::<B, Mlp<B>>()
        .unwrap();
    let mut optim1 = optim0.share_scaler(sgd);
    let (mut m0, mut m1) = (model(&device), second_model(&device));
    let mut before = 0;
    for i in 0..6 {
        if i == 1 {
            before = host_reads(); // after the first step: kernels compiled, states made
        }
        let g0 = grads_of(&m0, i, 0);
        m0 = optim0.step(1e-2, m0, g0);
        let g1 = grads_of(&m1, i, 1);
        m1 = optim1.step(1e-2, m1, g1);
    }
    assert_eq!(host_reads() - before, 0, "host reads in 5 shared steps");
    // Model 0 overflowed at 2, model 1 at 5 (its update waits for the next backward; the
    // scale says it).
    assert_eq!(optim0.scale(), 16384.0);
    assert_eq!(optim1.step_counts().skipped_steps, 1);
}

/// Records of both optimizers taken after iteration 5 (model 1's overflow, its update
/// waiting for the next backward) resume the run bitwise.
#[test]
fn records_of_shared_optimizers_resume_the_run() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    for order in [Order::BackwardsThenSteps, Order::Interleaved] {
        let mut saved = None;
        let whole = shared_from(Pair::new(), order, 0..ITERATIONS, |i, pair| {
            if i == 5 {
                saved = Some((pair.models.clone(), pair.records()));
            }
        });
        let (models, (record0, record1)) = saved.expect("saved at 5");
        let mut pair = Pair::new();
        pair.models = models;
        let (optim0, optim1) = pair.optims;
        pair.optims = (optim0.load_record(record0), optim1.load_record(record1));
        let resumed = shared_from(pair, order, 6..ITERATIONS, |_, _| {});
        assert_eq!(resumed.weights, whole.weights[6..], "{order:?}: weights");
        assert_eq!(resumed.scales, whole.scales[6..], "{order:?}: scales");
    }
}
