//! The backward of `rfft` and `irfft`, which burn-autodiff 0.21 lacks
//! (`todo!("rfft not yet supported for autodiff")`): a model with a spectral layer (FNet's
//! token mixing, a Fourier neural operator, an FFT convolution) cannot train in Burn.
//!
//! Both are linear, so each backward is the other transform, weighted per frequency bin.
//! With `N` the transform's length and `M = N/2 + 1` its bins, `rfft` gives
//! `re_k = Σ_j x_j cos(2πkj/N)` and `im_k = -Σ_j x_j sin(2πkj/N)`; their adjoints are
//! `Σ_k g_k cos(2πkj/N)` and `-Σ_k g_k sin(2πkj/N)`, which is `N · irfft(w ⊙ g)` with
//! `w = 1` at the first and the Nyquist bin and `1/2` between (`irfft` counts the bins between
//! twice, for their conjugates). `irfft` gives `y_j = (1/N) Σ_k c_k (re_k cos - im_k sin)`,
//! `c = 1` at both ends and `2` between (the imaginary parts of the end bins do not count, as
//! in NumPy and PyTorch); its adjoint is `c/N ⊙ rfft(g)`, zero for those imaginary parts. Where
//! the signal was truncated or padded to `N` (`n`), or the spectrum to `M` bins, the gradient
//! is padded or truncated back. The nodes keep no tensor: the backward needs shapes only.
//!
//! `rfft`'s two outputs are two nodes over the one input (autodiff's nodes have one output),
//! from one forward call; each backward is one `irfft`. The policy runs both in f32.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorData, TensorMetadata};
use burn_std::{DType, Shape, Slice};

use crate::backend::concrete::{AutodiffTensor, Visit, dispatch, moved};

/// `B`'s `rfft`; under autodiff, two nodes (real and imaginary part) with their backward.
pub(crate) fn rfft<B: Backend>(
    signal: FloatTensor<B>,
    dim: usize,
    n: Option<usize>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    struct Call<P> {
        signal: P,
        dim: usize,
        n: Option<usize>,
    }
    impl<P: 'static> Visit for Call<P> {
        type Out = (P, P);
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> (P, P) {
            let (re, im) = rfft_nodes::<X, C>(moved(self.signal), self.dim, self.n);
            (moved(re), moved(im))
        }
    }
    if n.unwrap_or(signal.shape()[dim]) == 1 {
        // A length-1 transform is the identity (CubeCL's kernel refuses it): `re = x_0`, `im = 0`.
        let re = fitted::<B>(signal, dim, 1);
        let im = B::float_zeros(re.shape(), &B::float_device(&re), re.dtype().into());
        return (re, im);
    }
    match dispatch::<B, _>(Call { signal, dim, n }) {
        Ok(out) => out,
        Err(call) => B::rfft(call.signal, call.dim, call.n),
    }
}

/// `B`'s `irfft`; under autodiff, one node over both parts of the spectrum.
pub(crate) fn irfft<B: Backend>(
    spectrum_re: FloatTensor<B>,
    spectrum_im: FloatTensor<B>,
    dim: usize,
    n: Option<usize>,
) -> FloatTensor<B> {
    struct Call<P> {
        re: P,
        im: P,
        dim: usize,
        n: Option<usize>,
    }
    impl<P: 'static> Visit for Call<P> {
        type Out = P;
        fn visit<X: Backend, C: CheckpointStrategy>(self) -> P {
            moved(irfft_node::<X, C>(
                moved(self.re),
                moved(self.im),
                self.dim,
                self.n,
            ))
        }
    }
    let bins = spectrum_re.shape()[dim];
    assert!(
        n.is_some() || bins > 1,
        "irfft: a spectrum of {bins} bin along dim {dim} gives a signal of length 0 \
         (2 · (bins - 1)); pass n = Some(1) for a length-1 signal"
    );
    if n == Some(1) {
        // `x_0 = re_0`, like the forward's length 1 (CubeCL's kernel refuses it).
        return fitted::<B>(spectrum_re, dim, 1);
    }
    let call = Call {
        re: spectrum_re,
        im: spectrum_im,
        dim,
        n,
    };
    match dispatch::<B, _>(call) {
        Ok(out) => out,
        Err(call) => B::irfft(call.re, call.im, call.dim, call.n),
    }
}

