//! An explicit precision the device cannot run is a clear error.

use burn::tensor::TensorData;
use burn_amp::{Amp, AmpError, autocast};

use super::*;

/// `Precision::F16` must fail at the first lowered op with the same typed message as bf16
/// does, naming the device and the alternative, not somewhere inside the backend.
#[test]
fn explicit_f16_without_device_support_is_a_clear_error() {
    use burn_ndarray::{NdArray, NdArrayDevice};
    let device = NdArrayDevice::Cpu;
    assert!(!<NdArray as Backend>::supports_dtype(&device, DType::F16));
    assert!(!<NdArray as Backend>::supports_dtype(&device, DType::BF16));
    type A = Amp<NdArray>;
    let a = Tensor::<A, 2>::from_data(TensorData::new(vec![0.5f32; 4], [2, 2]), &device);
    for precision in [Precision::F16, Precision::Bf16] {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = autocast(precision);
            a.clone().matmul(a.clone())
        }));
        let msg = panic_message(result.expect_err("a lowered matmul must fail"));
        let expected = AmpError::UnsupportedPrecision {
            precision,
            device: format!("{device:?}"),
            backend: <NdArray as Backend>::name(&device),
            alternative: Precision::F32,
        }
        .to_string();
        assert_eq!(msg, expected, "{precision}");
        assert!(
            msg.contains("Precision::F32") && msg.contains("Cpu"),
            "{msg}"
        );
    }
    // Autocast off still works on this device.
    let _g = autocast(Precision::F32);
    assert_eq!(a.clone().matmul(a).dtype(), DType::F32);
}
