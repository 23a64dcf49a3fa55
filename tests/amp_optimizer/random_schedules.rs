//! Random f16 training schedules through the front door (`AmpOptimizer` around
//! `GradientAccumulation` around AdamW, fused or Burn's), against the documented semantics
//! written out here on the host: the mean of a window's micro-batches (a parameter missing
//! from some counts as zero there, one missing from all is not stepped), the window skipped
//! whole when any micro-batch overflowed, the global-norm clip of the unscaled mean, AdamW
//! (with AMSGrad, cautious weight decay, or as Adam with an L2 penalty, each drawn) or SGD
//! (momentum, dampening, Nesterov, L2 weight decay, drawn), the fused ones with or without
//! weight decay of the bias (`weight_decay_min_rank`), and PyTorch's scale update with
//! DeepSpeed's hysteresis. The runs stop and resume from
//! saved records at random micro-steps, mid-window included.
//!
//! The loss is `Σ w ⊙ tw + Σ b ⊙ tb` with fixed targets, so a micro-batch's gradients are its
//! targets times the loss scale (exact: a power of two), and the host model sees exactly
//! what the device does; a poisoned target puts NaN or ±inf into them. Parameters are
//! compared after every micro-step (f32 arithmetic in another order: 1e-6 relative, where
//! 1.8e-7 was measured and 1e-4 of the update's size is caught), the scale and the skipped
//! steps exactly.

use burn::module::{Module, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    Adam, AdamConfig, AdamW, AdamWConfig, GradientsParams, Optimizer, Sgd, SgdConfig,
};
use burn::prelude::*;
use burn_amp::accumulate::GradientAccumulationConfig;
use burn_amp::optim::{FusedAdamWConfig, FusedSgdConfig};
use burn_amp::scaler::GradScalerConfig;
use burn_amp::scaler::ScaledStep;
use burn_amp::{AmpOptimizer, GradientAccumulation, Precision, autocast};

use super::common::Rng;
use super::{B, serial};

const ROWS: usize = 3;
const COLS: usize = 4;
const LR: f32 = 1e-2;
const BETA_1: f32 = 0.9;
const BETA_2: f32 = 0.999;
const EPSILON: f32 = 1e-8;
const WEIGHT_DECAY: f32 = 0.01;

#[derive(Module, Debug)]
struct Pair<B: Backend> {
    w: Param<Tensor<B, 2>>,
    b: Param<Tensor<B, 1>>,
}

impl<B: Backend> Pair<B> {
    fn new(w: &[f32], b: &[f32], device: &B::Device) -> Self {
        Self {
            w: Param::from_tensor(Tensor::from_data(
                TensorData::new(w.to_vec(), [ROWS, COLS]),
                device,
            )),
            b: Param::from_tensor(Tensor::from_data(
                TensorData::new(b.to_vec(), [COLS]),
                device,
            )),
        }
    }

    fn values(&self) -> [Vec<f32>; 2] {
        [
            self.w.val().into_data().to_vec().unwrap(),
            self.b.val().into_data().to_vec().unwrap(),
        ]
    }
}

/// One micro-batch: the targets (`None`: the bias gets no gradient), and whether the run is
/// saved and resumed after it.
#[derive(Debug, Clone)]
struct Micro {
    tw: Vec<f32>,
    tb: Option<Vec<f32>>,
    resume_after: bool,
}

#[derive(Debug, Clone)]
struct Schedule {
    seed: u64,
    fused: bool,
    /// The optimizer straight in `AmpOptimizer`, no accumulation wrapper (one micro-batch per
    /// window, no clipping).
    direct: bool,
    micro_batches: usize,
    max_grad_norm: Option<f32>,
    init_scale: f32,
    growth_interval: u32,
    hysteresis: u32,
    amsgrad: bool,
    cautious: bool,
    /// Adam: the weight decay an L2 penalty on the gradient (never cautious).
    adam: bool,
    /// SGD in place of Adam(W).
    sgd: Option<SgdDraw>,
    /// No weight decay for the bias (`weight_decay_min_rank` 2; fused optimizers only).
    matrices_only: bool,
    w: Vec<f32>,
    b: Vec<f32>,
    micros: Vec<Micro>,
}

