//! Where a NaN goes, op by op, against PyTorch (which propagates it through all of these):
//! Burn 0.21's Flex and CubeCL (wgpu; CUDA runs the same kernels) turn it into a number in
//! different ops; under `Amp` it stays a NaN (`src/backend/workarounds/nan.rs`), above
//! autodiff too. A NaN hidden so would leave a broken forward with a finite loss, which the
//! loss scaler cannot skip. The plain backends' lists are canaries: a Burn that changes them
//! fails here.

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::TensorData;
use burn::tensor::activation::{hard_sigmoid, relu, sigmoid};
use burn::tensor::module::max_pool1d;
use burn_amp::{Amp, autocast};

use super::*;

/// A row with a NaN and one without: `[[1, NaN, -2, 0.5], [3, -1, 0.25, 2]]`.
fn input<B: Backend>(device: &B::Device) -> Tensor<B, 2> {
    let values = vec![1.0f32, f32::NAN, -2.0, 0.5, 3.0, -1.0, 0.25, 2.0];
    Tensor::from_data(TensorData::new(values, [2, 4]), device)
}

/// The ops (each NaN wherever PyTorch's is) that turn the NaN into a number on `B`.
pub(crate) fn nan_hidden_by<B: Backend>(device: &B::Device) -> Vec<&'static str> {
    let x = input::<B>(device);
    let nan_at = |t: Tensor<B, 2>, at: &[usize]| {
        let v = values(t);
        at.iter().all(|&i| v[i].is_nan())
    };
    let seq = |t: Tensor<B, 2>| t.reshape([1, 2, 4]);
    let checks: Vec<(&'static str, bool)> = vec![
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
        ("cummax", nan_at(x.clone().cummax(1), &[1, 2, 3])),
        ("powf_scalar", nan_at(x.clone().powf_scalar(0.5), &[1])),
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
        .into_iter()
        .filter(|(_, kept)| !kept)
        .map(|(op, _)| op)
        .collect()
}

/// What each backend hides in Burn 0.21, plain; nothing under `Amp` (at F16: these ops keep
/// the f32 input's dtype or widen to f32), below or above autodiff.
#[test]
fn where_nan_goes() {
    let flex = ["relu", "clamp_min", "clamp_max", "max_pool1d"];
    let cubecl = [
        "sigmoid",
        "hard_sigmoid",
        "clamp",
        "max_dim",
        "min_dim",
        "max_pool1d",
        "cummax",
        "powf_scalar",
        "argmax",
    ];
    let none: [&str; 0] = [];
    let device = Default::default();
    assert_eq!(nan_hidden_by::<Flex>(&device), flex, "plain Flex");
    {
        let _g = autocast(Precision::F16);
        assert_eq!(nan_hidden_by::<Amp<Flex>>(&device), none, "Amp<Flex>");
        assert_eq!(
            nan_hidden_by::<Amp<Autodiff<Flex>>>(&device),
            none,
            "Amp<Autodiff<Flex>>"
        );
    }
    if let Some(device) = common::wgpu_device() {
        assert_eq!(nan_hidden_by::<Wgpu>(&device), cubecl, "plain wgpu");
        let _g = autocast(Precision::F16);
        assert_eq!(nan_hidden_by::<Amp<Wgpu>>(&device), none, "Amp<Wgpu>");
        assert_eq!(
            nan_hidden_by::<Amp<Autodiff<Wgpu>>>(&device),
            none,
            "Amp<Autodiff<Wgpu>>"
        );
    }
}
