//! Outputs recomputed in the backward (`burn_amp::backend::recompute`): under autocast, the
//! elementwise ops that keep their inputs build memory-bound nodes (an op that needs their
//! output keeps a recipe), and softmax / log-softmax are one node that keeps its input alone.
//! Elementwise gradients are bitwise those of kept outputs; softmax's backward is the
//! analytic one, within f32 rounding of Burn's composition. The bytes kept are measured with
//! this binary's counting allocator (`probabilities.rs`), against the count by hand.

use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::{gelu, log_sigmoid, log_softmax, relu, sigmoid, silu, softmax};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, TensorData};
use burn_amp::backend::recompute;
use burn_amp::{Amp, autocast};

// The allocator's counts: this test binary's (the GPU check compiles the checks alone).
#[cfg(test)]
use super::probabilities::{assert_kept_by_hand, live_bytes, retained_per_element};
use super::*;

/// Leaves: an input and a weight (their product is the half activation), an f32 factor.
struct Leaves<B: Backend> {
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    v: Tensor<B, 2>,
}

fn leaves<B: Backend>(device: &B::Device) -> Leaves<B> {
    B::seed(device, 11);
    let random = |shape: [usize; 2]| {
        Tensor::<B, 2>::random(shape, Distribution::Uniform(-1.0, 1.0), device).require_grad()
    };
    Leaves {
        x: random([8, 16]),
        w: random([16, 16]),
        v: random([8, 16]),
    }
}

/// Every recomputed elementwise op on a half activation `h` (a lowered matmul), each output
/// multiplied by `v` or by another output, so that an op keeps it.
fn elementwise<B: Backend>(l: &Leaves<B>) -> Tensor<B, 1> {
    let h = l.x.clone().matmul(l.w.clone());
    let v = l.v.clone();
    let t = h.clone().tanh();
    let p = h.clone().abs().add_scalar(1.0);
    let unit = t.clone().mul_scalar(0.9);
    let terms = [
        silu(h.clone()) * gelu(h.clone()),
        sigmoid(h.clone()) * relu(h.clone()),
        log_sigmoid(h.clone()) * v.clone(),
        h.clone().exp() * v.clone(),
        p.clone().log() * h.clone().erf(),
        h.clone().abs().log1p() * p.clone().sqrt(),
        h.clone().cos() * h.clone().sin(),
        unit.clone().tan() * unit.clone().asin(),
        unit.clone().acos() * unit.clone().atanh(),
        h.clone().cosh() * h.clone().sinh().mul_scalar(0.1),
        h.clone().atan() * h.clone().asinh(),
        p.clone().add_scalar(0.5).acosh() * t,
        p.clone().recip() * p.clone().powf_scalar(1.5),
        p.clone().powf(v.clone().abs()) * h.clone().div(p.clone()),
        h.clone().remainder(p.clone()) * h.clone().atan2(p) * v,
    ];
    terms.into_iter().reduce(|a, b| a + b).unwrap().mean()
}

/// Attention's shape: scores from a lowered matmul, softmax, a matmul by the values; and a
/// log-softmax over the same scores, gathered as a cross-entropy would.
fn normalized<B: Backend>(l: &Leaves<B>) -> Tensor<B, 1> {
    let scores = l.x.clone().matmul(l.w.clone());
    let probs = softmax(scores.clone(), 1);
    let context = probs.matmul(l.w.clone());
    let log_probs = log_softmax(scores, 1) * l.v.clone();
    (context.sum_dim(1) + log_probs.sum_dim(1)).mean()
}

fn gradients<B: AutodiffBackend>(
    l: &Leaves<B>,
    f: fn(&Leaves<B>) -> Tensor<B, 1>,
    recompute_on: bool,
) -> Vec<TensorData> {
    let previous = recompute::set_enabled(recompute_on);
    let grads = f(l).backward();
    recompute::set_enabled(previous);
    [&l.x, &l.w, &l.v]
        .into_iter()
        .map(|t| t.grad(&grads).expect("a gradient").into_data())
        .collect()
}

