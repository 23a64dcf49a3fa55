//! Random graphs through what autocast keeps for the backward. The weight-cast cache, the
//! shared activation casts, the recomputed widening casts and the recomputed outputs each
//! change where a saved value comes from, never a value; Burn's `BalancedCheckpointing` does
//! the same. So on any graph every combination gives **bitwise** the loss and gradients of
//! the others, under either strategy, but for one designed difference: recomputed outputs
//! make softmax and log-softmax one node with the analytic backward, within half precision's
//! tolerance of Burn's composition. So does the precision doctor's `detect_anomaly()`, which
//! watches every op. And autocast at F32 gives bitwise plain autodiff's. (Bitwise on Flex; on
//! wgpu within 1e-3, Burn's fusion not being bitwise reproducible run to run.)
//!
//! The graphs are drawn from a seed (a failure prints it and the ops), over 60 ops of
//! `[8, 8]` tensors: elementwise, reductions, scans, sorting, shape ops, softmax, matmul,
//! linear, conv1d, attention, embedding, gather, pooling, interpolation; chains, shared
//! operands whose paths meet again, untracked constants, detached values, chains past
//! `recompute::MAX_CHAIN`, two losses over one graph backpropagated one after the other, two
//! forwards through the same parameters, intermediates dropped after their last use. On
//! wgpu, the same graphs fused and unfused (`CubeBackend`) agree.
//!
//! Found here: softmax past `MAX_CHAIN` fell back to Burn's composition, whose forward
//! rounds differently (a value depended on the chain's length; fixed); and defects of Burn
//! 0.21 (the README lists them; `workarounds.rs` tests those `Amp` avoids).

use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::{gelu, log_sigmoid, log_softmax, relu, sigmoid, silu, softmax};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Bool, Int, TensorData};
use burn_amp::backend::{cast_cache, recompute, upcast};
use burn_amp::{Amp, autocast};

use super::common::Rng;
use super::*;

/// The ops a graph is drawn from; each maps `[N, N]` operands to `[N, N]`.
#[derive(Debug, Clone, Copy)]
enum Op {
    Matmul,
    Add,
    Sub,
    Mul,
    Div,
    Silu,
    Gelu,
    Sigmoid,
    Tanh,
    ExpOfTanh,
    LogOfAbs,
    SqrtOfAbs,
    RecipOfAbs,
    PowfScalar,
    Powf,
    Softmax,
    LogSoftmax,
    Transpose,
    Centered,
    Normalized,
    Relu,
    Clamp,
    CatOfHalves,
    Reshaped,
    DetachedTimes,
    TimesConstant,
    MaskFill,
    MaskWhere,
    SinTimesCos,
    LogSigmoid,
    Erf,
    Atan2,
    Remainder,
    MaxShifted,
    ColumnSums,
    Select,
    Widened,
    Linear,
    Conv1d,
    Attention,
    Embedding,
    Gather,
    MaxPool,
    AvgPool,
    ProdDim,
    Powi,
    AdaptivePool,
    Interpolate,
    Cross,
    Cumsum,
    Cumprod,
    Flip,
    Expanded,
    Stacked,
    SquareSign,
    Variance,
    MaxPair,
    Argmax,
    Sorted,
    Floor,
}

