//! A plain burn-train program: a dataset of blobs, its batcher, a classifier with burn-train's
//! step traits. Nothing of burn-amp here.

use super::*;

#[derive(Debug, Clone)]
pub struct Sample {
    x: [f32; D_IN],
    y: i64,
    poison: bool,
}

/// Four Gaussian-ish blobs, deterministic; the samples of the batches in `poison` carry a NaN.
pub struct Blobs(Vec<Sample>);

impl Blobs {
    pub fn new(n: usize, seed: u64, poisoned_batches: &[usize]) -> Self {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut uniform = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let samples = (0..n)
            .map(|i| {
                let y = (i % CLASSES) as i64;
                let mut x = [0.0; D_IN];
                for (d, v) in x.iter_mut().enumerate() {
                    let centre = if d % CLASSES == y as usize { 1.5 } else { 0.0 };
                    *v = centre + uniform();
                }
                Sample {
                    x,
                    y,
                    poison: poisoned_batches.contains(&(i / BATCH)),
                }
            })
            .collect();
        Self(samples)
    }
}

impl Dataset<Sample> for Blobs {
    fn get(&self, index: usize) -> Option<Sample> {
        self.0.get(index).cloned()
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

#[derive(Debug, Clone)]
pub struct BlobBatch<B: Backend> {
    x: Tensor<B, 2>,
    y: Tensor<B, 1, Int>,
}

#[derive(Debug, Clone, Default)]
pub struct BlobBatcher;

impl<B: Backend> Batcher<B, Sample, BlobBatch<B>> for BlobBatcher {
    fn batch(&self, items: Vec<Sample>, device: &B::Device) -> BlobBatch<B> {
        let n = items.len();
        let x: Vec<f32> = items
            .iter()
            .flat_map(|s| {
                let mut x = s.x;
                if s.poison {
                    x[0] = f32::NAN;
                }
                x
            })
            .collect();
        let y: Vec<i64> = items.iter().map(|s| s.y).collect();
        BlobBatch {
            x: Tensor::from_data(TensorData::new(x, [n, D_IN]), device),
            y: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

#[derive(Module, Debug)]
pub struct Classifier<B: Backend> {
    pub mlp: Mlp<B>,
}

impl<B: Backend> Classifier<B> {
    fn forward_classification(&self, batch: BlobBatch<B>) -> ClassificationOutput<B> {
        let logits = self.mlp.forward(batch.x).cast(DType::F32);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.y.clone());
        ClassificationOutput::new(loss, logits, batch.y)
    }
}

impl<B: AutodiffBackend> TrainStep for Classifier<B> {
    type Input = BlobBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: BlobBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.forward_classification(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Classifier<B> {
    type Input = BlobBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: BlobBatch<B>) -> ClassificationOutput<B> {
        self.forward_classification(batch)
    }
}
