//! [`OptimKernels::adamw8bit_step`](super::OptimKernels::adamw8bit_step): the burn-op
//! fallback, the CubeCL launch and the fusion custom op.

use burn_backend::tensor::{FloatTensor, IntTensor};

use crate::optim::quantized::QuantMap;

/// [`QuantizedMoments`] of backend `B`'s primitives.
pub type MomentsOf<B> = QuantizedMoments<FloatTensor<B>, IntTensor<B>>;

/// One parameter's 8-bit AdamW state as the kernels take it: the first moment and the square
/// root of the second, block-quantized (codes: i32 words; maxima: f32 `[blocks]`), and the
/// f32 `[1]` count of the steps applied.
#[derive(Debug, Clone)]
pub struct QuantizedMoments<F, I> {
    /// Codes of `exp_avg / absmax` in the signed map.
    pub exp_avg_codes: I,
    /// Block maxima of `|exp_avg|`.
    pub exp_avg_absmax: F,
    /// Codes of `sqrt(exp_avg_sq) / absmax` in the unsigned map.
    pub exp_avg_sq_codes: I,
    /// Block maxima of `sqrt(exp_avg_sq)`.
    pub exp_avg_sq_absmax: F,
    /// Steps applied.
    pub step: F,
    /// Values per block (256, 512, 1024 or 2048).
    pub block: usize,
    /// The map of both moments' codes.
    pub map: QuantMap,
}

/// The 8-bit step composed from burn ops: the reference of the kernel, and what backends
/// without CubeCL run.
pub mod fallback {
    use burn_backend::tensor::FloatTensor;
    use burn_backend::{Backend, TensorMetadata};

    use super::{MomentsOf, QuantizedMoments};
    use crate::optim::FusedAdamWConfig;
    use crate::optim::kernels::fallback::skip_mask;
    use crate::optim::kernels::{AdamWMoments, Scaling};
    use crate::optim::quantized::fallback::{dequantize, quantize};

    /// See [`OptimKernels::adamw8bit_step`](crate::optim::OptimKernels::adamw8bit_step): the
    /// f32 AdamW fallback between a dequantization and a quantization.
    pub fn adamw8bit_step<B: Backend>(
        param: FloatTensor<B>,
        grad: FloatTensor<B>,
        state: MomentsOf<B>,
        scaling: Scaling<FloatTensor<B>>,
        lr: f32,
        c: &FusedAdamWConfig,
    ) -> (FloatTensor<B>, MomentsOf<B>) {
        let shape = param.shape();
        let n = shape.num_elements();
        let (signed, unsigned) = (state.map.table(true), state.map.table(false));
        let m = dequantize::<B>(
            state.exp_avg_codes.clone(),
            state.exp_avg_absmax.clone(),
            state.block,
            signed,
            n,
        );
        let sq = dequantize::<B>(
            state.exp_avg_sq_codes.clone(),
            state.exp_avg_sq_absmax.clone(),
            state.block,
            unsigned,
            n,
        );
        let moments = AdamWMoments {
            exp_avg: B::float_reshape(m, shape.clone()),
            exp_avg_sq: B::float_reshape(B::float_mul(sq.clone(), sq), shape),
            max_exp_avg_sq: None,
            step: state.step.clone(),
        };
        let found_inf = scaling.found_inf.clone();
        let (param, next) =
            crate::optim::kernels::fallback::adamw_step::<B>(param, grad, moments, scaling, lr, c);
        let (m_codes, m_absmax) = quantize::<B>(next.exp_avg, state.block, signed);
        let (v_codes, v_absmax) =
            quantize::<B>(B::float_sqrt(next.exp_avg_sq), state.block, unsigned);
        // A skipped step keeps the old codes and maxima (requantizing the dequantized values
        // need not give them back bit for bit).
        let keep_int = |new, old: burn_backend::tensor::IntTensor<B>| {
            let mask = skip_mask::<B>(&found_inf, &old.shape());
            B::int_mask_where(new, mask, old)
        };
        let keep_float = |new, old: FloatTensor<B>| {
            let mask = skip_mask::<B>(&found_inf, &old.shape());
            B::float_mask_where(new, mask, old)
        };
        let state = QuantizedMoments {
            exp_avg_codes: keep_int(m_codes, state.exp_avg_codes),
            exp_avg_absmax: keep_float(m_absmax, state.exp_avg_absmax),
            exp_avg_sq_codes: keep_int(v_codes, state.exp_avg_sq_codes),
            exp_avg_sq_absmax: keep_float(v_absmax, state.exp_avg_sq_absmax),
            step: next.step,
            ..state
        };
        (param, state)
    }
}

pub(super) mod cube {
    use burn_backend::DType;
    use burn_backend::tensor::FloatTensor;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use cubecl::calculate_cube_count_elemwise;
    use cubecl::prelude::*;

