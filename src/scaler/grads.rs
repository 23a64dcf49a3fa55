//! Gradients of a module as one rank-erased list, and back: so that one kernel call sees
//! every gradient, and the scaler works for any module.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use burn_backend::tensor::FloatTensor;

/// The gradients of `module`'s float parameters, taken out of `grads`, in visiting order.
pub(crate) fn take<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
) -> Vec<(ParamId, FloatTensor<B::InnerBackend>)> {
    struct Take<'a, T> {
        grads: &'a mut GradientsParams,
        out: Vec<(ParamId, T)>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Take<'_, FloatTensor<B::InnerBackend>> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.out.push((param.id, grad.into_primitive().tensor()));
            }
        }
    }
    let mut visitor = Take {
        grads,
        out: Vec::new(),
    };
    module.visit(&mut visitor);
    visitor.out
}

/// Puts gradients taken by [`take`] back into `grads`, with their ranks.
pub(crate) fn put<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    list: Vec<(ParamId, FloatTensor<B::InnerBackend>)>,
) {
    struct Put<'a, T> {
        grads: &'a mut GradientsParams,
        list: HashMap<ParamId, T>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Put<'_, FloatTensor<B::InnerBackend>> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.list.remove(&param.id) {
                let grad =
                    Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(grad));
                self.grads.register::<B::InnerBackend, D>(param.id, grad);
            }
        }
    }
    let mut visitor = Put {
        grads,
        list: list.into_iter().collect(),
    };
    module.visit(&mut visitor);
}
