//! Products as one autodiff node each: `prod`, `prod_dim` and `cumprod` with the backend's
//! kernel forward and a backward that is right at zeros.
//!
//! burn-autodiff 0.21 keeps the backend trait's default `prod` and `prod_dim`,
//! `exp(sum(log x))`: NaN for any negative factor (`[-2, 3, 0.5]` gives NaN, the kernel -3),
//! a few ulps off for positive ones, and a NaN gradient at a zero. Its `cumprod` backward
//! divides by the input (`reverse_cumsum(g ⊙ y) / x`, "LIMITATION" in its source): NaN at a
//! zero. A NaN gradient under a `GradScaler` reads as an overflow: the step is skipped and
//! the scale shrinks, every step, for a bug that is not one.
//!
//! Here the forward is the inner backend's product kernel. The backward of `prod` and
//! `prod_dim` multiplies the gradient by the product of the other factors, taken as the
//! exclusive products from both ends (two `cumprod`s, no division), as PyTorch does where a
//! zero is present. `cumprod`'s is burn-autodiff's formula where it holds (before a slice's
//! first zero), and at the first zero `∏_{k<z} x_k · Σ_{j≥z} g_j ∏_{z<k≤j} x_k`; after it,
//! every term holds the zero: 0. Both keep the input as burn-autodiff's ops do (checkpointed:
//! a widened input is kept as its half source, see [`upcast`](crate::backend::upcast)).

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Scalar, TensorMetadata, get_device_settings};
use burn_std::{FloatDType, Shape, Slice};

use crate::backend::concrete::{AutodiffTensor, Visit, dispatch, moved};

/// `B`'s product of all elements, as one node when `B` is a listed autodiff backend.
pub(crate) fn float_prod<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    product::<B>(tensor, Product::All)
}

/// `B`'s product along `dim`, as one node when `B` is a listed autodiff backend.
pub(crate) fn float_prod_dim<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    product::<B>(tensor, Product::Dim(dim))
}

/// `B`'s cumulative product along `dim`, as one node when `B` is a listed autodiff backend.
pub(crate) fn float_cumprod<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    product::<B>(tensor, Product::Cumulative(dim))
}

#[derive(Debug, Clone, Copy)]
enum Product {
    All,
    Dim(usize),
    Cumulative(usize),
}

impl Product {
    fn forward<X: Backend>(self, x: FloatTensor<X>) -> FloatTensor<X> {
        match self {
            Product::All => X::float_prod(x),
            Product::Dim(dim) => X::float_prod_dim(x, dim),
            Product::Cumulative(dim) => X::float_cumprod(x, dim),
        }
    }

    /// The input's gradient from the input `x` and the output's gradient `g`.
    fn backward<X: Backend>(self, x: FloatTensor<X>, g: FloatTensor<X>) -> FloatTensor<X> {
        match self {
            Product::All => {
                let shape = x.shape();
                let flat = X::float_reshape(x, Shape::from(vec![shape.num_elements()]));
                let others = X::float_reshape(others_product::<X>(flat, 0), shape.clone());
                let g = X::float_reshape(g, Shape::from(vec![1; shape.num_dims()]));
                X::float_mul(others, g)
            }
            Product::Dim(dim) => X::float_mul(others_product::<X>(x, dim), g),
            Product::Cumulative(dim) => cumprod_backward::<X>(x, g, dim),
        }
    }
}

fn product<B: Backend>(tensor: FloatTensor<B>, kind: Product) -> FloatTensor<B> {
    struct Call<P> {
        tensor: P,
        kind: Product,
    }
    impl<P: 'static> Visit for Call<P> {
        type Out = P;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> P {
            moved(node::<X, C>(moved(self.tensor), self.kind))
        }
    }
    match dispatch::<B, _>(Call { tensor, kind }) {
        Ok(out) => out,
        // Not a listed autodiff backend: its own op (right on the backends' kernels).
        Err(call) => kind.forward::<B>(call.tensor),
    }
}

