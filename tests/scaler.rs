//! The loss scaler: config validation, the state machine, the scale trajectory, skipped
//! steps that change nothing, zero host reads with a fused optimizer, save and resume.

mod common;

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::module::{Module, ParamId};
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{AdamConfig, GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::optim::{FusedAdamW, FusedAdamWConfig, FusedSgdConfig, ScaledAdaptor};
use burn_amp::scaler::{GradScaler, GradScalerConfig, GradScalerRecord, ScalerError, Stage};
use burn_amp::{Amp, Precision, autocast, host_reads};
use common::models::Mlp;
use common::tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};

type B = Amp<Autodiff<Flex>>;
type Inner = <B as AutodiffBackend>::InnerBackend;

fn small_config() -> TinyLmConfig {
    TinyLmConfig::new()
        .with_d_model(16)
        .with_d_ff(32)
        .with_n_layers(1)
        .with_dropout(0.0)
}

#[test]
fn invalid_configs_are_named_errors() {
    let device = Default::default();
    let cases: [(GradScalerConfig, &str); 7] = [
        (
            GradScalerConfig::new().with_growth_factor(1.0),
            "growth_factor",
        ),
        (
            GradScalerConfig::new().with_growth_factor(0.5),
            "growth_factor",
        ),
        (
            GradScalerConfig::new().with_backoff_factor(1.0),
            "backoff_factor",
        ),
        (
            GradScalerConfig::new().with_backoff_factor(0.0),
            "backoff_factor",
        ),
        (
            GradScalerConfig::new().with_growth_interval(0),
            "growth_interval",
        ),
        (
            GradScalerConfig::new().with_init_scale(f32::INFINITY),
            "init_scale",
        ),
        // Counted in f32 on the device: past 2^24, `n + 1 == n` and the scale never grows.
        (
            GradScalerConfig::new().with_growth_interval((1 << 24) + 1),
            "growth_interval",
        ),
    ];
    for (config, field) in cases {
        match config.init::<B>(&device, Precision::F16) {
            Err(ScalerError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!(
                "{field}: expected InvalidConfig, got {:?}",
                other.map(|_| ())
            ),
        }
    }
    assert!(
        GradScalerConfig::new()
            .with_init_scale(f32::NAN)
            .validate()
            .is_err()
    );
    assert!(
        GradScalerConfig::new()
            .with_hysteresis(0)
            .validate()
            .is_err()
    );
    let msg = GradScalerConfig::new()
        .with_backoff_factor(2.0)
        .validate()
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("backoff_factor") && msg.contains("(0, 1)"),
        "{msg}"
    );
}

/// One parameter stored in f16 (a model kept in half precision).
#[derive(Module, Debug)]
struct HalfParam<B: Backend> {
    w: Param<Tensor<B, 1>>,
}

