//! Views whose result is empty, float, int and bool: a new empty tensor, not a view.
//!
//! A view launches nothing itself, but Burn's fusion fuses a view of an empty tensor into the
//! next elementwise block, whose kernel then takes the view's empty shape for its grid
//! (measured for `reshape` through the stand-in driver: a zero grid, refused). A view can also
//! be empty when its input is not: `expand` or `repeat_dim` to a zero size, `unfold` with
//! fewer elements than a window. Under autodiff a float result is one node over the input,
//! whose gradient is zeros of its shape (the view's backward over an empty gradient).

use burn_backend::ops::unfold::calculate_unfold_shape;
use burn_backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn_backend::{Backend, TensorMetadata};
use burn_std::Shape;

use super::super::{flex_views, repeat};
use super::is_empty;
use super::kind::{Bool, Float, Int, Kind};

// The shape rules of the views, as Burn's.

/// Reshape and expand: the shape given.
fn given(_: Shape, shape: Shape) -> Shape {
    shape
}

fn transposed(mut shape: Shape) -> Shape {
    let rank = shape.num_dims();
    if rank >= 2 {
        shape.swap(rank - 2, rank - 1);
    }
    shape
}

fn swapped(mut shape: Shape, dim1: usize, dim2: usize) -> Shape {
    shape.swap(dim1, dim2);
    shape
}

fn permuted(shape: Shape, axes: &[usize]) -> Shape {
    Shape::from(axes.iter().map(|&axis| shape[axis]).collect::<Vec<_>>())
}

fn repeated(mut shape: Shape, dim: usize, times: usize) -> Shape {
    shape[dim] *= times;
    shape
}

fn unfolded(shape: Shape, dim: usize, size: usize, step: usize) -> Shape {
    calculate_unfold_shape(shape, dim, size, step)
}

/// The gate of a view that changes the number of elements: its result can be empty whatever
/// its input. One that keeps it is gated by `is_empty` (its input's): the common case costs a
/// shape read, not a shape computed.
fn any_input<T>(_: &T) -> bool {
    true
}

/// Each view of a kind: when `gate` lets it, its result by `rule` from the input's shape and
/// the view's arguments; when empty, made here, else `B`'s view (`inner`).
macro_rules! views {
    ($($kind:ident($tensor:ident) $name:ident($($arg:ident: $ty:ty),*) if $gate:ident by $rule:ident, else $inner:expr;)*) => {$(
        #[allow(clippy::clone_on_copy)]
        pub(crate) fn $name<B: Backend>(tensor: $tensor<B>, $($arg: $ty),*) -> $tensor<B> {
            if $gate(&tensor) {
                let out = $rule(tensor.shape() $(, $arg.clone())*);
                if out.num_elements() == 0 {
                    return <$kind as Kind<B>>::empty_over(vec![tensor], out);
                }
            }
            $inner(tensor $(, $arg)*)
        }
    )*};
}

views! {
    Float(FloatTensor) float_reshape(shape: Shape) if is_empty by given, else B::float_reshape;
    Float(FloatTensor) float_transpose() if is_empty by transposed, else flex_views::float_transpose::<B>;
    Float(FloatTensor) float_swap_dims(dim1: usize, dim2: usize) if is_empty by swapped, else flex_views::float_swap_dims::<B>;
    Float(FloatTensor) float_permute(axes: &[usize]) if is_empty by permuted, else flex_views::float_permute::<B>;
    Float(FloatTensor) float_expand(shape: Shape) if any_input by given, else B::float_expand;
    Float(FloatTensor) float_repeat_dim(dim: usize, times: usize) if any_input by repeated, else repeat::float_repeat_dim::<B>;
    Float(FloatTensor) float_unfold(dim: usize, size: usize, step: usize) if any_input by unfolded, else B::float_unfold;
    Int(IntTensor) int_reshape(shape: Shape) if is_empty by given, else B::int_reshape;
    Int(IntTensor) int_transpose() if is_empty by transposed, else B::int_transpose;
    Int(IntTensor) int_swap_dims(dim1: usize, dim2: usize) if is_empty by swapped, else B::int_swap_dims;
    Int(IntTensor) int_permute(axes: &[usize]) if is_empty by permuted, else B::int_permute;
    Int(IntTensor) int_expand(shape: Shape) if any_input by given, else B::int_expand;
    Int(IntTensor) int_repeat_dim(dim: usize, times: usize) if any_input by repeated, else B::int_repeat_dim;
    Int(IntTensor) int_unfold(dim: usize, size: usize, step: usize) if any_input by unfolded, else B::int_unfold;
    Bool(BoolTensor) bool_reshape(shape: Shape) if is_empty by given, else B::bool_reshape;
    Bool(BoolTensor) bool_transpose() if is_empty by transposed, else B::bool_transpose;
    Bool(BoolTensor) bool_swap_dims(dim1: usize, dim2: usize) if is_empty by swapped, else B::bool_swap_dims;
    Bool(BoolTensor) bool_permute(axes: &[usize]) if is_empty by permuted, else B::bool_permute;
    Bool(BoolTensor) bool_expand(shape: Shape) if any_input by given, else B::bool_expand;
    Bool(BoolTensor) bool_repeat_dim(dim: usize, times: usize) if any_input by repeated, else B::bool_repeat_dim;
    Bool(BoolTensor) bool_unfold(dim: usize, size: usize, step: usize) if any_input by unfolded, else B::bool_unfold;
}

#[cfg(test)]
mod tests {
    use super::super::tests::s;
    use super::*;

    #[test]
    fn view_shapes_follow_burn() {
        assert_eq!(transposed(s(&[2, 0, 3])), s(&[2, 3, 0]));
        assert_eq!(swapped(s(&[2, 0, 3]), 0, 1), s(&[0, 2, 3]));
        assert_eq!(permuted(s(&[2, 0, 3]), &[2, 0, 1]), s(&[3, 2, 0]));
        assert_eq!(repeated(s(&[2, 3]), 1, 0), s(&[2, 0]));
        assert_eq!(
            unfolded(s(&[2, 3]), 1, 4, 1),
            s(&[2, 0, 4]),
            "fewer than a window"
        );
        assert_eq!(unfolded(s(&[2, 6]), 1, 3, 2), s(&[2, 2, 3]));
    }
}
