//! Shared test support: devices, models, record and timing helpers, the op harness. The
//! benches include this module by path, the examples `tiny_lm.rs` alone.
#![allow(dead_code)]

pub mod ema_placements;
pub mod harness;
pub mod memory;
pub mod models;
pub mod policy_ops;
pub mod tiny_lm;

use std::time::Duration;

use burn::prelude::Backend;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};

use burn::backend::wgpu::WgpuDevice;

/// The lavapipe (CPU Vulkan) device, or `None` where this machine has no Vulkan adapter.
///
/// Where `CI` is set a missing adapter is a failure, never a silent skip.
pub fn wgpu_device() -> Option<WgpuDevice> {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // Vulkan loaders warn (and some fail) without it.
        let dir = std::env::temp_dir().join("burn-amp-xdg");
        let _ = std::fs::create_dir_all(&dir);
        // SAFETY: set once, before any thread of this test reads the environment for Vulkan.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", dir) };
    }
    let device = WgpuDevice::default();
    let probe = std::panic::catch_unwind(|| {
        use burn::tensor::Tensor;
        let t = Tensor::<burn::backend::Wgpu, 1>::from_floats([1.0, 2.0], &device);
        t.sum().into_scalar()
    });
    match probe {
        Ok(v) if (v - 3.0).abs() < 1e-6 => Some(WgpuDevice::default()),
        outcome => {
            let msg = format!(
                "no working wgpu (Vulkan) adapter: {outcome:?}. Install the CPU Vulkan device: \
                 apt-get install -y mesa-vulkan-drivers libvulkan1"
            );
            if std::env::var_os("CI").is_some() {
                panic!("{msg}");
            }
            eprintln!("SKIPPED (not in CI): {msg}");
            None
        }
    }
}

/// Runs `f` on a thread with a large stack: debug builds of deep burn calls need it.
pub fn big_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    join(spawn_big_stack(f))
}

/// Starts `f` on a thread with a large stack, for runs side by side ([`join`] each).
pub fn spawn_big_stack<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(f)
        .unwrap()
}

/// The thread's result; its panic, if it panicked, goes on in this thread.
pub fn join<T>(handle: std::thread::JoinHandle<T>) -> T {
    handle
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// A record as bytes, at full precision (what a checkpoint on disk holds).
pub fn save<B: Backend, R: Record<B>>(record: R) -> Vec<u8> {
    BinBytesRecorder::<FullPrecisionSettings>::default()
        .record(record, ())
        .unwrap()
}

/// A record back from [`save`]'s bytes, onto `device`.
pub fn load<B: Backend, R: Record<B>>(bytes: Vec<u8>, device: &B::Device) -> R {
    BinBytesRecorder::<FullPrecisionSettings>::default()
        .load(bytes, device)
        .unwrap()
}

/// The median of `v`.
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Bytes as MiB, for tables.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// xorshift64*: reproducible data without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

/// A weight average's updates `ema ← ema + (1 − d_n)(w − ema)` over `weights` (the first is
/// the start), in f64; `d_n` as the device computes it, in f32 (with `warmup`,
/// `min(decay, (1 + n) / (10 + n))`).
pub fn ema_reference(weights: &[Vec<f32>], decay: f64, warmup: bool) -> Vec<f64> {
    let mut ema: Vec<f64> = weights[0].iter().map(|&w| w as f64).collect();
    for (n, w) in weights[1..].iter().enumerate() {
        let d = if warmup {
            ((1.0 + n as f32) / (10.0 + n as f32)).min(decay as f32)
        } else {
            decay as f32
        };
        let rate = (1.0 - d) as f64;
        for (e, &w) in ema.iter_mut().zip(w) {
            *e += rate * (w as f64 - *e);
        }
    }
    ema
}

/// The largest absolute difference between `got` and `want`, element by element.
pub fn largest_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .fold(0.0, |m, (&g, &w)| m.max((g as f64 - w).abs()))
}
