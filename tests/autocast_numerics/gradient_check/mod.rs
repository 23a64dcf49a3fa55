//! Gradients against central differences in f64: the check that comparisons between backends
//! and settings cannot make. A backward formula wrong the same way everywhere (burn-autodiff's,
//! shared by every backend, or one of `Amp`'s own nodes) passes every such comparison. Here a
//! loss runs on Flex in f64 (which `Amp` never lowers, so its nodes run in f64 too), and each
//! tracked leaf's gradient under `Autodiff<Flex>` and under `Amp<Autodiff<Flex>>` (and
//! `Autodiff<Amp<Flex>>`, wherever plain autodiff is right) is held to
//! `(L(x + h eᵢ) − L(x − h eᵢ)) / 2h` of the forward, element by element: within
//! 1e-8 + 1e-6 |d| (looser where Flex computes in f32 inside). Where the loss has a kink or a
//! jump within reach of `h` (a ReLU at 0, a sort at a tie, a floor), the one-sided differences
//! disagree by more than curvature explains (their gap does not double with the step) and
//! that element is left out; a check that leaves out more than an eighth of a leaf fails.
//!
//! From f32 leaves under autocast, the same truth checks the policy: what it keeps in f32
//! backpropagates in f32, what it lowers within half precision's rounding.
//!
//! `ops.rs`: 106 float ops of Burn 0.21 one by one (unary, binary with broadcasting,
//! reductions, scans, sorting, shape and indexing ops, every module op); the random graphs
//! (`random_graphs/gradients.rs`): compositions.

mod ops;

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::backend::{Autodiff, Flex};
use burn::tensor::TensorData;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::{Amp, autocast};

use super::*;

/// The step of the central differences: truncation ~h² f‴ ≈ 1e-10, rounding ~1e-16 / h.
const STEP: f64 = 1e-5;

/// A loss of `[rows, columns]` leaves, the first `tracked` of which are differentiated.
pub(crate) trait Loss {
    fn tracked(&self) -> usize;
    fn loss<B: Backend>(&self, leaves: &[Tensor<B, 2>]) -> Tensor<B, 1>;
    /// The tolerance of a gradient `g` against its difference `d`: `|g - d| <= abs + rel |d|`.
    fn tolerance(&self) -> (f64, f64) {
        (1e-8, 1e-6)
    }
}

/// What plain autodiff made of a check that `Amp` passed.
#[derive(Debug)]
#[allow(dead_code)] // the messages are for a debugger's eyes
pub(crate) enum Plain {
    Right,
    Wrong(String),
    Panics(String),
}

fn leaves<B: Backend>(
    data: &[(Vec<f64>, [usize; 2])],
    device: &B::Device,
    dtype: DType,
) -> Vec<Tensor<B, 2>> {
    data.iter()
        .map(|(v, shape)| Tensor::from_data(TensorData::new(v.clone(), *shape), (device, dtype)))
        .collect()
}

fn scalar<B: Backend>(t: Tensor<B, 1>) -> f64 {
    t.into_data().to_vec::<f64>().expect("f64")[0]
}

/// Each tracked leaf's gradient on `B`, from leaves of `dtype` (zeros where it gets none).
fn differentiated<B: AutodiffBackend, L: Loss>(
    l: &L,
    data: &[(Vec<f64>, [usize; 2])],
    dtype: DType,
) -> Vec<Vec<f64>> {
    let device = Default::default();
    let mut leaves = leaves::<B>(data, &device, dtype);
    for leaf in &mut leaves[..l.tracked()] {
        *leaf = leaf.clone().require_grad();
    }
    let grads = l.loss(&leaves).backward();
    leaves[..l.tracked()]
        .iter()
        .map(|leaf| match leaf.grad(&grads) {
            Some(g) => g.cast(DType::F64).into_data().to_vec::<f64>().expect("f64"),
            None => vec![0.0; leaf.shape().num_elements()],
        })
        .collect()
}

/// The central differences of each tracked leaf's elements, `None` where the loss is not
/// smooth within reach of the step. There the gap between the one-sided differences is the
/// jump in slope whatever the step; where smooth it is the curvature times the step, so it
/// doubles with the step (to within ~h³ f⁗).
fn differences<L: Loss>(l: &L, data: &[(Vec<f64>, [usize; 2])]) -> Vec<Vec<Option<f64>>> {
    // Under `Amp`, which has the forwards Flex lacks (bicubic `grid_sample`); in f64 the
    // same values as Flex's elsewhere.
    let device = Default::default();
    let _g = autocast(Precision::F16);
    let loss = |data: &[(Vec<f64>, [usize; 2])]| {
        scalar(l.loss(&leaves::<Amp<Flex>>(data, &device, DType::F64)))
    };
    let at_rest = loss(data);
    let mut moved = data.to_vec();
    let mut at = |leaf: usize, i: usize, step: f64| {
        let x = moved[leaf].0[i];
        moved[leaf].0[i] = x + step;
        let out = loss(&moved);
        moved[leaf].0[i] = x;
        out
    };
    (0..l.tracked())
        .map(|leaf| {
            (0..data[leaf].0.len())
                .map(|i| {
                    let [up, down, up2, down2] =
                        [STEP, -STEP, 2.0 * STEP, -2.0 * STEP].map(|step| at(leaf, i, step));
                    let central = (up - down) / (2.0 * STEP);
                    let gap = (up + down - 2.0 * at_rest) / STEP;
                    let gap2 = (up2 + down2 - 2.0 * at_rest) / (2.0 * STEP);
                    let smooth = (gap2 - 2.0 * gap).abs() <= 1e-8 + 1e-7 * central.abs();
                    smooth.then_some(central)
                })
                .collect()
        })
        .collect()
}

