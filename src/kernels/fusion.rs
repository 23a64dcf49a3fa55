//! [`AmpKernels`] for [`Fusion<B>`], the default `Wgpu` and `Cuda` backends: every method is
//! registered as a fusion custom op (`OperationIr::Custom`), the way burn-vision registers
//! its kernels. The op stays lazy in the fusion stream (no host sync, no drain); when the
//! stream runs it, it fetches `B`'s tensors and calls `B`'s own implementation (the CubeCL
//! kernels for `CubeBackend`). Inputs consumed for the last time reach `B` as mutable, so the
//! kernels can work in place there too.

use core::marker::PhantomData;

use burn_backend::TensorMetadata;
use burn_backend::tensor::FloatTensor;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use super::{AdamWHyper, AmpKernels, ScaleRule, SgdHyper, fallback};

type Handles<B> =
    HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// A fresh output tensor description with the shape and dtype of `like`.
fn out_like<B: FusionBackend>(like: &FloatTensor<Fusion<B>>) -> TensorIr {
    TensorIr::uninit(
        like.client.create_empty_handle(),
        like.shape(),
        like.dtype(),
    )
}

#[derive(Debug)]
struct UnscaleOp<B> {
    desc: CustomOpIr,
    _b: PhantomData<B>,
}

impl<B: FusionBackend + AmpKernels> Operation<B::FusionRuntime> for UnscaleOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        // Inputs: the grads, inv_scale, found_inf; outputs: the grads, found_inf. Fetched in
        // the order the descriptions were made, so a tensor given twice is read before its
        // last (mutable) use removes it.
        let n = self.desc.outputs.len() - 1;
        let inputs: Vec<_> = self
            .desc
            .inputs
            .iter()
            .map(|t| handles.get_float_tensor::<B>(t))
            .collect();
        let mut inputs = inputs.into_iter();
        let grads: Vec<_> = inputs.by_ref().take(n).collect();
        let inv_scale = inputs.next().unwrap();
        let found_inf = inputs.next().unwrap();
        let (grads, found) = B::unscale_and_check(grads, inv_scale, found_inf);
        for (out, t) in self.desc.outputs.iter().zip(grads) {
            handles.register_float_tensor::<B>(&out.id, t);
        }
        handles.register_float_tensor::<B>(&self.desc.outputs[n].id, found);
    }
}

#[derive(Debug)]
struct UpdateScaleOp<B> {
    desc: CustomOpIr,
    rule: ScaleRule,
    _b: PhantomData<B>,
}

impl<B: FusionBackend + AmpKernels> Operation<B::FusionRuntime> for UpdateScaleOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let ([state, found], [out]) = self.desc.as_fixed();
        let state = handles.get_float_tensor::<B>(state);
        let found = handles.get_float_tensor::<B>(found);
        let new = B::update_scale(state, found, self.rule);
        handles.register_float_tensor::<B>(&out.id, new);
    }
}

#[derive(Debug)]
struct AdamWOp<B> {
    desc: CustomOpIr,
    hyper: AdamWHyper,
    _b: PhantomData<B>,
}

impl<B: FusionBackend + AmpKernels> Operation<B::FusionRuntime> for AdamWOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let (inputs, [p_out, m_out, v_out]) = self.desc.as_fixed::<7, 3>();
        let [p, g, m, v, step, inv, found] =
            inputs.each_ref().map(|t| handles.get_float_tensor::<B>(t));
        let (p, m, v) = B::adamw_step(p, g, m, v, step, inv, found, self.hyper);
        handles.register_float_tensor::<B>(&p_out.id, p);
        handles.register_float_tensor::<B>(&m_out.id, m);
        handles.register_float_tensor::<B>(&v_out.id, v);
    }
}

#[derive(Debug)]
struct SgdOp<B> {
    desc: CustomOpIr,
    hyper: SgdHyper,
    /// Whether a momentum buffer is among the inputs (third).
    has_buf: bool,
    _b: PhantomData<B>,
}

