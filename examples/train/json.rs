//! The run's JSON: writing arrays, and reading back an earlier run to compare with.

use std::path::Path;

use super::Error2;

pub fn json_array<T: std::fmt::Display>(values: &[T]) -> String {
    let items: Vec<String> = values
        .iter()
        .map(|v| {
            let s = v.to_string();
            // JSON has no NaN or inf.
            if s.parse::<f64>().is_ok_and(f64::is_finite) {
                s
            } else {
                "null".into()
            }
        })
        .collect();
    format!("[{}]", items.join(","))
}

/// An earlier run to draw beside this one: its loss curve (a history.json) or only its final
/// loss (the JSON line).
pub struct Compared {
    pub label: String,
    pub losses: Option<Vec<f32>>,
    pub final_loss: Option<f32>,
}

impl Compared {
    pub fn read(path: &Path) -> Result<Self, Error2> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read --compare {}: {e}", path.display()))?;
        let precision = json_value(&text, "precision")
            .map(|v| v.trim_matches('"').to_string())
            .unwrap_or_else(|| "earlier run".into());
        let losses = json_value(&text, "losses").map(|v| {
            v.trim_start_matches('[')
                .split(',')
                .map(|x| x.trim().trim_end_matches(']').parse().unwrap_or(f32::NAN))
                .collect()
        });
        let final_loss = json_value(&text, "final_loss").and_then(|v| v.parse().ok());
        if losses.is_none() && final_loss.is_none() {
            return Err(format!(
                "--compare {}: no \"losses\" nor \"final_loss\" in it",
                path.display()
            )
            .into());
        }
        Ok(Self {
            label: format!("{precision} ({})", path.display()),
            losses,
            final_loss,
        })
    }
}

/// The text of `"key": value` in flat JSON (this example's own output): a number, a string
/// or an array of numbers.
fn json_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let at = text.find(&format!("\"{key}\""))? + key.len() + 2;
    let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
    let end = if rest.starts_with('[') {
        rest.find(']')? + 1
    } else if let Some(s) = rest.strip_prefix('"') {
        s.find('"')? + 2
    } else {
        rest.find([',', '}', '\n']).unwrap_or(rest.len())
    };
    Some(rest[..end].trim())
}