fn recomputed_against_kept<X: Backend, C: CheckpointStrategy>(
    device: &X::Device,
    precision: Precision,
    what: &str,
) {
    type B<X, C> = Amp<Autodiff<X, C>>;
    let l = leaves::<B<X, C>>(device);
    let f32 = |f| {
        let _g = autocast(Precision::F32);
        gradients(&l, f, true)
    };
    let _g = autocast(precision);

    // Recomputing an op changes where its output comes from, not one of its values.
    let (on, off) = (
        gradients(&l, elementwise, true),
        gradients(&l, elementwise, false),
    );
    assert_bitwise(&on, &off, &format!("{what}, elementwise"), "kept outputs");
    assert_near_f32(
        &on,
        &f32(elementwise),
        precision,
        &format!("{what}, elementwise"),
        &[],
    );

    // Softmax's analytic backward against Burn's composition: the same f32 values up to
    // rounding (1e-5 relative, where the half activations alone cost 1e-2), and against f32.
    let (on, off) = (
        gradients(&l, normalized, true),
        gradients(&l, normalized, false),
    );
    for (i, (a, b)) in on.iter().zip(&off).enumerate() {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        let err = rel_l2(&a, &b);
        assert!(
            err <= 1e-5,
            "{what}, softmax: gradient {i} {err:.2e} from the composition's"
        );
    }
    assert_near_f32(
        &on,
        &f32(normalized),
        precision,
        &format!("{what}, softmax"),
        &[],
    );
}

pub(crate) fn recomputed_gradients_are_those_of_kept_outputs<X: Backend>(
    device: &X::Device,
    precision: Precision,
) {
    recomputed_against_kept::<X, NoCheckpointing>(device, precision, "no checkpointing");
    recomputed_against_kept::<X, BalancedCheckpointing>(device, precision, "Balanced");
}

flex_and_wgpu_tests!(recomputed_gradients_are_those_of_kept_outputs:
    recomputed_outputs_flex_f16, recomputed_outputs_flex_bf16, recomputed_outputs_wgpu_f16);

/// Bytes per element kept for the backward, recomputation on and off (Flex, counting
/// allocator), against the count by hand. `x` is the half activation (2 bytes), f32 tensors 4.
#[test]
fn recomputed_outputs_are_not_kept() {
    type A = Amp<Autodiff<Flex>>;
    let n = 1 << 18;
    let kept = |precision, on, f: &dyn Fn(Tensor<A, 1>) -> Tensor<A, 1>| {
        let previous = recompute::set_enabled(on);
        let (saved, _) = retained_per_element::<A>(precision, n, f);
        recompute::set_enabled(previous);
        saved
    };
    // Attention: scores [4096, 64] by values [64, 64] (a parameter, its half copy cached).
    let rows = n / 64;
    let values =
        Tensor::<A, 2>::random([64, 64], Distribution::Default, &Default::default()).require_grad();
    let cached_values = (64 * 64 * 2) as f64 / n as f64;
    let row_sums = 4.0 / 64.0;
    type Case<'a> = (
        &'static str,
        &'a dyn Fn(Tensor<A, 1>) -> Tensor<A, 1>,
        f64,
        f64,
    );
    let attention = |x: Tensor<A, 1>| {
        softmax(x.reshape([rows, 64]), 1)
            .matmul(values.clone())
            .reshape([n])
    };
    let cases: [Case; 6] = [
        // On: x. Off: x, and sigmoid(x) in f32 (the mul's other input).
        ("silu", &silu, 2.0, 6.0),
        // SwiGLU's product: silu(x) * cos(x). Off: x, sigmoid(x) and silu(x) in f32, cos(x).
        (
            "silu(x) * cos(x)",
            &|x| silu(x.clone()) * x.cos(),
            2.0,
            12.0,
        ),
        // A GELU MLP's hidden layer, kept by the next linear: x. Off: x and gelu(x), halves.
        ("gelu(x) * cos(x)", &|x| gelu(x.clone()) * x.cos(), 2.0, 6.0),
        // Off: the shifted input and the exponentials in f32 (exp's input, div's numerator),
        // and each row's sum (div's denominator: 4 bytes a row of 64).
        (
            "softmax",
            &|x| softmax(x.reshape([rows, 64]), 1).reshape([n]),
            2.0,
            8.0 + row_sums,
        ),
        // Off: the shifted input in f32 (exp's input), each row's sum (log's input).
        (
            "log_softmax",
            &|x| log_softmax(x.reshape([rows, 64]), 1).reshape([n]),
            2.0,
            4.0 + row_sums,
        ),
        // On: the scores and the probabilities' half copy (the matmul's input). Off: 8 + 2.
        (
            "softmax(x) · v",
            &attention,
            4.0 + cached_values,
            10.0 + row_sums + cached_values,
        ),
    ];
    assert_kept_by_hand("recomputed outputs", &cases, |precision, on, f| {
        kept(precision, on, *f)
    });
}