/// Under `Autodiff<Amp<B>>` an f16 parameter read by an f32 op (a norm's weight) gets an f32
/// gradient, still multiplied by the loss scale. Cast to f16 before unscaling, a true gradient
/// of 2 at the initial scale (131072) was inf: a skipped step and a halved scale for an
/// overflow that unscaling removes. Each path unscales in f32 first: the scaler's step with a
/// Burn optimizer, its `unscale` before one, and a fused optimizer that clips.
#[test]
fn an_f32_gradient_of_an_f16_parameter_is_unscaled_before_its_cast() {
    let device: <B as burn::tensor::backend::BackendTypes>::Device = Default::default();
    let scale = 65536.0f32;
    let true_grad = [2.0f32, -3.0, 0.5];
    let model = || HalfParam::<B> {
        w: Param::from_tensor(Tensor::zeros([3], (&device, DType::F16))),
    };
    let scaled_grads = |m: &HalfParam<B>| {
        let mut grads = GradientsParams::new();
        let g = Tensor::<Inner, 1>::from_floats(true_grad.map(|v| v * scale), &device);
        grads.register::<Inner, 1>(m.w.id, g);
        grads
    };
    for path in ["step", "unscale, then step", "fused with clipping"] {
        let mut scaler = GradScalerConfig::new()
            .init::<B>(&device, Precision::F16)
            .unwrap();
        let (m, mut grads) = {
            let m = model();
            let g = scaled_grads(&m);
            (m, g)
        };
        let m = match path {
            "step" => {
                let mut optim = SgdConfig::new().init::<B, HalfParam<B>>();
                scaler.step(&mut optim, 1.0, m, grads).unwrap().0
            }
            "unscale, then step" => {
                scaler.unscale(&m, &mut grads).unwrap();
                let g = grads.get::<Inner, 1>(m.w.id).unwrap();
                assert_eq!(
                    g.dtype(),
                    DType::F16,
                    "unscaled, then in the parameter's dtype"
                );
                assert_eq!(
                    g.cast(DType::F32).into_data().to_vec::<f32>().unwrap(),
                    true_grad
                );
                let mut optim = SgdConfig::new().init::<B, HalfParam<B>>();
                scaler.step(&mut optim, 1.0, m, grads).unwrap().0
            }
            _ => {
                let mut optim = FusedSgdConfig::new()
                    .with_grad_clipping(Some(GradientClippingConfig::Norm(1e6)))
                    .init::<B, HalfParam<B>>()
                    .unwrap();
                scaler.step(&mut optim, 1.0, m, grads).unwrap().0
            }
        };
        scaler.update().unwrap();
        assert_eq!(
            scaler.record().scale,
            scale,
            "{path}: no overflow, no back-off"
        );
        let w = m.w.val();
        assert_eq!(w.dtype(), DType::F16, "{path}");
        let w = w.cast(DType::F32).into_data().to_vec::<f32>().unwrap();
        assert_eq!(w, true_grad.map(|g| -g), "{path}: one SGD step of lr 1");
    }
}

/// A step that saw no gradient (the module all frozen, or not in this backward) is no
/// evidence: the scale neither grows nor backs off (PyTorch refuses such a step).
#[test]
fn a_step_without_gradients_does_not_grow_the_scale() {
    let device = Default::default();
    let mut scaler = GradScalerConfig::new()
        .with_growth_interval(1)
        .init::<B>(&device, Precision::F16)
        .unwrap();
    let model = HalfParam::<B> {
        w: Param::from_tensor(Tensor::zeros([3], &device)),
    };
    let mut optim = SgdConfig::new().init::<B, HalfParam<B>>();
    let model = scaler
        .step(&mut optim, 1.0, model, GradientsParams::new())
        .unwrap()
        .0;
    scaler.update().unwrap();
    assert_eq!(
        scaler.record().scale,
        65536.0,
        "no gradient checked: the scale stays"
    );
    // One checked clean step grows it (growth_interval 1).
    let mut grads = GradientsParams::new();
    grads.register::<Inner, 1>(model.w.id, Tensor::ones([3], &device));
    scaler.step(&mut optim, 1.0, model, grads).unwrap();
    scaler.update().unwrap();
    assert_eq!(scaler.record().scale, 131072.0);
}

/// The gradients of one fixed batch.
fn grads_of(model: &TinyLm<B>) -> GradientsParams {
    let _g = autocast(Precision::F16);
    let device = Default::default();
    let config = small_config();
    let (x, y) = ReversalTask::new(config.vocab, config.seq_len, 3).batch::<B>(4, &device);
    GradientsParams::from_grads(model.loss(x, y).backward(), model)
}

/// One tiny model, one step's gradients.
fn model_and_grads(
    device: &<B as burn::tensor::backend::BackendTypes>::Device,
) -> (TinyLm<B>, GradientsParams) {
    B::seed(device, 1);
    let model = small_config().init::<B>(device);
    let grads = grads_of(&model);
    (model, grads)
}

