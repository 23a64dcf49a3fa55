//! Rounding an f32 result into a half-precision parameter: stochastically, with random bits
//! from a counter-based hash of (seed, step, index), so nothing random is stored and a run
//! replays bit for bit. `optim::rounding::fallback` computes the same bits with burn ops.

use cubecl::prelude::*;

/// A bijection of 16-bit values (xorshift, odd multiply, xorshift). Every product stays below
/// 2^31, so the burn-op fallback computes it exactly in any integer dtype.
#[cube]
pub fn mix16(x: u32) -> u32 {
    let x = x ^ (x >> 7u32);
    let x = (x * 0x5BD1u32 + 0x3C6Fu32) & 0xFFFFu32;
    x ^ (x >> 9u32)
}

/// 16 random bits for element `index` at step `step` of the stream `seed`. For a fixed seed
/// and step, 65,536 consecutive indices get 65,536 distinct values (and the same holds for
/// the steps of one index): the low halves enter first, through bijections.
#[cube]
pub fn random16(seed: u32, step: u32, index: u32) -> u32 {
    let h = mix16((seed ^ step ^ index) & 0xFFFFu32);
    let h = mix16(h ^ (index >> 16u32));
    let h = mix16(h ^ (step >> 16u32) ^ (seed >> 16u32));
    mix16(h ^ (index & 0xFFFFu32))
}

/// `x` rounded to a neighbour on the grid of a float format with `2^-ulp_scale` relative
/// spacing (bf16: `ulp_scale = 2^-7`, f16: `2^-10`) whose smallest normal binade is
/// `min_binade` (below it the spacing is fixed, as for subnormals): up with probability equal
/// to the distance to the lower neighbour over the spacing, so the rounding is unbiased.
/// Every operation is exact (powers of two, `floor`), and `random` (16 bits) is compared to
/// the fraction on a 2^-16 grid. The result is representable in the format; NaN and ±inf
/// pass through.
#[cube]
pub fn stochastic_round(x: f32, random: u32, ulp_scale: f32, min_binade: f32) -> f32 {
    let exponent = u32::reinterpret(x) & 0x7F80_0000u32;
    let mut out = x;
    if exponent != 0x7F80_0000u32 {
        let binade = f32::reinterpret(exponent);
        let binade = select(binade < min_binade, min_binade, binade);
        let ulp = binade * ulp_scale;
        let q = f32::abs(x) / ulp;
        let lo = f32::floor(q);
        let u = f32::cast_from(random) * (1.0f32 / 65536.0f32);
        let up = select(q - lo + u >= 1.0f32, 1.0f32, 0.0f32);
        let y = (lo + up) * ulp;
        out = select(x < 0.0f32, -y, y);
    }
    out
}
