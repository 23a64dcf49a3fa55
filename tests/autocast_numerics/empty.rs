//! Empty tensors under `Amp` (`src/backend/workarounds/empty/`): Burn 0.21's CubeCL
//! backends fail on them (on wgpu a matmul with an empty operand and a sum along an empty
//! dimension panic, on CUDA every kernel over an empty tensor is refused), `Amp` answers
//! those ops without a kernel.
//!
//! The check: a mixture of two experts where every token goes to the first, so that the
//! second runs on an empty batch (select, matmul, bias, relu, a layer norm by hand using its
//! input twice, a sum along the empty dimension). Its loss and the first expert's gradients
//! are bitwise those of the same model without the second expert, and the second expert's
//! parameters get zero gradients (PyTorch's `grad` there), not none. Then single ops: sums
//! and means of nothing, a matmul over an empty inner dimension, casts, comparisons, maxima
//! (and a clear panic along the empty dimension), `select_assign` of nothing. A mixture that
//! adds its experts back in place, one given no token; convolutions, pooling and interpolation
//! over an empty batch; int and bool ops on empty tensors (reductions, sorts, top-k and views:
//! `empty_reductions.rs`).

use burn::backend::Autodiff;
use burn::tensor::activation::relu;
use burn::tensor::{IndexingUpdateOp, Int, TensorData};
use burn_amp::{Amp, autocast};

use super::*;

const TOKENS: usize = 4;
const D_IN: usize = 8;
const D_OUT: usize = 6;

/// A gradient read back: its shape, dtype and values.
type Read = (Vec<usize>, DType, Vec<f32>);

struct Routed {
    loss: f32,
    /// `x`, `w0`, `b0`, `gamma`: the gradients of what the first expert uses.
    first: Vec<Vec<f32>>,
    /// `w1`, `b1`: the second expert's, `None` where it got none.
    second: Vec<Option<Read>>,
    /// The second expert's output shape.
    second_dims: Option<[usize; 2]>,
}

fn routed<B: Backend>(device: &B::Device, precision: Precision, second_expert: bool) -> Routed {
    type A<B> = Amp<Autodiff<B>>;
    let _autocast = autocast(precision);
    let mut next = uniform(7);
    let mut param = |dims: [usize; 2]| {
        let v: Vec<f32> = (0..dims[0] * dims[1]).map(|_| on_grid(next())).collect();
        Tensor::<A<B>, 2>::from_data(TensorData::new(v, dims), device).require_grad()
    };
    let x: Tensor<A<B>, 2> = param([TOKENS, D_IN]);
    let (w0, b0, w1, b1) = (
        param([D_IN, D_OUT]),
        param([1, D_OUT]),
        param([D_IN, D_OUT]),
        param([1, D_OUT]),
    );
    let gamma: Tensor<A<B>, 2> = param([1, D_OUT]);
    let expert = |h: Tensor<A<B>, 2>, w: Tensor<A<B>, 2>, b: Tensor<A<B>, 2>| {
        let y = relu(h.matmul(w) + b);
        let centred = y.clone() - y.mean_dim(1);
        let variance = centred.clone().powf_scalar(2.0).mean_dim(1);
        centred / (variance + 1e-5).sqrt() * gamma.clone()
    };
    let indices = |v: Vec<i64>| {
        let n = v.len();
        Tensor::<A<B>, 1, Int>::from_data(TensorData::new(v, [n]), device)
    };
    let y0 = expert(
        x.clone().select(0, indices((0..TOKENS as i64).collect())),
        w0.clone(),
        b0.clone(),
    );
    let mut loss = (y0.clone() * y0).sum();
    let mut second_dims = None;
    if second_expert {
        let y1 = expert(x.clone().select(0, indices(vec![])), w1.clone(), b1.clone());
        second_dims = Some(y1.dims());
        loss = loss + y1.clone().sum() + y1.sum_dim(0).sum();
    }
    let grads = loss.backward();
    let f32s = |t: Tensor<A<B>, 2>| values(t.grad(&grads).expect("a gradient"));
    let second = [w1, b1]
        .into_iter()
        .map(|t| {
            t.grad(&grads)
                .map(|g| (g.dims().to_vec(), g.dtype(), values(g)))
        })
        .collect();
    Routed {
        loss: values(loss)[0],
        first: vec![f32s(x), f32s(w0), f32s(b0), f32s(gamma)],
        second,
        second_dims,
    }
}

