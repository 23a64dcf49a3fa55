//! Products under `Amp` (`src/backend/workarounds/products.rs`): `prod`, `prod_dim` and
//! `cumprod` with signed factors and zeros, values and gradients against a host reference in
//! f64, on Flex (both checkpointing strategies) and wgpu, from f32 and from half inputs.
//! Plain burn-autodiff 0.21 is measured beside it: NaN for a negative factor and at a zero.

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::TensorData;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::{Amp, autocast};

use super::*;

const SHAPE: [usize; 2] = [4, 5];

/// Inputs of `SHAPE`, every value on a grid of 0.5 with few significant bits: exact in f16,
/// and so are the products, sums and gradients below (the half-precision runs see the
/// reference's values).
const INPUTS: [(&str, [f32; 20]); 3] = [
    (
        "rows with zeros",
        [
            -2.0, 3.0, 0.5, -1.5, 1.0, // signed, no zero
            1.5, 0.0, -2.0, 0.5, 2.0, // one zero
            0.0, 1.0, -0.5, 0.0, 3.0, // two zeros
            -1.0, -0.5, 2.5, -1.0, 0.0, // a zero last
        ],
    ),
    (
        "signed, no zero",
        [
            -2.0, 1.0, 0.5, -1.0, 1.5, 1.0, -0.5, 2.0, -1.0, 1.0, //
            0.5, -1.0, 1.0, 2.0, -1.0, 1.5, -1.0, 0.5, 1.0, -2.0,
        ],
    ),
    (
        "one zero",
        [
            -2.0, 1.0, 0.5, -1.0, 1.5, 1.0, -0.5, 0.0, -1.0, 1.0, //
            0.5, -1.0, 1.0, 2.0, -1.0, 1.5, -1.0, 0.5, 1.0, -2.0,
        ],
    ),
];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    All,
    Dim(usize),
    Cumulative(usize),
}

const KINDS: [Kind; 5] = [
    Kind::All,
    Kind::Dim(0),
    Kind::Dim(1),
    Kind::Cumulative(0),
    Kind::Cumulative(1),
];

fn out_shape(kind: Kind) -> Vec<usize> {
    match kind {
        Kind::All => vec![1],
        Kind::Dim(d) => {
            let mut s = SHAPE.to_vec();
            s[d] = 1;
            s
        }
        Kind::Cumulative(_) => SHAPE.to_vec(),
    }
}

/// The weights of the loss `Σ w ⊙ out`: the output's gradient, not uniform.
fn weights(kind: Kind) -> Vec<f32> {
    let n: usize = out_shape(kind).iter().product();
    (0..n).map(|i| [1.0, -0.5, 2.0, 0.5][i % 4]).collect()
}

/// The output and the input's gradient, in f64 on the host: products of the factors (the
/// others, for the gradient) written out.
fn reference(input: &[f32; 20], kind: Kind) -> (Vec<f64>, Vec<f64>) {
    let x = |r: usize, c: usize| input[r * SHAPE[1] + c] as f64;
    let w: Vec<f64> = weights(kind).iter().map(|&v| v as f64).collect();
    let (rows, cols) = (SHAPE[0], SHAPE[1]);
    let mut grad = vec![0.0; rows * cols];
    let out = match kind {
        Kind::All => {
            let all: Vec<(usize, usize)> = (0..rows)
                .flat_map(|r| (0..cols).map(move |c| (r, c)))
                .collect();
            for &(r, c) in &all {
                let others: f64 = all
                    .iter()
                    .filter(|&&p| p != (r, c))
                    .map(|&(i, j)| x(i, j))
                    .product();
                grad[r * cols + c] = w[0] * others;
            }
            vec![all.iter().map(|&(i, j)| x(i, j)).product()]
        }
        Kind::Dim(d) | Kind::Cumulative(d) => {
            let (slices, len) = if d == 0 { (cols, rows) } else { (rows, cols) };
            let at = |s: usize, k: usize| if d == 0 { (k, s) } else { (s, k) };
            let index = |(r, c): (usize, usize)| r * cols + c;
            let mut out = vec![
                0.0;
                if matches!(kind, Kind::Dim(_)) {
                    slices
                } else {
                    rows * cols
                }
            ];
            for s in 0..slices {
                let v = |k: usize| {
                    let (r, c) = at(s, k);
                    x(r, c)
                };
                if matches!(kind, Kind::Dim(_)) {
                    out[s] = (0..len).map(v).product();
                    for i in 0..len {
                        let others: f64 = (0..len).filter(|&k| k != i).map(v).product();
                        grad[index(at(s, i))] = w[s] * others;
                    }
                } else {
                    for j in 0..len {
                        out[index(at(s, j))] = (0..=j).map(v).product();
                    }
                    // d out_j / d x_i = Π_{k ≤ j, k ≠ i} x_k, for j ≥ i.
                    for i in 0..len {
                        grad[index(at(s, i))] = (i..len)
                            .map(|j| {
                                let wj = w[index(at(s, j))];
                                wj * (0..=j).filter(|&k| k != i).map(v).product::<f64>()
                            })
                            .sum();
                    }
                }
            }
            out
        }
    };
    (out, grad)
}

