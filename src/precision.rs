//! The autocast precision: one small value, per thread, with a scoped override.
//!
//! Like `torch.autocast`, the setting is thread-local: a data-loader or logging thread
//! never changes what the training thread computes in.

use core::cell::Cell;
use core::fmt;
use core::sync::atomic::{AtomicU8, Ordering};

use burn_backend::{Backend, DType, DeviceOps};
use burn_std::FloatDType;
use serde::{Deserialize, Serialize};

/// The low-precision dtype that autocast runs matmul, convolution and attention in.
///
/// `F32` turns autocast off: every op is forwarded unchanged (only mixed-dtype inputs are
/// still promoted, so that nothing panics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Precision {
    /// Autocast off.
    F32,
    /// IEEE half precision: needs loss scaling (see the `scaler` module).
    F16,
    /// bfloat16: f32's range, no loss scaling needed.
    Bf16,
}

impl Precision {
    /// The dtype autocast lowers to, or `None` when autocast is off.
    pub fn low_dtype(self) -> Option<FloatDType> {
        match self {
            Precision::F32 => None,
            Precision::F16 => Some(FloatDType::F16),
            Precision::Bf16 => Some(FloatDType::BF16),
        }
    }

    /// Whether autocast is on at this precision.
    pub fn is_low(self) -> bool {
        self != Precision::F32
    }

    /// Whether training at this precision needs a loss scaler (f16's narrow range).
    pub fn needs_loss_scaling(self) -> bool {
        self == Precision::F16
    }

    /// The best precision `device` can run: bf16 where supported, else f16, else f32.
    pub fn default_for<B: Backend>(device: &B::Device) -> Precision {
        support::default_precision::<B>(device)
    }

    /// Whether `device` can compute in this precision.
    pub fn is_supported<B: Backend>(self, device: &B::Device) -> bool {
        match self {
            Precision::F32 => true,
            Precision::F16 => support::supports::<B>(device, DType::F16),
            Precision::Bf16 => support::supports::<B>(device, DType::BF16),
        }
    }

    /// The setting in force on this thread: its [`autocast`] guard, else the process-wide
    /// [`set_default_precision`]; `None` means "the device's default"
    /// ([`Precision::default_for`]).
    pub fn current() -> Option<Precision> {
        thread_state().precision
    }

    fn code(precision: Option<Precision>) -> u8 {
        match precision {
            None => 0,
            Some(Precision::F32) => 1,
            Some(Precision::F16) => 2,
            Some(Precision::Bf16) => 3,
        }
    }

    fn from_code(code: u8) -> Option<Precision> {
        match code {
            1 => Some(Precision::F32),
            2 => Some(Precision::F16),
            3 => Some(Precision::Bf16),
            _ => None,
        }
    }

    /// The precision that autocast uses on this thread for `device`.
    pub fn effective<B: Backend>(device: &B::Device) -> Precision {
        Self::current().unwrap_or_else(|| Self::default_for::<B>(device))
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
        })
    }
}

impl core::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(Precision::F32),
            "f16" | "fp16" | "float16" | "half" => Ok(Precision::F16),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            other => Err(format!(
                "unknown precision `{other}`: expected one of f32, f16, bf16"
            )),
        }
    }
}

/// The thread's autocast setting, and the low dtype last resolved under it: one read of this
/// thread-local gives a lowered op both, so an op whose dtype is already resolved for its
/// backend and device costs no other lookup.
#[derive(Clone, Copy)]
pub(crate) struct ThreadState {
    pub(crate) precision: Option<Precision>,
    pub(crate) resolved: Option<Resolved>,
}

/// A low dtype resolved (and its device support checked) for one backend, device and setting.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Resolved {
    pub(crate) backend: core::any::TypeId,
    pub(crate) device: burn_std::device::DeviceId,
    pub(crate) asked: Option<Precision>,
    pub(crate) low: Option<FloatDType>,
}

thread_local! {
    static STATE: Cell<ThreadState> = const {
        Cell::new(ThreadState { precision: None, resolved: None })
    };
}

