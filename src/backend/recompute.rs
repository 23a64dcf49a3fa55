//! Outputs recomputed in the backward instead of kept: elementwise ops and softmax.
//!
//! burn-autodiff's elementwise ops that keep their inputs for the backward (`sigmoid`, `exp`,
//! `mul`, `tanh`, `gelu`, ...) are memory-bound: under `BalancedCheckpointing` a later op that
//! needs their output keeps a recipe (the op, and inputs that are kept anyway) instead of the
//! output. Without checkpointing the output is kept too. Under autocast that cost is doubled:
//! the ops of the f32 category return f32 from half-precision inputs. SiLU is `x * sigmoid(x)`
//! in Burn: the `mul` kept `sigmoid(x)` in f32, 4 bytes per element beside x's 2, where
//! PyTorch's fused `silu` keeps x alone; `SwiGlu`'s product kept `silu(x)` in f32 too.
//!
//! While autocast lowers (any setting but `Precision::F32`), these ops build their node as
//! memory-bound whatever the graph's strategy. They keep nothing more for it (their inputs
//! are kept by their own backward already), and the backward recomputes an output it needs
//! from those inputs: the same op on the same values (the same bits on Flex and wgpu,
//! tested; on CUDA, fusion may group the recomputed op with others). SiLU then keeps
//! its half input alone (with [recomputed widening](super::upcast)); so does `silu(x) * y`.
//!
//! `softmax` and `log_softmax` were Burn's composition under autodiff (`sub`, `exp`, `sum`,
//! `div`), which kept the shifted input and the exponentials, 8 bytes per element in f32. Here
//! they are one node: the backend's kernel forward, the analytic backward
//! (`y ⊙ (g − Σ g ⊙ y)`, `g − exp(y) ⊙ Σ g`), and only the input kept, recomputing `y`. An
//! attention's scores, lowered by their matmul and widened for the softmax, are then kept in
//! half (2 bytes per element, from 8), as are an LM head's logits under `log_softmax`.
//!
//! A chain of recomputed nodes is at most [`MAX_CHAIN`] long: past it a node is built as the
//! graph's strategy builds it (its output kept). burn-autodiff 0.21 walks a recomputed node's
//! ancestors path by path, without memo, so a chain whose paths meet again (`y = y * f(y)` in a
//! loop) costs 2^length in the backward: unbounded, 32 such steps did not finish in 20 minutes.
//! The benched models' chains are short (`SwiGlu`: 4, from the widening cast to the product).
//! Softmax past it is the same node keeping its output: values never depend on a chain's
//! length (the random-graph tests compare every setting bit for bit on Flex).
//!
//! This needs the concrete autodiff backend, as the [cast cache](super::cast_cache) does:
//! `Autodiff<Flex | Wgpu | Cuda>`, either checkpointing. Other backends run their own ops.

use core::any::Any;
use core::marker::PhantomData;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Arc, Weak};

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn_backend::Backend;
use burn_backend::ops::{ActivationOps, FloatTensorOps};
use burn_backend::tensor::FloatTensor;

use super::concrete::{AutodiffTensor, Visit, dispatch, moved};
use super::policy::Op;
use crate::Precision;

/// The longest chain of recomputed nodes (widening casts included): at most 2^8 paths to
/// walk for one retrieval in the backward.
pub const MAX_CHAIN: u8 = 8;

/// A recomputed node's place in its chain.
struct Link {
    depth: u8,
    /// The node: alive while tensors or graphs hold it (pruned once gone).
    node: Weak<dyn Any>,
}

/// The smallest map that is scanned for nodes gone.
const PRUNE_FROM: usize = 64;

thread_local! {
    static ENABLED: Cell<bool> = const { Cell::new(true) };
    static CHAINS: RefCell<HashMap<NodeId, Link>> = RefCell::new(HashMap::new());
}

/// The depth in a chain of recomputed nodes of a node over `inputs`, or `None` past
/// [`MAX_CHAIN`]: an input that is not a recomputed node starts a chain.
pub(crate) fn chain_depth<'a, X: Backend>(
    inputs: impl IntoIterator<Item = &'a AutodiffTensor<X>>,
) -> Option<u8> {
    let longest = CHAINS.with(|c| {
        let chains = c.borrow();
        inputs
            .into_iter()
            .filter_map(|t| chains.get(&t.node.id).map(|link| link.depth))
            .max()
            .unwrap_or(0)
    });
    (longest < MAX_CHAIN).then_some(longest + 1)
}

/// Notes that `output` is a recomputed node at `depth` of its chain.
pub(crate) fn record<X: Backend>(output: &AutodiffTensor<X>, depth: u8) {
    if !output.is_tracked() {
        return;
    }
    let link = Link {
        depth,
        node: Arc::downgrade(&output.node) as Weak<dyn Any>,
    };
    CHAINS.with(|c| {
        let mut chains = c.borrow_mut();
        // Nodes gone (their backward ran, their tensors dropped) leave when the map doubles:
        // a scan per node would cost O(n²) a forward.
        let len = chains.len();
        if len >= PRUNE_FROM && len.is_power_of_two() {
            chains.retain(|_, link| link.node.strong_count() > 0);
        }
        chains.insert(output.node.id, link);
    });
}

