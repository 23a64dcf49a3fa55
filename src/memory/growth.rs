//! [`GrowthWatch`]: a steady climb of the memory in use, step after step, reported as a leak.

use core::fmt;
use std::collections::VecDeque;

use burn::config::Config;
use thiserror::Error;

use super::{DeviceMemory, MemoryReport, budget_from_free, mib};

/// When a climb counts as a leak. The defaults: skip 2 samples, a window of 8, at least
/// 4 KiB a step (below that, a million steps leak under 4 GiB).
#[derive(Config, Debug, PartialEq)]
pub struct GrowthWatchConfig {
    /// Samples skipped at the start, while the run allocates what it keeps.
    #[config(default = 2)]
    pub warmup: usize,
    /// Samples a climb must span before it is reported; at least 3.
    #[config(default = 8)]
    pub window: usize,
    /// The slope, in bytes a step, below which a climb is not reported.
    #[config(default = 4096)]
    pub min_bytes_per_step: u64,
}

impl GrowthWatchConfig {
    /// The watch, or why the configuration cannot work.
    pub fn init(&self) -> Result<GrowthWatch, GrowthWatchError> {
        if self.window < 3 {
            return Err(GrowthWatchError::WindowTooShort {
                window: self.window,
            });
        }
        Ok(GrowthWatch {
            config: self.clone(),
            seen: 0,
            samples: VecDeque::with_capacity(self.window),
            budget: None,
            report: None,
        })
    }
}

/// A configuration that cannot tell a climb from noise.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GrowthWatchError {
    /// Fewer than 3 samples cannot show a steady climb.
    #[error(
        "a growth window of {window} samples cannot tell a climb from one allocation: use at \
         least 3 (GrowthWatchConfig::with_window; the default is 8)"
    )]
    WindowTooShort {
        /// The window asked for.
        window: usize,
    },
}

/// What the backward passes during the climb say about its cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrowthCause {
    /// No backward ran while memory climbed: forward passes on an autodiff backend keep their
    /// graphs until the next backward. Evaluate on `model.valid()`.
    GraphsWithoutBackward,
    /// Backward ran, so autodiff freed the graphs it could: something keeps tensors from each
    /// step alive.
    KeptAcrossSteps,
    /// The backend does not count backward passes (only `Amp<B>` over autodiff does): either.
    Unknown,
}

/// A steady climb of the memory in use: a leak, with its rate and its likely cause.
#[derive(Debug, Clone, PartialEq, Error)]
pub struct MemoryGrowth {
    /// The least-squares slope over the window, in bytes a step.
    pub bytes_per_step: u64,
    /// Steps the window spans (its first sample to its last).
    pub steps: u64,
    /// Bytes in use at the window's first sample.
    pub from: u64,
    /// Bytes in use at its last.
    pub to: u64,
    /// Backward passes during the window's rising steps, where counted.
    pub backward_passes: Option<u64>,
    /// What those say about the cause.
    pub cause: GrowthCause,
    /// The category of the last [`MemoryReport`] given to the watch that one step's growth
    /// matches (within a quarter), with its size: "one step's activations" is a graph kept.
    pub matches: Option<(&'static str, u64)>,
    /// Steps until the budget is reached at this rate, where a budget is known.
    pub steps_left: Option<u64>,
}

impl fmt::Display for MemoryGrowth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "memory in use grows by {:.3} MiB a step ({:.2} -> {:.2} MiB over {} steps)",
            mib(self.bytes_per_step),
            mib(self.from),
            mib(self.to),
            self.steps
        )?;
        if let Some((what, bytes)) = self.matches {
            write!(f, ", about {what} ({:.3} MiB)", mib(bytes))?;
        }
        if let Some(left) = self.steps_left {
            write!(f, "; at this rate the budget is reached in {left} steps")?;
        }
        f.write_str(". This is a leak: a smaller batch only delays it. ")?;
        const GRAPHS: &str = "forward passes on the autodiff model whose loss never reaches \
            backward (validation, inference, an extra forward for a metric) keep their graphs, \
            with the activations saved for backward, until the next backward: run them on \
            `model.valid()` (no graph, PyTorch's no_grad)";
        const KEPT: &str = "tensors from each step are kept alive (outputs, losses or gradients \
            collected in a Vec or a struct): read what you need with `into_scalar`/`into_data`, \
            or `.detach()` a forward's tensor you keep";
        match self.cause {
            GrowthCause::GraphsWithoutBackward => {
                write!(f, "No backward ran while it rose: {GRAPHS}")
            }
            GrowthCause::KeptAcrossSteps => write!(
                f,
                "{} backward passes ran while it rose, so autodiff freed what it could: {KEPT}",
                self.backward_passes.unwrap_or(0)
            ),
            GrowthCause::Unknown => write!(
                f,
                "If no backward runs between the samples, {GRAPHS}. Otherwise {KEPT}. \
                 (`Amp<B>` counts backward passes and tells the two apart.)"
            ),
        }
    }
}