/// The mixture with an empty expert, against the same mixture without it.
pub fn an_empty_expert_changes_nothing<B: Backend>(device: &B::Device, precision: Precision) {
    let with = routed::<B>(device, precision, true);
    let without = routed::<B>(device, precision, false);
    assert_eq!(
        with.second_dims,
        Some([0, D_OUT]),
        "the second expert's output"
    );
    assert_eq!(
        with.loss, without.loss,
        "the loss, with and without the empty expert"
    );
    for (name, (a, b)) in ["x", "w0", "b0", "gamma"]
        .iter()
        .zip(with.first.iter().zip(&without.first))
    {
        assert_eq!(
            a, b,
            "{name}'s gradient, with and without the empty expert ({precision})"
        );
        assert!(
            a.iter().any(|v| *v != 0.0),
            "{name}'s gradient is not all zeros"
        );
    }
    for ((name, dims), grad) in [("w1", vec![D_IN, D_OUT]), ("b1", vec![1, D_OUT])]
        .into_iter()
        .zip(&with.second)
    {
        let (got_dims, dtype, v) = grad
            .as_ref()
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        assert_eq!(got_dims, &dims, "{name}'s gradient shape");
        assert_eq!(
            *dtype,
            DType::F32,
            "{name}'s gradient dtype (an f32 parameter)"
        );
        assert!(
            v.iter().all(|v| *v == 0.0),
            "{name}'s gradient is zeros: {v:?}"
        );
    }
    assert!(
        without.second.iter().all(Option::is_none),
        "unused parameters get no gradient"
    );
}

flex_and_wgpu_tests!(an_empty_expert_changes_nothing: empty_expert_flex_f16, empty_expert_flex_bf16, empty_expert_wgpu_f16);

/// Single ops on empty tensors, with the values PyTorch gives.
pub fn empty_ops_give_torch_values<B: Backend>(device: &B::Device, precision: Precision) {
    type A<B> = Amp<Autodiff<B>>;
    let _autocast = autocast(precision);
    let empty = || Tensor::<A<B>, 2>::zeros([0, D_IN], device).require_grad();
    assert_eq!(empty().dims(), [0, D_IN]);
    assert_eq!(values(empty().sum()), [0.0], "the sum of nothing");
    assert!(
        values(empty().mean())[0].is_nan(),
        "the mean of nothing is NaN"
    );
    let along = empty().sum_dim(0);
    assert_eq!(
        (along.dims(), values(along)),
        ([1, D_IN], vec![0.0; D_IN]),
        "a sum along the empty dimension"
    );
    assert!(
        values(empty().mean_dim(0)).iter().all(|v| v.is_nan()),
        "a mean along the empty dimension"
    );
    assert_eq!(empty().sum_dim(1).dims(), [0, 1]);
    let inner = Tensor::<A<B>, 2>::ones([3, 0], device).matmul(Tensor::ones([0, 4], device));
    assert_eq!(
        (inner.dims(), values(inner)),
        ([3, 4], vec![0.0; 12]),
        "a matmul over an empty inner dimension"
    );
    let rows = empty().matmul(Tensor::ones([D_IN, 4], device));
    assert_eq!(
        (rows.dims(), rows.dtype()),
        ([0, 4], low(precision)),
        "a matmul of no row, autocast"
    );
    assert_eq!(empty().cast(low(precision)).dtype(), low(precision));
    assert_eq!(empty().exp().dtype(), DType::F32, "exp runs in f32");
    assert_eq!(empty().greater_elem(0.0).dims(), [0, D_IN]);
    assert_eq!(empty().max_dim(1).dims(), [0, 1]);
    let (min, at) = empty().min_dim_with_indices(1);
    assert_eq!((min.dims(), at.dims()), ([0, 1], [0, 1]));
    assert_eq!(empty().argmax(1).dims(), [0, 1]);
    let no_value = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| empty().max_dim(0)));
    let message = panic_message(no_value.expect_err("a max along an empty dimension"));
    assert!(
        message.contains("it has no value"),
        "a clear panic: {message}"
    );
    assert_eq!(Tensor::<A<B>, 2, Int>::zeros([3, 0], device).dims(), [3, 0]);
    let x = Tensor::<A<B>, 2>::ones([3, D_IN], device);
    let none = Tensor::<A<B>, 1, Int>::from_data(TensorData::new(Vec::<i64>::new(), [0]), device);
    assert_eq!(x.clone().select(0, none.clone()).dims(), [0, D_IN]);
    let unchanged = x
        .clone()
        .select_assign(0, none, empty(), IndexingUpdateOp::Add);
    assert_eq!(values(unchanged), values(x), "adding nothing");
}

