//! The backward of `interpolate` where Burn 0.21 has none. burn-cubecl (wgpu, CUDA) has it for
//! nearest only: for bilinear, bicubic and lanczos3 it panics ("bilinear interpolation
//! backward is not supported by JIT backend"), so a model that upsamples that way (a U-Net, a
//! segmentation or super-resolution head) cannot train there. Flex has no lanczos3 backward
//! ("unsupported mode Lanczos3").
//!
//! Each of these modes is linear in the input and separable: per plane, `out = A · x · Bᵀ`
//! with `A` (`out_h × h`) and `B` (`out_w × w`) the weights along each axis (lanczos3
//! normalizes by the product of the two axes' sums, which is still a product). The backward
//! is then `Aᵀ · g · B`, two matmuls. `A` and `B` come from the backend's own forward applied
//! to unit vectors (a batch of `h` one-hot columns of width 1, interpolated to `out_h × 1`; a
//! 1 → 1 axis maps to itself in every mode and either `align_corners`), so they hold the very
//! weights the forward used. The node keeps no tensor: the backward needs the input's shape
//! only. Where Burn has the backward (nearest; bilinear and bicubic on Flex), Burn's node.
//! Below autodiff (`Autodiff<Amp<B>>`) `interpolate_backward` is the same separable backward
//! where `B` has none.

use core::any::TypeId;

use burn::backend::Flex;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn_backend::ops::{InterpolateMode, InterpolateOptions};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorData, TensorMetadata};
use burn_std::{DType, Shape};

use crate::backend::concrete::{AutodiffTensor, Visit, dispatch, moved};

/// `B`'s `interpolate`; under autodiff where Burn has no backward for the mode, a node with
/// the separable backward.
pub(crate) fn interpolate<B: Backend>(
    x: FloatTensor<B>,
    output_size: [usize; 2],
    options: InterpolateOptions,
) -> FloatTensor<B> {
    struct Call<P> {
        x: P,
        output_size: [usize; 2],
        options: InterpolateOptions,
    }
    impl<P: 'static> Visit for Call<P> {
        type Out = Result<P, Self>;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> Result<P, Self> {
            let flex = TypeId::of::<X>() == TypeId::of::<Flex>();
            if flex && !matches!(self.options.mode, InterpolateMode::Lanczos3) {
                return Err(self);
            }
            Ok(moved(node::<X, C>(
                moved(self.x),
                self.output_size,
                self.options,
            )))
        }
    }
    if matches!(options.mode, InterpolateMode::Nearest) {
        return B::interpolate(x, output_size, options);
    }
    let call = Call {
        x,
        output_size,
        options,
    };
    match dispatch::<B, _>(call) {
        Ok(Ok(out)) => out,
        Ok(Err(call)) | Err(call) => B::interpolate(call.x, call.output_size, call.options),
    }
}

/// `B`'s `interpolate_backward` (below autodiff: `Autodiff<Amp<B>>`), the separable backward
/// where `B` has none.
pub(crate) fn interpolate_backward<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
    output_size: [usize; 2],
    options: InterpolateOptions,
) -> FloatTensor<B> {
    let has_one = match options.mode {
        InterpolateMode::Nearest => true,
        InterpolateMode::Lanczos3 => false,
        _ => super::on_flex::<B>(),
    };
    if has_one {
        return B::interpolate_backward(x, grad, output_size, options);
    }
    let shape = x.shape();
    if shape.num_elements() == 0 || grad.shape().num_elements() == 0 {
        // No plane, or planes of no pixel: nothing flows back (no matmul of nothing).
        return B::float_zeros(shape, &B::float_device(&grad), grad.dtype().into());
    }
    separable_backward::<B>(grad, &shape, &options)
}

fn node<X: Backend, C: CheckpointStrategy>(
    x: AutodiffTensor<X>,
    output_size: [usize; 2],
    options: InterpolateOptions,
) -> AutodiffTensor<X> {
    match InterpolateBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let shape = x.primitive.shape();
            let out = X::interpolate(x.primitive, output_size, options.clone());
            prep.finish((shape, options), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(X::interpolate(x.primitive, output_size, options)),
    }
}

#[derive(Debug)]
struct InterpolateBackward;

impl<X: Backend> Backward<X, 1> for InterpolateBackward {
    type State = (Shape, InterpolateOptions);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (shape, options) = ops.state;
        unary::<X, _>(ops.parents, ops.node, grads, |g| {
            separable_backward::<X>(g, &shape, &options)
        });
    }
}

/// `Aᵀ · g · B` per plane of `g` (`[n, c, out_h, out_w]`), for an input of `shape`.
fn separable_backward<X: Backend>(
    g: FloatTensor<X>,
    shape: &Shape,
    options: &InterpolateOptions,
) -> FloatTensor<X> {
    let (n, c, h, w) = (shape[0], shape[1], shape[2], shape[3]);
    let g_shape = g.shape();
    let (out_h, out_w) = (g_shape[2], g_shape[3]);
    // Along the width: `[n·c·out_h, out_w] · B`, B = (Bᵀ)ᵀ.
    let b = X::float_transpose(axis_weights::<X>(&g, w, out_w, Axis::Width, options));
    let g = X::float_reshape(g, Shape::from(vec![n * c * out_h, out_w]));
    let g = X::float_matmul(g, b); // [n·c·out_h, w]
    // Along the height: `[n·c·w, out_h] · A`, with the planes' rows and columns swapped.
    let a = X::float_transpose(axis_weights::<X>(&g, h, out_h, Axis::Height, options));
    let g = X::float_reshape(g, Shape::from(vec![n * c, out_h, w]));
    let g = X::float_swap_dims(g, 1, 2);
    let g = X::float_reshape(g, Shape::from(vec![n * c * w, out_h]));
    let g = X::float_matmul(g, a); // [n·c·w, h]
    let g = X::float_reshape(g, Shape::from(vec![n * c, w, h]));
    let g = X::float_swap_dims(g, 1, 2);
    X::float_reshape(g, Shape::from(vec![n, c, h, w]))
}

#[derive(Debug, Clone, Copy)]
enum Axis {
    Height,
    Width,
}

/// The transposed weights of one axis, `[size, out]`: row `i` is what input position `i`
/// contributes to each output position, from the backend's forward on unit vectors.
fn axis_weights<X: Backend>(
    like: &FloatTensor<X>,
    size: usize,
    out: usize,
    axis: Axis,
    options: &InterpolateOptions,
) -> FloatTensor<X> {
    let mut eye = vec![0f32; size * size];
    for i in 0..size {
        eye[i * size + i] = 1.0;
    }
    let (unit_shape, out_size) = match axis {
        Axis::Height => ([size, 1, size, 1], [out, 1]),
        Axis::Width => ([size, 1, 1, size], [1, out]),
    };
    let device = X::float_device(like);
    let mut units = X::float_from_data(TensorData::new(eye, unit_shape), &device);
    let dtype = like.dtype();
    if dtype != DType::F32 {
        units = X::float_cast(units, dtype.into());
    }
    let weights = X::interpolate(units, out_size, options.clone());
    X::float_reshape(weights, Shape::from(vec![size, out]))
}
