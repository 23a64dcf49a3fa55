//! Defects of Burn 0.21 that give wrong numbers, worked around where `Amp` runs the op. Each
//! is measured in plain Burn and under `Amp` by `tests/autocast_numerics/workarounds.rs` (and
//! `products.rs`), which fail once a Burn fixes it (then the workaround can go).
//!
//! **A cat loses the gradients before it while another thread runs a backward.**
//! burn-autodiff 0.21's `float_cat` lets go of its inputs' handles before it registers its
//! own node. A backward that ends on another thread in that window frees the ops of every
//! graph that no live tensor holds; after a first backward, an op on a parameter starts a
//! new graph of intermediates only, and when the cat's inputs were its last live tensors, the
//! op on the parameter is freed and the parameter gets no gradient at all: 888 of 20,000
//! steps of `(w * x).tanh()` then a cat, with backwards running on a second thread (as
//! burn-train trains one thread per device). `Amp` holds the inputs until the cat returns.
//!
//! **A value picked per row and broadcast by a fused op comes out wrong.** burn-cubecl-fusion
//! 0.21 (the fusion of `Wgpu` and `Cuda`) fuses a `gather` or `select` into the elementwise
//! kernel that consumes it. When the pick is along the last dimension and keeps one element
//! there (`[n, 1]` from `[n, m]`: `scores.gather(1, targets)`, `x.select(1, [k])`) and the
//! consumer broadcasts it against a wider last dimension (`scores - picked`), the kernel
//! reads one index per vector lane instead of one per row: 48 of 64 values wrong for an 8×8
//! gather on wgpu, 56 of 64 for a select (`CubeBackend` without fusion and `Flex` are right).
//! `Amp` copies such a pick into a buffer of its own (a `cat` of the one tensor, which the
//! fusion does not fuse), so the consumer reads it as any broadcast input; the copy holds one
//! value per row. Exact, and applied on every backend (which ones fuse is not visible from a
//! generic `B`; Flex's cat of one tensor is no copy). Not covered: such picks inside
//! burn-autodiff's own backward ops, which `Amp` above autodiff does not see, and ints (the
//! same pattern measured right).
//!
//! **Products are `exp(sum(log x))`, and their gradients NaN at a zero.** burn-autodiff 0.21
//! keeps the trait's default `prod` and `prod_dim` (NaN for a negative factor) and divides by
//! the input in `cumprod`'s backward. `Amp` builds each as one node of its own
//! ([`products`]): the kernel's product, and a backward right at zeros.
//!
//! **CubeCL has no backward for bilinear, bicubic or lanczos3 `interpolate`** (a panic):
//! `Amp` builds the node on wgpu and CUDA, with a separable backward
//! ([`interpolate`](mod@interpolate)).
//! **burn-autodiff has no `topk` of floats** (a panic): `Amp` gathers at the top-k indices
//! ([`float_topk_values`]), on every backend, so that a NaN ranks the same everywhere. **Flex has no `argtopk`** (a panic, floats and
//! ints): `Amp` takes the first `k` of a descending argsort there ([`float_argtopk_indices`]).
//! **burn-autodiff has no backward for `rfft` and `irfft`** (a `todo!` panic): `Amp` builds
//! their nodes, each backward the other transform weighted per bin ([`fft`]). **CubeCL
//! refuses a length-1 transform** (a panic): `Amp` computes that identity itself.
//! **CubeCL's `scatter_nd` loses updates at a repeated index, hence `gather_nd`'s gradient
//! too; burn-autodiff has no int `gather_nd` or `scatter_nd`** (a panic): `Amp` computes both
//! as a `select` and a `select_add` of the flattened data ([`nd`]).
//! **burn-autodiff differentiates `repeat_dim` as an interleaving** where the forward tiles
//! (every backend, a repeated dimension longer than 1): `Amp` repeats through a new
//! dimension of 1, whose backward is right ([`repeat`]).
//! **CubeCL's integer powers lose one** (`int_powi` goes through a float `pow` that lands
//! below a whole power, then truncates: 5³ = 124 on wgpu): `Amp` multiplies, by squaring
//! ([`int_pow`]).
//! **A NaN turned into a number** by Flex's `relu`, clamps, maxima and max pools, by CubeCL's
//! `sigmoid`, `clamp`, maxima, max pools, scans, powers, `atan2` and `topk` (hidden from the
//! loss scaler): `Amp` puts it back into the op's value, and ranks it first for a top-k
//! ([`nan`]); it also gives the maximum of a row of `-inf` (CubeCL: the lowest finite value)
//! its `-inf`. **A power's gradient at a zero base is NaN** (burn-autodiff's bare formulas):
//! `Amp`'s powers are nodes with PyTorch's backward ([`powers`]). **Flex's remainder rounds
//! to the divisor's precision** (`0.001 % 2π` 7e-5 off): on Flex `Amp` computes it in f64
//! ([`remainder`]). **A NaN made from an infinity** by Burn's default `log_sigmoid` at `-inf`
//! (CubeCL's), value and gradient, by `exp`'s backward behind a mask (`elu`, `selu`, `celu`,
//! `mish` above 88.7) and by `log`'s and `log1p`'s behind a clamp (burn-nn's binary
//! cross-entropy on a probability of 0 or 1): `Amp` runs `log_sigmoid` on a finite stand-in
//! there, and gives those backwards 0 where the derivative is infinite and nothing flowed
//! back, in nodes of its own ([`infinities`]).
//! **CubeCL's `deform_conv2d` backward reads the first tap's column for every tap** (wrong
//! offset and mask gradients for any kernel above 1×1): `Amp` composes both from the pixels
//! each tap samples ([`deform_conv`]).
//! **`grid_sample_2d` is bilinear only** outside Flex (CubeCL panics on other modes,
//! burn-autodiff's composition is bilinear only), Flex has no bicubic and rounds nearest's
//! ties away from zero: `Amp` composes nearest and bicubic from gathers, as PyTorch samples
//! ([`grid_sample`]).
//!
//! **CubeCL's `avg_pool2d` backward reads 4 channels at a time** where the output gradient's
//! channels are adjacent (a 1×1 output, a gradient arriving channels-last), over channels
//! that may not come in fours (wrong values, or a wgpu validation panic): `Amp` computes a
//! 1×1 output's gradient itself and hands the kernel any other one packed ([`pooling`]).
//! **A `ceil_mode` average over padding alone is 0 / 0 on CubeCL** (NaN): `Amp` makes it 0,
//! as Flex does ([`pooling`]).
//!
//! **Flex sums a transposed view's rows as if they were packed** ([`flex_views`]): wrong
//! `sum_dim` and `mean_dim` in f32, or a panic; in the forward and in burn-autodiff's
//! backward, where a bias's gradient is summed from a transposed gradient. `Amp` packs such a
//! view before its sums, and the gradient that a transposition hands back.
//!
//! **CubeCL computes `gelu`, `tanh` and `asinh` of half inputs in half precision**, step by
//! step (`gelu`'s negative tail thousands of f16 steps off): `Amp` computes them in f32 and
//! rounds once, as PyTorch's half kernels do ([`opmath`]).
//!
//! **A half tensor's scalar operand is rounded to its dtype first** (`x / 1,048,576` is 0 in
//! f16): `Amp` computes the op in f32 where the dtype cannot hold the scalar, and fills a
//! mask past the dtype's range with its largest finite value ([`scalars`]).
//!
//! **wgpu's convolutions and Flex's f16 matmul sum in half precision** ([`half_sums`]), where
//! AMP promises f32 sums of half products: `Amp` runs them on the half values widened to f32
//! and rounds the result.