/// Autocast at f32 (and any backend that is not a listed autodiff one) builds Burn's own
/// nodes: `Amp` at f32 keeps what plain autodiff keeps.
#[test]
fn f32_runs_keep_what_autodiff_keeps() {
    fn silu_keeps<B: AutodiffBackend>() -> isize {
        let n = 1 << 16;
        let x = Tensor::<B, 1>::random([n], Distribution::Default, &Default::default())
            .require_grad()
            .mul_scalar(2.0);
        let before = live_bytes();
        let y = silu(x.clone()) * x.clone().cos();
        let after = live_bytes();
        drop(y);
        (after - before) / n as isize
    }
    let plain = silu_keeps::<Autodiff<Flex>>();
    let amp = {
        let _g = autocast(Precision::F32);
        silu_keeps::<Amp<Autodiff<Flex>>>()
    };
    // sigmoid(x), silu(x) and cos(x) kept by the muls, 4 bytes each, and the output.
    assert_eq!(plain, 16, "plain autodiff: bytes per element");
    assert_eq!(amp, plain, "Amp at f32 keeps what plain autodiff keeps");
}

/// Which ops: those whose burn-autodiff backward keeps every input, and softmax; never one
/// that keeps none (a recipe of `add` would hold its inputs until the backward).
#[test]
fn recomputed_ops_are_those_that_keep_their_inputs() {
    use burn_amp::backend::Op;
    for op in [
        Op::sigmoid,
        Op::float_mul,
        Op::float_exp,
        Op::log_sigmoid,
        Op::float_log,
        Op::float_log1p,
        Op::float_sqrt,
        Op::gelu,
        Op::softmax,
        Op::log_softmax,
    ] {
        assert!(recompute::is_recomputed(op), "{op:?}");
    }
    for op in [
        Op::float_add,
        Op::float_sub,
        Op::float_matmul,
        Op::float_sum,
        Op::layer_norm,
    ] {
        assert!(!recompute::is_recomputed(op), "{op:?}");
    }
}

/// A long elementwise loop whose paths meet again at each step (`y = silu(y) * tanh(y / 2)`):
/// burn-autodiff 0.21 walks a recomputed node's ancestors path by path, so an unbounded chain
/// costs 2^steps in the backward (32 steps ran for over 20 minutes). Chains stop at
/// `MAX_CHAIN` nodes: 48 steps take about what kept outputs take, with the same gradient.
#[test]
fn a_long_elementwise_loop_backpropagates_in_linear_time() {
    type A = Amp<Autodiff<Flex>>;
    let device = Default::default();
    let _g = autocast(Precision::Bf16);
    let x = Tensor::<A, 1>::random([64], Distribution::Uniform(-1.0, 1.0), &device).require_grad();
    let run = |on: bool| {
        let previous = recompute::set_enabled(on);
        let start = std::time::Instant::now();
        let mut y = x.clone().cast(low(Precision::Bf16));
        for _ in 0..48 {
            y = silu(y.clone()) * y.mul_scalar(0.5).tanh();
        }
        let grads = y.sum().backward();
        recompute::set_enabled(previous);
        (
            x.grad(&grads).expect("a gradient").into_data(),
            start.elapsed(),
        )
    };
    let (kept, kept_time) = run(false);
    let (recomputed, recomputed_time) = run(true);
    assert_bitwise(&[recomputed], &[kept], "48 steps", "kept outputs");
    eprintln!("48 steps: {recomputed_time:?} recomputed, {kept_time:?} kept");
    assert!(
        recomputed_time < kept_time * 20 + std::time::Duration::from_secs(2),
        "48 steps took {recomputed_time:?} recomputed, {kept_time:?} kept"
    );
}
