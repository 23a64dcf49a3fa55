//! Small models used by several tests and benches, written once, and readers of a module's
//! float parameters (values, bits, ids).

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;

/// Burn initialises parameters lazily, per clone: give them their values once, so that
/// clones of one model start from the same weights.
pub fn materialize<B: Backend, M: Module<B>>(module: M) -> M {
    let record = module.clone().into_record();
    module.load_record(record)
}

/// Every float parameter's values, as f32, in visiting order.
pub fn params<B: Backend, M: Module<B>>(module: &M) -> Vec<f32> {
    struct Values(Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().cast(burn::tensor::FloatDType::F32).into_data();
            self.0.extend(data.to_vec::<f32>().unwrap());
        }
    }
    let mut v = Values(Vec::new());
    module.visit(&mut v);
    v.0
}

/// Every float parameter's values, as f32 bits, to compare modules exactly.
pub fn bits<B: Backend, M: Module<B>>(module: &M) -> Vec<u32> {
    params(module).into_iter().map(f32::to_bits).collect()
}

/// Every float parameter's id, in visiting order.
pub fn ids<B: Backend, M: Module<B>>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl<B: Backend> ModuleVisitor<B> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.id);
        }
    }
    let mut v = Ids(Vec::new());
    module.visit(&mut v);
    v.0
}

/// Two linear layers with a GELU between them.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// First layer.
    pub l1: Linear<B>,
    /// Second layer.
    pub l2: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    /// `d_in -> d_hidden -> d_out`, materialized.
    pub fn new(d_in: usize, d_hidden: usize, d_out: usize, device: &B::Device) -> Self {
        materialize(Self {
            l1: LinearConfig::new(d_in, d_hidden).init(device),
            l2: LinearConfig::new(d_hidden, d_out).init(device),
        })
    }

    /// The logits.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.l2
            .forward(burn::tensor::activation::gelu(self.l1.forward(x)))
    }

    /// Cross-entropy of the logits against `y`.
    pub fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let logits = self.forward(x);
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, y)
    }

    /// The weights' bits, to compare runs exactly.
    pub fn weight_bits(&self) -> Vec<u32> {
        [&self.l1.weight, &self.l2.weight]
            .into_iter()
            .flat_map(|p| {
                p.val()
                    .cast(burn::tensor::DType::F32)
                    .into_data()
                    .to_vec::<f32>()
                    .unwrap()
            })
            .map(f32::to_bits)
            .collect()
    }
}

/// `depth` square linear layers of `width`, each followed by a GELU.
#[derive(Module, Debug)]
pub struct DeepMlp<B: Backend> {
    /// The layers.
    pub layers: Vec<Linear<B>>,
}

impl<B: Backend> DeepMlp<B> {
    /// A stack of `depth` layers `width -> width`.
    pub fn new(width: usize, depth: usize, device: &B::Device) -> Self {
        Self {
            layers: (0..depth)
                .map(|_| LinearConfig::new(width, width).init(device))
                .collect(),
        }
    }

    /// The output.
    pub fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for layer in &self.layers {
            x = burn::tensor::activation::gelu(layer.forward(x));
        }
        x
    }
}
