//! Attention under autocast: softmax in f32, matmuls in the low dtype, the scale applied before
//! the first matmul, rows that see no key 0, and what a forward keeps.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, TensorData, module};
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
    /// `true` where a key is masked, `[1, 1, queries, keys]`.
    mask: Option<Vec<bool>>,
    options: AttentionModuleOptions,
}

impl AttnData {
    /// One batch, one head: `q` and `r` of `[sq, d]`, `k` and `v` of `[sk, d]`, every
    /// gradient compared, no mask, the default options.
    fn new(sq: usize, sk: usize, d: usize, [q, k, v, r]: [Vec<f32>; 4]) -> Self {
        AttnData {
            shape_q: [1, 1, sq, d],
            shape_kv: [1, 1, sk, d],
            q,
            k,
            v,
            r,
            grads: [true; 3],
            mask: None,
            options: AttentionModuleOptions::default(),
        }
    }
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
    let data = AttnData::new(sq, sk, d, [q, k, v, r]);
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
        grads: [false, false, true],
        ..AttnData::new(sq, sk, d, [q, k, v, r])
    }
}

fn attention_run<X: AutodiffBackend>(data: &AttnData, precision: Option<Precision>) -> AttnResult {
    attention_run_on::<X>(&Default::default(), data, precision)
}

fn attention_run_on<X: AutodiffBackend>(
    device: &X::Device,
    data: &AttnData,
    precision: Option<Precision>,
) -> AttnResult {
    let t = |v: &Vec<f32>, s: [usize; 4]| {
        Tensor::<X, 4>::from_data(TensorData::new(v.clone(), s), device)
    };
    let q = t(&data.q, data.shape_q).require_grad();
    let k = t(&data.k, data.shape_kv).require_grad();
    let v = t(&data.v, data.shape_kv).require_grad();
    let r = t(&data.r, data.shape_q);
    let mask = data.mask.as_ref().map(|m| {
        let shape = [1, 1, data.shape_q[2], data.shape_kv[2]];
        Tensor::<X, 4, Bool>::from_data(TensorData::new(m.clone(), shape), device)
    });
    let guard = precision.map(autocast);
    let out = module::attention(q.clone(), k.clone(), v.clone(), mask, None, data.options);
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

/// Scores that f16 holds whose raw products `q·k` it does not: head dim 64 with a `1/d`
/// scale (as muP's attention), `q` and `k` of entries near 40. Each query's four keys of
/// `k = 40` score 1600 (raw 102,400 > 65,504), the others 1580: the softmax shares each query
/// among its four keys (weights 0.25, the rest below 1e-9). Scaled after the half matmul
/// (Burn's composition) every score is inf and the output NaN.
fn raw_products_past_f16() -> AttnData {
    let (sq, sk, d) = (4, 64, 64);
    let mut u = uniform(13);
    let q = vec![40.0; sq * d];
    let k = (0..sk)
        .flat_map(|j| vec![if j % 16 == 5 { 40.0 } else { 39.5 }; d])
        .collect();
    let v = (0..sk * d).map(|_| on_grid(2.0 * u() - 1.0)).collect();
    let r = (0..sq * d).map(|_| on_grid(2.0 * u() - 1.0)).collect();
    AttnData {
        // Equal keys: dq and dk cancel to rounding, and the tail's are ~1e-9.
        grads: [false, false, true],
        options: AttentionModuleOptions {
            scale: Some(1.0 / d as f64),
            ..Default::default()
        },
        ..AttnData::new(sq, sk, d, [q, k, v, r])
    }
}

/// A mask that hides every key from query 1, and a causal mask with more queries than keys
/// (queries 0 and 1 see no key): Burn's composition gives such rows weights 0, so output 0
/// and no gradient through them.
fn dead_rows(causal: bool) -> AttnData {
    let (sq, sk, d) = (6, 4, 8);
    let mut u = uniform(if causal { 17 } else { 19 });
    let mut next = |n: usize, scale: f32| -> Vec<f32> {
        (0..n).map(|_| on_grid(scale * (2.0 * u() - 1.0))).collect()
    };
    let inputs = [
        next(sq * d, 2.0),
        next(sk * d, 2.0),
        next(sk * d, 1.0),
        next(sq * d, 1.0),
    ];
    AttnData {
        mask: (!causal).then(|| (0..sq * sk).map(|i| i / sk == 1 || i % 3 == 0).collect()),
        options: AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        },
        ..AttnData::new(sq, sk, d, inputs)
    }
}

/// The rows that see no key, as query indices.
fn dead_queries(data: &AttnData) -> Vec<usize> {
    let (sq, sk) = (data.shape_q[2], data.shape_kv[2]);
    (0..sq)
        .filter(|&i| match &data.mask {
            Some(mask) => mask[i * sk..(i + 1) * sk].iter().all(|&m| m),
            None => data.options.is_causal && i + sk < sq,
        })
        .collect()
}

