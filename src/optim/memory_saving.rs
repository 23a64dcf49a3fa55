//! [`MemorySaving`]: one value that turns on every way burn-amp saves training memory on the
//! weights and the optimizer: half-precision parameters (no f32 master copy; their gradients
//! are then half too), 8-bit AdamW moments, and stochastic rounding of the updates. From 16
//! bytes per trainable parameter (f32 weights 4, gradients 4, moments 8) to about 6.

use burn::module::{AutodiffModule, Module, ModuleMapper, Param};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_std::FloatDType;

use super::{FusedAdamW, FusedAdamWConfig, OptimError, OptimKernels, ScaledAdaptor};

/// The memory-saving preset: [`prepare`](Self::prepare) the model, build the
/// [`optimizer`](Self::optimizer), train as usual (on [`Amp`](crate::Amp) in bf16, so the
/// ops run in the weights' dtype; wrap the optimizer in an
/// [`AmpOptimizer`](crate::AmpOptimizer) to get the same program at every precision).
#[derive(Debug, Clone)]
pub struct MemorySaving {
    /// AdamW with 8-bit moments and stochastic rounding.
    pub optimizer: FusedAdamWConfig,
    /// The dtype of the trainable parameters: bf16 (f32's range: nothing overflows).
    pub weights: FloatDType,
}

impl Default for MemorySaving {
    fn default() -> Self {
        Self::new()
    }
}

impl MemorySaving {
    /// bf16 weights, [`FusedAdamWConfig::memory_saving`].
    pub fn new() -> Self {
        Self {
            optimizer: FusedAdamWConfig::memory_saving(),
            weights: FloatDType::BF16,
        }
    }

    /// Another optimizer configuration (its moments and rounding are kept as given).
    pub fn with_optimizer(mut self, optimizer: FusedAdamWConfig) -> Self {
        self.optimizer = optimizer;
        self
    }

    /// Another weight dtype (`F32` keeps f32 weights: only the moments shrink).
    pub fn with_weights(mut self, weights: FloatDType) -> Self {
        self.weights = weights;
        self
    }

    /// `module` with its float parameters stored in [`weights`](Self::weights); whether a
    /// parameter requires gradients is kept.
    pub fn prepare<B: Backend, M: Module<B>>(&self, module: M) -> M {
        module.map(&mut CastParams(self.weights))
    }

    /// The optimizer, with empty state.
    pub fn optimizer<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
    ) -> Result<ScaledAdaptor<FusedAdamW, M, B>, OptimError>
    where
        B::InnerBackend: OptimKernels,
    {
        self.optimizer.init()
    }
}

/// Casts every float parameter to a dtype, as a fresh leaf (the cast is not recorded).
struct CastParams(FloatDType);

impl<B: Backend> ModuleMapper<B> for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let mut tensor = tensor.set_require_grad(false).cast(self.0);
        if require_grad {
            tensor = tensor.require_grad();
        }
        Param::from_mapped_value(id, tensor, mapper)
    }
}
