//! What the precision doctor costs. A TinyLm forward+backward on `Amp<Autodiff<Flex>>` at
//! bf16, side by side: with no session (what every op pays while the doctor is off is in
//! `benches/autocast.rs`, the decorator-overhead rows), under `detect_anomaly` (every op's
//! output checked on the device and read back), and `PrecisionReport::measure` (two steps,
//! every output on the host, each half-precision op run again in f32). One table, then one
//! JSON line.
//!
//! `cargo bench --bench doctor` (`cargo test` runs it small, as a smoke test).

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "common/mode.rs"]
mod mode;
#[path = "common/report.rs"]
mod report;

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn_amp::{Amp, Precision, PrecisionReport, autocast, detect_anomaly};
use common::tiny_lm::{ReversalTask, TinyLm, TinyLmConfig};

type B = Amp<Autodiff<Flex>>;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let quick = mode::quick();
    let iters = if quick { 2 } else { 15 };
    let device = Default::default();
    let config = TinyLmConfig::new().with_dropout(0.0);
    let model: TinyLm<B> = config.init(&device);
    let (x, y) = ReversalTask::new(config.vocab, config.seq_len, 1).batch::<B>(32, &device);
    let step = |m: &TinyLm<B>| {
        let _ = m.loss(x.clone(), y.clone()).backward();
    };
    let _bf16 = autocast(Precision::Bf16);
    step(&model); // warm-up

    // Interleaved: plain, anomaly, report, plain, ...: the machine's drift hits all alike.
    let (mut plain, mut anomaly, mut report) = (Vec::new(), Vec::new(), Vec::new());
    let mut ops = 0;
    for _ in 0..iters {
        let t = Instant::now();
        step(&model);
        plain.push(t.elapsed());

        let guard = detect_anomaly();
        let t = Instant::now();
        step(&model);
        anomaly.push(t.elapsed());
        ops = guard.ops_checked();
        assert!(guard.report().is_none(), "a healthy step");
        drop(guard);

        let t = Instant::now();
        let r = PrecisionReport::measure(&model, Precision::Bf16, 1.0, |m: &TinyLm<B>| {
            m.loss(x.clone(), y.clone())
        })
        .expect("no optimizer installed");
        report.push(t.elapsed());
        assert!(!r.ops.is_empty());
    }
    let (plain, anomaly, report) = (median(plain), median(anomaly), median(report));
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let anomaly_ratio = anomaly.as_secs_f64() / plain.as_secs_f64();
    let report_ratio = report.as_secs_f64() / plain.as_secs_f64();
    println!("burn-amp precision doctor ({iters} iterations, medians, side by side)");
    println!("| TinyLm fwd+bwd, Amp<Autodiff<Flex>> bf16, batch 32 | ms | / plain step |");
    println!("|---|---|---|");
    println!("| plain | {:.2} | 1.00 |", ms(plain));
    println!(
        "| detect_anomaly ({ops} ops checked, one read each) | {:.2} | {anomaly_ratio:.2} |",
        ms(anomaly)
    );
    println!(
        "| PrecisionReport::measure (two steps, all outputs read) | {:.2} | {report_ratio:.2} |",
        ms(report)
    );
    report::emit(&format!(
        "{{\"bench\":\"doctor\",\"iterations\":{iters},\"plain_ms\":{:.3},\"anomaly_ms\":{:.3},\"report_ms\":{:.3},\"anomaly_over_plain\":{anomaly_ratio:.3},\"report_over_plain\":{report_ratio:.3},\"ops_checked\":{ops}}}",
        ms(plain),
        ms(anomaly),
        ms(report)
    ));
}