#[test]
fn misuse_is_a_named_error() {
    let device = Default::default();
    let (model, grads) = model_and_grads(&device);
    let mut scaler = GradScalerConfig::new()
        .init::<B>(&device, Precision::F16)
        .unwrap();
    let mut optim = AdamConfig::new().init::<B, TinyLm<B>>();

    assert_eq!(scaler.update(), Err(ScalerError::UpdateBeforeStep));
    let mut g = grads;
    scaler.unscale(&model, &mut g).unwrap();
    assert_eq!(scaler.stage(), Stage::Unscaled);
    assert_eq!(
        scaler.unscale(&model, &mut g),
        Err(ScalerError::UnscaleTwice)
    );
    let (model, _) = scaler.step(&mut optim, 1e-3, model, g).unwrap();
    assert_eq!(scaler.stage(), Stage::Stepped);
    let mut g2 = grads_of(&model);
    assert_eq!(
        scaler.unscale(&model, &mut g2),
        Err(ScalerError::UnscaleAfterStep)
    );
    assert!(matches!(
        scaler.step(&mut optim, 1e-3, model.clone(), g2),
        Err(ScalerError::StepTwice)
    ));
    scaler.update().unwrap();
    assert_eq!(scaler.stage(), Stage::Ready);
}

/// The semantics, written out on the host: the reference for the device update.
#[derive(Debug, Clone, Copy, PartialEq)]
struct HostScaler {
    scale: f32,
    tracker: u32,
    hysteresis_left: u32,
    floor_overflows: u32,
}

impl HostScaler {
    fn new(c: &GradScalerConfig) -> Self {
        Self {
            scale: c.init_scale,
            tracker: 0,
            hysteresis_left: c.hysteresis,
            floor_overflows: 0,
        }
    }

    fn step(&mut self, overflow: bool, c: &GradScalerConfig) {
        if overflow {
            // Overflows in a row with the scale already at the floor.
            self.floor_overflows = if self.scale <= c.min_scale {
                self.floor_overflows + 1
            } else {
                0
            };
            self.tracker = 0;
            if self.hysteresis_left <= 1 {
                self.scale = (self.scale * c.backoff_factor).max(c.min_scale);
            } else {
                self.hysteresis_left -= 1;
            }
        } else {
            self.floor_overflows = 0;
            self.tracker += 1;
            if self.tracker >= c.growth_interval {
                // A growth past max_scale (or to inf) is refused, as PyTorch refuses a
                // non-finite one: the scale stays a power of two.
                let grown = self.scale * c.growth_factor;
                if grown <= c.max_scale {
                    self.scale = grown;
                }
                self.tracker = 0;
                self.hysteresis_left = c.hysteresis;
            }
        }
    }

    fn as_record(&self) -> (f32, u32, u32, u32) {
        (
            self.scale,
            self.tracker,
            self.hysteresis_left,
            self.floor_overflows,
        )
    }
}

fn as_tuple(r: &GradScalerRecord) -> (f32, u32, u32, u32) {
    (
        r.scale,
        r.growth_tracker as u32,
        r.hysteresis_left as u32,
        r.floor_overflows as u32,
    )
}

/// Multiplies one parameter's gradient by NaN or inf.
fn poison(grads: &mut GradientsParams, id: ParamId, value: f32) {
    let g = grads.remove::<Inner, 2>(id).expect("a 2-d gradient");
    let bad = g
        .clone()
        .slice([0..1, 0..1])
        .mul_scalar(0.0)
        .add_scalar(value);
    grads.register::<Inner, 2>(id, g.slice_assign([0..1, 0..1], bad));
}

/// Runs `script` (true: the step's gradients overflow) and checks the device state against
/// the host model after every update.
fn follow_script(config: &GradScalerConfig, script: &[bool]) -> GradScalerRecord {
    let device = Default::default();
    let (mut model, _) = model_and_grads(&device);
    let mut scaler = config.init::<B>(&device, Precision::F16).unwrap();
    let mut optim = FusedSgdConfig::new().init::<B, TinyLm<B>>().unwrap();
    let mut host = HostScaler::new(config);
    let head = model.head.weight.id;
    for (i, &overflow) in script.iter().enumerate() {
        let mut grads = grads_of(&model);
        if overflow {
            poison(
                &mut grads,
                head,
                if i % 2 == 0 {
                    f32::NAN
                } else {
                    f32::NEG_INFINITY
                },
            );
        }
        let (m, report) = scaler.step(&mut optim, 1e-3, model, grads).unwrap();
        model = m;
        assert_eq!(report.skipped(), overflow, "step {i}");
        scaler.update().unwrap();
        host.step(overflow, config);
        assert_eq!(
            as_tuple(&scaler.record()),
            host.as_record(),
            "step {i} ({config:?})"
        );
    }
    scaler.record()
}