    use super::{MomentsOf, QuantizedMoments};
    use crate::kernels::cube::{assert_f32, empty_scalar_f32, scalar_f32, tensor_output_for};
    use crate::kernels::cubecl_kernels::quantized as k;
    use crate::optim::FusedAdamWConfig;
    use crate::optim::kernels::{AdamWConstants, Scaling};
    use crate::optim::quantized::fallback::table;
    use crate::optim::rounding::{StochasticRounding, kernel_args};

    type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    /// The step's outputs: the parameter and its state.
    type Outputs<C> = (FloatTensor<C>, MomentsOf<C>);

    pub(crate) fn adamw8bit_step<
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    >(
        param: FloatTensor<Cube<R, F, I, BT>>,
        grad: FloatTensor<Cube<R, F, I, BT>>,
        state: MomentsOf<Cube<R, F, I, BT>>,
        scaling: Scaling<FloatTensor<Cube<R, F, I, BT>>>,
        lr: f32,
        c: &FusedAdamWConfig,
    ) -> Outputs<Cube<R, F, I, BT>> {
        let n = param.meta.num_elements();
        assert_eq!(
            param.meta.shape(),
            grad.meta.shape(),
            "the gradient must have the parameter's shape"
        );
        let words_per_block = state.block / k::CODES_PER_WORD;
        let blocks = state.exp_avg_absmax.meta.num_elements();
        assert_eq!(
            blocks,
            n.div_ceil(state.block),
            "one absmax per block of the parameter"
        );
        for (codes, what) in [
            (&state.exp_avg_codes, "exp_avg"),
            (&state.exp_avg_sq_codes, "exp_avg_sq"),
        ] {
            assert_eq!(
                codes.meta.num_elements(),
                blocks * words_per_block,
                "{what}: block * blocks / 4 code words"
            );
            assert_eq!(codes.dtype, DType::I32, "{what}: codes are i32 words");
        }
        assert_f32(&state.exp_avg_absmax, "exp_avg absmax");
        assert_f32(&state.exp_avg_sq_absmax, "exp_avg_sq absmax");
        let param = into_contiguous(param);
        let grad = into_contiguous(grad);
        let m_codes = into_contiguous(state.exp_avg_codes);
        let v_codes = into_contiguous(state.exp_avg_sq_codes);
        let m_absmax = into_contiguous(state.exp_avg_absmax);
        let v_absmax = into_contiguous(state.exp_avg_sq_absmax);
        let step = scalar_f32(state.step, "the step count");
        let inv_scale = scalar_f32(scaling.inv_scale, "inv_scale");
        let found = scalar_f32(scaling.found_inf, "found_inf");
        let kc = AdamWConstants::new(lr, c);
        let rounding = StochasticRounding::new(c.weight_rounding, c.seed, param.dtype, n);
        let (seed, ulp_scale, min_binade) = kernel_args(rounding);
        let (signed, unsigned) = (state.map.table(true), state.map.table(false));

        let client = param.client.clone();
        let dim = CubeDim::new_1d(words_per_block as u32);
        let count = calculate_cube_count_elemwise(&client, blocks * words_per_block, dim);
        let dtypes = [param.dtype.into(), grad.dtype.into()];
        // Argument positions of the aliased inputs: param 0, codes 2 and 4, maxima 3 and 5.
        let (p_out, p_arg) = tensor_output_for(&param, 0);
        let (mc_out, mc_arg) = tensor_output_for(&m_codes, 2);
        let (ma_out, ma_arg) = tensor_output_for(&m_absmax, 3);
        let (vc_out, vc_arg) = tensor_output_for(&v_codes, 4);
        let (va_out, va_arg) = tensor_output_for(&v_absmax, 5);
        let step_out = empty_scalar_f32(&param);
        let table = |values| table::<Cube<R, F, I, BT>>(values, &param.device);
        let tables = [
            table(&signed.values),
            table(&signed.bounds),
            table(&unsigned.values),
            table(&unsigned.bounds),
        ];
        let [sv, sb, uv, ub] = tables;
        // SAFETY: every index is below the bound checked before it (`numel` for the
        // parameter, the block count for the maxima, the asserted word count for the codes),
        // a code (< 256) into a 256-entry table, or `[0]` of an f32 `[1]` device scalar.
        unsafe {
            k::adamw8bit_kernel::launch_unchecked(
                &client,
                count,
                dim,
                param.into_tensor_arg(),
                grad.into_tensor_arg(),
                m_codes.into_tensor_arg(),
                m_absmax.into_tensor_arg(),
                v_codes.into_tensor_arg(),
                v_absmax.into_tensor_arg(),
                sv.into_tensor_arg(),
                sb.into_tensor_arg(),
                uv.into_tensor_arg(),
                ub.into_tensor_arg(),
                step.into_tensor_arg(),
                inv_scale.into_tensor_arg(),
                found.into_tensor_arg(),
                p_arg,
                mc_arg,
                ma_arg,
                vc_arg,
                va_arg,
                step_out.clone().into_tensor_arg(),
                n,
                lr,
                c.beta_1,
                c.beta_2,
                kc.one_minus_beta1,
                kc.one_minus_beta2,
                kc.ln_beta1,
                kc.ln_beta2,
                c.epsilon,
                kc.decay,
                kc.l2.unwrap_or(0.0),
                seed,
                ulp_scale,
                min_binade,
                words_per_block,
                rounding.is_some(),
                c.cautious_weight_decay,
                kc.l2.is_some(),
                dtypes,
            )
        };
        let state = QuantizedMoments {
            exp_avg_codes: mc_out,
            exp_avg_absmax: ma_out,
            exp_avg_sq_codes: vc_out,
            exp_avg_sq_absmax: va_out,
            step: step_out,
            block: state.block,
            map: state.map,
        };
        (p_out, state)
    }
}

