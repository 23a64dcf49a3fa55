//! The numerics part: the checks of `tests/autocast_numerics`, compiled in (as `kernel_cases`
//! compiles the kernel checks) and run on the target's backend, which the tests never see
//! (CUDA, and bf16 on a CubeCL backend: WGSL has none):
//! - what autodiff keeps under autocast (the weight-cast cache, shared activation casts,
//!   recomputed widening and outputs: gradients bitwise those of the plain run, and within
//!   half precision of f32), pooling, deformable convolution, attention and an op of the
//!   user's own backend trait (`CustomOp`) against f32, at f16 and bf16;
//! - the Burn 0.21 defects `Amp` works around: products with signs and zeros against an f64
//!   reference, interpolation's backward against Flex's, picks broadcast by fused ops, average
//!   pools' gradients (and whether plain Burn gets those wrong on this backend too), the
//!   backward of `rfft`, `irfft` and `topk`, `gather_nd` and `scatter_nd` at repeated indices,
//!   `grid_sample` in every mode, `repeat`'s gradient, integer powers, the remainder of half
//!   tensors, NaN propagation, ops on empty tensors (on CUDA, plain Burn's refused launches);
//! - random graphs, drawn while the time lasts: fused against unfused (f32, f16, bf16), Flex
//!   against the unfused kernels (f32), and every saving of autocast on and off.
//!
//! It runs alone (`--only numerics`), within `budget`: a case that cannot start in time is a
//! `skipped` line, never a failure. Each case is one JSON line, as in `correctness`. Its steps
//! (each case, each random graph's comparison, each plain-Burn canary) are counted, so that
//! after a case that ended the device's stream a new process goes on with the next one
//! (`device_lost`).

#![allow(dead_code, unused_imports, clippy::all)]

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn_amp::Amp;
use serde_json::json;

use crate::common;
use crate::correctness::{Outcome, timed};
use crate::device_lost::{DeviceLost, Steps};
use crate::report::Report;
use crate::{Device, Target};

// The tests turn each check into `#[test]`s on Flex and wgpu; here they are listed by hand.
macro_rules! flex_and_wgpu_tests {
    ($($anything:tt)*) => {};
}

include!("../../tests/autocast_numerics/helpers.rs");

#[path = "../../tests/autocast_numerics/attention.rs"]
mod attention;
#[path = "../../tests/autocast_numerics/cast_cache.rs"]
mod cast_cache;
#[path = "../../tests/autocast_numerics/custom_op.rs"]
pub(crate) mod custom_op;
#[path = "../../tests/autocast_numerics/deform_conv.rs"]
mod deform_conv;
#[path = "../../tests/autocast_numerics/empty.rs"]
mod empty;
#[path = "../../tests/autocast_numerics/empty_reductions.rs"]
mod empty_reductions;
// Not run here (Flex in f64, no backend of the target's): the random graphs' module uses it.
#[path = "../../tests/autocast_numerics/gradient_check/mod.rs"]
mod gradient_check;
#[path = "../../tests/autocast_numerics/grid_sample.rs"]
mod grid_sample;
#[path = "../../tests/autocast_numerics/half_sums.rs"]
mod half_sums;
#[path = "../../tests/autocast_numerics/indexing.rs"]
mod indexing;
#[path = "../../tests/autocast_numerics/infinities.rs"]
mod infinities;
#[path = "../../tests/autocast_numerics/int_pow.rs"]
mod int_pow;
#[path = "../../tests/autocast_numerics/interpolate.rs"]
mod interpolate;
#[path = "../../tests/autocast_numerics/modules/mod.rs"]
mod modules;
#[path = "../../tests/autocast_numerics/nan_propagation.rs"]
mod nan_propagation;
#[path = "../../tests/autocast_numerics/opmath.rs"]
mod opmath;
#[path = "../../tests/autocast_numerics/pooling.rs"]
mod pooling;
#[path = "../../tests/autocast_numerics/powers.rs"]
mod powers;
#[path = "../../tests/autocast_numerics/products.rs"]
mod products;
#[path = "../../tests/autocast_numerics/random_graphs/mod.rs"]
mod random_graphs;
#[path = "../../tests/autocast_numerics/random_pools.rs"]
mod random_pools;
#[path = "../../tests/autocast_numerics/recompute.rs"]
mod recompute;
#[path = "../../tests/autocast_numerics/remainder.rs"]
mod remainder;
#[path = "../../tests/autocast_numerics/repeat.rs"]
mod repeat;
#[path = "../../tests/autocast_numerics/shared_casts.rs"]
mod shared_casts;
#[path = "../../tests/autocast_numerics/spectral.rs"]
mod spectral;
#[path = "../../tests/autocast_numerics/upcast.rs"]
mod upcast;
#[path = "../../tests/autocast_numerics/workarounds.rs"]
mod workarounds;