const OPS: [Op; 60] = [
    Op::Matmul,
    Op::Add,
    Op::Sub,
    Op::Mul,
    Op::Div,
    Op::Silu,
    Op::Gelu,
    Op::Sigmoid,
    Op::Tanh,
    Op::ExpOfTanh,
    Op::LogOfAbs,
    Op::SqrtOfAbs,
    Op::RecipOfAbs,
    Op::PowfScalar,
    Op::Powf,
    Op::Softmax,
    Op::LogSoftmax,
    Op::Transpose,
    Op::Centered,
    Op::Normalized,
    Op::Relu,
    Op::Clamp,
    Op::CatOfHalves,
    Op::Reshaped,
    Op::DetachedTimes,
    Op::TimesConstant,
    Op::MaskFill,
    Op::MaskWhere,
    Op::SinTimesCos,
    Op::LogSigmoid,
    Op::Erf,
    Op::Atan2,
    Op::Remainder,
    Op::MaxShifted,
    Op::ColumnSums,
    Op::Select,
    Op::Widened,
    Op::Linear,
    Op::Conv1d,
    Op::Attention,
    Op::Embedding,
    Op::Gather,
    Op::MaxPool,
    Op::AvgPool,
    Op::ProdDim,
    Op::Powi,
    Op::AdaptivePool,
    Op::Interpolate,
    Op::Cross,
    Op::Cumsum,
    Op::Cumprod,
    Op::Flip,
    Op::Expanded,
    Op::Stacked,
    Op::SquareSign,
    Op::Variance,
    Op::MaxPair,
    Op::Argmax,
    Op::Sorted,
    Op::Floor,
];

/// Side of every tensor.
const N: usize = 8;

/// Leaves at the front of the pool: an input and two weights that require gradients, and an
/// untracked constant.
const LEAVES: usize = 4;

#[derive(Debug, Clone, Copy)]
struct Node {
    op: Op,
    a: usize,
    b: usize,
    dim: usize,
}

#[derive(Debug, Clone)]
struct Case {
    seed: u64,
    nodes: Vec<Node>,
    /// The pool indices summed into the loss(es).
    outputs: Vec<usize>,
    /// The outputs are split into two losses, backpropagated one after the other.
    two_losses: bool,
    /// The graph is built twice from the same leaves (two forwards through the same
    /// parameters, as two micro-batches), then both are backpropagated.
    twice: bool,
    data: [Vec<f32>; LEAVES],
    mask: Vec<bool>,
    rows: Vec<i64>,
}

impl Case {
    fn draw(seed: u64, max_ops: usize) -> Self {
        let mut rng = Rng::new(seed);
        let len = 2 + rng.below(max_ops - 1);
        let mut nodes = Vec::with_capacity(len);
        for i in 0..len {
            let pool = LEAVES + i;
            // `a` is mostly the newest value (long chains), `b` anything (paths that meet).
            let a = if rng.below(4) == 0 {
                rng.below(pool)
            } else {
                pool - 1 - rng.below(pool.min(3))
            };
            let b = rng.below(pool);
            // The first op lowers the input, so that something is half precision.
            let op = if i == 0 {
                Op::Matmul
            } else {
                OPS[rng.below(OPS.len())]
            };
            nodes.push(Node {
                op,
                a,
                b,
                dim: rng.below(2),
            });
        }
        let last = LEAVES + len - 1;
        let mut outputs = vec![last];
        for _ in 0..rng.below(3) {
            outputs.push(LEAVES + rng.below(len));
        }
        let data = std::array::from_fn(|_| {
            (0..N * N)
                .map(|_| on_grid(rng.unit() * 1.5))
                .collect::<Vec<_>>()
        });
        Self {
            seed,
            nodes,
            two_losses: outputs.len() > 1 && rng.below(2) == 0,
            twice: rng.below(4) == 0,
            outputs,
            data,
            mask: (0..N * N).map(|_| rng.below(3) == 0).collect(),
            rows: (0..N).map(|_| rng.below(N) as i64).collect(),
        }
    }
}

/// A positive version of `t`, away from 0: `|t| + offset`.
fn positive<B: Backend>(t: Tensor<B, 2>, offset: f32) -> Tensor<B, 2> {
    t.abs().add_scalar(offset)
}

