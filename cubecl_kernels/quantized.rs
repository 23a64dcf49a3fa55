//! AdamW with 8-bit moments: each unit owns one `i32` word (four 8-bit codes) of both moments,
//! and one cube owns one block (its `absmax`). Dequantize, update (f32), write the parameter,
//! reduce the block's new absmax in shared memory, requantize: one pass over every byte.
//!
//! The first moment `m` is stored as `code(m / absmax)` in a signed map, the second as
//! `code(sqrt(v) / absmax)` in an unsigned map (its square root: half the dynamic range in
//! log scale, so a small `v` beside a large one in its block does not collapse to zero while
//! its `m` survives, which would make `m / sqrt(v)` explode). A code is the index of the
//! nearest map value: the number of `bounds` (midpoints of the sorted map) below the value.

use cubecl::prelude::*;

use super::optim::{decayed, write_count};
use super::rounding::{random16, stochastic_round};

/// Codes per `i32` word.
pub const CODES_PER_WORD: usize = 4;

/// The code of `x` (a value in [-1, 1]): binary search of the 255 sorted bounds.
#[cube]
fn encode(x: f32, bounds: &Tensor<f32>) -> u32 {
    let mut code = 0u32;
    #[unroll]
    for bit in 0..8u32 {
        let candidate = code + (128u32 >> bit);
        if bounds[(candidate - 1u32) as usize] < x {
            code = candidate;
        }
    }
    code
}

/// `x / absmax`, 0 for an all-zero block.
#[cube]
fn normalized(x: f32, absmax: f32) -> f32 {
    select(absmax > 0.0f32, x / absmax, 0.0f32)
}

/// One AdamW step on one parameter with block-quantized moments. `words_per_block` units per
/// cube, one cube per block (cubes past the last block leave). Skipped bit for bit when
/// `found_inf[0]` is raised.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn adamw8bit_kernel<P: Float, G: Float>(
    param: &Tensor<P>,
    grad: &Tensor<G>,
    m_codes: &Tensor<i32>,
    m_absmax: &Tensor<f32>,
    v_codes: &Tensor<i32>,
    v_absmax: &Tensor<f32>,
    signed_map: &Tensor<f32>,
    signed_bounds: &Tensor<f32>,
    unsigned_map: &Tensor<f32>,
    unsigned_bounds: &Tensor<f32>,
    step: &Tensor<f32>,
    inv_scale: &Tensor<f32>,
    found_inf: &Tensor<f32>,
    param_out: &mut Tensor<P>,
    m_codes_out: &mut Tensor<i32>,
    m_absmax_out: &mut Tensor<f32>,
    v_codes_out: &mut Tensor<i32>,
    v_absmax_out: &mut Tensor<f32>,
    step_out: &mut Tensor<f32>,
    numel: usize,
    lr: f32,
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    ln_beta1: f32,
    ln_beta2: f32,
    epsilon: f32,
    decay: f32,
    l2: f32,
    seed: u32,
    ulp_scale: f32,
    min_binade: f32,
    #[comptime] words_per_block: usize,
    #[comptime] stochastic: bool,
    #[comptime] cautious: bool,
    #[comptime] has_l2: bool,
    #[define(P, G)] _dtypes: [StorageType; 2],
) {
    let block = CUBE_POS;
    if block >= m_absmax.len() {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let word = block * words_per_block + unit;
    let first = word * 4usize;
    let skipped = found_inf[0] > 0.5f32;
    write_count(step, step_out, skipped);
    if skipped {
        #[unroll]
        for j in 0..4usize {
            if first + j < numel {
                param_out[first + j] = param[first + j];
            }
        }
        m_codes_out[word] = m_codes[word];
        v_codes_out[word] = v_codes[word];
        if unit == 0 {
            m_absmax_out[block] = m_absmax[block];
            v_absmax_out[block] = v_absmax[block];
        }
        terminate!();
    }

    // Read before the barriers below: unit 0 may then overwrite them in place.
    let old_m_absmax = m_absmax[block];
    let old_s_absmax = v_absmax[block];
    let m_word = u32::cast_from(m_codes[word]);
    let v_word = u32::cast_from(v_codes[word]);

    let t = step[0] + 1.0f32;
    let bc1 = -(f32::exp(t * ln_beta1) - 1.0f32);
    let bc2 = -(f32::exp(t * ln_beta2) - 1.0f32);
    let step_bits = u32::cast_from(t);

    let mut ms = Array::<f32>::new(4usize);
    let mut ss = Array::<f32>::new(4usize);
    let mut max_m = 0.0f32;
    let mut max_s = 0.0f32;
    #[unroll]
    for j in 0..4usize {
        let shift = 8u32 * (j as u32);
        let m_old = signed_map[((m_word >> shift) & 255u32) as usize] * old_m_absmax;
        let s_old = unsigned_map[((v_word >> shift) & 255u32) as usize] * old_s_absmax;
        let index = first + j;
        let mut m = 0.0f32;
        let mut s = 0.0f32;
        if index < numel {
            let mut g = f32::cast_from(grad[index]) * inv_scale[0];
            if comptime![has_l2] {
                g += f32::cast_from(param[index]) * l2;
            }
            m = m_old * beta1 + g * one_minus_beta1;
            let v = s_old * s_old * beta2 + (g * g) * one_minus_beta2;
            s = f32::sqrt(v);
            let update = (m / bc1) / (f32::sqrt(v / bc2) + epsilon);
            let new_p = decayed(f32::cast_from(param[index]), m, decay, cautious) - update * lr;
            if comptime![stochastic] {
                let r = random16(seed, step_bits, index as u32);
                param_out[index] = P::cast_from(stochastic_round(new_p, r, ulp_scale, min_binade));
            } else {
                param_out[index] = P::cast_from(new_p);
            }
        }
        ms[j] = m;
        ss[j] = s;
        max_m = f32::max(max_m, f32::abs(m));
        max_s = f32::max(max_s, s);
    }

    // The block's new absmax of both moments: a tree reduction in shared memory.
    let mut red_m = SharedMemory::<f32>::new(words_per_block);
    let mut red_s = SharedMemory::<f32>::new(words_per_block);
    red_m[unit] = max_m;
    red_s[unit] = max_s;
    sync_cube();
    #[unroll]
    for level in 1..comptime![words_per_block.trailing_zeros() as usize + 1] {
        let stride = comptime![words_per_block >> level];
        if unit < stride {
            red_m[unit] = f32::max(red_m[unit], red_m[unit + stride]);
            red_s[unit] = f32::max(red_s[unit], red_s[unit + stride]);
        }
        sync_cube();
    }
    let m_absmax_new = red_m[0];
    let s_absmax_new = red_s[0];

    let mut m_packed = 0u32;
    let mut v_packed = 0u32;
    #[unroll]
    for j in 0..4usize {
        let shift = 8u32 * (j as u32);
        m_packed |= encode(normalized(ms[j], m_absmax_new), signed_bounds) << shift;
        v_packed |= encode(normalized(ss[j], s_absmax_new), unsigned_bounds) << shift;
    }
    m_codes_out[word] = i32::cast_from(m_packed);
    v_codes_out[word] = i32::cast_from(v_packed);
    if unit == 0 {
        m_absmax_out[block] = m_absmax_new;
        v_absmax_out[block] = s_absmax_new;
    }
}
