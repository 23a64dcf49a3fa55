//! Records that come back as they were saved, whatever the recorder's precision settings.
//!
//! Burn saves a float tensor field as the recorder's float element (f16 under
//! `HalfPrecisionSettings`) and loads it in the device's default float dtype. That is right
//! for weights and moments, a choice the user made, and wrong for state whose value is exact:
//! a step count (f16 holds integers only up to 2048, and 65504 at most: a count of 70,000
//! came back as inf, and stochastic rounding drew the same bits every step after), or an
//! accumulation window's partial sums, still multiplied by the loss scale (65536 times a
//! gradient of 2 is inf in f16).

use burn::prelude::*;
use burn::record::{PrecisionSettings, Record};
use burn::tensor::TensorData;

/// A float tensor whose record keeps its dtype and its bits: an optimizer's step count, an
/// accumulation window's sums.
#[derive(Debug, Clone)]
pub struct ExactTensor<B: Backend, const D: usize>(pub Tensor<B, D>);

impl<B: Backend, const D: usize> ExactTensor<B, D> {
    /// The tensor.
    pub fn into_tensor(self) -> Tensor<B, D> {
        self.0
    }

    /// The tensor on `device`.
    pub fn to_device(self, device: &B::Device) -> Self {
        Self(self.0.to_device(device))
    }
}

impl<B: Backend, const D: usize> From<Tensor<B, D>> for ExactTensor<B, D> {
    fn from(t: Tensor<B, D>) -> Self {
        Self(t)
    }
}

impl<B: Backend, const D: usize> Record<B> for ExactTensor<B, D> {
    type Item<S: PrecisionSettings> = TensorData;

    fn into_item<S: PrecisionSettings>(self) -> TensorData {
        self.0.into_data()
    }

    fn from_item<S: PrecisionSettings>(item: TensorData, device: &B::Device) -> Self {
        Self(exact_from_data(item, device))
    }
}

/// A tensor of `data`'s own dtype (`Tensor::from_data` with a device alone converts it to the
/// device's default).
pub(crate) fn exact_from_data<B: Backend, const D: usize, K>(
    data: TensorData,
    device: &B::Device,
) -> Tensor<B, D, K>
where
    K: burn::tensor::BasicOps<B>,
{
    let dtype = data.dtype;
    Tensor::from_data(data, (device, dtype))
}