mod deform_conv;
mod elementwise_node;
pub(crate) mod empty;
mod fft;
mod flex_views;
mod grid_sample;
pub mod half_sums;
mod infinities;
mod int_pow;
mod interpolate;
mod nan;
mod nd;
mod negative_powers;
mod opmath;
mod pooling;
mod powers;
mod products;
mod remainder;
mod repeat;
mod scalars;

pub(crate) use deform_conv::deform_conv2d_backward;
pub(crate) use empty::{
    adaptive_avg_pool1d, adaptive_avg_pool2d, avg_pool2d, bool_all, bool_all_dim, bool_any,
    bool_any_dim, bool_cat, bool_expand, bool_gather, bool_ones, bool_permute, bool_repeat_dim,
    bool_reshape, bool_scatter_or, bool_select, bool_select_or, bool_slice_assign, bool_swap_dims,
    bool_transpose, bool_unfold, bool_zeros, conv_transpose1d, conv_transpose2d, conv_transpose3d,
    conv1d, conv2d, conv3d, deform_conv2d, embedding, float_all, float_all_dim, float_any,
    float_any_dim, float_argmax, float_argmin, float_argsort, float_argtopk, float_cast,
    float_expand, float_full, float_gather_nd, float_grid_sample_2d, float_into_int, float_matmul,
    float_max, float_max_abs, float_max_abs_dim, float_max_dim, float_max_dim_with_indices,
    float_mean, float_mean_dim, float_min, float_min_dim, float_min_dim_with_indices, float_ones,
    float_permute, float_prod, float_prod_dim, float_random, float_repeat_dim, float_reshape,
    float_scatter_add, float_scatter_nd, float_select_add, float_slice_assign,
    float_sort_with_indices, float_sum, float_sum_dim, float_swap_dims, float_topk,
    float_transpose, float_unfold, float_zeros, int_all, int_all_dim, int_any, int_any_dim,
    int_argmax, int_argmin, int_argsort, int_argtopk, int_cat, int_expand, int_full, int_gather,
    int_gather_nd, int_matmul, int_max, int_max_abs, int_max_abs_dim, int_max_dim,
    int_max_dim_with_indices, int_mean, int_mean_dim, int_min, int_min_dim,
    int_min_dim_with_indices, int_ones, int_permute, int_prod, int_prod_dim, int_random,
    int_repeat_dim, int_reshape, int_scatter_add, int_scatter_nd, int_select, int_select_add,
    int_slice_assign, int_sort_with_indices, int_sum, int_sum_dim, int_swap_dims, int_topk,
    int_transpose, int_unfold, int_zeros, interpolate, linear, max_pool1d, max_pool1d_with_indices,
    max_pool2d, max_pool2d_with_indices,
};
pub(crate) use fft::{irfft, rfft};
pub(crate) use half_sums::{
    conv_transpose1d_weight_backward, conv_transpose1d_x_backward,
    conv_transpose2d_weight_backward, conv_transpose2d_x_backward,
    conv_transpose3d_weight_backward, conv_transpose3d_x_backward, conv1d_weight_backward,
    conv1d_x_backward, conv2d_weight_backward, conv2d_x_backward, conv3d_weight_backward,
    conv3d_x_backward, linear_weight_backward, linear_x_backward,
};
pub(crate) use infinities::{
    float_exp, float_log, float_log1p, float_sqrt, log_sigmoid, log_sigmoid_backward,
};
pub(crate) use int_pow::{int_powi, int_powi_scalar, int_powi_scalar as int_powi_scalar_impl};
pub(crate) use interpolate::interpolate_backward;
pub(crate) use nan::{
    float_atan2, float_clamp, float_clamp_max, float_clamp_min, float_cummax, float_cummin,
    hard_sigmoid, relu, sigmoid,
};
pub(crate) use opmath::{float_asinh, float_tanh, gelu, gelu_backward};
pub(crate) use pooling::{avg_pool1d, avg_pool2d_backward};
pub(crate) use powers::{
    float_powf, float_powf_scalar, float_powf_scalar_impl, float_powi_scalar,
    float_powi_scalar_impl,
};
pub(crate) use products::float_cumprod;
pub(crate) use remainder::{float_remainder, float_remainder_scalar};
pub(crate) use scalars::{
    float_add_scalar, float_div_scalar, float_mask_fill, float_mul_scalar, float_sub_scalar,
};

