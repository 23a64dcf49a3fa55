//! `adamw8bit_step` (8-bit moments) and the stochastic rounding of both AdamW kernels,
//! kernel against fallback. Each step starts both from the same state (the kernel's), so a
//! difference is this step's, not an accumulated drift:
//! - parameters: the f32 tolerance of every optimizer step (f16: one f16 ulp, which also
//!   covers a stochastic rounding decided the other way by an f32 ulp of difference);
//! - codes: at least 99.9% identical; the others one code apart (a value on a decision bound
//!   by an f32 ulp), so the dequantized moments agree within one code's spacing;
//! - skipped steps: every output bit for bit its input; step counts exact.

use super::*;
use burn_amp::optim::kernels::QuantizedMoments;
use burn_amp::optim::kernels::quantized::fallback::adamw8bit_step;
use burn_amp::optim::quantized::fallback::dequantize;
use burn_amp::optim::{MomentStorage, QuantMap, WeightRounding};
use burn_backend::tensor::IntTensor;
use burn_std::IntDType;

type Moments<B> = QuantizedMoments<FloatTensor<B>, IntTensor<B>>;

fn ints<B: Backend>(t: IntTensor<B>) -> Vec<i32> {
    let data = read_sync(B::int_into_data(t)).expect("read back");
    data.convert::<i32>().to_vec::<i32>().expect("i32 data")
}

fn zero_state<B: Backend>(n: usize, block: usize, map: QuantMap, device: &B::Device) -> Moments<B> {
    let blocks = n.div_ceil(block);
    let codes = || B::int_zeros(Shape::new([blocks * block / 4]), device, IntDType::I32);
    let absmax = || tensor::<B>(vec![0.0; blocks], &[blocks], FloatDType::F32, device);
    QuantizedMoments {
        exp_avg_codes: codes(),
        exp_avg_absmax: absmax(),
        exp_avg_sq_codes: codes(),
        exp_avg_sq_absmax: absmax(),
        step: scalar::<B>(0.0, device),
        block,
        map,
    }
}

/// The bytes of every tensor of a parameter and its 8-bit state.
fn state_bytes<B: Backend>(p: &FloatTensor<B>, s: &Moments<B>) -> Vec<Vec<u8>> {
    let int_bytes = |t: &IntTensor<B>| {
        read_sync(B::int_into_data(t.clone()))
            .expect("read back")
            .as_bytes()
            .to_vec()
    };
    vec![
        read::<B>(p.clone()).1,
        int_bytes(&s.exp_avg_codes),
        read::<B>(s.exp_avg_absmax.clone()).1,
        int_bytes(&s.exp_avg_sq_codes),
        read::<B>(s.exp_avg_sq_absmax.clone()).1,
        read::<B>(s.step.clone()).1,
    ]
}

/// Codes of kernel and fallback: nearly all equal, the rest one apart.
#[track_caller]
fn assert_codes_close(what: &str, kernel: Vec<i32>, fallback: Vec<i32>) {
    let bytes = |w: Vec<i32>| -> Vec<i32> {
        w.iter()
            .flat_map(|w| (0..4).map(move |j| (w >> (8 * j)) & 255))
            .collect()
    };
    let (k, f) = (bytes(kernel), bytes(fallback));
    let differ = k.iter().zip(&f).filter(|(a, b)| a != b).count();
    assert!(
        k.iter().zip(&f).all(|(a, b)| (a - b).abs() <= 1),
        "{what}: codes more than one apart"
    );
    assert!(
        differ * 1000 <= k.len(),
        "{what}: {differ} of {} codes differ",
        k.len()
    );
}

