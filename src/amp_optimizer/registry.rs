//! Which loss scale `Amp<B>`'s backward multiplies the root by.
//!
//! An [`AmpOptimizer`](super::AmpOptimizer) installs itself for its training backend type
//! (`Amp<Autodiff<..>>`) when it is made and uninstalls when its last clone is dropped. While
//! it is installed, every `backward` on that backend at a precision that needs loss scaling
//! (f16) multiplies the loss by the scale, kept here per device as a device tensor (no host
//! read), and counts the scaled backward so that the optimizer knows its gradients are scaled.
//!
//! The table is process-wide, as PyTorch's autocast state is: `backward` has no other way to
//! find the scaler (burn-train's `Learner` calls it inside the user's `TrainStep`, on worker
//! threads when it trains on several devices). One installation per backend type: a second
//! one while the first lives is [`AmpOptimizerError::AlreadyInstalled`](super::AmpOptimizerError).
//! Optimizers that share its scaler ([`AmpOptimizer::share_scaler`](super::AmpOptimizer::share_scaler))
//! are its members: each counts the scaled backwards since its own last step, and their one
//! scale is updated here, at the first backward after their steps ([`PendingUpdate`]).

use core::any::{Any, TypeId};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn_backend::tensor::FloatTensor;
use burn_backend::{AutodiffBackend, Backend, DType, DeviceOps, TensorMetadata};
use burn_std::device::DeviceId;
use burn_std::{FloatDType, Shape};

use super::metrics::{SamplePoint, ScalerMonitor};
use crate::{Amp, Precision};

/// One device's copy of the scale and the backwards scaled with it since each member's last
/// step.
struct DeviceScale {
    device: DeviceId,
    /// `FloatTensor<Inner>`, f32 `[1]`, on `device`; `None` until needed.
    scale: Option<Box<dyn Any + Send>>,
    /// Per member (index: [`join`]'s), the scaled backwards it has not stepped yet.
    scaled_backwards: Vec<u64>,
}

/// The scale update that optimizers sharing one scaler leave for the next backward: their
/// steps must all unscale with the scale their backwards used, so it changes only when a
/// new backward starts. Runs it (when a step left one) and publishes the new scale.
pub(crate) trait PendingUpdate: Send + Sync {
    fn run(&self);
}

/// The installation of one optimizer for one training backend type.
struct Installation {
    backend: TypeId,
    owner: u64,
    /// The scale before the optimizer published one (its config's, or a loaded record's).
    initial_scale: f32,
    /// The optimizer's current scale (`FloatTensor<Inner>` on its main device), copied to
    /// each device on its first backward after a step.
    current: Option<Box<dyn Any + Send>>,
    devices: Vec<DeviceScale>,
    /// Samples memory at the start of backward, when the optimizer tracks it.
    monitor: ScalerMonitor,
    /// Optimizers counting scaled backwards: 1, more when they share the scaler.
    members: usize,
    /// The shared scaler's update, when optimizers share it.
    pending: Option<Arc<dyn PendingUpdate>>,
}

static TABLE: Mutex<Vec<Installation>> = Mutex::new(Vec::new());
/// Installations alive: a backward with none takes no lock.
static INSTALLED: AtomicUsize = AtomicUsize::new(0);
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);
static WARNED_UNSCALED: AtomicBool = AtomicBool::new(false);

fn table() -> std::sync::MutexGuard<'static, Vec<Installation>> {
    // A panic while the lock was held leaves the table consistent (every change is one push,
    // retain or field write), so a poisoned lock is still usable.
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Installs a scaler for the training backend `T`. `Err(owner)` names the live installation
/// that already has it.
pub(crate) fn install<T: 'static>(initial_scale: f32, monitor: ScalerMonitor) -> Result<u64, ()> {
    let mut table = table();
    if table.iter().any(|i| i.backend == TypeId::of::<T>()) {
        return Err(());
    }
    let owner = NEXT_OWNER.fetch_add(1, Ordering::Relaxed);
    table.push(Installation {
        backend: TypeId::of::<T>(),
        owner,
        initial_scale,
        current: None,
        devices: Vec::new(),
        monitor,
        members: 1,
        pending: None,
    });
    INSTALLED.fetch_add(1, Ordering::Release);
    Ok(owner)
}

pub(crate) fn uninstall(owner: u64) {
    let mut table = table();
    let before = table.len();
    table.retain(|i| i.owner != owner);
    if table.len() < before {
        INSTALLED.fetch_sub(1, Ordering::Release);
    }
}

fn with_installation<R>(owner: u64, f: impl FnOnce(&mut Installation) -> R) -> Option<R> {
    table().iter_mut().find(|i| i.owner == owner).map(f)
}

/// A new member of `owner`'s installation, sharing its scaler, whose update then waits for
/// the next backward (`pending`): the member's index for [`take_scaled_backwards`].
pub(crate) fn join(owner: u64, pending: Arc<dyn PendingUpdate>) -> usize {
    with_installation(owner, |i| {
        i.pending = Some(pending);
        i.members += 1;
        i.members - 1
    })
    .expect("joined while its installation lives")
}

/// Publishes the optimizer's scale after a step (or a load): every device's next backward
/// uses it (copied to that device on its first use).
pub(crate) fn publish<IB: Backend>(owner: u64, scale: FloatTensor<IB>) {
    with_installation(owner, |i| {
        i.current = Some(Box::new(scale));
        i.devices.iter_mut().for_each(|d| d.scale = None);
    });
}

/// Sets the scale of backwards before the first published one (after loading a record into
/// an optimizer that has not stepped yet), and forgets the published one.
pub(crate) fn reset(owner: u64, initial_scale: f32) {
    with_installation(owner, |i| {
        i.initial_scale = initial_scale;
        i.current = None;
        i.devices.iter_mut().for_each(|d| d.scale = None);
    });
}

