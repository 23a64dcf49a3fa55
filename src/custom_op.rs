//! Autocast for an op of your own: a backend trait that extends Burn's (a custom CubeCL
//! kernel, a fused op), as PyTorch's `torch.amp.custom_fwd(cast_inputs=...)` does for a
//! custom autograd function.
//!
//! A model written against `B: MyBackend` runs on `Amp<B>` once `Amp<B>` implements
//! `MyBackend`. `Amp`'s tensor primitives are `B`'s own, so the implementation forwards to
//! `B`; what it must decide is the dtype the op's float inputs arrive in. Under autocast they
//! come from lowered and f32 ops alike (an f16 activation beside an f32 weight), and a kernel
//! written for the backend's float element, as Burn's `custom-cubecl-kernel` example is
//! (`launch::<F, R>` with `F` the backend's `FloatElement`, f32), reads an f16 buffer as f32:
//! garbage, not an error. A [`CustomOp`] says both things once: how autocast treats the op
//! (a [`Category`] of the policy table) and which dtypes its kernel reads. [`CustomOp::cast`]
//! then casts the inputs the way `Amp`'s own ops are cast (autodiff records the casts above
//! it; a parameter's half copy is shared through the [cast cache](crate::backend::cast_cache)),
//! into a dtype the kernel reads.
//!
//! ```no_run
//! use burn::tensor::ops::FloatTensor;
//! use burn::tensor::{Tensor, TensorPrimitive};
//! use burn::prelude::Backend;
//! use burn_amp::custom_op::{Category, CustomOp};
//! use burn_amp::Amp;
//!
//! /// Your backend trait (implemented for your backends and for `Autodiff<B>`).
//! pub trait FusedBackend: Backend {
//!     fn fused_matmul_add_relu(
//!         lhs: FloatTensor<Self>,
//!         rhs: FloatTensor<Self>,
//!         bias: FloatTensor<Self>,
//!     ) -> FloatTensor<Self>;
//! }
//!
//! /// A matmul: half precision under autocast, where the kernel reads f16 and bf16 too
//! /// (`.accepts(&[FloatDType::F32])` for a kernel written for f32 alone, with
//! /// `burn::tensor::FloatDType`).
//! const FUSED: CustomOp = CustomOp::new("fused_matmul_add_relu", Category::Lower);
//!
//! impl<B: FusedBackend> FusedBackend for Amp<B> {
//!     fn fused_matmul_add_relu(
//!         lhs: FloatTensor<Self>,
//!         rhs: FloatTensor<Self>,
//!         bias: FloatTensor<Self>,
//!     ) -> FloatTensor<Self> {
//!         FUSED.run::<B, 3>([lhs, rhs, bias], |[lhs, rhs, bias]| {
//!             B::fused_matmul_add_relu(lhs, rhs, bias)
//!         })
//!     }
//! }
//! ```
//!
//! With `Amp<Autodiff<B>>` (the usual stack) the op's backward is your `Autodiff<B>`
//! implementation's, on the inputs as cast: half inputs give half gradients, and the casts
//! autodiff recorded bring each parameter's gradient back to its dtype. Below autodiff
//! (`Autodiff<Amp<B>>`) your backward's ops are `Amp`'s, autocast like any others.
//!
//! [`CustomOp::run`] casts, calls the op and shows it to the [precision doctor](crate::doctor),
//! which then names it when it creates an inf or NaN and measures what it loses in half
//! precision; [`CustomOp::run_many`] does the same for several float outputs, and
//! [`CustomOp::run_with_indices`] for an op that also returns indices (the report compares
//! them with the f32 run's). [`CustomOp::cast`] casts alone (an op with bool outputs, or a
//! number of inputs known at run time); the doctor does not see such an op, and an inf it
//! creates shows as one passed on by the next op.

use burn_backend::Backend;
use burn_backend::tensor::{FloatTensor, IntTensor};
use burn_std::FloatDType;

pub use crate::backend::Category;
use crate::backend::policy::{Autocast, Plan};
use crate::doctor::{Chosen, Probe};

/// An op of your own under autocast: its name, its [`Category`] in the policy, and the float
/// dtypes its kernel reads. A small value, made once (`const`), used by each call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CustomOp {
    name: &'static str,
    category: Category,
    /// `None`: every float dtype.
    accepts: Option<&'static [FloatDType]>,
}

impl CustomOp {
    /// An op treated as the policy treats `category` (`Lower`: f16/bf16 under autocast, as
    /// matmul; `F32`: f32, as softmax; `Promote`: the widest input dtype; `Pass`: as they come,
    /// promoted when they differ), whose kernel reads every float dtype.
    pub const fn new(name: &'static str, category: Category) -> Self {
        Self {
            name,
            category,
            accepts: None,
        }
    }

    /// The float dtypes the op's kernel reads (a kernel compiled for the backend's float
    /// element reads that one alone: `&[FloatDType::F32]`). Inputs the policy would leave in
    /// another dtype are cast to f32 where it is listed, else to the first listed.
    ///
    /// # Panics
    /// At compile time in a `const`, on an empty list: the op could read nothing.
    pub const fn accepts(self, dtypes: &'static [FloatDType]) -> Self {
        assert!(
            !dtypes.is_empty(),
            "CustomOp::accepts: list at least one float dtype the op's kernel reads"
        );
        Self {
            accepts: Some(dtypes),
            ..self
        }
    }

    /// The op's name.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// Its category in the policy.
    pub const fn category(&self) -> Category {
        self.category
    }

