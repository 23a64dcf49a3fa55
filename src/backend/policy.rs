//! The autocast policy: every float op of burn 0.21's `FloatTensorOps`, `ModuleOps` and
//! `ActivationOps` in one of four categories (`shared/AUTOCAST_POLICY.md`, after PyTorch's
//! `autocast_mode.h`). This table is the whole policy; the op forwarding only asks it.

use core::any::TypeId;

use burn_backend::{Backend, DType, DeviceOps, TensorMetadata};
use burn_std::FloatDType;

use crate::precision::{Precision, Resolved, remember, thread_state};

/// What autocast does with an op's float inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Category {
    /// Cast every float input to the low dtype `L` (f16/bf16): matmul, conv, attention.
    Lower,
    /// Cast every float input to f32: exp/log, accumulating reductions, norms, softmax.
    F32,
    /// Run in the widest float dtype among the inputs (f16 with bf16 gives f32).
    Promote,
    /// Run in the input dtype. Several float inputs of different dtypes are promoted
    /// as above, so that no op ever panics on mixed dtypes.
    Pass,
}

macro_rules! policy_table {
    ($($category:ident => [$($op:ident),* $(,)?]),* $(,)?) => {
        /// One float op of the backend traits, named exactly as the trait method.
        #[allow(non_camel_case_types, missing_docs)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Op { $($($op,)*)* }

        impl Op {
            /// Every op in the table.
            pub const ALL: &'static [Op] = &[$($(Op::$op,)*)*];

            /// The op's category: the policy table, one arm per category.
            #[inline(always)]
            pub const fn category(self) -> Category {
                match self { $($(Op::$op)|* => Category::$category,)* }
            }

            /// The trait method's name.
            pub const fn name(self) -> &'static str {
                match self { $($(Op::$op => stringify!($op),)*)* }
            }

            /// Looks an op up by its trait method's name.
            pub fn from_name(name: &str) -> Option<Op> {
                Op::ALL.iter().copied().find(|op| op.name() == name)
            }
        }
    };
}

