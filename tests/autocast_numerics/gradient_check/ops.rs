//! The float ops of Burn 0.21 one by one, each on two tracked `[8, 8]` leaves `a` and `b`
//! (reshaped to what the op takes), its output weighted by a fixed pattern and summed.

use burn::tensor::activation::{
    hard_sigmoid, leaky_relu, log_softmax, mish, prelu, softmin, softplus,
};
use burn::tensor::module::{
    adaptive_avg_pool1d, adaptive_avg_pool2d, attention, avg_pool2d, conv_transpose1d,
    conv_transpose2d, conv_transpose3d, conv2d, conv3d, ctc_loss, deform_conv2d, interpolate,
    max_pool2d, max_pool2d_with_indices, unfold4d,
};
use burn::tensor::ops::{
    AttentionModuleOptions, ConvOptions, ConvTransposeOptions, DeformConvOptions,
    GridSampleOptions, GridSamplePaddingMode, InterpolateMode, InterpolateOptions, UnfoldOptions,
};
use burn::tensor::signal::rfft;
use burn::tensor::{Bool, IndexingUpdateOp, Int, Slice, TensorPrimitive};

use super::super::common::Rng;
use super::*;

/// The ops, by name (`apply` says what each computes).
const OPS: &[&str] = &[
    "exp",
    "log1p",
    "cos",
    "tan",
    "sinh",
    "cosh",
    "asin",
    "acos",
    "atan",
    "asinh",
    "acosh",
    "atanh",
    "powf_scalar negative",
    "powi_scalar negative",
    "powf_scalar",
    "powi_scalar",
    "zeroth power plus identity",
    "powf broadcast",
    "atan2 broadcast",
    "square",
    "leaky_relu",
    "hard_sigmoid",
    "prelu",
    "softplus",
    "mish",
    "softmin",
    "clamp_min",
    "clamp_max",
    "min_pair",
    "fmod",
    "ceil plus identity",
    "round plus identity",
    "trunc plus identity",
    "sum",
    "mean",
    "sum_dim",
    "mean_dim",
    "max",
    "min",
    "max_abs",
    "max_dim",
    "min_dim",
    "max_dim_with_indices",
    "min_dim_with_indices",
    "max_abs_dim",
    "cummin",
    "cummax",
    "prod",
    "sort_with_indices",
    "sort_descending",
    "topk",
    "unfold",
    "repeat",
    "repeat_dim rows",
    "slice_assign",
    "slice stepped",
    "slice reversed",
    "narrow",
    "chunks swapped",
    "permute",
    "expand",
    "flip both",
    "triu",
    "cat of three",
    "broadcast div column",
    "broadcast sub 3d",
    "matmul broadcast batch",
    "matmul transposed",
    "scatter add",
    "select_assign add",
    "gather_nd",
    "scatter_nd add",
    "conv2d",
    "conv2d strided dilated grouped",
    "conv3d",
    "conv_transpose2d",
    "conv_transpose1d",
    "deform_conv2d with mask",
    "max_pool2d dilated padded",
    "avg_pool2d ceil no pad count",
    "adaptive_avg_pool2d 8 to 3x5",
    "adaptive_avg_pool1d 8 to 3",
    "unfold4d",
    "interpolate nearest",
    "interpolate bilinear",
    "interpolate bicubic",
    "interpolate lanczos3",
    "grid_sample bilinear border",
    "grid_sample bilinear reflection",
    "grid_sample bicubic",
    "attention bias softcap causal",
    "ctc_loss",
    "rfft",
    "conv_transpose3d",
    "conv_transpose2d grouped dilated",
    "layer_norm",
    "interpolate bilinear align_corners",
    "interpolate bicubic align_corners",
    "adaptive_avg_pool2d 4x4 to 6x3",
    "max_pool2d_with_indices",
    "attention masked",
    "ctc_loss batch of two",
    "deform_conv2d grouped",
    "grid_sample bilinear zeros align_corners",
    "slice_assign stepped",
    "slice_fill",
];

/// What plain `Autodiff<Flex>` gets wrong in Burn 0.21, each a defect the README lists and
/// `Amp` avoids: wrong gradients, and panics (no backward).
const PLAIN_WRONG: &[&str] = &["repeat", "repeat_dim rows"];
const PLAIN_PANICS: &[&str] = &[
    "topk",
    "interpolate lanczos3",
    "grid_sample bicubic",
    "rfft",
];

