//! `grid_sample_2d` in nearest and bicubic modes, composed of gathers at the sampled pixels.
//!
//! Burn 0.21 has bilinear everywhere and little else: burn-cubecl (wgpu, CUDA) panics on any
//! other mode ("Unsupported grid_sample interpolation mode"), burn-autodiff keeps the trait's
//! reference composition, bilinear only (`todo!` for the others, on every backend), and Flex
//! has nearest (rounding ties away from zero) but no bicubic. So a spatial transformer, a
//! flow warp or a label map resampled by nearest neighbour cannot train in Burn, nor run on a
//! GPU. `Amp` composes both modes from ops every backend has, PyTorch's `grid_sample`
//! (`GridSampler.h`) step by step: the coordinate unnormalized as PyTorch does it (same f32
//! operations in the same order), nearest rounding ties to even (`nearbyint`; Flex's own
//! nearest picks the other pixel at a tie, which a 2× downsampling grid hits at every
//! sample), bicubic's 16 taps with the cubic convolution weights (A = -0.75) and the padding
//! applied to each tap's integer position. Under autodiff the gradients follow: the input's
//! through the gathers (a scatter-add: right at repeated pixels), the grid's through
//! bicubic's weights, and zeros from nearest (PyTorch's), not none.
//!
//! Bilinear stays `B`'s (kernels on every backend, and the reference composition under
//! autodiff). A NaN coordinate samples 0 in nearest mode, in every padding mode (PyTorch's
//! CPU and CUDA kernels disagree there); in bicubic mode its NaN weights give NaN, as in
//! PyTorch. Memory: a learned grid (one that requires a gradient) keeps the gathered values
//! for its gradient, one copy of the output per tap (bicubic: 16).

use burn_backend::ops::{GridSampleOptions, GridSamplePaddingMode, InterpolateMode};
use burn_backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn_backend::{Backend, Scalar, TensorMetadata, get_device_settings};
use burn_std::{Shape, Slice};

/// Bicubic's `A` (PyTorch's and OpenCV's).
const CUBIC_A: f64 = -0.75;

/// `tensor [n, c, h, w]` sampled at `grid [n, h_out, w_out, 2]`: `[n, c, h_out, w_out]`.
pub(crate) fn grid_sample_2d<B: Backend>(
    tensor: FloatTensor<B>,
    grid: FloatTensor<B>,
    options: GridSampleOptions,
) -> FloatTensor<B> {
    match options.mode {
        InterpolateMode::Bilinear => B::float_grid_sample_2d(tensor, grid, options),
        InterpolateMode::Nearest | InterpolateMode::Bicubic => {
            Sampling::<B>::new(tensor, grid, options).sample()
        }
        InterpolateMode::Lanczos3 => panic!(
            "grid_sample_2d has no lanczos3 mode: use bilinear, nearest or bicubic (PyTorch's \
             three); lanczos3 is an `interpolate` mode"
        ),
    }
}

/// One axis of the input: its size, and where normalized coordinates land on it.
#[derive(Clone, Copy)]
struct Axis {
    size: usize,
    align_corners: bool,
    padding: GridSamplePaddingMode,
}

impl Axis {
    /// PyTorch's `grid_sampler_unnormalize`, in its order of f32 operations (so that ties
    /// fall where they fall there): `(g + 1) / 2 * (size - 1)` with `align_corners`, else
    /// `((g + 1) * size - 1) / 2`.
    fn unnormalized<B: Backend>(&self, g: FloatTensor<B>) -> FloatTensor<B> {
        let size = self.size as f64;
        let g = B::float_add_scalar(g, Scalar::Float(1.0));
        if self.align_corners {
            let g = B::float_div_scalar(g, Scalar::Float(2.0));
            B::float_mul_scalar(g, Scalar::Float(size - 1.0))
        } else {
            let g = B::float_mul_scalar(g, Scalar::Float(size));
            let g = B::float_sub_scalar(g, Scalar::Float(1.0));
            B::float_div_scalar(g, Scalar::Float(2.0))
        }
    }