/// The process-wide precision of threads without an [`autocast`] guard (0: the device's
/// default). An atomic, not a lock: every lowered op reads it.
static PROCESS_DEFAULT: AtomicU8 = AtomicU8::new(0);

/// Sets the precision of every thread that has no [`autocast`] guard of its own, process-wide
/// (`None`: each device's default, [`Precision::default_for`]). Returns the previous setting.
///
/// This is the setting for code that runs on threads you do not create: burn-train's
/// `Learner` with several devices runs each device's forward and backward on a worker thread
/// of its own, where a guard made on the main thread does not reach. PyTorch's
/// `torch.set_autocast_dtype` is the same kind of global.
pub fn set_default_precision(precision: Option<Precision>) -> Option<Precision> {
    Precision::from_code(PROCESS_DEFAULT.swap(Precision::code(precision), Ordering::Relaxed))
}

/// This thread's setting (its guard, else the process default) and last resolution.
#[inline(always)]
pub(crate) fn thread_state() -> ThreadState {
    let mut state = STATE.with(|s| s.get());
    if state.precision.is_none() {
        state.precision = Precision::from_code(PROCESS_DEFAULT.load(Ordering::Relaxed));
    }
    state
}

/// Remembers a resolution for the next ops of this thread.
#[cold]
pub(crate) fn remember(resolved: Resolved) {
    STATE.with(|s| {
        let mut state = s.get();
        state.resolved = Some(resolved);
        s.set(state);
    })
}

/// Sets this thread's own setting (not the process default); returns its previous own one.
fn set_precision(precision: Option<Precision>) -> Option<Precision> {
    STATE.with(|s| {
        let mut state = s.get();
        let previous = core::mem::replace(&mut state.precision, precision);
        s.set(state);
        previous
    })
}

/// Sets the autocast precision of this thread until the returned guard is dropped.
///
/// Guards nest: dropping one restores whatever was in force when it was made.
///
/// ```
/// use burn_amp::{autocast, Precision};
/// let _outer = autocast(Precision::F16);
/// {
///     let _inner = autocast(Precision::F32); // e.g. a numerically touchy block
///     assert_eq!(Precision::current(), Some(Precision::F32));
/// }
/// assert_eq!(Precision::current(), Some(Precision::F16));
/// ```
#[must_use = "autocast is restored when the guard is dropped; bind it with `let _g = ...`"]
pub fn autocast(precision: Precision) -> AutocastGuard {
    AutocastGuard {
        previous: set_precision(Some(precision)),
        _not_send: core::marker::PhantomData,
    }
}

/// Restores the previous autocast setting of this thread when dropped.
#[derive(Debug)]
pub struct AutocastGuard {
    previous: Option<Precision>,
    // The setting is per thread: the guard must be dropped on the thread that made it.
    _not_send: core::marker::PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        // PyTorch drops its cast cache when the outermost autocast scope ends.
        if self.previous.is_none() {
            crate::backend::cast_cache::clear();
        }
        set_precision(self.previous);
    }
}

/// Device dtype support, cached per thread: `supports_dtype` on CubeCL backends looks the
/// device's client up in a global map, too slow for the per-op path.
pub(crate) mod support {
    use super::*;
    use core::any::TypeId;
    use std::cell::RefCell;

    type Key = (TypeId, burn_std::device::DeviceId, DType);

    thread_local! {
        static CACHE: RefCell<Vec<(Key, bool)>> = const { RefCell::new(Vec::new()) };
    }

    pub(crate) fn supports<B: Backend>(device: &B::Device, dtype: DType) -> bool {
        let key = (TypeId::of::<B>(), device.id(), dtype);
        if let Some(hit) = CACHE.with(|c| c.borrow().iter().find(|(k, _)| *k == key).map(|e| e.1)) {
            return hit;
        }
        let ok = B::supports_dtype(device, dtype);
        CACHE.with(|c| c.borrow_mut().push((key, ok)));
        ok
    }

    pub(crate) fn default_precision<B: Backend>(device: &B::Device) -> Precision {
        if supports::<B>(device, DType::BF16) {
            Precision::Bf16
        } else if supports::<B>(device, DType::F16) {
            Precision::F16
        } else {
            Precision::F32
        }
    }
}