fn trajectory(hysteresis: u32) {
    let config = GradScalerConfig::new()
        .with_init_scale(1024.0)
        .with_growth_interval(3)
        .with_hysteresis(hysteresis)
        .with_min_scale(64.0)
        .with_max_scale(4096.0);
    let script = [
        false, true, false, false, false, false, false, false, true, true, true, true, true, true,
        false, false, false, false, false, false, false, false, false, false, false, true,
    ];
    follow_script(&config, &script);
}

#[test]
fn scale_trajectory_follows_the_semantics() {
    trajectory(1);
}

#[test]
fn scale_trajectory_with_hysteresis() {
    trajectory(3);
}

/// A growth past `max_scale` is refused: the scale stays where it was (a power of two),
/// instead of being clamped to `max_scale` (which 3000 and `f32::MAX` are not).
#[test]
fn growth_past_max_scale_keeps_the_scale() {
    let config = GradScalerConfig::new()
        .with_init_scale(1024.0)
        .with_growth_interval(1)
        .with_max_scale(3000.0);
    let end = follow_script(&config, &[false; 4]);
    assert_eq!(
        end.scale, 2048.0,
        "1024 -> 2048, then 4096 > 3000 is refused"
    );

    // The default ceiling only refuses an infinite scale, as PyTorch does.
    let config = GradScalerConfig::new()
        .with_init_scale(2f32.powi(127))
        .with_growth_interval(1);
    let end = follow_script(&config, &[false; 2]);
    assert_eq!(
        end.scale,
        2f32.powi(127),
        "2^128 is inf: refused, not f32::MAX"
    );
}

/// `floor_overflows` counts overflows in a row at the floor: a clean step in between resets
/// it, so an occasional overflow at the floor never adds up to a false alarm.
#[test]
fn floor_overflows_count_only_overflows_in_a_row() {
    let config = GradScalerConfig::new()
        .with_init_scale(1.0)
        .with_min_scale(1.0)
        .with_max_floor_overflows(3);
    let script = [true, true, false, true, true, false, true];
    let end = follow_script(&config, &script);
    assert_eq!(end.floor_overflows, 1.0);
}