impl Schedule {
    fn draw(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        // Targets away from 0, on the bf16 grid: sums of a few stay well conditioned.
        let target = |rng: &mut Rng| {
            let magnitude = 0.125 + 0.875 * (rng.unit() + 1.0) / 2.0;
            let sign = if rng.below(2) == 0 { -1.0 } else { 1.0 };
            half::bf16::from_f32(sign * magnitude).to_f32()
        };
        let direct = rng.below(6) == 0;
        let micro_batches = if direct { 1 } else { 1 + rng.below(4) };
        let windows = 3 + rng.below(6);
        let micros = (0..micro_batches * windows)
            .map(|_| {
                let mut tw: Vec<f32> = (0..ROWS * COLS).map(|_| target(&mut rng)).collect();
                if rng.below(7) == 0 {
                    tw[rng.below(ROWS * COLS)] =
                        [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.below(3)];
                }
                let tb = (rng.below(5) != 0).then(|| (0..COLS).map(|_| target(&mut rng)).collect());
                Micro {
                    tw,
                    tb,
                    resume_after: rng.below(8) == 0,
                }
            })
            .collect();
        // From always clipping to never.
        let max_grad_norm = match direct {
            true => None,
            false => [None, Some(0.05), Some(0.5), Some(5.0)][rng.below(4)],
        };
        let mut s = Self {
            seed,
            fused: rng.below(2) == 0,
            direct,
            micro_batches,
            max_grad_norm,
            init_scale: 2f32.powi(4 + rng.below(12) as i32),
            growth_interval: 1 + rng.below(3) as u32,
            hysteresis: 1 + rng.below(2) as u32,
            w: (0..ROWS * COLS).map(|_| rng.unit()).collect(),
            b: (0..COLS).map(|_| rng.unit()).collect(),
            micros,
            // Drawn last: the schedules drawn before these options came stay as they were.
            amsgrad: rng.below(2) == 0,
            cautious: rng.below(2) == 0,
            adam: rng.below(3) == 0,
            sgd: (rng.below(3) == 0).then(|| SgdDraw::draw(&mut rng)),
            matrices_only: rng.below(3) == 0,
        };
        s.matrices_only &= s.fused;
        s.cautious &= !s.adam;
        s
    }

    fn scaler(&self) -> GradScalerConfig {
        GradScalerConfig::new()
            .with_init_scale(self.init_scale)
            .with_growth_interval(self.growth_interval)
            .with_hysteresis(self.hysteresis)
    }

    fn accumulation(&self) -> GradientAccumulationConfig {
        GradientAccumulationConfig::new(self.micro_batches).with_max_grad_norm(self.max_grad_norm)
    }
}

/// SGD's options (PyTorch's and Burn's semantics).
#[derive(Debug, Clone, Copy)]
struct SgdDraw {
    momentum: f32,
    dampening: f32,
    nesterov: bool,
    weight_decay: f32,
}

impl SgdDraw {
    fn draw(rng: &mut Rng) -> Self {
        let momentum = [0.0, 0.9][rng.below(2)];
        let nesterov = momentum > 0.0 && rng.below(2) == 0;
        // PyTorch's Nesterov needs no dampening (FusedSgd refuses it).
        let dampening = if nesterov {
            0.0
        } else {
            [0.0, 0.5][rng.below(2)]
        };
        let weight_decay = [0.0, WEIGHT_DECAY][rng.below(2)];
        Self {
            momentum,
            dampening,
            nesterov,
            weight_decay,
        }
    }

