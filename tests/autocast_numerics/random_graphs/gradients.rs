//! The random graphs' ops, alone and composed, differentiated in f64 against central
//! differences (`gradient_check`): every op on the leaves of a few seeds and along both
//! dimensions, then random graphs (chains, shared operands, paths that meet).

use super::super::gradient_check::{Loss, Plain, check};
use super::super::*;
use super::graph::{Case, LEAVES, OPS, Op, total_loss};

impl Loss for Case {
    fn tracked(&self) -> usize {
        LEAVES - 1
    }

    fn loss<B: Backend>(&self, leaves: &[Tensor<B, 2>]) -> Tensor<B, 1> {
        total_loss(self, leaves)
    }
}

/// Ops whose gradient is not their derivative by design: a detached operand's, and a cast to
/// f32 (which an f64 run cannot difference).
const NOT_DERIVATIVES: [Op; 2] = [Op::DetachedTimes, Op::Widened];

/// Ops whose gradient plain Burn 0.21 gets wrong and `Amp` right: the adaptive pool's output
/// tiled by `repeat_dim` (`src/backend/workarounds/repeat.rs`).
const PLAIN_WRONG: [Op; 1] = [Op::AdaptivePool];

/// `case` with its leaves in f64, checked; whether plain autodiff got it wrong (a panic is a
/// failure: these ops all have a backward in Burn).
fn checked(case: &Case, what: &str) -> bool {
    let data: Vec<_> = case
        .data()
        .iter()
        .map(|leaf| (leaf.iter().map(|&v| v as f64).collect(), [8, 8]))
        .collect();
    match check(case, &data, what).plain {
        Plain::Right => false,
        Plain::Wrong(_) => true,
        Plain::Panics(message) => panic!("{what}: plain autodiff panics: {message}"),
    }
}

/// Every op but [`NOT_DERIVATIVES`], both dimensions, seeds 0..`seeds`: which ops plain
/// autodiff got wrong.
pub(crate) fn every_op_differentiates_right(seeds: u64) -> Vec<Op> {
    let mut plain_wrong = Vec::new();
    for op in OPS.into_iter().filter(|op| !NOT_DERIVATIVES.contains(op)) {
        for dim in 0..2 {
            for seed in 0..seeds {
                let what = format!("{op:?} (dim {dim}, seed {seed})");
                if checked(&Case::single(op, dim, seed), &what) && !plain_wrong.contains(&op) {
                    plain_wrong.push(op);
                }
            }
        }
    }
    plain_wrong
}

/// Random graphs of up to `max_ops` ops (those without [`NOT_DERIVATIVES`]), seeds
/// 0..`seeds`, `Amp`'s gradients as the differences say and plain autodiff's too but where a
/// graph has one of [`PLAIN_WRONG`]. Returns how many graphs were checked.
pub(crate) fn random_graphs_differentiate_right(seeds: u64, max_ops: usize) -> usize {
    let mut checked_graphs = 0;
    for seed in 0..seeds {
        let case = Case::draw(seed, max_ops);
        if case.has(&NOT_DERIVATIVES) {
            continue;
        }
        let what = format!("random graph (seed {seed}, nodes {:?})", case.nodes);
        let plain_wrong = checked(&case, &what);
        assert!(
            !plain_wrong || case.has(&PLAIN_WRONG),
            "{what}: plain autodiff's gradients are wrong"
        );
        checked_graphs += 1;
    }
    checked_graphs
}

/// Also the canary of plain Burn's `repeat_dim` gradient: fixed in a later Burn, this fails.
#[test]
fn every_op_differentiates_as_its_central_differences_in_f64() {
    assert_eq!(
        every_op_differentiates_right(2),
        PLAIN_WRONG,
        "the ops plain autodiff differentiates wrong"
    );
}

#[test]
fn random_graphs_differentiate_as_their_central_differences_in_f64() {
    let checked = random_graphs_differentiate_right(200, 8);
    eprintln!("gradient check: {checked} random graphs");
}
