//! One loss scale for an optimizer that accumulates and one that does not
//! (`share_scaler` + `GradientAccumulation`): a GAN's loop where the discriminator (Burn's
//! Adam) steps on every micro-batch and the generator (the fused AdamW) accumulates 2. The
//! generator's window sums gradients multiplied by the scale, so the scale must not change
//! inside it: an overflow of the discriminator there is skipped at once and backed off after
//! the window's boundary. Checked against each optimizer stepped by hand with a `GradScaler`
//! of its own, set to the scale of each iteration: weights bitwise, skipped steps; and a run
//! resumed from records saved with a window open and a step's update waiting.
//! Overflows: the discriminator at 3 and 7 (inside windows), the generator at 5 and 7 (the
//! micro-batches that close its windows).

use burn_amp::scaler::{GradScaler, GradScalerRecord};

use super::shared_scaler::{BurnAdam, Fused, Run, adam, fused, second_model};
use super::*;

const ITERATIONS: usize = 9;
const WINDOW: usize = 2;
const GENERATOR: usize = 0;
const DISCRIMINATOR: usize = 1;

type Accumulating = GradientAccumulation<Fused, B>;

fn poisoned(iteration: usize, model: usize) -> bool {
    matches!(
        (iteration, model),
        (3, DISCRIMINATOR) | (5, GENERATOR) | (7, _)
    )
}

fn loss_of(model: &Mlp<B>, iteration: usize, which: usize) -> Tensor<B, 1> {
    let device = model.l1.weight.device();
    let (x, y) = batch(iteration + 100 * which, poisoned(iteration, which), &device);
    model.loss(x, y)
}

fn accumulating() -> Accumulating {
    GradientAccumulation::new(fused(), WINDOW).unwrap()
}

/// The generator and the discriminator, with their optimizers sharing the scale.
struct Pair {
    models: (Mlp<B>, Mlp<B>),
    optims: (AmpOptimizer<Accumulating, B>, AmpOptimizer<BurnAdam, B>),
}

impl Pair {
    fn new() -> Self {
        let device = Default::default();
        let mut generator = AmpOptimizer::new(accumulating(), GradScalerConfig::new()).unwrap();
        let discriminator = generator.share_scaler(adam());
        Self {
            models: (model(&device), second_model(&device)),
            optims: (generator, discriminator),
        }
    }
}

/// Iterations `range` of the loop as a user writes it: the discriminator's backward and
/// step, then the generator's; `after` sees the pair after each iteration.
fn shared_from(
    mut pair: Pair,
    range: core::ops::Range<usize>,
    mut after: impl FnMut(usize, &Pair),
) -> Run {
    let mut run = Run {
        weights: Vec::new(),
        scales: Vec::new(),
        skipped: [0; 2],
    };
    for i in range {
        let Pair { models, optims } = &mut pair;
        let before = optims.0.scale();
        let loss = loss_of(&models.1, i, DISCRIMINATOR);
        let grads = GradientsParams::from_grads(loss.backward(), &models.1);
        models.1 = optims
            .1
            .try_step(1e-2, models.1.clone(), grads)
            .unwrap_or_else(|e| panic!("iteration {i}, discriminator: {e}"));
        // What the generator's backward will use: in this loop, the iteration's one scale.
        let told = optims.1.scale();
        assert_eq!(told, before, "iteration {i}: the scale told mid-iteration");
        let loss = loss_of(&models.0, i, GENERATOR);
        let grads = GradientsParams::from_grads(loss.backward(), &models.0);
        models.0 = optims
            .0
            .try_step(1e-2, models.0.clone(), grads)
            .unwrap_or_else(|e| panic!("iteration {i}, generator: {e}"));
        run.weights
            .push([weights_bits(&models.0), weights_bits(&models.1)]);
        assert_eq!(
            optims.0.scale(),
            optims.1.scale(),
            "iteration {i}: one scale"
        );
        run.scales.push(optims.0.scale());
        after(i, &pair);
    }
    run.skipped = [
        pair.optims.0.step_counts().skipped_steps,
        pair.optims.1.step_counts().skipped_steps,
    ];
    run
}

