//! How the precision report measures a float output against its truth: the relative error,
//! and what fell out of the dtype's range.

pub(super) fn smallest_normal(dtype: burn_backend::DType) -> f64 {
    match dtype {
        burn_backend::DType::F16 => f64::from(half::f16::MIN_POSITIVE),
        burn_backend::DType::BF16 => f64::from(half::bf16::MIN_POSITIVE),
        burn_backend::DType::F64 => f64::MIN_POSITIVE,
        _ => f64::from(f32::MIN_POSITIVE),
    }
}

pub(super) fn f16_epsilon() -> f64 {
    f64::from(half::f16::EPSILON)
}

pub(super) fn bf16_epsilon() -> f64 {
    f64::from(half::bf16::EPSILON)
}

/// ‖b − a‖ / ‖a‖ over the values finite in both (‖b − a‖ where a is all zero).
pub(super) fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&a, &b) in a.iter().zip(b) {
        if a.is_finite() && b.is_finite() {
            let (a, b) = (f64::from(a), f64::from(b));
            diff += (b - a) * (b - a);
            norm += a * a;
        }
    }
    if norm > 0.0 {
        (diff / norm).sqrt()
    } else {
        diff.sqrt()
    }
}

/// (underflow, overflow, min nonzero |truth|, max |truth|), the first two as fractions of all
/// values. Underflow: a value below `smallest_normal` (where the dtype's range ends, not its
/// precision) that became 0; a cancellation to 0 is an error, not an underflow.
pub(super) fn range_loss(
    truth: &[f32],
    values: &[f32],
    smallest_normal: f64,
) -> (f64, f64, f64, f64) {
    let (mut under, mut over) = (0usize, 0usize);
    let (mut lo, mut hi) = (f64::INFINITY, 0.0f64);
    for (&t, &v) in truth.iter().zip(values) {
        if !t.is_finite() {
            continue;
        }
        let a = f64::from(t.abs());
        if a > 0.0 {
            lo = lo.min(a);
            if v == 0.0 && a < smallest_normal {
                under += 1;
            }
        }
        hi = hi.max(a);
        if !v.is_finite() {
            over += 1;
        }
    }
    let n = truth.len().max(1) as f64;
    let lo = if lo.is_finite() { lo } else { 0.0 };
    (under as f64 / n, over as f64 / n, lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_error_and_range_loss() {
        assert!((relative_error(&[3.0, 4.0], &[3.0, 4.5]) - 0.1).abs() < 1e-12);
        assert_eq!(relative_error(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
        let (under, over, lo, hi) = range_loss(
            &[1e-9, 2.0, 7e4, 0.0],
            &[0.0, 0.0, f32::INFINITY, 0.0],
            6.1e-5,
        );
        // 2.0 → 0 is cancellation (an error), not underflow.
        assert_eq!((under, over), (0.25, 0.25));
        assert!((lo - 1e-9).abs() < 1e-15 && (hi - 7e4).abs() < 1e-3);
    }
}
