//! `ActivationOps` of `Amp<B>`: every op through the policy table.
//!
//! Written by macro from the trait's signatures (see `backend/macros.rs`).

use burn_backend::Backend;
use burn_backend::Scalar;
use burn_backend::ops::ActivationOps;
use burn_backend::tensor::FloatTensor;

use crate::backend::Amp;
use crate::backend::macros::{
    autocast_call, autocast_empty, autocast_input, autocast_ops, probe_dim,
};

impl<B: Backend> ActivationOps<Self> for Amp<B> {
    autocast_ops! {
        fn leaky_relu(tensor: FloatTensor<Self>, negative_slope: Scalar) -> FloatTensor<Self> => [t tensor, s negative_slope];
        fn relu(tensor: FloatTensor<Self>) -> FloatTensor<Self> => [t tensor] via workarounds;
        fn relu_backward(output: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> => [t output, t grad];
        fn gelu(tensor: FloatTensor<Self>) -> FloatTensor<Self> => [t tensor] via workarounds;
        fn prelu(tensor: FloatTensor<Self>, alpha: FloatTensor<Self>) -> FloatTensor<Self> => [t tensor, t alpha];
        fn gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> => [t x, t grad] via workarounds;
        fn sigmoid(tensor: FloatTensor<Self>) -> FloatTensor<Self> => [t tensor] via workarounds;
        fn sigmoid_backward(output: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> => [t output, t grad];
        fn hard_sigmoid(tensor: FloatTensor<Self>, alpha: Scalar, beta: Scalar) -> FloatTensor<Self> => [t tensor, s alpha, s beta] via workarounds;
        fn log_sigmoid(tensor: FloatTensor<Self>) -> FloatTensor<Self> => [t tensor] via workarounds;
        fn softmax(tensor: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> => [t tensor] via recompute;
        fn log_softmax(tensor: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> => [t tensor] via recompute;
        fn softmin(tensor: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> => [t tensor];
        fn log_sigmoid_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> => [t x, t grad] via workarounds;
    }
}
