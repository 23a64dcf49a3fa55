//! `deform_conv2d`'s offset and mask gradients on CubeCL (wgpu, CUDA), composed from its
//! forward.
//!
//! burn-cubecl 0.21's `deform_col2img_coord_kernel` reads, for every kernel tap, the column
//! of tap (0, 0): its `col_pos` adds the channel's row but not the tap's. A deformable
//! convolution's offset and mask gradients are wrong for any kernel larger than 1×1 (relative
//! L2 error 1.2 against Flex's on a 3×3 kernel, in plain Burn; its input, weight and bias
//! gradients and its forward are right). Flex's are right (checked against central
//! differences in `gradient_check`).
//!
//! Here, from the same columns (`weightᵀ · grad`, per weight group) and the forward's own
//! bilinear sampling: the convolution's im2col is `deform_conv2d` with a one-hot depthwise
//! weight (one output channel per input channel and tap), and bilinear sampling is linear in
//! each coordinate within a cell, so its derivative along `y` is the sample at `⌊y⌋ + 1`
//! minus the sample at `⌊y⌋` (the tap's base position is an integer: flooring the offset
//! floors the coordinate). With zero padding outside the image, as the forward's.
//!
//! - mask gradient: `Σ_c columns · samples`, over the channels of each offset group;
//! - offset gradient: `mask · Σ_c columns · (samples at ⌊y⌋ + 1 − samples at ⌊y⌋)`, and the
//!   same along `x`.
//!
//! Cost: five one-hot forwards (each `C·K²` multiply-adds per output position, K taps) and
//! the columns' matmul, the kernel's order of work; memory: two `[batch, C·K, positions]`
//! tensors at a time, the kernel's columns.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::ops::{DeformConv2dBackward, DeformConvOptions};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Scalar, TensorData, TensorMetadata};
use burn_std::{Shape, Slice};

use super::on_flex;
use crate::backend::concrete::{AutodiffTensor, Visit, dispatch, moved};

/// Whether `B`'s `deform_conv2d_backward` computes the offset and mask gradients wrong
/// (every backend but Flex: the CubeCL ones).
fn composed<B: Backend>() -> bool {
    !on_flex::<B>()
}

/// `B::deform_conv2d_backward`, its offset and mask gradients composed where `B`'s are wrong.
pub(crate) fn deform_conv2d_backward<B: Backend>(
    x: FloatTensor<B>,
    offset: FloatTensor<B>,
    weight: FloatTensor<B>,
    mask: Option<FloatTensor<B>>,
    bias: Option<FloatTensor<B>>,
    grad: FloatTensor<B>,
    options: DeformConvOptions<2>,
) -> DeformConv2dBackward<B> {
    let grads = B::deform_conv2d_backward(
        x.clone(),
        offset.clone(),
        weight.clone(),
        mask.clone(),
        bias,
        grad.clone(),
        options.clone(),
    );
    if !composed::<B>() {
        return grads;
    }
    let (offset_grad, mask_grad) =
        offset_and_mask_gradients::<B>(x, offset, weight, mask, grad, &options);
    DeformConv2dBackward::new(
        grads.x_grad,
        offset_grad,
        grads.weight_grad,
        mask_grad,
        grads.bias_grad,
    )
}