fn apply<B: Backend>(
    node: Node,
    pool: &[Option<Tensor<B, 2>>],
    mask: &Tensor<B, 2, Bool>,
    rows: &Tensor<B, 1, Int>,
) -> Tensor<B, 2> {
    use burn::tensor::module::{
        adaptive_avg_pool1d, attention, avg_pool1d, conv1d, embedding, interpolate, linear,
        max_pool1d,
    };
    use burn::tensor::ops::{
        AttentionModuleOptions, ConvOptions, InterpolateMode, InterpolateOptions,
    };
    // `[N, N]` as a batch of one sequence: `[1, channels N, length N]`.
    let seq = |t: Tensor<B, 2>| t.reshape([1, N, N]);
    let back = |t: Tensor<B, 3>| t.slice([0..1, 0..N, 0..N]).reshape([N, N]);
    let live = |i: usize| pool[i].clone().expect("a live value");
    let (a, b) = (live(node.a), live(node.b));
    let constant = live(LEAVES - 1);
    let h = N / 2;
    match node.op {
        Op::Matmul => a.matmul(b).mul_scalar(0.25),
        Op::Add => a + b,
        Op::Sub => a - b,
        Op::Mul => a * b.tanh(),
        Op::Div => a / positive(b, 0.5),
        Op::Silu => silu(a),
        Op::Gelu => gelu(a),
        Op::Sigmoid => sigmoid(a),
        Op::Tanh => a.tanh(),
        Op::ExpOfTanh => a.tanh().exp(),
        Op::LogOfAbs => positive(a, 1.0).log(),
        Op::SqrtOfAbs => positive(a, 0.1).sqrt(),
        Op::RecipOfAbs => positive(a, 0.5).recip(),
        Op::PowfScalar => positive(a, 0.1).powf_scalar(1.5),
        Op::Powf => positive(a, 0.5).powf(b.tanh().mul_scalar(0.5)),
        Op::Softmax => softmax(a, node.dim),
        Op::LogSoftmax => log_softmax(a, node.dim),
        Op::Transpose => a.swap_dims(0, 1),
        Op::Centered => a.clone() - a.mean_dim(node.dim),
        Op::Normalized => {
            let centered = a.clone() - a.mean_dim(1);
            let var = centered.clone().square().mean_dim(1);
            centered / var.add_scalar(1e-5).sqrt()
        }
        Op::Relu => relu(a),
        Op::Clamp => a.clamp(-1.0, 1.0),
        Op::CatOfHalves => Tensor::cat(vec![a.slice([0..h, 0..N]), b.slice([h..N, 0..N])], 0),
        Op::Reshaped => a.reshape([N * N]).mul_scalar(0.5).reshape([N, N]),
        Op::DetachedTimes => a.detach() * b.tanh(),
        Op::TimesConstant => a * constant,
        Op::MaskFill => a.mask_fill(mask.clone(), 0.0),
        Op::MaskWhere => a.mask_where(mask.clone(), b),
        Op::SinTimesCos => a.sin() * b.cos(),
        Op::LogSigmoid => log_sigmoid(a),
        Op::Erf => a.erf(),
        Op::Atan2 => a.atan2(positive(b, 0.5)),
        Op::Remainder => a.remainder(positive(b, 0.5)),
        Op::MaxShifted => a.clone() - a.max_dim(node.dim),
        Op::ColumnSums => a.clone().sum_dim(0).mul_scalar(0.125) * b.tanh(),
        Op::Select => a.select(0, rows.clone()),
        Op::Widened => a.cast(DType::F32).mul_scalar(0.5),
        Op::Linear => {
            let bias = b.clone().sum_dim(0).reshape([N]).mul_scalar(0.1);
            linear(a, b.mul_scalar(0.25), Some(bias))
        }
        Op::Conv1d => {
            // Two groups, kernel 2, padding 1: length N + 1, cut back to N.
            let weight = b.reshape([N, N / 2, 2]).mul_scalar(0.25);
            let options = ConvOptions::new([1], [1], [1], 2);
            back(conv1d(seq(a), weight, None, options))
        }
        Op::Attention => {
            let heads = |t: Tensor<B, 2>| t.reshape([1, 2, N / 2, N]);
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: node.dim == 1,
            };
            let context = attention(
                heads(a.clone()),
                heads(b.clone()),
                heads(b),
                None,
                None,
                options,
            );
            context.reshape([N, N])
        }
        Op::Embedding => {
            let ids = rows.clone().reshape([1, N]);
            embedding(a, ids).reshape([N, N])
        }
        Op::Gather => {
            // Cross-entropy's pattern: log-probabilities picked by class indices.
            let classes = rows.clone().reshape([N, 1]).repeat_dim(1, N);
            log_softmax(a, 1).gather(1, classes) * b.tanh()
        }
        Op::MaxPool => back(max_pool1d(seq(a), 2, 1, 1, 1, false)),
        Op::AvgPool => back(avg_pool1d(seq(a), 2, 1, 1, true, false)),
        Op::ProdDim => a.tanh().mul_scalar(0.5).add_scalar(1.0).prod_dim(node.dim) * b,
        Op::Powi => a.powi_scalar(3).mul_scalar(0.5),
        Op::AdaptivePool => back(adaptive_avg_pool1d(seq(a), h).repeat_dim(2, 2)),
        Op::Interpolate => {
            let top = a.slice([0..h, 0..N]).reshape([1, 1, h, N]);
            let options = InterpolateOptions::new(InterpolateMode::Bilinear);
            interpolate(top, [N, N], options).reshape([N, N])
        }
        Op::Cross => {
            let three = |t: Tensor<B, 2>| t.slice([0..N, 0..3]);
            let crossed = three(a.clone()).cross(three(b), 1);
            Tensor::cat(vec![crossed, a.slice([0..N, 3..N])], 1)
        }
        Op::Cumsum => a.cumsum(node.dim).mul_scalar(0.25),
        Op::Cumprod => a.tanh().add_scalar(1.5).mul_scalar(0.5).cumprod(node.dim),
        // Scaled: Flex 0.21 panics in `sum_dim(0)` of a flipped view of a transposed tensor
        // (`swap_dims(0, 1).flip([1])`, in plain Burn too); the product is contiguous.
        Op::Flip => a.flip([node.dim as isize]).mul_scalar(0.5),
        Op::Expanded => a.slice([0..1, 0..N]).expand([N, N]) * b.tanh(),
        Op::Stacked => Tensor::stack::<3>(vec![a.slice([0..h, 0..N]), b.slice([0..h, 0..N])], 0)
            .reshape([N, N]),
        Op::SquareSign => a.clone().square().neg().mul_scalar(0.1) + b.sign() * a,
        Op::Variance => a.clone().var(node.dim) * a,
        Op::MaxPair => a.max_pair(b),
        // A value per row, broadcast: what Burn 0.21's fusion gets wrong (`workarounds.rs`).
        Op::Argmax => {
            let picked = b.gather(1, a.clone().argmax(1));
            picked * a
        }
        Op::Sorted => a.sort(node.dim),
        Op::Floor => a.clone().mul_scalar(4.0).floor().mul_scalar(0.25) + a,
    }
}

