//! The cast cache for parameters: a layer used at every step of a sequence (Burn's `Lstm`)
//! casts each parameter once per forward, and its gradients are bitwise those of a cast per
//! use, also through two graphs at once and with checkpointing. The memory it saves is
//! measured in `tests/memory_counting.rs` (Flex, exact) and `tests/memory.rs` (wgpu); shared
//! activation casts are tested in `shared_casts.rs`.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::nn::{Lstm, LstmConfig};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, TensorData};
use burn_amp::backend::cast_cache;
use burn_amp::{Amp, autocast};

use super::*;

const HIDDEN: usize = 32;
const SEQ: usize = 6;
/// An `Lstm`'s four gates, each an input and a hidden `Linear` with a bias.
const PARAMETERS: usize = 16;
/// The activations its gates share one copy of: each timestep's input and hidden state.
const ACTIVATIONS: usize = 2 * SEQ;

pub(super) fn new_lstm<B: Backend>(device: &B::Device) -> (Lstm<B>, Tensor<B, 3>, Tensor<B, 3>) {
    B::seed(device, 11);
    let lstm = LstmConfig::new(HIDDEN, HIDDEN, true).init::<B>(device);
    let x = || Tensor::<B, 3>::random([2, SEQ, HIDDEN], Distribution::Default, device);
    (lstm, x(), x())
}

/// Every parameter's gradient, in a fixed order.
pub(super) fn gradients<B: AutodiffBackend>(
    lstm: &Lstm<B>,
    grads: &B::Gradients,
) -> Vec<TensorData> {
    [
        &lstm.input_gate,
        &lstm.forget_gate,
        &lstm.output_gate,
        &lstm.cell_gate,
    ]
    .into_iter()
    .flat_map(|gate| [&gate.input_transform, &gate.hidden_transform])
    .flat_map(|linear| {
        let weight = linear.weight.val().grad(grads).unwrap().into_data();
        let bias = linear.bias.as_ref().unwrap().val().grad(grads);
        [weight, bias.unwrap().into_data()]
    })
    .collect()
}

pub(super) fn loss<B: Backend>(lstm: &Lstm<B>, x: Tensor<B, 3>) -> Tensor<B, 1> {
    let (out, _) = lstm.forward(x, None);
    out.powi_scalar(2).mean()
}

fn assert_same(cached: &[TensorData], per_use: &[TensorData], what: &str) {
    assert_eq!(cached.len(), PARAMETERS);
    for (i, (a, b)) in cached.iter().zip(per_use).enumerate() {
        assert_eq!(a.dtype, DType::F32, "{what}: parameter {i}'s gradient");
        // Bitwise: the cache changes where a copy lives, not one operation.
        assert_eq!(
            a, b,
            "{what}: parameter {i}'s gradient differs from a cast per use"
        );
    }
}

/// One forward and backward, the cache on or off: the gradients, and the copies held after
/// the forward and after the backward.
fn step<B: AutodiffBackend>(
    lstm: &Lstm<B>,
    x: Tensor<B, 3>,
    cache: bool,
) -> (Vec<TensorData>, usize, usize) {
    let previous = cast_cache::set_enabled(cache);
    let loss = loss(lstm, x);
    let after_forward = cast_cache::len();
    let grads = loss.backward();
    let after_backward = cast_cache::len();
    cast_cache::set_enabled(previous);
    (gradients(lstm, &grads), after_forward, after_backward)
}

/// The cached run against a cast per use, with the same parameters and input, under
/// checkpointing strategy `C`.
fn cached_against_per_use<X: Backend, C: CheckpointStrategy>(device: &X::Device, what: &str) {
    assert!(cast_cache::is_supported::<Autodiff<X, C>>());
    let (lstm, x, _) = new_lstm::<Amp<Autodiff<X, C>>>(device);
    let (cached, held, after) = step(&lstm, x.clone(), true);
    assert_eq!(
        held,
        PARAMETERS + ACTIVATIONS,
        "{what}: one copy per parameter (not one per timestep), per input and hidden state (not one per gate)"
    );
    assert_eq!(after, 0, "{what}: backward drops the cache");
    let (per_use, held, _) = step(&lstm, x, false);
    assert_eq!(held, 0, "{what}: the cache is off");
    assert_same(&cached, &per_use, what);
}

