//! Shared activation casts (`burn_amp::backend::cast_cache`): an f32 activation lowered by
//! several ops (attention's query, key and value projections of one normed input, an `Lstm`'s
//! four gates) keeps one half-precision copy, not one per op, and only where the ops keep it
//! for their backward anyway. Gradients are bitwise those of a cast per use; the bytes kept
//! are measured with this binary's counting allocator (`probabilities.rs`).

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::softmax;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, TensorData};
use burn_amp::backend::cast_cache;
use burn_amp::{Amp, autocast};

use super::cast_cache::{gradients as lstm_gradients, loss as lstm_loss, new_lstm};
// The allocator's counts: this test binary's (the GPU check compiles the checks alone).
#[cfg(test)]
use super::probabilities::live_bytes;
use super::*;

const D: usize = 32;

/// Self-attention's shape: a `LayerNorm` (f32 out, as this crate's policy runs it) read by
/// three projections, then `softmax(q kᵀ / √d) v` with a residual.
struct Block<B: Backend> {
    norm: LayerNorm<B>,
    projections: [Linear<B>; 3],
}

fn block<B: Backend>(device: &B::Device) -> (Block<B>, Tensor<B, 2>) {
    B::seed(device, 3);
    let linear = || LinearConfig::new(D, D).init::<B>(device);
    let block = Block {
        norm: LayerNormConfig::new(D).init(device),
        projections: [linear(), linear(), linear()],
    };
    let x = Tensor::<B, 2>::random([16, D], Distribution::Default, device).require_grad();
    (block, x)
}

fn block_loss<B: Backend>(block: &Block<B>, x: Tensor<B, 2>) -> Tensor<B, 1> {
    let h = block.norm.forward(x.clone());
    let [q, k, v] = block.projections.each_ref().map(|p| p.forward(h.clone()));
    let scores = q.matmul(k.transpose()).div_scalar((D as f32).sqrt());
    let out = softmax(scores, 1).matmul(v) + x;
    out.powi_scalar(2).mean()
}

/// The input's and every parameter's gradient, sharing on or off; and the copies the cache
/// held after the forward.
fn block_gradients<B: AutodiffBackend>(
    block: &Block<B>,
    x: &Tensor<B, 2>,
    share: bool,
) -> (Vec<TensorData>, usize) {
    let previous = cast_cache::set_activations_enabled(share);
    let loss = block_loss(block, x.clone());
    let held = cast_cache::len();
    let grads = loss.backward();
    cast_cache::set_activations_enabled(previous);
    let mut out = vec![x.grad(&grads).expect("the input's gradient").into_data()];
    for p in &block.projections {
        out.push(p.weight.val().grad(&grads).unwrap().into_data());
        out.push(
            p.bias
                .as_ref()
                .unwrap()
                .val()
                .grad(&grads)
                .unwrap()
                .into_data(),
        );
    }
    out.push(block.norm.gamma.val().grad(&grads).unwrap().into_data());
    (out, held)
}

/// The index of k's bias gradient in [`block_gradients`]'s list.
const K_BIAS: usize = 4;

fn shared_against_per_use<X: Backend, C: CheckpointStrategy>(
    device: &X::Device,
    precision: Precision,
    what: &str,
) {
    type B<X, C> = Amp<Autodiff<X, C>>;
    let (block, x) = block::<B<X, C>>(device);
    let _g = autocast(precision);
    let (shared, held) = block_gradients(&block, &x, true);
    let (per_use, held_per_use) = block_gradients(&block, &x, false);
    // Six parameters (3 weights, 3 biases); with sharing also the normed input (one copy for
    // three projections) and the softmax's f32 output (lowered for its matmul with v).
    assert_eq!(held_per_use, 6, "{what}: parameters only");
    assert_eq!(held, 8, "{what}: parameters, normed input, probabilities");
    // One copy instead of three equal ones: not one value changes.
    assert_bitwise(&shared, &per_use, what, "a cast per use");

    // Within half precision of the f32 run. k's bias gradient is zero in exact arithmetic
    // (softmax ignores a shift of a row): rounding only.
    let f32 = {
        let _f = autocast(Precision::F32);
        block_gradients(&block, &x, true).0
    };
    assert_near_f32(&shared, &f32, precision, what, &[K_BIAS]);
    let k_bias = shared[K_BIAS].to_vec::<f32>().unwrap();
    let max = k_bias.iter().fold(0f32, |m, g| m.max(g.abs()));
    assert!(
        max < 1e-4,
        "{what}: k's bias gradient {max:.2e}, not about 0"
    );

    // A recurrent layer: each timestep's input and hidden state feed four gates.
    let (lstm, x, _) = new_lstm::<B<X, C>>(device);
    let step = |share| {
        let previous = cast_cache::set_activations_enabled(share);
        let grads = lstm_loss(&lstm, x.clone()).backward();
        cast_cache::set_activations_enabled(previous);
        lstm_gradients(&lstm, &grads)
    };
    assert_bitwise(
        &step(true),
        &step(false),
        &format!("{what}, Lstm"),
        "a cast per use",
    );
}