impl<B: FusionBackend + AmpKernels> Operation<B::FusionRuntime> for SgdOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let mut inputs = self
            .desc
            .inputs
            .iter()
            .map(|t| handles.get_float_tensor::<B>(t))
            .collect::<Vec<_>>()
            .into_iter();
        let param = inputs.next().unwrap();
        let grad = inputs.next().unwrap();
        let buf = if self.has_buf { inputs.next() } else { None };
        let inv_scale = inputs.next().unwrap();
        let found = inputs.next().unwrap();
        let (p, b) = B::sgd_step(param, grad, buf, inv_scale, found, self.hyper);
        handles.register_float_tensor::<B>(&self.desc.outputs[0].id, p);
        if let (Some(out), Some(b)) = (self.desc.outputs.get(1), b) {
            handles.register_float_tensor::<B>(&out.id, b);
        }
    }
}

#[derive(Debug)]
struct AccumulateOp<B> {
    desc: CustomOpIr,
    weight: f32,
    _b: PhantomData<B>,
}

impl<B: FusionBackend + AmpKernels> Operation<B::FusionRuntime> for AccumulateOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        // Inputs: the accumulator (when there is one), then the gradient.
        let mut inputs: Vec<_> = self
            .desc
            .inputs
            .iter()
            .map(|t| handles.get_float_tensor::<B>(t))
            .collect();
        let grad = inputs.pop().unwrap();
        let acc = inputs.pop();
        let out = B::accumulate(acc, grad, self.weight);
        handles.register_float_tensor::<B>(&self.desc.outputs[0].id, out);
    }
}

impl<B: FusionBackend + AmpKernels> AmpKernels for Fusion<B> {
    fn unscale_and_check(
        grads: Vec<FloatTensor<Self>>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
    ) -> (Vec<FloatTensor<Self>>, FloatTensor<Self>) {
        // Empty gradients are returned as they are and stay out of the op.
        let (work, empty): (Vec<_>, Vec<_>) = grads
            .into_iter()
            .enumerate()
            .partition(|(_, g)| g.shape().num_elements() != 0);
        if work.is_empty() {
            return (empty.into_iter().map(|(_, g)| g).collect(), found_inf);
        }
        let client = inv_scale.client.clone();
        let streams = OperationStreams::with_inputs(
            work.iter().map(|(_, g)| g).chain([&inv_scale, &found_inf]),
        );
        let mut outputs: Vec<TensorIr> = work.iter().map(|(_, g)| out_like::<B>(g)).collect();
        outputs.push(out_like::<B>(&found_inf));
        let positions: Vec<usize> = work.iter().map(|(i, _)| *i).collect();
        let mut inputs: Vec<TensorIr> = work.into_iter().map(|(_, g)| g.into_ir()).collect();
        inputs.push(inv_scale.into_ir());
        inputs.push(found_inf.into_ir());

        let desc = CustomOpIr::new("burn_amp_unscale_and_check", &inputs, &outputs);
        let op = UnscaleOp::<B> {
            desc: desc.clone(),
            _b: PhantomData,
        };
        let mut outs = client.register(streams, OperationIr::Custom(desc), op);
        let found = outs.pop().unwrap();

        // Back in the caller's order.
        let mut result: Vec<Option<FloatTensor<Self>>> =
            (0..positions.len() + empty.len()).map(|_| None).collect();
        for (pos, t) in positions.into_iter().zip(outs) {
            result[pos] = Some(t);
        }
        for (pos, t) in empty {
            result[pos] = Some(t);
        }
        (result.into_iter().map(Option::unwrap).collect(), found)
    }

