//! Probabilities: sigmoid in f32. Also the SiLU cost of that choice, measured with the
//! counting allocator declared here as the `#[global_allocator]` of this test binary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::nn::LinearConfig;
use burn::nn::loss::BinaryCrossEntropyLossConfig;
use burn::tensor::activation::{sigmoid, silu};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, TensorData};
use burn_amp::{Amp, autocast};

use super::*;

/// A linear layer (exact weights) whose logits are 12, 10, 9, -9, 11, -12, 3 and 8.5, through
/// `sigmoid` and burn-nn's `BinaryCrossEntropyLoss` on probabilities, targets making four of
/// them confidently wrong. Returns the loss, the weight's gradient, and the dtype of p.
fn bce_on_probabilities<X: AutodiffBackend>(
    precision: Option<Precision>,
) -> (f32, Vec<f32>, DType) {
    let device = Default::default();
    let mut linear = LinearConfig::new(4, 1).init::<X>(&device);
    linear.weight = Param::from_tensor(Tensor::from_data(
        TensorData::new(vec![1.0f32, 0.5, 0.25, 2.0], [4, 1]),
        &device,
    ));
    linear.bias = Some(Param::from_tensor(Tensor::from_floats([0.0], &device)));
    let x: Vec<f32> = vec![
        12.0, 0.0, 0.0, 0.0, //
        0.0, 20.0, 0.0, 0.0, //
        0.0, 0.0, 36.0, 0.0, //
        0.0, 0.0, 0.0, -4.5, //
        5.0, 4.0, 8.0, 1.0, //
        -12.0, 0.0, 0.0, 0.0, //
        1.0, 1.0, 2.0, 0.5, //
        8.0, 0.0, 0.0, 0.25,
    ];
    let x = Tensor::<X, 2>::from_data(TensorData::new(x, [8, 4]), &device);
    let targets = Tensor::<X, 2, Int>::from_data(
        TensorData::new(vec![0i64, 0, 0, 1, 1, 0, 1, 0], [8, 1]),
        &device,
    );
    let bce = BinaryCrossEntropyLossConfig::new().init(&device);
    let guard = precision.map(autocast);
    let p = sigmoid(linear.forward(x));
    let p_dtype = p.dtype();
    let loss = bce.forward(p, targets);
    drop(guard);
    let loss_value = values(loss.clone())[0];
    let grads = loss.backward();
    let grad = linear.weight.val().grad(&grads).expect("weight gradient");
    assert_eq!(
        grad.dtype(),
        DType::F32,
        "an f32 weight gets an f32 gradient"
    );
    (loss_value, values(grad), p_dtype)
}

/// Tolerances: the loss 1e-3 relative (logits are exact in f16/bf16, the sigmoid and the
/// log run in f32 as in the reference); the weight gradient 2e-2 relative L2 (its matmul runs
/// in the low dtype).
fn bce_matches_f32(precision: Precision) {
    let (want_loss, want_grad, _) = bce_on_probabilities::<Autodiff<Flex>>(None);
    let (loss, grad, p_dtype) = bce_on_probabilities::<Amp<Autodiff<Flex>>>(Some(precision));
    let grad_err = rel_l2(&grad, &want_grad);
    eprintln!(
        "{precision}: loss {loss} (f32 {want_loss}), weight grad rel. L2 error {grad_err:.2e}"
    );
    assert_eq!(p_dtype, DType::F32, "sigmoid makes probabilities in f32");
    assert!(
        (loss - want_loss).abs() <= 1e-3 * want_loss.abs(),
        "BCE on probabilities under {precision}: loss {loss}, f32 reference {want_loss}"
    );
    assert!(
        grad_err <= 2e-2,
        "weight gradient under {precision}: {grad:?}, f32 reference {want_grad:?}"
    );
}

#[test]
fn bce_on_sigmoid_probabilities_matches_f32_f16() {
    bce_matches_f32(Precision::F16);
}

#[test]
fn bce_on_sigmoid_probabilities_matches_f32_bf16() {
    bce_matches_f32(Precision::Bf16);
}

/// Bytes allocated and not yet freed by this thread (the measurement below).
struct CountingAlloc;

thread_local! {
    static LIVE_BYTES: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    let _ = LIVE_BYTES.try_with(|c| c.set(c.get() + delta));
}