/// The output and `x`'s gradient on `B`, `x` entering the product in `dtype`.
fn run<B: AutodiffBackend>(
    input: &[f32; 20],
    kind: Kind,
    dtype: DType,
    device: &B::Device,
) -> (Vec<f32>, Vec<f32>) {
    let x =
        Tensor::<B, 2>::from_data(TensorData::new(input.to_vec(), SHAPE), device).require_grad();
    let input = x.clone().cast(dtype);
    let out: Tensor<B, 2> = match kind {
        Kind::All => input.prod().reshape([1, 1]),
        Kind::Dim(d) => input.prod_dim(d),
        Kind::Cumulative(d) => input.cumprod(d),
    };
    let shape: [usize; 2] = match out_shape(kind)[..] {
        [a] => [1, a],
        [a, b] => [a, b],
        _ => unreachable!(),
    };
    let w = Tensor::<B, 2>::from_data(TensorData::new(weights(kind), shape), device);
    let out = out.cast(DType::F32);
    let loss = (out.clone() * w).sum();
    let grad = x.grad(&loss.backward()).expect("x's gradient");
    (values(out), values(grad))
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().to_vec::<f32>().unwrap()
}

fn assert_matches(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        // Every value here is exact on the grid: equal, up to f32 rounding of a few products.
        let ok = (*g as f64 - w).abs() <= 1e-6 * w.abs().max(1.0);
        assert!(
            ok,
            "{what}: element {i} is {g}, want {w}\n  got: {got:?}\n  want: {want:?}"
        );
    }
}

pub(crate) fn check<B: AutodiffBackend>(device: &B::Device, backend: &str) {
    for (precision, dtype) in [
        (Precision::F32, DType::F32),
        (Precision::F16, DType::F16),
        (Precision::F16, DType::F32),
    ] {
        let _g = autocast(precision);
        for (name, input) in &INPUTS {
            for kind in KINDS {
                let (want_out, want_grad) = reference(input, kind);
                let (out, grad) = run::<B>(input, kind, dtype, device);
                let what =
                    format!("{kind:?} of {name} on {backend} at {precision:?} from {dtype:?}");
                assert_matches(&out, &want_out, &format!("{what}: output"));
                assert_matches(&grad, &want_grad, &format!("{what}: gradient"));
            }
        }
    }
}

#[test]
fn products_are_right_with_signs_and_zeros_on_flex() {
    check::<Amp<Autodiff<Flex>>>(&Default::default(), "Flex");
    check::<Amp<Autodiff<Flex, BalancedCheckpointing>>>(
        &Default::default(),
        "Flex, BalancedCheckpointing",
    );
}

#[test]
fn products_are_right_with_signs_and_zeros_on_wgpu() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    check::<Amp<Autodiff<Wgpu>>>(&device, "Wgpu");
}

/// Without a gradient (an untracked tensor under autodiff, and no autodiff at all): the
/// kernel's product too.
#[test]
fn untracked_products_are_the_kernels() {
    let device = Default::default();
    let _g = autocast(Precision::F16);
    let row = [-2.0f32, 3.0, 0.5];
    let want = -3.0;
    let on_autodiff = Tensor::<Amp<Autodiff<Flex>>, 1>::from_floats(row, &device);
    assert_eq!(on_autodiff.clone().prod().into_scalar(), want);
    assert_eq!(on_autodiff.prod_dim(0).into_scalar(), want);
    let plain = Tensor::<Amp<Flex>, 1>::from_floats(row, &device);
    assert_eq!(plain.prod().into_scalar(), want);
}