    fn update_scale(
        state: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        rule: ScaleRule,
    ) -> FloatTensor<Self> {
        let client = state.client.clone();
        let streams = OperationStreams::with_inputs([&state, &found_inf]);
        let out = TensorIr::uninit(
            client.create_empty_handle(),
            state.shape(),
            burn_backend::DType::F32,
        );
        let desc = CustomOpIr::new(
            "burn_amp_update_scale",
            &[state.into_ir(), found_inf.into_ir()],
            &[out],
        );
        let op = UpdateScaleOp::<B> {
            desc: desc.clone(),
            rule,
            _b: PhantomData,
        };
        client
            .register(streams, OperationIr::Custom(desc), op)
            .pop()
            .unwrap()
    }

    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        exp_avg: FloatTensor<Self>,
        exp_avg_sq: FloatTensor<Self>,
        step: FloatTensor<Self>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        hyper: AdamWHyper,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if param.shape().num_elements() == 0 {
            return (param, exp_avg, exp_avg_sq);
        }
        let client = param.client.clone();
        let streams = OperationStreams::with_inputs([
            &param,
            &grad,
            &exp_avg,
            &exp_avg_sq,
            &step,
            &inv_scale,
            &found_inf,
        ]);
        let outputs = [
            out_like::<B>(&param),
            out_like::<B>(&exp_avg),
            out_like::<B>(&exp_avg_sq),
        ];
        let inputs = [
            param.into_ir(),
            grad.into_ir(),
            exp_avg.into_ir(),
            exp_avg_sq.into_ir(),
            step.into_ir(),
            inv_scale.into_ir(),
            found_inf.into_ir(),
        ];
        let desc = CustomOpIr::new("burn_amp_adamw_step", &inputs, &outputs);
        let op = AdamWOp::<B> {
            desc: desc.clone(),
            hyper,
            _b: PhantomData,
        };
        let [p, m, v]: [FloatTensor<Self>; 3] = client
            .register(streams, OperationIr::Custom(desc), op)
            .try_into()
            .unwrap();
        (p, m, v)
    }

    fn sgd_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        momentum: Option<FloatTensor<Self>>,
        inv_scale: FloatTensor<Self>,
        found_inf: FloatTensor<Self>,
        hyper: SgdHyper,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        if param.shape().num_elements() == 0 {
            return (param, momentum);
        }
        // As the fallback: without momentum no buffer is used or returned.
        let buf = if hyper.momentum != 0.0 {
            momentum
        } else {
            None
        };
        let has_buf = buf.is_some();
        let client = param.client.clone();
        let mut streams = OperationStreams::with_inputs([&param, &grad]);
        if let Some(buf) = &buf {
            streams.tensor(buf);
        }
        streams.tensor(&inv_scale);
        streams.tensor(&found_inf);

        let mut outputs = vec![out_like::<B>(&param)];
        if hyper.momentum != 0.0 {
            outputs.push(TensorIr::uninit(
                client.create_empty_handle(),
                param.shape(),
                burn_backend::DType::F32,
            ));
        }
        let mut inputs = vec![param.into_ir(), grad.into_ir()];
        if let Some(buf) = buf {
            inputs.push(buf.into_ir());
        }
        inputs.push(inv_scale.into_ir());
        inputs.push(found_inf.into_ir());

        let desc = CustomOpIr::new("burn_amp_sgd_step", &inputs, &outputs);
        let op = SgdOp::<B> {
            desc: desc.clone(),
            hyper,
            has_buf,
            _b: PhantomData,
        };
        let mut outs = client
            .register(streams, OperationIr::Custom(desc), op)
            .into_iter();
        let p = outs.next().unwrap();
        (p, outs.next())
    }

    fn accumulate(
        acc: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        weight: f32,
    ) -> FloatTensor<Self> {
        use burn_backend::DType;
        if let Some(acc) = &acc {
            assert_eq!(
                acc.shape(),
                grad.shape(),
                "the accumulator must have the gradient's shape"
            );
        }
        let empty = grad.shape().num_elements() == 0;
        // f64 gradients (or an accumulator that is not f32) take the burn ops, which fusion
        // can still fuse; so do empty tensors without an accumulator.
        if grad.dtype() == DType::F64
            || acc.as_ref().is_some_and(|a| a.dtype() != DType::F32)
            || (empty && acc.is_none())
        {
            return fallback::accumulate::<Self>(acc, grad, weight);
        }
        let acc = match acc {
            Some(acc) if empty => return acc,
            // As the fallback: an f32 gradient with weight 1 is the sum itself, uncopied.
            None if grad.dtype() == DType::F32 && weight == 1.0 => return grad,
            acc => acc,
        };
        let client = grad.client.clone();
        let streams = match &acc {
            Some(acc) => OperationStreams::with_inputs([acc, &grad]),
            None => OperationStreams::with_inputs([&grad]),
        };
        let out = TensorIr::uninit(client.create_empty_handle(), grad.shape(), DType::F32);
        let mut inputs = Vec::with_capacity(2);
        if let Some(acc) = acc {
            inputs.push(acc.into_ir());
        }
        inputs.push(grad.into_ir());
        let desc = CustomOpIr::new("burn_amp_accumulate", &inputs, &[out]);
        let op = AccumulateOp::<B> {
            desc: desc.clone(),
            weight,
            _b: PhantomData,
        };
        client
            .register(streams, OperationIr::Custom(desc), op)
            .pop()
            .unwrap()
    }
}
