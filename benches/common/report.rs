//! The one JSON line of a bench: printed on stdout and appended to
//! `target/tmp/burn-amp-benches.jsonl`, so that `cargo bench` leaves one file with every
//! figure of the run.

use std::io::Write;

pub fn emit(json: &str) {
    println!("{json}");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("burn-amp-benches.jsonl");
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
    {
        let _ = writeln!(file, "{json}");
    }
}
