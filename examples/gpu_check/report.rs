//! The check's output: one JSON object per line, on stdout and in `--out`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

pub struct Report {
    file: Option<BufWriter<File>>,
}

impl Report {
    pub fn new(path: Option<&Path>) -> Result<Self, String> {
        let file = path
            .map(|p| {
                File::create(p)
                    .map(BufWriter::new)
                    .map_err(|e| format!("cannot write --out {}: {e}", p.display()))
            })
            .transpose()?;
        Ok(Self { file })
    }

    /// Writes one record. JSON has no NaN or inf: serde_json writes them as `null`.
    pub fn emit(&mut self, record: Value) {
        let line = record.to_string();
        println!("{line}");
        if let Some(f) = self.file.as_mut() {
            // A line at a time: a run killed by a timeout keeps what it measured.
            let _ = writeln!(f, "{line}").and_then(|_| f.flush());
        }
    }

    pub fn flush(&mut self) {
        if let Some(f) = self.file.as_mut() {
            let _ = f.flush();
        }
    }
}

/// The time now as `YYYY-MM-DDTHH:MM:SSZ` (the device machine has no `date` we rely on).
pub fn now_utc() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
