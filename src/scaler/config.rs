//! The scaler's configuration: PyTorch `GradScaler`'s knobs, DeepSpeed's extras.

use burn::config::Config;

use super::ScalerError;
use super::kernels::ScaleRule;

/// Configuration of a [`GradScaler`](super::GradScaler).
///
/// The defaults are PyTorch's (`init_scale` 2^16, `growth_factor` 2, `backoff_factor` 0.5,
/// `growth_interval` 2000), with DeepSpeed's extras: `hysteresis` 1 (PyTorch's behaviour),
/// `min_scale` 1 and no `max_scale`. PyTorch has no floor: its scale can shrink towards 0.
/// burn-amp stops at 1 by default, because below 1 the scaler shrinks the gradients instead
/// of protecting them, and an f16 run that overflows at scale 1 is diverging or has a bug,
/// which [`GradScaler::check`](super::GradScaler::check) then reports. Set `min_scale` lower
/// to follow PyTorch.
#[derive(Config, Debug, PartialEq)]
pub struct GradScalerConfig {
    /// The first loss scale.
    #[config(default = 65536.0)]
    pub init_scale: f32,
    /// Multiplier after `growth_interval` clean steps in a row; must be > 1.
    #[config(default = 2.0)]
    pub growth_factor: f32,
    /// Multiplier on an overflow; must be in (0, 1).
    #[config(default = 0.5)]
    pub backoff_factor: f32,
    /// Clean steps in a row before the scale grows; must be in 1..=2^24 (the count is an f32
    /// on the device, exact up to 2^24).
    #[config(default = 2000)]
    pub growth_interval: u32,
    /// The overflow in a row that backs off (DeepSpeed's `hysteresis`): `h` tolerates `h - 1`
    /// overflows and backs off on the `h`-th; 1 backs off on every overflow, as PyTorch does.
    /// A skipped step is skipped whatever `h`.
    #[config(default = 1)]
    pub hysteresis: u32,
    /// The floor of the scale (DeepSpeed's `min_loss_scale`; see above).
    #[config(default = 1.0)]
    pub min_scale: f32,
    /// The ceiling of the scale: a growth that would pass it is refused, the scale stays (so
    /// a power-of-two scale stays one). By default only an infinite scale is refused, as in
    /// PyTorch.
    #[config(default = "f32::MAX")]
    pub max_scale: f32,
    /// Overflows in a row at `min_scale` after which [`GradScaler::check`](super::GradScaler::check)
    /// reports [`ScalerError::StuckAtMinScale`]: gradients that overflow even unscaled
    /// point at a bug or a diverged run, not at the scale.
    #[config(default = 16)]
    pub max_floor_overflows: u32,
    /// `false` turns the scaler into a pass-through, as does a precision that needs no
    /// scaling (bf16, f32).
    #[config(default = true)]
    pub enabled: bool,
}

impl GradScalerConfig {
    /// Checks the values; the error names the field and says what is allowed.
    pub fn validate(&self) -> Result<(), ScalerError> {
        self.rule().map(|_| ())
    }

    /// The validated constants of the scale update.
    pub(crate) fn rule(&self) -> Result<ScaleRule, ScalerError> {
        let invalid = |field: &'static str, value: f64, expected: &'static str| {
            Err(ScalerError::InvalidConfig {
                field,
                value,
                expected,
            })
        };
        if !self.init_scale.is_finite() || self.init_scale <= 0.0 {
            return invalid("init_scale", self.init_scale as f64, "a finite number > 0");
        }
        if !self.growth_factor.is_finite() || self.growth_factor <= 1.0 {
            return invalid(
                "growth_factor",
                self.growth_factor as f64,
                "a finite number > 1",
            );
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return invalid(
                "backoff_factor",
                self.backoff_factor as f64,
                "a number in (0, 1)",
            );
        }
        // Counted in f32 on the device: exact up to 2^24, where `n + 1 == n` would stop them.
        const EXACT: u32 = 1 << 24;
        if !(1..=EXACT).contains(&self.growth_interval) {
            return invalid(
                "growth_interval",
                self.growth_interval as f64,
                "1 to 2^24 steps (counted in f32 on the device)",
            );
        }
        if !(1..=EXACT).contains(&self.hysteresis) {
            return invalid(
                "hysteresis",
                self.hysteresis as f64,
                "1 to 2^24 overflows (counted in f32 on the device)",
            );
        }
        if !(self.min_scale > 0.0 && self.min_scale.is_finite()) {
            return invalid("min_scale", self.min_scale as f64, "a finite number > 0");
        }
        // Finite, so that a growth to inf is always refused (`grown <= max_scale` is false).
        if !self.max_scale.is_finite() || self.max_scale < self.min_scale {
            return invalid(
                "max_scale",
                self.max_scale as f64,
                "a finite number >= min_scale (f32::MAX for no ceiling)",
            );
        }
        if self.init_scale < self.min_scale || self.init_scale > self.max_scale {
            return invalid(
                "init_scale",
                self.init_scale as f64,
                "a number within [min_scale, max_scale]",
            );
        }
        Ok(ScaleRule {
            growth_factor: self.growth_factor,
            backoff_factor: self.backoff_factor,
            growth_interval: self.growth_interval,
            hysteresis: self.hysteresis,
            min_scale: self.min_scale,
            max_scale: self.max_scale,
        })
    }
}
