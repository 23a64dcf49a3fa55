//! The precision report on choices: a mixture-of-experts router's argmax, top-2, sort and a
//! threshold's mask, in half precision against f32, share by share as the test computes them
//! itself.

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::activation::softmax;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, ElementConversion};
use burn_amp::doctor::{OpPrecision, Suggestion};
use burn_amp::{Amp, Precision, PrecisionReport, autocast};

use crate::common::wgpu_device;
use crate::serial;

const TOKENS: usize = 512;
const EXPERTS: usize = 16;
const WIDTH: usize = 64;

/// A router whose experts' weights share a large common part (as at initialisation from one
/// checkpoint): logits ~8 apart by ~0.1, where bf16's spacing is 0.03 and f16's 0.004, so half
/// precision picks other experts for some tokens.
fn router<B: AutodiffBackend>(device: &B::Device) -> (Linear<B>, Tensor<B, 2>) {
    B::seed(device, 11);
    let common = Tensor::<B, 2>::random([WIDTH, 1], Distribution::Normal(0.0, 1.0), device);
    let own = Tensor::<B, 2>::random([WIDTH, EXPERTS], Distribution::Normal(0.0, 0.02), device);
    let mut linear = LinearConfig::new(WIDTH, EXPERTS)
        .with_bias(false)
        .init::<B>(device);
    linear.weight = Param::from_tensor(common.repeat_dim(1, EXPERTS) + own);
    let x = Tensor::<B, 2>::random([TOKENS, WIDTH], Distribution::Normal(1.0, 0.5), device);
    (linear, x)
}

/// What the router chose: each token's expert (argmax), its top-2 (`argtopk`), its experts in
/// order (a sort, as `topk_with_indices` does), the logits above a threshold and those above
/// their f32 values (masks).
struct Choices<B: Backend> {
    top1: Tensor<B, 2, Int>,
    top2: Tensor<B, 2, Int>,
    sorted: Tensor<B, 2, Int>,
    above: Tensor<B, 2, Bool>,
    rose: Tensor<B, 2, Bool>,
}

/// What the masks compare with: the f32 logits' mean (a threshold where many of them lie),
/// and the f32 logits themselves (none rises above them in f32; about half of them do once
/// rounded to a half dtype).
struct Against<B: Backend> {
    threshold: f64,
    logits: Tensor<B, 2>,
}

fn against<B: AutodiffBackend>(m: &Linear<B>, x: &Tensor<B, 2>) -> Against<B> {
    let _f32 = autocast(Precision::F32);
    let logits = m.forward(x.clone()).detach();
    Against {
        threshold: logits.clone().mean().into_scalar().elem::<f64>(),
        logits,
    }
}

/// The router's logits (in f32 when `router_in_f32`) and the choices made on them, with a
/// loss that depends on both.
fn route<B: AutodiffBackend>(
    m: &Linear<B>,
    x: &Tensor<B, 2>,
    router_in_f32: bool,
    against: &Against<B>,
) -> (Tensor<B, 1>, Choices<B>) {
    let logits = if router_in_f32 {
        let _f32 = autocast(Precision::F32);
        m.forward(x.clone())
    } else {
        m.forward(x.clone())
    };
    let top1 = logits.clone().argmax(1);
    let top2 = logits.clone().argtopk(2, 1);
    let (_, sorted) = logits.clone().sort_descending_with_indices(1);
    let above = logits.clone().greater_elem(against.threshold);
    let rose = logits.clone().greater(against.logits.clone());
    let gates = softmax(logits, 1);
    let loss = gates.clone().gather(1, top1.clone()).sum() + gates.gather(1, top2.clone()).sum();
    (
        loss,
        Choices {
            top1,
            top2,
            sorted,
            above,
            rose,
        },
    )
}

fn host<B: Backend, K: burn::tensor::BasicOps<B>>(t: Tensor<B, 2, K>) -> Vec<i64> {
    t.into_data().iter::<i64>().collect()
}

