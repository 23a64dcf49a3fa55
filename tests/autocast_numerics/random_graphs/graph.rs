//! The random graphs: the ops they are drawn from, a case drawn from a seed, and a case run
//! forward and backward on a backend.

use burn::tensor::activation::{gelu, log_sigmoid, log_softmax, relu, sigmoid, silu, softmax};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Bool, Int, TensorData};

use super::super::common::Rng;
use super::super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
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
    TransposedBiasCat,
}

pub(super) const OPS: [Op; 61] = [
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
    Op::TransposedBiasCat,
];

/// Side of every tensor.
const N: usize = 8;

/// Leaves at the front of the pool: an input and two weights that require gradients, and an
/// untracked constant.
pub(super) const LEAVES: usize = 4;

#[derive(Debug, Clone, Copy)]
pub(super) struct Node {
    pub(super) op: Op,
    a: usize,
    b: usize,
    dim: usize,
}

#[derive(Debug, Clone)]
pub(super) struct Case {
    pub(super) seed: u64,
    pub(super) nodes: Vec<Node>,
    /// The pool indices summed into the loss(es).
    pub(super) outputs: Vec<usize>,
    /// The outputs are split into two losses (their sum backpropagated).
    pub(super) two_losses: bool,
    /// The graph is built twice from the same leaves (two forwards through the same
    /// parameters, as two micro-batches), then both are backpropagated.
    twice: bool,
    data: [Vec<f32>; LEAVES],
    mask: Vec<bool>,
    rows: Vec<i64>,
}

impl Case {
    /// The same graph on inputs moved by `relative` (up and down in turn): how much a
    /// last-bit difference moves the results says how much two backends may differ.
    pub(super) fn perturbed(&self, relative: f32) -> Case {
        let mut case = self.clone();
        for leaf in &mut case.data {
            for (i, v) in leaf.iter_mut().enumerate() {
                *v *= if i % 2 == 0 {
                    1.0 + relative
                } else {
                    1.0 - relative
                };
            }
        }
        case
    }

    /// Whether any node of the graph is one of `ops`.
    pub(super) fn has(&self, ops: &[Op]) -> bool {
        self.nodes.iter().any(|n| ops.contains(&n.op))
    }

    /// One op on the input and the first weight (`dim` where it takes one), its output the
    /// loss's, on the leaves of `seed`'s graph.
    pub(super) fn single(op: Op, dim: usize, seed: u64) -> Self {
        let mut case = Case::draw(seed, 2);
        case.nodes = vec![Node {
            op,
            a: 0,
            b: 1,
            dim,
        }];
        case.outputs = vec![LEAVES];
        case.two_losses = false;
        case.twice = false;
        case
    }

    /// The leaves' values.
    pub(super) fn data(&self) -> &[Vec<f32>; LEAVES] {
        &self.data
    }

    pub(super) fn draw(seed: u64, max_ops: usize) -> Self {
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
        // A row broadcast, transposed, then half of a cat: its backward sums a gradient that is
        // a narrowed, transposed view (wrong on plain Flex).
        Op::TransposedBiasCat => {
            let biased = a.clone().slice([0..h, 0..N]) + b.slice([0..1, 0..N]);
            Tensor::cat(vec![biased.swap_dims(0, 1), a.slice([0..N, h..N])], 1)
        }
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

/// The case's loss on `B` for one forward from `leaves` (the values of any float dtype: the
/// gradient check runs it in f64), all outputs summed; values are kept to the end.
pub(super) fn total_loss<B: Backend>(case: &Case, leaves: &[Tensor<B, 2>]) -> Tensor<B, 1> {
    let device = leaves[0].device();
    let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(case.mask.clone(), [N, N]), &device);
    let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(case.rows.clone(), [N]), &device);
    let mut pool: Vec<_> = leaves.iter().cloned().map(Some).collect();
    for node in &case.nodes {
        let out = apply(*node, &pool, &mask, &rows);
        pool.push(Some(out));
    }
    let weights = leaves[LEAVES - 1].clone().abs().add_scalar(0.5);
    weighted(&pool, &case.outputs, &weights)
}

/// The sum of `outputs` of `pool`, each weighted by `weights` (times 1, 2, .. in turn) and
/// averaged: a plain mean of a softmax or of a normalized row is constant, and its gradient
/// would be rounding noise alone.
fn weighted<B: Backend>(
    pool: &[Option<Tensor<B, 2>>],
    outputs: &[usize],
    weights: &Tensor<B, 2>,
) -> Tensor<B, 1> {
    outputs
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            let output = pool[i].clone().expect("an output");
            (output * weights.clone().mul_scalar(1.0 + k as f32)).mean()
        })
        .reduce(|a, b| a + b)
        .expect("an output")
}

/// The case's loss values on `B`, each forward's then backpropagated: every tracked leaf's
/// gradient per forward (an empty `TensorData` where a leaf got none).
pub(super) fn run<B: AutodiffBackend>(case: &Case, device: &B::Device) -> Vec<TensorData> {
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
    let weights = leaf(LEAVES - 1).abs().add_scalar(0.5);
    let loss = |pool: &[Option<Tensor<B, 2>>], outputs: &[usize]| weighted(pool, outputs, &weights);
    // The losses of each forward. Two losses over one graph are backpropagated as their sum:
    // burn-autodiff frees a graph's nodes in its backward (there is no `retain_graph`), so a
    // second backward through shared nodes panics, in plain Burn as under `Amp`.
    let mut forwards = if case.two_losses {
        vec![vec![
            loss(&pool, &case.outputs[..1]),
            loss(&pool, &case.outputs[1..]),
        ]]
    } else {
        vec![vec![loss(&pool, &case.outputs)]]
    };
    if let Some(second) = second {
        forwards.push(vec![loss(&second, &case.outputs)]);
    }
    drop(pool);
    let mut results = Vec::new();
    for losses in forwards {
        for loss in &losses {
            results.push(loss.clone().cast(DType::F32).into_data());
        }
        let total = losses.into_iter().reduce(|a, b| a + b).expect("a loss");
        // Built from constants and detached values alone, a loss has no graph: every leaf's
        // gradient is then `None`, as it is for a leaf the loss does not depend on.
        let grads = total.backward();
        for t in &tracked {
            results.push(match t.grad(&grads) {
                Some(g) => g.cast(DType::F32).into_data(),
                None => TensorData::new(Vec::<f32>::new(), [0]),
            });
        }
    }
    results
}
