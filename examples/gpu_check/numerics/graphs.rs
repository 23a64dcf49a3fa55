//! The numerics part's random graphs: seed after seed while its time lasts, each graph run on
//! the fused and the unfused backend (and Flex), and with every saving of autocast on and off.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use burn::backend::Flex;
use burn_amp::Precision;
use serde_json::json;

use super::random_graphs::{self, Agreement, STEPS, UNFUSED_CANNOT};
use crate::device_lost::{DeviceLost, Steps};
use crate::report::Report;
use crate::{Device, Target};

/// The random graphs of `tests/autocast_numerics/random_graphs`, seed after seed until
/// `deadline` or `seeds` seeds: one JSON line per seed and comparison, written as each ends
/// (`gpu_table.py` sums them per comparison), so that a process stopped past its time keeps
/// what it compared; the deadline is checked before each comparison (after seed 0, which always
/// runs, so that CI's short run reaches this code).
pub(super) fn graphs_while_time_lasts<T: Target>(
    device: &Device<T>,
    lows: &[Precision],
    deadline: Instant,
    seeds: Option<u64>,
    steps: &mut Steps,
    report: &mut Report,
) -> Result<usize, DeviceLost> {
    type F<T> = <T as Target>::Fused;
    type U<T> = <T as Target>::Bare;
    // With TF32 a graph's f32 results move by about 1e-3 (relative) wherever a matmul runs:
    // tolerances follow from how much such a move of the inputs moves the graph.
    let f32_agreement = if T::TF32 {
        Agreement {
            floor: 1e-3,
            perturbation: Some(1e-3),
        }
    } else {
        Agreement {
            floor: 1e-4,
            perturbation: None,
        }
    };
    let mut leave_out = UNFUSED_CANNOT.to_vec();
    if T::TF32 {
        leave_out.extend_from_slice(STEPS);
    }
    let cross = [UNFUSED_CANNOT, STEPS].concat();
    let flex = Default::default();
    let d = device;
    type Comparison<'a> = Box<dyn Fn(u64) -> bool + 'a>;
    let mut comparisons: Vec<(String, Comparison<'_>)> = vec![(
        "fused against unfused, f32".into(),
        Box::new(|seed| {
            random_graphs::backends_agree_on::<F<T>, U<T>>(
                seed,
                ("fused", d),
                ("unfused", d),
                Precision::F32,
                f32_agreement,
                &leave_out,
            )
        }),
    )];
    for &precision in lows {
        let agreement = match precision {
            Precision::Bf16 => Agreement {
                floor: 5e-2,
                perturbation: Some(4e-3),
            },
            _ => Agreement {
                floor: 2e-2,
                perturbation: T::TF32.then_some(1e-3),
            },
        };
        let leave_out = &leave_out;
        comparisons.push((
            format!("fused against unfused, {precision}"),
            Box::new(move |seed| {
                random_graphs::backends_agree_on::<F<T>, U<T>>(
                    seed,
                    ("fused", d),
                    ("unfused", d),
                    precision,
                    agreement,
                    leave_out,
                )
            }),
        ));
    }
    comparisons.push((
        "Flex against unfused, f32".into(),
        Box::new(|seed| {
            random_graphs::backends_agree_on::<Flex, U<T>>(
                seed,
                ("Flex", &flex),
                ("unfused", d),
                Precision::F32,
                Agreement {
                    floor: 1e-2,
                    perturbation: Some(if T::TF32 { 1e-3 } else { 1e-7 }),
                },
                &cross,
            )
        }),
    ));
    for &precision in lows {
        comparisons.push((
            format!("every saving on and off, {precision}"),
            Box::new(move |seed| {
                random_graphs::savings_change_no_value_on::<F<T>>(seed, d, precision, 24);
                true
            }),
        ));
    }

    eprintln!("gpu_check: random graphs until the numerics part's time is spent");
    let mut failed = 0;
    let mut seed = 0;
    'seeds: loop {
        for (name, compare) in &comparisons {
            let Some(step) = steps.start() else {
                continue;
            };
            // Each comparison's line says how far it got; a stop mid-seed shows there.
            if seed > 0 && Instant::now() >= deadline {
                break 'seeds;
            }
            let start = Instant::now();
            let (ok, left_out, error) = match catch_unwind(AssertUnwindSafe(|| compare(seed))) {
                Ok(ran) => (true, !ran, None),
                Err(panic) => (false, false, Some(super::panic_message(panic))),
            };
            failed += usize::from(!ok);
            report.emit(json!({
                "kind": "correctness", "suite": "random graphs", "case": name, "variant": "fusion",
                "dtype": "", "seed": seed, "ok": ok, "left_out": left_out, "error": error,
                "ms": start.elapsed().as_secs_f64() * 1e3, "step": step,
            }));
            let after = format!("random graphs: {name}, seed {seed}");
            steps.check::<F<T>>(step, !ok, &after, d, report)?;
        }
        seed += 1;
        if seeds.is_some_and(|n| seed >= n) {
            break;
        }
    }
    Ok(failed)
}