flex_and_wgpu_tests!(empty_ops_give_torch_values: empty_ops_flex_f16, empty_ops_flex_bf16, empty_ops_wgpu_f16);

/// A mixture that adds each expert's output back in place (`select_assign` with `Add`), the
/// second expert given no token: its weight gets a zero gradient, as PyTorch's `index_add`
/// gives, not none (the write of nothing keeps it in the graph; before, `Amp` dropped it); the
/// first expert's gradient is bitwise that without the second.
pub fn an_expert_added_back_with_no_token_gets_zeros<B: Backend>(
    device: &B::Device,
    precision: Precision,
) {
    type A<B> = Amp<Autodiff<B>>;
    let _autocast = autocast(precision);
    let run = |second_expert: bool| {
        let mut next = uniform(11);
        let mut param = |dims: [usize; 2]| {
            let v: Vec<f32> = (0..dims[0] * dims[1]).map(|_| on_grid(next())).collect();
            Tensor::<A<B>, 2>::from_data(TensorData::new(v, dims), device).require_grad()
        };
        let (x, w0, w1) = (
            param([TOKENS, D_IN]),
            param([D_IN, D_IN]),
            param([D_IN, D_IN]),
        );
        let indices = |v: Vec<i64>| {
            let n = v.len();
            Tensor::<A<B>, 1, Int>::from_data(TensorData::new(v, [n]), device)
        };
        let mut routes = vec![(indices((0..TOKENS as i64).collect()), w0.clone())];
        if second_expert {
            routes.push((indices(vec![]), w1.clone()));
        }
        let mut out = x.zeros_like();
        for (tokens, w) in routes {
            let y = relu(x.clone().select(0, tokens.clone()).matmul(w));
            out = out.select_assign(0, tokens, y, IndexingUpdateOp::Add);
        }
        let grads = (out.clone() * out).sum().backward();
        let read = |t: &Tensor<A<B>, 2>| t.grad(&grads).map(|g| (g.dims(), values(g)));
        (read(&w0), read(&w1))
    };
    let ((dims0, with), w1) = {
        let (w0, w1) = run(true);
        (w0.expect("the first expert's gradient"), w1)
    };
    let (_, without) = run(false).0.expect("the first expert's gradient");
    assert_eq!(dims0, [D_IN, D_IN]);
    assert_eq!(
        with, without,
        "w0's gradient, with and without the empty expert"
    );
    assert!(
        with.iter().any(|v| *v != 0.0),
        "w0's gradient is not all zeros"
    );
    let (dims1, zeros) = w1.expect("the empty expert's weight gets a gradient");
    assert_eq!(dims1, [D_IN, D_IN], "its shape");
    assert!(zeros.iter().all(|v| *v == 0.0), "zeros: {zeros:?}");
}

flex_and_wgpu_tests!(an_expert_added_back_with_no_token_gets_zeros: added_back_flex_f16, added_back_flex_bf16, added_back_wgpu_f16);

