//! Convolutions, pooling and interpolation over an empty batch (a detection head given no
//! proposal, the images a mask selects when it selects none): the result's shape from Burn's
//! own shape rules, no kernel. The weight and bias get zero gradients, as in PyTorch.

use burn_backend::ops::conv::{
    calculate_conv_output_shape, calculate_conv_transpose_output_shape, calculate_pool_output_shape,
};
use burn_backend::ops::{
    ConvOptions, ConvTransposeOptions, DeformConvOptions, GridSampleOptions, InterpolateOptions,
    MaxPool1dWithIndices, MaxPool2dWithIndices,
};
use burn_backend::tensor::{FloatTensor, IntTensor};
use burn_backend::{Backend, TensorMetadata, get_device_settings};
use burn_std::{MetadataError, Shape};

use super::super::half_sums::{self, Summed};
use super::super::{deform_conv, grid_sample, interpolate as interpolated, nan, pooling};
use super::ops::{empty_like, with_indices};
use super::{Fill, constant, float_dtype, is_empty};

/// The result's shape when `x` is empty and so is the result, else `None` (then `B` runs the
/// op: over an empty channel dimension a convolution gives its bias, which needs a kernel).
fn empty_result<B: Backend>(
    x: &FloatTensor<B>,
    shape: impl FnOnce(&Shape) -> Result<Shape, MetadataError>,
) -> Option<Shape> {
    if !is_empty(x) {
        return None;
    }
    shape(&x.shape()).ok().filter(|s| s.num_elements() == 0)
}

macro_rules! convolutions {
    ($($name:ident($options:ident<$n:literal>) as $summed:ident => |$x:ident, $w:ident, $o:ident| $shape:expr;)*) => {$(
        pub(crate) fn $name<B: Backend>(
            x: FloatTensor<B>,
            weight: FloatTensor<B>,
            bias: Option<FloatTensor<B>>,
            options: $options<$n>,
        ) -> FloatTensor<B> {
            let ($w, $o) = (weight.shape(), &options);
            if let Some(shape) = empty_result::<B>(&x, |$x| $shape) {
                let dtype = float_dtype(x.dtype());
                let mut inputs = vec![x, weight];
                inputs.extend(bias);
                return constant::<B>(inputs, shape, dtype, Fill::Empty);
            }
            if half_sums::conv_sums_in_half::<B>(x.dtype()) {
                return half_sums::summed::<B>(Summed::$summed(options), x, weight, bias);
            }
            B::$name(x, weight, bias, options)
        }
    )*};
}

convolutions! {
    conv1d(ConvOptions<1>) as Conv1d => |x, w, o| calculate_conv_output_shape(x, &w, &o.stride, &o.padding, &o.dilation);
    conv2d(ConvOptions<2>) as Conv2d => |x, w, o| calculate_conv_output_shape(x, &w, &o.stride, &o.padding, &o.dilation);
    conv3d(ConvOptions<3>) as Conv3d => |x, w, o| calculate_conv_output_shape(x, &w, &o.stride, &o.padding, &o.dilation);
    conv_transpose1d(ConvTransposeOptions<1>) as ConvTranspose1d => |x, w, o| calculate_conv_transpose_output_shape(
        x, &w, &o.stride, &o.padding, &o.padding_out, &o.dilation, o.groups);
    conv_transpose2d(ConvTransposeOptions<2>) as ConvTranspose2d => |x, w, o| calculate_conv_transpose_output_shape(
        x, &w, &o.stride, &o.padding, &o.padding_out, &o.dilation, o.groups);
    conv_transpose3d(ConvTransposeOptions<3>) as ConvTranspose3d => |x, w, o| calculate_conv_transpose_output_shape(
        x, &w, &o.stride, &o.padding, &o.padding_out, &o.dilation, o.groups);
}

