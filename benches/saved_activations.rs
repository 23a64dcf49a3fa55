//! What a forward keeps for its backward under autocast, against f32, on three models where
//! half precision kept more than it needs before burn-amp's node-level tools:
//!
//! - burn-nn's `Lstm` applies its gates' `Linear`s at every timestep: each use cast the
//!   weights again and autodiff saved every copy (the cast cache, parameters); each timestep's
//!   input and hidden state were cast once per gate (the cast cache, activations);
//! - a Llama MLP block (`RmsNorm`, burn-nn's `SwiGlu`, a down `Linear`, a residual): SiLU is
//!   `x * sigmoid(x)` with `sigmoid` in f32, and autodiff saved the f32 copies of the half
//!   activations those ops widened (recomputed widening casts, `backend::upcast`); the normed
//!   input was cast once per linear of `SwiGlu`;
//! - burn-nn's pre-norm `TransformerEncoder`: the normed input was cast once per projection
//!   (query, key, value); softmax (Burn's composition) kept its shifted input and its
//!   exponentials in f32, 8 bytes per attention weight (recomputed outputs).
//!
//! SiLU's `sigmoid(x)` and `SwiGlu`'s `silu(x)` were also kept in f32 by the products that use
//! them, and an `Lstm`'s gates likewise (recomputed outputs, `backend::recompute`).
//!
//! Side by side in one run, per backend: f32; half precision as before the tools (a cast per
//! use, widened copies kept); with the parameter cache; with recomputed widening too; with
//! shared activation casts too; with recomputed outputs too (the default). The bytes one
//! forward keeps, and the median time of a forward and backward; then one JSON line.
//!
//! Flex: exact bytes (the counting allocator), bf16 (its default). Wgpu (lavapipe): CubeCL's
//! allocator, f16.

#[path = "common/mode.rs"]
mod mode;
#[path = "common/report.rs"]
mod report;

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderInput};
use burn::nn::{
    Linear, LinearConfig, Lstm, LstmConfig, RmsNorm, RmsNormConfig, SwiGlu, SwiGluConfig,
};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::backend::{cast_cache, recompute, upcast};
use burn_amp::memory::{CountingAlloc, DeviceMemory, parameter_bytes};
use burn_amp::{Amp, Precision, autocast};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

#[derive(Clone, Copy)]
enum Model {
    /// hidden, timesteps, batch
    Lstm(usize, usize, usize),
    /// d_model, d_ff, layers, tokens
    LlamaMlp(usize, usize, usize, usize),
    /// d_model, heads, layers, batch, seq (d_ff 4 d_model, pre-norm, GELU, no dropout)
    Transformer(usize, usize, usize, usize, usize),
}

impl Model {
    fn describe(self) -> String {
        match self {
            Model::Lstm(hidden, seq, batch) => {
                format!("Lstm hidden {hidden}, seq {seq}, batch {batch}")
            }
            Model::LlamaMlp(d, ff, layers, tokens) => {
                format!("Llama MLP d_model {d}, d_ff {ff}, {layers} layers, {tokens} tokens")
            }
            Model::Transformer(d, heads, layers, batch, seq) => format!(
                "pre-norm Transformer d_model {d}, {heads} heads, d_ff {}, {layers} layers, batch {batch}, seq {seq}",
                4 * d
            ),
        }
    }

    fn key(self) -> &'static str {
        match self {
            Model::Lstm(..) => "lstm",
            Model::LlamaMlp(..) => "llama_mlp",
            Model::Transformer(..) => "transformer",
        }
    }
}

/// Pre-norm MLP blocks of a Llama: `x + down(silu(gate(norm(x))) * up(norm(x)))`.
#[derive(Module, Debug)]
struct LlamaMlp<B: Backend> {
    norms: Vec<RmsNorm<B>>,
    swiglus: Vec<SwiGlu<B>>,
    downs: Vec<Linear<B>>,
}