/// Whether gradients that `member` steps on `device` were scaled: the backwards scaled on
/// `device` since its last step (a DDP worker, a single device), else, when the device made
/// none (a main device summing other workers' gradients), those of every device. Resets
/// what it counted, for `member` only.
pub(crate) fn take_scaled_backwards(owner: u64, member: usize, device: DeviceId) -> u64 {
    let mut take = |d: &mut DeviceScale| {
        d.scaled_backwards
            .get_mut(member)
            .map_or(0, core::mem::take)
    };
    with_installation(owner, |i| {
        let own = i
            .devices
            .iter_mut()
            .find(|d| d.device == device)
            .map_or(0, &mut take);
        if own > 0 {
            return own;
        }
        i.devices.iter_mut().map(take).sum()
    })
    .unwrap_or(0)
}

/// Whether an `AmpOptimizer` is installed for the autodiff backend `AB` (`Amp<..>`).
pub(crate) fn is_installed<AB: 'static>() -> bool {
    INSTALLED.load(Ordering::Acquire) != 0
        && table().iter().any(|i| i.backend == TypeId::of::<AB>())
}

/// The root of `Amp<AB>`'s backward: `loss × scale` (in f32) when a scaler is installed for
/// `Amp<AB>` and the thread's precision on the loss's device needs loss scaling, else `loss`.
pub(crate) fn scale_root<AB: AutodiffBackend>(loss: FloatTensor<AB>) -> FloatTensor<AB> {
    if INSTALLED.load(Ordering::Acquire) == 0 {
        warn_if_unscaled_f16::<AB>(&loss);
        return loss;
    }
    let device = AB::float_device(&loss);
    // The memory monitor, and the scale when this backward scales.
    let look = |table: &mut Vec<Installation>| {
        installation_of::<AB>(table).map(|installation| {
            let scaled = Precision::effective::<Amp<AB>>(&device).needs_loss_scaling();
            let scale = scaled.then(|| device_scale::<AB::InnerBackend>(installation, &device));
            (installation.monitor.clone(), scale)
        })
    };
    // One look at the table; optimizers sharing a scaler first update it, outside the table's
    // lock (the update publishes its scale), then this backward takes the scale.
    let found = {
        let mut held = table();
        match installation_of::<AB>(&mut held).and_then(|i| i.pending.clone()) {
            Some(pending) => {
                drop(held);
                pending.run();
                look(&mut table())
            }
            None => look(&mut held),
        }
    };
    let Some((monitor, scale)) = found else {
        warn_if_unscaled_f16::<AB>(&loss);
        return loss;
    };
    // Outside the table's lock: a sample waits for the device.
    monitor.sample(SamplePoint::Backward, &device);
    let Some(scale) = scale else {
        return loss;
    };
    let scale = AB::float_reshape(
        AB::from_inner(scale),
        Shape::from(vec![1; loss.shape().num_dims()]),
    );
    // In f32: an f16 loss times 65536 would overflow before backward starts.
    let loss = match loss.dtype() {
        DType::F32 => loss,
        _ => AB::float_cast(loss, FloatDType::F32),
    };
    AB::float_mul(loss, scale)
}

/// The installation for the autodiff backend `AB` (of `Amp<AB>`).
fn installation_of<AB: 'static>(table: &mut [Installation]) -> Option<&mut Installation> {
    table
        .iter_mut()
        .find(|i| i.backend == TypeId::of::<Amp<AB>>())
}

/// The scale on `device` (copied there, or made from the initial scale, on first use), and
/// one more scaled backward counted there.
fn device_scale<IB: Backend>(i: &mut Installation, device: &IB::Device) -> FloatTensor<IB> {
    let id = device.id();
    let index = match i.devices.iter().position(|d| d.device == id) {
        Some(index) => index,
        None => {
            i.devices.push(DeviceScale {
                device: id,
                scale: None,
                scaled_backwards: Vec::new(),
            });
            i.devices.len() - 1
        }
    };
    let current = i
        .current
        .as_ref()
        .and_then(|c| c.downcast_ref::<FloatTensor<IB>>())
        .cloned();
    let initial = i.initial_scale;
    let entry = &mut i.devices[index];
    entry.scaled_backwards.resize(i.members, 0);
    entry.scaled_backwards.iter_mut().for_each(|n| *n += 1);
    if let Some(scale) = entry
        .scale
        .as_ref()
        .and_then(|s| s.downcast_ref::<FloatTensor<IB>>())
    {
        return scale.clone();
    }
    let scale = match current {
        Some(current) => IB::float_to_device(current, device),
        None => crate::grads::primitive(crate::grads::f32_scalar::<IB>(initial, device)),
    };
    entry.scale = Some(Box::new(scale.clone()));
    scale
}

/// An f16 backward with no loss scaler: gradients below 6e-8 flush to zero, silently. Said
/// once per process (a hand-written loop that scales with `GradScaler::scale` is fine).
fn warn_if_unscaled_f16<AB: AutodiffBackend>(loss: &FloatTensor<AB>) {
    if WARNED_UNSCALED.load(Ordering::Relaxed) {
        return;
    }
    let device = AB::float_device(loss);
    if Precision::effective::<Amp<AB>>(&device).needs_loss_scaling()
        && !WARNED_UNSCALED.swap(true, Ordering::Relaxed)
    {
        log::warn!(
            "burn-amp: backward at f16 with no AmpOptimizer installed: unless this loop scales \
             the loss itself (GradScaler::scale), small gradients flush to zero. Wrap the \
             optimizer: AmpOptimizer::new(optim, GradScalerConfig::new())"
        );
    }
}
