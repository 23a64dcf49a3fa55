//! A backtrace taken at the op, trimmed to the model's frames.
//!
//! `std::backtrace::Backtrace` gives its frames only as text on stable Rust; the format is
//! `  N: function` followed by `      at file:line:col`, which is what is parsed here.

use serde::Serialize;

/// One frame of a backtrace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Frame {
    /// The function, demangled (`my_model::Block::forward`).
    pub function: String,
    /// `file:line:col` where debug info has it.
    pub location: Option<String>,
}

impl core::fmt::Display for Frame {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match &self.location {
            Some(at) => write!(f, "{} ({at})", self.function),
            None => f.write_str(&self.function),
        }
    }
}

/// The call stack here, as frames.
pub(crate) fn capture() -> Vec<Frame> {
    parse(&std::backtrace::Backtrace::force_capture().to_string())
}

pub(crate) fn parse(text: &str) -> Vec<Frame> {
    let mut frames: Vec<Frame> = Vec::new();
    for line in text.lines() {
        let line = line.trim_start();
        if let Some(at) = line.strip_prefix("at ") {
            if let Some(last) = frames.last_mut() {
                last.location.get_or_insert_with(|| at.to_string());
            }
        } else if let Some((index, function)) = line.split_once(": ")
            && index.chars().all(|c| c.is_ascii_digit())
        {
            frames.push(Frame {
                function: function.to_string(),
                location: None,
            });
        }
    }
    frames
}

/// Crates whose frames are the machinery between the model and the device.
const MACHINERY: &[&str] = &[
    "std::",
    "core::",
    "alloc::",
    "test::",
    "backtrace::",
    "burn_amp::",
    "burn_backend::",
    "burn_tensor::",
    "burn_autodiff::",
    "burn_fusion::",
    "burn_cubecl::",
    "burn_flex::",
    "burn_ndarray::",
    "burn_wgpu::",
    "burn_cuda::",
    "burn_ir::",
    "burn_std::",
    "burn_router::",
    "cubecl",
    "rayon",
    "__rust",
    "rust_begin_unwind",
    "_start",
    "__libc",
    "start_thread",
    "clone",
    // the test harness's `<fn() -> Result<..> as FnOnce<()>>::call_once`
    "fn(",
    "&dyn core::",
];

fn crate_of(function: &str) -> &str {
    // `<burn_amp::backend::Amp<B> as ...>::float_exp` is burn_amp's.
    function.trim_start_matches('<')
}

/// Whether the frame is the model's or its caller's (not the runtime's).
pub(crate) fn is_user_frame(frame: &Frame) -> bool {
    let f = crate_of(&frame.function);
    // `main` alone is the C entry point; the program's is `crate::main`.
    let by_name = f != "main" && !MACHINERY.iter().any(|m| f.starts_with(m));
    by_name && !frame.location.as_deref().is_some_and(is_machinery_file)
}

/// Folders of code that is not the model's: std's sources and the crates cargo fetched.
const MACHINERY_DIRS: &[&str] = &["/rustc/", "/.cargo/registry/", "/.cargo/git/"];

/// Whether a frame's `file:line:col` is std's, a fetched dependency's or burn-amp's own.
///
/// Debug info limited to line tables (`debug = "line-tables-only"`, this crate's own dev
/// profile) names functions without their path (`check<B>`, not
/// `burn_amp::doctor::anomaly::check<B>`), so names alone cannot tell the model from the
/// machinery; the files can.
fn is_machinery_file(location: &str) -> bool {
    // Strip `:line:col`.
    let file = location.rsplitn(3, ':').last().unwrap_or(location);
    MACHINERY_DIRS.iter().any(|d| file.contains(d)) || is_own_source(file)
}

/// Whether `file` is in burn-amp's `src/`. Cargo names the files of the package it builds
/// relative to it (`./src/..`), and runs tests and examples from there.
fn is_own_source(file: &str) -> bool {
    let own = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let path = std::path::Path::new(file);
    if path.is_absolute() {
        return path.starts_with(&own);
    }
    std::env::current_dir().is_ok_and(|dir| dir.join(path).starts_with(&own))
}