impl<B: Backend> LlamaMlp<B> {
    fn new(d: usize, ff: usize, layers: usize, device: &B::Device) -> Self {
        Self {
            norms: (0..layers)
                .map(|_| RmsNormConfig::new(d).init(device))
                .collect(),
            swiglus: (0..layers)
                .map(|_| SwiGluConfig::new(d, ff).init(device))
                .collect(),
            downs: (0..layers)
                .map(|_| LinearConfig::new(ff, d).init(device))
                .collect(),
        }
    }

    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for ((norm, swiglu), down) in self.norms.iter().zip(&self.swiglus).zip(&self.downs) {
            x = x.clone() + down.forward(swiglu.forward(norm.forward(x)));
        }
        x
    }
}

/// What is on, in half precision.
#[derive(Clone, Copy)]
struct Tools {
    cache: bool,
    recompute: bool,
    activations: bool,
    outputs: bool,
}

/// One configuration's figures: bytes kept by a forward, median time of a forward and backward.
#[derive(Clone, Copy)]
struct Figures {
    kept: u64,
    step: Duration,
}

fn measure<B: AutodiffBackend>(
    model: Model,
    iters: usize,
    precision: Precision,
    tools: Tools,
    in_use: impl Fn(&B::Device) -> u64,
) -> Figures {
    let device = Default::default();
    let _autocast = autocast(precision);
    let cache = cast_cache::set_enabled(tools.cache);
    let recompute = upcast::set_enabled(tools.recompute);
    let activations = cast_cache::set_activations_enabled(tools.activations);
    let outputs = recompute::set_enabled(tools.outputs);
    B::seed(&device, 1);
    let loss: Box<dyn Fn() -> Tensor<B, 1>> = match model {
        Model::Lstm(hidden, seq, batch) => {
            let lstm: Lstm<B> = LstmConfig::new(hidden, hidden, true).init(&device);
            let _ = parameter_bytes::<B, _>(&lstm); // materialise the lazy parameters
            let x = Tensor::<B, 3>::random([batch, seq, hidden], Distribution::Default, &device);
            Box::new(move || lstm.forward(x.clone(), None).0.mean())
        }
        Model::LlamaMlp(d, ff, layers, tokens) => {
            let mlp = LlamaMlp::<B>::new(d, ff, layers, &device);
            let _ = parameter_bytes::<B, _>(&mlp);
            let x = Tensor::<B, 2>::random([tokens, d], Distribution::Default, &device);
            Box::new(move || mlp.forward(x.clone()).mean())
        }
        Model::Transformer(d, heads, layers, batch, seq) => {
            let encoder = TransformerEncoderConfig::new(d, 4 * d, heads, layers)
                .with_norm_first(true)
                .with_dropout(0.0)
                .init::<B>(&device);
            let _ = parameter_bytes::<B, _>(&encoder);
            let x = Tensor::<B, 3>::random([batch, seq, d], Distribution::Default, &device);
            Box::new(move || {
                encoder
                    .forward(TransformerEncoderInput::new(x.clone()))
                    .mean()
            })
        }
    };
    let step = || {
        let _ = loss().backward();
        B::sync(&device).unwrap();
    };
    step(); // kernels, first allocations
    let before = in_use(&device);
    let kept_loss = loss();
    let kept = in_use(&device).saturating_sub(before);
    let _ = kept_loss.backward();
    let mut times: Vec<Duration> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            step();
            start.elapsed()
        })
        .collect();
    times.sort();
    cast_cache::set_enabled(cache);
    upcast::set_enabled(recompute);
    cast_cache::set_activations_enabled(activations);
    recompute::set_enabled(outputs);
    Figures {
        kept,
        step: times[times.len() / 2],
    }
}

/// f32; half before the tools; half with each tool added in turn (all: the default). On a
/// thread of its own each (CubeCL counts memory per thread's stream; autocast is per thread).
fn backend<B: AutodiffBackend>(
    model: Model,
    iters: usize,
    half: Precision,
    in_use: fn(&B::Device) -> u64,
) -> [Figures; 6] {
    let run = move |precision, cache, recompute, activations, outputs| {
        let tools = Tools {
            cache,
            recompute,
            activations,
            outputs,
        };
        std::thread::spawn(move || measure::<B>(model, iters, precision, tools, in_use))
            .join()
            .unwrap()
    };
    [
        run(Precision::F32, true, true, true, true),
        run(half, false, false, false, false),
        run(half, true, false, false, false),
        run(half, true, true, false, false),
        run(half, true, true, true, false),
        run(half, true, true, true, true),
    ]
}