/// Convolutions (deformable too), pooling, interpolation and `grid_sample` over an empty batch
/// (a detection head given no proposal): PyTorch's shapes, the autocast dtype, and zero
/// gradients for the weights, biases and sampled features (PyTorch's), none dropped.
pub fn an_empty_batch_through_convolutions<B: Backend>(device: &B::Device, precision: Precision) {
    use burn::tensor::module::{
        adaptive_avg_pool1d, adaptive_avg_pool2d, avg_pool1d, avg_pool2d, conv_transpose2d, conv1d,
        conv2d, deform_conv2d, interpolate, max_pool1d, max_pool2d, max_pool2d_with_indices,
    };
    use burn::tensor::ops::{
        ConvOptions, ConvTransposeOptions, DeformConvOptions, GridSampleOptions, InterpolateMode,
        InterpolateOptions,
    };
    type A<B> = Amp<Autodiff<B>>;
    let _autocast = autocast(precision);
    let ones = |dims: [usize; 4]| Tensor::<A<B>, 4>::ones(dims, device).require_grad();
    let bias = || Tensor::<A<B>, 1>::ones([4], device).require_grad();
    let (w, b, wt, bt) = (ones([4, 3, 3, 3]), bias(), ones([4, 4, 2, 2]), bias());
    let x = Tensor::<A<B>, 4>::zeros([0, 3, 9, 9], device).require_grad();
    let y = conv2d(
        x,
        w.clone(),
        Some(b.clone()),
        ConvOptions::new([2, 2], [1, 1], [1, 1], 1),
    );
    assert_eq!(
        (y.dims(), y.dtype()),
        ([0, 4, 5, 5], low(precision)),
        "conv2d"
    );
    let y = max_pool2d(y, [2, 2], [2, 2], [0, 0], [1, 1], true);
    assert_eq!(y.dims(), [0, 4, 3, 3], "max_pool2d, ceil_mode");
    let (y, at) = max_pool2d_with_indices(y, [2, 2], [1, 1], [0, 0], [1, 1], false);
    assert_eq!(
        (y.dims(), at.dims()),
        ([0, 4, 2, 2], [0, 4, 2, 2]),
        "with indices"
    );
    let y = avg_pool2d(y, [2, 2], [1, 1], [1, 1], true, false);
    assert_eq!(y.dims(), [0, 4, 3, 3], "avg_pool2d");
    let y = interpolate(
        y,
        [6, 7],
        InterpolateOptions::new(InterpolateMode::Bilinear),
    );
    assert_eq!(y.dims(), [0, 4, 6, 7], "interpolate");
    let y = conv_transpose2d(
        y,
        wt.clone(),
        Some(bt.clone()),
        ConvTransposeOptions::new([2, 2], [0, 0], [1, 1], [1, 1], 1),
    );
    assert_eq!(y.dims(), [0, 4, 13, 15], "conv_transpose2d");
    let y = adaptive_avg_pool2d(y, [2, 3]);
    assert_eq!(y.dims(), [0, 4, 2, 3], "adaptive_avg_pool2d");
    let s = Tensor::<A<B>, 3>::zeros([0, 4, 10], device).require_grad();
    let w1 = Tensor::<A<B>, 3>::ones([2, 4, 3], device).require_grad();
    let s = conv1d(s, w1.clone(), None, ConvOptions::new([1], [0], [1], 1));
    let s = max_pool1d(avg_pool1d(s, 2, 2, 0, true, false), 2, 1, 0, 1, false);
    let s = adaptive_avg_pool1d(s, 5);
    assert_eq!(
        s.dims(),
        [0, 2, 5],
        "conv1d, avg_pool1d, max_pool1d, adaptive_avg_pool1d"
    );
    // A deformable convolution over no box, and RoI features sampled for no box.
    let wd = ones([4, 3, 3, 3]);
    let d = deform_conv2d(
        Tensor::<A<B>, 4>::zeros([0, 3, 5, 5], device).require_grad(),
        Tensor::<A<B>, 4>::zeros([0, 18, 3, 3], device),
        wd.clone(),
        Some(Tensor::<A<B>, 4>::ones([0, 9, 3, 3], device)),
        Some(b.clone()),
        DeformConvOptions::new([1, 1], [0, 0], [1, 1], 1, 1),
    );
    assert_eq!(d.dims(), [0, 4, 3, 3], "deform_conv2d");
    let features = ones([1, 3, 8, 8]);
    let sampled = features.clone().grid_sample_2d(
        Tensor::<A<B>, 4>::zeros([0, 7, 7, 2], device),
        GridSampleOptions::default(),
    );
    assert_eq!(sampled.dims(), [0, 3, 7, 7], "grid_sample_2d of no box");
    let grads = (y.sum() + s.sum() + d.sum() + sampled.sum()).backward();
    let sampled_from = features
        .grad(&grads)
        .map(values)
        .expect("the features' gradient");
    assert_eq!(sampled_from, vec![0.0; 3 * 64], "nothing sampled: zeros");
    for (name, grad, dims) in [
        ("conv2d weight", w.grad(&grads).map(values), 4 * 3 * 3 * 3),
        (
            "deform_conv2d weight",
            wd.grad(&grads).map(values),
            4 * 3 * 3 * 3,
        ),
        (
            "conv_transpose2d weight",
            wt.grad(&grads).map(values),
            4 * 4 * 2 * 2,
        ),
        ("conv1d weight", w1.grad(&grads).map(values), 2 * 4 * 3),
    ] {
        let grad = grad.unwrap_or_else(|| panic!("{name}: no gradient"));
        assert_eq!(grad, vec![0.0; dims], "{name}'s gradient is zeros");
    }
    for (name, grad) in [
        ("conv2d bias", b.grad(&grads)),
        ("conv_transpose2d bias", bt.grad(&grads)),
    ] {
        let grad = grad.unwrap_or_else(|| panic!("{name}: no gradient"));
        assert_eq!(values(grad), vec![0.0; 4], "{name}'s gradient is zeros");
    }
}