/// The shares the report must give, computed here from the two runs' choices: argmax's each
/// index, top-2 as sets per token, the sort's first place, the masks' each value.
fn expected<B: AutodiffBackend>(
    m: &Linear<B>,
    x: &Tensor<B, 2>,
    precision: Precision,
    router_in_f32: bool,
    against: &Against<B>,
) -> [f64; 5] {
    let choices = |p: Precision| {
        let _at = autocast(p);
        let (_, c) = route(m, x, router_in_f32, against);
        let masks = (host(c.above), host(c.rose));
        (host(c.top1), host(c.top2), host(c.sorted), masks)
    };
    let (a1, a2, a3, (a4, a5)) = choices(Precision::F32);
    let (b1, b2, b3, (b4, b5)) = choices(precision);
    let share = |n: usize, of: usize| n as f64 / of as f64;
    let differ =
        |a: &[i64], b: &[i64]| share(a.iter().zip(b).filter(|(a, b)| a != b).count(), a.len());
    let top1 = differ(&a1, &b1);
    let top2 = share(
        (0..TOKENS)
            .map(|t| {
                let (a, b) = (&a2[2 * t..2 * t + 2], &b2[2 * t..2 * t + 2]);
                b.iter().filter(|e| !a.contains(e)).count()
            })
            .sum(),
        2 * TOKENS,
    );
    let first = share(
        (0..TOKENS)
            .filter(|t| a3[t * EXPERTS] != b3[t * EXPERTS])
            .count(),
        TOKENS,
    );
    [top1, top2, first, differ(&a4, &b4), differ(&a5, &b5)]
}

fn row<'a>(report: &'a PrecisionReport, op: &str, int: bool) -> &'a OpPrecision {
    report
        .ops
        .iter()
        .find(|o| o.op == op && o.differing.is_some() == int)
        .unwrap_or_else(|| panic!("no {op} row (indices: {int}):\n{}", report.table(40)))
}

fn router_choices<B: AutodiffBackend>(device: &B::Device, precision: Precision) {
    let _turn = serial();
    let (model, x) = router::<B>(device);
    let against = against(&model, &x);
    for router_in_f32 in [false, true] {
        let want = expected(&model, &x, precision, router_in_f32, &against);
        let report = PrecisionReport::measure(&model, precision, 1.0, |m: &Linear<B>| {
            route(m, &x, router_in_f32, &against).0
        })
        .unwrap();
        let table = report.table(40);
        assert_eq!(report.diverged_at, None, "{table}");
        let rows = [
            row(&report, "float_argmax", true),
            row(&report, "float_argtopk", true),
            row(&report, "float_sort_with_indices", true),
            row(&report, "float_greater_elem", true),
            row(&report, "float_greater", true),
        ];
        for (o, want) in rows.iter().zip(want) {
            assert_eq!(o.differing, Some(want), "{o:?}\n{table}");
            assert_eq!(o.shape[0], TOKENS, "{o:?}");
            let kind = if o.op.starts_with("float_greater") {
                "Bool"
            } else {
                "I"
            };
            assert!(o.dtype.starts_with(kind), "{o:?}");
            assert_eq!((o.own_error, o.error), (None, None), "{o:?}");
        }
        // The sort's values are a float row of their own, measured as floats.
        let values = row(&report, "float_sort_with_indices", false);
        assert!(values.error.is_some(), "{values:?}");
        if router_in_f32 {
            // The same logits in both runs: the same choices, nothing to suggest.
            for o in rows {
                assert_eq!(
                    (o.differing, o.suggestion),
                    (Some(0.0), Suggestion::Fine),
                    "{o:?}"
                );
            }
        } else {
            // Half logits choose otherwise for some tokens: the top-1 row is among the worst
            // and says to compute the logits in f32.
            assert!(
                want[0] > 0.01,
                "the planted near ties flip no choice: {want:?}"
            );
            // Logits near the threshold cross it in bf16 (spacing 0.06 at 8); f16's
            // rounding may leave all 8192 on their side. Rounded, about half rise above
            // their f32 values.
            if precision == Precision::Bf16 {
                assert!(want[3] > 0.0, "{want:?}");
            }
            assert!((0.2..0.8).contains(&want[4]), "{want:?}");
            let top1 = rows[0];
            assert_eq!(top1.suggestion, Suggestion::ComputeItsInputInF32, "{table}");
            // What it compared: the router's logits, `linear`'s output (call 0).
            let linear = row(&report, "linear", false);
            for o in rows {
                assert_eq!(o.compared, Some(linear.call), "{o:?}\n{table}");
            }
            assert!(table.contains("(call 0, `linear`)"), "{table}");
            assert!(
                report.worst(5).iter().any(|o| o.op == "float_argmax"),
                "{table}"
            );
            assert!(table.contains("% differ"), "{table}");
            let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
            let differing = json["ops"]
                .as_array()
                .unwrap()
                .iter()
                .find(|o| o["op"] == "float_argmax")
                .unwrap()["differing"]
                .as_f64();
            assert_eq!(differing, Some(want[0]));
        }
    }
}

