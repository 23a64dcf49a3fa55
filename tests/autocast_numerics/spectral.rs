//! Ops that burn-autodiff 0.21 cannot differentiate (a panic), which `Amp` builds nodes for:
//! `rfft` and `irfft` (`src/backend/workarounds/fft.rs`; `cfft`, which Burn builds on
//! `rfft`, with them) and float `topk`
//! (`float_topk_values` in `src/backend/workarounds/mod.rs`). Values and gradients against
//! a direct DFT in f64 (and a host sort for top-k), with truncation and padding by `n` along
//! either dimension; canaries that plain autodiff still panics.

use burn::backend::{Autodiff, Flex};
use burn::tensor::TensorData;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::signal::{cfft, irfft, rfft};
use burn_amp::{Amp, autocast};

use super::*;

/// Distinct values in [-1, 1), from a seed.
fn data(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 37 + seed * 11) % 53) as f32 - 26.0) / 26.5)
        .collect()
}

/// `[rows, len]` along dimension 1, or its transpose `[len, rows]` along dimension 0.
fn laid_out<B: Backend>(
    v: &[f32],
    rows: usize,
    len: usize,
    dim: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    let t = Tensor::<B, 2>::from_data(TensorData::new(v.to_vec(), [rows, len]), device);
    if dim == 1 { t } else { t.transpose() }
}

/// Back from [`laid_out`]: rows of `len`.
fn rows_of<B: Backend>(t: Tensor<B, 2>, dim: usize) -> Vec<f32> {
    values(if dim == 1 { t } else { t.transpose() })
}

fn angle(k: usize, j: usize, n: usize) -> f64 {
    2.0 * std::f64::consts::PI * ((k * j) % n) as f64 / n as f64
}

/// `rfft` of each row of `x` (`len` each, truncated or padded to `n`), in f64: `(re, im)`,
/// `n/2 + 1` bins a row.
fn dft(x: &[f32], len: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let bins = n / 2 + 1;
    let (mut re, mut im) = (vec![], vec![]);
    for row in x.chunks(len) {
        for k in 0..bins {
            let (mut r, mut i) = (0f64, 0f64);
            for (j, &v) in row.iter().enumerate().take(n) {
                r += v as f64 * angle(k, j, n).cos();
                i -= v as f64 * angle(k, j, n).sin();
            }
            re.push(r);
            im.push(i);
        }
    }
    (re, im)
}

/// How many times bin `k` of `n/2 + 1` counts in a signal of length `n`.
fn count(k: usize, n: usize) -> f64 {
    if k == 0 || 2 * k == n { 1.0 } else { 2.0 }
}

/// `irfft` of each row of a spectrum (`bins` a row, truncated or padded to `n/2 + 1`), in
/// f64: `n` samples a row; the imaginary parts of the first and the Nyquist bin do not count.
fn inverse_dft(re: &[f32], im: &[f32], bins: usize, n: usize) -> Vec<f64> {
    let mut out = vec![];
    for (r, i) in re.chunks(bins).zip(im.chunks(bins)) {
        for j in 0..n {
            let mut y = 0f64;
            for k in 0..bins.min(n / 2 + 1) {
                let c = count(k, n);
                let sin = if c == 1.0 { 0.0 } else { angle(k, j, n).sin() };
                y += c * (r[k] as f64 * angle(k, j, n).cos() - i[k] as f64 * sin);
            }
            out.push(y / n as f64);
        }
    }
    out
}

fn assert_close(got: &[f32], want: &[f64], tolerance: f32, what: &str) {
    let want: Vec<f32> = want.iter().map(|&v| v as f32).collect();
    let err = rel_l2(got, &want);
    assert!(
        err <= tolerance,
        "{what}: {err:.1e} from the f64 DFT (tolerance {tolerance:.0e})"
    );
}

const ROWS: usize = 3;

