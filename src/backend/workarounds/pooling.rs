//! The gradient of `avg_pool2d` on CubeCL. burn-cubecl 0.21's `avg_pool2d_backward` reads the
//! output gradient channels-last, with a vector width taken from the *input's* last dimension
//! (the width, in NCHW) whenever the two have equal innermost strides: whenever the output
//! gradient's channels are adjacent in memory. Then a width that is a multiple of 4 gives
//! 4-wide reads over channels that may not come in fours: wrong values (240 of 320 for
//! `[1, 5, 8, 8]` pooled 8×8), or a wgpu validation panic ("bound with size 8 where the
//! shader expects 16") when fewer than 4 values are there. Two cases make the channels
//! adjacent:
//! - a 1×1 output (one window over the whole map, as a CNN's head pools), in any layout;
//! - a gradient that arrives channels-last, as it does when the pooled map is permuted to
//!   channels-last next (`y.permute([0, 2, 3, 1])`, before a linear layer): 224 of 384
//!   values wrong for `[1, 6, 8, 8]` pooled 2×2.
//!
//! For a 1×1 output the gradient needs no kernel: each input position inside the window gets
//! the output's gradient times the same weight, `1 / divisor`, and the rest 0. The weight is
//! read off the backend's own forward on a map of ones (which averages `valid` ones: it is
//! `valid / divisor`), so padding, `count_include_pad` and `ceil_mode` mean what the backend
//! means by them. Any other output's gradient is first copied into a packed NCHW tensor (a
//! `cat` of the one tensor), whose channels are `out_h · out_w` apart: the kernel then reads
//! one value at a time, and is right. Under `Amp` above autodiff, `avg_pool2d` is a node
//! with this backward (on wgpu and CUDA; Flex is right), keeping the input as burn-autodiff
//! does (checkpointed), or nothing for a 1×1 output; below it, `Amp`'s `avg_pool2d_backward`
//! does the same.
//!
//! **`ceil_mode` windows of padding alone.** Burn 0.21's pool output size lacks PyTorch's
//! rule that the last window starts inside the input or its left padding, so with
//! `ceil_mode` a pool may have a last output whose window lies in the right padding alone
//! (width 3, kernel 2, stride 2, padding 1: three outputs where PyTorch has two). With
//! `count_include_pad = false` CubeCL averages no element there, 0 / 0: NaN (Flex: 0), and
//! a NaN loss reads as an overflow to the loss scaler, every step skipped. `Amp` keeps
//! Burn's shapes (a model sized for them keeps working) and makes such outputs 0, as Flex
//! does; their gradient reaches no input. `avg_pool1d` goes through the same code.

use core::any::TypeId;

use burn::backend::Flex;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn_backend::ops::conv::calculate_pool_output_size;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};
use burn_std::{Shape, Slice};

use crate::backend::concrete::{AutodiffTensor, Visit, dispatch, moved};

/// A pool's settings, as `avg_pool2d` takes them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AvgPool {
    kernel_size: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    count_include_pad: bool,
    ceil_mode: bool,
}

impl AvgPool {
    const fn new(
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        count_include_pad: bool,
        ceil_mode: bool,
    ) -> Self {
        Self {
            kernel_size,
            stride,
            padding,
            count_include_pad,
            ceil_mode,
        }
    }

    /// The input's gradient with the defect avoided: a 1×1 output's computed here (`x` is
    /// not needed), any other's by the kernel from the gradient packed NCHW (a `cat` of the
    /// one tensor: its channels are then `out_h · out_w` apart).
    fn gradient<X: Backend>(
        &self,
        x: Option<FloatTensor<X>>,
        shape: &Shape,
        dtype: burn_std::DType,
        g: FloatTensor<X>,
    ) -> FloatTensor<X> {
        match x {
            Some(x) if !self.is_global(shape) => self.backward::<X>(x, X::float_cat(vec![g], 1)),
            _ => {
                let device = X::float_device(&g);
                global_backward::<X>(self, shape, dtype, &device, g)
            }
        }
    }