/// The case's loss(es) on `B`, backpropagated: every tracked leaf's gradient per loss (an
/// empty `TensorData` where a leaf got none), and the loss values.
fn run<B: AutodiffBackend>(case: &Case, device: &B::Device) -> Vec<TensorData> {
    let leaf =
        |i: usize| Tensor::<B, 2>::from_data(TensorData::new(case.data[i].clone(), [N, N]), device);
    let tracked: Vec<_> = (0..LEAVES - 1).map(|i| leaf(i).require_grad()).collect();
    let leaves: Vec<_> = tracked
        .iter()
        .cloned()
        .chain([leaf(LEAVES - 1)])
        .map(Some)
        .collect();
    let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(case.mask.clone(), [N, N]), device);
    let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(case.rows.clone(), [N]), device);
    // A value is dropped after its last use, as a model's forward drops its intermediates
    // (what autodiff's memory management, and its races, see); the outputs live on.
    // (A value never used goes at once.)
    let mut last_use: Vec<usize> = (0..LEAVES + case.nodes.len())
        .map(|i| i.saturating_sub(LEAVES))
        .collect();
    for (k, node) in case.nodes.iter().enumerate() {
        last_use[node.a] = k;
        last_use[node.b] = k;
    }
    let forward = || {
        let mut pool = leaves.clone();
        for (k, node) in case.nodes.iter().enumerate() {
            let out = apply(*node, &pool, &mask, &rows);
            pool.push(Some(out));
            for (i, value) in pool.iter_mut().enumerate().skip(LEAVES) {
                if last_use[i] == k && !case.outputs.contains(&i) {
                    *value = None;
                }
            }
        }
        pool
    };
    let pool = forward();
    let second = case.twice.then(forward);
    // Each output weighted by a fixed tensor: a plain mean of a softmax or of a normalized
    // row is constant, and its gradient would be rounding noise alone.
    let weights = leaf(LEAVES - 1).abs().add_scalar(0.5);
    let loss = |pool: &[Option<Tensor<B, 2>>], outputs: &[usize]| {
        outputs
            .iter()
            .enumerate()
            .map(|(k, &i)| {
                let output = pool[i].clone().expect("an output");
                (output * weights.clone().mul_scalar(1.0 + k as f32)).mean()
            })
            .reduce(|a, b| a + b)
            .expect("an output")
    };
    let mut losses = if case.two_losses {
        vec![
            loss(&pool, &case.outputs[..1]),
            loss(&pool, &case.outputs[1..]),
        ]
    } else {
        vec![loss(&pool, &case.outputs)]
    };
    if let Some(second) = second {
        losses.push(loss(&second, &case.outputs));
    }
    drop(pool);
    let mut results = Vec::new();
    for loss in losses {
        results.push(loss.clone().cast(DType::F32).into_data());
        if !loss.is_require_grad() {
            continue; // built from constants and detached values alone
        }
        let grads = loss.backward();
        for t in &tracked {
            results.push(match t.grad(&grads) {
                Some(g) => g.cast(DType::F32).into_data(),
                None => TensorData::new(Vec::<f32>::new(), [0]),
            });
        }
    }
    results
}

