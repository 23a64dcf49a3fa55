//! Where a NaN goes, op by op, against PyTorch (which propagates it through all of these):
//! Burn 0.21's Flex and CubeCL (wgpu; CUDA runs the same kernels) turn it into a number in
//! different ops; under `Amp` it stays a NaN (`src/backend/workarounds/nan.rs`), above
//! autodiff too. A NaN hidden so would leave a broken forward with a finite loss, which the
//! loss scaler cannot skip. The plain backends' lists are canaries: a Burn that changes them
//! fails here.

use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::TensorData;
use burn::tensor::activation::{hard_sigmoid, relu, sigmoid};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::module::max_pool1d;
use burn_amp::{Amp, autocast};

use super::*;

/// A row with a NaN and one without: `[[1, NaN, -2, 0.5], [3, -1, 0.25, 2]]`, in `dtype`.
fn input<B: Backend>(device: &B::Device, dtype: DType) -> Tensor<B, 2> {
    let values = vec![1.0f32, f32::NAN, -2.0, 0.5, 3.0, -1.0, 0.25, 2.0];
    let x: Tensor<B, 2> = Tensor::from_data(TensorData::new(values, [2, 4]), device);
    x.cast(dtype)
}

/// The ops (each NaN wherever PyTorch's is) that turn the NaN into a number on `B`, the input
/// in `dtype`.
pub(crate) fn nan_hidden_by<B: Backend>(device: &B::Device, dtype: DType) -> Vec<&'static str> {
    nan_kept_by::<B>(device, dtype)
        .into_iter()
        .filter(|(_, kept)| !kept)
        .map(|(op, _)| op)
        .collect()
}

/// Each op checked, and whether it keeps the NaN on `B`, the input in `dtype`.
pub(crate) fn nan_kept_by<B: Backend>(
    device: &B::Device,
    dtype: DType,
) -> Vec<(&'static str, bool)> {
    let x = input::<B>(device, dtype);
    let nan_at = |t: Tensor<B, 2>, at: &[usize]| {
        let v = values(t);
        at.iter().all(|&i| v[i].is_nan())
    };
    let seq = |t: Tensor<B, 2>| t.reshape([1, 2, 4]);
    let halves = x.ones_like().mul_scalar(0.5);
    let checks = vec![
        ("relu", nan_at(relu(x.clone()), &[1])),
        ("sigmoid", nan_at(sigmoid(x.clone()), &[1])),
        (
            "hard_sigmoid",
            nan_at(hard_sigmoid(x.clone(), 0.2, 0.5), &[1]),
        ),
        ("clamp", nan_at(x.clone().clamp(-1.0, 1.0), &[1])),
        ("clamp_min", nan_at(x.clone().clamp_min(0.0), &[1])),
        ("clamp_max", nan_at(x.clone().clamp_max(0.0), &[1])),
        ("max_dim", nan_at(x.clone().max_dim(1), &[0])),
        ("min_dim", nan_at(x.clone().min_dim(1), &[0])),
        (
            "max_pool1d",
            nan_at(
                max_pool1d(seq(x.clone()), 2, 1, 0, 1, false).reshape([2, 3]),
                &[0, 1],
            ),
        ),
        ("max", nan_at(x.clone().max().reshape([1, 1]), &[0])),
        ("min", nan_at(x.clone().min().reshape([1, 1]), &[0])),
        ("max_abs", nan_at(x.clone().max_abs().reshape([1, 1]), &[0])),
        ("cummax", nan_at(x.clone().cummax(1), &[1, 2, 3])),
        ("cummin", nan_at(x.clone().cummin(1), &[1, 2, 3])),
        ("powf_scalar", nan_at(x.clone().powf_scalar(0.5), &[1])),
        ("powi_scalar", nan_at(x.clone().powi_scalar(3), &[1])),
        ("powf", nan_at(x.clone().powf(halves.clone()), &[1])),
        ("atan2", nan_at(x.clone().atan2(halves.clone()), &[1])),
        ("atan2 of x", nan_at(halves.clone().atan2(x.clone()), &[1])),
        // PyTorch ranks a NaN above every number.
        ("topk", nan_at(x.clone().topk(2, 1), &[0])),
        (
            "argmax",
            x.clone()
                .argmax(1)
                .into_data()
                .convert::<i64>()
                .to_vec::<i64>()
                .unwrap()[0]
                == 1,
        ),
    ];
    checks
}

