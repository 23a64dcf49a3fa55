//! The gradient of a global `avg_pool2d` on CubeCL. burn-cubecl 0.21's `avg_pool2d_backward`
//! reads the output gradient in channels-last order with a vector width taken from the
//! *input's* last dimension (the width, in NCHW), when the two have equal innermost strides:
//! true exactly when the output is 1×1 (a window over the whole map, as a CNN's head pools).
//! Then a width that is a multiple of 4 gives 4-wide reads over the channels: with `n · c`
//! not a multiple of 4 the gradient is wrong (48 of 320 values for `[1, 5, 8, 8]`), or wgpu
//! rejects the dispatch ("bound with size 8 where the shader expects 16", a panic) when
//! `n · c < 4`. Any output larger than 1×1 reads one value at a time, and is right.
//!
//! For a 1×1 output the gradient needs no kernel: each input position inside the window gets
//! the output's gradient times the same weight, `1 / divisor`, and the rest 0. The weight is
//! read off the backend's own forward on a map of ones (which averages `valid` ones: it is
//! `valid / divisor`), so padding, `count_include_pad` and `ceil_mode` mean what the backend
//! means by them. Under `Amp` above autodiff, such a pool is a node with this backward (on
//! wgpu and CUDA; Flex is right); below it, `Amp`'s `avg_pool2d_backward` computes it.

use core::any::TypeId;

use burn::backend::Flex;
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

    fn forward<X: Backend>(&self, x: FloatTensor<X>) -> FloatTensor<X> {
        X::avg_pool2d(
            x,
            self.kernel_size,
            self.stride,
            self.padding,
            self.count_include_pad,
            self.ceil_mode,
        )
    }
}

/// `B`'s `avg_pool2d`; under autodiff on wgpu and CUDA, a pool with a 1×1 output is a node
/// with the exact backward of the module docs.
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
    let pool = AvgPool {
        kernel_size,
        stride,
        padding,
        count_include_pad,
        ceil_mode,
    };
    if !pool.is_global(&x.shape()) {
        return pool.forward::<B>(x);
    }
    match dispatch::<B, _>(Call { x, pool }) {
        Ok(Ok(out)) => out,
        Ok(Err(call)) | Err(call) => call.pool.forward::<B>(call.x),
    }
}

/// `B`'s `avg_pool2d_backward`, but for a 1×1 output (not on Flex, which is right), the exact
/// gradient of the module docs.
pub(crate) fn avg_pool2d_backward<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
    kernel_size: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    count_include_pad: bool,
    ceil_mode: bool,
) -> FloatTensor<B> {
    let pool = AvgPool {
        kernel_size,
        stride,
        padding,
        count_include_pad,
        ceil_mode,
    };
    let flex = TypeId::of::<B>() == TypeId::of::<Flex>();
    if flex || !pool.is_global(&x.shape()) {
        return B::avg_pool2d_backward(
            x,
            grad,
            kernel_size,
            stride,
            padding,
            count_include_pad,
            ceil_mode,
        );
    }
    let device = B::float_device(&x);
    global_backward::<B>(&pool, &x.shape(), x.dtype(), &device, grad)
}

fn node<X: Backend, C: CheckpointStrategy>(
    x: AutodiffTensor<X>,
    pool: AvgPool,
) -> AutodiffTensor<X> {
    match GlobalAvgPoolBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = (x.primitive.shape(), x.primitive.dtype(), pool);
            let out = pool.forward::<X>(x.primitive);
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(pool.forward::<X>(x.primitive)),
    }
}

#[derive(Debug)]
struct GlobalAvgPoolBackward;

impl<X: Backend> Backward<X, 1> for GlobalAvgPoolBackward {
    type State = (Shape, burn_std::DType, AvgPool);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (shape, dtype, pool) = ops.state;
        unary::<X, _>(ops.parents, ops.node, grads, |g| {
            let device = X::float_device(&g);
            global_backward::<X>(&pool, &shape, dtype, &device, g)
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