/// Which of autocast's savings are on.
#[derive(Debug, Clone, Copy)]
struct Savings {
    weight_casts: bool,
    activation_casts: bool,
    widening_recomputed: bool,
    outputs_recomputed: bool,
}

impl Savings {
    const ALL: Savings = Savings {
        weight_casts: true,
        activation_casts: true,
        widening_recomputed: true,
        outputs_recomputed: true,
    };
    const NONE: Savings = Savings {
        weight_casts: false,
        activation_casts: false,
        widening_recomputed: false,
        outputs_recomputed: false,
    };

    /// Runs `f` with these settings on this thread, then restores the previous ones.
    fn with<T>(self, f: impl FnOnce() -> T) -> T {
        let previous = (
            cast_cache::set_enabled(self.weight_casts),
            cast_cache::set_activations_enabled(self.activation_casts),
            upcast::set_enabled(self.widening_recomputed),
            recompute::set_enabled(self.outputs_recomputed),
        );
        let out = f();
        cast_cache::set_enabled(previous.0);
        cast_cache::set_activations_enabled(previous.1);
        upcast::set_enabled(previous.2);
        recompute::set_enabled(previous.3);
        out
    }
}

fn under<X: Backend, C: CheckpointStrategy>(
    case: &Case,
    device: &X::Device,
    precision: Precision,
    savings: Savings,
) -> Vec<TensorData> {
    let _g = autocast(precision);
    savings.with(|| run::<Amp<Autodiff<X, C>>>(case, device))
}