mod graphs;

use graphs::graphs_while_time_lasts;

/// A check at one precision on the fused backend.
type AtPrecision<T> = fn(&Device<T>, Precision);

/// The precision-parameterized checks of the tests, by name.
fn at_precision<T: Target>() -> Vec<(&'static str, AtPrecision<T>)> {
    type F<T> = <T as Target>::Fused;
    vec![
        (
            "cast_cache: cached gradients are those of a cast per use",
            cast_cache::cached_gradients_are_those_of_a_cast_per_use::<F<T>> as AtPrecision<T>,
        ),
        (
            "cast_cache: two graphs over one copy keep their gradients",
            cast_cache::two_graphs_over_one_copy_keep_their_gradients::<F<T>> as AtPrecision<T>,
        ),
        (
            "shared_casts: shared gradients are those of a cast per use",
            shared_casts::shared_gradients_are_those_of_a_cast_per_use::<F<T>> as AtPrecision<T>,
        ),
        (
            "upcast: recomputed gradients are those of a kept cast",
            upcast::recomputed_gradients_are_those_of_a_kept_cast::<F<T>> as AtPrecision<T>,
        ),
        (
            "recompute: recomputed gradients are those of kept outputs",
            recompute::recomputed_gradients_are_those_of_kept_outputs::<F<T>> as AtPrecision<T>,
        ),
        (
            "pooling: average pooling against f32",
            pooling::pooling_matches_f32::<F<T>> as AtPrecision<T>,
        ),
        (
            "pooling: backward of 64x64 windows",
            (|_, precision| pooling::pooling_backward::<Amp<Autodiff<F<T>>>>(precision))
                as AtPrecision<T>,
        ),
        (
            "deform_conv: against f32 at large coordinates",
            deform_conv::deform_conv_matches_f32::<F<T>> as AtPrecision<T>,
        ),
        (
            "modules: 78 burn-nn layers, activations, losses and architecture blocks, loss, gradients and state against f32",
            modules::check_modules::<F<T>> as AtPrecision<T>,
        ),
        (
            "custom_op: a backend trait of the user's own, its inputs lowered, against f32",
            custom_op::lowered::<F<T>> as AtPrecision<T>,
        ),
        (
            "custom_op: an op with three outputs (run_many), each and the gradients against f32",
            custom_op::several_outputs::<F<T>> as AtPrecision<T>,
        ),
        (
            "attention: softmax in f32 (large logits, 70,000 keys), gradients",
            (|_, precision| attention::check_attention::<Amp<Autodiff<F<T>>>>(precision, true))
                as AtPrecision<T>,
        ),
        (
            "attention: raw products past f16 scaled first, rows that see no key, against f32",
            attention::check_attention_edges::<F<T>> as AtPrecision<T>,
        ),
    ]
}

/// f32 and the dtypes of `lows`: an op's input in f32, or made by a lowered op.
fn f32_and(lows: &[Precision]) -> Vec<DType> {
    std::iter::once(DType::F32)
        .chain(
            lows.iter()
                .map(|p| p.low_dtype().expect("a low precision").into()),
        )
        .collect()
}