    /// Whether the op's kernel reads `dtype`.
    pub fn reads(&self, dtype: FloatDType) -> bool {
        self.accepts.is_none_or(|list| list.contains(&dtype))
    }

    /// `op` called on `inputs` cast as [`cast`](Self::cast) casts them, under the
    /// [precision doctor](crate::doctor)'s eye like `Amp`'s own ops: `detect_anomaly` names
    /// this op when it creates an inf or NaN, and `PrecisionReport` measures it against a run
    /// of `op` on the same inputs in f32 (when the op reads f32; `op` is called twice then).
    pub fn run<B: Backend, const N: usize>(
        &self,
        inputs: [FloatTensor<B>; N],
        op: impl Fn([FloatTensor<B>; N]) -> FloatTensor<B>,
    ) -> FloatTensor<B> {
        self.probed::<B, N, _, 0>(inputs, |x| (op(x), [])).0
    }

    /// [`run`](Self::run) for an op with several float outputs (a fused layer norm's output,
    /// mean and inverse deviation; an attention's output and log-sum-exp), all in the dtype
    /// the op ran in. The doctor checks them together (the first with an inf or NaN is
    /// reported) and measures each as a call of its own.
    pub fn run_many<B: Backend, const N: usize, const M: usize>(
        &self,
        inputs: [FloatTensor<B>; N],
        op: impl Fn([FloatTensor<B>; N]) -> [FloatTensor<B>; M],
    ) -> [FloatTensor<B>; M] {
        self.probed::<B, N, _, 0>(inputs, |x| (op(x), [])).0
    }

    /// [`run_many`](Self::run_many) for an op that also returns indices it chose by comparing
    /// floats (a fused router's experts beside their gates, a top-k's positions): the doctor
    /// checks the float outputs, and the precision report gives each index output a row with
    /// the share that differ from the f32 run's, index by index (see
    /// [`OpPrecision::differing`](crate::doctor::OpPrecision::differing)).
    #[allow(clippy::type_complexity)]
    pub fn run_with_indices<B: Backend, const N: usize, const M: usize, const K: usize>(
        &self,
        inputs: [FloatTensor<B>; N],
        op: impl Fn([FloatTensor<B>; N]) -> ([FloatTensor<B>; M], [IntTensor<B>; K]),
    ) -> ([FloatTensor<B>; M], [IntTensor<B>; K]) {
        self.probed::<B, N, _, K>(inputs, op)
    }

    fn probed<B: Backend, const N: usize, O: Outputs<FloatTensor<B>>, const K: usize>(
        &self,
        inputs: [FloatTensor<B>; N],
        op: impl Fn([FloatTensor<B>; N]) -> (O, [IntTensor<B>; K]),
    ) -> (O, [IntTensor<B>; K]) {
        let plan = self.plan::<B>(inputs.iter());
        let mut probe = Probe::<B>::start_custom(*self);
        if let Some(probe) = probe.as_mut() {
            for x in &inputs {
                probe.input(x);
            }
            if self.reads(FloatDType::F32) && probe.wants_shadow(plan.target) {
                let (shadow, _) = op(inputs.each_ref().map(Probe::<B>::shadow_input));
                probe.shadow_floats(&shadow.floats());
            }
        }
        let inputs = inputs.map(|x| plan.cast::<B>(x));
        if let Some(probe) = probe.as_mut() {
            for x in &inputs {
                probe.cast_input(x);
            }
        }
        let (out, indices) = op(inputs);
        if let Some(probe) = probe {
            probe.finish_outputs(&out.floats(), &indices.each_ref().map(Chosen::Indices));
        }
        (out, indices)
    }

    /// The op's float inputs, cast as the policy and the thread's precision say, into a dtype
    /// the op reads: all in one dtype. For an op with outputs of other kinds (a bool mask) or
    /// whose number of inputs is known at run time
    /// ([`cast_vec`](Self::cast_vec)); the doctor does not see the op (see [`run`](Self::run)).
    pub fn cast<B: Backend, const N: usize>(
        &self,
        inputs: [FloatTensor<B>; N],
    ) -> [FloatTensor<B>; N] {
        let plan = self.plan::<B>(inputs.iter());
        inputs.map(|x| plan.cast::<B>(x))
    }

    /// [`cast`](Self::cast) for a number of inputs known at run time (a list of tensors, an
    /// optional bias pushed when present).
    pub fn cast_vec<B: Backend>(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        let plan = self.plan::<B>(inputs.iter());
        inputs.into_iter().map(|x| plan.cast::<B>(x)).collect()
    }

    /// The casts for these inputs: the policy's, then into a dtype the op reads.
    fn plan<'a, B: Backend>(&self, inputs: impl Iterator<Item = &'a FloatTensor<B>>) -> Plan {
        let mut autocast = Autocast::<B>::custom(self.category);
        for x in inputs {
            autocast.see(x);
        }
        let mut plan = autocast.plan();
        if let (Some(dtype), Some(list)) = (autocast.dtype(), self.accepts)
            && !list.contains(&dtype)
        {
            let read = if list.contains(&FloatDType::F32) {
                FloatDType::F32
            } else {
                list[0]
            };
            plan.target = Some(read);
        }
        plan
    }
}

/// What [`CustomOp::run`] and [`CustomOp::run_many`] return: the op's float outputs, for the
/// doctor.
trait Outputs<F> {
    fn floats(&self) -> Vec<&F>;
}

impl<F> Outputs<F> for F {
    fn floats(&self) -> Vec<&F> {
        vec![self]
    }
}

impl<F, const M: usize> Outputs<F> for [F; M] {
    fn floats(&self) -> Vec<&F> {
        self.iter().collect()
    }
}