/// Steps of `plan` (true: skipped) on a `[50, 100]` parameter of `dtype` (20 blocks of 256,
/// the last one partial), kernel against fallback from the kernel's state each time. Cautious
/// weight decay must also change the kernel's step from the plain decay's (by the decay,
/// `lr * weight_decay` relative, 100 times the tolerance) on some elements and not on others;
/// Adam's L2 penalty on most.
fn check_adamw8bit<B: AmpKernels>(
    device: &B::Device,
    dtype: FloatDType,
    map: QuantMap,
    rounding: WeightRounding,
    decay: Decay,
) {
    let shape = [50usize, 100];
    let n = 5000;
    let block = 256;
    let c = adamw_config(0.9, 0.999, 1e-8, 0.01)
        .with_moments(MomentStorage::Int8 {
            block,
            map,
            min_numel: 0,
        })
        .with_weight_rounding(rounding)
        .with_cautious_weight_decay(decay == Decay::Cautious)
        .with_decoupled_weight_decay(decay != Decay::L2)
        .with_seed(42);
    let mut rng = Rng::new(8);
    let mut p = tensor::<B>(rng.vec(n, 1.0), &shape, dtype, device);
    let mut s = zero_state::<B>(n, block, map, device);
    let plan = [false, false, true, false, false, false];
    let mut applied = 0.0;
    for (i, &skip) in plan.iter().enumerate() {
        let what =
            format!("adamw8bit {dtype:?} {map:?} {rounding:?} {decay:?} step {i} skip {skip}");
        // Blocks of very different magnitudes: the block maxima, not one scale, must carry it.
        let mut g = rng.vec(n, 1.0);
        for (j, v) in g.iter_mut().enumerate() {
            *v *= [1.0, 1e-3, 30.0, 1e-6][(j / block) % 4];
        }
        if skip {
            g[17] = f32::NAN;
        }
        let grad = || tensor::<B>(g.clone(), &shape, FloatDType::F32, device);
        let found = if skip { 1.0 } else { 0.0 };
        // With Adam's L2 penalty, `maximize`'s negative `inv_scale` too: the gradient is
        // negated before the penalty is added.
        let inv = if decay == Decay::L2 { -1.0 } else { 1.0 };
        let sc = || scaling::<B>(inv, found, device);
        let before = state_bytes::<B>(&p, &s);
        let (pk, sk) = B::adamw8bit_step(p.clone(), grad(), s.clone(), sc(), 1e-2, &c);
        let (pf, sf) = adamw8bit_step::<B>(p.clone(), grad(), s.clone(), sc(), 1e-2, &c);
        if decay != Decay::Decoupled && !skip {
            let plain = c
                .clone()
                .with_cautious_weight_decay(false)
                .with_decoupled_weight_decay(true);
            let (pp, _) = B::adamw8bit_step(p.clone(), grad(), s.clone(), sc(), 1e-2, &plain);
            let (k, plain) = (values::<B>(pk.clone()), values::<B>(pp));
            let changed = k.iter().zip(&plain).filter(|(a, b)| a != b).count();
            let expected = match decay {
                Decay::Cautious => n / 10..9 * n / 10,
                _ => n / 2..n + 1,
            };
            assert!(
                expected.contains(&changed),
                "{what}: the decay changed {changed} of {n} elements"
            );
        }
        if skip {
            assert_eq!(
                state_bytes::<B>(&pk, &sk),
                before,
                "{what}: kernel changed state"
            );
            assert_eq!(
                state_bytes::<B>(&pf, &sf),
                before,
                "{what}: fallback changed state"
            );
        } else {
            applied += 1.0;
        }
        assert_eq!(
            count::<B>(sk.step.clone()),
            applied,
            "{what}: kernel's count"
        );
        assert_eq!(
            count::<B>(sf.step.clone()),
            applied,
            "{what}: fallback's count"
        );
        assert_close(
            &format!("{what} param"),
            &values::<B>(pk.clone()),
            &values::<B>(pf),
            step_tol(dtype),
        );
        let maxima_k = values::<B>(sk.exp_avg_absmax.clone());
        let maxima_f = values::<B>(sf.exp_avg_absmax.clone());
        assert_close(
            &format!("{what} exp_avg absmax"),
            &maxima_k,
            &maxima_f,
            F32_STEP,
        );
        assert_close(
            &format!("{what} exp_avg_sq absmax"),
            &values::<B>(sk.exp_avg_sq_absmax.clone()),
            &values::<B>(sf.exp_avg_sq_absmax.clone()),
            F32_STEP,
        );
        assert_codes_close(
            &format!("{what} exp_avg"),
            ints::<B>(sk.exp_avg_codes.clone()),
            ints::<B>(sf.exp_avg_codes.clone()),
        );
        assert_codes_close(
            &format!("{what} exp_avg_sq"),
            ints::<B>(sk.exp_avg_sq_codes.clone()),
            ints::<B>(sf.exp_avg_sq_codes.clone()),
        );
        if !skip {
            // The moments moved, and decode to finite values.
            let m = values::<B>(dequantize::<B>(
                sk.exp_avg_codes.clone(),
                sk.exp_avg_absmax.clone(),
                block,
                map.table(true),
                n,
            ));
            assert!(m.iter().all(|v| v.is_finite()), "{what}: exp_avg finite");
            assert!(m.iter().any(|v| *v != 0.0), "{what}: exp_avg moved");
        }
        (p, s) = (pk, sk);
    }
}

