//! `maximize` (PyTorch's flag) in the fused optimizers: ascending the gradient `g` is
//! descending `-g`, weight decay left as it is. Each optimizer with `maximize` on fixed
//! gradients against the same one without it on the negated gradients, bitwise (negation is
//! exact): AdamW, Adam's L2 penalty with AMSGrad, cautious decay, 8-bit moments, clipping
//! (which the adaptor applies to unscaled gradients, before the kernel), SGD with Nesterov
//! momentum; stepped plainly, through `AmpOptimizer` at f16, and as a Burn `SimpleOptimizer`
//! inside Burn's own `OptimizerAdaptor`.

use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn_amp::optim::{FusedSgdConfig, MomentStorage, QuantMap};
use burn_amp::scaler::ScaledStep;

use super::param_groups::run_signed;
use super::*;

const LR: f64 = 1e-2;

/// `optim(maximize)` ascending `g` against `optim(false)` descending `-g`, on each path, and
/// against `optim(false)` descending `g` (which must differ).
fn check<O>(what: &str, optim: impl Fn(bool) -> O)
where
    O: Optimizer<Mlp<B>, B> + ScaledStep<Mlp<B>, B>,
{
    for scaled in [false, true] {
        let ascended = run_signed(optim(true), LR, scaled, 1.0);
        let descended = run_signed(optim(false), LR, scaled, -1.0);
        assert_eq!(ascended, descended, "{what} (scaled: {scaled})");
        let minimized = run_signed(optim(false), LR, scaled, 1.0);
        assert_ne!(
            ascended, minimized,
            "{what} (scaled: {scaled}): maximize did nothing"
        );
    }
}

#[test]
fn maximizing_is_minimizing_the_negated_gradient() {
    let _s = serial();
    let int8 = MomentStorage::Int8 {
        block: 256,
        map: QuantMap::Dynamic,
        min_numel: 1,
    };
    let clipping = Some(GradientClippingConfig::Norm(0.05));
    for (what, config) in [
        ("AdamW", FusedAdamWConfig::new().with_weight_decay(0.1)),
        (
            "Adam, L2 and AMSGrad",
            FusedAdamWConfig::adam()
                .with_weight_decay(0.1)
                .with_amsgrad(true),
        ),
        (
            "cautious decay",
            FusedAdamWConfig::new()
                .with_weight_decay(0.1)
                .with_cautious_weight_decay(true),
        ),
        ("8-bit moments", FusedAdamWConfig::new().with_moments(int8)),
        (
            "clipping",
            FusedAdamWConfig::new().with_grad_clipping(clipping.clone()),
        ),
    ] {
        check(what, |maximize| {
            config
                .clone()
                .with_maximize(maximize)
                .init::<B, Mlp<B>>()
                .unwrap()
        });
        check(&format!("{what}, in Burn's adaptor"), |maximize| {
            let fused = config.clone().with_maximize(maximize).init::<B, Mlp<B>>();
            OptimizerAdaptor::<_, Mlp<B>, B>::from(fused.unwrap().optim().clone())
        });
    }
    let sgd = FusedSgdConfig::new()
        .with_momentum(0.9)
        .with_nesterov(true)
        .with_weight_decay(0.1);
    check("SGD", |maximize| {
        sgd.clone()
            .with_maximize(maximize)
            .init::<B, Mlp<B>>()
            .unwrap()
    });
}
