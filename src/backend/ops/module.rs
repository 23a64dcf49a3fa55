//! `ModuleOps` of `Amp<B>`: every op through the policy table.
//!
//! Written by macro from the trait's signatures (see `backend/macros.rs`), except the ops
//! whose results are structs generic over the backend, which are rebuilt by hand.

use burn_backend::Backend;
use burn_backend::ops::{
    AttentionModuleOptions, ConvOptions, ConvTransposeOptions, DeformConv2dBackward,
    DeformConvOptions, InterpolateOptions, MaxPool1dBackward, MaxPool1dWithIndices,
    MaxPool2dBackward, MaxPool2dWithIndices, ModuleOps, UnfoldOptions,
};
use burn_backend::tensor::{BoolTensor, FloatTensor, IntTensor};

use crate::backend::macros::{
    autocast_call, autocast_empty, autocast_input, autocast_ops, probe_dim,
};
use crate::backend::policy::{Autocast, Op};
use crate::backend::{Amp, attention};

impl<B: Backend> ModuleOps<Self> for Amp<B> {
    autocast_ops! {
        fn embedding(weights: FloatTensor<Self>, indices: IntTensor<Self>) -> FloatTensor<Self> => [t weights] via workarounds;
        fn embedding_backward(weights: FloatTensor<Self>, output_grad: FloatTensor<Self>, indices: IntTensor<Self>) -> FloatTensor<Self> => [t weights, t output_grad];
        fn linear(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>) -> FloatTensor<Self> => [t x, t weight, opt bias] via workarounds;
        fn linear_x_backward(weight: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self> => [t weight, t output_grad] via workarounds;
        fn linear_weight_backward(x: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self> => [t x, t output_grad] via workarounds;
        fn linear_bias_backward(output_grad: FloatTensor<Self>) -> FloatTensor<Self> => [t output_grad];
        fn conv1d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvOptions<1>) -> FloatTensor<Self> => [t x, t weight, opt bias] via workarounds;
        fn conv1d_x_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<1>) -> FloatTensor<Self> => [t x, t weight, t output_grad] via workarounds;
        fn conv1d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<1>) -> FloatTensor<Self> => [t x, t weight, t output_grad] via workarounds;
        fn conv1d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self> => [t x, t bias, t output_grad];
        fn conv2d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvOptions<2>) -> FloatTensor<Self> => [t x, t weight, opt bias] via workarounds;
        fn conv2d_x_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<2>) -> FloatTensor<Self> => [t x, t weight, t output_grad] via workarounds;
        fn conv2d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<2>) -> FloatTensor<Self> => [t x, t weight, t output_grad] via workarounds;
        fn conv2d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self> => [t x, t bias, t output_grad];
        fn deform_conv2d(x: FloatTensor<Self>, offset: FloatTensor<Self>, weight: FloatTensor<Self>, mask: Option<FloatTensor<Self>>, bias: Option<FloatTensor<Self>>, options: DeformConvOptions<2>) -> FloatTensor<Self> => [t x, t offset, t weight, opt mask, opt bias] via workarounds;
        fn conv3d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvOptions<3>) -> FloatTensor<Self> => [t x, t weight, opt bias] via workarounds;
        fn conv3d_x_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<3>) -> FloatTensor<Self> => [t x, t weight, t output_grad] via workarounds;
        fn conv3d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<3>) -> FloatTensor<Self> => [t x, t weight, t output_grad] via workarounds;
        fn conv3d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self> => [t x, t bias, t output_grad];
        fn conv_transpose1d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvTransposeOptions<1>) -> FloatTensor<Self> => [t x, t weight, opt bias] via workarounds;
        fn conv_transpose1d_x_backward(weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<1>) -> FloatTensor<Self> => [t weight, t output_grad] via workarounds;
        fn conv_transpose1d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<1>) -> FloatTensor<Self> => [t x, t weight, t output_grad] via workarounds;
        fn conv_transpose1d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self> => [t x, t bias, t output_grad];
        fn conv_transpose2d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvTransposeOptions<2>) -> FloatTensor<Self> => [t x, t weight, opt bias] via workarounds;
        fn conv_transpose2d_x_backward(weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<2>) -> FloatTensor<Self> => [t weight, t output_grad] via workarounds;
        fn conv_transpose2d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<2>) -> FloatTensor<Self> => [t x, t weight, t output_grad] via workarounds;
        fn conv_transpose2d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self> => [t x, t bias, t output_grad];
        fn conv_transpose3d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvTransposeOptions<3>) -> FloatTensor<Self> => [t x, t weight, opt bias] via workarounds;
        fn conv_transpose3d_x_backward(weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<3>) -> FloatTensor<Self> => [t weight, t output_grad] via workarounds;
        fn conv_transpose3d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<3>) -> FloatTensor<Self> => [t x, t weight, t output_grad] via workarounds;
        fn conv_transpose3d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self> => [t x, t bias, t output_grad];
        fn unfold4d(x: FloatTensor<Self>, kernel_size: [usize; 2], options: UnfoldOptions) -> FloatTensor<Self> => [t x];
        fn avg_pool1d(x: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self> => [t x] via workarounds;
        fn avg_pool1d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self> => [t x, t grad];
        fn avg_pool2d(x: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self> => [t x] via workarounds;
        fn avg_pool2d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self> => [t x, t grad] via workarounds;
        fn adaptive_avg_pool2d(x: FloatTensor<Self>, output_size: [usize; 2]) -> FloatTensor<Self> => [t x] via workarounds;
        fn adaptive_avg_pool2d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> => [t x, t grad];
        fn adaptive_avg_pool1d(x: FloatTensor<Self>, output_size: usize) -> FloatTensor<Self> => [t x] via workarounds;
        fn adaptive_avg_pool1d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> => [t x, t grad];
        fn max_pool1d(x: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool) -> FloatTensor<Self> => [t x] via workarounds;
        fn max_pool2d(x: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2], ceil_mode: bool) -> FloatTensor<Self> => [t x] via workarounds;
        fn interpolate(x: FloatTensor<Self>, output_size: [usize; 2], options: InterpolateOptions) -> FloatTensor<Self> => [t x] via workarounds;
        fn interpolate_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>, output_size: [usize; 2], options: InterpolateOptions) -> FloatTensor<Self> => [t x, t grad] via workarounds;
        fn layer_norm(tensor: FloatTensor<Self>, gamma: FloatTensor<Self>, beta: Option<FloatTensor<Self>>, epsilon: f64) -> FloatTensor<Self> => [t tensor, t gamma, opt beta];
        fn ctc_loss(log_probs: FloatTensor<Self>, targets: IntTensor<Self>, input_lengths: IntTensor<Self>, target_lengths: IntTensor<Self>, blank: usize) -> FloatTensor<Self> => [t log_probs];
        fn has_ctc_loss_backward() -> bool => [];
        fn ctc_loss_backward(log_probs: FloatTensor<Self>, targets: IntTensor<Self>, input_lengths: IntTensor<Self>, target_lengths: IntTensor<Self>, grad_loss: FloatTensor<Self>, blank: usize) -> FloatTensor<Self> => [t log_probs, t grad_loss];
        fn rfft(signal: FloatTensor<Self>, dim: usize, n: Option<usize>) -> (FloatTensor<Self>, FloatTensor<Self>) => [t signal] via workarounds;
        fn irfft(spectrum_re: FloatTensor<Self>, spectrum_im: FloatTensor<Self>, dim: usize, n: Option<usize>) -> FloatTensor<Self> => [t spectrum_re, t spectrum_im] via workarounds;
    }

    /// The two matmuls in the low dtype, the softmax between them in f32 (`AUTOCAST_POLICY.md`
    /// section 1): composed from `Amp`'s own ops (`backend/attention.rs`) wherever the
    /// backend would compose it in the low dtype (`attention::composed_in_half`), else the
    /// backend's kernel on the lowered inputs.
    fn attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: Option<BoolTensor<Self>>,
        attn_bias: Option<FloatTensor<Self>>,
        options: AttentionModuleOptions,
    ) -> FloatTensor<Self> {
        let mut autocast = Autocast::<B>::new(Op::attention);
        autocast_input!(see t autocast query);
        autocast_input!(see t autocast key);
        autocast_input!(see t autocast value);
        autocast_input!(see opt autocast attn_bias);
        if autocast.lowers()
            && attention::composed_in_half::<B>(
                &B::float_device(&query),
                attn_bias.is_some(),
                &options,
            )
        {
            return attention::attention::<Self>(query, key, value, mask, attn_bias, options);
        }
        let plan = autocast.plan();
        B::attention(
            plan.cast::<B>(query),
            plan.cast::<B>(key),
            plan.cast::<B>(value),
            mask,
            attn_bias.map(|b| plan.cast::<B>(b)),
            options,
        )
    }

    fn deform_conv2d_backward(
        x: FloatTensor<Self>,
        offset: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        mask: Option<FloatTensor<Self>>,
        bias: Option<FloatTensor<Self>>,
        output_grad: FloatTensor<Self>,
        options: DeformConvOptions<2>,
    ) -> DeformConv2dBackward<Self> {
        let mut autocast = Autocast::<B>::new(Op::deform_conv2d_backward);
        autocast_input!(see t autocast x);
        autocast_input!(see t autocast offset);
        autocast_input!(see t autocast weight);
        autocast_input!(see opt autocast mask);
        autocast_input!(see opt autocast bias);
        autocast_input!(see t autocast output_grad);
        let plan = autocast.plan();
        let grads = crate::backend::workarounds::deform_conv2d_backward::<B>(
            plan.cast::<B>(x),
            plan.cast::<B>(offset),
            plan.cast::<B>(weight),
            mask.map(|m| plan.cast::<B>(m)),
            bias.map(|b| plan.cast::<B>(b)),
            plan.cast::<B>(output_grad),
            options,
        );
        DeformConv2dBackward::new(
            grads.x_grad,
            grads.offset_grad,
            grads.weight_grad,
            grads.mask_grad,
            grads.bias_grad,
        )
    }

    fn max_pool1d_with_indices(
        x: FloatTensor<Self>,
        kernel_size: usize,
        stride: usize,
        padding: usize,
        dilation: usize,
        ceil_mode: bool,
    ) -> MaxPool1dWithIndices<Self> {
        let out = crate::backend::workarounds::max_pool1d_with_indices::<B>(
            x,
            kernel_size,
            stride,
            padding,
            dilation,
            ceil_mode,
        );
        MaxPool1dWithIndices::new(out.output, out.indices)
    }

    fn max_pool2d_with_indices(
        x: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        ceil_mode: bool,
    ) -> MaxPool2dWithIndices<Self> {
        let out = crate::backend::workarounds::max_pool2d_with_indices::<B>(
            x,
            kernel_size,
            stride,
            padding,
            dilation,
            ceil_mode,
        );
        MaxPool2dWithIndices::new(out.output, out.indices)
    }

    fn max_pool1d_with_indices_backward(
        x: FloatTensor<Self>,
        kernel_size: usize,
        stride: usize,
        padding: usize,
        dilation: usize,
        ceil_mode: bool,
        output_grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> MaxPool1dBackward<Self> {
        let (x, output_grad) =
            promote_pair::<B>(Op::max_pool1d_with_indices_backward, x, output_grad);
        let out = B::max_pool1d_with_indices_backward(
            x,
            kernel_size,
            stride,
            padding,
            dilation,
            ceil_mode,
            output_grad,
            indices,
        );
        MaxPool1dBackward::new(out.x_grad)
    }

    fn max_pool2d_with_indices_backward(
        x: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        ceil_mode: bool,
        output_grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> MaxPool2dBackward<Self> {
        let (x, output_grad) =
            promote_pair::<B>(Op::max_pool2d_with_indices_backward, x, output_grad);
        let out = B::max_pool2d_with_indices_backward(
            x,
            kernel_size,
            stride,
            padding,
            dilation,
            ceil_mode,
            output_grad,
            indices,
        );
        MaxPool2dBackward::new(out.x_grad)
    }
}

/// Two float inputs through the policy, for the hand-written ops above.
fn promote_pair<B: Backend>(
    op: Op,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let mut autocast = Autocast::<B>::new(op);
    autocast.see(&a);
    autocast.see(&b);
    let plan = autocast.plan();
    (plan.cast::<B>(a), plan.cast::<B>(b))
}