pub(crate) fn cached_gradients_are_those_of_a_cast_per_use<X: Backend>(
    device: &X::Device,
    precision: Precision,
) {
    let _g = autocast(precision);
    cached_against_per_use::<X, NoCheckpointing>(device, "no checkpointing");
    // With checkpointing: the cast is compute-bound (kept), what follows it recomputed.
    cached_against_per_use::<X, BalancedCheckpointing>(device, "BalancedCheckpointing");
}

flex_and_wgpu_tests!(cached_gradients_are_those_of_a_cast_per_use:
    cached_gradients_flex_f16, cached_gradients_flex_bf16, cached_gradients_wgpu_f16);

/// Two forwards share the cached copies, then each is backpropagated on its own: each
/// graph has its own cast nodes, so the second backward still reaches the parameters.
pub(crate) fn two_graphs_over_one_copy_keep_their_gradients<X: Backend>(
    device: &X::Device,
    precision: Precision,
) {
    type B<X> = Amp<Autodiff<X>>;
    let _g = autocast(precision);
    // Parameters only: the activations of two graphs are two sets of tensors.
    let activations = cast_cache::set_activations_enabled(false);
    let (lstm, x1, x2) = new_lstm::<B<X>>(device);
    let first = loss(&lstm, x1.clone());
    let second = loss(&lstm, x2.clone());
    assert_eq!(
        cast_cache::len(),
        PARAMETERS,
        "the second forward reused the copies"
    );
    let first = gradients(&lstm, &first.backward());
    let second = gradients(&lstm, &second.backward());

    let previous = cast_cache::set_enabled(false);
    let first_alone = gradients(&lstm, &loss(&lstm, x1).backward());
    let second_alone = gradients(&lstm, &loss(&lstm, x2).backward());
    cast_cache::set_enabled(previous);
    cast_cache::set_activations_enabled(activations);
    assert_same(&first, &first_alone, "first graph");
    assert_same(
        &second,
        &second_alone,
        "second graph, backpropagated after the first",
    );
}

flex_and_wgpu_tests!(two_graphs_over_one_copy_keep_their_gradients:
    two_graphs_flex_f16, two_graphs_flex_bf16, two_graphs_wgpu_f16);

/// Which parameters are cached, and how long: trained f32 parameters; kept through an inner
/// guard, dropped with the outermost one and once their parameters are gone; off on request.
#[test]
fn the_cache_holds_trained_parameters_for_one_scope() {
    use burn::backend::Flex;
    use burn::module::Module;
    type B = Amp<Autodiff<Flex>>;
    let device = Default::default();
    cast_cache::set_activations_enabled(false);
    let outer = autocast(Precision::F16);
    let (lstm, x, _) = new_lstm::<B>(&device);
    drop(loss(&lstm, x.clone()));
    assert_eq!(cast_cache::len(), PARAMETERS, "the input is not cached");
    {
        let _inner = autocast(Precision::F32);
    }
    assert_eq!(
        cast_cache::len(),
        PARAMETERS,
        "an inner scope keeps the cache"
    );

    // Frozen (no gradient) parameters cast per use.
    drop(loss(&lstm.clone().no_grad(), x.clone()));
    assert_eq!(cast_cache::len(), PARAMETERS);

    // Parameters gone while this thread has not run a backward (a validation loop on the
    // autodiff model beside training on another thread): once a backward elsewhere has freed
    // the graphs that held them, their copies go at this thread's next new cast that finds
    // the cache at a doubling (from 16 entries: here, the first).
    let (replaced, x2, _) = new_lstm::<B>(&device);
    drop(lstm);
    std::thread::spawn(move || {
        let t = Tensor::<B, 1>::ones([1], &Default::default()).require_grad();
        let _ = t.sum().backward();
    })
    .join()
    .unwrap();
    assert_eq!(cast_cache::len(), PARAMETERS, "another thread's backward");
    drop(loss(&replaced, x2));
    assert_eq!(
        cast_cache::len(),
        PARAMETERS,
        "the replaced parameters' copies were dropped"
    );

    drop(outer);
    assert_eq!(
        cast_cache::len(),
        0,
        "the outermost scope's end drops the cache"
    );

    // Not an autodiff backend of this crate: each use casts (no cache, same results).
    assert!(!cast_cache::is_supported::<Flex>());
    assert!(!cast_cache::is_supported::<Autodiff<burn_ndarray::NdArray>>());
    assert!(cast_cache::is_supported::<
        Autodiff<Flex, BalancedCheckpointing>,
    >());
    assert!(cast_cache::is_supported::<Autodiff<burn::backend::Wgpu>>());
}