policy_table! {
    Lower => [
        float_matmul, linear,
        conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d, conv_transpose3d,
        // its softmax follows `F32` also under autodiff (see `ModuleOps::attention` of `Amp`)
        attention, prelu,
    ],
    F32 => [
        // exp / log family
        float_exp, float_log, float_log1p, float_powf, float_powf_scalar, float_powf_scalar_impl,
        float_powi, float_powi_scalar, float_powi_scalar_impl, float_recip, float_erf,
        float_tan, float_sinh, float_cosh, float_asin, float_acos, float_atanh,
        // reductions that accumulate
        float_sum, float_sum_dim, float_mean, float_mean_dim, float_prod, float_prod_dim,
        float_cumsum, float_cumprod,
        // average pooling: burn's CubeCL and Flex kernels sum in the element type
        avg_pool1d, avg_pool2d, adaptive_avg_pool1d, adaptive_avg_pool2d,
        // sampling coordinates need their fraction (torchvision runs it in f32)
        deform_conv2d,
        // normalisation and probability
        softmax, log_softmax, softmin, layer_norm, log_sigmoid, sigmoid,
        // losses, spectral, resampling
        ctc_loss, rfft, irfft, interpolate, float_grid_sample_2d,
    ],
    Promote => [
        float_add, float_sub, float_mul, float_div, float_remainder, float_atan2, float_cross,
        float_mask_where, float_cat, float_scatter_add, float_scatter_nd, float_select_add,
        float_slice_assign,
        float_equal, float_not_equal, float_greater, float_greater_equal, float_lower,
        float_lower_equal,
    ],
    Pass => [
        // creation, data and devices: the dtype the caller asked for
        float_from_data, float_random, float_zeros, float_ones, float_full, float_empty,
        float_into_data, float_device, float_to_device, float_into_int, float_cast,
        float_detach, float_set_require_grad, float_is_require_grad,
        // elementwise
        float_neg, float_abs, float_sqrt, float_sin, float_cos, float_tanh, float_acosh,
        float_asinh, float_atan, float_round, float_floor, float_ceil, float_trunc, float_sign,
        float_is_nan, float_is_inf,
        relu, leaky_relu, gelu,
        // saturates to exactly 0 and 1 (x <= -3, x >= 3) in f32 too
        hard_sigmoid,
        // scalar operands (kept in f32 where the half dtype cannot hold them:
        // `workarounds::scalars`)
        float_add_scalar, float_sub_scalar, float_mul_scalar, float_div_scalar,
        float_remainder_scalar, float_clamp, float_clamp_min, float_clamp_max, float_mask_fill,
        float_equal_elem, float_not_equal_elem, float_greater_elem, float_greater_equal_elem,
        float_lower_elem, float_lower_equal_elem,
        // layout and indexing
        float_reshape, float_transpose, float_swap_dims, float_permute, float_flip,
        float_expand, float_repeat_dim, float_slice, float_select, float_gather,
        float_gather_nd, float_unfold, unfold4d, embedding,
        // exact in any dtype
        float_max, float_max_dim, float_max_dim_with_indices, float_min, float_min_dim,
        float_min_dim_with_indices, float_max_abs, float_max_abs_dim, float_argmax,
        float_argmin, float_argtopk, float_topk, float_cummin, float_cummax, float_sort,
        float_sort_with_indices, float_argsort, float_any, float_any_dim, float_all,
        float_all_dim,
        // max pooling
        max_pool1d, max_pool2d, max_pool1d_with_indices, max_pool2d_with_indices,
        // backward kernels: run in the dtype of what autodiff saved
        relu_backward, gelu_backward, sigmoid_backward, log_sigmoid_backward,
        embedding_backward, linear_x_backward, linear_weight_backward, linear_bias_backward,
        conv1d_x_backward, conv1d_weight_backward, conv1d_bias_backward,
        conv2d_x_backward, conv2d_weight_backward, conv2d_bias_backward,
        conv3d_x_backward, conv3d_weight_backward, conv3d_bias_backward,
        conv_transpose1d_x_backward, conv_transpose1d_weight_backward,
        conv_transpose1d_bias_backward, conv_transpose2d_x_backward,
        conv_transpose2d_weight_backward, conv_transpose2d_bias_backward,
        conv_transpose3d_x_backward, conv_transpose3d_weight_backward,
        conv_transpose3d_bias_backward, deform_conv2d_backward, avg_pool1d_backward,
        avg_pool2d_backward, adaptive_avg_pool1d_backward, adaptive_avg_pool2d_backward,
        max_pool1d_with_indices_backward, max_pool2d_with_indices_backward,
        interpolate_backward, ctc_loss_backward, has_ctc_loss_backward,
    ],
}

/// Float dtypes as bits, to see "all inputs already in the target dtype" in one compare.
fn bit(dtype: FloatDType) -> u8 {
    match dtype {
        FloatDType::F64 => 1,
        FloatDType::F32 => 2,
        FloatDType::Flex32 => 4,
        FloatDType::F16 => 8,
        FloatDType::BF16 => 16,
    }
}

/// The widest float dtype present in `seen` (f64 > f32 > f16/bf16; f16 with bf16 is f32).
fn widest(seen: u8) -> FloatDType {
    if seen & 1 != 0 {
        FloatDType::F64
    } else if seen & 2 != 0 {
        FloatDType::F32
    } else if seen & 4 != 0 {
        FloatDType::Flex32
    } else if seen & (8 | 16) == (8 | 16) {
        FloatDType::F32
    } else if seen & 16 != 0 {
        FloatDType::BF16
    } else {
        FloatDType::F16
    }
}

