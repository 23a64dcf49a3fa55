//! The fused optimizer steps as [`OptimKernels`]: unscale, skip-on-overflow and the update of
//! one parameter in one pass, with f32 state and f32 math whatever the parameter's dtype.
//! Burn-op defaults for every backend ([`fallback`]), CubeCL kernels on `CubeBackend`, fusion
//! custom ops on `Fusion`.

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, TensorMetadata};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::{Fusion, FusionBackend};
use derive_new::new;

pub mod fallback;
pub mod quantized;

pub use quantized::{MomentsOf, QuantizedMoments};

use super::rounding::{StochasticRounding, kernel_args};
use super::{FusedAdamWConfig, FusedSgdConfig};
use crate::kernels::cube::{
    Elementwise, address_type, assert_f32, assert_same_shape, empty_scalar_f32, output_for,
    scalar_f32,
};
use crate::kernels::cubecl_kernels::optim as k;
use crate::kernels::{fusion, kernels_for_flex_and_amp};

/// The loss scaler's signals for one step, as the kernels read them on the device.
#[derive(Debug, Clone, new)]
pub struct Scaling<T> {
    /// f32 `[1]`: the gradients are multiplied by it (1 when they are not scaled).
    pub inv_scale: T,
    /// f32 `[1]`, 0 or 1: when 1 the step is skipped, every output equal to its input.
    pub found_inf: T,
}

/// One parameter's AdamW state: f32 moments of the parameter's shape, and the f32 `[1]` count
/// of the steps applied to it (skipped steps do not count).
#[derive(Debug, Clone, new)]
pub struct AdamWMoments<T> {
    /// First moment.
    pub exp_avg: T,
    /// Second moment.
    pub exp_avg_sq: T,
    /// AMSGrad's running maximum of the second moment. When present the step updates it and
    /// divides by it; [`FusedAdamW`](super::FusedAdamW) keeps one when its config says
    /// `amsgrad`.
    pub max_exp_avg_sq: Option<T>,
    /// Steps applied.
    pub step: T,
}

/// One parameter's SGD momentum: the f32 velocity, and the f32 `[1]` count of the steps
/// applied (0: the next step sets the velocity to the gradient, as PyTorch's first step).
#[derive(Debug, Clone, new)]
pub struct Velocity<T> {
    /// The momentum buffer.
    pub velocity: T,
    /// Steps applied.
    pub step: T,
}

/// The fused optimizer kernels. See the [module docs](self).
pub trait OptimKernels: Backend {
    /// One AdamW step on one parameter, skipped bit for bit (state and count included) when
    /// `found_inf[0] != 0`. The gradient is multiplied by `inv_scale[0]` inside; the math is
    /// f32 and only the result is rounded to the parameter's dtype. AMSGrad when the state
    /// holds `max_exp_avg_sq`; cautious weight decay, or Adam's L2 penalty in place of the
    /// decoupled decay, as the config says.
    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        state: AdamWMoments<FloatTensor<Self>>,
        scaling: Scaling<FloatTensor<Self>>,
        lr: f32,
        config: &FusedAdamWConfig,
    ) -> (FloatTensor<Self>, AdamWMoments<FloatTensor<Self>>) {
        fallback::adamw_step::<Self>(param, grad, state, scaling, lr, config)
    }

    /// One AdamW step with 8-bit block-quantized moments (see [`crate::optim::quantized`]):
    /// dequantize, update in f32, requantize, skipped bit for bit (codes, maxima and count)
    /// when `found_inf[0] != 0`. The parameter is rounded as `config.weight_rounding` says.
    fn adamw8bit_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        state: MomentsOf<Self>,
        scaling: Scaling<FloatTensor<Self>>,
        lr: f32,
        config: &FusedAdamWConfig,
    ) -> (FloatTensor<Self>, MomentsOf<Self>) {
        quantized::fallback::adamw8bit_step::<Self>(param, grad, state, scaling, lr, config)
    }

    /// One SGD step, with a velocity when the config has momentum (`None` otherwise), skipped
    /// bit for bit on overflow.
    fn sgd_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        velocity: Option<Velocity<FloatTensor<Self>>>,
        scaling: Scaling<FloatTensor<Self>>,
        lr: f32,
        config: &FusedSgdConfig,
    ) -> (FloatTensor<Self>, Option<Velocity<FloatTensor<Self>>>) {
        fallback::sgd_step::<Self>(param, grad, velocity, scaling, lr, config)
    }
}