fn node<X: Backend, C: CheckpointStrategy>(
    tensor: AutodiffTensor<X>,
    kind: Product,
) -> AutodiffTensor<X> {
    match ProductBackward
        .prepare::<C>([tensor.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let input = prep.checkpoint(&tensor);
            let out = kind.forward::<X>(tensor.primitive);
            prep.finish((input, kind), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(kind.forward::<X>(tensor.primitive)),
    }
}

#[derive(Debug)]
struct ProductBackward;

impl<X: Backend> Backward<X, 1> for ProductBackward {
    type State = (NodeId, Product);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (input, kind) = ops.state;
        let x = checkpointer.retrieve_node_output(input);
        unary::<X, _>(ops.parents, ops.node, grads, |g| kind.backward::<X>(x, g));
    }
}

/// For each element, the product of the others along `dim`: exclusive products from the
/// start and from the end, multiplied.
fn others_product<X: Backend>(x: FloatTensor<X>, dim: usize) -> FloatTensor<X> {
    let shape = x.shape();
    let n = shape[dim];
    let device = X::float_device(&x);
    let dtype = FloatDType::from(x.dtype());
    if n == 1 {
        return X::float_ones(shape, &device, dtype);
    }
    let mut edge = shape.clone();
    edge[dim] = 1;
    let ones = X::float_ones(edge, &device, dtype);
    let from_start = X::float_cumprod(x.clone(), dim);
    let from_end = reversed::<X>(X::float_cumprod(reversed::<X>(x, dim), dim), dim);
    let before = X::float_cat(
        vec![ones.clone(), narrow::<X>(from_start, dim, 0, n - 1)],
        dim,
    );
    let after = X::float_cat(vec![narrow::<X>(from_end, dim, 1, n), ones], dim);
    X::float_mul(before, after)
}

/// `cumprod`'s input gradient, right at zeros (see the module docs).
fn cumprod_backward<X: Backend>(
    x: FloatTensor<X>,
    g: FloatTensor<X>,
    dim: usize,
) -> FloatTensor<X> {
    let device = X::float_device(&x);
    let bools = get_device_settings::<X>(&device).bool_dtype;
    let dtype = FloatDType::from(x.dtype());
    let is_zero = X::float_equal_elem(x.clone(), Scalar::Float(0.0), bools);
    let zero_count = X::bool_into_float(is_zero.clone(), dtype);
    let zeros_through = X::float_cumsum(zero_count.clone(), dim);
    let zeros_before = X::float_sub(zeros_through.clone(), zero_count);
    let no_zero_through = X::float_equal_elem(zeros_through, Scalar::Float(0.0), bools);
    let no_zero_before = X::float_equal_elem(zeros_before, Scalar::Float(0.0), bools);
    let first_zero = X::bool_and(is_zero.clone(), no_zero_before.clone());

    // Before the first zero: Σ_{j≥i} g_j y_j / x_i (terms past the zero are 0 in y too).
    let y = X::float_cumprod(x.clone(), dim);
    let x_nonzero = X::float_mask_fill(x.clone(), is_zero, Scalar::Float(1.0));
    let before = X::float_div(
        reverse_cumsum::<X>(X::float_mul(g.clone(), y), dim),
        x_nonzero,
    );
    // At it: the product before it, times Σ_{j≥z} g_j ∏_{z<k≤j} x_k.
    let leading = X::float_prod_dim(
        X::float_mask_fill(
            x.clone(),
            X::bool_not(no_zero_through.clone()),
            Scalar::Float(1.0),
        ),
        dim,
    );
    let trailing = X::float_cumprod(
        X::float_mask_fill(x, no_zero_before, Scalar::Float(1.0)),
        dim,
    );
    let at = X::float_mul(leading, reverse_cumsum::<X>(X::float_mul(g, trailing), dim));
    let zero = X::float_zeros(at.shape(), &device, dtype);
    let grad = X::float_mask_where(zero, no_zero_through, before);
    X::float_mask_where(grad, first_zero, at)
}

fn reverse_cumsum<X: Backend>(t: FloatTensor<X>, dim: usize) -> FloatTensor<X> {
    reversed::<X>(X::float_cumsum(reversed::<X>(t, dim), dim), dim)
}

fn reversed<X: Backend>(t: FloatTensor<X>, dim: usize) -> FloatTensor<X> {
    X::float_flip(t, &[dim])
}

fn narrow<X: Backend>(t: FloatTensor<X>, dim: usize, start: usize, end: usize) -> FloatTensor<X> {
    let mut slices = vec![Slice::full(); t.shape().num_dims()];
    slices[dim] = Slice::new(start as isize, Some(end as isize), 1);
    X::float_slice(t, &slices)
}
