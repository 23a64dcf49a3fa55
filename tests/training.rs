//! Any model unchanged: the same burn-nn model and loop train under `Autodiff<Flex>` (f32),
//! `Amp<Autodiff<Flex>>` in bf16 and f16, and `Autodiff<Amp<Flex>>`.

mod common;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, ElementConversion};
use burn_amp::{Amp, Precision, autocast};
use common::tiny_lm::{ReversalTask, TinyLmConfig};

const STEPS: usize = 300;
const BATCH: usize = 32;
const LR: f64 = 3e-3;

struct Run {
    /// Mean loss of the last 20 steps.
    final_loss: f32,
    first_loss: f32,
    /// Dtypes of the gradients of an embedding table and of the linear head.
    grad_dtypes: Vec<DType>,
    /// Accuracy of `model.valid()` on fresh batches.
    valid_accuracy: f32,
    valid_logits_dtype: DType,
}

fn train<B: AutodiffBackend>(precision: Option<Precision>) -> Run {
    let _g = precision.map(autocast);
    let device = B::Device::default();
    B::seed(&device, 7);
    let config = TinyLmConfig::new();
    let mut model = config.init::<B>(&device);
    let mut optim = AdamConfig::new().init();
    let mut task = ReversalTask::new(config.vocab, config.seq_len, 11);
    let mut losses = Vec::new();
    let mut grad_dtypes = Vec::new();
    for step in 0..STEPS {
        let (x, y) = task.batch::<B>(BATCH, &device);
        let loss = model.loss(x, y);
        losses.push(loss.clone().into_scalar().elem::<f32>());
        let grads = loss.backward();
        if step == 0 {
            for param in [&model.tokens.weight, &model.head.weight] {
                grad_dtypes.push(param.grad(&grads).expect("a gradient").dtype());
            }
        }
        let grads = GradientsParams::from_grads(grads, &model);
        model = optim.step(LR, model, grads);
    }
    let valid = model.valid();
    let (x, y) = task.batch::<B::InnerBackend>(256, &device);
    let valid_logits_dtype = valid.forward(x.clone()).dtype();
    let valid_accuracy = valid.accuracy(x, y);
    let tail = &losses[STEPS - 20..];
    Run {
        final_loss: tail.iter().sum::<f32>() / tail.len() as f32,
        first_loss: losses[0],
        grad_dtypes,
        valid_accuracy,
        valid_logits_dtype,
    }
}

/// The AMP runs must land near the f32 run: within 0.15 in loss, or 25% of it.
fn assert_close_to_f32(name: &str, amp: &Run, f32_run: &Run) {
    let tolerance = 0.15f32.max(0.25 * f32_run.final_loss);
    assert!(
        (amp.final_loss - f32_run.final_loss).abs() <= tolerance,
        "{name}: final loss {} vs f32 {} (tolerance {tolerance})",
        amp.final_loss,
        f32_run.final_loss
    );
}

#[test]
fn the_same_model_trains_under_every_stack() {
    common::big_stack(|| {
        let f32_run = train::<Autodiff<Flex>>(None);
        let bf16 = train::<Amp<Autodiff<Flex>>>(Some(Precision::Bf16));
        let f16 = train::<Amp<Autodiff<Flex>>>(Some(Precision::F16));
        let compute_only = train::<Autodiff<Amp<Flex>>>(Some(Precision::Bf16));

        for (name, run) in [
            ("f32", &f32_run),
            ("bf16", &bf16),
            ("f16", &f16),
            ("Autodiff<Amp>", &compute_only),
        ] {
            eprintln!(
                "{name:>14}: loss {:.3} -> {:.3}, valid accuracy {:.2}, logits {:?}",
                run.first_loss, run.final_loss, run.valid_accuracy, run.valid_logits_dtype
            );
            // The task is learnt: chance is ln(16) = 2.77.
            assert!(
                run.final_loss < 0.5 * run.first_loss,
                "{name} did not learn"
            );
            assert!(
                run.valid_accuracy > 0.8,
                "{name}: valid accuracy {}",
                run.valid_accuracy
            );
            // f32 parameters receive f32 gradients, whatever the compute dtype.
            assert_eq!(run.grad_dtypes, vec![DType::F32, DType::F32], "{name}");
        }
        assert_close_to_f32("bf16", &bf16, &f32_run);
        assert_close_to_f32("f16", &f16, &f32_run);
        assert_close_to_f32("Autodiff<Amp>", &compute_only, &f32_run);

        // valid() keeps autocasting: the head's logits come out of a lowered linear.
        assert_eq!(f32_run.valid_logits_dtype, DType::F32);
        assert_eq!(bf16.valid_logits_dtype, DType::BF16);
        assert_eq!(f16.valid_logits_dtype, DType::F16);
    });
}