fn rfft_nodes<X: Backend, C: CheckpointStrategy>(
    x: AutodiffTensor<X>,
    dim: usize,
    n: Option<usize>,
) -> (AutodiffTensor<X>, AutodiffTensor<X>) {
    let length = x.primitive.shape()[dim];
    let (re, im) = X::rfft(x.primitive, dim, n);
    let state = RfftState {
        dim,
        length,
        bins: re.shape()[dim],
    };
    let node = |part: Part, out: FloatTensor<X>| match RfftBackward(part)
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(state, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    (node(Part::Re, re), node(Part::Im, im))
}

fn irfft_node<X: Backend, C: CheckpointStrategy>(
    re: AutodiffTensor<X>,
    im: AutodiffTensor<X>,
    dim: usize,
    n: Option<usize>,
) -> AutodiffTensor<X> {
    let bins = re.primitive.shape()[dim];
    let out = X::irfft(re.primitive, im.primitive, dim, n);
    match IrfftBackward
        .prepare::<C>([re.node, im.node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((dim, bins), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

#[derive(Debug, Clone, Copy)]
enum Part {
    Re,
    Im,
}

#[derive(Debug, Clone, Copy)]
struct RfftState {
    dim: usize,
    /// The input's length along `dim` (before `n` truncated or padded it).
    length: usize,
    /// `M`, the output's bins along `dim`.
    bins: usize,
}

/// The backward of one part of `rfft`'s output.
#[derive(Debug)]
struct RfftBackward(Part);

impl<X: Backend> Backward<X, 1> for RfftBackward {
    type State = RfftState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let RfftState { dim, length, bins } = ops.state;
        let part = self.0;
        unary::<X, _>(ops.parents, ops.node, grads, |g| {
            let size = transform_size(bins);
            // N · w: N at the end bins, N/2 between.
            let w = bin_weights::<X>(&g, dim, bins, |end| {
                if end { size as f32 } else { size as f32 / 2.0 }
            });
            let weighted = X::float_mul(g, w);
            let zeros = X::float_zeros(
                weighted.shape(),
                &X::float_device(&weighted),
                weighted.dtype().into(),
            );
            let x = match part {
                Part::Re => X::irfft(weighted, zeros, dim, Some(size)),
                Part::Im => X::irfft(zeros, weighted, dim, Some(size)),
            };
            fitted::<X>(x, dim, length)
        });
    }
}

/// The backward of `irfft`: one `rfft` of the gradient, for both parts of the spectrum.
#[derive(Debug)]
struct IrfftBackward;

impl<X: Backend> Backward<X, 2> for IrfftBackward {
    /// `dim`, and the spectrum's bins along it (before `n` truncated or padded them).
    type State = (usize, usize);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (dim, bins) = ops.state;
        let [re_node, im_node] = ops.parents;
        let g = grads.consume::<X>(&ops.node);
        if re_node.is_none() && im_node.is_none() {
            return;
        }
        let size = g.shape()[dim] as f32;
        let (re, im) = X::rfft(g, dim, None);
        let used = re.shape()[dim];
        if let Some(node) = re_node {
            let c = bin_weights::<X>(
                &re,
                dim,
                used,
                |end| {
                    if end { 1.0 / size } else { 2.0 / size }
                },
            );
            grads.register::<X>(node.id, fitted::<X>(X::float_mul(re, c), dim, bins));
        }
        if let Some(node) = im_node {
            let c = bin_weights::<X>(&im, dim, used, |end| if end { 0.0 } else { 2.0 / size });
            grads.register::<X>(node.id, fitted::<X>(X::float_mul(im, c), dim, bins));
        }
    }
}

/// `N` from `M = N/2 + 1` bins (one bin: a transform of length 1).
fn transform_size(bins: usize) -> usize {
    if bins <= 1 { 1 } else { 2 * (bins - 1) }
}

/// A weight per bin along `dim` (`weight(true)` at the first and the last of `bins`,
/// `weight(false)` between), shaped to broadcast against `like`, in its dtype.
fn bin_weights<X: Backend>(
    like: &FloatTensor<X>,
    dim: usize,
    bins: usize,
    weight: impl Fn(bool) -> f32,
) -> FloatTensor<X> {
    let values: Vec<f32> = (0..bins).map(|k| weight(k == 0 || k + 1 == bins)).collect();
    let mut shape = vec![1; like.shape().num_dims()];
    shape[dim] = bins;
    let weights = X::float_from_data(TensorData::new(values, shape), &X::float_device(like));
    match like.dtype() {
        DType::F32 => weights,
        other => X::float_cast(weights, other.into()),
    }
}

/// `tensor` truncated or zero-padded along `dim` to `length`.
fn fitted<X: Backend>(tensor: FloatTensor<X>, dim: usize, length: usize) -> FloatTensor<X> {
    let shape = tensor.shape();
    let current = shape[dim];
    if current > length {
        let slices: Vec<Slice> = (0..shape.num_dims())
            .map(|d| Slice::from(0..if d == dim { length } else { shape[d] }))
            .collect();
        X::float_slice(tensor, &slices)
    } else if current < length {
        let mut padding = shape.clone();
        padding[dim] = length - current;
        let zeros = X::float_zeros(
            Shape::from(padding.as_slice().to_vec()),
            &X::float_device(&tensor),
            tensor.dtype().into(),
        );
        X::float_cat(vec![tensor, zeros], dim)
    } else {
        tensor
    }
}
