//! A run saved with Burn's `AdamW`, `Adam` or `Sgd` goes on with the fused optimizer from the
//! converted record (`burn_amp::optim::fused_record`).

use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, Optimizer, SgdConfig};
use burn_amp::optim::{FusedAdamWConfig, FusedSgdConfig, fused_record};
use burn_amp::{Precision, autocast};

use super::{B, Mlp, model, params, serial, step};

/// Five steps of Burn's optimizer, its record converted; then four more steps each of Burn's
/// optimizer, the fused one from the converted record, and the fused one from nothing. The
/// resumed fused run follows Burn's within f32 rounding (`1e-6` of the value, 1 where
/// smaller: 1.8e-7, 1.9e-7 and 0 measured); the fresh one is off by far more, so the
/// moments, the maximum, the velocities and the step counts were carried.
fn resumes_like_burn<OB, OF>(
    what: &str,
    burn: impl Fn() -> OB,
    fused: impl Fn() -> OF,
    convert: impl Fn(OB::Record) -> OF::Record,
) where
    OB: Optimizer<Mlp<B>, B>,
    OF: Optimizer<Mlp<B>, B>,
{
    let _g = autocast(Precision::F32);
    let device = Default::default();
    let mut started = model(&device);
    let mut burn_optim = burn();
    for i in 0..5 {
        started = step(started, &mut burn_optim, i, false);
    }
    let mut resumed_optim = fused().load_record(convert(burn_optim.to_record()));
    let mut fresh_optim = fused();
    let (mut by_burn, mut resumed, mut fresh) = (started.clone(), started.clone(), started);
    for i in 5..9 {
        by_burn = step(by_burn, &mut burn_optim, i, false);
        resumed = step(resumed, &mut resumed_optim, i, false);
        fresh = step(fresh, &mut fresh_optim, i, false);
    }
    let off = |got: &[f32], want: &[f32]| {
        got.iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs() / w.abs().max(1.0))
            .fold(0f32, f32::max)
    };
    let want = params::<B, _>(&by_burn);
    let (resumed, fresh) = (params::<B, _>(&resumed), params::<B, _>(&fresh));
    let (resumed_off, fresh_off) = (off(&resumed, &want), off(&fresh, &want));
    eprintln!("{what}: resumed {resumed_off:e}, fresh {fresh_off:e} off Burn's run");
    assert!(
        resumed_off <= 1e-6,
        "{what}: the resumed fused run is {resumed_off} off"
    );
    assert!(
        fresh_off > 1e-3,
        "{what}: a fresh state is only {fresh_off} off"
    );
}

#[test]
fn burn_adamw_adam_and_sgd_records_resume_in_the_fused_optimizers() {
    let _serial = serial();
    let adamw = AdamWConfig::new()
        .with_epsilon(1e-8)
        .with_weight_decay(0.05)
        .with_amsgrad(true);
    let fused_adamw = FusedAdamWConfig::new()
        .with_epsilon(1e-8)
        .with_weight_decay(0.05)
        .with_amsgrad(true);
    resumes_like_burn(
        "AdamW with AMSGrad",
        || adamw.init::<B, Mlp<B>>(),
        || fused_adamw.init::<B, Mlp<B>>().expect("a valid config"),
        fused_record,
    );
    let adam = AdamConfig::new()
        .with_epsilon(1e-8)
        .with_weight_decay(Some(WeightDecayConfig::new(0.05)));
    let fused_adam = FusedAdamWConfig::adam()
        .with_epsilon(1e-8)
        .with_weight_decay(0.05);
    resumes_like_burn(
        "Adam with an L2 penalty",
        || adam.init::<B, Mlp<B>>(),
        || fused_adam.init::<B, Mlp<B>>().expect("a valid config"),
        fused_record,
    );
    let sgd = SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_dampening(0.1)))
        .with_weight_decay(Some(WeightDecayConfig::new(0.05)));
    let fused_sgd = FusedSgdConfig::new()
        .with_momentum(0.9)
        .with_dampening(0.1)
        .with_weight_decay(0.05);
    resumes_like_burn(
        "SGD with momentum",
        || sgd.init::<B, Mlp<B>>(),
        || fused_sgd.init::<B, Mlp<B>>().expect("a valid config"),
        fused_record,
    );
}