use core::any::TypeId;

use burn::backend::flex::FlexTensor;
use burn_backend::TensorMetadata;
use burn_backend::tensor::{FloatTensor, IntTensor};
use burn_backend::{Backend, get_device_settings};
use burn_std::{FloatDType, IntDType, Slice};

/// `B`'s cat, its inputs held until it returns (see the module docs); with an empty piece,
/// [`empty::float_cat_pieces`].
pub(crate) fn float_cat<B: Backend>(tensors: Vec<FloatTensor<B>>, dim: usize) -> FloatTensor<B> {
    let tensors = match empty::float_cat_pieces::<B>(tensors, dim) {
        Ok(out) => return out,
        Err(pieces) => pieces,
    };
    let held = tensors.clone();
    let out = B::float_cat(tensors, dim);
    drop(held);
    out
}

/// `B`'s gather, materialized when it picks one element along the last dimension.
pub(crate) fn float_gather<B: Backend>(
    dim: usize,
    tensor: FloatTensor<B>,
    indices: IntTensor<B>,
) -> FloatTensor<B> {
    match empty::picked::<B>(tensor, &indices, empty::gathered) {
        Ok(out) => out,
        Err(tensor) => materialized::<B>(B::float_gather(dim, tensor, indices), dim),
    }
}

/// The top `k` values along `dim`: a gather at the top-k indices ([`float_argtopk_indices`]).
/// burn-autodiff has no `topk` of floats (0.21: `unimplemented!("topk is not implemented for
/// autodiff")`, so a router or a beam that takes top-k values cannot train); the gather has a
/// backward (the gradient goes to the picked elements), and takes its values where the NaNs
/// were ranked.
pub(crate) fn float_topk_values<B: Backend>(
    tensor: FloatTensor<B>,
    dim: usize,
    k: usize,
) -> FloatTensor<B> {
    let dtype = get_device_settings::<B>(&B::float_device(&tensor)).int_dtype;
    let indices = float_argtopk_indices::<B>(tensor.clone(), dim, k, dtype);
    float_gather::<B>(dim, tensor, indices)
}