/// Attention's edges under autocast, `Amp<Autodiff<B>>` against `Autodiff<Flex>` in f32 and,
/// for the raw products, `Amp<B>` without autodiff: finite where f32 is, the output within
/// 1e-2 (f16) / 2e-2 (bf16) relative L2 error, the gradients the reference compares within
/// 2e-2 / 1e-1 (as [`check_attention`]); rows that see no key exactly 0, their gradients too.
pub(crate) fn check_attention_edges<B: Backend>(device: &B::Device, precision: Precision) {
    let (tol_out, tol_grad) = match precision {
        Precision::F16 => (1e-2, 2e-2),
        _ => (2e-2, 1e-1),
    };
    let mut failures = Vec::new();
    for (name, data) in [
        ("raw products past f16", raw_products_past_f16()),
        ("a row masked whole", dead_rows(false)),
        ("causal, more queries than keys", dead_rows(true)),
    ] {
        let reference = attention_run::<Autodiff<Flex>>(&data, None);
        let amp = attention_run_on::<Amp<Autodiff<B>>>(device, &data, Some(precision));
        let err = rel_l2(&amp.out, &reference.out);
        eprintln!("  {name} {precision}: output rel. L2 error {err:.2e}");
        if !within(err, tol_out) {
            failures.push(format!(
                "{name}: output rel. L2 error {err:.3e} > {tol_out:e} (first {:?}, f32 {:?})",
                &amp.out[..4],
                &reference.out[..4]
            ));
        }
        for (g, (got, want)) in amp.grads.iter().zip(&reference.grads).enumerate() {
            let what = ["dq", "dk", "dv"][g];
            if got.iter().any(|x| !x.is_finite()) {
                failures.push(format!("{name}: {what} not finite"));
            } else if data.grads[g] && !within(rel_l2(got, want), tol_grad) {
                failures.push(format!(
                    "{name}: {what} rel. L2 error {:.3e} > {tol_grad:e}",
                    rel_l2(got, want)
                ));
            }
        }
        let d = data.shape_q[3];
        for i in dead_queries(&data) {
            let rows = [&amp.out, &amp.grads[0]];
            if rows
                .iter()
                .any(|t| t[i * d..(i + 1) * d].iter().any(|&x| x != 0.0))
            {
                failures.push(format!(
                    "{name}: query {i} sees no key, its output or dq is not 0"
                ));
            }
        }
    }
    // Without autodiff, an explicit scale takes CubeCL to Burn's composition in the half
    // dtype (its flash kernel has no scale): `Amp` composes it in its place.
    let data = raw_products_past_f16();
    let reference = attention_run::<Autodiff<Flex>>(&data, None).out;
    let t = |v: &Vec<f32>, s: [usize; 4]| {
        Tensor::<Amp<B>, 4>::from_data(TensorData::new(v.clone(), s), device)
    };
    let out = {
        let _g = autocast(precision);
        module::attention(
            t(&data.q, data.shape_q),
            t(&data.k, data.shape_kv),
            t(&data.v, data.shape_kv),
            None,
            None,
            data.options,
        )
    };
    let err = rel_l2(&values(out), &reference);
    eprintln!("  raw products past f16, no autodiff, {precision}: output rel. L2 error {err:.2e}");
    if !within(err, tol_out) {
        failures.push(format!(
            "raw products past f16 without autodiff: output rel. L2 error {err:.3e} > {tol_out:e}"
        ));
    }
    assert!(
        failures.is_empty(),
        "attention's edges on {} under {precision}:\n{}",
        std::any::type_name::<B>(),
        failures.join("\n")
    );
}

flex_and_wgpu_tests!(check_attention_edges:
    attention_edges_flex_f16, attention_edges_flex_bf16, attention_edges_wgpu_f16);

/// Bytes per attention score that one forward keeps for the backward (Flex, counting
/// allocator; q, k and v given as the half activations a lowered linear returns, the output's
/// own bytes left out): two half tensors of the scores' shape (the scores, kept by their
/// softmax's composition, and the weights' half copy, the second matmul's input), 4 bytes,
/// plus a few bytes per row; `q √scale` and `k √scale` are recomputed, not kept. Measured
/// 4.02 to 4.08 (the f32 program: 20.07).
#[test]
fn attention_keeps_two_half_tensors_of_the_scores_shape() {
    type A = Amp<Autodiff<Flex>>;
    let (sq, sk, d) = (512, 512, 16);
    let scores = (sq * sk) as f64;
    let device = Default::default();
    let mut u = uniform(23);
    let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| 2.0 * u() - 1.0).collect() };
    let leaf = |v: Vec<f32>, s: usize| {
        Tensor::<A, 4>::from_data(TensorData::new(v, [1, 1, s, d]), &device).require_grad()
    };
    let (q, k, v) = (
        leaf(random(sq * d), sq),
        leaf(random(sk * d), sk),
        leaf(random(sk * d), sk),
    );
    let mask = Tensor::<A, 4, Bool>::from_data(
        TensorData::new((0..sq * sk).map(|i| i % 7 == 0).collect(), [1, 1, sq, sk]),
        &device,
    );
    let kept = |precision: Precision, mask: Option<Tensor<A, 4, Bool>>| {
        let _g = autocast(precision);
        let dtype = if precision == Precision::F32 {
            DType::F32
        } else {
            low(precision)
        };
        let (q, k, v) = (
            q.clone().cast(dtype),
            k.clone().cast(dtype),
            v.clone().cast(dtype),
        );
        let before = super::probabilities::live_bytes();
        let out = module::attention(q, k, v, mask, None, AttentionModuleOptions::default());
        let after = super::probabilities::live_bytes();
        let out_bytes = (sq * d * out.dtype().size()) as f64;
        ((after - before) as f64 - out_bytes) / scores
    };
    let f32_kept = kept(Precision::F32, None);
    eprintln!("f32 program: {f32_kept:.3} bytes per score");
    for precision in [Precision::F16, Precision::Bf16] {
        for (what, mask) in [("no mask", None), ("a mask", Some(mask.clone()))] {
            let got = kept(precision, mask);
            eprintln!("{precision}, {what}: {got:.3} bytes per score");
            assert!(
                (got - 4.0).abs() <= 0.1,
                "{precision}, {what}: {got:.3} bytes per score kept, by hand 4 (and a few per row)"
            );
        }
    }
}