/// The first of `got`'s elements off its difference (where smooth), as a message.
fn mismatch(want: &[Vec<Option<f64>>], got: &[Vec<f64>], (abs, rel): (f64, f64)) -> Option<String> {
    for (leaf, (want, got)) in want.iter().zip(got).enumerate() {
        for (i, (d, g)) in want.iter().zip(got).enumerate() {
            let off = d.map(|d| (g - d).abs());
            match d {
                // NaN is off too.
                Some(d) if off.is_some_and(|off| off.is_nan() || off > abs + rel * d.abs()) => {
                    return Some(format!(
                        "the gradient of leaf {leaf} at {i} is {g}, its central difference {d}"
                    ));
                }
                _ => {}
            }
        }
    }
    None
}

/// ‖got − d‖₂ / ‖d‖₂ over the smooth elements of every leaf.
fn relative_error(want: &[Vec<Option<f64>>], got: &[Vec<f64>]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (want, got) in want.iter().zip(got) {
        for (d, g) in want.iter().zip(got) {
            if let Some(d) = d {
                num += (g - d).powi(2);
                den += d * d;
            }
        }
    }
    (num / den.max(1e-300)).sqrt()
}

/// What a check found: how many elements were left out, what plain autodiff made of it, and
/// `Amp`'s gradients from f32 leaves under autocast at F32, F16 and BF16, as their relative
/// L2 error against the differences (the truth: the leaves' values are exact in bf16).
pub(crate) struct Checked {
    pub(crate) left_out: usize,
    pub(crate) plain: Plain,
    pub(crate) from_f32: [f64; 3],
}

/// `l` at `data`: `Amp`'s gradients in f64 as the differences say (else a panic naming
/// `what`), and the rest of [`Checked`].
pub(crate) fn check<L: Loss>(l: &L, data: &[(Vec<f64>, [usize; 2])], what: &str) -> Checked {
    let want = differences(l, data);
    let mut left_out = 0;
    for (leaf, want) in want.iter().enumerate() {
        let smooth = want.iter().filter(|d| d.is_some()).count();
        assert!(
            smooth * 8 >= 7 * want.len(),
            "{what}: leaf {leaf} is smooth at {smooth} of {} elements",
            want.len()
        );
        left_out += want.len() - smooth;
    }
    let amp = |precision, dtype| {
        let _g = autocast(precision);
        differentiated::<Amp<Autodiff<Flex>>, L>(l, data, dtype)
    };
    if let Some(wrong) = mismatch(&want, &amp(Precision::F16, DType::F64), l.tolerance()) {
        panic!("{what} under Amp: {wrong}");
    }
    let from_f32 = [Precision::F32, Precision::F16, Precision::Bf16]
        .map(|precision| relative_error(&want, &amp(precision, DType::F32)));
    let judged_once = |run: &dyn Fn() -> Vec<Vec<f64>>| match catch_unwind(AssertUnwindSafe(run)) {
        Ok(got) => match mismatch(&want, &got, l.tolerance()) {
            Some(wrong) => Plain::Wrong(wrong),
            None => Plain::Right,
        },
        Err(e) => Plain::Panics(panic_message(e)),
    };
    // Wrong is judged three times: burn-autodiff's `cat` drops the gradients before it while
    // another thread runs a backward (README, "Defects of Burn 0.21"), as the tests beside
    // this one do; its defects fail every run.
    let judged = |run: &dyn Fn() -> Vec<Vec<f64>>| {
        let mut verdict = judged_once(run);
        for _ in 0..2 {
            if matches!(verdict, Plain::Right) {
                break;
            }
            verdict = judged_once(run);
        }
        verdict
    };
    let plain = judged(&|| differentiated::<Autodiff<Flex>, L>(l, data, DType::F64));
    // `Amp` below autodiff: burn-autodiff's nodes (and defects), `Amp` under them.
    let below = judged(&|| {
        let _g = autocast(Precision::F16);
        differentiated::<Autodiff<Amp<Flex>>, L>(l, data, DType::F64)
    });
    if matches!(plain, Plain::Right) {
        assert!(
            matches!(below, Plain::Right),
            "{what} under Autodiff<Amp<Flex>>, right under plain autodiff: {below:?}"
        );
    }
    Checked {
        left_out,
        plain,
        from_f32,
    }
}