/// Resolves one op call: sees the float inputs, then tells the dtype to cast them to.
pub(crate) struct Autocast<B: Backend> {
    /// The op of the table; `None` for a [custom op](crate::custom_op).
    op: Option<Op>,
    category: Category,
    /// The dtype category `Lower` lowers to, once known.
    low: Option<FloatDType>,
    /// Whether `low` still waits for a device: the setting (the device's default, f16 or
    /// bf16) is resolved, and its support checked, on the first float input's device.
    low_pending: bool,
    /// The thread's setting and last resolution, read once in `new`.
    asked: Option<Precision>,
    memo: Option<Resolved>,
    seen: u8,
    /// How many float inputs of a `Lower` op autodiff does not track (saturating).
    untracked: u8,
    _backend: core::marker::PhantomData<B>,
}

impl<B: Backend> Autocast<B> {
    #[inline(always)]
    pub(crate) fn new(op: Op) -> Self {
        Self::of(Some(op), op.category())
    }

    /// A [custom op](crate::custom_op) of `category`.
    pub(crate) fn custom(category: Category) -> Self {
        Self::of(None, category)
    }

    #[inline(always)]
    fn of(op: Option<Op>, category: Category) -> Self {
        let (low, low_pending, asked, memo) = match category {
            // Their dtype follows the inputs alone: no setting to read.
            Category::Promote | Category::Pass => (None, false, None, None),
            Category::F32 | Category::Lower => {
                // The only thread-local read of an op whose low dtype is already resolved.
                let state = thread_state();
                let (low, pending) = match (category, state.precision) {
                    (_, Some(Precision::F32)) => (None, false),
                    // f32 ops need no device: any active setting means "to f32".
                    (Category::F32, _) => (Some(FloatDType::F32), false),
                    _ => (None, true),
                };
                (low, pending, state.precision, state.resolved)
            }
        };
        Self {
            op,
            category,
            low,
            low_pending,
            asked,
            memo,
            seen: 0,
            untracked: 0,
            _backend: core::marker::PhantomData,
        }
    }

    /// Records one float input.
    #[inline(always)]
    pub(crate) fn see(&mut self, tensor: &B::FloatTensorPrimitive) {
        if let Some(dtype) = float_dtype(tensor.dtype()) {
            self.seen |= bit(dtype);
        }
        if self.low_pending {
            self.low_pending = false;
            self.low = resolve_low::<B>(self.asked, self.memo, &B::float_device(tensor));
        }
        // Only a lowering `Lower` op narrows, and needs this (f32 runs skip the probe).
        if self.category == Category::Lower
            && self.low.is_some()
            && !super::concrete::is_tracked::<B>(tensor).unwrap_or(false)
        {
            self.untracked = self.untracked.saturating_add(1);
        }
    }

    /// What to do with the inputs seen: their dtype, and what the casts may share.
    #[inline(always)]
    pub(crate) fn plan(&self) -> Plan {
        Plan {
            target: self.target(),
            op: self.op,
            // `Lower` ops (matmul, linear, conv) keep an input for their backward when the
            // others are tracked (burn-autodiff 0.21: conv always, matmul and linear when
            // the other operand is): a copy of it shared is then kept by its first user anyway.
            untracked: (self.category == Category::Lower).then_some(self.untracked),
        }
    }

    /// The dtype to cast the inputs to, or `None` when they are already right.
    #[inline(always)]
    fn target(&self) -> Option<FloatDType> {
        if self.seen == 0 {
            return None;
        }
        let target = if self.seen & bit(FloatDType::F64) != 0 {
            // f64 is never lowered; anything beside it is promoted to it.
            FloatDType::F64
        } else {
            match (self.category, self.low) {
                (Category::Lower, Some(low)) => low,
                (Category::F32, Some(f32)) => f32,
                _ => widest(self.seen),
            }
        };
        (self.seen != bit(target)).then_some(target)
    }

    /// The dtype the inputs have once cast: the target, or the one they share; `None` when
    /// no float input was seen.
    pub(crate) fn dtype(&self) -> Option<FloatDType> {
        // Without a target the inputs share one dtype: the widest is it.
        self.target()
            .or_else(|| (self.seen != 0).then(|| widest(self.seen)))
    }