/// What each backend hides in Burn 0.21, plain; nothing under `Amp`, below or above
/// autodiff, for an f32 input (at F16 these ops keep its dtype or widen to f32) and for a half
/// one (an activation a lowered op made).
#[test]
fn where_nan_goes() {
    let flex = [
        "relu",
        "clamp_min",
        "clamp_max",
        "max_pool1d",
        "max",
        "min",
        "max_abs",
    ];
    let cubecl = [
        "sigmoid",
        "hard_sigmoid",
        "clamp",
        "max_dim",
        "min_dim",
        "max_pool1d",
        "max",
        "min",
        "max_abs",
        "cummax",
        "cummin",
        "powf_scalar",
        "powi_scalar",
        "powf",
        "atan2",
        "atan2 of x",
        "topk",
        "argmax",
    ];
    // An f32 input, and half ones (a lowered op's output): the same lists. WGSL has no bf16.
    let halves = [DType::F32, DType::F16, DType::BF16];
    hidden_as_listed::<Flex>(&Default::default(), &halves, &flex);
    if let Some(device) = common::wgpu_device() {
        hidden_as_listed::<Wgpu>(&device, &halves[..2], &cubecl);
    }
}

/// Plain `B` hides a NaN in the ops of `plain`, `Amp` above and below autodiff in none.
fn hidden_as_listed<B: Backend>(device: &B::Device, dtypes: &[DType], plain: &[&str]) {
    let name = core::any::type_name::<B>();
    for &dtype in dtypes {
        let ops = nan_hidden_by::<B>(device, dtype);
        assert_eq!(ops, plain, "plain {name}, {dtype:?}");
        let _g = autocast(Precision::F16);
        let ops = nan_hidden_by::<Amp<B>>(device, dtype);
        assert!(ops.is_empty(), "Amp<{name}>, {dtype:?}: {ops:?}");
        let ops = nan_hidden_by::<Amp<Autodiff<B>>>(device, dtype);
        assert!(ops.is_empty(), "Amp<Autodiff<{name}>>, {dtype:?}: {ops:?}");
    }
}

/// Around the NaNs `Amp` puts back, the values stay the op's: IEEE's `pow` exceptions
/// (`NaN⁰ = 1`, `1^NaN = 1`), a broadcast exponent, `atan2` elsewhere, and a top-k that ranks a
/// NaN first (PyTorch's order) with its index, and its gradient at the picked elements.
pub(crate) fn around_the_nans<B: Backend>(device: &B::Device) {
    let _g = autocast(Precision::F16);
    let nan = f32::NAN;
    let t = |v: Vec<f32>, shape: [usize; 2]| {
        Tensor::<Amp<B>, 2>::from_data(TensorData::new(v, shape), device)
    };
    let base = t(vec![nan, nan, 1.0, 1.0, 2.0, 4.0], [1, 6]);
    let exponent = t(vec![0.0, 2.0, nan, 3.0, nan, 0.5], [1, 6]);
    let got = values(base.clone().powf(exponent));
    let want = [1.0, nan, 1.0, 1.0, nan, 2.0];
    // Relative 1e-5: the inputs are f32 and these ops keep it (`powf` runs in f32 under the
    // policy, `atan2` promotes), and lavapipe's `atan2` is off by 4.3e-6 at -π/4.
    let same = |g: &[f32], w: &[f32]| {
        g.len() == w.len()
            && g.iter()
                .zip(w)
                .all(|(g, w)| (g.is_nan() && w.is_nan()) || (g - w).abs() <= 1e-5 * w.abs())
    };
    assert!(same(&got, &want), "powf: {got:?}, want {want:?}");
    // One exponent for every column.
    let got = values(base.clone().powf(t(vec![2.0], [1, 1])));
    assert!(same(&got, &[nan, nan, 1.0, 1.0, 4.0, 16.0]), "{got:?}");
    let got = values(base.clone().powf(t(vec![0.0], [1, 1])));
    assert!(same(&got, &[1.0; 6]), "NaN⁰: {got:?}");

    let y = t(vec![nan, 1.0, -1.0, 0.0], [1, 4]);
    let x = t(vec![1.0, nan, 1.0, -1.0], [1, 4]);
    let got = values(y.atan2(x));
    let want = [
        nan,
        nan,
        -core::f32::consts::FRAC_PI_4,
        core::f32::consts::PI,
    ];
    assert!(same(&got, &want), "atan2: {got:?}, want {want:?}");

    let x = t(vec![1.0, nan, -2.0, 0.5, 3.0, -1.0, 0.25, 2.0], [2, 4]);
    let (top, at) = x.clone().topk_with_indices(2, 1);
    let got = values(top);
    assert!(same(&got, &[nan, 1.0, 3.0, 2.0]), "topk: {got:?}");
    let at = at.into_data().convert::<i64>().to_vec::<i64>().unwrap();
    assert_eq!(at, [1, 0, 0, 3], "topk's indices");
    let got = values(x.clone().topk(2, 1));
    assert!(same(&got, &[nan, 1.0, 3.0, 2.0]), "topk: {got:?}");
    let at = x.argtopk(2, 1).into_data().convert::<i64>();
    assert_eq!(at.to_vec::<i64>().unwrap(), [1, 0, 0, 3], "argtopk");

    // Under autodiff: the gradient of the picked values' sum is 1 at each picked element.
    let x = Tensor::<Amp<Autodiff<B>>, 2>::from_data(
        TensorData::new(vec![1.0f32, nan, -2.0, 0.5, 3.0, -1.0, 0.25, 2.0], [2, 4]),
        device,
    )
    .require_grad();
    let grads = x.clone().topk(2, 1).sum().backward();
    let grad = values(x.grad(&grads).expect("x's gradient"));
    assert_eq!(
        grad,
        [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0],
        "topk's gradient"
    );
}