#[test]
fn stuck_at_the_floor_is_reported() {
    let device = Default::default();
    let config = GradScalerConfig::new()
        .with_init_scale(4.0)
        .with_min_scale(1.0)
        .with_max_floor_overflows(3);
    let (mut model, _) = model_and_grads(&device);
    let mut scaler = config.init::<B>(&device, Precision::F16).unwrap();
    let mut optim = FusedSgdConfig::new().init::<B, TinyLm<B>>().unwrap();
    let head = model.head.weight.id;
    for _ in 0..6 {
        let mut grads = grads_of(&model);
        poison(&mut grads, head, f32::INFINITY);
        model = scaler.step(&mut optim, 1e-3, model, grads).unwrap().0;
        scaler.update().unwrap();
    }
    // 4 -> 2 -> 1, then overflows at the floor: 4 of them >= 3.
    let err = scaler.check().unwrap_err();
    assert!(
        matches!(err, ScalerError::StuckAtMinScale { overflows: 4, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("Precision::Bf16"));
}

fn params_of(model: &TinyLm<B>) -> Vec<f32> {
    let mut out = Vec::new();
    for p in [&model.tokens.weight, &model.positions.weight] {
        out.extend(p.val().into_data().to_vec::<f32>().unwrap());
    }
    out.extend(model.head.weight.val().into_data().to_vec::<f32>().unwrap());
    out
}

/// An f16 run with poisoned gradients at chosen steps: exactly those are skipped, with the
/// parameters unchanged bit for bit, and the run still learns.
fn poisoned_run(fused: bool) {
    common::big_stack(move || {
        let device = Default::default();
        let _g = autocast(Precision::F16);
        B::seed(&device, 5);
        let config = small_config();
        let mut model = config.init::<B>(&device);
        let mut task = ReversalTask::new(config.vocab, config.seq_len, 9);
        let mut scaler = GradScalerConfig::new()
            .with_growth_interval(50)
            .init::<B>(&device, Precision::F16)
            .unwrap();
        let mut adamw = FusedAdamWConfig::new()
            .with_weight_decay(0.0)
            .init::<B, TinyLm<B>>()
            .unwrap();
        let mut adam = AdamConfig::new().init::<B, TinyLm<B>>();
        let poisoned = [3usize, 40, 41, 150];
        let mut skipped = Vec::new();
        let (mut first, mut last) = (0.0, 0.0);
        for step in 0..250 {
            let (x, y) = task.batch::<B>(32, &device);
            let loss = model.loss(x, y);
            let value: f32 = loss.clone().into_scalar().elem();
            if step == 0 {
                first = value;
            }
            last = value;
            let mut grads = GradientsParams::from_grads(scaler.scale(loss).backward(), &model);
            if poisoned.contains(&step) {
                poison(&mut grads, model.head.weight.id, f32::NAN);
            }
            let before = poisoned.contains(&step).then(|| params_of(&model));
            let (m, report) = if fused {
                scaler.step(&mut adamw, 3e-3, model, grads).unwrap()
            } else {
                scaler.step(&mut adam, 3e-3, model, grads).unwrap()
            };
            model = m;
            if report.skipped() {
                skipped.push(step);
            }
            if let Some(before) = before {
                let after = params_of(&model);
                assert!(
                    before
                        .iter()
                        .zip(&after)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "step {step}: a skipped step changed the parameters"
                );
            }
            scaler.update().unwrap();
        }
        assert_eq!(skipped, poisoned, "exactly the poisoned steps are skipped");
        assert!(
            last < 0.5 * first,
            "the run learns despite the skips: {first} -> {last}"
        );
    });
}

#[test]
fn poisoned_steps_are_skipped_fused() {
    poisoned_run(true);
}

#[test]
fn poisoned_steps_are_skipped_with_any_optimizer() {
    poisoned_run(false);
}

#[test]
fn a_fused_scaled_step_reads_nothing_back() {
    common::big_stack(|| {
        let device = Default::default();
        let _g = autocast(Precision::F16);
        let config = small_config();
        let mut model = config.init::<B>(&device);
        let mut task = ReversalTask::new(config.vocab, config.seq_len, 2);
        let mut scaler = GradScalerConfig::new()
            .init::<B>(&device, Precision::F16)
            .unwrap();
        let mut fused = FusedAdamWConfig::new().init::<B, TinyLm<B>>().unwrap();
        let mut adam = AdamConfig::new().init::<B, TinyLm<B>>();
        let mut step = |model: TinyLm<B>, use_fused: bool| {
            let (x, y) = task.batch::<B>(8, &device);
            let reads = host_reads();
            let loss = model.loss(x, y);
            let grads = GradientsParams::from_grads(scaler.scale(loss).backward(), &model);
            let (model, _) = if use_fused {
                scaler.step(&mut fused, 1e-3, model, grads).unwrap()
            } else {
                scaler.step(&mut adam, 1e-3, model, grads).unwrap()
            };
            scaler.update().unwrap();
            (model, host_reads() - reads)
        };
        for _ in 0..3 {
            let (m, reads) = step(model, true);
            model = m;
            assert_eq!(reads, 0, "a fused scaled step read from the device");
        }
        let (_, reads) = step(model, false);
        assert_eq!(reads, 1, "the non-fused path reads found_inf once");
    });
}

#[test]
fn bf16_and_f32_pass_through() {
    let device = Default::default();
    for precision in [Precision::Bf16, Precision::F32] {
        let (model, grads) = model_and_grads(&device);
        let mut scaler = GradScalerConfig::new()
            .init::<B>(&device, precision)
            .unwrap();
        assert!(!scaler.is_enabled());
        let loss = Tensor::<B, 1>::from_floats([2.5], &device);
        let scaled: f32 = scaler.scale(loss).into_scalar().elem();
        assert_eq!(scaled, 2.5);
        let mut optim = FusedAdamWConfig::new().init::<B, TinyLm<B>>().unwrap();
        let (_, report) = scaler.step(&mut optim, 1e-3, model, grads).unwrap();
        assert!(!report.skipped());
        scaler.update().unwrap();
    }
}

/// A batch fixed by the step number: the class is the argmax of the first 4 features.
fn mlp_batch(
    step: usize,
    device: &<B as burn::tensor::backend::BackendTypes>::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let mut task = ReversalTask::new(97, 8, step as u64);
    let (tokens, _) = task.batch::<B>(16, device);
    let x = tokens.float().div_scalar(48.0).sub_scalar(1.0);
    let y = x.clone().slice([0..16, 0..4]).argmax(1).squeeze_dim::<1>(1);
    (x, y)
}

/// Runs `steps` scaled steps; NaN poisons step 7 (so the scale moves).
fn run(
    model: Mlp<B>,
    scaler: &mut GradScaler<B>,
    optim: &mut ScaledAdaptor<FusedAdamW, Mlp<B>, B>,
    steps: std::ops::Range<usize>,
) -> Mlp<B> {
    let device = Default::default();
    let mut model = model;
    for step in steps {
        let (x, y) = mlp_batch(step, &device);
        // A plain chain (no tensor feeding several consumers), so that autodiff's order of
        // gradient accumulation cannot vary between runs: what is compared is the saved state.
        let loss = model.loss(x, y);
        let mut grads = GradientsParams::from_grads(scaler.scale(loss).backward(), &model);
        if step == 7 {
            let id = model.l2.weight.id;
            let g = grads.remove::<Inner, 2>(id).unwrap();
            grads.register::<Inner, 2>(id, g.mul_scalar(f32::NAN));
        }
        model = scaler.step(optim, 1e-2, model, grads).unwrap().0;
        scaler.update().unwrap();
    }
    model
}

#[test]
fn save_and_resume_continue_identically() {
    common::big_stack(|| {
        let device = Default::default();
        let _g = autocast(Precision::F16);
        B::seed(&device, 3);
        let init = Mlp::<B>::new(8, 32, 4, &device);
        let scaler_config = GradScalerConfig::new().with_growth_interval(4);

        // Uninterrupted.
        let mut scaler = scaler_config.init::<B>(&device, Precision::F16).unwrap();
        let adamw = || FusedAdamWConfig::new().init::<B, Mlp<B>>().unwrap();
        let mut optim = adamw();
        let straight = run(init.clone(), &mut scaler, &mut optim, 0..20);
        let straight_scaler = scaler.record();

        // Stopped after step 10, saved to bytes, loaded into fresh objects.
        let mut scaler = scaler_config.init::<B>(&device, Precision::F16).unwrap();
        let mut optim = adamw();
        let half = run(init.clone(), &mut scaler, &mut optim, 0..10);
        let model_bytes = common::save::<B, _>(half.into_record());
        let scaler_bytes = common::save::<B, _>(scaler.record());
        let optim_bytes = common::save::<B, _>(Optimizer::<Mlp<B>, B>::to_record(&optim));

        let model =
            Mlp::<B>::new(8, 32, 4, &device).load_record(common::load(model_bytes, &device));
        let scaler_record: GradScalerRecord = common::load::<B, _>(scaler_bytes, &device);
        let mut scaler = scaler_config
            .init::<B>(&device, Precision::F16)
            .unwrap()
            .load_record(scaler_record.clone());
        let mut optim =
            Optimizer::<Mlp<B>, B>::load_record(adamw(), common::load(optim_bytes, &device));
        assert_eq!(scaler.record(), scaler_record);
        let resumed = run(model, &mut scaler, &mut optim, 10..20);

        assert_eq!(
            straight.weight_bits(),
            resumed.weight_bits(),
            "resumed run differs"
        );
        assert_eq!(straight_scaler, scaler.record(), "scaler state differs");
        // The poisoned step moved the scale: the trajectory was really exercised.
        assert!(straight_scaler.scale != 65536.0);
    });
}