    /// PyTorch's `compute_coordinates`: the padding applied to a pixel coordinate (no
    /// gradient: it only picks pixels here). Border clips to `[0, size - 1]`; reflection
    /// reflects at the corner pixels' centres (`align_corners`) or at the image's edges, then
    /// clips.
    fn padded<B: Backend>(&self, x: FloatTensor<B>) -> FloatTensor<B> {
        let last = Scalar::Float(self.size as f64 - 1.0);
        match self.padding {
            GridSamplePaddingMode::Zeros => x,
            GridSamplePaddingMode::Border => B::float_clamp(x, Scalar::Float(0.0), last),
            GridSamplePaddingMode::Reflection => {
                let (low, high) = match self.align_corners {
                    true => (0.0, self.size as f64 - 1.0),
                    false => (-0.5, self.size as f64 - 0.5),
                };
                B::float_clamp(reflected::<B>(x, low, high), Scalar::Float(0.0), last)
            }
        }
    }

    /// Whether a (padded) pixel coordinate lies on the image: false for NaN too.
    fn inside<B: Backend>(&self, x: FloatTensor<B>) -> BoolTensor<B> {
        let dtype = get_device_settings::<B>(&B::float_device(&x)).bool_dtype;
        let last = Scalar::Float(self.size as f64 - 1.0);
        let above = B::float_greater_equal_elem(x.clone(), Scalar::Float(0.0), dtype);
        B::bool_and(above, B::float_lower_equal_elem(x, last, dtype))
    }
}

/// `x` reflected into `[low, high]` (PyTorch's `reflect_coordinates`): its distance from
/// `low`, folded by the span; every other fold runs backwards.
fn reflected<B: Backend>(x: FloatTensor<B>, low: f64, high: f64) -> FloatTensor<B> {
    let span = high - low;
    if span <= 0.0 {
        // One pixel with `align_corners`: every coordinate is its centre.
        return B::float_mul_scalar(x, Scalar::Float(0.0));
    }
    let distance = B::float_abs(B::float_sub_scalar(x, Scalar::Float(low)));
    let flips = B::float_floor(B::float_div_scalar(distance.clone(), Scalar::Float(span)));
    let extra = B::float_sub(
        distance,
        B::float_mul_scalar(flips.clone(), Scalar::Float(span)),
    );
    // 1 for an odd number of flips, else 0.
    let halves = B::float_floor(B::float_div_scalar(flips.clone(), Scalar::Float(2.0)));
    let odd = B::float_sub(flips, B::float_mul_scalar(halves, Scalar::Float(2.0)));
    // even: low + extra; odd: low + span - extra.
    let backwards = B::float_sub_scalar(
        B::float_mul_scalar(extra.clone(), Scalar::Float(-2.0)),
        Scalar::Float(-span),
    );
    B::float_add_scalar(
        B::float_add(extra, B::float_mul(odd, backwards)),
        Scalar::Float(low),
    )
}

/// One call: the input flattened per plane, the grid's coordinates as `[n, p]` (`p` output
/// pixels), and the shapes.
struct Sampling<B: Backend> {
    /// `[n, c, h * w]`.
    planes: FloatTensor<B>,
    /// The grid's x and y, `[n, p]`, tracked (for the weights' gradients).
    x: FloatTensor<B>,
    y: FloatTensor<B>,
    /// `[n, c, h_out, w_out]`.
    out: Shape,
    width: Axis,
    height: Axis,
    mode: InterpolateMode,
}

