//! Every op of the policy table, exercised once through `Amp<B>` against `B` in f32.
//!
//! Each entry: the op, its float inputs with their shapes (the harness makes them in the
//! dtypes its category meets in a real run), and one call. Non-float outputs are turned
//! into f32 tensors so that they can be compared too.

use burn_amp::Amp;
use burn_amp::backend::Op;
use burn_backend::ops::{
    ActivationOps, AttentionModuleOptions, ConvOptions, ConvTransposeOptions, DeformConvOptions,
    GridSampleOptions, InterpolateMode, InterpolateOptions, UnfoldOptions,
};
use burn_backend::tensor::{FloatTensor, IndexingUpdateOp, IntTensor};
use burn_backend::{Backend, Distribution, Scalar, TensorData, get_device_settings, read_sync};
use burn_std::{FloatDType, Shape, Slice};

use super::harness::{Expect, Harness};

macro_rules! expect {
    () => {
        Expect {
            dtype: None,
            values: true,
        }
    };
    (novalues) => {
        Expect {
            dtype: None,
            values: false,
        }
    };
    ($dt:ident) => {
        Expect {
            dtype: Some(FloatDType::$dt),
            values: true,
        }
    };
    ($dt:ident, novalues) => {
        Expect {
            dtype: Some(FloatDType::$dt),
            values: false,
        }
    };
}

macro_rules! ex {
    ($h:ident, $op:ident $([$($flag:tt)*])?, [$($x:ident: [$($d:expr),*]),*], |$X:ident, $dev:ident| $e:expr) => {{
        #[allow(unused_variables, unused_mut, clippy::redundant_clone)]
        fn run<$X: Backend>($dev: &$X::Device, inputs: Vec<FloatTensor<$X>>) -> FloatTensor<$X> {
            let mut inputs = inputs.into_iter();
            $(let $x = inputs.next().unwrap();)*
            $e
        }
        $h.check(
            Op::$op,
            &[$(&[$($d),*]),*],
            expect!($($($flag)*)?),
            |d, i| run::<Amp<B>>(d, i),
            |d, i| run::<B>(d, i),
            |d, i| run::<Amp<burn::backend::Flex>>(d, i),
        );
    }};
}

fn f(v: f64) -> Scalar {
    Scalar::Float(v)
}

fn ints<X: Backend>(d: &X::Device, values: &[i64], shape: &[usize]) -> IntTensor<X> {
    let data = TensorData::new(values.to_vec(), shape.to_vec());
    let data = data.convert_dtype(get_device_settings::<X>(d).int_dtype.into());
    X::int_from_data(data, d)
}

fn mask<X: Backend>(d: &X::Device, shape: &[usize]) -> burn_backend::tensor::BoolTensor<X> {
    let n: usize = shape.iter().product();
    let values: Vec<bool> = (0..n).map(|i| i % 3 == 0).collect();
    let data = TensorData::new(values, shape.to_vec());
    X::bool_from_data(data.convert_dtype(burn_std::DType::Bool(bd::<X>(d))), d)
}

/// Bool results as f32 0/1, for comparison.
fn b2f<X: Backend>(t: burn_backend::tensor::BoolTensor<X>) -> FloatTensor<X> {
    X::bool_into_float(t, FloatDType::F32)
}

/// Int results as f32, for comparison.
fn i2f<X: Backend>(t: IntTensor<X>) -> FloatTensor<X> {
    X::int_into_float(t, FloatDType::F32)
}

fn bd<X: Backend>(d: &X::Device) -> burn_std::BoolDType {
    get_device_settings::<X>(d).bool_dtype
}

fn id<X: Backend>(d: &X::Device) -> burn_std::IntDType {
    get_device_settings::<X>(d).int_dtype
}