    /// Whether the pool of a `[n, c, h, w]` input has a 1×1 output.
    fn is_global(&self, shape: &Shape) -> bool {
        (0..2).all(|i| {
            let size = shape[2 + i];
            // A window larger than the padded input has no output: Burn's error, not ours.
            size + 2 * self.padding[i] >= self.kernel_size[i]
                && calculate_pool_output_size(
                    self.kernel_size[i],
                    self.stride[i],
                    self.padding[i],
                    1,
                    size,
                    self.ceil_mode,
                ) == 1
        })
    }

    /// The input rows (or columns) inside the one window, along axis `i` of size `size`.
    fn window(&self, i: usize, size: usize) -> (usize, usize) {
        let end = self.kernel_size[i]
            .saturating_sub(self.padding[i])
            .min(size);
        (0, end)
    }

    fn backward<X: Backend>(&self, x: FloatTensor<X>, grad: FloatTensor<X>) -> FloatTensor<X> {
        X::avg_pool2d_backward(
            x,
            grad,
            self.kernel_size,
            self.stride,
            self.padding,
            self.count_include_pad,
            self.ceil_mode,
        )
    }

    fn forward<X: Backend>(&self, x: FloatTensor<X>) -> FloatTensor<X> {
        let shape = x.shape();
        let out = X::avg_pool2d(
            x,
            self.kernel_size,
            self.stride,
            self.padding,
            self.count_include_pad,
            self.ceil_mode,
        );
        if self.count_include_pad || TypeId::of::<X>() == TypeId::of::<Flex>() {
            return out;
        }
        // Windows of padding alone average nothing: 0, as on Flex, not CubeCL's 0 / 0.
        let out_shape = out.shape();
        let mut out = out;
        for i in 0..2 {
            let first = self.first_padding_window(i, shape[2 + i]);
            if first >= out_shape[2 + i] {
                continue;
            }
            let mut dims = out_shape.clone();
            dims[2 + i] = out_shape[2 + i] - first;
            let zeros = X::float_zeros(dims, &X::float_device(&out), out.dtype().into());
            let mut slices: Vec<Slice> = (0..4)
                .map(|d| Slice::new(0, Some(out_shape[d] as isize), 1))
                .collect();
            slices[2 + i] = Slice::new(first as isize, Some(out_shape[2 + i] as isize), 1);
            out = X::float_slice_assign(out, &slices, zeros);
        }
        out
    }

    /// The first output along axis `i` whose window starts past the input (in the right
    /// padding alone): Burn's `ceil_mode` makes such windows, PyTorch's does not.
    fn first_padding_window(&self, i: usize, size: usize) -> usize {
        // Window `o` starts at `o · stride − padding`; past the input from `o ≥ (size +
        // padding) / stride`, rounded up.
        (size + self.padding[i]).div_ceil(self.stride[i])
    }
}

/// `B`'s `avg_pool2d`; under autodiff on wgpu and CUDA, a node with the backward of the
/// module docs.
pub(crate) fn avg_pool2d<B: Backend>(
    x: FloatTensor<B>,
    kernel_size: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    count_include_pad: bool,
    ceil_mode: bool,
) -> FloatTensor<B> {
    struct Call<P> {
        x: P,
        pool: AvgPool,
    }
    impl<P: 'static> Visit for Call<P> {
        type Out = Result<P, Self>;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> Result<P, Self> {
            if TypeId::of::<X>() == TypeId::of::<Flex>() {
                return Err(self);
            }
            Ok(moved(node::<X, C>(moved(self.x), self.pool)))
        }
    }
    let pool = AvgPool::new(kernel_size, stride, padding, count_include_pad, ceil_mode);
    match dispatch::<B, _>(Call { x, pool }) {
        Ok(Ok(out)) => out,
        Ok(Err(call)) | Err(call) => call.pool.forward::<B>(call.x),
    }
}

