//! Widening casts recomputed in the backward (`burn_amp::backend::upcast`): an op that keeps
//! a half-precision activation widened to f32 (`sigmoid`, `log`, `mul` by an f32 operand, ...)
//! keeps the half tensor and a recipe, not an f32 copy. Gradients are bitwise those of a kept
//! cast; the bytes kept are measured with this binary's counting allocator
//! (`probabilities.rs`), against the count by hand.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::tensor::activation::{log_sigmoid, sigmoid, silu};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, TensorData};
use burn_amp::backend::upcast;
use burn_amp::{Amp, autocast};

use super::cast_cache::{gradients as lstm_gradients, loss as lstm_loss, new_lstm};
// The allocator's counts: this test binary's (the GPU check compiles the checks alone).
#[cfg(test)]
use super::probabilities::{assert_kept_by_hand, retained_per_element};
use super::*;

/// Leaves of the chain below: an input, a weight, an f32 scale and an f32 divisor.
struct Leaves<B: Backend> {
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    scale: Tensor<B, 1>,
    divisor: Tensor<B, 2>,
}

fn leaves<B: Backend>(device: &B::Device) -> Leaves<B> {
    B::seed(device, 5);
    let random = |shape: [usize; 2]| {
        Tensor::<B, 2>::random(shape, Distribution::Uniform(-1.0, 1.0), device).require_grad()
    };
    Leaves {
        x: random([8, 16]),
        w: random([16, 16]),
        scale: Tensor::<B, 1>::random([16], Distribution::Uniform(0.5, 1.5), device).require_grad(),
        divisor: random([8, 16]),
    }
}

/// A half-precision activation `h` (a lowered matmul) through every kind of op that keeps a
/// widened input: the probability ops, the exp/log and power family, and `mul`/`div` by f32
/// operands (broadcast included).
fn chain<B: Backend>(l: &Leaves<B>) -> Tensor<B, 1> {
    let h = l.x.clone().matmul(l.w.clone());
    let positive = h.clone().abs().add_scalar(1.0);
    let terms = [
        silu(h.clone()),
        log_sigmoid(h.clone()),
        sigmoid(h.clone()) * h.clone().cos(),
        positive.clone().log(),
        positive.clone().powf_scalar(1.5),
        positive.recip(),
        h.clone().powi_scalar(3),
        h.clone().exp(),
        h.clone() * l.scale.clone().unsqueeze_dim(0),
        h / l.divisor.clone().abs().add_scalar(1.0),
    ];
    terms.into_iter().reduce(|a, b| a + b).unwrap().mean()
}

/// The four leaves' gradients, with recomputation on or off.
fn chain_gradients<B: AutodiffBackend>(l: &Leaves<B>, recompute: bool) -> Vec<TensorData> {
    let previous = upcast::set_enabled(recompute);
    let grads = chain(l).backward();
    upcast::set_enabled(previous);
    let grad = |t: &Tensor<B, 2>| t.grad(&grads).expect("a gradient").into_data();
    vec![
        grad(&l.x),
        grad(&l.w),
        l.scale.grad(&grads).expect("a gradient").into_data(),
        grad(&l.divisor),
    ]
}

fn recomputed_against_kept<X: Backend, C: CheckpointStrategy>(
    device: &X::Device,
    precision: Precision,
    what: &str,
) {
    type B<X, C> = Amp<Autodiff<X, C>>;
    assert!(upcast::is_supported::<Autodiff<X, C>>());
    let l = leaves::<B<X, C>>(device);
    let (recomputed, kept) = {
        let _g = autocast(precision);
        (chain_gradients(&l, true), chain_gradients(&l, false))
    };
    // Recomputing an exact cast changes where the f32 values come from, not one of them.
    assert_bitwise(&recomputed, &kept, what, "a kept cast");

    // And both are the f32 run's, within half precision: the matmul runs in the low dtype,
    // everything after it in f32.
    let f32 = {
        let _g = autocast(Precision::F32);
        chain_gradients(&l, true)
    };
    assert_near_f32(&recomputed, &f32, precision, what, &[]);

    // A recurrent layer (sigmoid gates, their products with the f32 state).
    let (lstm, x, _) = new_lstm::<B<X, C>>(device);
    let _g = autocast(precision);
    let step = |recompute| {
        let previous = upcast::set_enabled(recompute);
        let grads = lstm_loss(&lstm, x.clone()).backward();
        upcast::set_enabled(previous);
        lstm_gradients(&lstm, &grads)
    };
    assert_bitwise(
        &step(true),
        &step(false),
        &format!("{what}, Lstm"),
        "a kept cast",
    );
}