kernels_for_flex_and_amp!(OptimKernels {
    fn adamw8bit_step(param: FloatTensor<Self>, grad: FloatTensor<Self>, state: MomentsOf<Self>, scaling: Scaling<FloatTensor<Self>>, lr: f32, config: &FusedAdamWConfig) -> (FloatTensor<Self>, MomentsOf<Self>);
    fn adamw_step(param: FloatTensor<Self>, grad: FloatTensor<Self>, state: AdamWMoments<FloatTensor<Self>>, scaling: Scaling<FloatTensor<Self>>, lr: f32, config: &FusedAdamWConfig) -> (FloatTensor<Self>, AdamWMoments<FloatTensor<Self>>);
    fn sgd_step(param: FloatTensor<Self>, grad: FloatTensor<Self>, velocity: Option<Velocity<FloatTensor<Self>>>, scaling: Scaling<FloatTensor<Self>>, lr: f32, config: &FusedSgdConfig) -> (FloatTensor<Self>, Option<Velocity<FloatTensor<Self>>>);
});

/// The same constants for the kernel and the fallback: f64 math, rounded to f32 once.
struct AdamWConstants {
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    ln_beta1: f32,
    ln_beta2: f32,
    /// The value's factor, `1 - lr * wd` (decoupled decay; 1 with an L2 penalty).
    decay: f32,
    /// The L2 penalty added to the gradient, `wd * p` (`None` for decoupled decay or none).
    l2: Option<f32>,
}

impl AdamWConstants {
    fn new(lr: f32, c: &FusedAdamWConfig) -> Self {
        let decoupled = c.decoupled_weight_decay;
        Self {
            one_minus_beta1: (1.0 - c.beta_1 as f64) as f32,
            one_minus_beta2: (1.0 - c.beta_2 as f64) as f32,
            ln_beta1: (c.beta_1 as f64).ln() as f32,
            ln_beta2: (c.beta_2 as f64).ln() as f32,
            decay: match decoupled {
                true => (1.0 - (lr * c.weight_decay) as f64) as f32,
                false => 1.0,
            },
            l2: (!decoupled && c.weight_decay != 0.0).then_some(c.weight_decay),
        }
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> OptimKernels
    for CubeBackend<R, F, I, BT>
{
    fn adamw8bit_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        state: MomentsOf<Self>,
        scaling: Scaling<FloatTensor<Self>>,
        lr: f32,
        config: &FusedAdamWConfig,
    ) -> (FloatTensor<Self>, MomentsOf<Self>) {
        quantized::cube::adamw8bit_step::<R, F, I, BT>(param, grad, state, scaling, lr, config)
    }

    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        state: AdamWMoments<FloatTensor<Self>>,
        scaling: Scaling<FloatTensor<Self>>,
        lr: f32,
        c: &FusedAdamWConfig,
    ) -> (FloatTensor<Self>, AdamWMoments<FloatTensor<Self>>) {
        if param.meta.num_elements() == 0 {
            return fallback::adamw_step::<Self>(param, grad, state, scaling, lr, c);
        }
        let AdamWMoments {
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
            step,
        } = state;
        assert_same_shape(&param, &grad, "the gradient");
        for (t, what) in [(&exp_avg, "exp_avg"), (&exp_avg_sq, "exp_avg_sq")]
            .into_iter()
            .chain(max_exp_avg_sq.iter().map(|t| (t, "max_exp_avg_sq")))
        {
            assert_same_shape(&param, t, what);
            assert_f32(t, what);
        }
        let step = scalar_f32(step, "the step count");
        let inv_scale = scalar_f32(scaling.inv_scale, "inv_scale");
        let found = scalar_f32(scaling.found_inf, "found_inf");
        let k = AdamWConstants::new(lr, c);
        let rounding = StochasticRounding::new(
            c.weight_rounding,
            c.seed,
            param.dtype,
            param.meta.num_elements(),
        );
        let (seed, ulp_scale, min_binade) = kernel_args(rounding);

        let mut inputs = vec![&param, &grad, &exp_avg, &exp_avg_sq];
        inputs.extend(&max_exp_avg_sq);
        let launch = Elementwise::over(&inputs);
        let dtypes = [param.dtype.into(), grad.dtype.into()];
        // Argument positions of the aliased inputs: param 0, exp_avg 2, exp_avg_sq 3, and
        // max_exp_avg_sq 7 (after the three device scalars).
        let (p_out, p_view) = output_for(&param, 0);
        let (m_out, m_view) = output_for(&exp_avg, 2);
        let (v_out, v_view) = output_for(&exp_avg_sq, 3);
        let (max_out, max_view) = max_exp_avg_sq
            .as_ref()
            .map(|max| output_for(max, 7))
            .unzip();
        let step_out = empty_scalar_f32(&param);
        let mut all = inputs;
        all.extend([&p_out, &m_out, &v_out]);
        all.extend(&max_out);
        let addr = address_type(&all);
        // SAFETY: every access is `ABSOLUTE_POS` behind the output's bounds check, on views of
        // the parameter's shape (asserted), or `[0]` of the f32 `[1]` device scalars.
        unsafe {
            k::adamw_kernel::launch_unchecked(
                &launch.client,
                launch.count,
                launch.dim,
                addr,
                launch.vector_size,
                param.into_linear_view(),
                grad.into_linear_view(),
                exp_avg.into_linear_view(),
                exp_avg_sq.into_linear_view(),
                step.into_tensor_arg(),
                inv_scale.into_tensor_arg(),
                found.into_tensor_arg(),
                max_exp_avg_sq.map(|max| max.into_linear_view()).into(),
                p_view,
                m_view,
                v_view,
                step_out.clone().into_tensor_arg(),
                max_view.into(),
                lr,
                c.beta_1,
                c.beta_2,
                k.one_minus_beta1,
                k.one_minus_beta2,
                k.ln_beta1,
                k.ln_beta2,
                c.epsilon,
                k.decay,
                k.l2.unwrap_or(0.0),
                seed,
                ulp_scale,
                min_binade,
                rounding.is_some(),
                c.cautious_weight_decay,
                k.l2.is_some(),
                dtypes,
            )
        };
        let state = AdamWMoments::new(m_out, v_out, max_out, step_out);
        (p_out, state)
    }

