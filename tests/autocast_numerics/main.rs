//! Numerics of autocast against f32 references, where half precision breaks results outright:
//! average pooling over large windows, deformable convolution at large coordinates, the
//! softmax of attention under autodiff, probabilities (sigmoid) fed to a binary
//! cross-entropy, and an explicit precision the device cannot run.
//!
//! Every comparison states its tolerance; the references run the same values in f32.
//!
//! Layout: this file holds the shared helpers and `flex_and_wgpu_tests!`; `pooling.rs`,
//! `deform_conv.rs`, `attention.rs`, `probabilities.rs` (which also declares this binary's
//! counting `#[global_allocator]`, for the SiLU measurement) and `support.rs` the tests;
//! `cast_cache.rs`, `shared_casts.rs`, `upcast.rs` and `recompute.rs` test what autodiff keeps
//! under autocast (gradients bitwise, bytes by hand); `modules/` burn-nn's modules and
//! losses as a model holds them, against f32; `custom_op.rs` an op of the user's own backend
//! trait (`burn_amp::custom_op`).

#[path = "../common/mod.rs"]
mod common;

/// The three tests of a check `check::<B>(device, precision)`: on Flex in f16 and in bf16,
/// and on wgpu in f16 where this machine has an adapter.
macro_rules! flex_and_wgpu_tests {
    ($check:ident: $flex_f16:ident, $flex_bf16:ident, $wgpu_f16:ident) => {
        #[test]
        fn $flex_f16() {
            $check::<burn::backend::Flex>(&Default::default(), Precision::F16);
        }

        #[test]
        fn $flex_bf16() {
            $check::<burn::backend::Flex>(&Default::default(), Precision::Bf16);
        }

        #[test]
        fn $wgpu_f16() {
            if let Some(device) = common::wgpu_device() {
                $check::<burn::backend::Wgpu>(&device, Precision::F16);
            }
        }
    };
}

mod attention;
mod cast_cache;
mod custom_op;
mod deform_conv;
mod empty;
mod empty_reductions;
mod gradient_check;
mod grid_sample;
mod half_sums;
mod indexing;
mod infinities;
mod int_pow;
mod interpolate;
mod modules;
mod nan_propagation;
mod opmath;
mod pooling;
mod powers;
mod probabilities;
mod products;
mod random_graphs;
mod random_pools;
mod recompute;
mod remainder;
mod repeat;
mod scalars;
mod shared_casts;
mod spectral;
mod support;
mod upcast;
mod workarounds;

include!("helpers.rs");