#[test]
fn around_the_nans_flex() {
    around_the_nans::<Flex>(&Default::default());
}

#[test]
fn around_the_nans_wgpu() {
    if let Some(device) = common::wgpu_device() {
        around_the_nans::<Wgpu>(&device);
    }
}

/// `Tensor::max_pair` and `min_pair` (PyTorch's `maximum`, `minimum`: NaN if either is) are
/// composed in Burn's tensor API, above any backend, as a comparison and a `mask_where`: a NaN
/// in `other` loses the comparison and is dropped. `Amp` sees only the two ops and cannot
/// tell; burn-optim's AMSGrad keeps its maximum so. A canary: a Burn that fixes it fails here.
#[test]
fn max_pair_drops_a_nan_in_other_above_any_backend() {
    fn dropped<B: Backend>(device: &B::Device) -> bool {
        let x = Tensor::<B, 1>::from_floats([1.0, f32::NAN], device);
        let ones = Tensor::<B, 1>::ones([2], device);
        let max = values(ones.clone().max_pair(x.clone()));
        let min = values(ones.min_pair(x.clone()));
        let kept = values(x.clone().max_pair(x.ones_like()));
        max == [1.0, 1.0] && min == [1.0, 1.0] && kept[1].is_nan()
    }
    let device = Default::default();
    assert!(dropped::<Flex>(&device));
    let _g = autocast(Precision::F16);
    assert!(dropped::<Amp<Flex>>(&device));
    if let Some(device) = common::wgpu_device() {
        assert!(dropped::<Amp<Wgpu>>(&device));
    }
}

/// The elementwise ops above whose output a later op reads back in the backward: `w`'s
/// gradient in `sum(op(x) · w)` is `op(x)`, NaN where PyTorch's is. While autocast lowers,
/// `op`'s node is recomputed ([`burn_amp::backend::recompute`]): the product's backward gets
/// `op(x)` again from `x`, and the NaN `Amp` put back must come back with it. Returns, on
/// `Amp<Autodiff<B, C>>` with `x` in `dtype`, the ops whose `w` gradient is a number at the
/// NaN, and those whose `x` gradient is.
pub(crate) fn nan_lost_in_recompute<B: Backend, C: CheckpointStrategy>(
    device: &B::Device,
    dtype: DType,
) -> (Vec<&'static str>, Vec<&'static str>) {
    type A<B, C> = Amp<Autodiff<B, C>>;
    let _g = autocast(Precision::F16);
    let x = || input::<A<B, C>>(device, dtype).require_grad();
    let halves = || x().ones_like().mul_scalar(0.5);
    type Op<B, C> = fn(Tensor<A<B, C>, 2>, Tensor<A<B, C>, 2>) -> Tensor<A<B, C>, 2>;
    let ops: Vec<(&'static str, Op<B, C>)> = vec![
        ("relu", |x, _| relu(x)),
        ("sigmoid", |x, _| sigmoid(x)),
        ("hard_sigmoid", |x, _| hard_sigmoid(x, 0.2, 0.5)),
        ("clamp", |x, _| x.clamp(-1.0, 1.0)),
        ("clamp_min", |x, _| x.clamp_min(0.0)),
        ("clamp_max", |x, _| x.clamp_max(0.0)),
        ("powf_scalar", |x, _| x.powf_scalar(0.5)),
        ("powf_scalar 2", |x, _| x.powf_scalar(2.0)),
        ("powi_scalar", |x, _| x.powi_scalar(3)),
        ("powf", |x, h| x.powf(h)),
        ("atan2", |x, h| x.atan2(h)),
        ("atan2 of x", |x, h| h.atan2(x)),
    ];
    let (mut from_w, mut from_x) = (Vec::new(), Vec::new());
    for (name, op) in ops {
        let (x, w) = (x(), x().ones_like().detach().require_grad());
        let grads = (op(x.clone(), halves()) * w.clone()).sum().backward();
        if !values(w.grad(&grads).expect("w's gradient"))[1].is_nan() {
            from_w.push(name);
        }
        if !values(x.grad(&grads).expect("x's gradient"))[1].is_nan() {
            from_x.push(name);
        }
    }
    (from_w, from_x)
}