/// The same loop with a `GradScaler` per optimizer, set to `scales[i]` before iteration `i`
/// (the generator's at its windows' first micro-batches: its sums carry one scale), each
/// updated after its own steps (which moves nothing that the next setting does not replace).
fn by_hand(scales: &[f32]) -> Run {
    let device = Default::default();
    let config = GradScalerConfig::new();
    let at = |scale| GradScalerRecord {
        scale,
        growth_tracker: 0.0,
        hysteresis_left: config.hysteresis as f32,
        floor_overflows: 0.0,
        deferred_found_inf: None,
    };
    let mut scalers: [GradScaler<B>; 2] =
        [(); 2].map(|()| config.init(&device, Precision::F16).unwrap());
    let (mut optim0, mut optim1) = (accumulating(), adam());
    let (mut m0, mut m1) = (model(&device), second_model(&device));
    let mut run = Run {
        weights: Vec::new(),
        scales: Vec::new(),
        skipped: [0; 2],
    };
    for (i, &scale) in scales.iter().enumerate() {
        let [s0, s1] = &mut scalers;
        *s1 = s1.clone().load_record(at(scale));
        if i % WINDOW == 0 {
            *s0 = s0.clone().load_record(at(scale));
        }
        let loss = s1.scale(loss_of(&m1, i, DISCRIMINATOR));
        let grads = GradientsParams::from_grads(loss.backward(), &m1);
        let (m, report) = s1.step(&mut optim1, 1e-2, m1, grads).unwrap();
        (m1, run.skipped[1]) = (m, run.skipped[1] + u64::from(report.skipped()));
        s1.update().unwrap();
        let loss = s0.scale(loss_of(&m0, i, GENERATOR));
        let grads = GradientsParams::from_grads(loss.backward(), &m0);
        let (m, report) = s0.step(&mut optim0, 1e-2, m0, grads).unwrap();
        (m0, run.skipped[0]) = (m, run.skipped[0] + u64::from(report.skipped()));
        s0.update().unwrap();
        run.weights.push([weights_bits(&m0), weights_bits(&m1)]);
    }
    run
}

#[test]
fn an_accumulating_optimizer_keeps_the_shared_scale_through_its_window() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let half = |n: i32| 65536.0 / 2f32.powi(n);
    let got = shared_from(Pair::new(), 0..ITERATIONS, |_, _| {});
    // The scale the next backward uses, after each iteration: the discriminator's overflow
    // at 3 backs off after the window 2..=3, the generator's at 5 after its window, and both
    // at 7 once.
    assert_eq!(got.scales, [0, 0, 0, 1, 1, 2, 2, 3, 3].map(half));
    assert_eq!(
        got.skipped,
        [2, 2],
        "skipped: generator windows, discriminator steps"
    );
    for (i, pair) in got.weights.windows(2).enumerate() {
        let i = i + 1;
        let [generator, discriminator] = [0, 1].map(|m| pair[0][m] != pair[1][m]);
        let closes_window = i % WINDOW == WINDOW - 1;
        assert_eq!(
            generator,
            closes_window && !poisoned(i, GENERATOR),
            "generator at {i}: steps at its windows' ends, skips 5 and 7"
        );
        assert_eq!(
            discriminator,
            !poisoned(i, DISCRIMINATOR),
            "discriminator at {i}"
        );
    }
    // Every backward of iteration i used the scale left after i - 1.
    let used: Vec<f32> = core::iter::once(half(0))
        .chain(got.scales[..ITERATIONS - 1].iter().copied())
        .collect();
    let reference = by_hand(&used);
    assert_eq!(
        got.weights, reference.weights,
        "against a scaler per optimizer"
    );
    assert_eq!(got.skipped, reference.skipped);
}

/// Records saved after iteration 2 (the generator's window open, its micro-step's update
/// waiting) resume the run bitwise: loaded, the window keeps the scale when the
/// discriminator overflows first.
#[test]
fn shared_records_resume_an_open_window() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let mut saved = None;
    let whole = shared_from(Pair::new(), 0..ITERATIONS, |i, pair| {
        if i == 2 {
            let records = (pair.optims.0.to_record(), pair.optims.1.to_record());
            saved = Some((pair.models.clone(), records));
        }
    });
    let (models, (record0, record1)) = saved.expect("saved at 2");
    let mut pair = Pair::new();
    pair.models = models;
    let (optim0, optim1) = pair.optims;
    pair.optims = (optim0.load_record(record0), optim1.load_record(record1));
    let resumed = shared_from(pair, 3..ITERATIONS, |_, _| {});
    assert_eq!(resumed.weights, whole.weights[3..], "weights");
    assert_eq!(resumed.scales, whole.scales[3..], "scales");
}

/// An optimizer dropped with its window open (a phase of training over) no longer holds the
/// scale: the discriminator's overflow backs off at its next backward.
#[test]
fn a_dropped_optimizer_holds_no_window() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let mut kept = None;
    shared_from(Pair::new(), 0..3, |i, pair| {
        if i == 2 {
            kept = Some((pair.models.1.clone(), pair.optims.1.clone()));
        }
    });
    // The generator's window (2..=3) is open, and its optimizer is gone with the pair.
    let (mut model, mut optim) = kept.expect("kept at 2");
    for i in 3..5 {
        let grads =
            GradientsParams::from_grads(loss_of(&model, i, DISCRIMINATOR).backward(), &model);
        model = optim.try_step(1e-2, model, grads).unwrap();
    }
    // 3 overflowed; 4's backward backed off.
    assert_eq!(optim.scale(), 32768.0);
    assert_eq!(optim.step_counts().skipped_steps, 1);
}