pub(super) mod fusion {
    use burn_backend::tensor::{FloatTensor, IntTensor};
    use burn_backend::{DType, TensorMetadata};
    use burn_fusion::{Fusion, FusionBackend};
    use burn_ir::TensorHandle;

    use super::{MomentsOf, QuantizedMoments};
    use crate::kernels::fusion;
    use crate::optim::FusedAdamWConfig;
    use crate::optim::kernels::{OptimKernels, Scaling};

    /// `B`'s int tensor handed through the float-typed custom op (one handle type).
    fn as_int<B: FusionBackend>(t: FloatTensor<B>) -> IntTensor<B> {
        let shape = t.shape();
        B::int_tensor(TensorHandle {
            handle: B::float_tensor_handle(t),
            shape,
        })
    }

    fn as_float<B: FusionBackend>(t: IntTensor<B>) -> FloatTensor<B> {
        let shape = t.shape();
        B::float_tensor(TensorHandle {
            handle: B::int_tensor_handle(t),
            shape,
        })
    }

    pub(crate) fn adamw8bit_step<B: FusionBackend + OptimKernels>(
        param: FloatTensor<Fusion<B>>,
        grad: FloatTensor<Fusion<B>>,
        state: MomentsOf<Fusion<B>>,
        scaling: Scaling<FloatTensor<Fusion<B>>>,
        lr: f32,
        config: &FusedAdamWConfig,
    ) -> (FloatTensor<Fusion<B>>, MomentsOf<Fusion<B>>) {
        let (block, map) = (state.block, state.map);
        let outputs = [
            fusion::like::<B>(&param),
            fusion::like::<B>(&state.exp_avg_codes),
            fusion::like::<B>(&state.exp_avg_absmax),
            fusion::like::<B>(&state.exp_avg_sq_codes),
            fusion::like::<B>(&state.exp_avg_sq_absmax),
            (state.step.shape(), DType::F32),
        ];
        let inputs = vec![
            param,
            grad,
            state.exp_avg_codes,
            state.exp_avg_absmax,
            state.exp_avg_sq_codes,
            state.exp_avg_sq_absmax,
            state.step,
            scaling.inv_scale,
            scaling.found_inf,
        ];
        let config = config.clone();
        let out =
            fusion::custom_op::<B, _>("burn_amp_adamw8bit_step", inputs, &outputs, move |i| {
                let [p, g, mc, ma, vc, va, step, inv_scale, found_inf]: [_; 9] =
                    i.try_into().ok().unwrap();
                let state = QuantizedMoments {
                    exp_avg_codes: as_int::<B>(mc),
                    exp_avg_absmax: ma,
                    exp_avg_sq_codes: as_int::<B>(vc),
                    exp_avg_sq_absmax: va,
                    step,
                    block,
                    map,
                };
                let scaling = Scaling::new(inv_scale, found_inf);
                let (p, s) = B::adamw8bit_step(p, g, state, scaling, lr, &config);
                vec![
                    p,
                    as_float::<B>(s.exp_avg_codes),
                    s.exp_avg_absmax,
                    as_float::<B>(s.exp_avg_sq_codes),
                    s.exp_avg_sq_absmax,
                    s.step,
                ]
            });
        let [p, mc, ma, vc, va, step]: [_; 6] = out.try_into().ok().unwrap();
        let state = QuantizedMoments {
            exp_avg_codes: mc,
            exp_avg_absmax: ma,
            exp_avg_sq_codes: vc,
            exp_avg_sq_absmax: va,
            step,
            block,
            map,
        };
        (p, state)
    }
}