/// The offset gradient, and the mask's where there is a mask (module docs).
fn offset_and_mask_gradients<B: Backend>(
    x: FloatTensor<B>,
    offset: FloatTensor<B>,
    weight: FloatTensor<B>,
    mask: Option<FloatTensor<B>>,
    grad: FloatTensor<B>,
    options: &DeformConvOptions<2>,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let [batch, channels, _, _] = x.shape().dims::<4>();
    let [_, _, kh, kw] = weight.shape().dims::<4>();
    let [_, _, out_h, out_w] = offset.shape().dims::<4>();
    let (taps, positions) = (kh * kw, out_h * out_w);
    let groups = options.offset_groups;
    let columns = columns::<B>(weight, grad, options.weight_groups, [channels, taps]);

    // Σ over each offset group's channels of `columns · samples`: [batch, groups·taps, h, w].
    let per_group = |samples: FloatTensor<B>| {
        let products = B::float_mul(columns.clone(), samples);
        let shape = [batch, groups, channels / groups, taps, positions];
        let sums = B::float_sum_dim(B::float_reshape(products, Shape::from(shape)), 2);
        B::float_reshape(sums, Shape::from([batch, groups * taps, out_h, out_w]))
    };
    let sampler = Sampler::<B>::new(x, [kh, kw], options);
    let sampled = |offset: FloatTensor<B>| sampler.samples(offset, [channels, taps, positions]);

    // The offsets as [batch, groups·taps, 2 (y, x), h, w].
    let split = Shape::from([batch, groups * taps, 2, out_h, out_w]);
    let offset = B::float_reshape(offset, split.clone());
    let direction = |d: usize| {
        let mut s: Vec<Slice> = split.iter().map(|&n| Slice::from(0..n)).collect();
        s[2] = Slice::from(d..d + 1);
        s
    };
    let along = |d: usize| {
        // The samples at the floor of the coordinate along `d`, and one past it.
        let floor = B::float_floor(B::float_slice(offset.clone(), &direction(d)));
        let ceil = B::float_add_scalar(floor.clone(), Scalar::Float(1.0));
        let with = |v: FloatTensor<B>| {
            let moved = B::float_slice_assign(offset.clone(), &direction(d), v);
            B::float_reshape(moved, Shape::from([batch, groups * taps * 2, out_h, out_w]))
        };
        let slope = B::float_sub(sampled(with(ceil)), sampled(with(floor)));
        let g = per_group(slope);
        match &mask {
            Some(m) => B::float_mul(g, m.clone()),
            None => g,
        }
    };
    let (dy, dx) = (along(0), along(1));
    let one = Shape::from([batch, groups * taps, 1, out_h, out_w]);
    let offset_grad = B::float_cat(
        vec![B::float_reshape(dy, one.clone()), B::float_reshape(dx, one)],
        2,
    );
    let offset_grad = B::float_reshape(
        offset_grad,
        Shape::from([batch, groups * taps * 2, out_h, out_w]),
    );
    let mask_grad = mask.map(|_| {
        let whole = B::float_reshape(
            offset,
            Shape::from([batch, groups * taps * 2, out_h, out_w]),
        );
        per_group(sampled(whole))
    });
    (offset_grad, mask_grad)
}

/// `weightᵀ · grad` per weight group: `[batch, channels, taps, positions]`, the gradient of
/// the loss with respect to each sampled (and masked) value.
fn columns<B: Backend>(
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    weight_groups: usize,
    [channels, taps]: [usize; 2],
) -> FloatTensor<B> {
    let [batch, out_channels, out_h, out_w] = grad.shape().dims::<4>();
    let per_group = out_channels / weight_groups;
    let rows = channels / weight_groups * taps;
    let weight = B::float_reshape(weight, Shape::from([1, weight_groups, per_group, rows]));
    let grad = B::float_reshape(
        grad,
        Shape::from([batch, weight_groups, per_group, out_h * out_w]),
    );
    let columns = B::float_matmul(B::float_swap_dims(weight, 2, 3), grad);
    B::float_reshape(columns, Shape::from([batch, channels, taps, out_h * out_w]))
}

/// The convolution's bilinear samples of `x` at given offsets, through `B`'s own forward.
struct Sampler<B: Backend> {
    x: FloatTensor<B>,
    /// `[channels · taps, 1, kh, kw]`: output channel `c · taps + t` picks input channel `c`
    /// at tap `t`.
    one_hot: FloatTensor<B>,
    options: DeformConvOptions<2>,
}

impl<B: Backend> Sampler<B> {
    fn new(x: FloatTensor<B>, [kh, kw]: [usize; 2], options: &DeformConvOptions<2>) -> Self {
        let channels = x.shape()[1];
        let taps = kh * kw;
        let mut values = vec![0f32; channels * taps * taps];
        for row in 0..channels * taps {
            values[row * taps + row % taps] = 1.0;
        }
        let data = TensorData::new(values, [channels * taps, 1, kh, kw]);
        let one_hot = B::float_from_data(data, &B::float_device(&x));
        let one_hot = B::float_cast(one_hot, x.dtype().into());
        let options = DeformConvOptions::new(
            options.stride,
            options.padding,
            options.dilation,
            channels,
            options.offset_groups,
        );
        Sampler {
            x,
            one_hot,
            options,
        }
    }

    /// `[batch, channels, taps, positions]`: each channel sampled at each tap's position,
    /// unmasked.
    fn samples(
        &self,
        offset: FloatTensor<B>,
        [channels, taps, positions]: [usize; 3],
    ) -> FloatTensor<B> {
        let batch = offset.shape()[0];
        let out = B::deform_conv2d(
            self.x.clone(),
            offset,
            self.one_hot.clone(),
            None,
            None,
            self.options.clone(),
        );
        B::float_reshape(out, Shape::from([batch, channels, taps, positions]))
    }
}