pub(crate) fn recomputed_gradients_are_those_of_a_kept_cast<X: Backend>(
    device: &X::Device,
    precision: Precision,
) {
    recomputed_against_kept::<X, NoCheckpointing>(device, precision, "no checkpointing");
    recomputed_against_kept::<X, BalancedCheckpointing>(device, precision, "Balanced");
}

flex_and_wgpu_tests!(recomputed_gradients_are_those_of_a_kept_cast:
    recomputed_gradients_flex_f16, recomputed_gradients_flex_bf16, recomputed_gradients_wgpu_f16);

/// Bytes per element kept for the backward, recomputation on and off (Flex, counting
/// allocator), against the count by hand. `x` is the half activation (2 bytes), f32 tensors 4.
#[test]
fn widened_inputs_are_kept_in_half_precision() {
    type A = Amp<Autodiff<burn::backend::Flex>>;
    let n = 1 << 18;
    let kept = |precision, recompute, f: fn(Tensor<A, 1>) -> Tensor<A, 1>| {
        let previous = upcast::set_enabled(recompute);
        // The widening alone: recomputed outputs (`recompute.rs`) off.
        let outputs = burn_amp::backend::recompute::set_enabled(false);
        let (saved, _) = retained_per_element::<A>(precision, n, f);
        burn_amp::backend::recompute::set_enabled(outputs);
        upcast::set_enabled(previous);
        saved
    };
    type Case = (&'static str, fn(Tensor<A, 1>) -> Tensor<A, 1>, f64, f64);
    let cases: [Case; 4] = [
        // on: x, and sigmoid(x) in f32 (the mul's other input). Off: x widened twice
        // (sigmoid's and the mul's casts), sigmoid(x).
        ("silu", silu, 6.0, 12.0),
        // A gated product, SwiGLU's shape: silu(x) * v with v = cos(x) in half (cos keeps x).
        // On: x, sigmoid(x), silu(x) in f32, v. Off: x, two f32 copies of x, sigmoid(x),
        // silu(x), v in f32.
        (
            "silu(x) * cos(x)",
            |x| silu(x.clone()) * x.cos(),
            12.0,
            22.0,
        ),
        // log keeps its input: |x| + 1 in half (abs keeps x too). Off: that input in f32.
        ("log(|x| + 1)", |x| x.abs().add_scalar(1.0).log(), 4.0, 6.0),
        // add keeps nothing: no recipe, no source kept (the cast is a plain one).
        ("x + f32(x)", |x| x.clone() + x.cast(DType::F32), 0.0, 0.0),
    ];
    assert_kept_by_hand("recomputed widening", &cases, |precision, on, f| {
        kept(precision, on, *f)
    });
}

/// The listed backends; any other casts and keeps as before.
#[test]
fn recomputation_is_for_the_listed_autodiff_backends() {
    use burn::backend::Flex;
    assert!(upcast::is_supported::<Autodiff<Flex>>());
    assert!(upcast::is_supported::<Autodiff<Flex, BalancedCheckpointing>>());
    assert!(!upcast::is_supported::<Flex>());
    assert!(!upcast::is_supported::<Autodiff<burn_ndarray::NdArray>>());
    // Only the ops that keep an input; a plain cast is always enough for the others.
    use burn_amp::backend::Op;
    assert!(upcast::keeps_widened_input(Op::sigmoid));
    assert!(upcast::keeps_widened_input(Op::float_mul));
    assert!(!upcast::keeps_widened_input(Op::float_add));
    assert!(!upcast::keeps_widened_input(Op::softmax));
}