    fn sgd_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        velocity: Option<Velocity<FloatTensor<Self>>>,
        scaling: Scaling<FloatTensor<Self>>,
        lr: f32,
        c: &FusedSgdConfig,
    ) -> (FloatTensor<Self>, Option<Velocity<FloatTensor<Self>>>) {
        if param.meta.num_elements() == 0 {
            return fallback::sgd_step::<Self>(param, grad, velocity, scaling, lr, c);
        }
        assert_same_shape(&param, &grad, "the gradient");
        let inv_scale = scalar_f32(scaling.inv_scale, "inv_scale");
        let found = scalar_f32(scaling.found_inf, "found_inf");
        let dtypes = [param.dtype.into(), grad.dtype.into()];
        let has_wd = c.weight_decay != 0.0;

        let Some(Velocity { velocity, step }) = velocity.filter(|_| c.momentum != 0.0) else {
            // As the fallback: no velocity without momentum (one passed in is dropped).
            let launch = Elementwise::over(&[&param, &grad]);
            let (p_out, p_view) = output_for(&param, 0);
            let addr = address_type(&[&param, &grad, &p_out]);
            // SAFETY: as in `adamw_step`.
            unsafe {
                k::sgd_kernel::launch_unchecked(
                    &launch.client,
                    launch.count,
                    launch.dim,
                    addr,
                    launch.vector_size,
                    param.into_linear_view(),
                    grad.into_linear_view(),
                    inv_scale.into_tensor_arg(),
                    found.into_tensor_arg(),
                    p_view,
                    lr,
                    c.weight_decay,
                    has_wd,
                    dtypes,
                )
            };
            return (p_out, None);
        };

        assert_same_shape(&param, &velocity, "the velocity");
        assert_f32(&velocity, "the velocity");
        let step = scalar_f32(step, "the step count");
        let launch = Elementwise::over(&[&param, &grad, &velocity]);
        // Argument positions of the aliased inputs: param 0, velocity 2.
        let (p_out, p_view) = output_for(&param, 0);
        let (b_out, b_view) = output_for(&velocity, 2);
        let step_out = empty_scalar_f32(&param);
        let addr = address_type(&[&param, &grad, &velocity, &p_out, &b_out]);
        // SAFETY: as in `adamw_step`.
        unsafe {
            k::sgd_momentum_kernel::launch_unchecked(
                &launch.client,
                launch.count,
                launch.dim,
                addr,
                launch.vector_size,
                param.into_linear_view(),
                grad.into_linear_view(),
                velocity.into_linear_view(),
                step.into_tensor_arg(),
                inv_scale.into_tensor_arg(),
                found.into_tensor_arg(),
                p_view,
                b_view,
                step_out.clone().into_tensor_arg(),
                lr,
                c.weight_decay,
                c.momentum,
                (1.0 - c.dampening as f64) as f32,
                has_wd,
                c.nesterov,
                dtypes,
            )
        };
        let velocity = Velocity::new(b_out, step_out);
        (p_out, Some(velocity))
    }
}