/// Burn 0.21's defects, which the above works around: a Burn that fixes them fails here (the
/// workaround can go then).
#[test]
fn plain_autodiff_products_are_still_wrong() {
    let device = Default::default();
    let x = Tensor::<Autodiff<Flex>, 1>::from_floats([-2.0, 3.0, 0.5], &device).require_grad();
    let p = x.clone().prod();
    assert!(
        p.clone().into_scalar().is_nan(),
        "plain autodiff's prod of [-2, 3, 0.5] is right now (-3): the defect is fixed"
    );
    let x = Tensor::<Autodiff<Flex>, 1>::from_floats([2.0, 0.0, 3.0], &device).require_grad();
    let g = x.grad(&x.clone().cumprod(0).sum().backward()).unwrap();
    let g = g.into_data().to_vec::<f32>().unwrap();
    assert!(
        g.iter().any(|v| v.is_nan()),
        "plain autodiff's cumprod gradient at a zero is {g:?}, no NaN: the defect is fixed"
    );
}

/// The products of a transposed view (a strided input: Flex 0.21 mishandles some views, see
/// the README) are those of the contiguous tensor along the other dimension, values and
/// gradients; and `w.swap_dims(0, 1).tanh().prod_dim(0)`, whose backward made Burn 0.21's
/// fusion panic in code generation on wgpu (`exp(sum(log x))`'s), runs under `Amp`.
pub(crate) fn transposed<B: AutodiffBackend>(device: &B::Device, backend: &str) {
    let _g = autocast(Precision::F16);
    let (_, input) = &INPUTS[0];
    for kind in [
        Kind::Dim(0),
        Kind::Dim(1),
        Kind::Cumulative(0),
        Kind::Cumulative(1),
    ] {
        let x = Tensor::<B, 2>::from_data(TensorData::new(input.to_vec(), SHAPE), device)
            .require_grad();
        let t = x.clone().swap_dims(0, 1);
        let out = match kind {
            Kind::Dim(d) => t.prod_dim(1 - d),
            Kind::Cumulative(d) => t.cumprod(1 - d),
            Kind::All => unreachable!(),
        }
        .swap_dims(0, 1);
        let w = Tensor::<B, 2>::from_data(TensorData::new(weights(kind), out.shape()), device);
        let grad = x.grad(&(out.clone() * w).sum().backward()).unwrap();
        let (want_out, want_grad) = reference(input, kind);
        let what = format!("{kind:?} of the transposed view on {backend}");
        assert_matches(&values(out), &want_out, &format!("{what}: output"));
        assert_matches(&values(grad), &want_grad, &format!("{what}: gradient"));
    }
    let quarter: Vec<f32> = input.iter().map(|v| v * 0.25).collect();
    let w = Tensor::<B, 2>::from_data(TensorData::new(quarter, SHAPE), device).require_grad();
    let loss = w.clone().swap_dims(0, 1).tanh().prod_dim(0).mean();
    let grad = values(w.grad(&loss.clone().backward()).unwrap());
    // The product runs along w's rows: ∂/∂w_rc of mean_r Π_c tanh(w_rc) is
    // Π_{c'≠c} tanh(w_rc') (1 − tanh²(w_rc)) / rows.
    let t = |r: usize, c: usize| ((input[r * SHAPE[1] + c] * 0.25) as f64).tanh();
    for r in 0..SHAPE[0] {
        for c in 0..SHAPE[1] {
            let others: f64 = (0..SHAPE[1]).filter(|&k| k != c).map(|k| t(r, k)).product();
            let want = others * (1.0 - t(r, c).powi(2)) / SHAPE[0] as f64;
            let got = grad[r * SHAPE[1] + c] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1e-3),
                "swap_dims, tanh, prod_dim on {backend}: gradient [{r}, {c}] is {got}, want {want}"
            );
        }
    }
}

#[test]
fn products_of_transposed_views_on_flex() {
    transposed::<Amp<Autodiff<Flex>>>(&Default::default(), "Flex");
}

#[test]
fn products_of_transposed_views_on_wgpu() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    transposed::<Amp<Autodiff<Wgpu>>>(&device, "Wgpu");
}