/// `B`'s `avg_pool1d`, as Burn builds it (a pool of `[n, c, length, 1]`), through
/// [`avg_pool2d`]: the 1d pool shares its `ceil_mode` windows of padding alone.
pub(crate) fn avg_pool1d<B: Backend>(
    x: FloatTensor<B>,
    kernel_size: usize,
    stride: usize,
    padding: usize,
    count_include_pad: bool,
    ceil_mode: bool,
) -> FloatTensor<B> {
    let shape = x.shape();
    let (n, c, length) = (shape[0], shape[1], shape[2]);
    let x = B::float_reshape(x, Shape::from(vec![n, c, length, 1]));
    // Through the empty-batch check too.
    let out = super::avg_pool2d::<B>(
        x,
        [kernel_size, 1],
        [stride, 1],
        [padding, 0],
        count_include_pad,
        ceil_mode,
    );
    let out_length = out.shape()[2];
    B::float_reshape(out, Shape::from(vec![n, c, out_length]))
}

/// `B`'s `avg_pool2d_backward`, as the module docs say (Flex's as it is: it is right).
pub(crate) fn avg_pool2d_backward<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
    kernel_size: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    count_include_pad: bool,
    ceil_mode: bool,
) -> FloatTensor<B> {
    let pool = AvgPool::new(kernel_size, stride, padding, count_include_pad, ceil_mode);
    if TypeId::of::<B>() == TypeId::of::<Flex>() {
        return pool.backward::<B>(x, grad);
    }
    let (shape, dtype) = (x.shape(), x.dtype());
    pool.gradient::<B>(Some(x), &shape, dtype, grad)
}

fn node<X: Backend, C: CheckpointStrategy>(
    x: AutodiffTensor<X>,
    pool: AvgPool,
) -> AutodiffTensor<X> {
    match AvgPoolBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let (shape, dtype) = (x.primitive.shape(), x.primitive.dtype());
            // A 1×1 output's gradient needs the input's shape only.
            let input = (!pool.is_global(&shape)).then(|| prep.checkpoint(&x));
            let out = pool.forward::<X>(x.primitive);
            prep.finish((input, shape, dtype, pool), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(pool.forward::<X>(x.primitive)),
    }
}

#[derive(Debug)]
struct AvgPoolBackward;

impl<X: Backend> Backward<X, 1> for AvgPoolBackward {
    type State = (Option<NodeId>, Shape, burn_std::DType, AvgPool);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (input, shape, dtype, pool) = ops.state;
        let x: Option<FloatTensor<X>> = input.map(|id| checkpointer.retrieve_node_output(id));
        unary::<X, _>(ops.parents, ops.node, grads, |g| {
            pool.gradient::<X>(x, &shape, dtype, g)
        });
    }
}

/// The gradient of a pool with a 1×1 output, for an input of `shape` and `dtype`: `g`
/// (`[n, c, 1, 1]`) times `1 / divisor` over the window's positions, 0 elsewhere.
fn global_backward<X: Backend>(
    pool: &AvgPool,
    shape: &Shape,
    dtype: burn_std::DType,
    device: &X::Device,
    g: FloatTensor<X>,
) -> FloatTensor<X> {
    let (n, c, h, w) = (shape[0], shape[1], shape[2], shape[3]);
    let (rows, cols) = (pool.window(0, h), pool.window(1, w));
    let (rh, rw) = (rows.1 - rows.0, cols.1 - cols.0);
    let zeros = X::float_zeros(Shape::from(vec![n, c, h, w]), device, dtype.into());
    if rh == 0 || rw == 0 {
        // A window of padding alone: the output is constant.
        return zeros;
    }
    // The forward on ones averages the window's `rh · rw` valid ones: `rh · rw / divisor`.
    let ones = X::float_ones(Shape::from(vec![1, 1, h, w]), device, dtype.into());
    let valid = burn_backend::Scalar::Float((rh * rw) as f64);
    let weight = X::float_div_scalar(pool.forward::<X>(ones), valid);
    let g = X::float_cast(g, dtype.into());
    let region = X::float_expand(X::float_mul(g, weight), Shape::from(vec![n, c, rh, rw]));
    let slices = [
        Slice::new(0, Some(n as isize), 1),
        Slice::new(0, Some(c as isize), 1),
        Slice::new(rows.0 as isize, Some(rows.1 as isize), 1),
        Slice::new(cols.0 as isize, Some(cols.1 as isize), 1),
    ];
    X::float_slice_assign(zeros, &slices, region)
}