/// The indices of the top `k` floats along `dim`, a NaN first (PyTorch's order; it ties with
/// `+inf`, see [`nan::nan_ranked_first`]). Flex 0.21 has no argtopk (`unimplemented!`, floats
/// and ints alike): there, the first `k` of a descending argsort.
pub(crate) fn float_argtopk_indices<B: Backend>(
    tensor: FloatTensor<B>,
    dim: usize,
    k: usize,
    out_dtype: IntDType,
) -> IntTensor<B> {
    let tensor = nan::nan_ranked_first::<B>(tensor);
    if on_flex::<B>() {
        first_k::<B>(B::float_argsort(tensor, dim, true, out_dtype), dim, k)
    } else {
        B::float_argtopk(tensor, dim, k, out_dtype)
    }
}

/// `B`'s indices of the top `k` ints along `dim` (on Flex as for floats).
pub(crate) fn int_argtopk_indices<B: Backend>(
    tensor: IntTensor<B>,
    dim: usize,
    k: usize,
) -> IntTensor<B> {
    if on_flex::<B>() {
        first_k::<B>(B::int_argsort(tensor, dim, true), dim, k)
    } else {
        B::int_argtopk(tensor, dim, k)
    }
}

/// `op` on `inputs` widened to f32, the result rounded back to the first one's dtype: a half
/// op computed as a kernel that works in f32 would ([`half_sums`], [`opmath`]).
fn in_f32<B: Backend, const N: usize>(
    inputs: [FloatTensor<B>; N],
    op: impl FnOnce([FloatTensor<B>; N]) -> FloatTensor<B>,
) -> FloatTensor<B> {
    widened::<B, N>(inputs, FloatDType::F32, op)
}

/// `op` on `inputs` cast to `wide`, the result rounded back to the first one's dtype.
fn widened<B: Backend, const N: usize>(
    inputs: [FloatTensor<B>; N],
    wide: FloatDType,
    op: impl FnOnce([FloatTensor<B>; N]) -> FloatTensor<B>,
) -> FloatTensor<B> {
    let dtype = FloatDType::from(inputs[0].dtype());
    let inputs = inputs.map(|t| B::float_cast(t, wide));
    B::float_cast(op(inputs), dtype)
}

/// Whether `B` is wgpu, or autodiff over it.
pub(super) fn on_wgpu<B: Backend>() -> bool {
    TypeId::of::<B::Device>() == TypeId::of::<burn::backend::wgpu::WgpuDevice>()
}

/// Whether `B` is Flex, or autodiff over it (both keep ints as Flex tensors).
pub(crate) fn on_flex<B: Backend>() -> bool {
    TypeId::of::<IntTensor<B>>() == TypeId::of::<FlexTensor>()
}

fn first_k<B: Backend>(indices: IntTensor<B>, dim: usize, k: usize) -> IntTensor<B> {
    let shape = indices.shape();
    let slices: Vec<Slice> = (0..shape.num_dims())
        .map(|d| Slice::from(0..if d == dim { k } else { shape[d] }))
        .collect();
    B::int_slice(indices, &slices)
}

/// `B`'s select, materialized when it picks one element along the last dimension.
pub(crate) fn float_select<B: Backend>(
    tensor: FloatTensor<B>,
    dim: usize,
    indices: IntTensor<B>,
) -> FloatTensor<B> {
    match empty::picked::<B>(tensor, &indices, empty::selected(dim)) {
        Ok(out) => out,
        Err(tensor) => materialized::<B>(B::float_select(tensor, dim, indices), dim),
    }
}

/// `out` copied into a buffer of its own when it picks one element along the last dimension
/// `dim` (through [`float_cat`], which holds it across the cat).
fn materialized<B: Backend>(out: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    let shape = out.shape();
    if dim + 1 == shape.num_dims() && shape[dim] == 1 {
        float_cat::<B>(vec![out], dim)
    } else {
        out
    }
}
