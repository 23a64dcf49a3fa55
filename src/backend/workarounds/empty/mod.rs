//! Ops on empty tensors, which Burn 0.21's CubeCL backends cannot run: `Amp` gives their
//! result without a kernel.
//!
//! CubeCL 0.10 launches a kernel over an empty tensor with a (0, 0, 0) grid. CUDA refuses such
//! a launch, CubeCL keeps the error, and the next read of anything on that stream fails ("The
//! server is in an invalid state"): one `Tensor::zeros([0, 8])` ends the run
//! (tracel-ai/cubecl#1349, after 0.10.0, skips them). On wgpu and CUDA alike, a matmul with an
//! empty operand panics in the matmul's launch ("CallError"), and a sum or mean along an empty
//! dimension in the reduce autotune. Measured by `examples/gpu_check`'s `empty` cases through
//! the stand-in driver (`scripts/cuda-compile-check.sh`), and by
//! `tests/autocast_numerics/empty.rs` on wgpu.
//!
//! `Amp` answers such an op without `B`'s kernel: an empty result is made with `float_empty`
//! (an allocation, no launch), a result that holds values (the sum of nothing: 0; the mean of
//! nothing: NaN, as in PyTorch; a matmul over an empty inner dimension: zeros) with
//! `float_full` over its non-zero size. Under autodiff the result is one node over the op's
//! float inputs whose backward gives each of them zeros (an empty input: an empty gradient):
//! the result does not depend on them, and a parameter reached only through an empty batch
//! gets a zero gradient, as in PyTorch, rather than none.
//!
//! Covered: creation (float, int, bool); the elementwise ops, activations and comparisons
//! (their result has the broadcast shape of their float inputs, [`Elementwise`]; checked in
//! `autocast_ops!`), and those of int and bool tensors, conversions between the kinds included
//! (marked `=> empty` in `forward!`); casts, `matmul` (float and int), `linear`; picks, writes
//! and `cat` of floats, ints and bools ([`indexing`]: `select`, `gather`, `gather_nd`,
//! `embedding` of no index; `select_add`, `scatter_add`, `scatter_nd`, `slice_assign` of an
//! empty value, the tensor itself with the value kept in the graph; a `cat` with an empty
//! piece); reductions, sorts and top-k ([`reduce`]: PyTorch's value over nothing, or a panic
//! where there is none); views with an empty result ([`views`]: reshape, transpose, permute,
//! expand, repeat, unfold); convolutions, pooling and `interpolate` over an empty batch,
//! deformable ones and `grid_sample` too ([`batch`]). Not covered: burn-autodiff's own
//! backward ops (they run on `B` directly): a gradient of an empty tensor that autodiff has to
//! add to another still launches on CUDA.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use core::any::Any;

use burn_backend::tensor::{Device, FloatTensor};
use burn_backend::{Backend, DType, Scalar, TensorData, TensorMetadata, get_device_settings};
use burn_std::{FloatDType, Shape};

use crate::backend::concrete::{AutodiffTensor, Visit, dispatch, moved};
use crate::backend::policy::Op;

mod batch;
mod indexing;
mod kind;
mod ops;
mod reduce;
mod views;

pub(crate) use batch::*;
pub(crate) use indexing::*;
pub(crate) use ops::*;
pub(crate) use reduce::*;
pub(crate) use views::*;

/// What a result made without a kernel holds.
#[derive(Debug, Clone, Copy)]
enum Fill {
    /// Nothing: the result is empty.
    Empty,
    /// One value everywhere.
    Value(f64),
}

fn is_empty<T: TensorMetadata>(tensor: &T) -> bool {
    tensor.shape().num_elements() == 0
}

fn float_dtype(dtype: DType) -> FloatDType {
    FloatDType::from(dtype)
}

/// A tensor of `shape` made without a kernel over an empty size.
fn filled<X: Backend>(
    shape: Shape,
    fill: Fill,
    device: &Device<X>,
    dtype: FloatDType,
) -> FloatTensor<X> {
    match fill {
        Fill::Value(value) if shape.num_elements() > 0 => {
            X::float_full(shape, Scalar::Float(value), device, dtype)
        }
        _ => X::float_empty(shape, device, dtype),
    }
}