// SAFETY: forwards to the system allocator; the counter is a const-initialised Cell.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

pub(super) fn live_bytes() -> isize {
    LIVE_BYTES.with(|c| c.get())
}

/// Bytes per element that `f`, given an activation in the low dtype (as a lowered linear
/// returns it), leaves alive on this thread: what autodiff saved for the backward (the
/// activation itself included, if saved), then the output's own bytes.
pub(super) fn retained_per_element<A: AutodiffBackend>(
    precision: Precision,
    n: usize,
    f: impl FnOnce(Tensor<A, 1>) -> Tensor<A, 1>,
) -> (f64, f64) {
    let device = Default::default();
    let x = Tensor::<A, 1>::from_data(
        TensorData::new(
            (0..n).map(|i| (i % 17) as f32 - 8.0).collect::<Vec<_>>(),
            [n],
        ),
        &device,
    )
    .require_grad();
    let _g = autocast(precision);
    let before = live_bytes();
    let y = f(x.clone().cast(low(precision)));
    let after = live_bytes();
    let out_bytes = y.dtype().size() as f64;
    let total = (after - before) as f64 / n as f64;
    drop(y);
    (total - out_bytes, out_bytes)
}

/// For each case (what, the function, bytes per element by hand with the tool on, off) and
/// both half precisions: `kept(precision, on, f)` within 0.05 of the count by hand.
pub(super) fn assert_kept_by_hand<F>(
    tool: &str,
    cases: &[(&str, F, f64, f64)],
    kept: impl Fn(Precision, bool, &F) -> f64,
) {
    for precision in [Precision::F16, Precision::Bf16] {
        for (what, f, on, off) in cases {
            let (got_on, got_off) = (kept(precision, true, f), kept(precision, false, f));
            eprintln!(
                "{what} under {precision}: {got_on:.2} bytes/element kept, {got_off:.2} without {tool}"
            );
            for (got, want, setting) in [(got_on, on, "on"), (got_off, off, "off")] {
                assert!(
                    (got - want).abs() < 0.05,
                    "{what} under {precision}, {tool} {setting}: {got:.2} bytes/element kept, by hand {want:.2}"
                );
            }
        }
    }
}

/// SiLU is `x * sigmoid(x)` in burn (no backend op): with `sigmoid` in f32 its output is
/// promoted to f32. Measured here: the output dtype, and the bytes per element that one SiLU
/// keeps for the backward (the counting allocator above, on `Amp<Autodiff<Flex>>`).
#[test]
fn silu_cost_of_sigmoid_in_f32() {
    type A = Amp<Autodiff<Flex>>;
    let n = 1 << 20;
    let mut dtypes = Vec::new();
    for precision in [Precision::F16, Precision::Bf16] {
        let (saved, out) = retained_per_element::<A>(precision, n, silu);
        eprintln!(
            "silu under {precision}: {saved:.2} bytes/element saved for backward, output {out} bytes/element"
        );
        // Calibration: gelu saves its input (2 bytes in f16/bf16).
        let (gelu_saved, _) =
            retained_per_element::<A>(precision, n, burn::tensor::activation::gelu);
        eprintln!("  (calibration: gelu saves {gelu_saved:.2} bytes/element)");
        let _g = autocast(precision);
        let a = Tensor::<A, 1>::ones([4], &Default::default())
            .require_grad()
            .cast(low(precision));
        dtypes.push((precision, silu(a).dtype()));
        // Before sigmoid moved to f32: x and sigmoid(x) in the low dtype, 4 bytes. Then 12:
        // sigmoid's input (x cast to f32), the mul's own f32 copy of x (promoted) and
        // sigmoid(x) in f32, 4 bytes each. Then 6: the widened copies recomputed in the
        // backward from x, kept in the low dtype (`upcast.rs`). Now 2, x alone, as PyTorch's
        // fused silu: sigmoid(x) is recomputed too (`recompute.rs`).
        assert!(saved <= 2.05, "silu saves {saved:.2} bytes/element");
    }
    for (precision, dtype) in dtypes {
        assert_eq!(
            dtype,
            DType::F32,
            "silu's output under {precision} (x * f32 sigmoid promotes)"
        );
    }
}
