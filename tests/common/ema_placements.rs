//! A weight average's placements side by side, for the low_bit bench (lavapipe) and the GPU
//! check: an f16 model of `layers` layers of `width × width`, its f32 average on the device
//! (without and with an overflow flag, as after an f16 step), in host memory, and in host
//! memory every 10th step. Per placement, the device bytes the average keeps and its time per
//! optimizer step (10 steps, each waited for, as a training loop's loss read waits),
//! alternating, median of `rounds`.

use std::time::Instant;

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_amp::{EmaConfig, EmaPlacement, MemorySaving, ModelEma};
use burn_std::FloatDType;

/// The model averaged.
#[derive(Module, Debug)]
pub struct Stack<B: Backend> {
    layers: Vec<Linear<B>>,
}

/// One placement's figures.
pub struct Placement {
    pub name: &'static str,
    pub placement: EmaPlacement,
    pub every: usize,
    pub flagged: bool,
    pub ms_per_step: f64,
    pub device_bytes: u64,
}

/// The bytes of the model's f16 weights.
pub fn weight_bytes(width: usize, layers: usize) -> u64 {
    (layers * (width * width + width) * 2) as u64
}

/// Measures the four placements; `in_use` reads the device's bytes in use (0 where the
/// backend has no figure).
pub fn measure<B: AutodiffBackend>(
    device: &B::Device,
    width: usize,
    layers: usize,
    rounds: usize,
    in_use: impl Fn() -> u64,
) -> Vec<Placement> {
    let model = Stack::<B> {
        layers: (0..layers)
            .map(|_| LinearConfig::new(width, width).init(device))
            .collect(),
    };
    let model = MemorySaving::new()
        .with_weights(FloatDType::F16)
        .prepare(model);
    let sync = || B::InnerBackend::sync(device).expect("device alive");
    let cases = [
        ("device, every step", EmaPlacement::Device, 1, false),
        (
            "device, every step, overflow flag",
            EmaPlacement::Device,
            1,
            true,
        ),
        ("host, every step", EmaPlacement::Host, 1, false),
        ("host, every 10th step", EmaPlacement::Host, 10, false),
    ];
    let flag = Tensor::<B::InnerBackend, 1>::zeros([1], device);
    let mut kept = Vec::new();
    let mut averages = Vec::new();
    for (_, placement, every, _) in cases {
        sync();
        let before = in_use();
        let config = EmaConfig::new()
            .with_decay(0.999)
            .with_update_every(every)
            .with_placement(placement);
        let mut ema = ModelEma::<B, _>::new(&model, config).expect("a valid config");
        ema.update(&model).expect("the same model");
        sync();
        kept.push(in_use().saturating_sub(before));
        averages.push(ema);
    }
    let mut times = vec![Vec::new(); cases.len()];
    for round in 0..rounds + 1 {
        for (i, ema) in averages.iter_mut().enumerate() {
            let flagged = cases[i].3;
            sync();
            let start = Instant::now();
            for _ in 0..10 {
                let found_inf = flagged.then(|| flag.clone());
                ema.update_unless(&model, found_inf)
                    .expect("the same model");
                sync();
            }
            if round >= 1 {
                times[i].push(start.elapsed() / 10);
            }
        }
    }
    cases
        .iter()
        .zip(times)
        .zip(kept)
        .map(
            |(((name, placement, every, flagged), t), device_bytes)| Placement {
                name,
                placement: *placement,
                every: *every,
                flagged: *flagged,
                ms_per_step: super::median(t).as_secs_f64() * 1e3,
                device_bytes,
            },
        )
        .collect()
}