    fn fused(self, min_rank: usize) -> FusedSgdConfig {
        FusedSgdConfig::new()
            .with_weight_decay_min_rank(min_rank)
            .with_momentum(self.momentum)
            .with_dampening(self.dampening)
            .with_nesterov(self.nesterov)
            .with_weight_decay(self.weight_decay)
    }

    fn burn(self) -> SgdConfig {
        let momentum = (self.momentum > 0.0).then_some(MomentumConfig {
            momentum: self.momentum as f64,
            dampening: self.dampening as f64,
            nesterov: self.nesterov,
        });
        let decay = (self.weight_decay > 0.0).then(|| WeightDecayConfig::new(self.weight_decay));
        SgdConfig::new()
            .with_momentum(momentum)
            .with_weight_decay(decay)
    }
}

/// AdamW's state of one parameter (SGD's velocity in `m`).
#[derive(Debug, Clone, Default)]
struct Moments {
    m: Vec<f32>,
    v: Vec<f32>,
    /// AMSGrad's maximum of `v`.
    v_max: Vec<f32>,
    steps: i32,
}

/// The documented semantics, on the host.
#[derive(Debug, Clone)]
struct Model {
    params: [Vec<f32>; 2],
    moments: [Moments; 2],
    /// The window's sums (`None`: no gradient yet).
    sums: [Option<Vec<f32>>; 2],
    micro: usize,
    scale: f32,
    tracker: u32,
    hysteresis_left: u32,
    skipped: u64,
    /// What the schedule exercised: windows clipped, overflows the hysteresis absorbed,
    /// windows with no gradient for the bias.
    clipped: u64,
    absorbed: u64,
    bias_unstepped: u64,
    /// Elements AMSGrad divided by an older, larger second moment; elements cautious weight
    /// decay left undecayed.
    amsgrad_mattered: u64,
    cautious_kept: u64,
    /// Steps of the bias without weight decay (`weight_decay_min_rank` 2).
    bias_undecayed: u64,
}

impl Model {
    fn new(s: &Schedule) -> Self {
        Self {
            params: [s.w.clone(), s.b.clone()],
            moments: Default::default(),
            sums: [None, None],
            micro: 0,
            scale: s.init_scale,
            tracker: 0,
            hysteresis_left: s.hysteresis,
            skipped: 0,
            clipped: 0,
            absorbed: 0,
            bias_unstepped: 0,
            amsgrad_mattered: 0,
            cautious_kept: 0,
            bias_undecayed: 0,
        }
    }

