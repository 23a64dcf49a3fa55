//! Reductions, sorts, top-k and views of empty tensors under `Amp`, float, int and bool
//! (`src/backend/workarounds/empty/reduce.rs` and `views.rs`; the rest of the empty-tensor
//! checks, and what plain Burn does with these, are in `empty.rs`).

use burn::backend::Autodiff;
use burn::tensor::{Bool, Int, Shape, TensorData};
use burn_amp::{Amp, autocast};

use super::*;

const D_IN: usize = 8;

/// Reductions, sorts, top-k and views of empty tensors, float, int and bool (an expert given
/// no token: its scores sorted, its mask reduced, its activations reshaped): PyTorch's values
/// over nothing (the product 1, `any` false, `all` true), empty results along the other
/// dimensions, a clear panic where there is no value (a max of nothing, the mean of no int),
/// and through a chain of views with an empty result, zero gradients, none dropped.
pub fn empty_reductions_sorts_and_views<B: Backend>(device: &B::Device, precision: Precision) {
    type A<B> = Amp<Autodiff<B>>;
    let _autocast = autocast(precision);
    let empty = || Tensor::<A<B>, 2>::zeros([0, D_IN], device).require_grad();
    let bools = |t: Tensor<A<B>, 2, Bool>| (t.dims(), t.into_data().iter::<bool>().collect());
    let ints = |t: Tensor<A<B>, 2, Int>| (t.dims(), t.into_data().iter::<i64>().collect());
    let no_value = |name: &str, op: &dyn Fn()| {
        let raised = std::panic::catch_unwind(std::panic::AssertUnwindSafe(op));
        let message = panic_message(raised.expect_err(name));
        assert!(message.contains("it has no value"), "{name}: {message}");
    };

    assert_eq!(values(empty().prod()), [1.0], "the product of nothing");
    let along = empty().prod_dim(0);
    assert_eq!(
        (along.dims(), values(along)),
        ([1, D_IN], vec![1.0; D_IN]),
        "a product along the empty dimension"
    );
    assert_eq!(empty().prod_dim(1).dims(), [0, 1]);
    let one = |t: Tensor<A<B>, 1, Bool>| t.into_data().iter::<bool>().collect::<Vec<_>>();
    assert_eq!(one(empty().any()), [false], "any of nothing");
    assert_eq!(one(empty().all()), [true], "all of nothing");
    assert_eq!(bools(empty().any_dim(0)), ([1, D_IN], vec![false; D_IN]));
    assert_eq!(bools(empty().all_dim(0)), ([1, D_IN], vec![true; D_IN]));
    assert_eq!(empty().any_dim(1).dims(), [0, 1]);
    assert_eq!(empty().max_abs_dim(1).dims(), [0, 1]);
    no_value("max of nothing", &|| drop(empty().max()));
    no_value("min of nothing", &|| drop(empty().min()));
    no_value("max_abs of nothing", &|| drop(empty().max_abs()));

    let (sorted, at) = empty().sort_with_indices(1);
    assert_eq!((sorted.dims(), at.dims()), ([0, D_IN], [0, D_IN]), "sort");
    assert_eq!(empty().argsort(1).dims(), [0, D_IN], "argsort");
    assert_eq!(empty().topk(2, 1).dims(), [0, 2], "top 2 of no row");
    let (top, at) = empty().topk_with_indices(2, 1);
    assert_eq!(
        (top.dims(), at.dims()),
        ([0, 2], [0, 2]),
        "top 2 with indices"
    );
    assert_eq!(empty().argtopk(2, 1).dims(), [0, 2], "argtopk");

    // Views whose result is empty, from a parameter that is not: its gradient is that of the
    // rest of the loss alone (2w), the views adding zeros.
    let v: Vec<f32> = (1..=D_IN).map(|i| i as f32).collect();
    let w =
        Tensor::<A<B>, 2>::from_data(TensorData::new(v.clone(), [1, D_IN]), device).require_grad();
    let chain = w
        .clone()
        .expand::<2, _>(Shape::new([0, D_IN]))
        .transpose()
        .swap_dims(0, 1)
        .reshape([0, 2, D_IN / 2])
        .permute([2, 0, 1])
        .unfold::<4, _>(2, 1, 1);
    assert_eq!(chain.dims(), [D_IN / 2, 0, 2, 1], "a chain of empty views");
    let short = w.clone().unfold::<3, _>(1, D_IN + 1, 1);
    assert_eq!(
        short.dims(),
        [1, 0, D_IN + 1],
        "unfold: fewer than a window"
    );
    let grads = ((w.clone() * w.clone()).sum() + chain.sum() + short.sum()).backward();
    let grad = w.grad(&grads).expect("w's gradient");
    let twice: Vec<f32> = v.iter().map(|x| 2.0 * x).collect();
    assert_eq!(values(grad), twice, "2w: the empty views add zeros");

    let none = || Tensor::<A<B>, 2, Int>::zeros([0, 4], device);
    assert_eq!(
        ints(none().prod_dim(0)),
        ([1, 4], vec![1; 4]),
        "int product"
    );
    let prod: Vec<i64> = none().prod().into_data().iter::<i64>().collect();
    assert_eq!(prod, [1], "the int product of nothing");
    no_value("the mean of no int", &|| drop(none().mean()));
    no_value("int max of nothing", &|| drop(none().max()));
    assert_eq!(none().mean_dim(1).dims(), [0, 1]);
    assert_eq!(none().max_dim(1).dims(), [0, 1]);
    let (min, at) = none().min_dim_with_indices(1);
    assert_eq!((min.dims(), at.dims()), ([0, 1], [0, 1]));
    assert_eq!(none().argmax(1).dims(), [0, 1], "int argmax");
    let any: Vec<bool> = none().any().into_data().iter::<bool>().collect();
    assert_eq!(any, [false], "any of no int");
    assert_eq!(bools(none().all_dim(0)), ([1, 4], vec![true; 4]));
    let (sorted, at) = none().sort_with_indices(1);
    assert_eq!((sorted.dims(), at.dims()), ([0, 4], [0, 4]), "int sort");
    assert_eq!(none().sort(0).dims(), [0, 4]);
    assert_eq!(none().argsort(1).dims(), [0, 4]);
    assert_eq!(none().topk(2, 1).dims(), [0, 2], "int top 2");
    let row = Tensor::<A<B>, 2, Int>::ones([1, 4], device);
    let views = none()
        .transpose()
        .swap_dims(0, 1)
        .permute([1, 0])
        .reshape([4, 0])
        .repeat_dim(0, 2);
    assert_eq!(views.dims(), [8, 0], "int views");
    assert_eq!(
        row.clone().expand::<2, _>(Shape::new([0, 4])).dims(),
        [0, 4],
        "int expand"
    );
    assert_eq!(row.unfold::<3, _>(1, 5, 1).dims(), [1, 0, 5], "int unfold");

    let mask = none().greater_elem(0);
    let any: Vec<bool> = mask.clone().any().into_data().iter::<bool>().collect();
    let all: Vec<bool> = mask.clone().all().into_data().iter::<bool>().collect();
    assert_eq!(
        (any, all),
        (vec![false], vec![true]),
        "any and all of no bool"
    );
    assert_eq!(bools(mask.clone().any_dim(0)), ([1, 4], vec![false; 4]));
    assert_eq!(mask.clone().all_dim(1).dims(), [0, 1]);
    let views = mask
        .transpose()
        .permute([1, 0])
        .swap_dims(0, 1)
        .repeat_dim(1, 3);
    assert_eq!(views.dims(), [4, 0], "bool views");
}

flex_and_wgpu_tests!(empty_reductions_sorts_and_views: empty_reductions_flex_f16, empty_reductions_flex_bf16, empty_reductions_wgpu_f16);