/// One sample: the step it was taken at, the bytes in use, the backward passes so far.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    step: u64,
    bytes: u64,
    backward_passes: Option<u64>,
}

/// Watches the memory in use at the same point of every step and reports a steady climb: a
/// leak, which no smaller batch fixes.
///
/// The commonest in Burn: forward passes on the autodiff backend that never reach `backward`
/// (a validation or inference loop run on the training model). Autodiff keeps each such
/// graph, with the activations it saved for a backward, until the next backward runs:
/// burn-autodiff 0.21 frees graphs no backward can reach only then (a backward on any thread
/// frees every thread's), so a validation epoch holds every batch's activations at once.
/// `model.valid()` runs on the inner backend and builds no graph (PyTorch's `no_grad`;
/// burn-train's `Learner` validates that way). The other kind: tensors from every step kept
/// alive (outputs, losses or gradients collected in a `Vec`).
///
/// Sample at the same point of every step (after the optimizer step, or after each
/// validation batch). The first samples are skipped (optimizer state, pools and caches are
/// allocated once), then a climb is reported when it spans a whole window: a slope above a
/// floor, with most steps rising, so one allocation that stays (a lazily created moment) is
/// not a leak. Under `Amp<B>` the backward passes between the samples are counted, which
/// tells the two kinds apart.
///
/// ```ignore
/// let mut watch = GrowthWatchConfig::new().init()?;
/// for batch in valid_batches {
///     let output = model.forward(batch.inputs);      // on `model.valid()`, no graph is kept
///     // ...
///     watch.sample::<B>(&device)?;                   // Err(MemoryGrowth) on a steady climb
/// }
/// ```
#[derive(Debug, Clone)]
pub struct GrowthWatch {
    config: GrowthWatchConfig,
    seen: u64,
    samples: VecDeque<Sample>,
    budget: Option<u64>,
    report: Option<MemoryReport>,
}

impl Default for GrowthWatch {
    fn default() -> Self {
        GrowthWatchConfig::new()
            .init()
            .expect("the default window is valid")
    }
}

impl GrowthWatch {
    /// The bytes in use the run may reach, for the steps left at the climb's rate.
    pub fn with_budget(mut self, budget: Option<u64>) -> Self {
        self.budget = budget;
        self
    }

    /// The budget from the device's free memory less a margin ([`budget_from_free`], CUDA),
    /// where the driver reports it; make the watch before the model.
    pub fn with_budget_of<B: DeviceMemory>(self, device: &B::Device) -> Self {
        self.with_budget(budget_from_free(B::free_memory(device)))
    }

    /// A training step's report: a climb is compared with its categories (a climb of one
    /// step's activations a step is a graph kept a step).
    pub fn set_report(&mut self, report: MemoryReport) {
        self.report = Some(report);
    }

    /// Samples the bytes in use on `device` as the next step (this waits for the device;
    /// CubeCL counts per thread: sample on the thread that runs the model). `Ok(None)` where
    /// the backend has no figures (Flex without [`CountingAlloc`](super::CountingAlloc)).
    ///
    /// # Errors
    /// [`MemoryGrowth`] once a climb spans the window; the window then starts again, so the
    /// next report needs a full window more.
    pub fn sample<B: DeviceMemory>(
        &mut self,
        device: &B::Device,
    ) -> Result<Option<u64>, MemoryGrowth> {
        let Some(snapshot) = B::memory_snapshot(device) else {
            return Ok(None);
        };
        let step = self.seen;
        self.record(step, snapshot.bytes_in_use, B::backward_passes(device))?;
        Ok(Some(snapshot.bytes_in_use))
    }