/// How the weight decay is applied.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Decay {
    /// AdamW's.
    Decoupled,
    /// AdamW's, only where value and update agree in sign.
    Cautious,
    /// Adam's L2 penalty on the gradient.
    L2,
}

/// The f32-moment AdamW with stochastic rounding: kernel against fallback, from the same
/// state each step (an f16 parameter: WGSL has no bf16).
fn check_adamw_stochastic<B: AmpKernels>(device: &B::Device) {
    let shape = [3000usize];
    let c = adamw_config(0.9, 0.999, 1e-8, 0.0)
        .with_weight_rounding(WeightRounding::Stochastic)
        .with_seed(7);
    let mut rng = Rng::new(3);
    let mut p = tensor::<B>(rng.vec(3000, 1.0), &shape, FloatDType::F16, device);
    let mut s = zero_moments::<B>(&shape, 0.0, device);
    for i in 0..3 {
        let g = rng.vec(3000, 1.0);
        let grad = || tensor::<B>(g.clone(), &shape, FloatDType::F32, device);
        let sc = || scaling::<B>(1.0, 0.0, device);
        let (pk, sk) = adamw::<B>(true, p.clone(), grad(), s.clone(), sc(), 1e-4, &c);
        let (pf, _) = adamw::<B>(false, p.clone(), grad(), s.clone(), sc(), 1e-4, &c);
        let (k, f) = (values::<B>(pk.clone()), values::<B>(pf));
        assert_close(&format!("stochastic adamw step {i}"), &k, &f, F16_STEP);
        let same = k.iter().zip(&f).filter(|(a, b)| a == b).count();
        assert!(
            same * 1000 >= 999 * k.len(),
            "step {i}: {same} of {} equal",
            k.len()
        );
        (p, s) = (pk, sk);
    }
}

on_both! {
    adamw8bit_f32_dynamic: check_adamw8bit(FloatDType::F32, QuantMap::Dynamic, WeightRounding::Nearest, Decay::Decoupled);
    adamw8bit_f32_linear: check_adamw8bit(FloatDType::F32, QuantMap::Linear, WeightRounding::Nearest, Decay::Decoupled);
    adamw8bit_f16_stochastic: check_adamw8bit(FloatDType::F16, QuantMap::Dynamic, WeightRounding::Stochastic, Decay::Decoupled);
    adamw8bit_f32_cautious: check_adamw8bit(FloatDType::F32, QuantMap::Dynamic, WeightRounding::Nearest, Decay::Cautious);
    adamw8bit_f32_l2: check_adamw8bit(FloatDType::F32, QuantMap::Dynamic, WeightRounding::Nearest, Decay::L2);
    adamw_f16_stochastic: check_adamw_stochastic();
}