/// A deformable convolution's result is `[n, c_out, h_out, w_out]`, its offsets'
/// `[n, _, h_out, w_out]`: empty over an empty batch (or no output position).
pub(crate) fn deform_conv2d<B: Backend>(
    x: FloatTensor<B>,
    offset: FloatTensor<B>,
    weight: FloatTensor<B>,
    mask: Option<FloatTensor<B>>,
    bias: Option<FloatTensor<B>>,
    options: DeformConvOptions<2>,
) -> FloatTensor<B> {
    if is_empty(&x) || is_empty(&offset) {
        let (o, w) = (offset.shape(), weight.shape());
        let shape = (o.num_dims() == 4 && w.num_dims() == 4)
            .then(|| Shape::from(vec![o[0], w[0], o[2], o[3]]))
            .filter(|s| s.num_elements() == 0);
        if let Some(shape) = shape {
            let dtype = float_dtype(x.dtype());
            let mut inputs = vec![x, offset, weight];
            inputs.extend(mask);
            inputs.extend(bias);
            return constant::<B>(inputs, shape, dtype, Fill::Empty);
        }
    }
    deform_conv::deform_conv2d::<B>(x, offset, weight, mask, bias, options)
}

/// `grid_sample_2d(tensor [n, c, h, w], grid [n, h_out, w_out, 2])`: `[n, c, h_out, w_out]`,
/// empty over an empty batch (RoI features of no box) or grid.
pub(crate) fn float_grid_sample_2d<B: Backend>(
    tensor: FloatTensor<B>,
    grid: FloatTensor<B>,
    options: GridSampleOptions,
) -> FloatTensor<B> {
    if is_empty(&tensor) || is_empty(&grid) {
        let (t, g) = (tensor.shape(), grid.shape());
        let shape = (t.num_dims() == 4 && g.num_dims() == 4)
            .then(|| Shape::from(vec![g[0], t[1], g[1], g[2]]))
            .filter(|s| s.num_elements() == 0);
        if let Some(shape) = shape {
            let dtype = float_dtype(tensor.dtype());
            return constant::<B>(vec![tensor, grid], shape, dtype, Fill::Empty);
        }
    }
    grid_sample::grid_sample_2d::<B>(tensor, grid, options)
}

/// `[n, c, ..]` with the trailing dimensions `size`.
fn resized(x: &Shape, size: &[usize]) -> Result<Shape, MetadataError> {
    if x.num_dims() != size.len() + 2 {
        return Err(MetadataError::RankMismatch {
            left: x.num_dims(),
            right: size.len() + 2,
        });
    }
    Ok(Shape::from([&x.as_slice()[..2], size].concat()))
}

pub(crate) fn avg_pool2d<B: Backend>(
    x: FloatTensor<B>,
    kernel_size: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    count_include_pad: bool,
    ceil_mode: bool,
) -> FloatTensor<B> {
    let pooled = |x: &Shape| {
        calculate_pool_output_shape(x, &kernel_size, &stride, &padding, &[1, 1], ceil_mode)
    };
    if let Some(shape) = empty_result::<B>(&x, pooled) {
        return empty_like::<B>(x, shape);
    }
    pooling::avg_pool2d::<B>(
        x,
        kernel_size,
        stride,
        padding,
        count_include_pad,
        ceil_mode,
    )
}

/// A 1d pool's window parameter (`usize`) or a 2d pool's (`[usize; 2]`), per dimension.
trait Window<const N: usize>: Copy {
    fn per_dim(self) -> [usize; N];
}

impl Window<1> for usize {
    fn per_dim(self) -> [usize; 1] {
        [self]
    }
}

impl Window<2> for [usize; 2] {
    fn per_dim(self) -> [usize; 2] {
        self
    }
}

/// The empty result of a max pool and its empty indices, in the device's int dtype.
fn pooled_with_indices<B: Backend>(
    x: FloatTensor<B>,
    shape: Shape,
) -> (FloatTensor<B>, IntTensor<B>) {
    let dtype = get_device_settings::<B>(&B::float_device(&x)).int_dtype;
    with_indices::<B>(x, shape, dtype)
}