/// What a node made here gives.
#[derive(Debug, Clone)]
enum Made {
    /// A tensor of this shape and dtype that depends on none of the inputs.
    Constant(Shape, FloatDType, Fill),
    /// The first input unchanged (a write of nothing into it): its gradient passes through.
    First,
}

/// The result of an op that does not depend on its float `inputs` (not empty: the op's
/// device is theirs), as one autodiff node over them when `B` is a listed autodiff backend.
fn constant<B: Backend>(
    inputs: Vec<FloatTensor<B>>,
    shape: Shape,
    dtype: FloatDType,
    fill: Fill,
) -> FloatTensor<B> {
    made::<B>(inputs, Made::Constant(shape, dtype, fill))
}

/// `tensor` after a write of the empty `value` into it: `tensor` itself, but under autodiff a
/// node over both, so that what made `value` stays in the graph (its parameters get a zero
/// gradient, as from `B`'s own op, not none).
fn unchanged<B: Backend>(tensor: FloatTensor<B>, value: FloatTensor<B>) -> FloatTensor<B> {
    made::<B>(vec![tensor, value], Made::First)
}

fn made<B: Backend>(inputs: Vec<FloatTensor<B>>, result: Made) -> FloatTensor<B> {
    struct Call<P> {
        inputs: Vec<P>,
        result: Made,
    }
    impl<P: 'static> Visit for Call<P> {
        type Out = P;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> P {
            let inputs: Vec<AutodiffTensor<X>> = moved(self.inputs);
            let first = matches!(self.result, Made::First);
            let out = match self.result {
                Made::Constant(shape, dtype, fill) => {
                    let device = X::float_device(&inputs[0].primitive);
                    filled::<X>(shape, fill, &device, dtype)
                }
                Made::First => inputs[0].primitive.clone(),
            };
            moved(match inputs.len() {
                1 => node::<X, C, 1>(inputs, out, first),
                2 => node::<X, C, 2>(inputs, out, first),
                3 => node::<X, C, 3>(inputs, out, first),
                4 => node::<X, C, 4>(inputs, out, first),
                5 => node::<X, C, 5>(inputs, out, first),
                n => unreachable!("an op of {n} float inputs"),
            })
        }
    }
    let device = B::float_device(&inputs[0]);
    match dispatch::<B, _>(Call { inputs, result }) {
        Ok(out) => out,
        // Not a listed autodiff backend: the tensor alone.
        Err(Call {
            result: Made::Constant(shape, dtype, fill),
            ..
        }) => filled::<B>(shape, fill, &device, dtype),
        Err(Call { mut inputs, .. }) => inputs.swap_remove(0),
    }
}

fn node<X: Backend, C: CheckpointStrategy, const N: usize>(
    inputs: Vec<AutodiffTensor<X>>,
    out: FloatTensor<X>,
    first_through: bool,
) -> AutodiffTensor<X> {
    let inputs: [AutodiffTensor<X>; N] = match inputs.try_into() {
        Ok(inputs) => inputs,
        Err(_) => unreachable!("called with N inputs"),
    };
    let parents = inputs.each_ref().map(|t| t.node.clone());
    match KernelFreeBackward
        .prepare::<C>(parents)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = inputs
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    if i == 0 && first_through {
                        Input::Through
                    } else if is_empty(&t.primitive) {
                        Input::Empty(t.clone())
                    } else {
                        Input::Zeros(t.primitive.shape(), float_dtype(t.primitive.dtype()))
                    }
                })
                .collect();
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// An input of a [`KernelFreeBackward`] node: the shape and dtype of its zero gradient, or, if
/// empty, the tensor itself (to see whether it has its gradient already), or the input the
/// result is (its gradient is the result's).
#[derive(Debug, Clone)]
enum Input<X: Backend> {
    Zeros(Shape, FloatDType),
    Empty(AutodiffTensor<X>),
    Through,
}

