//! The scaler's state as a Burn record.

use burn::prelude::*;
use burn::record::{PrecisionSettings, Record};
use burn::tensor::{DType, TensorData};
use serde::{Deserialize, Serialize};

/// The scaler's state as plain numbers, a Burn [`Record`]: save it beside the model and
/// optimizer records, load it to continue the same scale trajectory.
///
/// Serialized as itself (its fields are plain numbers at every precision setting); a record
/// saved before `deferred_found_inf` existed loads with it `None`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GradScalerRecord {
    /// The loss scale.
    pub scale: f32,
    /// Clean steps since the last growth or overflow.
    pub growth_tracker: f32,
    /// Overflows still tolerated before backing off.
    pub hysteresis_left: f32,
    /// Overflows in a row at the floor.
    pub floor_overflows: f32,
    /// The overflow flag of steps whose update was put off, for the next update: `Some(true)`
    /// an overflow (the next update backs off), `Some(false)` clean steps, `None` none put
    /// off. Only optimizers sharing a scaler put updates off
    /// ([`AmpOptimizer::share_scaler`](crate::AmpOptimizer::share_scaler)), while one of
    /// them holds an open accumulation window.
    #[serde(default)]
    pub deferred_found_inf: Option<bool>,
}

impl<B: Backend> Record<B> for GradScalerRecord {
    type Item<S: PrecisionSettings> = Self;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        self
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, _device: &B::Device) -> Self {
        item
    }
}

/// The f32 `[4]` state: f32 whatever the device's default float dtype (an f16 default would
/// turn the initial scale 65536 into inf).
pub(super) fn state_tensor<B: Backend>(
    record: &GradScalerRecord,
    device: &B::Device,
) -> Tensor<B, 1> {
    let values = vec![
        record.scale,
        record.growth_tracker,
        record.hysteresis_left,
        record.floor_overflows,
    ];
    Tensor::from_data(TensorData::new(values, [4]), (device, DType::F32))
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::record::{
        BinBytesRecorder, BytesRecorder, FullPrecisionSettings, HalfPrecisionSettings,
        NamedMpkBytesRecorder, Recorder,
    };

    use super::*;

    /// The record as it was before `deferred_found_inf`.
    #[derive(burn::record::Record)]
    struct FourFields {
        scale: f32,
        growth_tracker: f32,
        hysteresis_left: f32,
        floor_overflows: f32,
    }

    fn saved(deferred_found_inf: Option<bool>) -> GradScalerRecord {
        GradScalerRecord {
            scale: 4096.0,
            growth_tracker: 17.0,
            hysteresis_left: 2.0,
            floor_overflows: 0.0,
            deferred_found_inf,
        }
    }

    fn round_trip<R: BytesRecorder<Flex, Vec<u8>>>(recorder: R, record: GradScalerRecord) {
        let bytes = recorder.record(record.clone(), ()).unwrap();
        let loaded: GradScalerRecord = recorder.load(bytes, &Default::default()).unwrap();
        assert_eq!(loaded, record);
    }

    #[test]
    fn records_round_trip_through_burns_recorders() {
        for flag in [None, Some(false), Some(true)] {
            round_trip(
                NamedMpkBytesRecorder::<FullPrecisionSettings>::new(),
                saved(flag),
            );
            // Burn's `CompactRecorder` settings (the Learner's): the scale stays f32.
            round_trip(
                NamedMpkBytesRecorder::<HalfPrecisionSettings>::new(),
                saved(flag),
            );
            round_trip(
                BinBytesRecorder::<FullPrecisionSettings>::new(),
                saved(flag),
            );
        }
    }

    #[test]
    fn a_record_saved_before_the_deferred_flag_loads_without_one() {
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        let old = FourFields {
            scale: 4096.0,
            growth_tracker: 17.0,
            hysteresis_left: 2.0,
            floor_overflows: 0.0,
        };
        let bytes = Recorder::<Flex>::record(&recorder, old, ()).unwrap();
        let loaded: GradScalerRecord =
            Recorder::<Flex>::load(&recorder, bytes, &Default::default()).unwrap();
        assert_eq!(loaded, saved(None));
    }
}
