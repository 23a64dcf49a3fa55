//! `deform_conv2d`'s offset and mask gradients on CubeCL (wgpu, CUDA), composed from the
//! pixels each tap samples.
//!
//! burn-cubecl 0.21's `deform_col2img_coord_kernel` reads, for every kernel tap, the column
//! of tap (0, 0): its `col_pos` adds the channel's row but not the tap's. A deformable
//! convolution's offset and mask gradients are wrong for any kernel larger than 1×1 (relative
//! L2 error 1.2 against Flex's on a 3×3 kernel, in plain Burn; its input, weight and bias
//! gradients and its forward are right). Flex's are right (checked against central
//! differences in `gradient_check`).
//!
//! Here, from the same columns (`weightᵀ · grad`, per weight group, the gradient of each
//! sampled value) and the four pixels around each tap's sampling position, gathered (0 off
//! the image, as the forward's bilinear sampling): bilinear sampling is linear in each
//! coordinate within a cell, so its derivative along `y` is the row below minus the row
//! above, each interpolated along `x` (and along `x` alike).
//!
//! - mask gradient: `Σ_c columns · sample`, over the channels of each offset group;
//! - offset gradient: `mask · Σ_c columns · ∂sample/∂y`, and the same along `x`.
//!
//! The sampling weights (the fractions, whether a pixel is on the image) are the same for
//! every channel of an offset group, so each corner's pixels are summed against the columns
//! first (`S = Σ_c columns · pixel`) and the sample and its derivatives are interpolated
//! from the four `S` after, on a channel's worth of values.
//!
//! Cost, besides Burn's backward (which still computes the wrong two): four gathers of
//! `batch · C` values per tap and output position, with a multiply and a sum each, and the
//! columns' matmul; a step of a 3×3 deformable convolution with a mask (32 channels,
//! 8×32×32, wgpu) takes 1.43 times plain Burn's (`cargo bench --bench autocast`; 1.69
//! interpolating every channel before the sums, 1.59 gathering the four corners at once).
//! Memory: the four corners' pixels and the columns, `[batch, C·K, positions]` each (taking
//! the corners one at a time, each summed before the next is gathered, was slower on wgpu:
//! 1.55).

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::ops::{DeformConv2dBackward, DeformConvOptions};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Scalar, TensorData, TensorMetadata, get_device_settings};
use burn_std::{Shape, Slice};

use super::on_flex;
use crate::backend::concrete::{AutodiffTensor, Visit, dispatch, moved};

/// Whether `B`'s `deform_conv2d_backward` computes the offset and mask gradients wrong:
/// every backend but Flex, the CubeCL ones (a backend this crate does not know gets the
/// composition too: right, if slower than its own).
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
    let (taps, groups) = (kh * kw, options.offset_groups);
    let columns = columns::<B>(weight, grad, options.weight_groups, [channels, taps]);
    let columns = B::float_reshape(
        columns,
        Shape::from([batch, groups, channels / groups, taps * out_h * out_w]),
    );
    let taps_of = Taps::<B>::new(x, offset, [kh, kw], options);
    // Each corner's `S = Σ_c columns · pixel` (module docs), 0 off the image:
    // `[batch, groups, 1, taps · positions]`.
    let [s00, s01, s10, s11] = taps_of.corners.map(|(corner, inside)| {
        let sum = B::float_sum_dim(B::float_mul(columns.clone(), corner), 2);
        B::float_mul(sum, inside)
    });
    let [fy, fx] = &taps_of.fractions;
    let lerp = |a: &FloatTensor<B>, b: &FloatTensor<B>, t: &FloatTensor<B>| {
        B::float_add(
            a.clone(),
            B::float_mul(B::float_sub(b.clone(), a.clone()), t.clone()),
        )
    };
    let (top, bottom) = (lerp(&s00, &s01, fx), lerp(&s10, &s11, fx));
    // The bilinear sample's derivative along `y`: the row below minus the row above, each
    // interpolated in `x`; along `x` alike.
    let dy = B::float_sub(bottom.clone(), top.clone());
    let dx = B::float_sub(lerp(&s01, &s11, fy), lerp(&s00, &s10, fy));
    let per_tap = Shape::from([batch, groups * taps, out_h, out_w]);
    let masked = |g: FloatTensor<B>| {
        let g = B::float_reshape(g, per_tap.clone());
        match &mask {
            Some(m) => B::float_mul(g, m.clone()),
            None => g,
        }
    };
    let one = Shape::from([batch, groups * taps, 1, out_h, out_w]);
    let offset_grad = B::float_cat(
        vec![
            B::float_reshape(masked(dy), one.clone()),
            B::float_reshape(masked(dx), one),
        ],
        2,
    );
    let offset_grad = B::float_reshape(
        offset_grad,
        Shape::from([batch, groups * taps * 2, out_h, out_w]),
    );
    // The mask's: the bilinear sample itself.
    let mask_grad = mask
        .is_some()
        .then(|| B::float_reshape(lerp(&top, &bottom, fy), per_tap.clone()));
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

