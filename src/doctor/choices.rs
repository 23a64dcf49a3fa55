//! Choices: what an op picks by comparing floats (indices, a mask), and how the precision
//! report compares them with the f32 run's.

use core::any::Any;

use burn::tensor::{Bool, Int, Tensor};
use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::Shape;

use super::ProbedOp;
use crate::backend::Op;

/// Ops that choose by comparing float values (a router's top-k experts, a classifier's
/// prediction, a bucket, a threshold's mask): in half precision a near tie can choose
/// otherwise than f32 does. Their choices are indices or booleans, not floats to measure.
/// (`is_nan` and `is_inf` are not: what they tell apart is the report's overflow.)
pub(super) fn makes_choices(op: ProbedOp) -> bool {
    use Op::*;
    makes_indices_alone(op)
        || makes_mask(op)
        || matches!(
            op,
            ProbedOp::Table(
                float_max_dim_with_indices | float_min_dim_with_indices | float_sort_with_indices
            )
        )
}

/// Ops whose one output is indices.
pub(super) fn makes_indices_alone(op: ProbedOp) -> bool {
    use Op::*;
    matches!(
        op,
        ProbedOp::Table(
            float_argmax | float_argmin | float_argtopk | float_argsort | float_into_int
        )
    )
}

/// Comparisons: their choices are a bool mask.
pub(super) fn makes_mask(op: ProbedOp) -> bool {
    use Op::*;
    matches!(
        op,
        ProbedOp::Table(
            float_equal
                | float_not_equal
                | float_greater
                | float_greater_equal
                | float_lower
                | float_lower_equal
                | float_equal_elem
                | float_not_equal_elem
                | float_greater_elem
                | float_greater_equal_elem
                | float_lower_elem
                | float_lower_equal_elem
        )
    )
}

/// An output of choices: indices (an int tensor) or a mask (a bool tensor).
pub(crate) enum Chosen<'a, B: Backend> {
    Indices(&'a B::IntTensorPrimitive),
    Mask(&'a B::BoolTensorPrimitive),
}

impl<'a, B: Backend> Chosen<'a, B> {
    /// The choices in a table op's output: a comparison's mask, an int tensor, or the second
    /// half of a (values, indices) pair. By the op, not the output's type: most backends'
    /// int, bool and float tensors are one type.
    pub(super) fn of(op: ProbedOp, output: &'a dyn Any) -> Option<Self> {
        if makes_mask(op) {
            return output
                .downcast_ref::<B::BoolTensorPrimitive>()
                .map(Self::Mask);
        }
        output
            .downcast_ref::<B::IntTensorPrimitive>()
            .or_else(|| {
                output
                    .downcast_ref::<(B::FloatTensorPrimitive, B::IntTensorPrimitive)>()
                    .map(|(_, i)| i)
            })
            .map(Self::Indices)
    }

    pub(super) fn shape(&self) -> Vec<usize> {
        match self {
            Self::Indices(t) => t.shape().to_vec(),
            Self::Mask(t) => t.shape().to_vec(),
        }
    }

    pub(super) fn dtype(&self) -> DType {
        match self {
            Self::Indices(t) => t.dtype(),
            Self::Mask(t) => t.dtype(),
        }
    }

    /// The choices on the host: indices as they are, a mask as 0 and 1.
    pub(super) fn host(&self) -> Vec<i64> {
        let data = match self {
            Self::Indices(t) => {
                let n = t.shape().num_elements();
                let t = B::int_reshape((*t).clone(), Shape::new([n]));
                Tensor::<B, 1, Int>::from_primitive(t).into_data()
            }
            Self::Mask(t) => {
                let n = t.shape().num_elements();
                let t = B::bool_reshape((*t).clone(), Shape::new([n]));
                Tensor::<B, 1, Bool>::from_primitive(t).into_data()
            }
        };
        data.iter::<i64>().collect()
    }
}

/// The share of an op's choices that differ from the f32 run's. Along `dim`: the k indices
/// of a top-k as a set (the same experts in another order is the same routing), a sort's
/// first place alone (ties further down are common and a top-k by sort, Burn's
/// `topk_with_indices`, keeps the head). Elsewhere value by value (argmax's one index per
/// row, `into_int`'s values, a mask's).
pub(super) fn differing_choices(
    op: ProbedOp,
    shape: &[usize],
    dim: Option<usize>,
    reference: &[i64],
    chosen: &[i64],
) -> f64 {
    use crate::backend::Op::{float_argsort, float_argtopk, float_sort_with_indices};
    #[derive(PartialEq)]
    enum Along {
        Set,
        First,
    }
    let along = match (op, dim) {
        (ProbedOp::Table(float_argtopk), Some(dim)) => Some((dim, Along::Set)),
        (ProbedOp::Table(float_argsort | float_sort_with_indices), Some(dim)) => {
            Some((dim, Along::First))
        }
        _ => None,
    };
    let n = reference.len().min(chosen.len());
    let (differ, total) = match along {
        Some((dim, along)) if dim < shape.len() && shape[dim] > 0 && n > 0 => {
            let len = shape[dim];
            let inner: usize = shape[dim + 1..].iter().product();
            let outer = n / (len * inner);
            let (mut differ, mut total) = (0usize, 0usize);
            for o in 0..outer {
                for i in 0..inner {
                    let at = |j: usize| (o * len + j) * inner + i;
                    if along == Along::First {
                        total += 1;
                        differ += usize::from(reference[at(0)] != chosen[at(0)]);
                        continue;
                    }
                    for j in 0..len {
                        total += 1;
                        let c = chosen[at(j)];
                        differ += usize::from(!(0..len).any(|q| reference[at(q)] == c));
                    }
                }
            }
            (differ, total)
        }
        _ => (
            reference.iter().zip(chosen).filter(|(a, b)| a != b).count(),
            n,
        ),
    };
    differ as f64 / total.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_are_compared_as_the_op_makes_them() {
        use crate::backend::Op;
        let reference = [0, 1, 2, 3, 3, 0];
        let chosen = [1, 0, 2, 3, 1, 0];
        let share = |op, shape: &[usize], dim| {
            differing_choices(ProbedOp::Table(op), shape, Some(dim), &reference, &chosen)
        };
        // Top-2 of 3 rows along dim 1: the same experts in another order is no difference;
        // row 2 swapped expert 3 for 1.
        assert_eq!(share(Op::float_argtopk, &[3, 2], 1), 1.0 / 6.0);
        // The same indices compared one by one (an argmax's): 3 of 6.
        assert_eq!(share(Op::float_argmax, &[3, 2], 1), 0.5);
        // A sort along dim 0 of a [2, 3]: its rows are the columns; the first place of
        // column 0 (0 vs 1) and column 1 (1 vs 0) differ, column 2's (2 vs 2) not.
        assert_eq!(share(Op::float_sort_with_indices, &[2, 3], 0), 2.0 / 3.0);
    }
}
