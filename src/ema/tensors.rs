//! The model's float tensors as the average sees them, and the mappers that build, update,
//! move and rebuild the average: on the device ([`Widen`], [`Average`]), in host memory
//! ([`Offload`], [`HostTensor::lerp`], [`Upload`], [`Refresh`]).

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;
use burn::record::{PrecisionSettings, Record};
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use burn_backend::TensorMetadata;
use burn_backend::tensor::FloatTensor;
use burn_std::FloatDType;

use super::kernels;
use crate::grads::{f32_scalar, flat, primitive, tensor};

/// One float tensor of the model, in traversal order.
pub(super) struct TrainedTensor<B: Backend> {
    pub tensor: FloatTensor<B>,
    pub shape: Vec<usize>,
    /// Requires a gradient: averaged. Otherwise taken as it is.
    pub trained: bool,
}

/// The model's float tensors (inner backend), in traversal order.
pub(super) struct Trained<B: AutodiffBackend> {
    pub tensors: Vec<TrainedTensor<B::InnerBackend>>,
    /// f32 0 on the first tensor's device: where the count of updates lives.
    pub zero: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> Trained<B> {
    pub fn of<M: AutodiffModule<B>>(model: &M) -> Self {
        let mut trained = Self {
            tensors: Vec::new(),
            zero: None,
        };
        model.visit(&mut trained);
        trained
    }

    pub fn shapes(&self) -> Vec<Vec<usize>> {
        self.tensors.iter().map(|t| t.shape.clone()).collect()
    }

    pub fn flags(&self) -> Vec<bool> {
        self.tensors.iter().map(|t| t.trained).collect()
    }
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Trained<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        self.zero
            .get_or_insert_with(|| f32_scalar(0.0, &value.device()));
        self.tensors.push(TrainedTensor {
            shape: value.dims().to_vec(),
            trained: value.is_require_grad(),
            tensor: primitive(value.inner()),
        });
    }
}

/// A module's float tensors' shapes, in traversal order.
#[derive(Default)]
pub(super) struct FloatShapes(pub Vec<Vec<usize>>);

impl<B: Backend> ModuleVisitor<B> for FloatShapes {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.val().dims().to_vec());
    }
}

/// The model's inner module with its trained tensors in f32.
pub(super) struct Widen<'a> {
    pub trained: &'a [bool],
    pub index: usize,
}

impl<B: Backend> ModuleMapper<B> for Widen<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let trained = self.trained.get(self.index).copied().unwrap_or(false);
        self.index += 1;
        let (id, value, mapper) = param.consume();
        let value = if trained && value.dtype() != DType::F32 {
            value.cast(FloatDType::F32)
        } else {
            value
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

/// The weight of the weights in an update of a device average: `1 − decay_n` with the count
/// on the host, or `(1 − decay_n) · (1 − found_inf)` as an f32 `[1]` tensor.
pub(super) type Rate<B> = kernels::Rate<Tensor<B, 1>>;

/// One update of an average on the device, tensor by tensor against the model's (shapes
/// checked).
pub(super) struct Average<'a, B: Backend> {
    pub model: &'a [TrainedTensor<B>],
    pub rate: Rate<B>,
    pub index: usize,
}

impl<B: Backend> ModuleMapper<B> for Average<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let w = &self.model[self.index];
        self.index += 1;
        let (id, average, mapper) = param.consume();
        // The average stays on the device it was made on; weights stepped elsewhere (a DDP
        // worker's clone, a sharded step) come to it. The same device: no copy.
        let weights = tensor::<B, D>(w.tensor.clone()).to_device(&average.device());
        let value = match (&self.rate, w.trained) {
            (_, false) => weights,
            (rate, true) => {
                let rate = match rate {
                    kernels::Rate::Host(rate) => kernels::Rate::Host(*rate),
                    // On the tensor's device (a model over several devices).
                    kernels::Rate::Device(rate) => {
                        kernels::Rate::Device(primitive(rate.clone().to_device(&average.device())))
                    }
                };
                tensor(kernels::update::<B>(
                    primitive(average),
                    primitive(weights),
                    rate,
                ))
            }
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

/// One trained tensor's average in host memory, f32.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    data: Vec<f32>,
    shape: Vec<usize>,
}

impl HostTensor {
    /// Reads a device tensor (in its own dtype, widened on the host: half the bytes of a
    /// bf16 or f16 tensor cross the bus).
    pub(super) fn read<B: Backend>(t: FloatTensor<B>) -> Self {
        let shape = t.shape().to_vec();
        let data = flat::<B>(t).into_data().convert::<f32>();
        Self {
            data: data.into_vec::<f32>().expect("converted to f32"),
            shape,
        }
    }

