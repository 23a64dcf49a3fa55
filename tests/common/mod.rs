//! Shared test support: backends, devices, the op harness.
#![allow(dead_code)]

pub mod harness;
pub mod policy_ops;

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
    std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
}
