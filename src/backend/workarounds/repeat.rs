//! `repeat_dim`'s gradient. burn-autodiff 0.21's backward of `float_repeat_dim` splits the
//! repeated dimension as `[size, times]` and sums over `times`: the gradient of a repeat that
//! puts each element's copies next to each other (`[a, a, b, b]`, PyTorch's
//! `repeat_interleave`). But the forward tiles (`[a, b, a, b]`, PyTorch's `repeat`), so every
//! element gets the sum of the wrong outputs' gradients: for `[a, b]` repeated twice, `a` gets
//! `g₀ + g₁` where `g₀ + g₂` is right. Silently, on every backend, wherever the repeated
//! dimension is longer than 1 (`Tensor::repeat` and `repeat_dim` tiling a sequence, a
//! positional table, feature maps); a dimension of 1 (a broadcast by repetition, the common
//! case) takes another branch and is right.
//!
//! `Amp` repeats through a new dimension of 1 in front of the repeated one: `[.., size, ..]`
//! as `[.., 1, size, ..]`, repeated to `[.., times, size, ..]` (a repeat of a dimension of 1,
//! whose backward is right), then read as `[.., times · size, ..]`. The same values, tiled;
//! both reshapes are of contiguous tensors.

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};
use burn_std::Shape;

/// `tensor` tiled `times` along `dim`, with a right gradient under autodiff.
pub(crate) fn float_repeat_dim<B: Backend>(
    tensor: FloatTensor<B>,
    dim: usize,
    times: usize,
) -> FloatTensor<B> {
    let shape = tensor.shape();
    if times <= 1 || shape[dim] <= 1 {
        return B::float_repeat_dim(tensor, dim, times);
    }
    let mut unit = shape.as_slice().to_vec();
    unit.insert(dim, 1);
    let tiled = B::float_repeat_dim(B::float_reshape(tensor, Shape::from(unit)), dim, times);
    let mut out = shape.as_slice().to_vec();
    out[dim] *= times;
    B::float_reshape(tiled, Shape::from(out))
}
