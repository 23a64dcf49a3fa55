//! Block quantization round trips (`quantize` then `dequantize`, the burn-op reference of the
//! kernels' encoder and decoder): every value within the map's largest half-spacing of its
//! block's absmax, no NaN, and on Flex the codes equal a host encoder's.

use burn::backend::{Flex, Wgpu};
use burn::prelude::*;
use burn_amp::optim::QuantMap;
use burn_amp::optim::quantized::{MapTable, dequantize, quantize};

use crate::{Rng, common, values};

/// The largest distance from a value of [-1, 1] (`signed`) or [0, 1] to its nearest map
/// entry: half the largest gap, or the distance from an end of the range to the map's end.
fn max_error(table: &MapTable, signed: bool) -> f32 {
    let v = &table.values;
    let half_gap = v
        .windows(2)
        .map(|w| (w[1] - w[0]) / 2.0)
        .fold(0f32, f32::max);
    let low_end = if signed { 1.0 + v[0] } else { v[0] };
    half_gap.max(low_end.abs()).max((1.0 - v[255]).abs())
}

/// The blocks of the cases: values, and a name.
fn cases(n: usize) -> Vec<(&'static str, Vec<f32>)> {
    let mut rng = Rng::new(4);
    let mut outliers = rng.vec(n, 1.0);
    for i in (0..n).step_by(97) {
        outliers[i] = 1e4;
    }
    vec![
        ("random", rng.vec(n, 1.0)),
        ("all zero", vec![0.0; n]),
        ("tiny", rng.vec(n, 1e-30)),
        ("huge", rng.vec(n, 1e30)),
        ("outliers", outliers),
        // Each block a different scale: the maxima are per block.
        ("mixed scales", {
            let v = rng.vec(n, 1.0);
            v.iter()
                .enumerate()
                .map(|(i, x)| x * 10f32.powi((i / 256) as i32 % 9 - 4))
                .collect()
        }),
    ]
}

fn check<B: Backend>(device: &B::Device, exact_codes: bool) {
    // 1000 values: 4 blocks of 256, the last one partial.
    let n = 1000;
    let block = 256;
    for map in [QuantMap::Dynamic, QuantMap::Linear] {
        for signed in [true, false] {
            let table = map.table(signed);
            let bound = max_error(table, signed);
            for (name, mut x) in cases(n) {
                if !signed {
                    x.iter_mut().for_each(|v| *v = v.abs());
                }
                let what = format!("{map:?} signed {signed} {name}");
                let t = Tensor::<B, 1>::from_data(TensorData::new(x.clone(), [n]), device);
                let q = quantize(t, block, map, signed);
                assert_eq!(q.blocks(), 4, "{what}: blocks");
                assert_eq!(q.codes.dims(), [4 * block / 4], "{what}: code words");
                assert_eq!(q.bytes(), (4 * block + 4 * 4) as u64, "{what}: bytes");
                let absmax = values(q.absmax.clone());
                let back = values(dequantize(&q, n, signed));
                for (i, (a, b)) in x.iter().zip(&back).enumerate() {
                    let m = absmax[i / block];
                    assert!(b.is_finite(), "{what}: element {i} decoded to {b}");
                    // The bound, plus f32 rounding of the product and the quotient.
                    let tol = bound * m * (1.0 + 1e-5) + m * 1e-6;
                    assert!(
                        (a - b).abs() <= tol,
                        "{what}: element {i}: {a:e} decoded as {b:e} (bound {tol:e})"
                    );
                }
                // Each block's absmax is its largest magnitude.
                for (j, m) in absmax.iter().enumerate() {
                    let want = x[j * block..((j + 1) * block).min(n)]
                        .iter()
                        .fold(0f32, |m, v| m.max(v.abs()));
                    assert_eq!(*m, want, "{what}: absmax of block {j}");
                }
                if exact_codes {
                    let words = q
                        .codes
                        .clone()
                        .into_data()
                        .convert::<i32>()
                        .to_vec::<i32>()
                        .unwrap();
                    for i in 0..n {
                        let m = absmax[i / block];
                        let norm = if m > 0.0 { x[i] / m } else { 0.0 };
                        let code = (words[i / 4] >> (8 * (i % 4))) & 255;
                        assert_eq!(
                            code as u8,
                            table.encode(norm),
                            "{what}: code of element {i}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn round_trips_within_the_maps_spacing_on_flex() {
    common::big_stack(|| check::<Flex>(&Default::default(), true));
}

#[test]
fn round_trips_within_the_maps_spacing_on_wgpu() {
    if let Some(device) = common::wgpu_device() {
        // WGSL's division may differ from IEEE by an ulp: codes on a bound may differ, the
        // bound still holds.
        common::big_stack(move || check::<Wgpu>(&device, false));
    }
}

/// The maps themselves: 256 sorted values, 0 and the range's top exactly representable, the
/// dynamic map finer than the linear one near 0.
#[test]
fn the_maps_are_sorted_and_contain_zero() {
    for map in [QuantMap::Dynamic, QuantMap::Linear] {
        for signed in [true, false] {
            let t = map.table(signed);
            assert!(
                t.values.windows(2).all(|w| w[0] < w[1]),
                "{map:?} {signed}: sorted, distinct"
            );
            assert!(t.values.contains(&0.0), "{map:?} {signed}: zero is exact");
            assert_eq!(t.values[255], 1.0, "{map:?} {signed}: 1 is exact");
            assert_eq!(
                t.encode(0.0) as usize,
                t.values.iter().position(|v| *v == 0.0).unwrap()
            );
        }
    }
    let smallest = |map: QuantMap| {
        let t = map.table(false);
        t.values[1]
    };
    assert!(
        smallest(QuantMap::Dynamic) < 1e-6,
        "dynamic: reaches 1e-7 of the block max"
    );
    assert!(smallest(QuantMap::Linear) > 1e-3, "linear: 1/255");
}