/// Turns recomputation on or off for this thread (on by default); returns the previous
/// setting. Off, the ops build their nodes as burn-autodiff does under the graph's strategy,
/// and softmax is Burn's composition.
pub fn set_enabled(enabled: bool) -> bool {
    ENABLED.with(|e| e.replace(enabled))
}

/// Whether this thread recomputes now: on, and autocast lowers.
#[inline]
pub(crate) fn active() -> bool {
    ENABLED.with(|e| e.get()) && crate::precision::thread_state().precision != Some(Precision::F32)
}

/// Whether `op`, run now, keeps its input for its backward where Burn's own op did not: a
/// widened input is then better kept as its half source ([`super::upcast`]).
#[inline]
pub(crate) fn keeps_input(op: Op) -> bool {
    matches!(op, Op::softmax | Op::log_softmax) && active()
}

/// One function per op: `B`'s op, run as `Autodiff<X, BalancedCheckpointing>`'s when `B` is a
/// listed `Autodiff<X, _>` and recomputation is active (the tensor type is the same under
/// either strategy: only how the node is built differs).
macro_rules! recomputed_ops {
    ($($ops:ident :: $name:ident($($arg:ident),*);)*) => {
        /// The ops recomputed here: burn-autodiff 0.21's memory-bound ops that keep every
        /// tracked input for their backward (so a recipe of them keeps nothing more), and
        /// softmax and log-softmax; `exp`, `log`, `log1p`, `sqrt` and `log_sigmoid` (for
        /// their backward at an infinity), `relu`, `sigmoid`, `atan2` and the powers (for a
        /// NaN that survives the recomputation) are such ops too, whose nodes `Amp` builds
        /// itself under the same strategy.
        pub const fn is_recomputed(op: Op) -> bool {
            matches!(
                op,
                $(Op::$name)|*
                    | Op::softmax
                    | Op::log_softmax
                    | Op::float_exp
                    | Op::float_log
                    | Op::float_log1p
                    | Op::float_sqrt
                    | Op::log_sigmoid
                    | Op::relu
                    | Op::sigmoid
                    | Op::float_atan2
                    | Op::float_powf
                    | Op::float_powf_scalar
                    | Op::float_powf_scalar_impl
                    | Op::float_powi_scalar
                    | Op::float_powi_scalar_impl
            )
        }
        $(
        #[inline]
        pub(crate) fn $name<B: Backend>($($arg: FloatTensor<B>),*) -> FloatTensor<B> {
            if !active() {
                return B::$name($($arg),*);
            }
            #[allow(non_camel_case_types)]
            struct Call<P> {
                $($arg: P),*
            }
            impl<P: 'static> Visit for Call<P> {
                type Out = P;
                fn visit<X: Backend, C: CheckpointStrategy>(self) -> P {
                    $(let $arg: AutodiffTensor<X> = moved(self.$arg);)*
                    moved(match chain_depth::<X>([$(&$arg),*]) {
                        Some(depth) => {
                            let out = <Autodiff<X, BalancedCheckpointing> as $ops<Autodiff<X, BalancedCheckpointing>>>::$name($($arg),*);
                            record(&out, depth);
                            out
                        }
                        None => <Autodiff<X, C> as $ops<Autodiff<X, C>>>::$name($($arg),*),
                    })
                }
            }
            match dispatch::<B, _>(Call { $($arg),* }) {
                Ok(out) => out,
                Err(Call { $($arg),* }) => B::$name($($arg),*),
            }
        }
    )*
    };
}

recomputed_ops! {
    FloatTensorOps::float_mul(lhs, rhs);
    FloatTensorOps::float_div(lhs, rhs);
    FloatTensorOps::float_remainder(lhs, rhs);
    FloatTensorOps::float_recip(tensor);
    FloatTensorOps::float_abs(tensor);
    FloatTensorOps::float_cos(tensor);
    FloatTensorOps::float_sin(tensor);
    FloatTensorOps::float_tan(tensor);
    FloatTensorOps::float_tanh(tensor);
    FloatTensorOps::float_cosh(tensor);
    FloatTensorOps::float_sinh(tensor);
    FloatTensorOps::float_asin(tensor);
    FloatTensorOps::float_acos(tensor);
    FloatTensorOps::float_atan(tensor);
    FloatTensorOps::float_asinh(tensor);
    FloatTensorOps::float_acosh(tensor);
    FloatTensorOps::float_atanh(tensor);
    FloatTensorOps::float_erf(tensor);
    ActivationOps::gelu(tensor);
}

/// `softmax` along `dim` as one node (see the module docs).
#[inline]
pub(crate) fn softmax<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    normalized::<B>(tensor, dim, Normalization::Softmax)
}

/// `log_softmax` along `dim` as one node.
#[inline]
pub(crate) fn log_softmax<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    normalized::<B>(tensor, dim, Normalization::LogSoftmax)
}