pub(crate) fn shared_gradients_are_those_of_a_cast_per_use<X: Backend>(
    device: &X::Device,
    precision: Precision,
) {
    shared_against_per_use::<X, NoCheckpointing>(device, precision, "no checkpointing");
    shared_against_per_use::<X, BalancedCheckpointing>(device, precision, "Balanced");
}

flex_and_wgpu_tests!(shared_gradients_are_those_of_a_cast_per_use:
    shared_gradients_flex_f16, shared_gradients_flex_bf16, shared_gradients_wgpu_f16);

/// Bytes per element of an f32 activation `h` that three projections of it leave alive
/// (Flex, counting allocator), sharing on and off. `h` is tracked (computed from a trained
/// leaf) or untracked (a data batch); the projections trained, frozen, or frozen but for
/// their bias (BitFit).
#[test]
fn projections_keep_one_copy_of_their_input_when_they_keep_it() {
    type A = Amp<Autodiff<burn::backend::Flex>>;
    const TOKENS: usize = 1 << 15;
    let device = Default::default();
    let kept = |precision, share, tracked: bool, projections: &[Linear<A>; 3]| {
        let leaf = Tensor::<A, 2>::random([TOKENS, D], Distribution::Default, &device);
        let h = if tracked {
            leaf.require_grad().add_scalar(1.0)
        } else {
            leaf
        };
        let _g = autocast(precision);
        let previous = cast_cache::set_activations_enabled(share);
        let before = live_bytes();
        let outs = projections.each_ref().map(|p| p.forward(h.clone()));
        let after = live_bytes();
        cast_cache::set_activations_enabled(previous);
        drop(outs);
        cast_cache::clear();
        (after - before) as f64 / (TOKENS * D) as f64
    };
    let trained: [Linear<A>; 3] = core::array::from_fn(|_| LinearConfig::new(D, D).init(&device));
    let frozen = trained.clone().map(|p| p.no_grad());
    let bitfit = frozen.clone().map(|mut p| {
        p.bias = p.bias.map(|b| b.set_require_grad(true));
        p
    });
    // (what, projections, h tracked, bytes per element of h kept shared and per use, by
    // hand): the three half outputs (6), and the copies of h the projections keep (2 each).
    let cases = [
        ("trained, h tracked", &trained, true, 8.0, 12.0),
        // f16 on Flex sums its matmuls in f32 (`half_sums`), whose node keeps the half copy
        // of an untracked h too.
        ("trained, h a data batch", &trained, false, 8.0, 12.0),
        // A frozen matmul keeps nothing of its input: each copy is freed after its op,
        // with or without sharing (the cache must not keep it until the backward).
        ("frozen, h tracked", &frozen, true, 6.0, 6.0),
        // A trained bias needs no input: as frozen.
        ("frozen but biases, h tracked", &bitfit, true, 6.0, 6.0),
    ];
    for precision in [Precision::F16, Precision::Bf16] {
        // Warm-up: the thread's first casts allocate their lazily built state.
        kept(precision, true, true, &trained);
        for (what, projections, tracked, shared, per_use) in cases {
            let on = kept(precision, true, tracked, projections);
            let off = kept(precision, false, tracked, projections);
            eprintln!(
                "{what} under {precision}: {on:.3} bytes/element kept shared, {off:.3} per use"
            );
            // The cached half weights add 0.01 (3 x 32 x 32 x 2 bytes over 2^20 elements).
            for (got, want, how) in [(on, shared, "shared"), (off, per_use, "per use")] {
                assert!(
                    (got - want).abs() < 0.04,
                    "{what} under {precision}, {how}: {got:.3} bytes/element kept, by hand {want}"
                );
            }
        }
    }
}
