//! Random loops of three optimizers sharing one loss scale (`share_scaler`), each in a
//! `GradientAccumulation` window of 1 to 3 micro-batches, in any order the ordering rule
//! allows: blocks of backwards of some of them, then their steps in another order (PyTorch's
//! loop for several losses, a GAN's, and everything between). Micro-batches overflow at
//! random; the scale grows every 2 clean updates (from 1024, up to 65536) and backs off on
//! an overflow; the run stops and resumes from the records of all three at random blocks,
//! windows open, updates waiting and overflows whose backoff waits for a window included.
//!
//! Against the documented semantics written out on the host: the update waits for the first
//! backward after a step, and while a window is open only finishes the steps (the flags wait
//! for a later update); each window is skipped whole on an overflow of any of its
//! micro-batches. The scale and growth tracker after each block and the skipped steps
//! exactly; the weights
//! bitwise against each optimizer stepped by hand with a `GradScaler` of its own set to the
//! scale the host says each window used (constant through each window, which the host
//! asserts too).

use burn_amp::scaler::{GradScaler, GradScalerRecord};

use super::common::Rng;
use super::shared_scaler::{Fused, fused};
use super::*;

const MEMBERS: usize = 3;
const BLOCKS: usize = 14;
const SCHEDULES: u64 = 64;
const LR: f64 = 1e-2;

type Accumulating = GradientAccumulation<Fused, B>;
type Optim = AmpOptimizer<Accumulating, B>;

fn scaler_config() -> GradScalerConfig {
    GradScalerConfig::new()
        .with_init_scale(1024.0)
        .with_growth_interval(2)
        .with_max_scale(65536.0)
}

/// Backwards of some members (each its next micro-batch, maybe poisoned), then their steps.
#[derive(Debug, Clone)]
struct Block {
    backwards: Vec<(usize, bool)>,
    steps: Vec<usize>,
    resume_after: bool,
}

#[derive(Debug, Clone)]
struct Schedule {
    windows: [usize; MEMBERS],
    blocks: Vec<Block>,
}

impl Schedule {
    fn draw(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let windows = [(); MEMBERS].map(|()| 1 + rng.below(3));
        let shuffled = |rng: &mut Rng, mut members: Vec<usize>| {
            for i in (1..members.len()).rev() {
                members.swap(i, rng.below(i + 1));
            }
            members
        };
        let blocks = (0..BLOCKS)
            .map(|_| {
                let mut members: Vec<usize> = (0..MEMBERS).filter(|_| rng.below(3) != 0).collect();
                if members.is_empty() {
                    members.push(rng.below(MEMBERS));
                }
                let members = shuffled(&mut rng, members);
                let steps = shuffled(&mut rng, members.clone());
                Block {
                    backwards: members.iter().map(|&m| (m, rng.below(8) == 0)).collect(),
                    steps,
                    resume_after: rng.below(4) == 0,
                }
            })
            .collect();
        Self { windows, blocks }
    }
}

fn member_model(member: usize, device: &burn::tensor::Device<B>) -> Mlp<B> {
    B::seed(device, 20 + member as u64);
    Mlp::new(D_IN, 16, CLASSES, device)
}

fn loss_of(model: &Mlp<B>, member: usize, micro: usize, poison: bool) -> Tensor<B, 1> {
    let device = model.l1.weight.device();
    let (x, y) = batch(1000 * member + micro, poison, &device);
    model.loss(x, y)
}

/// What a run gives: per block, each member's weights and the scale and growth tracker
/// after it (as the records say them); the skipped steps of each member at the end.
#[derive(Debug, PartialEq)]
struct Observed {
    weights: Vec<Vec<Vec<u32>>>,
    scales: Vec<(f32, f32)>,
    skipped: Vec<u64>,
}

fn optimizers(schedule: &Schedule) -> Vec<Optim> {
    let accumulating = |m: usize| GradientAccumulation::new(fused(), schedule.windows[m]).unwrap();
    let mut first = AmpOptimizer::new(accumulating(0), scaler_config()).unwrap();
    let others: Vec<Optim> = (1..MEMBERS)
        .map(|m| first.share_scaler(accumulating(m)))
        .collect();
    core::iter::once(first).chain(others).collect()
}

