//! burn-train's `Learner`: the windowed scheduler counts optimizer steps.

use burn::lr_scheduler::LrScheduler;
use burn::lr_scheduler::exponential::ExponentialLrSchedulerConfig;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::train::{InferenceStep, Learner, TrainOutput, TrainStep};
use burn_amp::accumulate::{GradientAccumulation, WindowedLrScheduler};

use super::*;

type Item<B> = (Tensor<B, 2>, Tensor<B, 1, Int>);

impl TrainStep for Mlp<F> {
    type Input = Item<F>;
    type Output = ();

    fn step(&self, item: Item<F>) -> TrainOutput<()> {
        TrainOutput::new(self, self.batch_loss(item).backward(), ())
    }
}

impl InferenceStep for Mlp<Flex> {
    type Input = Item<Flex>;
    type Output = ();

    fn step(&self, _item: Item<Flex>) {}
}

/// Runs `windows` windows through a `Learner` exactly as its training epoch does: per
/// micro-batch, `lr_step`, `train_step`, `optimizer_step`.
fn learner_run<LR: LrScheduler + 'static>(init: Mlp<F>, scheduler: LR, windows: usize) -> Mlp<F> {
    let device = Default::default();
    let accum = GradientAccumulation::new(SgdConfig::new().init::<F, Mlp<F>>(), N).unwrap();
    let mut learner = Learner::new(init, accum, scheduler);
    for step in 0..windows {
        for i in 0..N {
            learner.lr_step();
            let out = learner.train_step(micro(step, i, MICRO, &device));
            learner.optimizer_step(out.grads);
        }
    }
    learner.model()
}

#[test]
fn under_learner_the_windowed_scheduler_counts_optimizer_steps() {
    let device = Default::default();
    F::seed(&device, 16);
    let init = mlp::<F>(&device);
    let schedule = || ExponentialLrSchedulerConfig::new(0.5, 0.5).init().unwrap();

    // Reference: batches of N·b, the schedule stepped once per optimizer step.
    let mut reference = init.clone();
    let mut sgd = SgdConfig::new().init::<F, Mlp<F>>();
    let mut scheduler = schedule();
    for step in 0..3 {
        let grads = GradientsParams::from_grads(
            reference
                .batch_loss(big(step, N, MICRO, &device))
                .backward(),
            &reference,
        );
        reference = sgd.step(scheduler.step(), reference, grads);
    }

    let windowed = learner_run(
        init.clone(),
        WindowedLrScheduler::new(schedule(), N).unwrap(),
        3,
    );
    let err = max_abs_diff(&params(&windowed), &params(&reference));
    assert!(
        err < 1e-6,
        "Learner + windowed schedule vs big batches: {err}"
    );

    // The bare schedule advances per micro-batch: the boundary calls see lr × 0.5^(N-1)…
    let bare = learner_run(init, schedule(), 3);
    let off = max_abs_diff(&params(&bare), &params(&reference));
    assert!(off > 1e-3, "the bare schedule should drift: {off}");
}
