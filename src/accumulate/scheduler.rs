//! [`WindowedLrScheduler`]: a learning-rate schedule that counts optimizer steps, not
//! micro-batches, under burn-train's `Learner`.

use burn::lr_scheduler::LrScheduler;
use burn::optim::LearningRate;
use burn::prelude::*;

use super::AccumulationError;

/// A learning-rate scheduler that advances once per accumulation window: for burn-train's
/// `Learner`, which steps its scheduler on every micro-batch.
///
/// Call `step` once per micro-batch, in lockstep with the accumulation (as `Learner` does):
/// the `N`-th call of each window, the boundary, advances the wrapped schedule and returns
/// its value; the calls before it return that same upcoming value without advancing (they
/// only label the micro-batch). The schedule then counts optimizer steps, as it would without
/// accumulation.
#[derive(Clone)]
pub struct WindowedLrScheduler<S> {
    inner: S,
    micro_batches: usize,
    position: usize,
}

impl<S: LrScheduler> WindowedLrScheduler<S> {
    /// Wraps `inner` for windows of `micro_batches` micro-batches.
    pub fn new(inner: S, micro_batches: usize) -> Result<Self, AccumulationError> {
        if micro_batches == 0 {
            return Err(AccumulationError::ZeroMicroBatches);
        }
        Ok(Self {
            inner,
            micro_batches,
            position: 0,
        })
    }

    /// The wrapped scheduler.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: LrScheduler> LrScheduler for WindowedLrScheduler<S> {
    type Record<B: Backend> = (S::Record<B>, usize);

    fn step(&mut self) -> LearningRate {
        if self.position + 1 == self.micro_batches {
            self.position = 0;
            self.inner.step()
        } else {
            self.position += 1;
            self.inner.clone().step()
        }
    }

    fn to_record<B: Backend>(&self) -> Self::Record<B> {
        (self.inner.to_record::<B>(), self.position)
    }

    fn load_record<B: Backend>(mut self, record: Self::Record<B>) -> Self {
        self.inner = self.inner.load_record::<B>(record.0);
        self.position = record.1 % self.micro_batches;
        self
    }
}
