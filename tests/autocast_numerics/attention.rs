//! Attention under autodiff: softmax in f32, matmuls in the low dtype.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{TensorData, module};
use burn_amp::{Amp, autocast};
use burn_backend::ops::AttentionModuleOptions;

use super::*;

struct AttnData {
    shape_q: [usize; 4],
    shape_kv: [usize; 4],
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Weights of the loss `sum(out * r)`: varied upstream gradients.
    r: Vec<f32>,
    /// Which of dq, dk, dv have a meaningful f32 reference.
    grads: [bool; 3],
}

struct AttnResult {
    out_dtype: DType,
    grad_dtypes: [DType; 3],
    out: Vec<f32>,
    /// dq, dk, dv.
    grads: [Vec<f32>; 3],
}

/// Large logits over a long, flat sequence: 8 queries, 1024 keys, head dim 16, scores
/// q·k/4 = 16 ± 0.3, so that hundreds of keys share the softmax (its sum S > 256, checked:
/// S² overflows f16 in the backward of the division), and values 10 ± 1 (a common part: the
/// softmax backward subtracts nearly equal numbers, which half precision loses).
fn large_logits() -> AttnData {
    let (sq, sk, d) = (8, 1024, 16);
    let mut u = uniform(7);
    let q = (0..sq * d).map(|_| on_grid(0.9 + 0.2 * u())).collect();
    let k = (0..sk * d).map(|_| on_grid(3.5 + u())).collect();
    let v = (0..sk * d).map(|_| on_grid(9.0 + 2.0 * u())).collect();
    let r = (0..sq * d).map(|_| on_grid(2.0 * u() - 1.0)).collect();
    let data = AttnData {
        shape_q: [1, 1, sq, d],
        shape_kv: [1, 1, sk, d],
        q,
        k,
        v,
        r,
        grads: [true; 3],
    };
    for i in 0..sq {
        let scores: Vec<f32> = (0..sk)
            .map(|j| {
                (0..d)
                    .map(|m| data.q[i * d + m] * data.k[j * d + m])
                    .sum::<f32>()
                    / 4.0
            })
            .collect();
        let max = scores.iter().copied().fold(f32::MIN, f32::max);
        let sum: f32 = scores.iter().map(|s| (s - max).exp()).sum();
        assert!(
            max > 15.0 && sum > 256.0,
            "query {i}: max score {max}, softmax sum {sum}"
        );
    }
    data
}

/// 70,000 keys with equal scores: the softmax sum (70,000) is beyond f16's 65,504. With all
/// scores equal dq and dk are zero up to rounding: only the output and dv are compared.
fn long_flat() -> AttnData {
    let (sq, sk, d) = (2, 70_000, 4);
    let mut u = uniform(11);
    let q = vec![0.5; sq * d];
    let k = vec![1.0; sk * d];
    let v = (0..sk * d).map(|_| on_grid(0.5 + u())).collect();
    let r = (0..sq * d).map(|_| on_grid(2.0 * u() - 1.0)).collect();
    AttnData {
        shape_q: [1, 1, sq, d],
        shape_kv: [1, 1, sk, d],
        q,
        k,
        v,
        r,
        grads: [false, false, true],
    }
}

fn attention_run<X: AutodiffBackend>(data: &AttnData, precision: Option<Precision>) -> AttnResult {
    let device = Default::default();
    let t = |v: &Vec<f32>, s: [usize; 4]| {
        Tensor::<X, 4>::from_data(TensorData::new(v.clone(), s), &device)
    };
    let q = t(&data.q, data.shape_q).require_grad();
    let k = t(&data.k, data.shape_kv).require_grad();
    let v = t(&data.v, data.shape_kv).require_grad();
    let r = t(&data.r, data.shape_q);
    let guard = precision.map(autocast);
    let out = module::attention(
        q.clone(),
        k.clone(),
        v.clone(),
        None,
        None,
        AttentionModuleOptions::default(),
    );
    let out_dtype = out.dtype();
    let loss = (out.clone() * r).sum();
    drop(guard);
    let grads = loss.backward();
    let gq = q.grad(&grads).expect("dq");
    let gk = k.grad(&grads).expect("dk");
    let gv = v.grad(&grads).expect("dv");
    AttnResult {
        out_dtype,
        grad_dtypes: [gq.dtype(), gk.dtype(), gv.dtype()],
        out: values(out),
        grads: [values(gq), values(gk), values(gv)],
    }
}

