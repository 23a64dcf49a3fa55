//! How an f32 update is rounded into a half-precision parameter.
//!
//! A bf16 weight has 8 significant bits: an update smaller than half its spacing
//! (`|w| · 2^-8`) is lost by round-to-nearest, every step, so a bf16 model without an f32
//! master copy stalls once its updates get small. Stochastic rounding rounds up with
//! probability equal to the fraction of the spacing covered, so the expected stored value is
//! the exact one and small updates accumulate on average (the approach of torchao's
//! `bf16_stochastic_round` and of adamw-bf16).
//!
//! The random bits are a counter-based hash of (seed, step, element index): nothing is
//! stored, a run replays bit for bit, and a skipped step (whose count does not advance)
//! leaves the stream where it was. The CubeCL kernels and the burn-op [`fallback`] compute
//! the same bits and the same rounding.

use burn_backend::DType;
use burn_std::FloatDType;
use serde::{Deserialize, Serialize};

/// How the fused optimizers store an f32 update into a parameter of a lower precision. f32
/// parameters are always stored exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum WeightRounding {
    /// Round to nearest (even): updates under half the spacing are lost.
    #[default]
    Nearest,
    /// Unbiased stochastic rounding. bf16: every value. f16: values in f16's normal range
    /// (|w| ≥ 2^-14); below it the spacing is f16's subnormal one (2^-24), still unbiased.
    Stochastic,
}

/// The grid of a half-precision format as [`stochastic_round`](crate::kernels) sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Grid {
    /// The format.
    pub dtype: FloatDType,
    /// Spacing relative to the binade: 2^-(mantissa bits).
    pub ulp_scale: f32,
    /// Smallest normal binade: below it the spacing stays `min_binade · ulp_scale`.
    pub min_binade: f32,
}

impl Grid {
    /// The grid of `dtype`, `None` when an f32 result is stored exactly (f32, f64).
    pub(crate) fn of(dtype: DType) -> Option<Self> {
        match dtype {
            DType::BF16 => Some(Self {
                dtype: FloatDType::BF16,
                ulp_scale: 2f32.powi(-7),
                min_binade: f32::MIN_POSITIVE,
            }),
            DType::F16 => Some(Self {
                dtype: FloatDType::F16,
                ulp_scale: 2f32.powi(-10),
                min_binade: 2f32.powi(-14),
            }),
            _ => None,
        }
    }
}

/// The rounding of one parameter's step: the grid when it is stochastic, and the stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StochasticRounding {
    pub grid: Grid,
    /// 31 bits: the optimizer's seed mixed with the parameter's size.
    pub seed: u32,
}

impl StochasticRounding {
    /// The rounding of a parameter of `dtype` and `numel` values under `mode`; `None` when it
    /// rounds to nearest (or is f32).
    pub(crate) fn new(mode: WeightRounding, seed: u64, dtype: DType, numel: usize) -> Option<Self> {
        if mode != WeightRounding::Stochastic {
            return None;
        }
        let grid = Grid::of(dtype)?;
        // splitmix64's finalizer: parameters of different sizes get unrelated streams.
        let mut z = seed ^ (numel as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Some(Self {
            grid,
            seed: (z as u32) & 0x7FFF_FFFF,
        })
    }
}

/// The launch arguments of a kernel that may round stochastically: neutral when it does not.
pub(crate) fn kernel_args(rounding: Option<StochasticRounding>) -> (u32, f32, f32) {
    match rounding {
        Some(r) => (r.seed, r.grid.ulp_scale, r.grid.min_binade),
        None => (0, 1.0, 1.0),
    }
}

/// Stochastic rounding from burn ops, bit for bit the kernels' (`cubecl_kernels/rounding.rs`).
pub mod fallback {
    use burn_backend::tensor::{FloatTensor, IntTensor};
    use burn_backend::{Backend, TensorMetadata, get_device_settings};
    use burn_std::{FloatDType, IntDType, Shape};

    use super::StochasticRounding;
    use crate::scaler::kernels::fallback::s;

    fn int(v: i64) -> burn_backend::Scalar {
        burn_backend::Scalar::Int(v)
    }

    /// `mix16` of the kernels.
    fn mix16<B: Backend>(x: IntTensor<B>) -> IntTensor<B> {
        let x = B::bitwise_xor(x.clone(), B::bitwise_right_shift_scalar(x, int(7)));
        let x = B::int_add_scalar(B::int_mul_scalar(x, int(0x5BD1)), int(0x3C6F));
        let x = B::bitwise_and_scalar(x, int(0xFFFF));
        B::bitwise_xor(x.clone(), B::bitwise_right_shift_scalar(x, int(9)))
    }

