//! The kernel checks of `tests/kernels`, compiled in: each of its files lists its checks with
//! `on_both!`, which the tests turn into `#[test]`s on wgpu and this module into a list of
//! cases for any backend. Every case in f16 also runs in bf16 where the device has it: the
//! kernels pick the float type at run time, and WGSL has no bf16, so only a GPU runs those.

use crate::common;

include!("../../tests/kernels/support.rs");

/// One check, ready to run on a device of `B`; it panics when the kernel and the fallback
/// disagree (the tests' `assert!`s).
pub struct KernelCase<B: Backend> {
    pub name: String,
    /// The float type the case runs in, where it has one.
    pub dtype: Option<FloatDType>,
    pub run: Box<dyn Fn(&B::Device)>,
}

impl<B: Backend> KernelCase<B> {
    fn new(
        module: &str,
        name: &str,
        dtype: Option<FloatDType>,
        run: impl Fn(&B::Device) + 'static,
    ) -> Self {
        let module = module.rsplit("::").next().unwrap_or(module);
        Self {
            name: format!("{module}::{name}"),
            dtype,
            run: Box::new(run),
        }
    }
}

macro_rules! on_both {
    ($($name:ident: $check:ident($($arg:tt)*);)+) => {
        pub(crate) fn cases<B: AmpKernels>() -> Vec<crate::kernel_cases::KernelCase<B>> {
            let mut cases = Vec::new();
            $(on_both!(@case cases, $name, $check, ($($arg)*));)+
            cases
        }
    };
    (@case $cases:ident, $name:ident, $check:ident, (FloatDType::F16 $($rest:tt)*)) => {
        $cases.push(crate::kernel_cases::KernelCase::new(
            module_path!(), stringify!($name), Some(FloatDType::F16),
            |d: &B::Device| $check::<B>(d, FloatDType::F16 $($rest)*),
        ));
        $cases.push(crate::kernel_cases::KernelCase::new(
            module_path!(), concat!(stringify!($name), " (its f16 as bf16)"), Some(FloatDType::BF16),
            |d: &B::Device| $check::<B>(d, FloatDType::BF16 $($rest)*),
        ));
    };
    (@case $cases:ident, $name:ident, $check:ident, (FloatDType::F32 $($rest:tt)*)) => {
        $cases.push(crate::kernel_cases::KernelCase::new(
            module_path!(), stringify!($name), Some(FloatDType::F32),
            |d: &B::Device| $check::<B>(d, FloatDType::F32 $($rest)*),
        ));
    };
    (@case $cases:ident, $name:ident, $check:ident, ($($arg:tt)*)) => {
        $cases.push(crate::kernel_cases::KernelCase::new(
            module_path!(), stringify!($name), None,
            |d: &B::Device| $check::<B>(d, $($arg)*),
        ));
    };
}

#[path = "../../tests/kernels/accumulate.rs"]
mod accumulate;
#[path = "../../tests/kernels/ema.rs"]
mod ema;
#[path = "../../tests/kernels/optim.rs"]
mod optim;
#[path = "../../tests/kernels/scaler.rs"]
mod scaler;

/// Every kernel case, on `B`.
pub fn all<B: AmpKernels>() -> Vec<KernelCase<B>> {
    [
        scaler::cases::<B>(),
        accumulate::cases::<B>(),
        ema::cases::<B>(),
        optim::cases::<B>(),
        optim::adamw::cases::<B>(),
        optim::sgd::cases::<B>(),
        optim::scaled::cases::<B>(),
        optim::quantized::cases::<B>(),
    ]
    .into_iter()
    .flatten()
    .collect()
}