/// The loop as a user writes it, resumed from records where the schedule says.
fn shared(schedule: &Schedule) -> Observed {
    let device = Default::default();
    let mut models: Vec<Mlp<B>> = (0..MEMBERS).map(|m| member_model(m, &device)).collect();
    let mut optims = optimizers(schedule);
    let mut micro = [0; MEMBERS];
    let mut observed = Observed {
        weights: Vec::new(),
        scales: Vec::new(),
        skipped: Vec::new(),
    };
    for (b, block) in schedule.blocks.iter().enumerate() {
        let mut grads: Vec<Option<GradientsParams>> = (0..MEMBERS).map(|_| None).collect();
        for &(m, poison) in &block.backwards {
            let loss = loss_of(&models[m], m, micro[m], poison);
            grads[m] = Some(GradientsParams::from_grads(loss.backward(), &models[m]));
            micro[m] += 1;
        }
        for &m in &block.steps {
            let g = grads[m].take().expect("a backward before the step");
            models[m] = optims[m]
                .try_step(LR, models[m].clone(), g)
                .unwrap_or_else(|e| panic!("block {b}, member {m}: {e}"));
        }
        observed
            .weights
            .push(models.iter().map(weights_bits).collect());
        let scale = optims[0].scale();
        for (m, optim) in optims.iter().enumerate() {
            assert_eq!(optim.scale(), scale, "block {b}: member {m}'s scale");
        }
        let record = optims[0].scaler_record().expect("a scaled step was taken");
        assert_eq!(record.scale, scale, "block {b}: the record's scale");
        observed.scales.push((scale, record.growth_tracker));
        if block.resume_after {
            let records: Vec<_> = optims.iter().map(Optimizer::to_record).collect();
            drop(optims); // one installation per backend: the old ones go first
            optims = optimizers(schedule)
                .into_iter()
                .zip(records)
                .map(|(optim, record)| optim.load_record(record))
                .collect();
        }
    }
    observed.skipped = optims
        .iter()
        .map(|o| o.step_counts().skipped_steps)
        .collect();
    observed
}

/// The scale's state machine as documented, on the host.
#[derive(Debug, Clone)]
struct Host {
    scale: f32,
    tracker: u32,
    /// A step was taken since the last update (or deferral).
    pending: bool,
    /// Overflow flags of the checked steps since then (a mid-window micro-step checks none).
    flags: Vec<bool>,
    /// Flags of deferred steps, when any was checked.
    carried: Option<bool>,
    /// Each member's open window: micro-batches in it, and whether one overflowed.
    windows: [(usize, bool); MEMBERS],
    skipped: [u64; MEMBERS],
}

impl Host {
    fn new() -> Self {
        Self {
            scale: 1024.0,
            tracker: 0,
            pending: false,
            flags: Vec::new(),
            carried: None,
            windows: [(0, false); MEMBERS],
            skipped: [0; MEMBERS],
        }
    }

    fn holding(&self) -> bool {
        self.windows.iter().any(|&(n, _)| n > 0)
    }

    /// The update with all flags (PyTorch's rule, hysteresis 1, growth capped at 65536).
    fn update(&mut self) {
        let flags = self.flags.drain(..).chain(self.carried.take());
        let Some(found) = flags.reduce(|a, b| a || b) else {
            return; // no step checked anything: the state stays
        };
        if found {
            self.scale = (self.scale * 0.5).max(1.0);
            self.tracker = 0;
        } else {
            self.tracker += 1;
            if self.tracker >= 2 {
                self.tracker = 0;
                if self.scale * 2.0 <= 65536.0 {
                    self.scale *= 2.0;
                }
            }
        }
    }

    /// Runs or defers the waiting update.
    fn finish_steps(&mut self) {
        if core::mem::take(&mut self.pending) {
            if self.holding() {
                let flags = self.flags.drain(..).chain(self.carried.take());
                self.carried = flags.reduce(|a, b| a || b);
            } else {
                self.update();
            }
        }
    }

    /// A backward: runs or defers the waiting update; the scale it multiplies by.
    fn backward(&mut self) -> f32 {
        self.finish_steps();
        self.scale
    }

    fn step(&mut self, member: usize, window: usize, poisoned: bool) {
        let (count, overflowed) = &mut self.windows[member];
        *count += 1;
        *overflowed |= poisoned;
        if *count == window {
            let found = *overflowed;
            self.windows[member] = (0, false);
            self.flags.push(found);
            self.skipped[member] += u64::from(found);
        }
        self.pending = true;
    }

    /// The state the records save and the next backward finds (`scale()`, the records).
    fn settled(&self) -> Self {
        let mut next = self.clone();
        next.finish_steps();
        next
    }

    /// Loaded from the records: the settled state, the flags of an update put off included.
    fn resumed(&self) -> Self {
        self.settled()
    }
}

/// The host's account of a schedule: the scale after each block, each member's
/// micro-batches (the scale each backward used, poisoned or not), and the skipped steps.
struct Expected {
    scales: Vec<(f32, f32)>,
    micro_batches: [Vec<(f32, bool)>; MEMBERS],
    /// Micro-batches of each member after each block.
    counts: Vec<[usize; MEMBERS]>,
    skipped: [u64; MEMBERS],
}

