//! Burn's `AdamW` and `Adam` records as [`FusedAdamW`]'s: a run saved with Burn's optimizer
//! goes on with the fused one, moments, AMSGrad's maximum and step counts included.
//!
//! Both records are Burn's `OptimizerAdaptor` record (a state per parameter, by rank), and
//! both optimizers keep f32 moments of the parameter's shape: only the state's layout
//! differs. Set the fused config to the one the run used (Burn's `AdamWConfig` defaults to
//! epsilon 1e-5 and weight decay 1e-4, [`FusedAdamWConfig`](super::FusedAdamWConfig) to
//! PyTorch's 1e-8 and 1e-2; for `Adam`, [`FusedAdamWConfig::adam`](super::FusedAdamWConfig::adam)
//! with its L2 penalty).

use burn::module::ParamId;
use burn::optim::record::{AdaptorRecord, AdaptorRecordV1};
use burn::optim::{Adam, AdamState, AdamW, AdamWState, AdaptiveMomentumState, SimpleOptimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use hashbrown::HashMap;

use super::{AdamWMomentState, F32Moments, FusedAdamW, FusedAdamWState, OptimKernels};
use crate::record::ExactTensor;

/// A Burn optimizer whose per-parameter state becomes [`FusedAdamW`]'s.
pub trait IntoFusedAdamW<B: Backend>: SimpleOptimizer<B> {
    /// One parameter's state.
    fn fused_state<const D: usize>(state: Self::State<D>) -> FusedAdamWState<B, D>;
}

impl<B: OptimKernels> IntoFusedAdamW<B> for AdamW {
    fn fused_state<const D: usize>(state: AdamWState<B, D>) -> FusedAdamWState<B, D> {
        from_momentum(state.momentum)
    }
}

impl<B: OptimKernels> IntoFusedAdamW<B> for Adam {
    fn fused_state<const D: usize>(state: AdamState<B, D>) -> FusedAdamWState<B, D> {
        from_momentum(state.momentum)
    }
}

/// The moments as they are; the step count (`time`, the steps applied) as an f32 device
/// scalar, exact below 2^24 steps.
fn from_momentum<B: Backend, const D: usize>(
    m: AdaptiveMomentumState<B, D>,
) -> FusedAdamWState<B, D> {
    let device = m.moment_1.device();
    let step = Tensor::<B, 1>::from_data(
        TensorData::new(vec![m.time as f32], [1]),
        (&device, burn::tensor::DType::F32),
    );
    FusedAdamWState {
        moments: AdamWMomentState::F32(F32Moments {
            exp_avg: m.moment_1,
            exp_avg_sq: m.moment_2,
            max_exp_avg_sq: m.max_moment_2,
        }),
        step: ExactTensor(step),
    }
}

/// The record of Burn's `AdamW` or `Adam` (`optim.to_record()`, or loaded) as the record of
/// [`FusedAdamW`]'s optimizer, for its `load_record`.
pub fn fused_adamw_record<O, B>(
    record: HashMap<ParamId, AdaptorRecord<O, B>>,
) -> HashMap<ParamId, AdaptorRecord<FusedAdamW, B>>
where
    B: AutodiffBackend,
    B::InnerBackend: OptimKernels,
    O: IntoFusedAdamW<B::InnerBackend>,
{
    record
        .into_iter()
        .map(|(id, AdaptorRecord::V1(state))| (id, AdaptorRecord::V1(by_rank::<O, _>(state))))
        .collect()
}

fn by_rank<O: IntoFusedAdamW<B>, B: OptimKernels>(
    state: AdaptorRecordV1<O, B>,
) -> AdaptorRecordV1<FusedAdamW, B> {
    use AdaptorRecordV1 as R;
    match state {
        R::Rank0(s) => R::Rank0(O::fused_state(s)),
        R::Rank1(s) => R::Rank1(O::fused_state(s)),
        R::Rank2(s) => R::Rank2(O::fused_state(s)),
        R::Rank3(s) => R::Rank3(O::fused_state(s)),
        R::Rank4(s) => R::Rank4(O::fused_state(s)),
        R::Rank5(s) => R::Rank5(O::fused_state(s)),
        R::Rank6(s) => R::Rank6(O::fused_state(s)),
        R::Rank7(s) => R::Rank7(O::fused_state(s)),
        R::Rank8(s) => R::Rank8(O::fused_state(s)),
    }
}
