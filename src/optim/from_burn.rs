//! Burn's `AdamW`, `Adam` and `Sgd` records as the fused optimizers': a run saved with Burn's
//! optimizer goes on with the fused one, moments, AMSGrad's maximum, velocities and step
//! counts included.
//!
//! The records are Burn's `OptimizerAdaptor` record on both sides (a state per parameter, by
//! rank), and the states hold the same tensors: only their layout differs. Set the fused
//! config to the one the run used (Burn's `AdamWConfig` defaults to epsilon 1e-5 and weight
//! decay 1e-4, [`FusedAdamWConfig`](super::FusedAdamWConfig) to PyTorch's 1e-8 and 1e-2; for
//! `Adam`, [`FusedAdamWConfig::adam`](super::FusedAdamWConfig::adam) with its L2 penalty;
//! Burn's `MomentumConfig` defaults to a dampening of 0.1, [`FusedSgdConfig`](super::FusedSgdConfig)
//! to 0).

use burn::module::ParamId;
use burn::optim::record::{AdaptorRecord, AdaptorRecordV1};
use burn::optim::{
    Adam, AdamState, AdamW, AdamWState, AdaptiveMomentumState, Sgd, SgdState, SimpleOptimizer,
};
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::backend::AutodiffBackend;
use hashbrown::HashMap;

use super::{
    AdamWMomentState, F32Moments, FusedAdamW, FusedAdamWState, FusedSgd, FusedSgdState,
    OptimKernels,
};
use crate::grads::f32_scalar;
use crate::record::ExactTensor;

/// A Burn optimizer whose per-parameter state becomes a fused optimizer's.
pub trait IntoFused<B: Backend>: SimpleOptimizer<B> {
    /// The fused optimizer.
    type Fused: SimpleOptimizer<B>;

    /// One parameter's state (`None`: the fused optimizer starts it as it would anyway).
    fn fused_state<const D: usize>(
        state: Self::State<D>,
    ) -> Option<<Self::Fused as SimpleOptimizer<B>>::State<D>>;
}

impl<B: OptimKernels> IntoFused<B> for AdamW {
    type Fused = FusedAdamW;

    fn fused_state<const D: usize>(state: AdamWState<B, D>) -> Option<FusedAdamWState<B, D>> {
        Some(from_momentum(state.momentum))
    }
}

impl<B: OptimKernels> IntoFused<B> for Adam {
    type Fused = FusedAdamW;

    fn fused_state<const D: usize>(state: AdamState<B, D>) -> Option<FusedAdamWState<B, D>> {
        Some(from_momentum(state.momentum))
    }
}

/// A velocity says one step or more was applied, which is all SGD's count tells (0: the
/// next step sets the velocity to the gradient). Without one (no momentum), nothing: a
/// fused SGD with momentum starts it as Burn's would. Burn keeps the velocity private; its
/// record item does not (read on the default device, moved to the parameter's at its step).
impl<B: OptimKernels> IntoFused<B> for Sgd<B> {
    type Fused = FusedSgd;

    fn fused_state<const D: usize>(state: SgdState<B, D>) -> Option<FusedSgdState<B, D>> {
        let item = state.momentum?.into_item::<FullPrecisionSettings>();
        let velocity = Tensor::<B, D>::from_item(item.velocity, &Default::default());
        Some(FusedSgdState {
            step: ExactTensor(f32_scalar(1.0, &velocity.device())),
            velocity,
        })
    }
}

/// The moments as they are; the step count is `time`, the steps applied (an f32 device
/// scalar, as the fused optimizers count: exact below 2^24 steps).
fn from_momentum<B: Backend, const D: usize>(
    m: AdaptiveMomentumState<B, D>,
) -> FusedAdamWState<B, D> {
    let step = f32_scalar(m.time as f32, &m.moment_1.device());
    FusedAdamWState {
        moments: AdamWMomentState::F32(F32Moments {
            exp_avg: m.moment_1,
            exp_avg_sq: m.moment_2,
            max_exp_avg_sq: m.max_moment_2,
        }),
        step: ExactTensor(step),
    }
}

/// The record of Burn's `AdamW`, `Adam` or `Sgd` (`optim.to_record()`, or loaded) as the
/// record of the fused optimizer ([`FusedAdamW`] for the first two, [`FusedSgd`]), for its
/// `load_record`.
pub fn fused_record<O, B>(
    record: HashMap<ParamId, AdaptorRecord<O, B>>,
) -> HashMap<ParamId, AdaptorRecord<O::Fused, B>>
where
    B: AutodiffBackend,
    B::InnerBackend: OptimKernels,
    O: IntoFused<B::InnerBackend>,
{
    record
        .into_iter()
        .filter_map(|(id, AdaptorRecord::V1(state))| {
            by_rank::<O, _>(state).map(|state| (id, AdaptorRecord::V1(state)))
        })
        .collect()
}

fn by_rank<O: IntoFused<B>, B: OptimKernels>(
    state: AdaptorRecordV1<O, B>,
) -> Option<AdaptorRecordV1<O::Fused, B>> {
    use AdaptorRecordV1 as R;
    Some(match state {
        R::Rank0(s) => R::Rank0(O::fused_state(s)?),
        R::Rank1(s) => R::Rank1(O::fused_state(s)?),
        R::Rank2(s) => R::Rank2(O::fused_state(s)?),
        R::Rank3(s) => R::Rank3(O::fused_state(s)?),
        R::Rank4(s) => R::Rank4(O::fused_state(s)?),
        R::Rank5(s) => R::Rank5(O::fused_state(s)?),
        R::Rank6(s) => R::Rank6(O::fused_state(s)?),
        R::Rank7(s) => R::Rank7(O::fused_state(s)?),
        R::Rank8(s) => R::Rank8(O::fused_state(s)?),
    })
}
