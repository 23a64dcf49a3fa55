//! Integer powers under `Amp` (`src/backend/workarounds/int_pow.rs`): Burn 0.21 takes them
//! through a float `pow` and truncates, which CubeCL's lands below (5³ = 124 on wgpu). Against
//! `i64::pow`, and the canary that plain wgpu still loses one.

use burn::tensor::{Int, TensorData};
use burn_amp::Amp;

use super::*;

const BASES: std::ops::RangeInclusive<i64> = -6..=6;

fn ints<B: Backend>(values: &[i64], device: &B::Device) -> Tensor<B, 1, Int> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

fn read<B: Backend>(t: Tensor<B, 1, Int>) -> Vec<i64> {
    t.into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("ints")
}

/// Bases -6..=6 to the scalar powers 0..=9 (6⁹ fits i32), and element by element to
/// exponents from -3 to 41 (past 9 on bases -1, 0, 1 only, as the others overflow), exactly.
pub(crate) fn int_powers_are_exact<X: Backend>(device: &X::Device) {
    let bases: Vec<i64> = BASES.collect();
    for exponent in 0..=9u32 {
        let got = read(ints::<Amp<X>>(&bases, device).powi_scalar(exponent as i64));
        let want: Vec<i64> = bases.iter().map(|b| b.pow(exponent)).collect();
        assert_eq!(got, want, "powi_scalar({exponent})");
    }
    let (mut base, mut exponent) = (Vec::new(), Vec::new());
    for b in BASES {
        for e in -3..=41i64 {
            if e <= 9 || b.abs() <= 1 {
                base.push(b);
                exponent.push(e);
            }
        }
    }
    let got = read(ints::<Amp<X>>(&base, device).powi(ints::<Amp<X>>(&exponent, device)));
    // A negative exponent: Burn's float power truncated (±1 for a base of ±1, else 0).
    let want: Vec<i64> = base
        .iter()
        .zip(&exponent)
        .map(|(&b, &e)| match e {
            0.. => b.pow(e as u32),
            _ if b.abs() == 1 => b.pow(e.unsigned_abs() as u32),
            _ => 0,
        })
        .collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "{}^{}", base[i], exponent[i]);
    }
}

#[test]
fn int_powers_are_exact_on_flex() {
    int_powers_are_exact::<burn::backend::Flex>(&Default::default());
}

#[test]
fn int_powers_are_exact_on_wgpu() {
    if let Some(device) = common::wgpu_device() {
        int_powers_are_exact::<burn::backend::Wgpu>(&device);
    }
}

/// i64 powers past 2^33, element by element: exact (an exponent past 33 counted as 32 or 33,
/// right for i32 only, made 2^40 into 2^32).
#[test]
fn i64_powers_past_2_to_the_33_are_exact_on_flex() {
    let device = Default::default();
    let (base, exponent) = ([2i64, 3, -2, 7, -1, 2], [40i64, 35, 41, 20, 71, 62]);
    type A = Amp<burn::backend::Flex>;
    let i64s = |v: &[i64]| {
        Tensor::<A, 1, Int>::from_data(
            TensorData::new(v.to_vec(), [v.len()]),
            (&device, DType::I64),
        )
    };
    let lhs = i64s(&base);
    assert_eq!(lhs.dtype(), DType::I64);
    let got = read(lhs.powi(i64s(&exponent)));
    let want: Vec<i64> = base
        .iter()
        .zip(&exponent)
        .map(|(b, e)| b.pow(*e as u32))
        .collect();
    assert_eq!(got, want);
}

/// Plain `X`'s 5³ (the GPU check reports CUDA's).
pub(crate) fn plain_five_cubed<X: Backend>(device: &X::Device) -> i64 {
    read(ints::<X>(&[5], device).powi_scalar(3))[0]
}

/// Burn 0.21's defect, which `Amp` works around: fixed in a later Burn, this fails.
#[test]
fn plain_wgpu_loses_one_in_integer_powers() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    let got = plain_five_cubed::<burn::backend::Wgpu>(&device);
    assert_eq!(
        got, 124,
        "plain wgpu's 5³ is right now: the defect is fixed"
    );
}