/// Exercises the float ops of `FloatTensorOps`.
pub fn float_ops<B: Backend>(h: &mut Harness<B>) {
    // Creation and data: the dtype the caller asked for.
    ex!(h, float_from_data[F32], [], |X, d| X::float_from_data(
        TensorData::new(vec![1.0f32, 2.5], [2]),
        d
    ));
    ex!(h, float_random[F32, novalues], [], |X, d| X::float_random(Shape::new([2, 3]), Distribution::Default, d, FloatDType::F32));
    ex!(h, float_zeros[F32], [], |X, d| X::float_zeros(
        Shape::new([2, 3]),
        d,
        FloatDType::F32
    ));
    ex!(h, float_ones[F32], [], |X, d| X::float_ones(
        Shape::new([2, 3]),
        d,
        FloatDType::F32
    ));
    ex!(h, float_full[F32], [], |X, d| X::float_full(
        Shape::new([2, 3]),
        f(2.5),
        d,
        FloatDType::F32
    ));
    ex!(h, float_empty[F32, novalues], [], |X, d| X::float_empty(Shape::new([2, 3]), d, FloatDType::F32));
    ex!(h, float_into_data, [a: [4, 6]], |X, d| X::float_from_data(read_sync(X::float_into_data(a)).unwrap(), d));
    ex!(h, float_device, [a: [4, 6]], |X, d| { let dev = X::float_device(&a); X::float_to_device(a, &dev) });
    ex!(h, float_to_device, [a: [4, 6]], |X, d| X::float_to_device(a, d));
    ex!(h, float_into_int[F32], [a: [4, 6]], |X, d| i2f::<X>(X::float_into_int(X::float_mul_scalar(a, f(4.0)), id::<X>(d))));
    ex!(h, float_cast[F32], [a: [4, 6]], |X, d| X::float_cast(a, FloatDType::F32));
    ex!(h, float_detach, [a: [4, 6]], |X, d| X::float_detach(a));
    ex!(h, float_set_require_grad, [a: [4, 6]], |X, d| X::float_set_require_grad(a, false));
    ex!(h, float_is_require_grad, [a: [4, 6]], |X, d| { assert!(!X::float_is_require_grad(&a)); a });

    // Binary arithmetic: promote.
    ex!(h, float_add, [a: [4, 6], b: [4, 6]], |X, d| X::float_add(a, b));
    ex!(h, float_sub, [a: [4, 6], b: [4, 6]], |X, d| X::float_sub(a, b));
    ex!(h, float_mul, [a: [4, 6], b: [4, 6]], |X, d| X::float_mul(a, b));
    ex!(h, float_div, [a: [4, 6], b: [4, 6]], |X, d| X::float_div(a, b));
    ex!(h, float_remainder, [a: [4, 6], b: [4, 6]], |X, d| X::float_remainder(a, b));
    ex!(h, float_atan2, [a: [4, 6], b: [4, 6]], |X, d| X::float_atan2(a, b));
    ex!(h, float_cross, [a: [4, 3], b: [4, 3]], |X, d| X::float_cross(a, b, 1));

    // Scalar operands: pass-through.
    ex!(h, float_add_scalar, [a: [4, 6]], |X, d| X::float_add_scalar(a, f(0.5)));
    ex!(h, float_sub_scalar, [a: [4, 6]], |X, d| X::float_sub_scalar(a, f(0.5)));
    ex!(h, float_mul_scalar, [a: [4, 6]], |X, d| X::float_mul_scalar(a, f(3.0)));
    ex!(h, float_div_scalar, [a: [4, 6]], |X, d| X::float_div_scalar(a, f(4.0)));
    ex!(h, float_remainder_scalar, [a: [4, 6]], |X, d| X::float_remainder_scalar(a, f(0.37)));
    ex!(h, float_clamp, [a: [4, 6]], |X, d| X::float_clamp(a, f(0.3), f(0.6)));
    ex!(h, float_clamp_min, [a: [4, 6]], |X, d| X::float_clamp_min(a, f(0.3)));
    ex!(h, float_clamp_max, [a: [4, 6]], |X, d| X::float_clamp_max(a, f(0.6)));
    ex!(h, float_mask_fill, [a: [4, 6]], |X, d| X::float_mask_fill(a, mask::<X>(d, &[4, 6]), f(0.5)));
    ex!(h, float_equal_elem[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_equal_elem(a, f(0.5), bd::<X>(d))));
    ex!(h, float_not_equal_elem[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_not_equal_elem(a, f(0.5), bd::<X>(d))));
    ex!(h, float_greater_elem[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_greater_elem(a, f(0.5), bd::<X>(d))));
    ex!(h, float_greater_equal_elem[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_greater_equal_elem(a, f(0.5), bd::<X>(d))));
    ex!(h, float_lower_elem[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_lower_elem(a, f(0.5), bd::<X>(d))));
    ex!(h, float_lower_equal_elem[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_lower_equal_elem(a, f(0.5), bd::<X>(d))));

    // Comparisons: promoted, bool out.
    ex!(h, float_equal[F32], [a: [4, 6], b: [4, 6]], |X, d| b2f::<X>(X::float_equal(a, b, bd::<X>(d))));
    ex!(h, float_not_equal[F32], [a: [4, 6], b: [4, 6]], |X, d| b2f::<X>(X::float_not_equal(a, b, bd::<X>(d))));
    ex!(h, float_greater[F32], [a: [4, 6], b: [4, 6]], |X, d| b2f::<X>(X::float_greater(a, b, bd::<X>(d))));
    ex!(h, float_greater_equal[F32], [a: [4, 6], b: [4, 6]], |X, d| b2f::<X>(X::float_greater_equal(a, b, bd::<X>(d))));
    ex!(h, float_lower[F32], [a: [4, 6], b: [4, 6]], |X, d| b2f::<X>(X::float_lower(a, b, bd::<X>(d))));
    ex!(h, float_lower_equal[F32], [a: [4, 6], b: [4, 6]], |X, d| b2f::<X>(X::float_lower_equal(a, b, bd::<X>(d))));

    // Lower precision.
    ex!(h, float_matmul, [a: [4, 6], b: [6, 5]], |X, d| X::float_matmul(a, b));

    // Layout and indexing: pass-through, or promote where a second float tensor comes in.
    ex!(h, float_transpose, [a: [4, 6]], |X, d| X::float_transpose(a));
    ex!(h, float_swap_dims, [a: [4, 6]], |X, d| X::float_swap_dims(a, 0, 1));
    ex!(h, float_permute, [a: [4, 6]], |X, d| X::float_permute(a, &[1, 0]));
    ex!(h, float_flip, [a: [4, 6]], |X, d| X::float_flip(a, &[0]));
    ex!(h, float_reshape, [a: [4, 6]], |X, d| X::float_reshape(a, Shape::new([6, 4])));
    ex!(h, float_expand, [a: [1, 6]], |X, d| X::float_expand(a, Shape::new([4, 6])));
    ex!(h, float_repeat_dim, [a: [4, 6]], |X, d| X::float_repeat_dim(a, 0, 2));
    ex!(h, float_slice, [a: [4, 6]], |X, d| X::float_slice(a, &[Slice::from(1..3)]));
    ex!(h, float_slice_assign, [a: [4, 6], b: [2, 6]], |X, d| X::float_slice_assign(a, &[Slice::from(1..3)], b));
    ex!(h, float_select, [a: [4, 6]], |X, d| X::float_select(a, 0, ints::<X>(d, &[3, 1], &[2])));
    ex!(h, float_select_add, [a: [4, 6], b: [2, 6]], |X, d| X::float_select_add(a, 0, ints::<X>(d, &[3, 1], &[2]), b));
    ex!(h, float_gather, [a: [4, 6]], |X, d| X::float_gather(1, a, ints::<X>(d, &[0, 5, 1, 4, 2, 3, 3, 0], &[4, 2])));
    ex!(h, float_scatter_add, [a: [4, 6], b: [4, 2]], |X, d| X::float_scatter_add(1, a, ints::<X>(d, &[0, 5, 1, 4, 2, 3, 3, 0], &[4, 2]), b));
    ex!(h, float_gather_nd, [a: [4, 6]], |X, d| X::float_gather_nd(a, ints::<X>(d, &[2, 0], &[2, 1])));
    ex!(h, float_scatter_nd, [a: [4, 6], b: [2, 6]], |X, d| X::float_scatter_nd(a, ints::<X>(d, &[2, 0], &[2, 1]), b, IndexingUpdateOp::Add));
    ex!(h, float_mask_where, [a: [4, 6], b: [4, 6]], |X, d| X::float_mask_where(a, mask::<X>(d, &[4, 6]), b));
    ex!(h, float_cat, [a: [4, 6], b: [2, 6]], |X, d| X::float_cat(vec![a, b], 0));
    ex!(h, float_unfold, [a: [4, 6]], |X, d| X::float_unfold(a, 1, 2, 2));

    // f32: exp / log family.
    ex!(h, float_exp, [a: [4, 6]], |X, d| X::float_exp(a));
    ex!(h, float_log, [a: [4, 6]], |X, d| X::float_log(a));
    ex!(h, float_log1p, [a: [4, 6]], |X, d| X::float_log1p(a));
    ex!(h, float_recip, [a: [4, 6]], |X, d| X::float_recip(a));
    ex!(h, float_erf, [a: [4, 6]], |X, d| X::float_erf(a));
    ex!(h, float_tan, [a: [4, 6]], |X, d| X::float_tan(a));
    ex!(h, float_sinh, [a: [4, 6]], |X, d| X::float_sinh(a));
    ex!(h, float_cosh, [a: [4, 6]], |X, d| X::float_cosh(a));
    ex!(h, float_asin, [a: [4, 6]], |X, d| X::float_asin(a));
    ex!(h, float_acos, [a: [4, 6]], |X, d| X::float_acos(a));
    ex!(h, float_atanh, [a: [4, 6]], |X, d| X::float_atanh(a));
    ex!(h, float_powf, [a: [4, 6], b: [4, 6]], |X, d| X::float_powf(a, b));
    ex!(h, float_powi, [a: [4, 6]], |X, d| X::float_powi(a, ints::<X>(d, &[2; 24], &[4, 6])));
    ex!(h, float_powi_scalar, [a: [4, 6]], |X, d| X::float_powi_scalar(a, Scalar::Int(3)));
    ex!(h, float_powi_scalar_impl, [a: [4, 6]], |X, d| X::float_powi_scalar_impl(a, Scalar::Int(3)));
    ex!(h, float_powf_scalar, [a: [4, 6]], |X, d| X::float_powf_scalar(a, f(1.5)));
    ex!(h, float_powf_scalar_impl, [a: [4, 6]], |X, d| X::float_powf_scalar_impl(a, f(1.5)));

    // f32: accumulating reductions.
    ex!(h, float_sum, [a: [4, 6]], |X, d| X::float_sum(a));
    ex!(h, float_sum_dim, [a: [4, 6]], |X, d| X::float_sum_dim(a, 1));
    ex!(h, float_mean, [a: [4, 6]], |X, d| X::float_mean(a));
    ex!(h, float_mean_dim, [a: [4, 6]], |X, d| X::float_mean_dim(a, 0));
    ex!(h, float_prod, [a: [2, 4]], |X, d| X::float_prod(a));
    ex!(h, float_prod_dim, [a: [4, 6]], |X, d| X::float_prod_dim(a, 1));
    ex!(h, float_cumsum, [a: [4, 6]], |X, d| X::float_cumsum(a, 1));
    ex!(h, float_cumprod, [a: [4, 6]], |X, d| X::float_cumprod(a, 1));

    // Pass-through elementwise.
    ex!(h, float_neg, [a: [4, 6]], |X, d| X::float_neg(a));
    ex!(h, float_abs, [a: [4, 6]], |X, d| X::float_abs(a));
    ex!(h, float_sqrt, [a: [4, 6]], |X, d| X::float_sqrt(a));
    ex!(h, float_sin, [a: [4, 6]], |X, d| X::float_sin(a));
    ex!(h, float_cos, [a: [4, 6]], |X, d| X::float_cos(a));
    ex!(h, float_tanh, [a: [4, 6]], |X, d| X::float_tanh(a));
    ex!(h, float_acosh, [a: [4, 6]], |X, d| X::float_acosh(X::float_add_scalar(a, f(1.0))));
    ex!(h, float_asinh, [a: [4, 6]], |X, d| X::float_asinh(a));
    ex!(h, float_atan, [a: [4, 6]], |X, d| X::float_atan(a));
    ex!(h, float_round, [a: [4, 6]], |X, d| X::float_round(X::float_mul_scalar(a, f(4.0))));
    ex!(h, float_floor, [a: [4, 6]], |X, d| X::float_floor(X::float_mul_scalar(a, f(4.0))));
    ex!(h, float_ceil, [a: [4, 6]], |X, d| X::float_ceil(X::float_mul_scalar(a, f(4.0))));
    ex!(h, float_trunc, [a: [4, 6]], |X, d| X::float_trunc(X::float_mul_scalar(a, f(4.0))));
    ex!(h, float_sign, [a: [4, 6]], |X, d| X::float_sign(X::float_sub_scalar(a, f(0.5))));
    ex!(h, float_is_nan[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_is_nan(a, bd::<X>(d))));
    ex!(h, float_is_inf[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_is_inf(a, bd::<X>(d))));

    // Exact in any dtype: pass-through.
    ex!(h, float_max, [a: [4, 6]], |X, d| X::float_max(a));
    ex!(h, float_max_dim, [a: [4, 6]], |X, d| X::float_max_dim(a, 1));
    ex!(h, float_max_dim_with_indices, [a: [4, 6]], |X, d| X::float_max_dim_with_indices(a, 1, id::<X>(d)).0);
    ex!(h, float_min, [a: [4, 6]], |X, d| X::float_min(a));
    ex!(h, float_min_dim, [a: [4, 6]], |X, d| X::float_min_dim(a, 1));
    ex!(h, float_min_dim_with_indices, [a: [4, 6]], |X, d| X::float_min_dim_with_indices(a, 1, id::<X>(d)).0);
    ex!(h, float_max_abs, [a: [4, 6]], |X, d| X::float_max_abs(a));
    ex!(h, float_max_abs_dim, [a: [4, 6]], |X, d| X::float_max_abs_dim(a, 0));
    ex!(h, float_argmax[F32], [a: [4, 6]], |X, d| i2f::<X>(X::float_argmax(a, 1, id::<X>(d))));
    ex!(h, float_argmin[F32], [a: [4, 6]], |X, d| i2f::<X>(X::float_argmin(a, 1, id::<X>(d))));
    ex!(h, float_argtopk[F32], [a: [4, 6]], |X, d| i2f::<X>(X::float_argtopk(a, 1, 2, id::<X>(d))));
    ex!(h, float_topk, [a: [4, 6]], |X, d| X::float_topk(a, 1, 2));
    ex!(h, float_cummin, [a: [4, 6]], |X, d| X::float_cummin(a, 1));
    ex!(h, float_cummax, [a: [4, 6]], |X, d| X::float_cummax(a, 1));
    ex!(h, float_sort, [a: [4, 6]], |X, d| X::float_sort(a, 1, false));
    ex!(h, float_sort_with_indices, [a: [4, 6]], |X, d| X::float_sort_with_indices(a, 1, true, id::<X>(d)).0);
    ex!(h, float_argsort[F32], [a: [4, 6]], |X, d| i2f::<X>(X::float_argsort(a, 1, false, id::<X>(d))));
    ex!(h, float_any[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_any(a, bd::<X>(d))));
    ex!(h, float_any_dim[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_any_dim(a, 1, bd::<X>(d))));
    ex!(h, float_all[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_all(a, bd::<X>(d))));
    ex!(h, float_all_dim[F32], [a: [4, 6]], |X, d| b2f::<X>(X::float_all_dim(a, 1, bd::<X>(d))));

    // f32: resampling.
    ex!(h, float_grid_sample_2d, [x: [1, 1, 4, 4], grid: [1, 2, 2, 2]], |X, d| X::float_grid_sample_2d(x, grid, GridSampleOptions::default()));
}