#[test]
fn router_choices_flex_bf16() {
    router_choices::<Amp<Autodiff<Flex>>>(&Default::default(), Precision::Bf16);
}

#[test]
fn router_choices_flex_f16_below_autodiff() {
    router_choices::<Autodiff<Amp<Flex>>>(&Default::default(), Precision::F16);
}

#[test]
fn router_choices_wgpu_f16() {
    let Some(device) = wgpu_device() else { return };
    router_choices::<Amp<Autodiff<Wgpu>>>(&device, Precision::F16);
}

/// A fused router of the user's own (`CustomOp::run_with_indices`): the logits, each token's
/// best gate and its expert. The report measures the two float outputs and gives the expert
/// indices a row with the share that differ from the f32 run's; through `cast` alone (the
/// canary) it sees no such op.
#[test]
fn custom_router_indices_are_compared() {
    use burn::tensor::TensorPrimitive;
    use burn::tensor::ops::{FloatTensor, FloatTensorOps, IntTensor};
    use burn_amp::custom_op::{Category, CustomOp};
    type Inner = Autodiff<Flex>;
    type B = Amp<Inner>;
    const ROUTE: CustomOp = CustomOp::new("route", Category::Lower);
    let _turn = serial();
    let device = Default::default();
    let (model, x) = router::<B>(&device);
    let route = |m: &Linear<B>, seen: bool| {
        let op =
            |[x, w]: [FloatTensor<Inner>; 2]| -> ([FloatTensor<Inner>; 2], [IntTensor<Inner>; 1]) {
                let logits = Inner::float_matmul(x, w);
                let (gate, expert) = Inner::float_max_dim_with_indices(
                    logits.clone(),
                    1,
                    burn::tensor::IntDType::I64,
                );
                ([logits, gate], [expert])
            };
        let inputs = [x.clone(), m.weight.val()].map(|t| t.into_primitive().tensor());
        let ([logits, gate], [expert]) = if seen {
            ROUTE.run_with_indices::<Inner, 2, 2, 1>(inputs, op)
        } else {
            op(ROUTE.cast::<Inner, 2>(inputs))
        };
        let float = |t| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
        let expert = Tensor::<B, 2, Int>::from_primitive(expert);
        (float(logits).sum() + float(gate).sum(), expert)
    };
    let choices = |p: Precision| {
        let _at = autocast(p);
        host(route(&model, true).1)
    };
    let (a, b) = (choices(Precision::F32), choices(Precision::Bf16));
    let want = a.iter().zip(&b).filter(|(a, b)| a != b).count() as f64 / TOKENS as f64;
    assert!(want > 0.01, "the planted near ties flip no choice: {want}");
    for seen in [true, false] {
        let report = PrecisionReport::measure(&model, Precision::Bf16, 1.0, |m: &Linear<B>| {
            route(m, seen).0
        })
        .unwrap();
        let rows: Vec<&OpPrecision> = report.ops.iter().filter(|o| o.op == "route").collect();
        if !seen {
            assert!(rows.is_empty(), "{}", report.table(10));
            continue;
        }
        let shapes: Vec<_> = rows
            .iter()
            .map(|o| (o.shape.clone(), o.differing))
            .collect();
        assert_eq!(
            shapes,
            vec![
                (vec![TOKENS, EXPERTS], None),
                (vec![TOKENS, 1], None),
                (vec![TOKENS, 1], Some(want))
            ],
            "{}",
            report.table(10)
        );
        assert!(rows[0].own_error.is_some_and(|e| e > 0.0), "{:?}", rows[0]);
        assert_eq!(rows[2].suggestion, Suggestion::ComputeItsInputInF32);
    }
}