impl<B: FusionBackend + OptimKernels> OptimKernels for Fusion<B> {
    fn adamw8bit_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        state: MomentsOf<Self>,
        scaling: Scaling<FloatTensor<Self>>,
        lr: f32,
        config: &FusedAdamWConfig,
    ) -> (FloatTensor<Self>, MomentsOf<Self>) {
        quantized::fusion::adamw8bit_step::<B>(param, grad, state, scaling, lr, config)
    }

    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        state: AdamWMoments<FloatTensor<Self>>,
        scaling: Scaling<FloatTensor<Self>>,
        lr: f32,
        config: &FusedAdamWConfig,
    ) -> (FloatTensor<Self>, AdamWMoments<FloatTensor<Self>>) {
        if param.shape().num_elements() == 0 {
            return fallback::adamw_step::<Self>(param, grad, state, scaling, lr, config);
        }
        let mut outputs = vec![
            fusion::like::<B>(&param),
            fusion::like::<B>(&state.exp_avg),
            fusion::like::<B>(&state.exp_avg_sq),
            (state.step.shape(), DType::F32),
        ];
        outputs.extend(state.max_exp_avg_sq.as_ref().map(fusion::like::<B>));
        let mut inputs = vec![
            param,
            grad,
            state.exp_avg,
            state.exp_avg_sq,
            state.step,
            scaling.inv_scale,
            scaling.found_inf,
        ];
        inputs.extend(state.max_exp_avg_sq);
        let config = config.clone();
        let out = fusion::custom_op::<B, _>("burn_amp_adamw_step", inputs, &outputs, move |i| {
            let mut i = i.into_iter();
            let mut next = || i.next().unwrap();
            let (p, g, m, v, step) = (next(), next(), next(), next(), next());
            let scaling = Scaling::new(next(), next());
            let state = AdamWMoments::new(m, v, i.next(), step);
            let (p, s) = B::adamw_step(p, g, state, scaling, lr, &config);
            let mut out = vec![p, s.exp_avg, s.exp_avg_sq, s.step];
            out.extend(s.max_exp_avg_sq);
            out
        });
        let mut out = out.into_iter();
        let mut next = || out.next().unwrap();
        let (p, exp_avg, exp_avg_sq, step) = (next(), next(), next(), next());
        let state = AdamWMoments::new(exp_avg, exp_avg_sq, out.next(), step);
        (p, state)
    }

    fn sgd_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        velocity: Option<Velocity<FloatTensor<Self>>>,
        scaling: Scaling<FloatTensor<Self>>,
        lr: f32,
        config: &FusedSgdConfig,
    ) -> (FloatTensor<Self>, Option<Velocity<FloatTensor<Self>>>) {
        if param.shape().num_elements() == 0 {
            return fallback::sgd_step::<Self>(param, grad, velocity, scaling, lr, config);
        }
        // As the fallback: without momentum no velocity is used or returned.
        let velocity = velocity.filter(|_| config.momentum != 0.0);
        let mut outputs = vec![fusion::like::<B>(&param)];
        let mut inputs = vec![param, grad, scaling.inv_scale, scaling.found_inf];
        let has_velocity = velocity.is_some();
        if let Some(v) = velocity {
            outputs.push(fusion::like::<B>(&v.velocity));
            outputs.push((v.step.shape(), DType::F32));
            inputs.push(v.velocity);
            inputs.push(v.step);
        }
        let config = config.clone();
        let mut out = fusion::custom_op::<B, _>("burn_amp_sgd_step", inputs, &outputs, move |i| {
            let mut i = i.into_iter();
            let (p, g, inv_scale, found_inf) = (
                i.next().unwrap(),
                i.next().unwrap(),
                i.next().unwrap(),
                i.next().unwrap(),
            );
            let velocity = i
                .next()
                .map(|velocity| Velocity::new(velocity, i.next().unwrap()));
            let scaling = Scaling::new(inv_scale, found_inf);
            let (p, v) = B::sgd_step(p, g, velocity, scaling, lr, &config);
            let mut out = vec![p];
            if let Some(v) = v {
                out.push(v.velocity);
                out.push(v.step);
            }
            out
        })
        .into_iter();
        let p = out.next().unwrap();
        let velocity =
            has_velocity.then(|| Velocity::new(out.next().unwrap(), out.next().unwrap()));
        (p, velocity)
    }
}