#[derive(Debug, Clone, Copy)]
enum Normalization {
    Softmax,
    LogSoftmax,
}

impl Normalization {
    /// On any backend: the inner one's kernel, or (on autodiff) Burn's composition.
    fn forward<X: Backend>(self, tensor: FloatTensor<X>, dim: usize) -> FloatTensor<X> {
        match self {
            Normalization::Softmax => X::softmax(tensor, dim),
            Normalization::LogSoftmax => X::log_softmax(tensor, dim),
        }
    }

    /// The input's gradient from the output `y` and the output's gradient `g`.
    fn backward<X: Backend>(
        self,
        y: FloatTensor<X>,
        g: FloatTensor<X>,
        dim: usize,
    ) -> FloatTensor<X> {
        match self {
            // y ⊙ (g − Σ g ⊙ y)
            Normalization::Softmax => {
                let dot = X::float_sum_dim(X::float_mul(g.clone(), y.clone()), dim);
                X::float_mul(y, X::float_sub(g, dot))
            }
            // g − exp(y) ⊙ Σ g
            Normalization::LogSoftmax => {
                let total = X::float_sum_dim(g.clone(), dim);
                X::float_sub(g, X::float_mul(X::float_exp(y), total))
            }
        }
    }
}

fn normalized<B: Backend>(
    tensor: FloatTensor<B>,
    dim: usize,
    kind: Normalization,
) -> FloatTensor<B> {
    if !active() {
        return kind.forward::<B>(tensor, dim);
    }
    struct Call<P> {
        tensor: P,
        dim: usize,
        kind: Normalization,
    }
    impl<P: 'static> Visit for Call<P> {
        type Out = P;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> P {
            let tensor: AutodiffTensor<X> = moved(self.tensor);
            moved(match chain_depth::<X>([&tensor]) {
                Some(depth) => {
                    let out = normalized_node::<X>(tensor, self.dim, self.kind);
                    record(&out, depth);
                    out
                }
                None => normalized_kept::<X, C>(tensor, self.dim, self.kind),
            })
        }
    }
    match dispatch::<B, _>(Call { tensor, dim, kind }) {
        Ok(out) => out,
        Err(call) => kind.forward::<B>(call.tensor, dim),
    }
}

/// The node: memory-bound, its input kept, its output recomputed where needed.
fn normalized_node<X: Backend>(
    tensor: AutodiffTensor<X>,
    dim: usize,
    kind: Normalization,
) -> AutodiffTensor<X> {
    match NormalizedBackward
        .prepare::<BalancedCheckpointing>([tensor.node.clone()])
        .memory_bound()
        .retro_forward(RetroNormalized::<X> {
            input: tensor.node.id,
            dim,
            kind,
            _backend: PhantomData,
        })
        .parents([&tensor])
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let input = prep.checkpoint(&tensor);
            let y = kind.forward::<X>(tensor.primitive, dim);
            prep.finish((Saved::Input(input), dim, kind), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(kind.forward::<X>(tensor.primitive, dim)),
    }
}

/// The same node past [`MAX_CHAIN`], keeping its output instead of a recipe (and ending the
/// chain): the same kernel forward and analytic backward, so a value never depends on how
/// long the chain before it was. Burn's composition there would round differently.
fn normalized_kept<X: Backend, C: CheckpointStrategy>(
    tensor: AutodiffTensor<X>,
    dim: usize,
    kind: Normalization,
) -> AutodiffTensor<X> {
    match NormalizedBackward
        .prepare::<C>([tensor.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = kind.forward::<X>(tensor.primitive, dim);
            prep.finish((Saved::Output(y.clone()), dim, kind), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(kind.forward::<X>(tensor.primitive, dim)),
    }
}

/// What a normalization node keeps for its backward.
#[derive(Debug, Clone)]
enum Saved<X: Backend> {
    /// Its input's node, the output recomputed from it.
    Input(NodeId),
    /// Its output.
    Output(FloatTensor<X>),
}

#[derive(Debug)]
struct NormalizedBackward;

impl<X: Backend> Backward<X, 1> for NormalizedBackward {
    type State = (Saved<X>, usize, Normalization);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (saved, dim, kind) = ops.state;
        let y = match saved {
            Saved::Input(input) => kind.forward::<X>(checkpointer.retrieve_node_output(input), dim),
            Saved::Output(y) => y,
        };
        unary::<X, _>(ops.parents, ops.node, grads, |g| {
            kind.backward::<X>(y, g, dim)
        });
    }
}

/// The forward again, in the backward, for an op that kept this node's output.
#[derive(Debug)]
struct RetroNormalized<X> {
    input: NodeId,
    dim: usize,
    kind: Normalization,
    _backend: PhantomData<fn() -> X>,
}

impl<X: Backend> RetroForward for RetroNormalized<X> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input: FloatTensor<X> = states.get_state(&self.input);
        states.save(out_node, self.kind.forward::<X>(input, self.dim));
    }
}