    /// Whether this `Lower` op runs in a low dtype: autocast is on and no input is f64.
    /// True also when the inputs are in that dtype already.
    #[inline(always)]
    pub(crate) fn lowers(&self) -> bool {
        self.category == Category::Lower
            && self.low.is_some()
            && self.seen & bit(FloatDType::F64) == 0
    }
}

#[inline(always)]
fn float_dtype(dtype: DType) -> Option<FloatDType> {
    match dtype {
        DType::F64 => Some(FloatDType::F64),
        DType::F32 => Some(FloatDType::F32),
        DType::Flex32 => Some(FloatDType::Flex32),
        DType::F16 => Some(FloatDType::F16),
        DType::BF16 => Some(FloatDType::BF16),
        _ => None,
    }
}

/// The low dtype on `device`: the thread's last resolution when it was for this backend,
/// device and setting (no lookup), else resolved afresh.
#[inline(always)]
fn resolve_low<B: Backend>(
    asked: Option<Precision>,
    memo: Option<Resolved>,
    device: &B::Device,
) -> Option<FloatDType> {
    let backend = TypeId::of::<B>();
    let id = device.id();
    match memo {
        Some(m) if m.backend == backend && m.device == id && m.asked == asked => m.low,
        _ => resolve_low_cold::<B>(asked, device, backend, id),
    }
}

/// The thread's explicit choice, checked against the device (f16 and bf16 alike), or the
/// device's default; remembered for the next ops.
#[cold]
#[inline(never)]
fn resolve_low_cold<B: Backend>(
    asked: Option<Precision>,
    device: &B::Device,
    backend: TypeId,
    id: burn_std::device::DeviceId,
) -> Option<FloatDType> {
    let low = match asked {
        None => Precision::default_for::<B>(device).low_dtype(),
        Some(precision) => {
            if !precision.is_supported::<B>(device) {
                let alternative = [Precision::Bf16, Precision::F16]
                    .into_iter()
                    .find(|p| *p != precision && p.is_supported::<B>(device))
                    .unwrap_or(Precision::F32);
                panic!(
                    "{}",
                    crate::error::AmpError::UnsupportedPrecision {
                        precision,
                        device: format!("{device:?}"),
                        backend: B::name(device),
                        alternative,
                    }
                );
            }
            precision.low_dtype()
        }
    };
    remember(Resolved {
        backend,
        device: id,
        asked,
        low,
    });
    low
}

/// One op call's casts, from [`Autocast::plan`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    /// The dtype to cast the float inputs to, or `None` when they are already right.
    pub(crate) target: Option<FloatDType>,
    /// The op of the table; `None` for a custom op (whose backward's needs are unknown: a
    /// widened input is then a plain cast).
    op: Option<Op>,
    /// For a `Lower` op, how many of its float inputs autodiff does not track.
    untracked: Option<u8>,
}

impl Plan {
    /// Casts `tensor`, an input of the op, to the target unless it is there already or is
    /// not a float: a narrowing that the op keeps for its backward through the
    /// [cast cache](super::cast_cache) (one copy per tensor, shared by its uses), a widening
    /// that the op keeps through a [recomputed cast](super::upcast).
    #[inline(always)]
    pub(crate) fn cast<B: Backend>(
        self,
        tensor: B::FloatTensorPrimitive,
    ) -> B::FloatTensorPrimitive {
        match self.target {
            Some(target) if float_dtype(tensor.dtype()).is_some_and(|d| d != target) => {
                if tensor.shape().num_elements() == 0 {
                    // No kernel over an empty tensor (CUDA refuses it), nor in its backward.
                    return super::workarounds::empty::float_cast::<B>(tensor, target);
                }
                super::cast_cache::cast::<B>(tensor, target, self.untracked)
                    .or_else(|tensor| match self.op {
                        Some(op) => super::upcast::cast::<B>(tensor, target, op),
                        None => Err(tensor),
                    })
                    .unwrap_or_else(|tensor| B::float_cast(tensor, target))
            }
            _ => tensor,
        }
    }
}