fn main() {
    mode::ensure_runtime_dir();
    let quick = mode::quick();
    let (models, iters) = if quick {
        (
            [
                Model::Lstm(32, 8, 2),
                Model::LlamaMlp(32, 88, 2, 16),
                Model::Transformer(32, 2, 1, 2, 8),
            ],
            1,
        )
    } else {
        (
            [
                Model::Lstm(256, 64, 16),
                Model::LlamaMlp(256, 704, 4, 1024),
                Model::Transformer(256, 4, 2, 8, 128),
            ],
            5,
        )
    };
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "Bytes one forward keeps for its backward; median of {iters} forward+backward. Half: before = cast per use, widened copies and outputs kept; + cache = parameter casts cached; + recompute = widening casts recomputed; + shared = activation casts shared; + outputs = elementwise and softmax outputs recomputed (the default)."
    );
    println!(
        "| model | backend | f32 | half, before | + cache | + recompute | + shared | + outputs | default / f32 | default / before | step f32 | step before | step shared | step default | default / before time | default / shared time |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut json = Vec::new();
    for model in models {
        let flex = backend::<Amp<Autodiff<Flex>>>(model, iters, Precision::Bf16, |_| {
            CountingAlloc::bytes_in_use().unwrap()
        });
        let wgpu = backend::<Amp<Autodiff<Wgpu>>>(model, iters, Precision::F16, |device| {
            Amp::<Autodiff<Wgpu>>::memory_snapshot(device)
                .unwrap()
                .bytes_in_use
        });
        for (name, [f32, before, cached, recomputed, shared, all]) in
            [("Flex (bf16)", flex), ("Wgpu (f16)", wgpu)]
        {
            let over_f32 = all.kept as f64 / f32.kept as f64;
            let over_before = all.kept as f64 / before.kept as f64;
            let time = all.step.as_secs_f64() / before.step.as_secs_f64();
            let time_outputs = all.step.as_secs_f64() / shared.step.as_secs_f64();
            println!(
                "| {} | {name} | {:.2} MiB | {:.2} MiB | {:.2} MiB | {:.2} MiB | {:.2} MiB | {:.2} MiB | {over_f32:.3} | {over_before:.3} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {time:.3} | {time_outputs:.3} |",
                model.describe(),
                mib(f32.kept),
                mib(before.kept),
                mib(cached.kept),
                mib(recomputed.kept),
                mib(shared.kept),
                mib(all.kept),
                ms(f32.step),
                ms(before.step),
                ms(shared.step),
                ms(all.step),
            );
            let key = format!(
                "{}_{}",
                model.key(),
                name.split(' ').next().unwrap().to_lowercase()
            );
            json.push(format!(
                "\"{key}_kept_f32\":{},\"{key}_kept_before\":{},\"{key}_kept_cached\":{},\"{key}_kept_recomputed\":{},\"{key}_kept_shared\":{},\"{key}_kept_default\":{},\"{key}_kept_default_over_f32\":{over_f32:.4},\"{key}_kept_default_over_before\":{over_before:.4},\"{key}_step_default_over_before\":{time:.4},\"{key}_step_default_over_shared\":{time_outputs:.4}",
                f32.kept, before.kept, cached.kept, recomputed.kept, shared.kept, all.kept
            ));
        }
    }
    let sizes: Vec<String> = models
        .iter()
        .map(|m| format!("\"{}\"", m.describe()))
        .collect();
    report::emit(&format!(
        "{{\"bench\":\"saved_activations\",\"models\":[{}],\"iterations\":{iters},{}}}",
        sizes.join(","),
        json.join(",")
    ));
}