/// `B::deform_conv2d`; above a listed autodiff backend whose backward is wrong, a node of
/// `Amp`'s own whose backward is [`deform_conv2d_backward`]'s.
pub(crate) fn deform_conv2d<B: Backend>(
    x: FloatTensor<B>,
    offset: FloatTensor<B>,
    weight: FloatTensor<B>,
    mask: Option<FloatTensor<B>>,
    bias: Option<FloatTensor<B>>,
    options: DeformConvOptions<2>,
) -> FloatTensor<B> {
    struct Build<P> {
        inputs: [P; 3],
        mask: Option<P>,
        bias: Option<P>,
        options: DeformConvOptions<2>,
    }
    impl<P: 'static> Visit for Build<P> {
        type Out = Result<P, Self>;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> Self::Out {
            if !composed::<X>() {
                return Err(self);
            }
            let Build {
                inputs,
                mask,
                bias,
                options,
            } = self;
            let [x, offset, weight] = inputs.map(moved::<P, AutodiffTensor<X>>);
            let (mask, bias) = (mask.map(moved), bias.map(moved));
            let roles = [true, true, true, mask.is_some(), bias.is_some()];
            let mut parents = vec![x, offset, weight];
            parents.extend(mask);
            parents.extend(bias);
            let out = match parents.len() {
                3 => node::<X, C, 3>(parents, roles, options),
                4 => node::<X, C, 4>(parents, roles, options),
                _ => node::<X, C, 5>(parents, roles, options),
            };
            Ok(moved(out))
        }
    }
    let build = Build {
        inputs: [x, offset, weight],
        mask,
        bias,
        options,
    };
    let build = match dispatch::<B, _>(build) {
        Ok(Ok(out)) => return out,
        Ok(Err(build)) | Err(build) => build,
    };
    let [x, offset, weight] = build.inputs;
    B::deform_conv2d(x, offset, weight, build.mask, build.bias, build.options)
}

/// The checkpointed inputs (`x`, offset, weight, mask, bias; `None` where absent) and the
/// options.
#[derive(Clone, Debug)]
struct State {
    inputs: [Option<NodeId>; 5],
    options: DeformConvOptions<2>,
}

/// Burn's node, as burn-autodiff builds it (compute-bound, every input checkpointed), with
/// `N` parents: `x`, offset and weight, then the mask and the bias present in `roles`.
fn node<X: Backend, C: CheckpointStrategy, const N: usize>(
    parents: Vec<AutodiffTensor<X>>,
    roles: [bool; 5],
    options: DeformConvOptions<2>,
) -> AutodiffTensor<X> {
    let nodes: [_; N] = core::array::from_fn(|i| parents[i].node.clone());
    let prepared = DeformConvBackward { roles }
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful();
    let forward = || {
        let mut p = parents.iter().map(|t| t.primitive.clone());
        let [x, offset, weight] = core::array::from_fn(|_| p.next().expect("three inputs"));
        let mask = roles[3].then(|| p.next().expect("a mask"));
        let bias = roles[4].then(|| p.next().expect("a bias"));
        X::deform_conv2d(x, offset, weight, mask, bias, options.clone())
    };
    // The inputs' handles live until the node is registered (see `half_sums`' node).
    let out = match prepared {
        OpsKind::Tracked(mut prep) => {
            let mut inputs = [None; 5];
            let mut p = parents.iter();
            for (slot, present) in inputs.iter_mut().zip(roles) {
                if present {
                    *slot = Some(prep.checkpoint(p.next().expect("a parent per role")));
                }
            }
            let out = forward();
            prep.finish(
                State {
                    inputs,
                    options: options.clone(),
                },
                out,
            )
        }
        OpsKind::UnTracked(prep) => prep.finish(forward()),
    };
    drop(parents);
    out
}

#[derive(Debug)]
struct DeformConvBackward {
    roles: [bool; 5],
}

impl<X: Backend, const N: usize> Backward<X, N> for DeformConvBackward {
    type State = State;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let State { inputs, options } = ops.state;
        let [x, offset, weight, mask, bias] =
            inputs.map(|id| id.map(|id| checkpointer.retrieve_node_output::<FloatTensor<X>>(id)));
        let grad = grads.consume::<X>(&ops.node);
        let (x, offset, weight) = (
            x.expect("x is checkpointed"),
            offset.expect("the offset is checkpointed"),
            weight.expect("the weight is checkpointed"),
        );
        let g = deform_conv2d_backward::<X>(x, offset, weight, mask, bias, grad, options);
        let gradients = [
            Some(g.x_grad),
            Some(g.offset_grad),
            Some(g.weight_grad),
            g.mask_grad,
            g.bias_grad,
        ];
        let mut parents = ops.parents.into_iter();
        for (present, gradient) in self.roles.into_iter().zip(gradients) {
            if !present {
                continue;
            }
            if let (Some(Some(parent)), Some(gradient)) = (parents.next(), gradient) {
                grads.register::<X>(parent.id, gradient);
            }
        }
    }
}