fn flat<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, 1> {
    let n = t.shape().num_elements();
    t.reshape([n])
}

fn ints<B: Backend, const D: usize>(
    values: &[i64],
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D, Int> {
    Tensor::from_data(TensorData::new(values.to_vec(), shape), device)
}

fn apply<B: Backend>(name: &str, a: Tensor<B, 2>, b: Tensor<B, 2>) -> Tensor<B, 1> {
    let device = a.device();
    let image = |t: Tensor<B, 2>| t.reshape([1, 4, 4, 4]);
    let heads = |t: Tensor<B, 2>| t.reshape([1, 2, 4, 8]);
    let rows = ints::<B, 1>(&[3, 0, 3, 7, 1, 3], [6], &device);
    let sampled = |mode, padding| {
        let grid = b.clone().reshape([1, 4, 8, 2]).tanh().mul_scalar(1.3);
        let options = GridSampleOptions::new(mode).with_padding_mode(padding);
        flat(image(a.clone()).grid_sample_2d(grid, options))
    };
    let interpolated = |mode| {
        let options = InterpolateOptions::new(mode).with_align_corners(false);
        flat(interpolate(
            a.clone().reshape([1, 1, 8, 8]),
            [5, 11],
            options,
        ))
    };
    match name {
        "exp" => flat(a.mul_scalar(0.5).exp()),
        "log1p" => flat(a.abs().log1p()),
        "cos" => flat(a.cos()),
        "tan" => flat(a.mul_scalar(0.5).tan()),
        "sinh" => flat(a.sinh()),
        "cosh" => flat(a.cosh()),
        "asin" => flat(a.tanh().mul_scalar(0.9).asin()),
        "acos" => flat(a.tanh().mul_scalar(0.9).acos()),
        "atan" => flat(a.atan()),
        "asinh" => flat(a.asinh()),
        "acosh" => flat(a.abs().add_scalar(1.2).acosh()),
        "atanh" => flat(a.tanh().mul_scalar(0.9).atanh()),
        "powf_scalar negative" => flat(a.abs().add_scalar(0.5).powf_scalar(-1.5)),
        "powi_scalar negative" => flat(a.abs().add_scalar(0.5).powi_scalar(-2)),
        "powf_scalar" => flat(a.abs().add_scalar(0.5).powf_scalar(1.5)),
        "powi_scalar" => flat(a.powi_scalar(3)),
        "zeroth power plus identity" => flat(a.clone().powf_scalar(0.0).add(a)),
        "powf broadcast" => flat(a.abs().add_scalar(0.5).powf(b.slice([0..1, 0..8]).tanh())),
        "atan2 broadcast" => flat(a.atan2(b.slice([0..8, 0..1]).add_scalar(0.1))),
        "square" => flat(a.square()),
        "leaky_relu" => flat(leaky_relu(a, 0.1)),
        "hard_sigmoid" => flat(hard_sigmoid(a.mul_scalar(3.0), 0.2, 0.5)),
        "prelu" => flat(prelu(a, b.slice([0..1, 0..8]).reshape([8]))),
        "softplus" => flat(softplus(a, 2.0)),
        "mish" => flat(mish(a)),
        "softmin" => flat(softmin(a, 1)),
        "clamp_min" => flat(a.clamp_min(0.1)),
        "clamp_max" => flat(a.clamp_max(-0.1)),
        "min_pair" => flat(a.min_pair(b)),
        "fmod" => flat(a.fmod(b.abs().add_scalar(0.5))),
        "ceil plus identity" => flat(a.clone().mul_scalar(3.0).ceil() + a),
        "round plus identity" => flat(a.clone().mul_scalar(3.0).round() + a),
        "trunc plus identity" => flat(a.clone().mul_scalar(3.0).trunc() + a),
        "sum" => flat(b * a.sum().reshape([1, 1])),
        "mean" => flat(b * a.mean().reshape([1, 1])),
        "sum_dim" => flat(a.sum_dim(1)),
        "mean_dim" => flat(a.mean_dim(0)),
        "max" => flat(b * a.max().reshape([1, 1])),
        "min" => flat(b * a.min().reshape([1, 1])),
        "max_abs" => flat(b * a.max_abs().reshape([1, 1])),
        "max_dim" => flat(a.max_dim(1)),
        "min_dim" => flat(a.min_dim(0)),
        "max_dim_with_indices" => flat(a.max_dim_with_indices(1).0),
        "min_dim_with_indices" => flat(a.min_dim_with_indices(0).0),
        "max_abs_dim" => flat(a.max_abs_dim(1)),
        "cummin" => flat(a.cummin(1)),
        "cummax" => flat(a.cummax(0)),
        "prod" => flat(
            b * a
                .tanh()
                .mul_scalar(0.5)
                .add_scalar(1.0)
                .prod()
                .reshape([1, 1]),
        ),
        "sort_with_indices" => flat(a.sort_with_indices(1).0),
        "sort_descending" => flat(a.sort_descending(0)),
        "topk" => flat(a.topk(3, 1)),
        "unfold" => flat(a.unfold::<3, _>(1, 3, 2)),
        "repeat" => flat(a.repeat(&[2, 3])),
        "repeat_dim rows" => flat(a.repeat_dim(0, 2)),
        "slice_assign" => flat(a.slice_assign([2..5, 1..4], b.slice([0..3, 0..3]))),
        "slice stepped" => flat(a.slice([Slice::new(1, None, 1), Slice::new(0, Some(8), 3)])),
        "slice reversed" => flat(a.slice([Slice::new(0, None, -1), Slice::new(1, Some(7), -2)])),
        "narrow" => flat(a.narrow(1, 2, 4)),
        "chunks swapped" => {
            let mut halves = a.chunk(2, 1);
            halves.reverse();
            flat(Tensor::cat(halves, 1))
        }
        "permute" => flat(a.reshape([2, 4, 8]).permute([2, 0, 1])),
        "expand" => flat(a.reshape([1, 8, 8]).expand([3, 8, 8]) * b.reshape([1, 8, 8])),
        "flip both" => flat(a.flip([0, 1])),
        "triu" => flat(a.triu(1)),
        "cat of three" => flat(Tensor::cat(
            vec![a.clone().slice([0..3, 0..8]), b, a.slice([5..8, 0..8])],
            0,
        )),
        "broadcast div column" => flat(a / b.abs().add_scalar(0.5).slice([0..8, 0..1])),
        "broadcast sub 3d" => flat(a.reshape([2, 4, 8]) - b.slice([0..4, 0..8]).reshape([1, 4, 8])),
        "matmul broadcast batch" => flat(a.reshape([2, 4, 8]).matmul(b.reshape([1, 8, 8]))),
        "matmul transposed" => flat(a.matmul(b.transpose())),
        "scatter add" => {
            let index: Vec<i64> = (0..64).map(|i| (i * 5 % 8) as i64 % 4).collect();
            let index = ints::<B, 2>(&index, [8, 8], &device);
            flat(a.scatter(1, index, b, IndexingUpdateOp::Add))
        }
        "select_assign add" => {
            flat(a.select_assign(0, rows, b.slice([0..6, 0..8]), IndexingUpdateOp::Add))
        }
        "gather_nd" => flat(a.gather_nd::<2, 2>(rows.reshape([6, 1]))),
        "scatter_nd add" => flat(a.scatter_nd::<2, 2>(
            rows.reshape([6, 1]),
            b.slice([0..6, 0..8]),
            IndexingUpdateOp::Add,
        )),
        "conv2d" => flat(conv2d(
            image(a),
            b.reshape([4, 4, 2, 2]),
            None,
            ConvOptions::new([1, 1], [1, 1], [1, 1], 1),
        )),
        "conv2d strided dilated grouped" => {
            let weight = b.slice([0..4, 0..8]).reshape([4, 2, 2, 2]);
            flat(conv2d(
                image(a),
                weight,
                None,
                ConvOptions::new([2, 1], [1, 0], [1, 2], 2),
            ))
        }
        "conv3d" => {
            let weight = b.slice([0..1, 0..8]).reshape([1, 1, 2, 2, 2]);
            flat(conv3d(
                a.reshape([1, 1, 4, 4, 4]),
                weight,
                None,
                ConvOptions::new([1, 1, 1], [0, 1, 0], [1, 1, 1], 1),
            ))
        }
        "conv_transpose2d" => {
            let options = ConvTransposeOptions::new([2, 2], [1, 1], [1, 1], [1, 1], 1);
            flat(conv_transpose2d(
                image(a),
                b.reshape([4, 4, 2, 2]),
                None,
                options,
            ))
        }
        "conv_transpose1d" => {
            let options = ConvTransposeOptions::new([2], [0], [1], [1], 1);
            flat(conv_transpose1d(
                a.reshape([1, 8, 8]),
                b.reshape([8, 4, 2]),
                None,
                options,
            ))
        }
        "deform_conv2d with mask" => {
            let offset = b
                .clone()
                .slice([0..4, 0..8])
                .reshape([1, 8, 2, 2])
                .mul_scalar(0.6);
            let mask = b
                .clone()
                .slice([4..6, 0..8])
                .reshape([1, 4, 2, 2])
                .tanh()
                .add_scalar(1.0);
            let weight = b.reshape([4, 4, 2, 2]);
            let options = DeformConvOptions::new([2, 2], [0, 0], [1, 1], 1, 1);
            flat(deform_conv2d(
                image(a),
                offset,
                weight,
                Some(mask),
                None,
                options,
            ))
        }
        "max_pool2d dilated padded" => {
            flat(max_pool2d(image(a), [2, 2], [1, 2], [1, 1], [2, 1], false))
        }
        "avg_pool2d ceil no pad count" => {
            flat(avg_pool2d(image(a), [3, 3], [2, 2], [1, 1], false, true))
        }
        "adaptive_avg_pool2d 8 to 3x5" => {
            flat(adaptive_avg_pool2d(a.reshape([1, 1, 8, 8]), [3, 5]))
        }
        "adaptive_avg_pool1d 8 to 3" => flat(adaptive_avg_pool1d(a.reshape([1, 8, 8]), 3)),
        "unfold4d" => flat(unfold4d(
            image(a),
            [2, 2],
            UnfoldOptions::new([1, 2], [1, 0], [1, 1]),
        )),
        "interpolate nearest" => interpolated(InterpolateMode::Nearest),
        "interpolate bilinear" => interpolated(InterpolateMode::Bilinear),
        "interpolate bicubic" => interpolated(InterpolateMode::Bicubic),
        "interpolate lanczos3" => interpolated(InterpolateMode::Lanczos3),
        "grid_sample bilinear border" => {
            sampled(InterpolateMode::Bilinear, GridSamplePaddingMode::Border)
        }
        "grid_sample bilinear reflection" => {
            sampled(InterpolateMode::Bilinear, GridSamplePaddingMode::Reflection)
        }
        "grid_sample bicubic" => sampled(InterpolateMode::Bicubic, GridSamplePaddingMode::Zeros),
        "attention bias softcap causal" => {
            let bias = b.clone().slice([0..4, 0..8]).reshape([1, 2, 4, 4]);
            let options = AttentionModuleOptions {
                scale: Some(0.3),
                softcap: Some(1.5),
                is_causal: true,
            };
            flat(attention(
                heads(a),
                heads(b.clone()),
                heads(b),
                None,
                Some(bias),
                options,
            ))
        }
        "ctc_loss" => {
            let log_probs = log_softmax(a.reshape([8, 1, 8]), 2);
            let targets = ints::<B, 2>(&[1, 3, 3], [1, 3], &device);
            let input_lengths = ints::<B, 1>(&[8], [1], &device);
            let target_lengths = ints::<B, 1>(&[3], [1], &device);
            flat(
                ctc_loss(log_probs, targets, input_lengths, target_lengths, 0)
                    * b.slice([0..1, 0..1]).reshape([1]),
            )
        }
        "rfft" => {
            let (re, im) = rfft(a, 1, None);
            flat(Tensor::cat(vec![re, im], 1))
        }
        "conv_transpose3d" => {
            let weight = b.slice([0..1, 0..8]).reshape([1, 1, 2, 2, 2]);
            let options = ConvTransposeOptions::new([2, 1, 1], [0, 1, 0], [1, 0, 0], [1, 1, 2], 1);
            flat(conv_transpose3d(
                a.reshape([1, 1, 4, 4, 4]),
                weight,
                None,
                options,
            ))
        }
        "conv_transpose2d grouped dilated" => {
            let weight = b.slice([0..4, 0..8]).reshape([4, 2, 2, 2]);
            let options = ConvTransposeOptions::new([2, 1], [1, 0], [1, 0], [1, 2], 2);
            flat(conv_transpose2d(image(a), weight, None, options))
        }
        "layer_norm" => {
            let gamma = b.clone().slice([0..1, 0..8]).reshape([8]);
            let beta = b.slice([1..2, 0..8]).reshape([8]);
            let out = B::layer_norm(
                a.into_primitive().tensor(),
                gamma.into_primitive().tensor(),
                Some(beta.into_primitive().tensor()),
                1e-5,
            );
            flat(Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(out)))
        }
        "interpolate bilinear align_corners" | "interpolate bicubic align_corners" => {
            let mode = match name.starts_with("interpolate bilinear") {
                true => InterpolateMode::Bilinear,
                false => InterpolateMode::Bicubic,
            };
            let options = InterpolateOptions::new(mode).with_align_corners(true);
            flat(interpolate(a.reshape([1, 1, 8, 8]), [11, 5], options))
        }
        "adaptive_avg_pool2d 4x4 to 6x3" => flat(adaptive_avg_pool2d(image(a), [6, 3])),
        "max_pool2d_with_indices" => {
            flat(max_pool2d_with_indices(image(a), [3, 2], [1, 1], [1, 0], [1, 1], true).0)
        }
        "attention masked" => {
            let mask: Vec<bool> = (0..32).map(|i| i % 5 == 1).collect();
            let mask =
                Tensor::<B, 4, Bool>::from_data(TensorData::new(mask, [1, 2, 4, 4]), &device);
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: false,
            };
            flat(attention(
                heads(a),
                heads(b.clone()),
                heads(b),
                Some(mask),
                None,
                options,
            ))
        }
        "ctc_loss batch of two" => {
            let log_probs = log_softmax(a.reshape([8, 2, 4]), 2);
            let targets = ints::<B, 2>(&[1, 2, 2, 3, 1, 0], [2, 3], &device);
            let input_lengths = ints::<B, 1>(&[8, 6], [2], &device);
            let target_lengths = ints::<B, 1>(&[3, 2], [2], &device);
            let weights = b.slice([0..1, 0..2]).reshape([2]);
            flat(ctc_loss(log_probs, targets, input_lengths, target_lengths, 0) * weights)
        }
        "deform_conv2d grouped" => {
            let offset = b
                .clone()
                .slice([0..2, 0..8])
                .reshape([1, 16, 1, 1])
                .mul_scalar(0.7);
            let weight = b.slice([2..4, 0..8]).reshape([4, 2, 2, 1]);
            let options = DeformConvOptions::new([3, 3], [0, 1], [2, 1], 2, 4);
            flat(deform_conv2d(image(a), offset, weight, None, None, options))
        }
        "grid_sample bilinear zeros align_corners" => {
            let grid = b.reshape([1, 4, 8, 2]).tanh().mul_scalar(1.3);
            let options =
                GridSampleOptions::new(InterpolateMode::Bilinear).with_align_corners(true);
            flat(image(a).grid_sample_2d(grid, options))
        }
        "slice_assign stepped" => {
            let slices = [Slice::new(0, None, 2), Slice::new(1, Some(7), 3)];
            flat(a.slice_assign(slices, b.slice([0..4, 0..2])))
        }
        "slice_fill" => flat(a.slice_fill([1..6, 2..3], 0.5) * b),
        other => unreachable!("no op {other}"),
    }
}

