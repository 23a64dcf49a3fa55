//! A device whose stream ended. After a kernel that fails to compile or launch, CubeCL keeps
//! the error, and reads on that device fail with it ("the server is in an invalid state"): in
//! the case that launched it and, with the errors it left (one per failed launch), in the
//! cases after it, and the speed part with them; burn-fusion's handles may be left behind too
//! (tracel-ai/burn#5352). A process cannot be sure of its device again; a new one can. So
//! after a failed case `gpu_check` syncs and reads one value; when either fails it writes a
//! `device_lost` line saying where to go on (`resume`), stops, and exits with
//! [`DEVICE_LOST`]; `gpu-check.sh` starts it again with `--resume <that>`. A failed case whose
//! error was read and left nothing behind goes on in the same process.
//!
//! Seen on the stand-in driver (README, "CUDA without a GPU"): Burn 0.21's fused-matmul
//! autotune key leaves out the operands' vector size, which a fused bool (one byte) widens
//! from 8 to 16 halves; a winner tuned at 8 then fails to compile at 16.

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::tensor::{Tensor, backend::Backend};
use serde_json::json;

use crate::report::Report;

/// `gpu_check`'s exit status when it stopped on a lost device (`gpu-check.sh` resumes it).
pub const DEVICE_LOST: i32 = 3;

/// Where a new process goes on (`--resume`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// The speed part (the correctness part lost the device).
    Speed,
    /// The numerics part, from this step on (the steps before it ran in earlier processes).
    Numerics(usize),
}

impl std::str::FromStr for Resume {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            None if s == "speed" => Ok(Self::Speed),
            Some(("numerics", step)) => step
                .parse()
                .map(Self::Numerics)
                .map_err(|e| format!("--resume numerics:<step>: {e}")),
            _ => Err(format!(
                "--resume takes speed or numerics:<step> (a device_lost line's `resume`), not {s:?}"
            )),
        }
    }
}

impl std::fmt::Display for Resume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Speed => write!(f, "speed"),
            Self::Numerics(step) => write!(f, "numerics:{step}"),
        }
    }
}

/// A case ended the device's stream; its `device_lost` line says where to resume.
#[derive(Debug)]
pub struct DeviceLost;

/// Whether `device` still syncs and reads: a failed case may have failed on its own values
/// (the device fine) or on a kernel that ended the stream; an error its reads did not take
/// fails the sync. Only the read's error counts, not its value: the stand-in driver runs no
/// kernel.
pub fn device_reads<B: Backend>(device: &B::Device) -> bool {
    catch_unwind(AssertUnwindSafe(|| {
        B::sync(device).is_ok()
            && Tensor::<B, 1>::from_floats([1.0, 2.0], device)
                .add_scalar(1.0)
                .try_into_data()
                .is_ok()
    }))
    .unwrap_or(false)
}

/// Writes the `device_lost` line and returns what the caller stops with.
pub fn lost(report: &mut Report, after: &str, resume: Resume, simulated: bool) -> DeviceLost {
    eprintln!("gpu_check: the device's stream ended after {after}; resume with --resume {resume}");
    report.emit(json!({
        "kind": "device_lost", "after": after, "resume": resume.to_string(),
        "simulated": simulated,
    }));
    DeviceLost
}

/// The numerics part's steps, counted in the order they run, so that a new process skips
/// those an earlier one ran.
pub struct Steps {
    next: usize,
    from: usize,
    simulate_at: Option<usize>,
}

impl Steps {
    /// `from`: the first step to run; `simulate_at`: a step after which the device counts as
    /// lost (CI's check of the resumption, on a device that cannot be made to lose its stream).
    pub fn new(from: usize, simulate_at: Option<usize>) -> Self {
        Self {
            next: 0,
            from,
            simulate_at,
        }
    }

    /// The index of the step about to come, when it runs in this process.
    pub fn start(&mut self) -> Option<usize> {
        let step = self.next;
        self.next += 1;
        (step >= self.from).then_some(step)
    }

    /// After step `step` (`failed` or not): `Err` when the device no longer reads.
    pub fn check<B: Backend>(
        &self,
        step: usize,
        failed: bool,
        after: &str,
        device: &B::Device,
        report: &mut Report,
    ) -> Result<(), DeviceLost> {
        let resume = Resume::Numerics(step + 1);
        if self.simulate_at == Some(step) {
            return Err(lost(report, after, resume, true));
        }
        if failed && !device_reads::<B>(device) {
            return Err(lost(report, after, resume, false));
        }
        Ok(())
    }
}