fn expected(schedule: &Schedule) -> Expected {
    let mut host = Host::new();
    let mut expected = Expected {
        scales: Vec::new(),
        micro_batches: Default::default(),
        counts: Vec::new(),
        skipped: [0; MEMBERS],
    };
    for block in &schedule.blocks {
        for &(m, poison) in &block.backwards {
            let scale = host.backward();
            expected.micro_batches[m].push((scale, poison));
        }
        for &m in &block.steps {
            let poisoned = expected.micro_batches[m].last().unwrap().1;
            host.step(m, schedule.windows[m], poisoned);
        }
        let settled = host.settled();
        expected
            .scales
            .push((settled.scale, settled.tracker as f32));
        expected
            .counts
            .push(expected.micro_batches.each_ref().map(Vec::len));
        if block.resume_after {
            host = host.resumed();
        }
    }
    expected.skipped = host.skipped;
    expected
}

/// Each member alone with a `GradScaler` of its own, set at each window's first micro-batch
/// to the scale the host says the window used: its weights after each micro-batch (the
/// initial ones first) and its skipped steps.
fn by_hand(member: usize, window: usize, micro_batches: &[(f32, bool)]) -> (Vec<Vec<u32>>, u64) {
    let device = Default::default();
    let config = scaler_config();
    let mut scaler: GradScaler<B> = config.init(&device, Precision::F16).unwrap();
    let mut optim: Accumulating = GradientAccumulation::new(fused(), window).unwrap();
    let mut model = member_model(member, &device);
    let mut weights = vec![weights_bits(&model)];
    let mut skipped = 0;
    for (i, &(scale, poison)) in micro_batches.iter().enumerate() {
        let start = i - i % window;
        assert!(
            micro_batches[start..=i].iter().all(|&(s, _)| s == scale),
            "member {member}: the host changed the scale inside a window at micro-batch {i}"
        );
        if i == start {
            scaler = scaler.load_record(GradScalerRecord {
                scale,
                growth_tracker: 0.0,
                hysteresis_left: 1.0,
                floor_overflows: 0.0,
                deferred_found_inf: None,
            });
        }
        let loss = scaler.scale(loss_of(&model, member, i, poison));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let (stepped, report) = scaler.step(&mut optim, LR, model, grads).unwrap();
        model = stepped;
        skipped += u64::from(report.skipped());
        scaler.update().unwrap();
        weights.push(weights_bits(&model));
    }
    (weights, skipped)
}

#[test]
fn random_loops_of_optimizers_sharing_a_scale_follow_the_documented_updates() {
    let _s = serial();
    let _g = autocast(Precision::F16);
    let (mut deferred, mut resumed_open, mut held_by_loaded, mut resumed_owing) = (0, 0, 0, 0);
    for seed in 0..SCHEDULES {
        let schedule = Schedule::draw(seed);
        let want = expected(&schedule);
        let got = shared(&schedule);
        let context = format!("schedule {seed}: {schedule:?}");
        assert_eq!(
            got.scales, want.scales,
            "the scale and growth tracker after each block; {context}"
        );
        assert_eq!(got.skipped, want.skipped, "skipped steps; {context}");
        for m in 0..MEMBERS {
            let (weights, skipped) = by_hand(m, schedule.windows[m], &want.micro_batches[m]);
            assert_eq!(skipped, want.skipped[m], "member {m} by hand; {context}");
            for (b, counts) in want.counts.iter().enumerate() {
                assert!(
                    got.weights[b][m] == weights[counts[m]],
                    "member {m} after block {b} ({} micro-batches); {context}",
                    counts[m]
                );
            }
        }
        // What the schedules exercised (counted on the host).
        let mut host = Host::new();
        // Members whose open window was loaded from a record and who have not stepped since.
        let mut loaded = [false; MEMBERS];
        let mut poisoned = [false; MEMBERS];
        for block in &schedule.blocks {
            for &(m, poison) in &block.backwards {
                poisoned[m] = poison;
                deferred += usize::from(host.pending && host.holding());
                let holds = |m: usize| host.windows[m].0 > 0;
                let by_loaded = (0..MEMBERS).any(|m| loaded[m] && holds(m));
                let by_others = (0..MEMBERS).any(|m| !loaded[m] && holds(m));
                let checked = !host.flags.is_empty();
                held_by_loaded += usize::from(host.pending && checked && by_loaded && !by_others);
                host.backward();
            }
            for &m in &block.steps {
                host.step(m, schedule.windows[m], poisoned[m]);
                loaded[m] = false;
            }
            if block.resume_after {
                resumed_open += usize::from(host.holding());
                host = host.resumed();
                resumed_owing += usize::from(host.carried == Some(true));
                loaded = [true; MEMBERS];
            }
        }
    }
    eprintln!(
        "deferred updates: {deferred}, resumes with a window open: {resumed_open}, updates \
         held by a window loaded from a record: {held_by_loaded}, resumes owing a backoff: \
         {resumed_owing}"
    );
    assert!(
        deferred >= 20 && resumed_open >= 5 && held_by_loaded >= 5 && resumed_owing >= 5,
        "{deferred}, {resumed_open}, {held_by_loaded}, {resumed_owing}"
    );
}