impl<B: Backend> Sampling<B> {
    fn new(tensor: FloatTensor<B>, grid: FloatTensor<B>, options: GridSampleOptions) -> Self {
        let (t, g) = (tensor.shape(), grid.shape());
        assert!(
            t.num_dims() == 4 && g.num_dims() == 4 && g[3] == 2 && g[0] == t[0],
            "grid_sample_2d takes an input [n, c, h, w] and a grid [n, h_out, w_out, 2] of the \
             same batch; got {t:?} and {g:?}"
        );
        let [n, c, h, w] = [t[0], t[1], t[2], t[3]];
        assert!(
            h > 0 && w > 0,
            "grid_sample_2d: the input {t:?} has no pixel to sample (an empty height or width)"
        );
        let p = g[1] * g[2];
        let coordinate = |k: usize| {
            let slices = [
                Slice::from(0..n),
                Slice::from(0..g[1]),
                Slice::from(0..g[2]),
                Slice::from(k..k + 1),
            ];
            B::float_reshape(
                B::float_slice(grid.clone(), &slices),
                Shape::from(vec![n, p]),
            )
        };
        let axis = |size| Axis {
            size,
            align_corners: options.align_corners,
            padding: options.padding_mode,
        };
        Sampling {
            planes: B::float_reshape(tensor, Shape::from(vec![n, c, h * w])),
            x: coordinate(0),
            y: coordinate(1),
            out: Shape::from(vec![n, c, g[1], g[2]]),
            width: axis(w),
            height: axis(h),
            mode: options.mode,
        }
    }

    fn sample(self) -> FloatTensor<B> {
        let out = match self.mode {
            InterpolateMode::Nearest => self.nearest(),
            _ => self.bicubic(),
        };
        B::float_reshape(out, self.out.clone())
    }

    /// The pixel nearest to each padded coordinate (ties to even), 0 off the image.
    fn nearest(&self) -> FloatTensor<B> {
        let at = |axis: &Axis, g: &FloatTensor<B>| {
            let x = axis.unnormalized::<B>(B::float_detach(g.clone()));
            B::float_round(axis.padded::<B>(x))
        };
        let (x, y) = (at(&self.width, &self.x), at(&self.height, &self.y));
        let inside = B::bool_and(
            self.width.inside::<B>(x.clone()),
            self.height.inside::<B>(y.clone()),
        );
        // 1 on the image, 0 off it, and a zero gradient for the grid (PyTorch's for nearest).
        let weight = B::float_mask_fill(self.x.clone(), inside.clone(), Scalar::Float(1.0));
        let weight = B::float_mask_fill(weight, B::bool_not(inside.clone()), Scalar::Float(0.0));
        B::float_mul(self.gathered(x, y, inside), per_plane::<B>(weight))
    }

    /// PyTorch's bicubic: 4 × 4 taps around the floor of the unnormalized coordinate, each
    /// at its padded integer position (0 off the image), weighted by the cubic convolution
    /// of the coordinate's fraction along each axis.
    fn bicubic(&self) -> FloatTensor<B> {
        // Per axis: the four taps' positions (detached) and weights (tracked), validity folded
        // into the weights so that an off-image tap adds nothing, gradient included.
        let taps = |axis: &Axis, g: &FloatTensor<B>| {
            let x = axis.unnormalized::<B>(g.clone());
            let floor = B::float_floor(B::float_detach(x.clone()));
            let t = B::float_sub(x, floor.clone());
            let weights = cubic_weights::<B>(t);
            let mut out = Vec::with_capacity(4);
            for (k, weight) in weights.into_iter().enumerate() {
                let at = B::float_add_scalar(floor.clone(), Scalar::Float(k as f64 - 1.0));
                let at = axis.padded::<B>(at);
                let inside = axis.inside::<B>(at.clone());
                let weight =
                    B::float_mask_fill(weight, B::bool_not(inside.clone()), Scalar::Float(0.0));
                out.push((at, inside, weight));
            }
            out
        };
        let (columns, rows) = (taps(&self.width, &self.x), taps(&self.height, &self.y));
        let mut sum: Option<FloatTensor<B>> = None;
        for (y, y_inside, y_weight) in &rows {
            for (x, x_inside, x_weight) in &columns {
                let inside = B::bool_and(x_inside.clone(), y_inside.clone());
                let values = self.gathered(x.clone(), y.clone(), inside);
                let weight = B::float_mul(x_weight.clone(), y_weight.clone());
                let term = B::float_mul(values, per_plane::<B>(weight));
                sum = Some(match sum {
                    Some(sum) => B::float_add(sum, term),
                    None => term,
                });
            }
        }
        sum.expect("sixteen taps")
    }