    /// Records a figure taken elsewhere: `step` increasing (it need not advance by one),
    /// `backward_passes` the process's count where known ([`crate::backend::backward_passes`]).
    ///
    /// # Errors
    /// As [`sample`](Self::sample).
    pub fn record(
        &mut self,
        step: u64,
        bytes_in_use: u64,
        backward_passes: Option<u64>,
    ) -> Result<(), MemoryGrowth> {
        self.seen += 1;
        if self.seen <= self.config.warmup as u64 {
            return Ok(());
        }
        if self.samples.back().is_some_and(|s| s.step >= step) {
            // A step that does not advance starts the window again rather than divide by 0.
            self.samples.clear();
        }
        if self.samples.len() == self.config.window {
            self.samples.pop_front();
        }
        self.samples.push_back(Sample {
            step,
            bytes: bytes_in_use,
            backward_passes,
        });
        match self.climb() {
            Some(growth) => {
                // One report per window: keep the last sample as the next window's first.
                let last = self.samples.pop_back();
                self.samples.clear();
                self.samples.extend(last);
                Err(growth)
            }
            None => Ok(()),
        }
    }

    /// The climb over a full window, if it is one.
    fn climb(&self) -> Option<MemoryGrowth> {
        if self.samples.len() < self.config.window {
            return None;
        }
        let n = self.samples.len() as f64;
        let mean_x = self.samples.iter().map(|s| s.step as f64).sum::<f64>() / n;
        let mean_y = self.samples.iter().map(|s| s.bytes as f64).sum::<f64>() / n;
        let (mut sxy, mut sxx) = (0.0, 0.0);
        for s in &self.samples {
            let dx = s.step as f64 - mean_x;
            sxy += dx * (s.bytes as f64 - mean_y);
            sxx += dx * dx;
        }
        let slope = sxy / sxx;
        // Most steps must rise: one allocation that stays is a step, not a slope. The
        // backward passes that count are those of the rising steps (a window may open on the
        // last training steps before a validation loop).
        let mut rising = 0;
        let mut backward_passes = Some(0);
        for (a, b) in self.samples.iter().zip(self.samples.iter().skip(1)) {
            if b.bytes > a.bytes {
                rising += 1;
                backward_passes = match (backward_passes, a.backward_passes, b.backward_passes) {
                    (Some(sum), Some(a), Some(b)) => Some(sum + b.saturating_sub(a)),
                    _ => None,
                };
            }
        }
        let steps = self.samples.len() - 1;
        if slope < self.config.min_bytes_per_step as f64 || rising * 4 < steps * 3 {
            return None;
        }
        let (first, last) = (self.samples.front()?, self.samples.back()?);
        let cause = match backward_passes {
            Some(0) => GrowthCause::GraphsWithoutBackward,
            Some(_) => GrowthCause::KeptAcrossSteps,
            None => GrowthCause::Unknown,
        };
        let bytes_per_step = slope.round() as u64;
        Some(MemoryGrowth {
            bytes_per_step,
            steps: last.step - first.step,
            from: first.bytes,
            to: last.bytes,
            backward_passes,
            cause,
            matches: self
                .report
                .and_then(|r| matching_category(&r, bytes_per_step)),
            steps_left: self
                .budget
                .map(|b| b.saturating_sub(last.bytes) / bytes_per_step.max(1)),
        })
    }
}