/// Runs the numerics part's `steps` (those from where an earlier process stopped) within
/// `budget`, random graphs on at most `seeds` seeds (while time lasts without it); returns how
/// many cases failed, or where to go on when a case ended the device's stream.
pub fn run<T: Target>(
    device: &Device<T>,
    lows: &[Precision],
    budget: Duration,
    seeds: Option<u64>,
    steps: &mut Steps,
    report: &mut Report,
) -> Result<usize, DeviceLost> {
    type F<T> = <T as Target>::Fused;
    let deadline = Instant::now() + budget;
    let mut failed = 0;
    let mut case = |suite: &str,
                    name: &str,
                    dtype: &str,
                    f: &mut dyn FnMut() -> Result<String, String>|
     -> Result<(), DeviceLost> {
        let Some(step) = steps.start() else {
            return Ok(());
        };
        if Instant::now() >= deadline {
            report.emit(json!({"kind": "skipped", "suite": suite, "case": name, "dtype": dtype,
                "why": format!("the numerics part's {} s were spent (--numerics-seconds)", budget.as_secs())}));
            return Ok(());
        }
        eprintln!("gpu_check: {suite}: {name} {dtype}");
        let outcome: Outcome = timed(|| f());
        failed += usize::from(outcome.error.is_some());
        report.emit(json!({
            "kind": "correctness", "suite": suite, "case": name, "variant": "fusion",
            "dtype": dtype, "ok": outcome.error.is_none(), "error": outcome.error,
            "detail": outcome.detail, "ms": outcome.ms, "step": step,
        }));
        let after = format!("{suite}: {name} {dtype}");
        steps.check::<F<T>>(
            step,
            outcome.error.is_some(),
            after.trim_end(),
            device,
            report,
        )
    };
    let ok = |what: &str| Ok::<String, String>(what.to_string());

    for &precision in lows {
        for (name, check) in at_precision::<T>() {
            case("numerics", name, &precision.to_string(), &mut || {
                check(device, precision);
                ok("as in tests/autocast_numerics")
            })?;
        }
    }

    // f32 matmuls may run in TF32 on CUDA: 2e-3 rather than 1e-5 for interpolation's backward.
    let matmul_tolerance = if T::TF32 { 2e-3 } else { 1e-5 };
    let workarounds: Vec<(&str, Box<dyn Fn() -> Result<String, String> + '_>)> = vec![
        (
            "products: prod, prod_dim, cumprod with signs and zeros against f64, values and gradients",
            Box::new(|| {
                products::check::<Amp<Autodiff<F<T>>>>(device, T::NAME);
                products::transposed::<Amp<Autodiff<F<T>>>>(device, T::NAME);
                ok("within 1e-6 of the f64 reference, transposed views too")
            }),
        ),
        (
            "interpolate: backward of bilinear, bicubic, lanczos3 against Flex's",
            Box::new(move || {
                interpolate::backpropagates_as_on_flex::<F<T>>(device, T::NAME, matmul_tolerance);
                Ok(format!(
                    "4 modes x align_corners x 3 sizes within {matmul_tolerance:e} of Flex"
                ))
            }),
        ),
        (
            "picks broadcast by fused ops",
            Box::new(|| {
                let plain = workarounds::picks_are_right::<F<T>>(device);
                workarounds::pick_gradients_are_right::<F<T>>(device);
                let plain: Vec<String> = plain
                    .iter()
                    .map(|(pick, n)| format!("{pick} {n}"))
                    .collect();
                Ok(format!(
                    "Flex's values and gradients under Amp; plain {} gets wrong: {}",
                    T::NAME,
                    plain.join(", ")
                ))
            }),
        ),
        (
            "deform_conv2d's offset and mask gradients (wrong in burn-cubecl 0.21) against Flex's",
            Box::new(move || {
                let plain =
                    deform_conv::deform_conv_gradients_match_flex::<F<T>>(device, matmul_tolerance);
                Ok(format!(
                    "2 options x mask x bias within {matmul_tolerance:e} of Flex, Amp above and \
                     below autodiff; plain {}'s offset gradient {plain:.2e} from Flex's",
                    T::NAME
                ))
            }),
        ),
        (
            "gelu's gradient (the tanh approximation's derivative in Burn 0.21) against its derivative",
            Box::new(move || {
                let plain = opmath::gelu_gradient_is_exact::<F<T>>(device);
                Ok(format!(
                    "f32, 4001 inputs in [-6, 6] within 1e-6 of the f64 derivative, Amp above \
                     and below autodiff; plain {}'s {plain:.2e} off",
                    T::NAME
                ))
            }),
        ),
        (
            "modules with autocast off: the 78 module checks in f32 against Flex's",
            Box::new(move || {
                modules::check_modules_at_f32::<F<T>>(device, matmul_tolerance);
                Ok(format!(
                    "outputs, gradients and state within {matmul_tolerance:e} of Flex's, Amp \
                     above and below autodiff"
                ))
            }),
        ),
        (
            "avg_pool2d's gradient, 1x1 outputs and channels-last gradients, against Flex's",
            Box::new(|| {
                workarounds::avg_pool_gradients_are_right::<F<T>>(device);
                ok("11 pools within 1e-6 of Flex, Amp above and below autodiff")
            }),
        ),
        (
            "200 random pools (avg, max, adaptive; 2d, 1d; channels-last too) against Flex's",
            Box::new(|| {
                let (compared, padding_windows, _) =
                    random_pools::random_pools_agree_with_flex::<F<T>>(device, 200, false);
                Ok(format!(
                    "{compared} compared ({padding_windows} with a ceil_mode window of padding \
                     alone), outputs and gradients within 1e-5 of Flex, Amp above and below \
                     autodiff"
                ))
            }),
        ),
        (
            "backward of rfft, irfft and topk (none in burn-autodiff), argtopk, against an f64 DFT",
            Box::new(|| {
                for &precision in lows {
                    spectral::spectral_ops_and_topk_backpropagate::<F<T>>(device, precision);
                }
                ok(
                    "spectra, signals and gradients within 1e-5 of the f64 DFT (n truncating, \
                    padding, length 1), top-k values and gradients exact",
                )
            }),
        ),
        (
            "gather_nd and scatter_nd at repeated indices (CubeCL's scatter_nd loses updates), \
             int ones under autodiff (none in burn-autodiff)",
            Box::new(|| {
                for &precision in lows {
                    indexing::gather_nd_and_scatter_nd_at_repeated_indices::<F<T>>(
                        device, precision,
                    );
                }
                ok(
                    "picks exact, gradients and adds at a row picked three times within 1e-6 of \
                    sums by hand, int picks, adds and the embedding they index exact",
                )
            }),
        ),
        (
            "integer powers (Burn's go through a float pow, truncated)",
            Box::new(|| {
                int_pow::int_powers_are_exact::<F<T>>(device);
                ok("bases -6..=6 to powers 0..=9, and element by element from -3 to 41: exact")
            }),
        ),
        (
            "NaN propagation (Burn's kernels turn a NaN into a number in some ops)",
            Box::new(|| {
                // An f32 input, and half ones (a lowered op's output).
                let dtypes = f32_and(lows);
                let mut ops = 0;
                for &dtype in &dtypes {
                    let checks = {
                        let _g = burn_amp::autocast(Precision::F16);
                        nan_propagation::nan_kept_by::<Amp<F<T>>>(device, dtype)
                    };
                    let hidden: Vec<_> = checks.iter().filter(|(_, kept)| !kept).collect();
                    if !hidden.is_empty() {
                        return Err(format!(
                            "under Amp, {dtype:?}: a NaN is hidden by {hidden:?}"
                        ));
                    }
                    ops = checks.len();
                }
                nan_propagation::around_the_nans::<F<T>>(device);
                for &dtype in &dtypes {
                    let (w, x) = nan_propagation::nan_lost_in_recompute::<
                        F<T>,
                        BalancedCheckpointing,
                    >(device, dtype);
                    if !w.is_empty() || x != nan_propagation::COMPARISONS {
                        return Err(format!(
                            "{dtype:?}: recomputed in the backward, {w:?} lost the NaN (w's \
                             gradient in op(x) · w is a number); the input gradient is a \
                             number at a NaN for {x:?} (PyTorch: {:?})",
                            nan_propagation::COMPARISONS
                        ));
                    }
                }
                nan_propagation::relu_beside_a_nan::<F<T>, BalancedCheckpointing>(device);
                ok(&format!(
                    "{ops} ops on a row holding a NaN (f32 and half inputs): none hides it under \
                     Amp; pow's IEEE exceptions, atan2, top-k's NaN first with its index and \
                     gradient; the NaN survives recomputation in the backward, gradients \
                     included; relu's value and gradients at -1, -0, 0, 2, NaN"
                ))
            }),
        ),
        (
            "infinities (a NaN made from one: log_sigmoid(-inf), the backward of exp behind a mask, of log behind a clamp)",
            Box::new(|| {
                infinities::log_sigmoid_at_minus_infinity::<F<T>>(device);
                for &precision in lows {
                    infinities::exp_behind_a_mask::<F<T>>(device, precision);
                    infinities::bce_on_saturated_probabilities::<F<T>>(device, precision);
                }
                infinities::cosine_similarity_of_a_zero_row::<F<T>>(device);
                powers::negative_powers::<F<T>>(device);
                let dtypes = f32_and(lows);
                infinities::extremes_of_infinite_rows::<F<T>>(device, &dtypes);
                powers::powers_at_a_zero_base::<F<T>>(device);
                ok(
                    "log_sigmoid(-inf) = -inf, gradient 1 (also beside x · c); elu, celu, selu, \
                    mish from -3 to 30000, values and gradients within 2e-2 of PyTorch's (1e-5 \
                    at f32), exp's +inf gradient kept where it reached the loss; binary \
                    cross-entropy on probabilities of 0 and 1: PyTorch's loss and gradient; \
                    cosine similarity of a zero row: a finite gradient; negative powers of \
                    negative and zero bases, values and gradients as Flex's (IEEE's); the \
                    maximum of a row of -inf is -inf; powers at a zero base: PyTorch's \
                    gradients",
                )
            }),
        ),
        (
            "remainder of two f16 tensors (CubeCL's quotient in f16 overflows)",
            Box::new(|| {
                let plain = remainder::remainder_of_half_tensors::<F<T>>(device);
                Ok(format!(
                    "[40000, 500.75, -3.25] % 0.5 as PyTorch's [0, 0.25, 0.25], tensor and \
                     scalar divisors; plain {}: {plain:?}",
                    T::NAME
                ))
            }),
        ),
        (
            "half sums (matmuls and convolutions lowered to half precision sum in f32)",
            Box::new(|| {
                for &precision in lows {
                    half_sums::exact_sums::<F<T>>(device, precision);
                    let tol = if precision == Precision::F16 {
                        1e-3
                    } else {
                        8e-3
                    };
                    half_sums::against_f32::<F<T>>(device, precision, tol);
                }
                ok(
                    "4096 terms of 0.25 sum to 1024 (a half sum stalls at 512): conv1d over \
                    channels, its weight and input gradients, a one-row matmul, a one-column \
                    one's weight gradient; conv2d and conv_transpose2d (with biases, of a data \
                    batch, frozen), matmuls of one row, one column, k = 16384 and broadcast \
                    batches, linear of a data batch and frozen, forward and gradients, within \
                    1e-3 (f16) or 8e-3 (bf16) of f32, above and below autodiff",
                )
            }),
        ),
        (
            "gelu, tanh and asinh of half inputs computed in f32 and rounded once",
            Box::new(|| {
                for &precision in lows {
                    opmath::half_elementwise_in_f32::<F<T>>(device, precision);
                }
                ok(
                    "4200 inputs in [-4, 4] and around 0: values within 1 step of the half \
                    dtype of the f32 op's, gradients within 2, above and below autodiff",
                )
            }),
        ),
        (
            "repeat's gradient (burn-autodiff sums a tiling as an interleaving)",
            Box::new(|| {
                for &precision in lows {
                    repeat::repeat_backpropagates_right::<F<T>>(device, precision);
                }
                ok("4 tilings of [2, 3, 2]: values and gradients exactly the sums by hand")
            }),
        ),
        (
            "grid_sample in nearest and bicubic mode (no kernel, no backward in Burn) and \
             bilinear, every padding, against PyTorch's sampler in f64",
            Box::new(|| {
                for &precision in lows {
                    grid_sample::samples_as_pytorch::<F<T>>(device, precision, T::NAME, 1e-5);
                }
                ok(
                    "3 modes x 3 paddings x align_corners: outputs and input gradients within 1e-5 \
                    of the reference, grid gradients within 1e-4 of its differences",
                )
            }),
        ),
        (
            // Last of these: an op it misses on CUDA would end the device's stream.
            "empty tensors: an expert given no token, an empty batch through convolutions, \
             single float, int and bool ops, reductions, sorts, views, picks, writes and cats, \
             without a kernel",
            Box::new(|| {
                for &precision in lows {
                    empty::an_empty_expert_changes_nothing::<F<T>>(device, precision);
                    empty::empty_ops_give_torch_values::<F<T>>(device, precision);
                    empty::an_expert_added_back_with_no_token_gets_zeros::<F<T>>(device, precision);
                    empty::an_empty_batch_through_convolutions::<F<T>>(device, precision);
                    empty::empty_ints_and_bools::<F<T>>(device, precision);
                    indexing::empty_picks_writes_and_cats::<F<T>>(device, precision);
                    empty_reductions::empty_reductions_sorts_and_views::<F<T>>(device, precision);
                }
                ok(
                    "loss and gradients bitwise those without the empty expert, its parameters' \
                    gradients zeros (added back in place too; convolution weights and biases over \
                    an empty batch, through empty views); PyTorch's values for sums, means, \
                    products, matmuls, any and all of nothing, a clear panic for maxima of nothing",
                )
            }),
        ),
    ];
    for (name, check) in &workarounds {
        case("workarounds", name, "", &mut || check())?;
    }

    // What plain Burn does here where Amp works around a defect: `info` lines, not cases.
    type Canary<'a> = Box<dyn Fn() -> Result<String, String> + 'a>;
    let canaries: Vec<(&str, Canary<'_>)> = vec![
        (
            "plain Burn: an integer power",
            Box::new(|| {
                let got = int_pow::plain_five_cubed::<F<T>>(device);
                Ok(format!("plain {}: 5^3 = {got}", T::NAME))
            }),
        ),
        (
            "plain Burn: NaN propagation",
            Box::new(|| {
                let hidden = nan_propagation::nan_hidden_by::<F<T>>(device, DType::F32);
                Ok(format!(
                    "plain {} turns a NaN into a number in {hidden:?}",
                    T::NAME
                ))
            }),
        ),
        (
            "plain Burn: elu, celu, selu, mish above exp's overflow",
            Box::new(|| {
                let errors =
                    infinities::activation_errors::<burn::backend::Autodiff<F<T>>>(device, 1e-5);
                Ok(format!("plain {}: {errors:?}", T::NAME))
            }),
        ),
        (
            // A race: the count may vary from run to run.
            "plain Burn: scatter_nd at a repeated index",
            Box::new(|| {
                let (floats, ints) = indexing::plain_scatter_nd_at_a_repeated_row::<F<T>>(device);
                Ok(format!(
                    "plain {}: three updates of 1 at one row give {floats} (floats), {ints} \
                     (ints); 3 is right",
                    T::NAME
                ))
            }),
        ),
        (
            // Last of these, as it reads past a buffer's end (wgpu refuses; CUDA may not
            // notice, or may fault and end the device's stream).
            "plain Burn: avg_pool2d's gradient",
            Box::new(|| {
                let wrong: Vec<String> = workarounds::plain_avg_pool_wrong::<F<T>>(device)
                    .into_iter()
                    .map(|(what, wrong, of)| format!("{what} pool: {wrong} of {of}"))
                    .collect();
                Ok(format!(
                    "plain {} gets gradient values wrong: {}",
                    T::NAME,
                    wrong.join(", ")
                ))
            }),
        ),
    ];
    for (name, canary) in &canaries {
        let Some(step) = steps.start() else {
            continue;
        };
        let plain = timed(canary);
        report.emit(json!({
            "kind": "info", "suite": "workarounds", "case": name, "detail": plain.detail,
            "error": plain.error, "ms": plain.ms, "step": step,
        }));
        steps.check::<F<T>>(step, plain.error.is_some(), name, device, report)?;
    }

    // Random graphs while time lasts, at least one seed each (so that the code runs in CI)
    // unless `seeds` says none. Last: how many steps they take depends on the time, and a
    // process resuming after them could not count them again.
    if seeds != Some(0) {
        failed += graphs_while_time_lasts::<T>(device, lows, deadline, seeds, steps, report)?;
    }
    Ok(failed)
}
