//! Parameter groups of the fused optimizers (`ParamGroup`: a learning-rate scale and a weight
//! decay per module path). Each parameter's trajectory, under fixed gradients, is the one the
//! optimizer without groups gives it with that group's options: bitwise, for AdamW (decoupled
//! and Adam's L2 penalty) and SGD with momentum, stepped plainly and through `AmpOptimizer` at
//! f16 (the scaled path), with `weight_decay_min_rank` overridden by a group's decay.

use burn::module::{ModuleVisitor, Param};
use burn_amp::optim::{FusedSgdConfig, OptimError, ParamGroup};
use burn_amp::scaler::ScaledStep;

use super::*;

const STEPS: usize = 4;
const LR: f64 = 1e-2;

/// The same gradients whatever the weights (times `factor`): each parameter's trajectory
/// then depends on its own options only, and runs with other options can be compared
/// parameter by parameter.
pub(super) fn fixed_grads(model: &Mlp<B>, step: usize, factor: f32) -> GradientsParams {
    struct Grads {
        step: usize,
        factor: f32,
        index: usize,
        grads: GradientsParams,
    }
    impl ModuleVisitor<B> for Grads {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let shape = param.shape();
            let values: Vec<f32> = (0..shape.num_elements())
                .map(|i| {
                    let k = i * 31 + self.step * 17 + self.index * 7;
                    ((k % 29) as f32 / 29.0 - 0.45) * 0.1 * self.factor
                })
                .collect();
            let grad = Tensor::<Inner, 1>::from_floats(values.as_slice(), &param.device());
            self.grads
                .register::<Inner, D>(param.id, grad.reshape(shape));
            self.index += 1;
        }
    }
    let mut grads = Grads {
        step,
        factor,
        index: 0,
        grads: GradientsParams::new(),
    };
    model.visit(&mut grads);
    grads.grads
}

/// Each parameter's values (bits), in visiting order.
pub(super) fn per_param(model: &Mlp<B>) -> Vec<Vec<u32>> {
    struct Values(Vec<Vec<u32>>);
    impl ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let values = param.val().into_data().to_vec::<f32>().unwrap();
            self.0.push(values.into_iter().map(f32::to_bits).collect());
        }
    }
    let mut values = Values(Vec::new());
    model.visit(&mut values);
    values.0
}

/// `STEPS` steps of `optim` on fixed gradients at learning rate `lr`, plainly or, when
/// `scaled`, through an `AmpOptimizer` at f16: after a scaled backward (whose gradients are
/// dropped) it gets the fixed gradients times the scale, and unscales them in its kernels
/// (by a power of two: exact, so both ways give the same bits).
fn run<O>(optim: O, lr: f64, scaled: bool) -> Vec<Vec<u32>>
where
    O: Optimizer<Mlp<B>, B> + ScaledStep<Mlp<B>, B>,
{
    run_signed(optim, lr, scaled, 1.0)
}

/// `run` on the fixed gradients times `sign`.
pub(super) fn run_signed<O>(optim: O, lr: f64, scaled: bool, sign: f32) -> Vec<Vec<u32>>
where
    O: Optimizer<Mlp<B>, B> + ScaledStep<Mlp<B>, B>,
{
    let device = Default::default();
    let mut model = model(&device);
    if !scaled {
        let mut optim = optim;
        for i in 0..STEPS {
            let grads = fixed_grads(&model, i, sign);
            model = optim.step(lr, model, grads);
        }
        return per_param(&model);
    }
    let _g = autocast(Precision::F16);
    let mut optim = AmpOptimizer::new(optim, GradScalerConfig::new()).unwrap();
    for i in 0..STEPS {
        let (x, y) = batch(i, false, &device);
        drop(model.loss(x, y).backward());
        let grads = fixed_grads(&model, i, sign * optim.scale());
        model = optim.step(lr, model, grads);
    }
    per_param(&model)
}

/// Paths of the `Mlp`'s parameters, in visiting order.
const PATHS: [&str; 4] = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"];

/// Groups over `base` (decay 0.1, and `weight_decay_min_rank` 2 in `with_min_rank`): biases
/// undecayed, `l1` at half the learning rate, and `l2.bias` decayed at 0.05 after all (a
/// group's decay beats the rank rule; the first group matching wins, so it comes first).
/// Each parameter's (learning-rate scale, decay).
fn groups() -> (Vec<ParamGroup>, [(f64, f32); 4]) {
    let groups = vec![
        ParamGroup::new("l2.bias".into()).with_weight_decay(Some(0.05)),
        ParamGroup::new("**.bias".into()).with_weight_decay(Some(0.0)),
        ParamGroup::new("l1".into()).with_lr_scale(0.5),
    ];
    // l1.weight: `l1`; l1.bias: `**.bias` first; l2.weight: none; l2.bias: its own.
    (groups, [(0.5, 0.1), (1.0, 0.0), (1.0, 0.1), (1.0, 0.05)])
}

