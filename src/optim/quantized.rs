//! Block-wise 8-bit optimizer state, as in Dettmers et al., "8-bit Optimizers via Block-wise
//! Quantization" (bitsandbytes): a tensor is cut into blocks of `block` values; each block
//! keeps its absolute maximum in f32 and each value an 8-bit code, the index of the nearest
//! entry of a 256-value map of [-1, 1] (signed) or [0, 1] (unsigned) to `value / absmax`.
//! Four codes are packed in one `i32` word, so a value costs 1 byte plus `4 / block`.
//!
//! Two maps: [`QuantMap::Dynamic`] (bitsandbytes' dynamic tree map: values from 1e-7 to 1,
//! spaced by decade, fine where Adam's moments live) and [`QuantMap::Linear`] (evenly
//! spaced). `benches/low_bit.rs` trains with both; the dynamic map is the default.

use std::sync::OnceLock;

use burn::prelude::*;
use burn::record::{PrecisionSettings, Record};
use burn::tensor::TensorData;
use serde::{Deserialize, Serialize};

/// Codes per `i32` word.
pub const CODES_PER_WORD: usize = 4;

/// The 256 values a code stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum QuantMap {
    /// bitsandbytes' dynamic tree map: per decade 10^-k, a linear grid of (0.1, 1], more
    /// points in the upper decades; plus 0 and 1.
    #[default]
    Dynamic,
    /// `k / 127` (signed) or `k / 255` (unsigned).
    Linear,
}

/// A map's values and the midpoints between them (the decision bounds), both sorted
/// ascending, 256 entries each (the bounds' last entry is +inf, never read).
#[derive(Debug, Clone)]
pub struct MapTable {
    /// Code `c` stands for `values[c] · absmax`.
    pub values: [f32; 256],
    /// `bounds[c] = (values[c] + values[c + 1]) / 2`.
    pub bounds: [f32; 256],
}

impl MapTable {
    fn from_values(mut values: Vec<f64>) -> Self {
        assert_eq!(values.len(), 256, "a map has 256 values");
        values.sort_by(f64::total_cmp);
        let mut out = Self {
            values: [0.0; 256],
            bounds: [f32::INFINITY; 256],
        };
        for (c, v) in values.iter().enumerate() {
            out.values[c] = *v as f32;
        }
        for c in 0..255 {
            out.bounds[c] = ((values[c] + values[c + 1]) / 2.0) as f32;
        }
        out
    }

    /// The code of `x` (normalized): the number of bounds below it.
    pub fn encode(&self, x: f32) -> u8 {
        let mut code = 0usize;
        for bit in 0..8 {
            let candidate = code + (128 >> bit);
            if self.bounds[candidate - 1] < x {
                code = candidate;
            }
        }
        code as u8
    }
}

impl QuantMap {
    /// The signed (`true`: first moment) or unsigned (second moment's square root) table.
    pub fn table(self, signed: bool) -> &'static MapTable {
        static TABLES: OnceLock<[MapTable; 4]> = OnceLock::new();
        let tables = TABLES.get_or_init(|| {
            [
                MapTable::from_values(dynamic_map(true)),
                MapTable::from_values(dynamic_map(false)),
                MapTable::from_values(linear_map(true)),
                MapTable::from_values(linear_map(false)),
            ]
        });
        let index = match self {
            QuantMap::Dynamic => 0,
            QuantMap::Linear => 2,
        };
        &tables[index + usize::from(!signed)]
    }
}

/// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8)`.
fn dynamic_map(signed: bool) -> Vec<f64> {
    let mut data = Vec::with_capacity(256);
    for i in 0..7i32 {
        let items = if signed {
            1usize << i
        } else {
            1usize << (i + 1)
        };
        let scale = 10f64.powi(i - 6);
        for k in 0..items {
            // Midpoints of `items` equal intervals of [0.1, 1].
            let lo = 0.1 + 0.9 * k as f64 / items as f64;
            let hi = 0.1 + 0.9 * (k + 1) as f64 / items as f64;
            let mean = (lo + hi) / 2.0;
            data.push(scale * mean);
            if signed {
                data.push(-scale * mean);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    data
}

fn linear_map(signed: bool) -> Vec<f64> {
    if signed {
        (-128..128).map(|k| k as f64 / 127.0).collect()
    } else {
        (0..256).map(|k| k as f64 / 255.0).collect()
    }
}

/// One tensor's 8-bit state: `ceil(n / block)` blocks, each with its f32 absmax and `block`
/// codes (the last block padded with zeros), packed four to an `i32` word.
#[derive(Debug, Clone)]
pub struct QuantizedTensor<B: Backend> {
    /// `blocks · block / 4` words, i32.
    pub codes: Tensor<B, 1, Int>,
    /// `blocks` f32 absolute maxima.
    pub absmax: Tensor<B, 1>,
    /// Values per block.
    pub block: usize,
    /// The map the codes index.
    pub map: QuantMap,
}

impl<B: Backend> QuantizedTensor<B> {
    /// Bytes on the device.
    pub fn bytes(&self) -> u64 {
        (self.codes.shape().num_elements() * 4 + self.absmax.shape().num_elements() * 4) as u64
    }

    /// The number of blocks.
    pub fn blocks(&self) -> usize {
        self.absmax.shape().num_elements()
    }

    /// The state on `device`.
    pub fn to_device(self, device: &B::Device) -> Self {
        Self {
            codes: self.codes.to_device(device),
            absmax: self.absmax.to_device(device),
            ..self
        }
    }
}

/// A record item that keeps the bytes as they are: codes and block maxima must come back bit
/// for bit, whatever the recorder's precision settings (Burn's half-precision settings would
/// turn the i32 words into i16 and the maxima into f16).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QuantizedTensorItem {
    codes: TensorData,
    absmax: TensorData,
    block: usize,
    map: QuantMap,
}

impl<B: Backend> Record<B> for QuantizedTensor<B> {
    type Item<S: PrecisionSettings> = QuantizedTensorItem;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        QuantizedTensorItem {
            codes: self.codes.into_data(),
            absmax: self.absmax.into_data(),
            block: self.block,
            map: self.map,
        }
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, device: &B::Device) -> Self {
        Self {
            codes: crate::record::exact_from_data(item.codes, device),
            absmax: crate::record::exact_from_data(item.absmax, device),
            block: item.block,
            map: item.map,
        }
    }
}

/// Quantizes `x` (any shape, read as f32 in logical order) into blocks of `block`: the
/// burn-op reference of the kernels' encoder.
pub fn quantize<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    block: usize,
    map: QuantMap,
    signed: bool,
) -> QuantizedTensor<B> {
    use crate::grads::{primitive, tensor};
    let (codes, absmax) = fallback::quantize::<B>(primitive(x), block, map.table(signed));
    QuantizedTensor {
        codes: Tensor::from_primitive(codes),
        absmax: tensor(absmax),
        block,
        map,
    }
}

/// The f32 values of `q` (`numel` of them, flat): the burn-op reference of the decoder.
pub fn dequantize<B: Backend>(q: &QuantizedTensor<B>, numel: usize, signed: bool) -> Tensor<B, 1> {
    use crate::grads::{primitive, tensor};
    tensor(fallback::dequantize::<B>(
        q.codes.clone().into_primitive(),
        primitive(q.absmax.clone()),
        q.block,
        q.map.table(signed),
        numel,
    ))
}

/// Block quantization from burn ops.
pub mod fallback {
    use burn_backend::tensor::{FloatTensor, IntTensor};
    use burn_backend::{Backend, Scalar, TensorData, TensorMetadata, get_device_settings};
    use burn_std::{FloatDType, IntDType, Shape, Slice};

    use super::{CODES_PER_WORD, MapTable};
    use crate::scaler::kernels::fallback::{s, to_f32};

    fn int(v: i64) -> Scalar {
        Scalar::Int(v)
    }

    /// A 256-entry table on `device`.
    pub(crate) fn table<B: Backend>(values: &[f32; 256], device: &B::Device) -> FloatTensor<B> {
        B::float_from_data(TensorData::new(values.to_vec(), [256]), device)
    }