    /// The input's values at pixel coordinates `x`, `y` (`[n, p]`, whole numbers), `[n, c,
    /// p]`; where `inside` is false (off the image, NaN) pixel 0, which the caller weighs 0.
    fn gathered(
        &self,
        x: FloatTensor<B>,
        y: FloatTensor<B>,
        inside: BoolTensor<B>,
    ) -> FloatTensor<B> {
        let outside = B::bool_not(inside);
        let x = B::float_mask_fill(x, outside.clone(), Scalar::Float(0.0));
        let y = B::float_mask_fill(y, outside, Scalar::Float(0.0));
        // Whole numbers, exact in the float; the flat position in ints (exact past 2^24).
        let int_dtype = get_device_settings::<B>(&B::float_device(&x)).int_dtype;
        let row = B::float_into_int(y, int_dtype);
        let row = B::int_mul_scalar(row, Scalar::Int(self.width.size as i64));
        let index: IntTensor<B> = B::int_add(row, B::float_into_int(x, int_dtype));
        let [n, c, _] = self.planes.shape().dims();
        let p = self.out[2] * self.out[3];
        let index = B::int_expand(
            B::int_reshape(index, Shape::from(vec![n, 1, p])),
            Shape::from(vec![n, c, p]),
        );
        super::float_gather::<B>(2, self.planes.clone(), index)
    }
}

/// A per-pixel `[n, p]` weight as `[n, 1, p]`, to scale every plane.
fn per_plane<B: Backend>(weight: FloatTensor<B>) -> FloatTensor<B> {
    let [n, p] = weight.shape().dims();
    B::float_reshape(weight, Shape::from(vec![n, 1, p]))
}

/// The cubic convolution weights of the taps at -1, 0, 1, 2 from the floor, for a fraction
/// `t` (PyTorch's `get_cubic_upsample_coefficients`).
fn cubic_weights<B: Backend>(t: FloatTensor<B>) -> [FloatTensor<B>; 4] {
    let a = CUBIC_A;
    // |x| <= 1: ((A + 2) x - (A + 3)) x² + 1
    let near = |x: FloatTensor<B>| {
        let inner = B::float_sub_scalar(
            B::float_mul_scalar(x.clone(), Scalar::Float(a + 2.0)),
            Scalar::Float(a + 3.0),
        );
        let x2 = B::float_mul(x.clone(), x);
        B::float_add_scalar(B::float_mul(inner, x2), Scalar::Float(1.0))
    };
    // 1 < |x| < 2: ((A x - 5A) x + 8A) x - 4A
    let far = |x: FloatTensor<B>| {
        let inner = B::float_sub_scalar(
            B::float_mul_scalar(x.clone(), Scalar::Float(a)),
            Scalar::Float(5.0 * a),
        );
        let inner = B::float_add_scalar(B::float_mul(inner, x.clone()), Scalar::Float(8.0 * a));
        B::float_sub_scalar(B::float_mul(inner, x), Scalar::Float(4.0 * a))
    };
    let one_minus_t = B::float_add_scalar(B::float_neg(t.clone()), Scalar::Float(1.0));
    [
        far(B::float_add_scalar(t.clone(), Scalar::Float(1.0))),
        near(t.clone()),
        near(one_minus_t.clone()),
        far(B::float_add_scalar(one_minus_t, Scalar::Float(1.0))),
    ]
}