/// Each parameter of a grouped run against the run without groups at that parameter's
/// options.
fn check_groups<O>(what: &str, grouped: impl Fn() -> O, plain: impl Fn(f32) -> O)
where
    O: Optimizer<Mlp<B>, B> + ScaledStep<Mlp<B>, B>,
{
    let (_, options) = groups();
    assert_eq!(
        run(grouped(), LR, true),
        run(grouped(), LR, false),
        "{what}: scaled gradients unscaled exactly"
    );
    for scaled in [false, true] {
        let got = run(grouped(), LR, scaled);
        for (index, &(lr_scale, decay)) in options.iter().enumerate() {
            let want = run(plain(decay), LR * lr_scale, scaled);
            assert_eq!(
                got[index], want[index],
                "{what} (scaled: {scaled}): {} with lr x{lr_scale}, decay {decay}",
                PATHS[index]
            );
            // The options matter: the parameter without its group's moves elsewhere.
            let ungrouped = run(plain(0.1), LR, scaled);
            if (lr_scale, decay) != (1.0, 0.1) {
                assert_ne!(got[index], ungrouped[index], "{what}: {}", PATHS[index]);
            }
        }
    }
}

/// `check_groups` for a fused optimizer's config `base`: with `groups()` (and
/// `weight_decay_min_rank` 2, which a group's decay overrides) against `base` at each decay.
macro_rules! check_config {
    ($what:expr, $base:expr) => {{
        let base = $base;
        check_groups(
            $what,
            || {
                let grouped = base.clone().with_weight_decay_min_rank(2);
                grouped.with_param_groups(groups().0).init().unwrap()
            },
            |decay| base.clone().with_weight_decay(decay).init().unwrap(),
        )
    }};
}

#[test]
fn each_group_steps_with_its_learning_rate_and_decay() {
    let _s = serial();
    let adamw = FusedAdamWConfig::new().with_weight_decay(0.1);
    check_config!("AdamW", adamw.clone());
    check_config!("Adam (L2)", adamw.with_decoupled_weight_decay(false));
    let sgd = FusedSgdConfig::new().with_momentum(0.9);
    check_config!("SGD", sgd.with_weight_decay(0.1));
}

#[test]
fn the_optimizer_says_which_group_each_parameter_is_in() {
    let _s = serial(); // `model` seeds the process's generator
    let optim = FusedAdamWConfig::new()
        .with_param_groups(groups().0)
        .init::<B, Mlp<B>>()
        .unwrap();
    let device = Default::default();
    let placed = optim.param_groups(&model(&device));
    let want: Vec<(String, Option<usize>)> = PATHS
        .iter()
        .map(|p| p.to_string())
        .zip([Some(2), Some(1), None, Some(0)])
        .collect();
    assert_eq!(placed, want);
    assert!(optim.unmatched_groups(&model(&device)).is_empty());
    // A typo matches nothing: the first step says so in the log, and this tells which.
    let typo = FusedSgdConfig::new()
        .with_group(ParamGroup::new("l1".into()))
        .with_group(ParamGroup::new("layer1".into()))
        .with_group(ParamGroup::new("**.bais".into()))
        .init::<B, Mlp<B>>()
        .unwrap();
    assert_eq!(typo.unmatched_groups(&model(&device)), [1, 2]);
}

#[test]
fn a_bad_group_is_refused_when_the_optimizer_is_made() {
    let _s = serial(); // `model` seeds the process's generator
    let refused = FusedAdamWConfig::new()
        .with_group(ParamGroup::new("l1".into()).with_lr_scale(f64::INFINITY))
        .init::<B, Mlp<B>>()
        .err();
    match refused {
        Some(OptimError::InvalidParamGroup { index: 0, path, .. }) => assert_eq!(path, "l1"),
        other => panic!("expected InvalidParamGroup, got {other:?}"),
    }
    let refused = FusedSgdConfig::new()
        .with_group(ParamGroup::new("**".into()))
        .with_group(ParamGroup::new("l1.".into()))
        .init::<B, Mlp<B>>()
        .err();
    assert!(
        matches!(
            refused,
            Some(OptimError::InvalidParamGroup { index: 1, .. })
        ),
        "{refused:?}"
    );
}