flex_and_wgpu_tests!(an_empty_batch_through_convolutions: empty_batch_flex_f16, empty_batch_flex_bf16, empty_batch_wgpu_f16);

/// Int and bool ops on empty tensors (the indices of an expert given no token): shapes,
/// dtypes, and PyTorch's values for the sums of nothing.
pub fn empty_ints_and_bools<B: Backend>(device: &B::Device, precision: Precision) {
    type A<B> = Amp<Autodiff<B>>;
    let _autocast = autocast(precision);
    let none =
        || Tensor::<A<B>, 1, Int>::from_data(TensorData::new(Vec::<i64>::new(), [0]), device);
    let routed = Tensor::<A<B>, 1, Int>::from_data(TensorData::new(vec![0i64, 1, 0], [3]), device);
    let no_token = routed.clone().equal_elem(2).argwhere().squeeze_dim::<1>(1);
    assert_eq!(no_token.dims(), [0], "argwhere of nothing");
    let int_dtype = no_token.dtype();
    let shifted = (no_token.clone() + 3) * 2 - none();
    assert_eq!(
        (shifted.dims(), shifted.dtype()),
        ([0], int_dtype),
        "int arithmetic"
    );
    assert_eq!(none().cast(DType::I32).dtype(), DType::I32, "int cast");
    let mask = none().greater_elem(1);
    assert_eq!(mask.dims(), [0], "int comparison");
    let bool_dtype = mask.dtype();
    let flipped = mask.clone().bool_not().bool_and(none().lower(none()));
    assert_eq!(
        (flipped.dims(), flipped.dtype()),
        ([0], bool_dtype),
        "bool ops"
    );
    let as_float = mask.clone().float();
    assert_eq!(
        (as_float.dims(), as_float.dtype()),
        ([0], DType::F32),
        "bool to float"
    );
    assert_eq!(mask.int().dims(), [0], "bool to int");
    assert_eq!(none().float().dims(), [0], "int to float");
    assert_eq!(
        Tensor::<A<B>, 2>::zeros([0, D_IN], device).int().dims(),
        [0, D_IN],
        "float to int"
    );
    assert_eq!(
        routed.clone().select(0, none()).dims(),
        [0],
        "int select of no index"
    );
    let gathered = Tensor::<A<B>, 2, Int>::ones([3, 4], device)
        .gather(1, Tensor::<A<B>, 2, Int>::zeros([3, 0], device));
    assert_eq!(gathered.dims(), [3, 0], "int gather of no index");
    let sum = none()
        .sum()
        .into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .unwrap();
    assert_eq!(sum, [0], "the int sum of nothing");
    let along = none().reshape([0, 1]).sum_dim(0);
    let along = (
        along.dims(),
        along.into_data().convert::<i64>().to_vec::<i64>().unwrap(),
    );
    assert_eq!(
        along,
        ([1, 1], vec![0]),
        "an int sum along the empty dimension"
    );
}