    fn micro_step(&mut self, s: &Schedule, micro: &Micro) {
        let weight = 1.0 / s.micro_batches as f32;
        for (sum, target) in self
            .sums
            .iter_mut()
            .zip([Some(&micro.tw), micro.tb.as_ref()])
        {
            let Some(target) = target else { continue };
            // The device's gradient is the target times the scale; the window adds it × 1/N.
            let added = target.iter().map(|t| (t * self.scale) * weight);
            *sum = Some(match sum.take() {
                None => added.collect(),
                Some(acc) => acc.iter().zip(added).map(|(a, g)| a + g).collect(),
            });
        }
        self.micro += 1;
        if self.micro < s.micro_batches {
            return;
        }
        self.micro = 0;
        let sums = core::mem::take(&mut self.sums);
        let overflow = sums.iter().flatten().flatten().any(|g| !g.is_finite());
        if overflow {
            self.skipped += 1;
            self.tracker = 0;
            if self.hysteresis_left <= 1 {
                self.scale = (self.scale * 0.5).max(1.0);
            } else {
                self.hysteresis_left -= 1;
                self.absorbed += 1;
            }
            return;
        }
        let inv_scale = 1.0 / self.scale;
        let mut grads: [Option<Vec<f32>>; 2] =
            sums.map(|sum| sum.map(|sum| sum.iter().map(|g| g * inv_scale).collect()));
        if let Some(max_norm) = s.max_grad_norm {
            let norm = grads
                .iter()
                .flatten()
                .flatten()
                .map(|g| g * g)
                .sum::<f32>()
                .sqrt();
            let coef = (max_norm / (norm + 1e-6)).min(1.0);
            self.clipped += u64::from(coef < 1.0);
            for g in grads.iter_mut().flatten().flat_map(|g| g.iter_mut()) {
                *g *= coef;
            }
        }
        self.bias_unstepped += u64::from(grads[1].is_none());
        let params = self.params.iter_mut().zip(&mut self.moments).zip(grads);
        for (index, ((param, moments), grad)) in params.enumerate() {
            let Some(grad) = grad else { continue };
            // Parameter 1 is the bias, of rank 1.
            let decays = !(s.matrices_only && index == 1);
            self.bias_undecayed += u64::from(!decays);
            if let Some(sgd) = s.sgd {
                let weight_decay = if decays { sgd.weight_decay } else { 0.0 };
                sgd_step(
                    SgdDraw {
                        weight_decay,
                        ..sgd
                    },
                    param,
                    moments,
                    &grad,
                );
            } else {
                let weight_decay = if decays { WEIGHT_DECAY } else { 0.0 };
                let (mattered, kept) = adamw(s, weight_decay, param, moments, &grad);
                self.amsgrad_mattered += mattered;
                self.cautious_kept += kept;
            }
        }
        self.tracker += 1;
        if self.tracker >= s.growth_interval {
            self.scale *= 2.0;
            self.tracker = 0;
            self.hysteresis_left = s.hysteresis;
        }
    }
}

/// One SGD step: the first applied one sets the velocity to the gradient.
fn sgd_step(sgd: SgdDraw, param: &mut [f32], state: &mut Moments, grad: &[f32]) {
    for i in 0..param.len() {
        let g = grad[i] + sgd.weight_decay * param[i];
        let mut d = g;
        if sgd.momentum > 0.0 {
            if state.steps == 0 {
                state.m.push(g);
            } else {
                state.m[i] = sgd.momentum * state.m[i] + (1.0 - sgd.dampening) * g;
            }
            d = match sgd.nesterov {
                true => g + sgd.momentum * state.m[i],
                false => state.m[i],
            };
        }
        param[i] -= LR * d;
    }
    state.steps += 1;
}

/// One AdamW step; returns how many elements AMSGrad's maximum and cautious weight decay
/// changed.
fn adamw(
    s: &Schedule,
    weight_decay: f32,
    param: &mut [f32],
    state: &mut Moments,
    grad: &[f32],
) -> (u64, u64) {
    if state.m.is_empty() {
        state.m = vec![0.0; param.len()];
        state.v = vec![0.0; param.len()];
        state.v_max = vec![0.0; param.len()];
    }
    state.steps += 1;
    let bc1 = 1.0 - BETA_1.powi(state.steps);
    let bc2 = 1.0 - BETA_2.powi(state.steps);
    let (mut mattered, mut kept) = (0, 0);
    for i in 0..param.len() {
        // Adam: the penalty joins the gradient; AdamW: the value decays below.
        let g = if s.adam {
            grad[i] + weight_decay * param[i]
        } else {
            grad[i]
        };
        state.m[i] = BETA_1 * state.m[i] + (1.0 - BETA_1) * g;
        state.v[i] = BETA_2 * state.v[i] + (1.0 - BETA_2) * g * g;
        let mut v = state.v[i];
        if s.amsgrad {
            state.v_max[i] = state.v_max[i].max(v);
            mattered += u64::from(state.v_max[i] > v);
            v = state.v_max[i];
        }
        let update = (state.m[i] / bc1) / ((v / bc2).sqrt() + EPSILON);
        // Cautious: no decay where the value and the update have opposite signs.
        let opposed = param[i] * state.m[i] < 0.0;
        kept += u64::from(s.cautious && opposed);
        if !(s.cautious && opposed || s.adam) {
            param[i] *= 1.0 - LR * weight_decay;
        }
        param[i] -= LR * update;
    }
    (mattered, kept)
}