/// Max pools: an empty result made here; else the backend's pool, with a NaN wherever a window
/// holds one (`nan`; `$plain` pools the NaN mask, without indices). The indices stay the
/// backend's.
macro_rules! max_pools {
    ($($name:ident<$n:literal>($window:ty) by $plain:ident -> $ret:ty
        = |$x:ident, $shape:ident| $empty:expr, |$pooled:ident, $nan:ident| $out:expr;)*) => {$(
        pub(crate) fn $name<B: Backend>(
            x: FloatTensor<B>,
            kernel_size: $window,
            stride: $window,
            padding: $window,
            dilation: $window,
            ceil_mode: bool,
        ) -> $ret {
            let pooled = |x: &Shape| {
                calculate_pool_output_shape::<$n>(
                    x,
                    &kernel_size.per_dim(),
                    &stride.per_dim(),
                    &padding.per_dim(),
                    &dilation.per_dim(),
                    ceil_mode,
                )
            };
            if let Some($shape) = empty_result::<B>(&x, pooled) {
                let $x = x;
                return $empty;
            }
            let $pooled = B::$name(x.clone(), kernel_size, stride, padding, dilation, ceil_mode);
            let $nan = |output| {
                nan::pooled::<B>(&x, output, |mask| {
                    B::$plain(mask, kernel_size, stride, padding, dilation, ceil_mode)
                })
            };
            $out
        }
    )*};
}

max_pools! {
    max_pool1d<1>(usize) by max_pool1d -> FloatTensor<B> = |x, shape| empty_like::<B>(x, shape),
        |pooled, with_nan| with_nan(pooled);
    max_pool2d<2>([usize; 2]) by max_pool2d -> FloatTensor<B>
        = |x, shape| empty_like::<B>(x, shape), |pooled, with_nan| with_nan(pooled);
    max_pool1d_with_indices<1>(usize) by max_pool1d -> MaxPool1dWithIndices<B> = |x, shape| {
        let (output, indices) = pooled_with_indices::<B>(x, shape);
        MaxPool1dWithIndices::new(output, indices)
    }, |pooled, with_nan| MaxPool1dWithIndices::new(with_nan(pooled.output), pooled.indices);
    max_pool2d_with_indices<2>([usize; 2]) by max_pool2d -> MaxPool2dWithIndices<B> = |x, shape| {
        let (output, indices) = pooled_with_indices::<B>(x, shape);
        MaxPool2dWithIndices::new(output, indices)
    }, |pooled, with_nan| MaxPool2dWithIndices::new(with_nan(pooled.output), pooled.indices);
}

pub(crate) fn adaptive_avg_pool1d<B: Backend>(
    x: FloatTensor<B>,
    output_size: usize,
) -> FloatTensor<B> {
    if let Some(shape) = empty_result::<B>(&x, |x| resized(x, &[output_size])) {
        return empty_like::<B>(x, shape);
    }
    B::adaptive_avg_pool1d(x, output_size)
}

pub(crate) fn adaptive_avg_pool2d<B: Backend>(
    x: FloatTensor<B>,
    output_size: [usize; 2],
) -> FloatTensor<B> {
    if let Some(shape) = empty_result::<B>(&x, |x| resized(x, &output_size)) {
        return empty_like::<B>(x, shape);
    }
    B::adaptive_avg_pool2d(x, output_size)
}

pub(crate) fn interpolate<B: Backend>(
    x: FloatTensor<B>,
    output_size: [usize; 2],
    options: InterpolateOptions,
) -> FloatTensor<B> {
    if let Some(shape) = empty_result::<B>(&x, |x| resized(x, &output_size)) {
        return empty_like::<B>(x, shape);
    }
    interpolated::interpolate::<B>(x, output_size, options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resized_keeps_batch_and_channels() {
        let x = Shape::from(vec![0, 3, 8, 8]);
        assert_eq!(resized(&x, &[2, 5]).unwrap(), Shape::from(vec![0, 3, 2, 5]));
        assert!(resized(&x, &[2]).is_err());
    }
}