/// Each tap's sampling position, as the forward computes it (`o · stride − padding + k ·
/// dilation + offset`), between four pixels: the pixels' values, whether each is on the
/// image (the forward's bilinear sampling weighs a pixel off it 0), and the fractions of the
/// position past the first.
struct Taps<B: Backend> {
    /// At `(⌊y⌋, ⌊x⌋)`, `(⌊y⌋, ⌊x⌋ + 1)`, `(⌊y⌋ + 1, ⌊x⌋)`, `(⌊y⌋ + 1, ⌊x⌋ + 1)`: the
    /// values, `[batch, groups, channels / groups, taps · positions]` (a pixel off the image
    /// reads the nearest on it), and 1 where the pixel is on the image, else 0,
    /// `[batch, groups, 1, taps · positions]`.
    corners: [(FloatTensor<B>, FloatTensor<B>); 4],
    /// `y − ⌊y⌋` and `x − ⌊x⌋`: `[batch, groups, 1, taps · positions]`.
    fractions: [FloatTensor<B>; 2],
}

impl<B: Backend> Taps<B> {
    fn new(
        x: FloatTensor<B>,
        offset: FloatTensor<B>,
        [kh, kw]: [usize; 2],
        options: &DeformConvOptions<2>,
    ) -> Self {
        let [batch, channels, h, w] = x.shape().dims::<4>();
        let [_, _, out_h, out_w] = offset.shape().dims::<4>();
        let (taps, groups) = (kh * kw, options.offset_groups);
        let points = taps * out_h * out_w;
        let device = B::float_device(&x);
        // The taps' positions without offsets, `[1, 1, 1, taps · positions]`, y then x.
        let base = |dim: usize| {
            let mut v = Vec::with_capacity(points);
            for t in 0..taps {
                for oy in 0..out_h {
                    for ox in 0..out_w {
                        let (o, k) = if dim == 0 { (oy, t / kw) } else { (ox, t % kw) };
                        let p = o * options.stride[dim] + k * options.dilation[dim];
                        v.push(p as f32 - options.padding[dim] as f32);
                    }
                }
            }
            let t = B::float_from_data(TensorData::new(v, [1, 1, 1, points]), &device);
            B::float_cast(t, x.dtype().into())
        };
        // The offsets as [batch, groups, taps, 2 (y, x), positions].
        let split = Shape::from([batch, groups, taps, 2, out_h * out_w]);
        let offset = B::float_reshape(offset, split.clone());
        let position = |dim: usize| {
            let mut s: Vec<Slice> = split.iter().map(|&n| Slice::from(0..n)).collect();
            s[3] = Slice::from(dim..dim + 1);
            let d = B::float_reshape(
                B::float_slice(offset.clone(), &s),
                Shape::from([batch, groups, 1, points]),
            );
            B::float_add(d, base(dim))
        };
        let (y, x_pos) = (position(0), position(1));
        let (y0, x0) = (B::float_floor(y.clone()), B::float_floor(x_pos.clone()));
        let fractions = [B::float_sub(y, y0.clone()), B::float_sub(x_pos, x0.clone())];
        let settings = get_device_settings::<B>(&device);
        let planes = B::float_reshape(x, Shape::from([batch, channels, h * w]));
        let corner = |dy: f64, dx: f64| {
            let yc = B::float_add_scalar(y0.clone(), Scalar::Float(dy));
            let xc = B::float_add_scalar(x0.clone(), Scalar::Float(dx));
            let inside = |c: &FloatTensor<B>, size: usize| {
                let low =
                    B::float_greater_equal_elem(c.clone(), Scalar::Float(0.0), settings.bool_dtype);
                let high =
                    B::float_lower_elem(c.clone(), Scalar::Float(size as f64), settings.bool_dtype);
                B::bool_and(low, high)
            };
            let inside = B::bool_and(inside(&yc, h), inside(&xc, w));
            // Whole numbers, clamped onto the image (the value is weighed 0 off it).
            let clamp = |c: FloatTensor<B>, size: usize| {
                let c = B::float_clamp(c, Scalar::Float(0.0), Scalar::Float(size as f64 - 1.0));
                B::float_into_int(c, settings.int_dtype)
            };
            let row = B::int_mul_scalar(clamp(yc, h), Scalar::Int(w as i64));
            let index = B::int_add(row, clamp(xc, w));
            let index = B::int_reshape(
                B::int_expand(
                    index,
                    Shape::from([batch, groups, channels / groups, points]),
                ),
                Shape::from([batch, channels, points]),
            );
            let values = super::float_gather::<B>(2, planes.clone(), index);
            let values = B::float_reshape(
                values,
                Shape::from([batch, groups, channels / groups, points]),
            );
            (values, B::bool_into_float(inside, planes.dtype().into()))
        };
        Taps {
            corners: [
                corner(0.0, 0.0),
                corner(0.0, 1.0),
                corner(1.0, 0.0),
                corner(1.0, 1.0),
            ],
            fractions,
        }
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
            let with = [mask.is_some(), bias.is_some()];
            let mut parents = vec![x, offset, weight];
            parents.extend(mask);
            parents.extend(bias);
            let out = match parents.len() {
                3 => node::<X, C, 3>(parents, with, options),
                4 => node::<X, C, 4>(parents, with, options),
                _ => node::<X, C, 5>(parents, with, options),
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
/// `N` parents: `x`, offset and weight, then the mask and the bias where `with` says so.
fn node<X: Backend, C: CheckpointStrategy, const N: usize>(
    parents: Vec<AutodiffTensor<X>>,
    [with_mask, with_bias]: [bool; 2],
    options: DeformConvOptions<2>,
) -> AutodiffTensor<X> {
    let nodes: [_; N] = core::array::from_fn(|i| parents[i].node.clone());
    let prepared = DeformConvBackward
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful();
    let present = [true, true, true, with_mask, with_bias];
    // Each input's slot of the five: its parent, or `None` where absent.
    let slots = || {
        let mut p = parents.iter();
        present.map(|here| here.then(|| p.next().expect("a parent per present input")))
    };
    let forward = || {
        let [x, offset, weight, mask, bias] = slots().map(|t| t.map(|t| t.primitive.clone()));
        let (x, offset, weight) = (x.unwrap(), offset.unwrap(), weight.unwrap());
        X::deform_conv2d(x, offset, weight, mask, bias, options.clone())
    };
    // The inputs' handles live until the node is registered (see `half_sums`' node).
    let out = match prepared {
        OpsKind::Tracked(mut prep) => {
            let inputs = slots().map(|t| t.map(|t| prep.checkpoint(t)));
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
struct DeformConvBackward;

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
        // The parents come in the order of the inputs present (checkpointed).
        let mut parents = ops.parents.into_iter();
        for (id, gradient) in inputs.into_iter().zip(gradients) {
            if id.is_none() {
                continue;
            }
            if let (Some(Some(parent)), Some(gradient)) = (parents.next(), gradient) {
                grads.register::<X>(parent.id, gradient);
            }
        }
    }
}
