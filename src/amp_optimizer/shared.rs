//! Where an [`AmpOptimizer`](super::AmpOptimizer) keeps its [`GradScaler`]: its own, or one
//! shared with other optimizers ([`AmpOptimizer::share_scaler`](super::AmpOptimizer::share_scaler)).
//!
//! An optimizer of its own updates the scale at the end of its step. Optimizers that share
//! one cannot: in PyTorch's loop for several losses (`backward` of each, then `step` of each)
//! the second step's gradients were scaled by the scale the first step would have changed.
//! So their steps only record their overflow flags, and the one update (backing off if any of
//! them overflowed) runs at the next backward, before it takes the scale
//! ([`registry::PendingUpdate`]): every step unscales with the scale its backward used,
//! whether a loop runs all backwards before the steps or each backward before its step.
//!
//! While one of them holds gradients multiplied by the current scale for a later step (an
//! accumulation window), the scale must not change: the update at a backward then only
//! finishes the steps (so that each optimizer may step again) and keeps their overflow flags
//! for the update after that window's boundary ([`GradScaler::defer_update`]).

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use burn::tensor::backend::AutodiffBackend;

use super::registry::{self, PendingUpdate};
use crate::grads::primitive;
use crate::scaler::{GradScaler, GradScalerRecord, ScalerKernels};

/// A scaler, or what it starts from.
#[derive(Clone)]
pub(super) struct ScalerCell<B: AutodiffBackend>
where
    B::InnerBackend: ScalerKernels,
{
    /// Made on the device of the first scaled step.
    pub scaler: Option<GradScaler<B>>,
    /// A record loaded before the scaler existed.
    pub loaded: Option<GradScalerRecord>,
    /// Steps taken whose update waits for the next backward (a shared scaler only).
    pub pending: bool,
    /// Per member (index: `registry::join`'s), whether it holds scaled gradients for a later
    /// step ([`ScaledStep::holds_scaled_gradients`](crate::scaler::ScaledStep)), as its last
    /// step or load left it, while it lives.
    pub holding: Vec<Holding>,
}

/// Whether a member holds scaled gradients, and whether it still exists: a dropped optimizer
/// (a phase of training over) must not hold the scale of the others forever.
#[derive(Clone, Debug, Default)]
pub(super) struct Holding {
    holds: bool,
    /// The member's [`MemberToken`] (its clones share it).
    alive: Weak<()>,
}

/// What tells the shared scaler that an optimizer (one of its clones) still lives.
pub(super) type MemberToken = Arc<()>;

impl<B: AutodiffBackend> Default for ScalerCell<B>
where
    B::InnerBackend: ScalerKernels,
{
    fn default() -> Self {
        Self {
            scaler: None,
            loaded: None,
            pending: false,
            holding: Vec::new(),
        }
    }
}

impl<B: AutodiffBackend> ScalerCell<B>
where
    B::InnerBackend: ScalerKernels,
{
    /// The scaler as the next backward will find it: with the update its steps left for that
    /// backward applied, or put off while a window holds the scale (to a copy: the update
    /// itself waits), so that the scale and the records say what the next step will use, and
    /// a record resumes where the run goes on (an overflow put off included).
    pub fn settled(&self) -> Option<GradScaler<B>> {
        let mut scaler = self.scaler.clone()?;
        if self.pending {
            // As `run`: `pending` means a step to finish.
            let _ = if self.any_holding() {
                scaler.defer_update()
            } else {
                scaler.update()
            };
        }
        Some(scaler)
    }

    /// Records whether `member` (alive while `token` is) holds scaled gradients for a later
    /// step.
    pub fn set_holding(&mut self, member: usize, holds: bool, token: &MemberToken) {
        if self.holding.len() <= member {
            self.holding.resize(member + 1, Holding::default());
        }
        self.holding[member] = Holding {
            holds,
            alive: Arc::downgrade(token),
        };
    }

    fn any_holding(&self) -> bool {
        self.holding
            .iter()
            .any(|h| h.holds && h.alive.strong_count() > 0)
    }
}

/// One scaler for several optimizers of one installation.
pub(super) struct SharedScaler<B: AutodiffBackend>
where
    B::InnerBackend: ScalerKernels,
{
    owner: u64,
    cell: Mutex<ScalerCell<B>>,
}

impl<B: AutodiffBackend> SharedScaler<B>
where
    B::InnerBackend: ScalerKernels,
{
    fn lock(&self) -> MutexGuard<'_, ScalerCell<B>> {
        // Every change to the cell is a field write or a whole step: a panic inside a step
        // (the wrapped optimizer's) leaves it as the step found it or as it left it.
        self.cell.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<B: AutodiffBackend> PendingUpdate for SharedScaler<B>
where
    B::InnerBackend: ScalerKernels,
{
    fn run(&self) {
        let mut cell = self.lock();
        if !core::mem::take(&mut cell.pending) {
            return;
        }
        let holding = cell.any_holding();
        if let Some(scaler) = cell.scaler.as_mut() {
            // `pending` is set only after a step, so the update has one to finish.
            if holding {
                // The scale stays; the flags wait for the window's boundary.
                let _ = scaler.defer_update();
            } else if scaler.update().is_ok() {
                registry::publish::<B::InnerBackend>(self.owner, primitive(scaler.scale_tensor()));
            }
        }
    }
}

/// An optimizer's scaler: its own (a clone copies it), or shared (a clone shares it too).
#[derive(Clone)]
pub(super) enum ScalerSlot<B: AutodiffBackend>
where
    B::InnerBackend: ScalerKernels,
{
    Own(ScalerCell<B>),
    Shared(Arc<SharedScaler<B>>),
}

impl<B: AutodiffBackend> ScalerSlot<B>
where
    B::InnerBackend: ScalerKernels,
{
    /// Whether the update waits for the next backward.
    pub fn deferred(&self) -> bool {
        matches!(self, Self::Shared(_))
    }

    pub fn with<R>(&mut self, f: impl FnOnce(&mut ScalerCell<B>) -> R) -> R {
        match self {
            Self::Own(cell) => f(cell),
            Self::Shared(shared) => f(&mut shared.lock()),
        }
    }

    pub fn with_ref<R>(&self, f: impl FnOnce(&ScalerCell<B>) -> R) -> R {
        match self {
            Self::Own(cell) => f(cell),
            Self::Shared(shared) => f(&shared.lock()),
        }
    }

    /// This slot's scaler made shareable (an own one moves into the shared cell with its
    /// state), and registered as `owner`'s pending update: the slot of a new member, and its
    /// index.
    pub fn share(&mut self, owner: u64) -> (Self, usize)
    where
        B: 'static,
    {
        let shared = match self {
            Self::Shared(shared) => shared.clone(),
            Self::Own(cell) => {
                let shared = Arc::new(SharedScaler {
                    owner,
                    cell: Mutex::new(core::mem::take(cell)),
                });
                *self = Self::Shared(shared.clone());
                shared
            }
        };
        let member = registry::join(owner, shared.clone());
        (Self::Shared(shared), member)
    }
}