/// Exercises every op of the table: `FloatTensorOps`, `ActivationOps`, `ModuleOps`.
pub fn every_op<B: Backend>(h: &mut Harness<B>) {
    float_ops(h);
    activation_ops(h);
    module_ops(h);
}

/// Every op through `Amp<B>` with autocast off against the same op on Flex
/// ([`Harness::against_flex`]), on inputs in [0.1, 0.9] (every op's domain), then in [-4, 4]
/// (negatives: NaN alike where out of the domain). The ops compared on each span, or what
/// differed.
pub fn agree_with_flex<B: Backend>(device: &B::Device, tf32: bool) -> Result<[usize; 2], String> {
    let mut agreed = [0; 2];
    for (count, (lo, hi)) in agreed.iter_mut().zip([(0.1, 0.9), (-4.0, 4.0)]) {
        let mut h = Harness::<B>::against_flex(device.clone(), tf32).with_span(lo, hi);
        every_op(&mut h);
        if !h.failures.is_empty() {
            return Err(format!(
                "{} ops differ from Flex's in f32 on [{lo}, {hi}]:\n{}",
                h.failures.len(),
                h.failures.join("\n")
            ));
        }
        *count = h.exercised.len() - h.unsupported.len();
    }
    Ok(agreed)
}

/// Exercises `ActivationOps`.
pub fn activation_ops<B: Backend>(h: &mut Harness<B>) {
    ex!(h, relu, [a: [4, 6]], |X, d| X::relu(X::float_sub_scalar(a, f(0.5))));
    ex!(h, leaky_relu, [a: [4, 6]], |X, d| X::leaky_relu(X::float_sub_scalar(a, f(0.5)), f(0.1)));
    ex!(h, gelu, [a: [4, 6]], |X, d| X::gelu(a));
    ex!(h, sigmoid, [a: [4, 6]], |X, d| X::sigmoid(a));
    ex!(h, hard_sigmoid, [a: [4, 6]], |X, d| X::hard_sigmoid(a, f(0.2), f(0.5)));
    ex!(h, prelu, [a: [4, 6], alpha: [4, 6]], |X, d| X::prelu(X::float_sub_scalar(a, f(0.5)), alpha));
    ex!(h, log_sigmoid, [a: [4, 6]], |X, d| X::log_sigmoid(a));
    ex!(h, softmax, [a: [4, 6]], |X, d| X::softmax(a, 1));
    ex!(h, log_softmax, [a: [4, 6]], |X, d| X::log_softmax(a, 1));
    ex!(h, softmin, [a: [4, 6]], |X, d| X::softmin(a, 1));
    ex!(h, relu_backward, [out: [4, 6], grad: [4, 6]], |X, d| X::relu_backward(out, grad));
    // Against the derivative composed from the backend's own ops: Burn 0.21's `gelu_backward`
    // outside Flex is the tanh approximation's derivative, `Amp`'s is `gelu`'s.
    fn pair<X: Backend>(inputs: Vec<FloatTensor<X>>) -> (FloatTensor<X>, FloatTensor<X>) {
        let mut inputs = inputs.into_iter();
        (inputs.next().expect("x"), inputs.next().expect("grad"))
    }
    h.check(
        Op::gelu_backward,
        &[&[4, 6], &[4, 6]],
        expect!(),
        |_, inputs| {
            let (x, grad) = pair::<Amp<B>>(inputs);
            <Amp<B> as ActivationOps<Amp<B>>>::gelu_backward(x, grad)
        },
        |_, inputs| {
            let (x, grad) = pair::<B>(inputs);
            gelu_derivative::<B>(x, grad)
        },
        |_, inputs| {
            let (x, grad) = pair::<Amp<burn::backend::Flex>>(inputs);
            gelu_derivative::<Amp<burn::backend::Flex>>(x, grad)
        },
    );
    ex!(h, sigmoid_backward, [out: [4, 6], grad: [4, 6]], |X, d| X::sigmoid_backward(out, grad));
    ex!(h, log_sigmoid_backward, [x: [4, 6], grad: [4, 6]], |X, d| X::log_sigmoid_backward(x, grad));
}