struct Op(&'static str);

impl Loss for Op {
    fn tracked(&self) -> usize {
        2
    }

    /// Flex computes `deform_conv2d`'s backward in f32, even for f64 (its comment: "f64
    /// backward computed via f32"), and `rfft` with f32 twiddle factors, its backward (`irfft`)
    /// in f32. (`irfft` itself, f32 inside, is left out: its differences would be f32's
    /// rounding; `spectral.rs` holds both transforms to an f64 DFT.)
    fn tolerance(&self) -> (f64, f64) {
        match self.0 {
            name if name.starts_with("deform_conv2d") || name == "rfft" => (1e-6, 1e-5),
            _ => (1e-8, 1e-6),
        }
    }

    fn loss<B: Backend>(&self, leaves: &[Tensor<B, 2>]) -> Tensor<B, 1> {
        let out = apply(self.0, leaves[0].clone(), leaves[1].clone());
        let n = out.shape().num_elements();
        let weights: Vec<f64> = (0..n).map(|i| 0.5 + ((i * 7) % 13) as f64 / 13.0).collect();
        let weights = Tensor::from_data(TensorData::new(weights, [n]), (&out.device(), DType::F64));
        (out * weights).sum()
    }
}

fn data(seed: u64) -> Vec<(Vec<f64>, [usize; 2])> {
    let mut rng = Rng::new(seed);
    (0..2)
        .map(|_| {
            let v = (0..64).map(|_| on_grid(rng.unit() * 1.5) as f64).collect();
            (v, [8, 8])
        })
        .collect()
}

/// Whether the policy lowers the op (`Lower`: matmuls, convolutions but the deformable one,
/// attention, `prelu`): the rest runs in f32 under autocast.
fn lowered(name: &str) -> bool {
    ["matmul", "conv", "attention", "prelu"]
        .iter()
        .any(|lowered| name.starts_with(lowered))
}

/// The gradients from f32 leaves under autocast against the truth (relative L2): f32's
/// rounding (1e-6) for the ops the policy does not lower, at every precision; the lowered
/// ones within a few units of the half type's rounding (f16: 2e-3, bf16: 1.6e-2).
fn assert_precision(name: &str, seed: u64, [f32, f16, bf16]: [f64; 3]) {
    let (f16_bound, bf16_bound) = if lowered(name) {
        (2e-3, 1.6e-2)
    } else {
        (1e-6, 1e-6)
    };
    for (precision, error, bound) in [
        ("F32", f32, 1e-6),
        ("F16", f16, f16_bound),
        ("BF16", bf16, bf16_bound),
    ] {
        assert!(
            error <= bound,
            "{name} (seed {seed}) from f32 leaves under autocast at {precision}: gradients \
             {error:.1e} from the truth (bound {bound:.0e})"
        );
    }
}

/// Every op at seeds 0..`seeds`: `Amp`'s gradients as the differences say, in f64 and from
/// f32 leaves under autocast; returns how many elements were left out, the largest error at
/// F16 of the ops the policy lowers and of the others, and the ops plain autodiff gets wrong
/// and those it panics on.
pub(crate) fn every_float_op_differentiates_right(seeds: u64) -> Summary {
    let mut summary = Summary::default();
    for &name in OPS {
        for seed in 0..seeds {
            let checked = check(&Op(name), &data(seed), &format!("{name} (seed {seed})"));
            assert_precision(name, seed, checked.from_f32);
            summary.left_out += checked.left_out;
            let worst = match lowered(name) {
                true => &mut summary.worst_f16_lowered,
                false => &mut summary.worst_f16_f32_ops,
            };
            *worst = worst.max(checked.from_f32[1]);
            let list = match checked.plain {
                Plain::Right => continue,
                Plain::Wrong(_) => &mut summary.plain_wrong,
                Plain::Panics(_) => &mut summary.plain_panics,
            };
            if !list.contains(&name) {
                list.push(name);
            }
        }
    }
    summary
}

#[derive(Debug, Default)]
pub(crate) struct Summary {
    pub(crate) left_out: usize,
    pub(crate) worst_f16_lowered: f64,
    pub(crate) worst_f16_f32_ops: f64,
    pub(crate) plain_wrong: Vec<&'static str>,
    pub(crate) plain_panics: Vec<&'static str>,
}

/// Also the canaries of plain Burn's defects here: fixed in a later Burn, this fails.
#[test]
fn every_float_op_differentiates_as_its_central_differences_in_f64() {
    let summary = every_float_op_differentiates_right(3);
    eprintln!("gradient check: {} ops, {summary:?}", OPS.len());
    assert_eq!(
        summary.plain_wrong, PLAIN_WRONG,
        "the ops plain autodiff differentiates wrong"
    );
    assert_eq!(
        summary.plain_panics, PLAIN_PANICS,
        "the ops plain autodiff cannot differentiate"
    );
}