/// Equal bit for bit, any NaN equal to any NaN.
fn same_bits(a: &TensorData, b: &TensorData) -> bool {
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    a.len() == b.len()
        && a.iter()
            .zip(&b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

/// `got` is `want`: bit for bit where `exact`, else within 1e-3 relative L2 per result (a
/// fusion backend: see `savings_change_no_value`).
fn assert_same(case: &Case, got: &[TensorData], want: &[TensorData], what: &str, exact: bool) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = same_bits(g, w) || {
            let (g, w) = (g.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap());
            !exact && g.len() == w.len() && rel_l2(&g, &w) <= 1e-3
        };
        assert!(
            same,
            "random graph (seed {}): result {i} (loss, then a gradient per tracked leaf, per \
             loss) differs with {what}\n  nodes: {:?}\n  outputs: {:?}, two losses: {}",
            case.seed, case.nodes, case.outputs, case.two_losses
        );
    }
}

/// Every saving on and off, alone and together, under both checkpointing strategies: bitwise
/// the same as the run that differs only in softmax's backward (recomputed outputs make
/// softmax and log-softmax one node with the analytic backward, whose f32 rounding differs
/// from Burn's composition), and that run within `softmax_tolerance` (relative L2) of it;
/// then autocast at F32 against plain autodiff.
fn savings_change_no_value<X: Backend>(
    device: &X::Device,
    precision: Precision,
    cases: u64,
    max_ops: usize,
) {
    // Bitwise on Flex. Burn's fusion (wgpu) is not bitwise reproducible here: in one CI run
    // the same op stream gave a loss that differed (seed 17, not reproduced by hand), so
    // there the results agree within 1e-3.
    let exact = !core::any::type_name::<X>().contains("Fusion");
    let only = |outputs_recomputed: bool| Savings {
        outputs_recomputed,
        ..Savings::NONE
    };
    let settings = [
        ("everything", Savings::ALL),
        (
            "the weight-cast cache off",
            Savings {
                weight_casts: false,
                ..Savings::ALL
            },
        ),
        (
            "shared activation casts off",
            Savings {
                activation_casts: false,
                ..Savings::ALL
            },
        ),
        (
            "recomputed widening off",
            Savings {
                widening_recomputed: false,
                ..Savings::ALL
            },
        ),
        (
            "recomputed outputs off",
            Savings {
                outputs_recomputed: false,
                ..Savings::ALL
            },
        ),
        ("nothing", Savings::NONE),
    ];
    for seed in 0..cases {
        let case = Case::draw(seed, max_ops);
        let composed = under::<X, NoCheckpointing>(&case, device, precision, only(false));
        let analytic = under::<X, NoCheckpointing>(&case, device, precision, only(true));
        for (what, savings) in settings {
            let want = if savings.outputs_recomputed {
                &analytic
            } else {
                &composed
            };
            let got = under::<X, NoCheckpointing>(&case, device, precision, savings);
            assert_same(&case, &got, want, what, exact);
            let got = under::<X, BalancedCheckpointing>(&case, device, precision, savings);
            assert_same(
                &case,
                &got,
                want,
                &format!("{what}, Burn's BalancedCheckpointing"),
                exact,
            );
        }
        for (i, (a, c)) in analytic.iter().zip(&composed).enumerate() {
            let err = rel_l2(&a.to_vec::<f32>().unwrap(), &c.to_vec::<f32>().unwrap());
            assert!(
                err <= softmax_tolerance(precision),
                "random graph (seed {}): result {i} {err:.2e} from the composed softmax's\n  \
                 nodes: {:?}",
                case.seed,
                case.nodes
            );
        }

        // The precision doctor watches every op (forward and backward) and changes none.
        let anomaly = burn_amp::doctor::detect_anomaly();
        let got = under::<X, NoCheckpointing>(&case, device, precision, Savings::ALL);
        assert!(anomaly.ops_checked() > 0, "the doctor saw no op");
        drop(anomaly);
        assert_same(
            &case,
            &got,
            &analytic,
            "the precision doctor's detect_anomaly()",
            exact,
        );

        let f32 = under::<X, NoCheckpointing>(&case, device, Precision::F32, Savings::ALL);
        // Plain autodiff over Burn 0.21's fusion gets a broadcast per-row pick wrong, which
        // `Amp` works around (`workarounds.rs`): no reference there.
        let fused = core::any::type_name::<X>().contains("Fusion");
        if !(fused && case.nodes.iter().any(|n| matches!(n.op, Op::Argmax))) {
            let plain = run::<Autodiff<X>>(&case, device);
            assert_same(
                &case,
                &f32,
                &plain,
                "autocast at F32 against plain autodiff",
                exact,
            );
        }
    }
}