    /// `random16(seed, step, index)` of the kernels for every element of `shape`, as f32 in
    /// [0, 65535]. `step` is the f32 `[1]` count after this step.
    pub(crate) fn random16<B: Backend>(
        seed: u32,
        step: FloatTensor<B>,
        shape: &Shape,
    ) -> FloatTensor<B> {
        let device = B::float_device(&step);
        let dtype = IntDType::I32;
        let n = shape.num_elements();
        let index = B::int_reshape(B::int_arange(0..n as i64, &device, dtype), shape.clone());
        let ones = Shape::from(vec![1; shape.num_dims()]);
        let step = B::float_reshape(step, ones);
        let step = B::int_expand(B::float_into_int(step, dtype), shape.clone());
        let seed = seed as i64;
        let low = |t: IntTensor<B>| B::bitwise_and_scalar(t, int(0xFFFF));
        let high = |t: IntTensor<B>| B::bitwise_right_shift_scalar(t, int(16));
        let h = B::bitwise_xor_scalar(B::bitwise_xor(step.clone(), index.clone()), int(seed));
        let h = mix16::<B>(low(h));
        let h = mix16::<B>(B::bitwise_xor(h, high(index.clone())));
        let h = B::bitwise_xor_scalar(B::bitwise_xor(h, high(step)), int(seed >> 16));
        let h = mix16::<B>(h);
        let h = mix16::<B>(B::bitwise_xor(h, low(index)));
        B::int_into_float(h, FloatDType::F32)
    }

    /// `x` (f32) rounded stochastically onto `rounding`'s grid, as f32 (exactly representable
    /// in the target format): `stochastic_round` of the kernels, element by element.
    pub(crate) fn stochastic_round<B: Backend>(
        x: FloatTensor<B>,
        step: FloatTensor<B>,
        rounding: StochasticRounding,
    ) -> FloatTensor<B> {
        let device = B::float_device(&x);
        let bool_dtype = get_device_settings::<B>(&device).bool_dtype;
        let shape = x.shape();
        let grid = rounding.grid;
        let a = B::float_abs(x.clone());
        // The binade 2^floor(log2 a), exact: estimated with ln/exp, snapped to a power of two
        // by a round trip through the target format (the estimate is within 1e-6 of it, and
        // every binade the format's values live in is representable in it), then corrected
        // by one binade either way, with exact comparisons.
        let e = B::float_floor(B::float_div_scalar(B::float_log(a.clone()), s(2f64.ln())));
        let p = B::float_exp(B::float_mul_scalar(e, s(2f64.ln())));
        let p = B::float_cast(B::float_cast(p, grid.dtype), FloatDType::F32);
        let too_big = B::float_greater(p.clone(), a.clone(), bool_dtype);
        let p = B::float_mask_where(p.clone(), too_big, B::float_mul_scalar(p, s(0.5)));
        let doubled = B::float_mul_scalar(p.clone(), s(2.0));
        let too_small = B::float_lower_equal(doubled.clone(), a.clone(), bool_dtype);
        let p = B::float_mask_where(p, too_small, doubled);
        let p = B::float_clamp_min(p, s(grid.min_binade as f64));
        let ulp = B::float_mul_scalar(p, s(grid.ulp_scale as f64));
        let q = B::float_div(a, ulp.clone());
        let lo = B::float_floor(q.clone());
        let u = B::float_mul_scalar(random16::<B>(rounding.seed, step, &shape), s(1.0 / 65536.0));
        let frac_u = B::float_add(B::float_sub(q, lo.clone()), u);
        let up = B::float_greater_equal_elem(frac_u, s(1.0), bool_dtype);
        let lo = B::float_mask_where(lo.clone(), up, B::float_add_scalar(lo, s(1.0)));
        let y = B::float_mul(lo, ulp.clone());
        let negative = B::float_lower_elem(x.clone(), s(0.0), bool_dtype);
        let y = B::float_mask_where(y.clone(), negative, B::float_neg(y));
        // Past the format's largest binade the round trip above is inf (and `0 · inf` NaN):
        // `x` itself, which the cast to the format makes inf, as the kernels' result is.
        let passed = B::bool_or(
            B::bool_or(
                B::float_is_nan(x.clone(), bool_dtype),
                B::float_is_inf(x.clone(), bool_dtype),
            ),
            B::float_is_inf(ulp, bool_dtype),
        );
        B::float_mask_where(y, passed, x)
    }
}