    /// `x` flattened to f32 `[blocks, block]`, zero-padded.
    fn blocks_of<B: Backend>(x: FloatTensor<B>, block: usize) -> FloatTensor<B> {
        let n = x.shape().num_elements();
        let blocks = n.div_ceil(block).max(1);
        let x = B::float_reshape(to_f32::<B>(x), Shape::new([n]));
        let x = if blocks * block > n {
            let pad = B::float_zeros(
                Shape::new([blocks * block - n]),
                &B::float_device(&x),
                FloatDType::F32,
            );
            B::float_cat(vec![x, pad], 0)
        } else {
            x
        };
        B::float_reshape(x, Shape::new([blocks, block]))
    }

    /// The codes (i32 words) and block maxima (f32 `[blocks]`) of `x`.
    pub fn quantize<B: Backend>(
        x: FloatTensor<B>,
        block: usize,
        map: &MapTable,
    ) -> (IntTensor<B>, FloatTensor<B>) {
        let device = B::float_device(&x);
        let bool_dtype = get_device_settings::<B>(&device).bool_dtype;
        let xb = blocks_of::<B>(x, block);
        let [blocks, _] = xb.shape().dims();
        let absmax = B::float_max_dim(B::float_abs(xb.clone()), 1);
        // `x / absmax`, 0 in an all-zero block (0 / 1).
        let is_zero = B::float_equal_elem(absmax.clone(), s(0.0), bool_dtype);
        let safe = B::float_mask_fill(absmax.clone(), is_zero, s(1.0));
        let norm = B::float_reshape(
            B::float_div(xb, B::float_expand(safe, Shape::new([blocks, block]))),
            Shape::new([blocks * block]),
        );
        // Binary search of the sorted bounds: the code is the number of bounds below x.
        let bounds = table::<B>(&map.bounds, &device);
        let n = blocks * block;
        let mut code = B::int_zeros(Shape::new([n]), &device, IntDType::I32);
        for bit in 0..8 {
            let candidate = B::int_add_scalar(code.clone(), int(128 >> bit));
            let bound = B::float_select(
                bounds.clone(),
                0,
                B::int_sub_scalar(candidate.clone(), int(1)),
            );
            let below = B::float_lower(bound, norm.clone(), bool_dtype);
            code = B::int_mask_where(code, below, candidate);
        }
        let words = n / CODES_PER_WORD;
        let code = B::int_reshape(code, Shape::new([words, CODES_PER_WORD]));
        let mut packed = B::int_zeros(Shape::new([words, 1]), &device, IntDType::I32);
        for j in 0..CODES_PER_WORD {
            let column = B::int_slice(
                code.clone(),
                &[Slice::from(0..words), Slice::from(j..j + 1)],
            );
            packed = B::bitwise_or(
                packed,
                B::bitwise_left_shift_scalar(column, int(8 * j as i64)),
            );
        }
        (
            B::int_reshape(packed, Shape::new([words])),
            B::float_reshape(absmax, Shape::new([blocks])),
        )
    }

    /// The f32 values (`[numel]`) of codes `words` with block maxima `absmax`.
    pub fn dequantize<B: Backend>(
        words: IntTensor<B>,
        absmax: FloatTensor<B>,
        block: usize,
        map: &MapTable,
        numel: usize,
    ) -> FloatTensor<B> {
        let device = B::float_device(&absmax);
        let w = words.shape().num_elements();
        let blocks = absmax.shape().num_elements();
        let words = B::int_reshape(words, Shape::new([w, 1]));
        let columns = (0..CODES_PER_WORD)
            .map(|j| {
                let shifted = B::bitwise_right_shift_scalar(words.clone(), int(8 * j as i64));
                B::bitwise_and_scalar(shifted, int(255))
            })
            .collect();
        let codes = B::int_reshape(B::int_cat(columns, 1), Shape::new([w * CODES_PER_WORD]));
        let values = B::float_select(table::<B>(&map.values, &device), 0, codes);
        let values = B::float_reshape(values, Shape::new([blocks, block]));
        let absmax = B::float_reshape(to_f32::<B>(absmax), Shape::new([blocks, 1]));
        let values = B::float_mul(values, B::float_expand(absmax, Shape::new([blocks, block])));
        let flat = B::float_reshape(values, Shape::new([blocks * block]));
        if numel == blocks * block {
            flat
        } else {
            B::float_slice(flat, &[Slice::from(0..numel)])
        }
    }
}