/// The backward of a result made without a kernel: zeros of each input's shape and dtype (the
/// result does not depend on them), the result's gradient for the input it is. An empty input
/// gets an empty gradient once: a second would be added to the first by burn-autodiff, with a
/// kernel (on CUDA, refused).
#[derive(Debug)]
struct KernelFreeBackward;

impl<X: Backend, const N: usize> Backward<X, N> for KernelFreeBackward {
    type State = Vec<Input<X>>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<X>(&ops.node);
        let device = X::float_device(&grad);
        for (parent, input) in ops.parents.into_iter().zip(ops.state) {
            let Some(parent) = parent else { continue };
            match input {
                Input::Zeros(shape, dtype) => {
                    grads.register::<X>(parent.id, X::float_zeros(shape, &device, dtype))
                }
                Input::Through => grads.register::<X>(parent.id, grad.clone()),
                Input::Empty(tensor) if grads.get::<X>(&tensor).is_none() => {
                    let (shape, dtype) = (tensor.primitive.shape(), tensor.primitive.dtype());
                    let empty = X::float_empty(shape, &device, float_dtype(dtype));
                    grads.register::<X>(parent.id, empty)
                }
                Input::Empty(_) => {}
            }
        }
    }
}

/// The broadcast shape of `shapes` (same rank, each dimension equal or 1), `None` when they
/// do not broadcast (then `B` says why).
fn broadcast(shapes: &[Shape]) -> Option<Shape> {
    let rank = shapes[0].num_dims();
    if shapes.iter().any(|s| s.num_dims() != rank) {
        return None;
    }
    let mut dims = Vec::with_capacity(rank);
    for i in 0..rank {
        let mut dim = 1;
        for shape in shapes {
            match (dim, shape[i]) {
                (_, 1) => {}
                (1, d) => dim = d,
                (a, b) if a == b => {}
                _ => return None,
            }
        }
        dims.push(dim);
    }
    Some(Shape::from(dims))
}

/// The data of an empty tensor, read without `B`: CubeCL copies an empty tensor whose
/// zero-sized dimension makes it look strided (`[3, 0]`) before reading it, a kernel CUDA
/// refuses.
pub(crate) fn no_data<T: TensorMetadata>(tensor: &T) -> Option<TensorData> {
    is_empty(tensor).then(|| TensorData::from_bytes_vec(vec![], tensor.shape(), tensor.dtype()))
}

/// The result's shape of an elementwise int or bool op over tensors of `shapes` when one is
/// empty and so is the result, else `None` (then `B` runs the op, and says why if they do not
/// broadcast). A shape read per input, no allocation.
#[inline(always)]
pub(crate) fn empty_broadcast(shapes: &[Shape]) -> Option<Shape> {
    if shapes.iter().all(|s| s.num_elements() > 0) {
        return None;
    }
    broadcast(shapes).filter(|s| s.num_elements() == 0)
}

/// What an elementwise op gives: its result has the broadcast shape of its float tensor
/// inputs (those `autocast_ops!` marks `t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elementwise {
    /// A float tensor in the inputs' dtype after autocast.
    Float,
    /// A comparison's bool tensor.
    Bool,
}

