//! Flex 0.21's sum along a dimension of a strided view: `sum_dim` and `mean_dim` read the
//! rows of a view whose reduced dimension has stride 1 and whose other dimension does not
//! (a transposed view: `x.narrow(1, 0, 4).swap_dims(0, 1)`) as if they were packed one after
//! the other, in f32: wrong sums, silently (`[6, 22, 38, 54]` for `[6, 38, 70, 102]`), or
//! a panic past the buffer's end when the view is also flipped ("src too short"). Here such
//! a view is copied into a packed tensor first (what Flex does itself for views of more
//! dimensions), on `Flex` and `Autodiff<Flex>`; other backends are handed the tensor as is.

use core::any::TypeId;

use burn::backend::flex::FlexTensor;
use burn_backend::Backend;
use burn_backend::tensor::FloatTensor;

use crate::backend::concrete::{AutodiffTensor, moved};

/// `B`'s sum along `dim`, a strided Flex view packed first.
pub(crate) fn float_sum_dim<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    B::float_sum_dim(packed::<B>(tensor), dim)
}

/// `B`'s mean along `dim`, a strided Flex view packed first.
pub(crate) fn float_mean_dim<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    B::float_mean_dim(packed::<B>(tensor), dim)
}

/// `tensor` with its Flex storage packed, when it is a Flex view (not contiguous); the same
/// values, and under autodiff the same node.
fn packed<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    let pack = |t: FlexTensor| {
        if t.is_contiguous() {
            t
        } else {
            t.to_contiguous()
        }
    };
    let ty = TypeId::of::<FloatTensor<B>>();
    if ty == TypeId::of::<FlexTensor>() {
        return moved(pack(moved(tensor)));
    }
    if ty == TypeId::of::<AutodiffTensor<burn::backend::Flex>>() {
        let mut t: AutodiffTensor<burn::backend::Flex> = moved(tensor);
        t.primitive = pack(t.primitive);
        return moved(t);
    }
    tensor
}
