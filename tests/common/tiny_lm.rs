//! A small transformer and a learnable synthetic task, shared by the examples, benches and
//! tests. The model is ordinary burn-nn code, written once over any backend: burn-amp needs
//! nothing from it.

use burn::module::Module;
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Gelu, LayerNorm, LayerNormConfig, Linear,
    LinearConfig, PaddingConfig2d,
};
use burn::prelude::*;

/// Sizes of [`TinyLm`].
#[derive(Config, Debug)]
pub struct TinyLmConfig {
    /// Number of distinct tokens.
    #[config(default = 16)]
    pub vocab: usize,
    /// Sequence length.
    #[config(default = 8)]
    pub seq_len: usize,
    /// Model width.
    #[config(default = 32)]
    pub d_model: usize,
    /// Attention heads.
    #[config(default = 4)]
    pub n_heads: usize,
    /// Transformer blocks.
    #[config(default = 2)]
    pub n_layers: usize,
    /// Width of the feed-forward layer.
    #[config(default = 64)]
    pub d_ff: usize,
    /// Dropout probability.
    #[config(default = 0.1)]
    pub dropout: f64,
}

/// One pre-norm transformer block: attention then a GELU feed-forward, each residual.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    norm_attn: LayerNorm<B>,
    attn: MultiHeadAttention<B>,
    norm_ff: LayerNorm<B>,
    ff_in: Linear<B>,
    ff_out: Linear<B>,
    act: Gelu,
    dropout: Dropout,
}

impl<B: Backend> Block<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = self.norm_attn.forward(x.clone());
        let x = x + self
            .dropout
            .forward(self.attn.forward(MhaInput::self_attn(h)).context);
        let h = self.ff_in.forward(self.norm_ff.forward(x.clone()));
        let h = self
            .ff_out
            .forward(self.dropout.forward(self.act.forward(h)));
        x + self.dropout.forward(h)
    }
}

/// A token model: embeddings, a 3×3 convolution over (position, feature), transformer
/// blocks, a norm and a linear head. Uses `Linear`, `Conv2d`, `Embedding`, `LayerNorm`,
/// `MultiHeadAttention`, `Dropout` and `Gelu`; trained with `CrossEntropyLoss`.
#[derive(Module, Debug)]
pub struct TinyLm<B: Backend> {
    /// Token embeddings (a natural part to freeze).
    pub tokens: Embedding<B>,
    /// Position embeddings.
    pub positions: Embedding<B>,
    conv: Conv2d<B>,
    blocks: Vec<Block<B>>,
    norm: LayerNorm<B>,
    /// The output projection.
    pub head: Linear<B>,
}

impl TinyLmConfig {
    /// Builds the model on `device`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> TinyLm<B> {
        let block = || Block {
            norm_attn: LayerNormConfig::new(self.d_model).init(device),
            attn: MultiHeadAttentionConfig::new(self.d_model, self.n_heads)
                .with_dropout(self.dropout)
                .init(device),
            norm_ff: LayerNormConfig::new(self.d_model).init(device),
            ff_in: LinearConfig::new(self.d_model, self.d_ff).init(device),
            ff_out: LinearConfig::new(self.d_ff, self.d_model).init(device),
            act: Gelu::new(),
            dropout: DropoutConfig::new(self.dropout).init(),
        };
        TinyLm {
            tokens: EmbeddingConfig::new(self.vocab, self.d_model).init(device),
            positions: EmbeddingConfig::new(self.seq_len, self.d_model).init(device),
            conv: Conv2dConfig::new([1, 1], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device),
            blocks: (0..self.n_layers).map(|_| block()).collect(),
            norm: LayerNormConfig::new(self.d_model).init(device),
            head: LinearConfig::new(self.d_model, self.vocab).init(device),
        }
    }
}

impl<B: Backend> TinyLm<B> {
    /// Logits `[batch, seq, vocab]` for tokens `[batch, seq]`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &device)
            .reshape([1, seq])
            .repeat_dim(0, batch);
        let x = self.tokens.forward(tokens) + self.positions.forward(positions);
        let [_, _, d] = x.dims();
        let local = self.conv.forward(x.clone().reshape([batch, 1, seq, d]));
        let mut x = x + local.reshape([batch, seq, d]);
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.head.forward(self.norm.forward(x))
    }

    /// Mean cross-entropy over every position.
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let logits = self.forward(tokens);
        let [batch, seq, vocab] = logits.dims();
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(
                logits.reshape([batch * seq, vocab]),
                targets.reshape([batch * seq]),
            )
    }

    /// Fraction of positions predicted right.
    pub fn accuracy(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> f32 {
        let [batch, seq] = targets.dims();
        let predicted = self.forward(tokens).argmax(2).squeeze_dim::<2>(2);
        let right = predicted
            .equal(targets)
            .int()
            .sum()
            .into_scalar()
            .elem::<f32>();
        right / (batch * seq) as f32
    }
}

/// Sequence reversal: the target at position i is the input token at position `len-1-i`.
/// Learnable only by attending across the sequence; made from a seeded generator, so every
/// backend and precision sees the same batches.
#[derive(Debug, Clone)]
pub struct ReversalTask {
    state: u64,
    /// Number of distinct tokens.
    pub vocab: usize,
    /// Sequence length.
    pub seq_len: usize,
}

impl ReversalTask {
    /// A task whose batches are fixed by `seed`.
    pub fn new(vocab: usize, seq_len: usize, seed: u64) -> Self {
        Self {
            state: seed ^ 0x9E37_79B9_7F4A_7C15,
            vocab,
            seq_len,
        }
    }

    fn next(&mut self) -> u64 {
        // SplitMix64: small, fast, good enough for synthetic data.
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The next batch of `(tokens, targets)`, both `[batch, seq_len]`.
    pub fn batch<B: Backend>(
        &mut self,
        batch: usize,
        device: &B::Device,
    ) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        let n = self.seq_len;
        let tokens: Vec<i64> = (0..batch * n)
            .map(|_| (self.next() % self.vocab as u64) as i64)
            .collect();
        let targets: Vec<i64> = (0..batch * n)
            .map(|i| tokens[(i / n) * n + (n - 1 - i % n)])
            .collect();
        (
            Tensor::from_data(TensorData::new(tokens, [batch, n]), device),
            Tensor::from_data(TensorData::new(targets, [batch, n]), device),
        )
    }
}