/// `rfft` of `[3, len]` along `dim` with `n`, the loss `Σ re ⊙ a + im ⊙ b`: spectrum and
/// the input's gradient (`Σ_k a_k cos - b_k sin`, zero where `n` truncated) against the DFT,
/// from an f32 input and from one in the low dtype (the policy widens it: the gradient
/// comes back through the cast, in the low dtype).
fn rfft_backpropagates<B: AutodiffBackend>(device: &B::Device, precision: Precision) {
    let _autocast = autocast(precision);
    for (len, n, dim) in [
        (8, None, 1),
        (8, None, 0),
        (6, Some(8), 1),
        (16, Some(8), 0),
        (1, None, 1),
        (4, Some(1), 0),
    ] {
        let size = n.unwrap_or(len);
        let bins = size / 2 + 1;
        for low_input in [false, true] {
            let what =
                format!("rfft of {len} along {dim}, n {n:?}, low input {low_input}, {precision:?}");
            let xs = data(ROWS * len, 1);
            let x = laid_out::<B>(&xs, ROWS, len, dim, device).require_grad();
            let input = if low_input {
                x.clone().cast(low(precision))
            } else {
                x.clone()
            };
            let (re, im) = rfft(input, dim, n);
            assert_eq!(re.dtype(), DType::F32, "{what}: the spectrum's dtype");
            let (a, b) = (data(ROWS * bins, 2), data(ROWS * bins, 3));
            let loss = (re.clone() * laid_out::<B>(&a, ROWS, bins, dim, device)
                + im.clone() * laid_out::<B>(&b, ROWS, bins, dim, device))
            .sum();
            let grads = loss.backward();
            let grad = x.grad(&grads).expect("a gradient for the signal");

            // The input as the op saw it: in the low dtype, rounded.
            let seen = if low_input {
                rows_of(
                    laid_out::<B>(&xs, ROWS, len, dim, device).cast(low(precision)),
                    dim,
                )
            } else {
                xs.clone()
            };
            let (want_re, want_im) = dft(&seen, len, size);
            let tolerance = 1e-5;
            assert_close(
                &rows_of(re.inner(), dim),
                &want_re,
                tolerance,
                &format!("{what}: re"),
            );
            assert_close(
                &rows_of(im.inner(), dim),
                &want_im,
                tolerance,
                &format!("{what}: im"),
            );
            let mut want = vec![];
            for (ra, rb) in a.chunks(bins).zip(b.chunks(bins)) {
                for j in 0..len {
                    let g: f64 = (0..bins)
                        .map(|k| {
                            let t = angle(k, j, size);
                            if j < size {
                                ra[k] as f64 * t.cos() - rb[k] as f64 * t.sin()
                            } else {
                                0.0
                            }
                        })
                        .sum();
                    want.push(g);
                }
            }
            // The gradient through the cast is in the low dtype: its rounding.
            let tolerance = match (low_input, precision) {
                (false, _) => 1e-5,
                (true, Precision::Bf16) => 1e-2,
                (true, _) => 2e-3,
            };
            assert_close(
                &rows_of(grad, dim),
                &want,
                tolerance,
                &format!("{what}: gradient"),
            );
        }
    }
}

/// `irfft` of `[3, bins]` along `dim` with `n`, the loss `Σ y ⊙ c`: the signal and the
/// gradients of both parts (`count_k / N · Σ_j c_j cos` and `-count_k / N · Σ_j c_j sin`; zero
/// for the imaginary parts of the end bins and where `n` truncated) against the DFT.
fn irfft_backpropagates<B: AutodiffBackend>(device: &B::Device, precision: Precision) {
    let _autocast = autocast(precision);
    for (bins, n, dim) in [
        (5, None, 1),
        (5, None, 0),
        (3, Some(8), 1),
        (9, Some(8), 0),
        (2, None, 1),
        (3, Some(1), 1),
    ] {
        let size = n.unwrap_or(2 * (bins - 1));
        let what = format!("irfft of {bins} bins along {dim}, n {n:?}, {precision:?}");
        let (rs, is) = (data(ROWS * bins, 4), data(ROWS * bins, 5));
        let re = laid_out::<B>(&rs, ROWS, bins, dim, device).require_grad();
        let im = laid_out::<B>(&is, ROWS, bins, dim, device).require_grad();
        let y = irfft(re.clone(), im.clone(), dim, n);
        assert_eq!(y.dtype(), DType::F32, "{what}: the signal's dtype");
        let c = data(ROWS * size, 6);
        let loss = (y.clone() * laid_out::<B>(&c, ROWS, size, dim, device)).sum();
        let grads = loss.backward();

        assert_close(
            &rows_of(y.inner(), dim),
            &inverse_dft(&rs, &is, bins, size),
            1e-5,
            &format!("{what}: signal"),
        );
        let (mut want_re, mut want_im) = (vec![], vec![]);
        for row in c.chunks(size) {
            for k in 0..bins {
                let used = k < size / 2 + 1;
                let scale = if used {
                    count(k, size) / size as f64
                } else {
                    0.0
                };
                let (mut gr, mut gi) = (0f64, 0f64);
                for (j, &v) in row.iter().enumerate() {
                    gr += v as f64 * angle(k, j, size).cos();
                    gi -= v as f64 * angle(k, j, size).sin();
                }
                want_re.push(scale * gr);
                want_im.push(if count(k, size) == 1.0 {
                    0.0
                } else {
                    scale * gi
                });
            }
        }
        let grad_re = re.grad(&grads).expect("a gradient for the real part");
        // A length-1 signal does not read the imaginary parts: no gradient, i.e. zero.
        let grad_im = im
            .grad(&grads)
            .map_or(vec![0.0; ROWS * bins], |g| rows_of(g, dim));
        assert_close(
            &rows_of(grad_re, dim),
            &want_re,
            1e-5,
            &format!("{what}: real part's gradient"),
        );
        assert_close(
            &grad_im,
            &want_im,
            1e-5,
            &format!("{what}: imaginary part's gradient"),
        );
    }
}