/// The schedule on the device, checked against the model after every micro-step.
fn run<O>(s: &Schedule, inner: impl Fn() -> O) -> Model
where
    O: Optimizer<Pair<B>, B> + burn_amp::scaler::ScaledStep<Pair<B>, B>,
{
    let device = Default::default();
    let _g = autocast(Precision::F16);
    let make = || AmpOptimizer::new(inner(), s.scaler()).expect("a valid scaler config");
    let mut optim = make();
    let mut pair = Pair::<B>::new(&s.w, &s.b, &device);
    let mut model = Model::new(s);
    for (k, micro) in s.micros.iter().enumerate() {
        let target = |t: &[f32]| Tensor::<B, 1>::from_floats(t, &device);
        let tw = target(&micro.tw).reshape([ROWS, COLS]);
        let mut loss = (pair.w.val() * tw).sum();
        if let Some(tb) = &micro.tb {
            loss = loss + (pair.b.val() * target(tb)).sum();
        }
        let grads = GradientsParams::from_grads(loss.backward(), &pair);
        pair = optim.step(LR as f64, pair, grads);
        model.micro_step(s, micro);

        let what = || {
            format!(
                "schedule {} (fused {}, direct {}, N {}, clip {:?}, growth interval {}, \
                 hysteresis {}, amsgrad {}, cautious {}, adam {}, sgd {:?}, matrices only {}), \
                 after micro-step {k} {micro:?}",
                s.seed,
                s.fused,
                s.direct,
                s.micro_batches,
                s.max_grad_norm,
                s.growth_interval,
                s.hysteresis,
                s.amsgrad,
                s.cautious,
                s.adam,
                s.sgd,
                s.matrices_only
            )
        };
        for (got, want) in pair.values().iter().zip(&model.params) {
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                    "{}: parameter {g} where the semantics give {w}",
                    what()
                );
            }
        }
        assert_eq!(optim.scale(), model.scale, "{}: the loss scale", what());
        // The monitor counts since the start, resumes included (the counts are in the record).
        let snapshot = optim.monitor().snapshot();
        assert_eq!(
            snapshot.skipped_steps,
            model.skipped,
            "{}: skipped steps",
            what()
        );
        assert_eq!(
            snapshot.optimizer_steps,
            ((k + 1) / s.micro_batches) as u64,
            "{}: optimizer steps (windows ended)",
            what()
        );

        if micro.resume_after {
            let pair_bytes = super::common::save::<B, _>(pair.into_record());
            let optim_bytes = super::common::save::<B, _>(optim.to_record());
            drop(optim); // one AmpOptimizer per backend at a time
            optim = make().load_record(super::common::load::<B, _>(optim_bytes, &device));
            pair = Pair::new(&s.w, &s.b, &device)
                .load_record(super::common::load::<B, _>(pair_bytes, &device));
        }
    }
    model
}

fn accumulated<O>(s: &Schedule, inner: O) -> GradientAccumulation<O, B> {
    s.accumulation().init(inner).expect("a valid config")
}

/// [`run`] with the optimizer straight in `AmpOptimizer`, or in the accumulation wrapper.
fn run_direct_or_accumulated<O>(s: &Schedule, inner: impl Fn() -> O) -> Model
where
    O: Optimizer<Pair<B>, B> + ScaledStep<Pair<B>, B>,
{
    match s.direct {
        true => run(s, inner),
        false => run(s, || accumulated(s, inner())),
    }
}