/// The report's category within a quarter of `bytes`, the closest first.
fn matching_category(report: &MemoryReport, bytes: u64) -> Option<(&'static str, u64)> {
    [
        ("one step's activations", report.activations.unwrap_or(0)),
        ("one step's gradients", report.gradients),
        (
            "a copy of the parameters",
            report.parameters + report.frozen_parameters,
        ),
        ("the optimizer state", report.optimizer_state),
    ]
    .into_iter()
    .filter(|(_, size)| *size > 0 && bytes.abs_diff(*size) * 4 <= *size)
    .min_by_key(|(_, size)| bytes.abs_diff(*size))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;

    fn watch() -> GrowthWatch {
        GrowthWatchConfig::new().init().unwrap()
    }

    /// Feeds `bytes` as steps 0, 1, ... with `backward_passes(step)`; the steps that reported.
    fn feed(
        watch: &mut GrowthWatch,
        bytes: impl IntoIterator<Item = u64>,
        backward_passes: impl Fn(u64) -> Option<u64>,
    ) -> Vec<(u64, MemoryGrowth)> {
        let mut reports = Vec::new();
        for (step, b) in bytes.into_iter().enumerate() {
            let step = step as u64;
            if let Err(g) = watch.record(step, b, backward_passes(step)) {
                reports.push((step, g));
            }
        }
        reports
    }

    #[test]
    fn a_flat_run_with_allocator_noise_is_not_a_leak() {
        // What a clean Flex training loop showed under `CountingAlloc`: 0 to 64 bytes a step.
        let deltas = [32, 0, 0, 0, 32, 0, 0, 0, 64, 0, 0];
        let bytes = (0..200).scan(2u64 << 20, |b, i| {
            *b += deltas[i % deltas.len()];
            Some(*b)
        });
        assert!(feed(&mut watch(), bytes, Some).is_empty());
    }

    #[test]
    fn what_the_first_steps_allocate_once_is_not_a_leak() {
        // Adam's moments at the first step, a pool growing over the first two.
        let bytes = [1 << 20, 9 << 20, 17 << 20, 17 << 20]
            .into_iter()
            .chain(std::iter::repeat_n(17 << 20, 50));
        assert!(feed(&mut watch(), bytes, Some).is_empty());
    }

    #[test]
    fn one_allocation_that_stays_mid_run_is_a_step_not_a_slope() {
        // A buffer created at step 20 (a lazily built state, a larger last batch).
        let bytes = (0..60).map(|i| if i < 20 { 4 << 20 } else { 64 << 20 });
        assert!(feed(&mut watch(), bytes, Some).is_empty());
    }

    #[test]
    fn a_steady_climb_is_reported_with_its_rate_after_one_window() {
        let rate = 789 * KIB;
        let bytes = (0..10u64).map(|i| (3 << 20) + i * rate + (i % 3) * 512);
        let reports = feed(&mut watch(), bytes, |_| Some(7));
        // Skip 2, then a window of 8: the 10th sample (step 9) is the first report.
        assert_eq!(reports.len(), 1, "{reports:?}");
        let (step, g) = &reports[0];
        assert_eq!(*step, 9);
        assert!(g.bytes_per_step.abs_diff(rate) < rate / 100, "{g:?}");
        assert_eq!(g.steps, 7);
        assert_eq!(
            (g.from, g.to),
            ((3 << 20) + 2 * rate + 1024, (3 << 20) + 9 * rate)
        );
        assert_eq!(g.backward_passes, Some(0));
        assert_eq!(g.cause, GrowthCause::GraphsWithoutBackward);
        assert!(g.to_string().contains("model.valid()"), "{g}");
    }

    #[test]
    fn backward_passes_during_the_climb_point_at_kept_tensors() {
        let bytes = (0..10u64).map(|i| (3 << 20) + i * 128 * KIB);
        let reports = feed(&mut watch(), bytes, |s| Some(100 + s));
        let g = &reports[0].1;
        assert_eq!(g.backward_passes, Some(7));
        assert_eq!(g.cause, GrowthCause::KeptAcrossSteps);
        assert!(g.to_string().contains("7 backward passes ran"), "{g}");
        assert!(g.to_string().contains("into_data"), "{g}");
        // Only the rising steps count: a backward before a validation loop's climb does not.
        let bytes = [1, 1, 5, 5, 5, 6, 7, 8, 9, 10, 11].map(|m| m << 20);
        let g = &feed(&mut watch(), bytes, |s| Some(if s < 4 { s } else { 4 }))[0].1;
        assert_eq!(g.cause, GrowthCause::GraphsWithoutBackward, "{g:?}");
    }

    #[test]
    fn without_a_backward_count_both_causes_are_named() {
        let bytes = (0..10u64).map(|i| i * 64 * KIB);
        let g = &feed(&mut watch(), bytes, |_| None)[0].1;
        assert_eq!((g.backward_passes, g.cause), (None, GrowthCause::Unknown));
        let text = g.to_string();
        assert!(
            text.contains("model.valid()") && text.contains("into_data"),
            "{text}"
        );
    }

    #[test]
    fn a_climb_below_the_floor_is_not_reported_and_the_floor_is_configurable() {
        let slow = || (0..40u64).map(|i| i * 1000);
        assert!(feed(&mut watch(), slow(), |_| Some(0)).is_empty());
        let mut fine = GrowthWatchConfig::new()
            .with_min_bytes_per_step(512)
            .init()
            .unwrap();
        let reports = feed(&mut fine, slow(), |_| Some(0));
        assert_eq!(reports[0].1.bytes_per_step, 1000);
    }

    #[test]
    fn it_reports_once_a_window_while_the_climb_goes_on() {
        let bytes = (0..40u64).map(|i| i * 64 * KIB);
        let steps: Vec<u64> = feed(&mut watch(), bytes, |_| Some(0))
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        // The last sample of a report opens the next window: 7 more samples fill it.
        assert_eq!(steps, vec![9, 16, 23, 30, 37]);
    }

    #[test]
    fn a_validation_epoch_without_valid_is_caught_before_the_next_backward_frees_it() {
        // 5 epochs of 30 training steps (flat) then 20 validation batches on the autodiff
        // model (each keeps 1 MiB until the next backward).
        let mut bytes = Vec::new();
        let mut backwards = Vec::new();
        let mut count = 0;
        for _ in 0..5 {
            for _ in 0..30 {
                count += 1;
                bytes.push(8 << 20);
                backwards.push(count);
            }
            for b in 1..=20 {
                bytes.push((8 << 20) + b * (1 << 20));
                backwards.push(count);
            }
        }
        let reports = feed(&mut watch(), bytes, |s| Some(backwards[s as usize]));
        assert!(!reports.is_empty());
        assert!(
            reports.iter().all(|(step, g)| (*step as usize % 50) >= 30
                && g.cause == GrowthCause::GraphsWithoutBackward
                && g.bytes_per_step.abs_diff(1 << 20) < (1 << 20) / 10),
            "{reports:?}"
        );
    }

    #[test]
    fn the_rate_is_per_step_when_samples_skip_steps() {
        // Sampled every 10th step, 8 KiB a step.
        let mut w = watch();
        let mut got = None;
        for i in 0..10u64 {
            if let Err(g) = w.record(i * 10, i * 80 * KIB, Some(i * 10)) {
                got = Some(g);
            }
        }
        let g = got.expect("a report");
        assert_eq!((g.bytes_per_step, g.steps), (8 * KIB, 70));
    }

    #[test]
    fn a_budget_gives_the_steps_left_and_a_report_the_matching_category() {
        let report = MemoryReport {
            activations: Some(800 * KIB),
            gradients: 64 * KIB,
            parameters: 64 * KIB,
            ..MemoryReport::default()
        };
        let mut w = watch().with_budget(Some(100 << 20));
        w.set_report(report);
        let bytes = (0..10u64).map(|i| (10 << 20) + i * 789 * KIB);
        let g = feed(&mut w, bytes, |_| Some(0)).remove(0).1;
        assert_eq!(g.matches, Some(("one step's activations", 800 * KIB)));
        let last = (10 << 20) + 9 * 789 * KIB;
        assert_eq!(g.steps_left, Some(((100 << 20) - last) / g.bytes_per_step));
        let text = g.to_string();
        assert!(text.contains("about one step's activations"), "{text}");
        assert!(text.contains("budget is reached in"), "{text}");
        // Nothing within a quarter: no category named.
        let bytes = (0..10u64).map(|i| i * 300 * KIB);
        let mut w = watch();
        w.set_report(report);
        assert_eq!(feed(&mut w, bytes, |_| Some(0))[0].1.matches, None);
    }

    #[test]
    fn a_step_that_does_not_advance_restarts_the_window() {
        let mut w = watch();
        for i in 0..9u64 {
            w.record(i, i * 64 * KIB, Some(0)).unwrap();
        }
        // Step 8 again (a loop that restarted its counter): no division by zero, no report.
        assert!(w.record(8, 100 << 20, Some(0)).is_ok());
        assert_eq!(w.samples.len(), 1);
    }

    #[test]
    fn a_window_under_three_samples_is_a_typed_error() {
        let err = GrowthWatchConfig::new().with_window(2).init().unwrap_err();
        assert_eq!(err, GrowthWatchError::WindowTooShort { window: 2 });
        assert!(err.to_string().contains("at least 3"), "{err}");
    }
}