/// `cfft` (Burn builds it on `rfft`, with slices, flips and a `cat`) of a complex `[3, len]`
/// along `dim` with `n`, the loss `Σ re ⊙ a + im ⊙ b`: the full spectrum and the gradients of
/// both parts of the signal against the DFT.
fn cfft_backpropagates<B: AutodiffBackend>(device: &B::Device, precision: Precision) {
    let _autocast = autocast(precision);
    for (len, n, dim) in [
        (8, None, 1),
        (8, None, 0),
        (16, Some(8), 1),
        (2, None, 0),
        (4, Some(1), 1),
    ] {
        let size = n.unwrap_or(len);
        let what = format!("cfft of {len} along {dim}, n {n:?}, {precision:?}");
        let (rs, is) = (data(ROWS * len, 10), data(ROWS * len, 11));
        let xr = laid_out::<B>(&rs, ROWS, len, dim, device).require_grad();
        let xi = laid_out::<B>(&is, ROWS, len, dim, device).require_grad();
        let (zr, zi) = cfft(xr.clone(), xi.clone(), dim, n);
        let (a, b) = (data(ROWS * size, 12), data(ROWS * size, 13));
        let loss = (zr.clone() * laid_out::<B>(&a, ROWS, size, dim, device)
            + zi.clone() * laid_out::<B>(&b, ROWS, size, dim, device))
        .sum();
        let grads = loss.backward();

        let (mut want_zr, mut want_zi) = (vec![], vec![]);
        for (r, i) in rs.chunks(len).zip(is.chunks(len)) {
            for k in 0..size {
                let (mut re, mut im) = (0f64, 0f64);
                for j in 0..len.min(size) {
                    let (c, s) = (angle(k, j, size).cos(), angle(k, j, size).sin());
                    re += r[j] as f64 * c + i[j] as f64 * s;
                    im += i[j] as f64 * c - r[j] as f64 * s;
                }
                want_zr.push(re);
                want_zi.push(im);
            }
        }
        let (mut want_gr, mut want_gi) = (vec![], vec![]);
        for (ra, rb) in a.chunks(size).zip(b.chunks(size)) {
            for j in 0..len {
                let (mut gr, mut gi) = (0f64, 0f64);
                // Samples past `n` were truncated away: no gradient.
                let bins = if j < size { 0..size } else { 0..0 };
                for k in bins {
                    let (c, s) = (angle(k, j, size).cos(), angle(k, j, size).sin());
                    gr += ra[k] as f64 * c - rb[k] as f64 * s;
                    gi += ra[k] as f64 * s + rb[k] as f64 * c;
                }
                want_gr.push(gr);
                want_gi.push(gi);
            }
        }
        let grad = |x: &Tensor<B, 2>| rows_of(x.grad(&grads).expect("a gradient"), dim);
        for (got, want, part) in [
            (rows_of(zr.inner(), dim), want_zr, "spectrum, re"),
            (rows_of(zi.inner(), dim), want_zi, "spectrum, im"),
            (grad(&xr), want_gr, "real part's gradient"),
            (grad(&xi), want_gi, "imaginary part's gradient"),
        ] {
            assert_close(&got, &want, 1e-5, &format!("{what}: {part}"));
        }
    }
}

