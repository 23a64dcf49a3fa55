//! How a bench was started: `cargo bench` passes `--bench`; under `cargo test --all-targets`
//! (or with `--quick`) it runs small, as a smoke test, so that it cannot rot.

/// Whether to run the small sizes.
pub fn quick() -> bool {
    let args: Vec<String> = std::env::args().collect();
    args.iter().any(|a| a == "--quick") || !args.iter().any(|a| a == "--bench")
}

/// wgpu's Vulkan loader wants a runtime directory; CI containers have none.
#[allow(dead_code)] // not every bench runs wgpu
pub fn ensure_runtime_dir() {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // SAFETY: called first in `main`, before any other thread exists.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
}