/// Exercises `ModuleOps`.
pub fn module_ops<B: Backend>(h: &mut Harness<B>) {
    ex!(h, embedding, [w: [10, 4]], |X, d| X::embedding(w, ints::<X>(d, &[1, 9, 3, 0, 3, 5], &[2, 3])));
    ex!(h, embedding_backward, [w: [10, 4], grad: [2, 3, 4]], |X, d| X::embedding_backward(w, grad, ints::<X>(d, &[1, 9, 3, 0, 3, 5], &[2, 3])));
    ex!(h, linear, [x: [4, 6], w: [6, 5], b: [5]], |X, d| X::linear(x, w, Some(b)));
    ex!(h, linear_x_backward, [w: [6, 5], grad: [4, 5]], |X, d| X::linear_x_backward(w, grad));
    ex!(h, linear_weight_backward, [x: [4, 6], grad: [4, 5]], |X, d| X::linear_weight_backward(x, grad));
    ex!(h, linear_bias_backward, [grad: [4, 5]], |X, d| X::linear_bias_backward(grad));

    ex!(h, conv1d, [x: [1, 2, 6], w: [3, 2, 3], b: [3]], |X, d| X::conv1d(x, w, Some(b), ConvOptions::new([1], [0], [1], 1)));
    ex!(h, conv1d_x_backward, [x: [1, 2, 6], w: [3, 2, 3], g: [1, 3, 4]], |X, d| X::conv1d_x_backward(x, w, g, ConvOptions::new([1], [0], [1], 1)));
    ex!(h, conv1d_weight_backward, [x: [1, 2, 6], w: [3, 2, 3], g: [1, 3, 4]], |X, d| X::conv1d_weight_backward(x, w, g, ConvOptions::new([1], [0], [1], 1)));
    ex!(h, conv1d_bias_backward, [x: [1, 2, 6], b: [3], g: [1, 3, 4]], |X, d| X::conv1d_bias_backward(x, b, g));
    ex!(h, conv2d, [x: [1, 2, 5, 5], w: [3, 2, 3, 3], b: [3]], |X, d| X::conv2d(x, w, Some(b), ConvOptions::new([1, 1], [0, 0], [1, 1], 1)));
    ex!(h, conv2d_x_backward, [x: [1, 2, 5, 5], w: [3, 2, 3, 3], g: [1, 3, 3, 3]], |X, d| X::conv2d_x_backward(x, w, g, ConvOptions::new([1, 1], [0, 0], [1, 1], 1)));
    ex!(h, conv2d_weight_backward, [x: [1, 2, 5, 5], w: [3, 2, 3, 3], g: [1, 3, 3, 3]], |X, d| X::conv2d_weight_backward(x, w, g, ConvOptions::new([1, 1], [0, 0], [1, 1], 1)));
    ex!(h, conv2d_bias_backward, [x: [1, 2, 5, 5], b: [3], g: [1, 3, 3, 3]], |X, d| X::conv2d_bias_backward(x, b, g));
    ex!(h, conv3d, [x: [1, 2, 4, 4, 4], w: [3, 2, 3, 3, 3], b: [3]], |X, d| X::conv3d(x, w, Some(b), ConvOptions::new([1, 1, 1], [0, 0, 0], [1, 1, 1], 1)));
    ex!(h, conv3d_x_backward, [x: [1, 2, 4, 4, 4], w: [3, 2, 3, 3, 3], g: [1, 3, 2, 2, 2]], |X, d| X::conv3d_x_backward(x, w, g, ConvOptions::new([1, 1, 1], [0, 0, 0], [1, 1, 1], 1)));
    ex!(h, conv3d_weight_backward, [x: [1, 2, 4, 4, 4], w: [3, 2, 3, 3, 3], g: [1, 3, 2, 2, 2]], |X, d| X::conv3d_weight_backward(x, w, g, ConvOptions::new([1, 1, 1], [0, 0, 0], [1, 1, 1], 1)));
    ex!(h, conv3d_bias_backward, [x: [1, 2, 4, 4, 4], b: [3], g: [1, 3, 2, 2, 2]], |X, d| X::conv3d_bias_backward(x, b, g));
    ex!(h, conv_transpose1d, [x: [1, 2, 4], w: [2, 3, 3], b: [3]], |X, d| X::conv_transpose1d(x, w, Some(b), ConvTransposeOptions::new([1], [0], [0], [1], 1)));
    ex!(h, conv_transpose1d_x_backward, [w: [2, 3, 3], g: [1, 3, 6]], |X, d| X::conv_transpose1d_x_backward(w, g, ConvTransposeOptions::new([1], [0], [0], [1], 1)));
    ex!(h, conv_transpose1d_weight_backward, [x: [1, 2, 4], w: [2, 3, 3], g: [1, 3, 6]], |X, d| X::conv_transpose1d_weight_backward(x, w, g, ConvTransposeOptions::new([1], [0], [0], [1], 1)));
    ex!(h, conv_transpose1d_bias_backward, [x: [1, 2, 4], b: [3], g: [1, 3, 6]], |X, d| X::conv_transpose1d_bias_backward(x, b, g));
    ex!(h, conv_transpose2d, [x: [1, 2, 3, 3], w: [2, 3, 3, 3], b: [3]], |X, d| X::conv_transpose2d(x, w, Some(b), ConvTransposeOptions::new([1, 1], [0, 0], [0, 0], [1, 1], 1)));
    ex!(h, conv_transpose2d_x_backward, [w: [2, 3, 3, 3], g: [1, 3, 5, 5]], |X, d| X::conv_transpose2d_x_backward(w, g, ConvTransposeOptions::new([1, 1], [0, 0], [0, 0], [1, 1], 1)));
    ex!(h, conv_transpose2d_weight_backward, [x: [1, 2, 3, 3], w: [2, 3, 3, 3], g: [1, 3, 5, 5]], |X, d| X::conv_transpose2d_weight_backward(x, w, g, ConvTransposeOptions::new([1, 1], [0, 0], [0, 0], [1, 1], 1)));
    ex!(h, conv_transpose2d_bias_backward, [x: [1, 2, 3, 3], b: [3], g: [1, 3, 5, 5]], |X, d| X::conv_transpose2d_bias_backward(x, b, g));
    ex!(h, conv_transpose3d, [x: [1, 2, 2, 2, 2], w: [2, 3, 2, 2, 2], b: [3]], |X, d| X::conv_transpose3d(x, w, Some(b), ConvTransposeOptions::new([1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1], 1)));
    ex!(h, conv_transpose3d_x_backward, [w: [2, 3, 2, 2, 2], g: [1, 3, 3, 3, 3]], |X, d| X::conv_transpose3d_x_backward(w, g, ConvTransposeOptions::new([1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1], 1)));
    ex!(h, conv_transpose3d_weight_backward, [x: [1, 2, 2, 2, 2], w: [2, 3, 2, 2, 2], g: [1, 3, 3, 3, 3]], |X, d| X::conv_transpose3d_weight_backward(x, w, g, ConvTransposeOptions::new([1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1], 1)));
    ex!(h, conv_transpose3d_bias_backward, [x: [1, 2, 2, 2, 2], b: [3], g: [1, 3, 3, 3, 3]], |X, d| X::conv_transpose3d_bias_backward(x, b, g));
    ex!(h, deform_conv2d, [x: [1, 2, 5, 5], off: [1, 18, 3, 3], w: [3, 2, 3, 3], m: [1, 9, 3, 3], b: [3]], |X, d| X::deform_conv2d(x, off, w, Some(m), Some(b), DeformConvOptions::new([1, 1], [0, 0], [1, 1], 1, 1)));
    ex!(h, deform_conv2d_backward, [x: [1, 2, 5, 5], off: [1, 18, 3, 3], w: [3, 2, 3, 3], m: [1, 9, 3, 3], b: [3], g: [1, 3, 3, 3]], |X, d| X::deform_conv2d_backward(x, off, w, Some(m), Some(b), g, DeformConvOptions::new([1, 1], [0, 0], [1, 1], 1, 1)).weight_grad);
    ex!(h, unfold4d, [x: [1, 2, 4, 4]], |X, d| X::unfold4d(x, [2, 2], UnfoldOptions::new([1, 1], [0, 0], [1, 1])));

    ex!(h, avg_pool1d, [x: [1, 2, 6]], |X, d| X::avg_pool1d(x, 2, 2, 0, true, false));
    ex!(h, avg_pool1d_backward, [x: [1, 2, 6], g: [1, 2, 3]], |X, d| X::avg_pool1d_backward(x, g, 2, 2, 0, true, false));
    ex!(h, avg_pool2d, [x: [1, 2, 4, 4]], |X, d| X::avg_pool2d(x, [2, 2], [2, 2], [0, 0], true, false));
    ex!(h, avg_pool2d_backward, [x: [1, 2, 4, 4], g: [1, 2, 2, 2]], |X, d| X::avg_pool2d_backward(x, g, [2, 2], [2, 2], [0, 0], true, false));
    ex!(h, adaptive_avg_pool1d, [x: [1, 2, 6]], |X, d| X::adaptive_avg_pool1d(x, 3));
    ex!(h, adaptive_avg_pool1d_backward, [x: [1, 2, 6], g: [1, 2, 3]], |X, d| X::adaptive_avg_pool1d_backward(x, g));
    ex!(h, adaptive_avg_pool2d, [x: [1, 2, 4, 4]], |X, d| X::adaptive_avg_pool2d(x, [2, 2]));
    ex!(h, adaptive_avg_pool2d_backward, [x: [1, 2, 4, 4], g: [1, 2, 2, 2]], |X, d| X::adaptive_avg_pool2d_backward(x, g));
    ex!(h, max_pool1d, [x: [1, 2, 6]], |X, d| X::max_pool1d(x, 2, 2, 0, 1, false));
    ex!(h, max_pool1d_with_indices, [x: [1, 2, 6]], |X, d| X::max_pool1d_with_indices(x, 2, 2, 0, 1, false).output);
    ex!(h, max_pool1d_with_indices_backward, [x: [1, 2, 6], g: [1, 2, 3]], |X, d| {
        let indices = X::max_pool1d_with_indices(x.clone(), 2, 2, 0, 1, false).indices;
        X::max_pool1d_with_indices_backward(x, 2, 2, 0, 1, false, g, indices).x_grad
    });
    ex!(h, max_pool2d, [x: [1, 2, 4, 4]], |X, d| X::max_pool2d(x, [2, 2], [2, 2], [0, 0], [1, 1], false));
    ex!(h, max_pool2d_with_indices, [x: [1, 2, 4, 4]], |X, d| X::max_pool2d_with_indices(x, [2, 2], [2, 2], [0, 0], [1, 1], false).output);
    ex!(h, max_pool2d_with_indices_backward, [x: [1, 2, 4, 4], g: [1, 2, 2, 2]], |X, d| {
        let indices = X::max_pool2d_with_indices(x.clone(), [2, 2], [2, 2], [0, 0], [1, 1], false).indices;
        X::max_pool2d_with_indices_backward(x, [2, 2], [2, 2], [0, 0], [1, 1], false, g, indices).x_grad
    });
    ex!(h, interpolate, [x: [1, 2, 3, 3]], |X, d| X::interpolate(x, [5, 5], InterpolateOptions::new(InterpolateMode::Bilinear)));
    // Nearest: burn-cubecl has no bilinear backward.
    ex!(h, interpolate_backward, [x: [1, 2, 3, 3], g: [1, 2, 5, 5]], |X, d| X::interpolate_backward(x, g, [5, 5], InterpolateOptions::new(InterpolateMode::Nearest)));

    ex!(h, attention, [q: [1, 2, 4, 8], k: [1, 2, 4, 8], v: [1, 2, 4, 8]], |X, d| X::attention(q, k, v, None, None, AttentionModuleOptions::default()));
    ex!(h, layer_norm, [x: [4, 6], gamma: [6], beta: [6]], |X, d| X::layer_norm(x, gamma, Some(beta), 1e-5));
    ex!(h, ctc_loss, [lp: [5, 1, 4]], |X, d| X::ctc_loss(X::log_softmax(lp, 2), ints::<X>(d, &[1, 2], &[1, 2]), ints::<X>(d, &[5], &[1]), ints::<X>(d, &[2], &[1]), 0));
    ex!(h, has_ctc_loss_backward, [a: [4, 6]], |X, d| { let _ = X::has_ctc_loss_backward(); a });
    ex!(h, ctc_loss_backward, [lp: [5, 1, 4], g: [1]], |X, d| X::ctc_loss_backward(lp, ints::<X>(d, &[1, 2], &[1, 2]), ints::<X>(d, &[5], &[1]), ints::<X>(d, &[2], &[1]), g, 0));
    ex!(h, rfft, [s: [2, 8]], |X, d| X::rfft(s, 1, None).0);
    ex!(h, irfft, [re: [2, 5], im: [2, 5]], |X, d| X::irfft(re, im, 1, None));
}

/// `grad · (Φ(x) + x · φ(x))`, `gelu`'s derivative, from `X`'s `erf` and `exp`.
fn gelu_derivative<X: Backend>(x: FloatTensor<X>, grad: FloatTensor<X>) -> FloatTensor<X> {
    let cdf = X::float_erf(X::float_mul_scalar(
        x.clone(),
        f(std::f64::consts::FRAC_1_SQRT_2),
    ));
    let cdf = X::float_mul_scalar(X::float_add_scalar(cdf, f(1.0)), f(0.5));
    let squared = X::float_mul(x.clone(), x.clone());
    let density = X::float_exp(X::float_mul_scalar(squared, f(-0.5)));
    let density = X::float_mul_scalar(density, f(1.0 / (2.0 * std::f64::consts::PI).sqrt()));
    X::float_mul(grad, X::float_add(cdf, X::float_mul(x, density)))
}