/// No `w` gradient hides the NaN (before `Amp` built its own nodes for them: `relu`'s on Flex,
/// `sigmoid`'s on wgpu, and under balanced checkpointing `x^0.5`'s and `x^3`'s on wgpu). The
/// `x` gradients that are a number there are those of ops whose backward is a comparison,
/// PyTorch's too (`relu` passes the gradient, as CubeCL's does, and Flex's gives 0;
/// `hard_sigmoid` and the clamps give 0). Before, on wgpu, `sigmoid`'s and the powers' were 0
/// (Burn's backward recomputed the output, or raised `x` to `p - 1`, with CubeCL's kernel).
/// The same under either checkpointing of the graph.
fn nan_survives_recompute<B: Backend>(device: &B::Device, dtypes: &[DType], from_x: &[&str]) {
    for &dtype in dtypes {
        let want = (vec![], from_x.to_vec());
        let lost = nan_lost_in_recompute::<B, NoCheckpointing>(device, dtype);
        assert_eq!(lost, want, "{dtype:?}");
        let lost = nan_lost_in_recompute::<B, BalancedCheckpointing>(device, dtype);
        assert_eq!(lost, want, "{dtype:?}, balanced checkpointing");
    }
}

/// The ops above whose backward is a comparison (PyTorch's: a number at a NaN).
pub(crate) const COMPARISONS: [&str; 5] =
    ["relu", "hard_sigmoid", "clamp", "clamp_min", "clamp_max"];

#[test]
fn nan_survives_recompute_flex() {
    let dtypes = [DType::F32, DType::F16, DType::BF16];
    nan_survives_recompute::<Flex>(&Default::default(), &dtypes, &COMPARISONS);
}

#[test]
fn nan_survives_recompute_wgpu() {
    if let Some(device) = common::wgpu_device() {
        nan_survives_recompute::<Wgpu>(&device, &[DType::F32, DType::F16], &COMPARISONS);
    }
}

/// `relu(x) · w` under `Amp` above autodiff on `B` (either checkpointing), at
/// `x = [-1, -0, 0, 2, NaN]`: the value `[0, 0, 0, 2w, NaN]`, `w`'s gradient `relu(x)` with its
/// NaN, and `x`'s gradient bitwise plain autodiff's (burn-autodiff's `relu_backward` of the
/// input: 0 at and below 0, `w` above, the backend's rule at the NaN). `relu` is a node of
/// `Amp`'s own whose forward is not the backend's `relu` on Flex (its `clamp`): a backward
/// other than burn-autodiff's (a clamp's passes the gradient at 0) would show here.
pub(crate) fn relu_beside_a_nan<B: Backend, C: CheckpointStrategy>(device: &B::Device) {
    fn run<A: AutodiffBackend>(device: &A::Device) -> [Vec<f32>; 3] {
        let x = Tensor::<A, 1>::from_floats([-1.0, -0.0, 0.0, 2.0, f32::NAN], device);
        let x = x.require_grad();
        let w = Tensor::<A, 1>::from_floats([1.5, 2.5, 3.5, 4.5, 5.5], device).require_grad();
        let y = relu(x.clone()) * w.clone();
        let grads = y.clone().sum().backward();
        [
            values(y),
            values(x.grad(&grads).expect("x's gradient")),
            values(w.grad(&grads).expect("w's gradient")),
        ]
    }
    let [y, dx, dw] = {
        let _g = autocast(Precision::F32);
        run::<Amp<Autodiff<B, C>>>(device)
    };
    let [_, plain_dx, _] = run::<Autodiff<B, C>>(device);
    assert!(
        y[..4] == [0.0, 0.0, 0.0, 9.0] && y[4].is_nan(),
        "value {y:?}"
    );
    assert!(
        dw[..4] == [0.0, 0.0, 0.0, 2.0] && dw[4].is_nan(),
        "w's gradient {dw:?}"
    );
    let bits = |v: &[f32]| v.iter().map(|g| g.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&dx),
        bits(&plain_dx),
        "x's gradient {dx:?}, plain {plain_dx:?}"
    );
    assert_eq!(dx[..4], [0.0, 0.0, 0.0, 4.5], "x's gradient");
}

#[test]
fn relu_beside_a_nan_flex() {
    relu_beside_a_nan::<Flex, NoCheckpointing>(&Default::default());
    relu_beside_a_nan::<Flex, BalancedCheckpointing>(&Default::default());
}

#[test]
fn relu_beside_a_nan_wgpu() {
    if let Some(device) = common::wgpu_device() {
        relu_beside_a_nan::<Wgpu, NoCheckpointing>(&device);
        relu_beside_a_nan::<Wgpu, BalancedCheckpointing>(&device);
    }
}