    pub(super) fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// `a ← a + (w − a) · rate`, element by element in f32, as the device's update.
    /// Widened as it is read (no f32 copy of a half tensor), on every core for a large one.
    pub(super) fn lerp<B: Backend>(&mut self, weights: FloatTensor<B>, rate: f32) {
        let w = flat::<B>(weights).into_data();
        match w.dtype {
            DType::F16 => lerp_from(&mut self.data, slice::<half::f16>(&w), rate),
            DType::BF16 => lerp_from(&mut self.data, slice::<half::bf16>(&w), rate),
            DType::F32 => lerp_from(&mut self.data, slice::<f32>(&w), rate),
            _ => {
                let w = w.convert::<f32>();
                lerp_from(&mut self.data, slice::<f32>(&w), rate)
            }
        }
    }

    /// The average as a device tensor, f32.
    fn upload<B: Backend, const D: usize>(&self, device: &B::Device) -> Tensor<B, D> {
        let data = TensorData::new(self.data.clone(), self.shape.clone());
        Tensor::from_data(data, (device, DType::F32))
    }
}

fn slice<E: burn::tensor::Element>(data: &TensorData) -> &[E] {
    data.as_slice::<E>().expect("the dtype matched")
}

/// `a ← a + (w − a) · rate` over `average`, split across threads above 2^18 values.
fn lerp_from<E: Copy + Into<f32> + Sync>(average: &mut [f32], weights: &[E], rate: f32) {
    let chunk = average.len().div_ceil(threads()).max(1 << 18);
    std::thread::scope(|scope| {
        for (a, w) in average.chunks_mut(chunk).zip(weights.chunks(chunk)) {
            let short = a.len() < chunk;
            let mut run = move || {
                for (a, &w) in a.iter_mut().zip(w) {
                    *a = *a + (w.into() - *a) * rate;
                }
            };
            if short {
                run() // the last (or only) chunk on this thread
            } else {
                scope.spawn(run);
            }
        }
    });
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Saved as f32 whatever the recorder's precision settings: the average is f32 on the device
/// too, and half-precision settings would round it to what the weights are.
impl<B: Backend> Record<B> for HostTensor {
    type Item<S: PrecisionSettings> = TensorData;

    fn into_item<S: PrecisionSettings>(self) -> TensorData {
        TensorData::new(self.data, self.shape)
    }

    fn from_item<S: PrecisionSettings>(item: TensorData, _device: &B::Device) -> Self {
        let shape = item.shape.to_vec();
        let data = item.convert::<f32>().into_vec::<f32>().expect("converted");
        Self { data, shape }
    }
}

/// A placeholder for a tensor kept in host memory: `[1; D]`, f32, on the tensor's device, so
/// that the module keeps its structure and devices for a few bytes.
fn placeholder<B: Backend, const D: usize>(device: &B::Device) -> Tensor<B, D> {
    Tensor::zeros([1; D], (device, DType::F32))
}

fn is_placeholder<B: Backend, const D: usize>(t: &Tensor<B, D>) -> bool {
    t.dims() == [1; D] && t.dtype() == DType::F32
}

/// Moves the trained tensors (`trained[i]`) of a module to host memory, widened to f32,
/// leaving placeholders: a host average from the model's weights or a device average.
pub(super) struct Offload<'a> {
    pub trained: &'a [bool],
    pub host: Vec<Option<HostTensor>>,
}

impl<B: Backend> ModuleMapper<B> for Offload<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let trained = self.trained.get(self.host.len()).copied().unwrap_or(false);
        let (id, value, mapper) = param.consume();
        let value = if trained {
            let device = value.device();
            self.host
                .push(Some(HostTensor::read::<B>(primitive(value))));
            placeholder(&device)
        } else {
            self.host.push(None);
            value
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Puts host averages back on the device, each where its placeholder is: the average as a
/// module.
pub(super) struct Upload<'a> {
    pub host: &'a [Option<HostTensor>],
    pub index: usize,
}

impl<B: Backend> ModuleMapper<B> for Upload<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let host = self.host.get(self.index).and_then(Option::as_ref);
        self.index += 1;
        let (id, value, mapper) = param.consume();
        let value = match host {
            Some(average) => average.upload(&value.device()),
            None => value,
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

/// After a host update: the tensors that are not averaged are the model's, the averaged
/// ones placeholders.
pub(super) struct Refresh<'a, B: Backend> {
    pub model: &'a [TrainedTensor<B>],
    pub host: &'a [Option<HostTensor>],
    pub index: usize,
}

impl<B: Backend> ModuleMapper<B> for Refresh<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let i = self.index;
        self.index += 1;
        let (id, value, mapper) = param.consume();
        let value = match self.host[i] {
            Some(_) if is_placeholder(&value) => value,
            Some(_) => placeholder(&value.device()),
            None => tensor(self.model[i].tensor.clone()).to_device(&value.device()),
        };
        Param::from_mapped_value(id, value, mapper)
    }
}