/// Attention on a training stack at `precision` against `Autodiff<Flex>` in f32 on the same
/// values. Tolerances, as relative L2 errors: the output 1e-2 (f16) / 2e-2 (bf16); the
/// gradients 2e-2 (f16) / 1e-1 (bf16). They cover what the lowered matmuls cost by
/// themselves (scores near 16 rounded to f16 move by up to 0.008, to bf16 by up to 0.06,
/// against a spread of 0.3; the gradient of the softmax weights is rounded once): measured
/// 5e-3 (f16) and 5e-2 (bf16) on dq and dk. A softmax in half precision, with its backward,
/// is off by 1e2 to 1e3 (f16) and about 1 (bf16) on the same gradients.
fn attention_matches_f32<A: AutodiffBackend>(
    data: &AttnData,
    precision: Precision,
    check_grads: bool,
) -> Vec<String> {
    let reference = attention_run::<Autodiff<Flex>>(data, None);
    let amp = attention_run::<A>(data, Some(precision));
    let (tol_out, tol_grad) = match precision {
        Precision::F16 => (1e-2, 2e-2),
        _ => (2e-2, 1e-1),
    };
    let mut failures = Vec::new();
    if amp.out_dtype != low(precision) {
        failures.push(format!(
            "output dtype {:?}, expected {:?}",
            amp.out_dtype,
            low(precision)
        ));
    }
    if check_grads && amp.grad_dtypes != [DType::F32; 3] {
        failures.push(format!(
            "f32 q, k, v got gradients of {:?}",
            amp.grad_dtypes
        ));
    }
    let err = rel_l2(&amp.out, &reference.out);
    eprintln!(
        "  {} {precision}: output rel. L2 error {err:.2e}",
        std::any::type_name::<A>()
    );
    if !within(err, tol_out) {
        failures.push(format!(
            "output: rel. L2 error {err:.3e} > {tol_out:e} (first values {:?}, f32 {:?})",
            &amp.out[..4],
            &reference.out[..4]
        ));
    }
    for (name, got, want) in ["dq", "dk", "dv"]
        .iter()
        .zip(&amp.grads)
        .zip(&reference.grads)
        .zip(data.grads)
        .filter(|(_, compared)| *compared)
        .map(|(((n, g), w), _)| (n, g, w))
    {
        let err = rel_l2(got, want);
        eprintln!("  {name}: rel. L2 error {err:.2e}");
        if check_grads && !within(err, tol_grad) {
            failures.push(format!(
                "{name}: rel. L2 error {err:.3e} > {tol_grad:e} (first values {:?}, f32 {:?})",
                &got[..3],
                &want[..3]
            ));
        }
    }
    failures
}

pub(crate) fn check_attention<A: AutodiffBackend>(precision: Precision, check_grads: bool) {
    let mut failures = Vec::new();
    for (name, data) in [
        ("large logits", large_logits()),
        ("70,000 flat keys", long_flat()),
    ] {
        eprintln!("{name}:");
        for f in attention_matches_f32::<A>(&data, precision, check_grads) {
            failures.push(format!("{name}: {f}"));
        }
    }
    assert!(
        failures.is_empty(),
        "attention on {} under {precision}:\n{}",
        std::any::type_name::<A>(),
        failures.join("\n")
    );
}

#[test]
fn attention_softmax_in_f32_amp_over_autodiff_f16() {
    check_attention::<Amp<Autodiff<Flex>>>(Precision::F16, true);
}

#[test]
fn attention_softmax_in_f32_amp_over_autodiff_bf16() {
    check_attention::<Amp<Autodiff<Flex>>>(Precision::Bf16, true);
}

/// `Autodiff<Amp<B>>`: autodiff composes attention from ops that each pass through `Amp`, so
/// the forward already follows the policy. Its backward runs through `Amp` at the precision
/// in force then and gives the lowered matmuls' gradients in the low dtype (this stack's
/// known gradient-dtype rule), so only the forward is compared here.
#[test]
fn attention_softmax_in_f32_autodiff_over_amp() {
    check_attention::<Autodiff<Amp<Flex>>>(Precision::F16, false);
    check_attention::<Autodiff<Amp<Flex>>>(Precision::Bf16, false);
}

/// Inference (no autodiff): `B::attention` runs on the lowered inputs, its output is in the
/// low dtype and close to f32 (Flex's kernel keeps its softmax in f32).
#[test]
fn attention_inference_keeps_the_backend_kernel() {
    let data = large_logits();
    let device = Default::default();
    let t = |v: &Vec<f32>, s: [usize; 4]| {
        Tensor::<Amp<Flex>, 4>::from_data(TensorData::new(v.clone(), s), &device)
    };
    let run = |q, k, v| module::attention(q, k, v, None, None, AttentionModuleOptions::default());
    let reference = values(run(
        t(&data.q, data.shape_q),
        t(&data.k, data.shape_kv),
        t(&data.v, data.shape_kv),
    ));
    for precision in [Precision::F16, Precision::Bf16] {
        let _g = autocast(precision);
        let out = run(
            t(&data.q, data.shape_q),
            t(&data.k, data.shape_kv),
            t(&data.v, data.shape_kv),
        );
        assert_eq!(out.dtype(), low(precision));
        let err = rel_l2(&values(out), &reference);
        assert!(err <= 2e-2, "{precision}: rel. L2 error {err:e}");
    }
}