flex_and_wgpu_tests!(empty_ints_and_bools: empty_ints_flex_f16, empty_ints_flex_bf16, empty_ints_wgpu_f16);

/// What plain Burn 0.21 does with an empty operand on this backend: the ops that panic.
pub fn plain_burn_fails_on<B: Backend>(device: &B::Device) -> Vec<&'static str> {
    let fails = |f: &dyn Fn() -> Vec<f32>| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err()
    };
    let mut failing = vec![];
    let empty = || Tensor::<Autodiff<B>, 2>::zeros([0, D_IN], device);
    if fails(&|| values(empty().matmul(Tensor::ones([D_IN, 4], device)))) {
        failing.push("matmul of no row");
    }
    if fails(&|| {
        values(Tensor::<Autodiff<B>, 2>::ones([3, 0], device).matmul(Tensor::ones([0, 4], device)))
    }) {
        failing.push("matmul over an empty inner dimension");
    }
    if fails(&|| values(empty().sum_dim(0))) {
        failing.push("sum along an empty dimension");
    }
    let ints = || Tensor::<Autodiff<B>, 2, Int>::empty([0, 4], device);
    let read_ints = |t: Tensor<Autodiff<B>, 2, Int>| t.into_data().iter::<f32>().collect();
    if fails(&|| read_ints(ints().prod_dim(0))) {
        failing.push("int product along an empty dimension");
    }
    if fails(&|| read_ints(ints().greater_elem(0).all_dim(0).int())) {
        failing.push("bool all along an empty dimension");
    }
    let row = Tensor::<Autodiff<B>, 2>::ones([1, 4], device);
    if fails(&|| vec![row.clone().unfold::<3, _>(1, 5, 1).dims()[1] as f32]) {
        failing.push("unfold of fewer elements than a window");
    }
    failing
}

/// Measured on the unfused CubeCL backend of wgpu, where an op's panic is raised by the op
/// itself (under fusion it comes out of whichever thread flushes the fused block), in this
/// build without autotune: its reductions along an empty dimension fail (the sum in the
/// reduce's launch, the int product and bool `all` with `ReduceAxisTooSmall`). With autotune
/// (Burn's default) the fused matmul with an empty operand panics too ("CallError", on wgpu
/// and through the stand-in CUDA driver).
#[test]
fn plain_wgpu_panics_on_empty_reductions() {
    if let Some(device) = common::wgpu_device() {
        type Bare = burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
        assert_eq!(
            plain_burn_fails_on::<Bare>(&device),
            [
                "sum along an empty dimension",
                "int product along an empty dimension",
                "bool all along an empty dimension"
            ],
            "Burn 0.21 on wgpu without autotune; a Burn that runs them makes the reduction guard \
             unneeded there"
        );
    }
}

/// Flex runs the rest, but refuses an unfold with fewer elements than a window ("smaller than
/// window size"), whose result Burn's shape rule (`calculate_unfold_shape`) says is empty, as
/// CubeCL's view gives: `Amp` gives that empty result on every backend.
#[test]
fn plain_flex_refuses_a_short_unfold() {
    assert_eq!(
        plain_burn_fails_on::<burn::backend::Flex>(&Default::default()),
        ["unfold of fewer elements than a window"]
    );
}