/// The frames from the first user frame on, without the runtime's.
pub(crate) fn trim(frames: &[Frame]) -> Vec<Frame> {
    frames
        .iter()
        .filter(|f| is_user_frame(f))
        .cloned()
        .collect()
}

/// Whether the stack is inside autodiff's backward pass.
pub(crate) fn in_backward(frames: &[Frame]) -> bool {
    frames.iter().any(|f| {
        f.function.contains("burn_autodiff")
            && (f.function.contains("Backward") || f.function.contains("::backward"))
    })
}

/// The forward op whose backward step is on the stack: autodiff names its backward structs
/// inside the forward op's method (`...>::float_exp::Exp as ...Backward<..>>::backward`).
pub(crate) fn forward_op(frames: &[Frame]) -> Option<String> {
    frames.iter().find_map(|f| {
        let head = f
            .function
            .split(" as burn_autodiff::ops::backward::Backward")
            .next()?;
        if head.len() == f.function.len() {
            return None;
        }
        // `...>::float_exp::Exp` (or `...>::float_exp::{{closure}}::Exp`): the method's name
        // is the segment after the impl's closing `>::`.
        let tail = head.rsplit(">::").next()?;
        let method = tail.split("::").next()?;
        (!method.is_empty()).then(|| method.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "   0: std::backtrace_rs::backtrace::libunwind::trace
             at /rustc/x/library/std/src/../../backtrace/src/backtrace/libunwind.rs:117:9
   1: <burn_amp::backend::Amp<B> as burn_backend::backend::ops::tensor::FloatTensorOps<burn_amp::backend::Amp<B>>>::float_exp
             at ./src/backend/ops/float.rs:83:9
   2: <burn_autodiff::ops::tensor::<impl burn_backend::backend::ops::tensor::FloatTensorOps<burn_autodiff::backend::Autodiff<B,C>> for burn_autodiff::backend::Autodiff<B,C>>::float_exp::Exp as burn_autodiff::ops::backward::Backward<B,1_usize>>::backward
   3: doctor::anomaly::model::Overflow<B>::forward
             at ./tests/doctor/anomaly.rs:40:17
   4: core::ops::function::FnOnce::call_once
";

    #[test]
    fn parses_trims_and_names_the_forward_op() {
        let frames = parse(TEXT);
        assert_eq!(frames.len(), 5);
        assert_eq!(
            frames[1].location.as_deref(),
            Some("./src/backend/ops/float.rs:83:9")
        );
        let user = trim(&frames);
        assert_eq!(user.len(), 1);
        assert_eq!(
            user[0].function,
            "doctor::anomaly::model::Overflow<B>::forward"
        );
        assert!(in_backward(&frames));
        assert!(!in_backward(&user));
        assert_eq!(forward_op(&frames).as_deref(), Some("float_exp"));
    }

    /// With line tables only, functions are named without their path: the files tell.
    #[test]
    fn line_table_names_are_trimmed_by_their_files() {
        let own = concat!(env!("CARGO_MANIFEST_DIR"), "/src/doctor/anomaly.rs");
        let text = format!(
            "   0: check<Flex>
             at {own}:389:18
   1: float_matmul<Flex>
             at ./src/backend/macros.rs:67:23
   2: matmul<Amp<Flex>>
             at /root/.cargo/registry/src/index.crates.io-1/burn-tensor-0.21.0/src/tensor/api/numeric.rs:935:21
   3: overflowing_matmul
             at ./tests/doctor/anomaly.rs:24:15
   4: call_once<fn()>
             at /rustc/59807616e/library/core/src/ops/function.rs:250:5
"
        );
        let frames = parse(&text);
        assert_eq!(frames.len(), 5);
        // The test runs from the package's folder, as cargo runs it: `./src` is burn-amp's.
        let user = trim(&frames);
        let names: Vec<&str> = user.iter().map(|f| f.function.as_str()).collect();
        assert_eq!(names, ["overflowing_matmul"]);
    }
}