/// `topk` of `[4, 7]` along either dimension, the loss `Σ v ⊙ w`: the values against a host
/// sort, the gradient `w` at the picked elements and zero elsewhere.
fn topk_backpropagates<B: AutodiffBackend>(device: &B::Device, precision: Precision) {
    let _autocast = autocast(precision);
    let (rows, len, k) = (4, 7, 3);
    for dim in [1, 0] {
        let what = format!("top {k} of {len} along {dim}, {precision:?}");
        let xs = data(rows * len, 7);
        let x = laid_out::<B>(&xs, rows, len, dim, device).require_grad();
        let top = x.clone().topk(k, dim);
        let w = data(rows * k, 8);
        let loss = (top.clone() * laid_out::<B>(&w, rows, k, dim, device)).sum();
        let grads = loss.backward();
        let (mut want, mut want_grad) = (vec![], vec![0f32; rows * len]);
        for (r, row) in xs.chunks(len).enumerate() {
            let mut order: Vec<usize> = (0..len).collect();
            order.sort_by(|&i, &j| row[j].total_cmp(&row[i]));
            for (p, &i) in order.iter().take(k).enumerate() {
                want.push(row[i]);
                want_grad[r * len + i] = w[r * k + p];
            }
        }
        assert_eq!(rows_of(top.inner(), dim), want, "{what}: values");
        let grad = x.grad(&grads).expect("a gradient");
        assert_eq!(rows_of(grad, dim), want_grad, "{what}: gradient");
    }
}

/// `argtopk` of floats and ints of `[4, 7]` along either dimension, against a host sort
/// (Flex has none of its own).
fn argtopk_picks_the_largest<B: Backend>(device: &B::Device, precision: Precision) {
    let _autocast = autocast(precision);
    let (rows, len, k) = (4, 7, 3);
    for dim in [1, 0] {
        let xs = data(rows * len, 9);
        let mut want = vec![];
        for row in xs.chunks(len) {
            let mut order: Vec<usize> = (0..len).collect();
            order.sort_by(|&i, &j| row[j].total_cmp(&row[i]));
            want.extend(order.iter().take(k).map(|&i| i as i64));
        }
        let floats = laid_out::<B>(&xs, rows, len, dim, device);
        let ints = floats.clone().mul_scalar(100).int();
        for (kind, got) in [
            ("floats", floats.argtopk(k, dim)),
            ("ints", ints.argtopk(k, dim)),
        ] {
            let got = if dim == 1 { got } else { got.transpose() };
            let got: Vec<i64> = got.into_data().convert::<i64>().to_vec().unwrap();
            assert_eq!(
                got, want,
                "top {k} indices of {kind} along {dim}, {precision:?}"
            );
        }
    }
}

pub fn spectral_ops_and_topk_backpropagate<B: Backend>(device: &B::Device, precision: Precision) {
    rfft_backpropagates::<Amp<Autodiff<B>>>(device, precision);
    irfft_backpropagates::<Amp<Autodiff<B>>>(device, precision);
    cfft_backpropagates::<Amp<Autodiff<B>>>(device, precision);
    topk_backpropagates::<Amp<Autodiff<B>>>(device, precision);
    argtopk_picks_the_largest::<Amp<B>>(device, precision);
}

flex_and_wgpu_tests!(
    spectral_ops_and_topk_backpropagate: spectral_backward_flex_f16,
    spectral_backward_flex_bf16, spectral_backward_wgpu_f16
);

/// Burn 0.21's missing pieces, which `Amp` builds: with a Burn that has them, this fails.
#[test]
fn plain_autodiff_has_no_fft_or_topk_backward() {
    type Plain = Autodiff<Flex>;
    let device = Default::default();
    let x = || {
        Tensor::<Plain, 2>::from_data(TensorData::new(data(16, 1), [2, 8]), &device).require_grad()
    };
    let fft = std::panic::catch_unwind(|| rfft(x(), 1, None).0.sum().backward());
    assert!(
        fft.is_err(),
        "plain autodiff runs rfft now: the defect is fixed"
    );
    let inverse = std::panic::catch_unwind(|| irfft(x(), x(), 1, Some(8)).sum().backward());
    assert!(
        inverse.is_err(),
        "plain autodiff runs irfft now: the defect is fixed"
    );
    let topk = std::panic::catch_unwind(|| x().topk(2, 1).sum().backward());
    assert!(
        topk.is_err(),
        "plain autodiff takes a float topk now: the defect is fixed"
    );
    let argtopk = std::panic::catch_unwind(|| {
        Tensor::<Flex, 2>::from_data(TensorData::new(data(16, 1), [2, 8]), &device).argtopk(2, 1)
    });
    assert!(
        argtopk.is_err(),
        "Flex takes an argtopk now: the defect is fixed"
    );
}
