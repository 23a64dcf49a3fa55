//! SVG plots of a run: loss against step, the loss scale with skipped steps, memory by
//! category.

use super::json::Compared;
use super::{Error2, HistoryRecord, mib};
use burn_amp::memory::{MemoryReport, MemorySource};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;

const SIZE: (u32, u32) = (900, 500);

fn positive_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        (0.1, 10.0)
    } else {
        (lo * 0.8, hi * 1.25)
    }
}

/// Loss against optimizer step, log scale; an earlier run overlaid.
pub fn loss(
    path: &Path,
    label: &str,
    losses: &[f32],
    compare: Option<&Compared>,
) -> Result<(), Error2> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let other = compare.and_then(|c| c.losses.as_deref()).unwrap_or(&[]);
    let steps = losses.len().max(other.len()).max(2) as f64;
    let all = losses.iter().chain(other).map(|&l| l as f64);
    let all = all.chain(compare.and_then(|c| c.final_loss).map(f64::from));
    let (lo, hi) = positive_range(all);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "training loss (TinyLm, sequence reversal)",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..steps, (lo..hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc("cross-entropy")
        .draw()?;
    let points = |ls: &[f32]| -> Vec<(f64, f64)> {
        ls.iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite() && **l > 0.0)
            .map(|(i, &l)| ((i + 1) as f64, l as f64))
            .collect()
    };
    chart
        .draw_series(LineSeries::new(points(losses), BLUE.stroke_width(2)))?
        .label(format!("{label}, this run"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    if let Some(c) = compare {
        if c.losses.is_some() {
            chart
                .draw_series(LineSeries::new(points(other), RED))?
                .label(c.label.clone())
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        } else if let Some(f) = c.final_loss {
            let f = f as f64;
            chart
                .draw_series(DashedLineSeries::new(
                    [(0.0, f), (steps, f)],
                    6,
                    4,
                    RED.into(),
                ))?
                .label(format!("{}: final loss", c.label))
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// The loss scale as read every `--log-every` steps (log2 axis), skipped steps marked.
pub fn scale(path: &Path, history: &HistoryRecord, enabled: bool) -> Result<(), Error2> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let steps = history.losses.len().max(2) as f64;
    let samples: Vec<(f64, f64)> = history
        .scale_steps
        .iter()
        .zip(&history.scale_values)
        .filter(|(_, v)| **v > 0.0)
        .map(|(&s, &v)| (s as f64, (v as f64).log2()))
        .collect();
    let (lo, hi) = samples.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    let (lo, hi) = if lo > hi {
        (-1.0, 1.0)
    } else {
        (lo - 1.0, hi + 1.0)
    };
    let caption = if enabled {
        "loss scale, read every --log-every steps".to_string()
    } else {
        "loss scale: 1, the scaler is off (it runs at f16 only)".to_string()
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..steps, lo..hi)?;
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc("scale")
        .y_label_formatter(&|y| {
            if (y - y.round()).abs() < 1e-6 {
                format!("2^{y:.0}")
            } else {
                String::new()
            }
        })
        .draw()?;
    chart
        .draw_series(LineSeries::new(samples.clone(), BLUE.stroke_width(2)))?
        .label("scale (between reads: interpolated)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    chart.draw_series(samples.iter().map(|&p| Circle::new(p, 3, BLUE.filled())))?;
    // A skipped step is marked at the scale read next: after its backoff.
    let at = |step: usize| {
        samples
            .iter()
            .find(|(s, _)| *s >= (step + 1) as f64)
            .or(samples.last())
            .map_or(0.0, |p| p.1)
    };
    chart
        .draw_series(
            history
                .skipped
                .iter()
                .map(|&s| Cross::new(((s + 1) as f64, at(s)), 7, RED.stroke_width(2))),
        )?
        .label(format!(
            "skipped step ({}), at the scale read after it",
            history.skipped.len()
        ))
        .legend(|(x, y)| Cross::new((x + 10, y), 5, RED.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Memory of one training step by category, from `StepMemory`.
pub fn memory(path: &Path, report: &MemoryReport, accum_bytes: u64) -> Result<(), Error2> {
    let bars = [
        ("parameters", report.parameters),
        ("frozen params", report.frozen_parameters),
        ("gradients", report.gradients),
        ("optimizer state", report.optimizer_state),
        ("accum. sums", accum_bytes),
        ("activations", report.activations.unwrap_or(0)),
        (
            "workspace / temp.",
            report.unexplained().map_or(0, |b| b.max(0) as u64),
        ),
        (
            "reserve + frag.",
            report.reserve_and_fragmentation.unwrap_or(0),
        ),
    ];
    let source = match report.source {
        Some(MemorySource::Allocator) => "device allocator",
        Some(MemorySource::CountingAllocator) => "process heap, counted",
        None => "tensor sizes; nothing measured the activations",
    };
    let top = bars.iter().map(|b| mib(b.1)).fold(0.0, f64::max).max(1e-3) * 1.2;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("memory of one training step ({source})"),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((0..bars.len()).into_segmented(), 0f64..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(bars.len())
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => bars.get(*i).map_or("", |b| b.0).to_string(),
            _ => String::new(),
        })
        .y_desc("MiB")
        .draw()?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (_, bytes))| {
        let mut bar = Rectangle::new(
            [
                (SegmentValue::Exact(i), 0.0),
                (SegmentValue::Exact(i + 1), mib(*bytes)),
            ],
            BLUE.mix(0.6).filled(),
        );
        bar.set_margin(0, 0, 12, 12);
        bar
    }))?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (_, bytes))| {
        Text::new(
            format!("{:.3}", mib(*bytes)),
            (SegmentValue::CenterOf(i), mib(*bytes) + top * 0.01),
            ("sans-serif", 14)
                .into_font()
                .into_text_style(&root)
                .pos(Pos::new(HPos::Center, VPos::Bottom)),
        )
    }))?;
    root.present()?;
    Ok(())
}