fn softmax_tolerance(precision: Precision) -> f32 {
    if precision == Precision::Bf16 {
        3e-2
    } else {
        5e-3
    }
}

#[test]
fn random_graphs_flex_f16() {
    savings_change_no_value::<Flex>(&Default::default(), Precision::F16, 400, 24);
}

#[test]
fn random_graphs_flex_bf16() {
    savings_change_no_value::<Flex>(&Default::default(), Precision::Bf16, 400, 24);
}

/// Long graphs: chains past `recompute::MAX_CHAIN` whose paths meet.
#[test]
fn long_random_graphs_flex_bf16() {
    savings_change_no_value::<Flex>(&Default::default(), Precision::Bf16, 80, 64);
}

#[test]
fn random_graphs_wgpu_f16() {
    if let Some(device) = common::wgpu_device() {
        savings_change_no_value::<burn::backend::Wgpu>(&device, Precision::F16, 20, 24);
    }
}

/// Burn's fusion against the same kernels unfused (`CubeBackend`), on wgpu, under autocast at
/// F32 and at F16: the loss and gradients within 1e-4 (F32) or 2e-2 (F16) relative L2 (fusion
/// may order a reduction differently). A fused kernel that reads a value wrong is caught here
/// (the per-row pick of `workarounds.rs` was, as a difference with the precision doctor on,
/// whose reads split the fusion). Burn 0.21's fusion also panics in its code generation on
/// some graphs (`w.swap_dims(0, 1).tanh().prod_dim(0)`, backpropagated, seed 168 here): the
/// seeds run stop short of it.
#[test]
fn random_graphs_fused_and_unfused_agree_on_wgpu() {
    type Unfused =
        burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
    let Some(device) = common::wgpu_device() else {
        return;
    };
    for seed in 0..40 {
        let case = Case::draw(seed, 24);
        for (precision, tolerance) in [(Precision::F32, 1e-4), (Precision::F16, 2e-2)] {
            let run = |fused: bool| match fused {
                true => under::<burn::backend::Wgpu, NoCheckpointing>(
                    &case,
                    &device,
                    precision,
                    Savings::ALL,
                ),
                false => under::<Unfused, NoCheckpointing>(&case, &device, precision, Savings::ALL),
            };
            let (fused, unfused) = (run(true), run(false));
            for (i, (a, b)) in fused.iter().zip(&unfused).enumerate() {
                let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
                let finite = |v: &[f32]| v.iter().all(|x| x.is_finite());
                match (finite(&a), finite(&b)) {
                    (true, true) => {}
                    (false, false) => continue, // an inf or NaN of the graph itself
                    // At F16 an overflow may tip either way; at F32 one side is wrong.
                    _ if precision == Precision::F16 => continue,
                    (fused_finite, _) => panic!(
                        "random graph (seed {seed}): result {i} finite fused {fused_finite}, \
                         unfused {}\n  nodes: {:?}",
                        !fused_finite, case.nodes
                    ),
                }
                let err = rel_l2(&a, &b);
                assert!(
                    err <= tolerance,
                    "random graph (seed {seed}) at {precision:?}: result {i} fused is {err:.2e} \
                     from unfused\n  nodes: {:?}",
                    case.nodes
                );
            }
        }
    }
}