impl Elementwise {
    /// `op`'s kind, `None` for an op that is not elementwise.
    pub(crate) const fn of(op: Op) -> Option<Elementwise> {
        use Op::*;
        match op {
            float_add
            | float_add_scalar
            | float_clamp_min
            | float_clamp_max
            | float_clamp
            | float_sub
            | float_sub_scalar
            | float_mul
            | float_mul_scalar
            | float_div
            | float_div_scalar
            | float_remainder
            | float_remainder_scalar
            | float_neg
            | float_recip
            | float_flip
            | float_mask_where
            | float_mask_fill
            | float_cumsum
            | float_cumprod
            | float_cummin
            | float_cummax
            | float_exp
            | float_log
            | float_log1p
            | float_powf
            | float_powi
            | float_powi_scalar
            | float_powi_scalar_impl
            | float_powf_scalar
            | float_powf_scalar_impl
            | float_sqrt
            | float_abs
            | float_cos
            | float_sin
            | float_tan
            | float_cosh
            | float_sinh
            | float_tanh
            | float_acos
            | float_acosh
            | float_asin
            | float_asinh
            | float_atan
            | float_atanh
            | float_atan2
            | float_round
            | float_floor
            | float_ceil
            | float_trunc
            | float_erf
            | float_sign
            | float_sort
            | leaky_relu
            | relu
            | relu_backward
            | gelu
            | gelu_backward
            | sigmoid
            | sigmoid_backward
            | hard_sigmoid
            | log_sigmoid
            | softmax
            | log_softmax
            | softmin
            | log_sigmoid_backward
            | layer_norm => Some(Elementwise::Float),
            float_equal
            | float_not_equal
            | float_equal_elem
            | float_not_equal_elem
            | float_greater
            | float_greater_elem
            | float_greater_equal
            | float_greater_equal_elem
            | float_lower
            | float_lower_elem
            | float_lower_equal
            | float_lower_equal_elem
            | float_is_nan
            | float_is_inf => Some(Elementwise::Bool),
            _ => None,
        }
    }
}

/// The empty-input check of an elementwise op in `autocast_ops!`: it sees the float inputs,
/// and when one is empty the op's result is made here.
pub(crate) struct EmptyInputs<B: Backend> {
    kind: Elementwise,
    inputs: Vec<FloatTensor<B>>,
    empty: bool,
}

impl<B: Backend> EmptyInputs<B> {
    /// The check of `op`; `None` (and free) for an op that is not elementwise.
    #[inline(always)]
    pub(crate) fn new(op: Op) -> Option<Self> {
        Some(Self {
            kind: Elementwise::of(op)?,
            inputs: Vec::new(),
            empty: false,
        })
    }

    /// Sees one float input.
    #[inline(always)]
    pub(crate) fn see(&mut self, tensor: &FloatTensor<B>) {
        self.empty |= is_empty(tensor);
    }

    /// Whether an input was empty: then each is handed to [`Self::keep`], in order.
    #[inline(always)]
    pub(crate) fn hit(&self) -> bool {
        self.empty
    }

    /// Keeps one float input (a clone: `B` runs the op on them if they do not broadcast).
    pub(crate) fn keep(&mut self, tensor: &FloatTensor<B>) {
        self.inputs.push(tensor.clone());
    }

    /// The op's empty result, `R` being its return type (a float or a bool tensor of `B`);
    /// `None` when the inputs do not broadcast (`B` runs the op and says why).
    pub(crate) fn result<R: 'static>(self, target: Option<FloatDType>) -> Option<R> {
        let shape = broadcast(&self.inputs.iter().map(|t| t.shape()).collect::<Vec<_>>())
            .filter(|s| s.num_elements() == 0)?;
        let out: Box<dyn Any> = match self.kind {
            Elementwise::Float => {
                let dtype = target.unwrap_or_else(|| float_dtype(self.inputs[0].dtype()));
                Box::new(constant::<B>(self.inputs, shape, dtype, Fill::Empty))
            }
            Elementwise::Bool => {
                let device = B::float_device(&self.inputs[0]);
                let dtype = get_device_settings::<B>(&device).bool_dtype;
                Box::new(B::bool_empty(shape, &device, dtype))
            }
        };
        out.downcast::<R>().ok().map(|out| *out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shape from its dimensions (for the tests of `empty`'s modules).
    pub(super) fn s(dims: &[usize]) -> Shape {
        Shape::from(dims.to_vec())
    }

    #[test]
    fn broadcast_follows_burn() {
        assert_eq!(broadcast(&[s(&[0, 8]), s(&[1, 8])]), Some(s(&[0, 8])));
        assert_eq!(broadcast(&[s(&[0, 1]), s(&[1, 8])]), Some(s(&[0, 8])));
        assert_eq!(broadcast(&[s(&[0, 8]), s(&[3, 8])]), None);
        assert_eq!(broadcast(&[s(&[0, 8]), s(&[8])]), None);
    }
}