#[test]
fn random_schedules_follow_the_semantics() {
    let _serial = serial();
    let mut exercised = [0u64; 13];
    for seed in 0..96 {
        let s = Schedule::draw(seed);
        let resumed_mid_window = s
            .micros
            .iter()
            .enumerate()
            .any(|(k, m)| m.resume_after && (k + 1) % s.micro_batches != 0);
        let fused = FusedAdamWConfig::new()
            .with_beta_1(BETA_1)
            .with_beta_2(BETA_2)
            .with_epsilon(EPSILON)
            .with_weight_decay(WEIGHT_DECAY)
            .with_amsgrad(s.amsgrad)
            .with_cautious_weight_decay(s.cautious)
            .with_decoupled_weight_decay(!s.adam)
            .with_weight_decay_min_rank(if s.matrices_only { 2 } else { 0 });
        let burn_adam = AdamConfig::new()
            .with_beta_1(BETA_1)
            .with_beta_2(BETA_2)
            .with_epsilon(EPSILON)
            .with_weight_decay(Some(WeightDecayConfig::new(WEIGHT_DECAY)))
            .with_amsgrad(s.amsgrad);
        let burn_adamw = AdamWConfig::new()
            .with_beta_1(BETA_1)
            .with_beta_2(BETA_2)
            .with_epsilon(EPSILON)
            .with_weight_decay(WEIGHT_DECAY)
            .with_amsgrad(s.amsgrad)
            .with_cautious_weight_decay(s.cautious);
        let fused = || fused.init::<B, Pair<B>>().expect("a valid config");
        let burn_adamw = || -> OptimizerAdaptor<AdamW, Pair<B>, B> { burn_adamw.init() };
        let burn_adam = || -> OptimizerAdaptor<Adam, Pair<B>, B> { burn_adam.init() };
        let model = match (s.sgd, s.fused, s.adam) {
            (Some(sgd), true, _) => run_direct_or_accumulated(&s, || {
                let min_rank = if s.matrices_only { 2 } else { 0 };
                sgd.fused(min_rank)
                    .init::<B, Pair<B>>()
                    .expect("a valid config")
            }),
            (Some(sgd), false, _) => {
                run_direct_or_accumulated(&s, || -> OptimizerAdaptor<Sgd<_>, Pair<B>, B> {
                    sgd.burn().init()
                })
            }
            (None, true, _) => run_direct_or_accumulated(&s, fused),
            (None, false, false) => run_direct_or_accumulated(&s, burn_adamw),
            (None, false, true) => run_direct_or_accumulated(&s, burn_adam),
        };
        let counts = [
            model.skipped,
            model.absorbed,
            model.clipped,
            model.bias_unstepped,
            u64::from(resumed_mid_window),
            u64::from(s.direct),
            model.amsgrad_mattered,
            model.cautious_kept,
            u64::from(s.adam && s.sgd.is_none()),
            u64::from(s.sgd.is_some_and(|g| g.momentum == 0.0)),
            u64::from(s.sgd.is_some_and(|g| g.nesterov)),
            u64::from(
                s.sgd
                    .is_some_and(|g| g.dampening > 0.0 && g.weight_decay > 0.0),
            ),
            model.bias_undecayed,
        ];
        for (total, n) in exercised.iter_mut().zip(counts) {
            *total += n;
        }
    }
    // The schedules exercised every branch: skipped windows, overflows absorbed by the
    // hysteresis, clipped windows, a bias without gradient for a whole window, runs resumed
    // mid-window, optimizers without the accumulation wrapper, AMSGrad's maximum and cautious
    // weight decay each changing some elements' steps, Adam's L2 penalty, and SGD without
    // momentum, with Nesterov's, and dampened with weight decay; a bias left undecayed.
    assert!(
        exercised.iter().all(|&n| n > 0),
        "not every branch was exercised: {exercised:?}"
    );
    eprintln!(
        "skipped, absorbed, clipped, bias unstepped, resumed mid-window, direct, \
         AMSGrad's maximum divided, cautiously undecayed, Adam, SGD plain, SGD Nesterov, SGD \
         dampened with weight decay, bias undecayed: {exercised:?}"
    );
}
