//! Runs one float op through `Amp<B>` under autocast and through `B` in f32, then checks
//! the output dtype the policy promises and the values against the f32 reference; or, in
//! [`Harness::against_flex`], through `Amp<B>` with autocast off against the same op on Flex.

use std::collections::BTreeSet;

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn_amp::backend::{Category, Op};
use burn_amp::{Amp, Precision, autocast};
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorData, TensorMetadata, read_sync};
use burn_std::{DType, FloatDType};

/// Tolerances of a comparison against the f32 reference: `|x - r| <= atol + rtol * |r|`.
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    pub atol: f32,
    pub rtol: f32,
}

impl Tolerance {
    /// An op computed in f32 on the same (already rounded) inputs as the reference.
    pub const F32: Tolerance = Tolerance {
        atol: 1e-5,
        rtol: 1e-4,
    };
    /// WGSL's inverse trigonometric functions: 4096 ULP (2^-11 relative), by specification.
    pub const WGSL_INVERSE_TRIGONOMETRY: Tolerance = Tolerance {
        atol: 1e-5,
        rtol: 5e-4,
    };
    /// An f32 matmul in TF32 (10-bit mantissa products, f32 sums).
    pub const TF32: Tolerance = Tolerance {
        atol: 1e-4,
        rtol: 2e-3,
    };
    /// An op computed in f16: 11-bit mantissa, a few roundings on small inputs.
    pub const F16: Tolerance = Tolerance {
        atol: 1e-2,
        rtol: 1e-2,
    };
    /// An op computed in bf16: 8-bit mantissa.
    pub const BF16: Tolerance = Tolerance {
        atol: 5e-2,
        rtol: 5e-2,
    };

    pub fn of(dtype: FloatDType) -> Tolerance {
        match dtype {
            FloatDType::F16 => Self::F16,
            FloatDType::BF16 => Self::BF16,
            _ => Self::F32,
        }
    }
}

/// What one exercise expects beyond the defaults of its category.
#[derive(Debug, Clone, Copy, Default)]
pub struct Expect {
    /// The output dtype, where the op fixes it (casts, creation, bool/int outputs).
    pub dtype: Option<FloatDType>,
    /// Compare values with the reference (off for random ops).
    pub values: bool,
}

pub struct Harness<B: Backend> {
    pub device: B::Device,
    pub precision: Precision,
    pub low: FloatDType,
    /// Against Flex in f32 instead: each op through `Amp<B>` with autocast off, on f32
    /// inputs, held to the same op on Flex ([`Harness::against_flex`]).
    pub against_flex: bool,
    /// Against Flex: `B`'s f32 matmuls may run in TF32 (CUDA): the lowered category's ops
    /// held to [`Tolerance::TF32`].
    pub tf32: bool,
    /// The inputs' range (`[0.1, 0.9]`, or wider against Flex: [`Harness::with_span`]).
    pub span: (f32, f32),
    pub exercised: BTreeSet<&'static str>,
    pub failures: Vec<String>,
    /// Ops the inner backend itself does not implement (checked to fail alike via Amp).
    pub unsupported: Vec<String>,
}

/// Ops a backend may lack that `Amp` builds (src/backend/workarounds).
const SUPPLIED_BY_AMP: &[&str] = &["float_argtopk"];

impl<B: Backend> Harness<B> {
    pub fn new(device: B::Device, precision: Precision) -> Self {
        let low = precision
            .low_dtype()
            .expect("the harness needs a low precision");
        Self {
            device,
            precision,
            low,
            against_flex: false,
            tf32: false,
            span: (0.1, 0.9),
            exercised: BTreeSet::new(),
            failures: Vec::new(),
            unsupported: Vec::new(),
        }
    }

    /// Every op through `Amp<B>` with autocast off against the same op on Flex, on the same
    /// f32 inputs, within [`Tolerance::F32`]: two implementations of every kernel, the
    /// backward ones included (`gelu_backward` was Burn's tanh approximation outside Flex).
    pub fn against_flex(device: B::Device, tf32: bool) -> Self {
        Self {
            against_flex: true,
            tf32,
            ..Self::new(device, Precision::F16)
        }
    }

    /// Inputs in `[lo, hi]` instead.
    pub fn with_span(self, lo: f32, hi: f32) -> Self {
        Self {
            span: (lo, hi),
            ..self
        }
    }

    /// Distinct values in [0.1, 0.9] (by default), shuffled: no ties after rounding to bf16
    /// for up to ~150 elements, in the domain of log, sqrt, asin, acos and atanh.
    fn input(&self, shape: &[usize], salt: usize) -> FloatTensor<B> {
        let n: usize = shape.iter().product();
        let (lo, hi) = self.span;
        let mut values: Vec<f32> = (0..n)
            .map(|k| lo + (hi - lo) * (k as f32 + 0.5) / n.max(1) as f32)
            .collect();
        // A fixed permutation: stride coprime with n.
        let stride = (7 + 2 * salt)..;
        let stride = stride.into_iter().find(|s| gcd(*s, n.max(1)) == 1).unwrap();
        values = (0..n)
            .map(|k| values[(k * stride + salt) % n.max(1)])
            .collect();
        B::float_from_data(TensorData::new(values, shape.to_vec()), &self.device)
    }

    /// Input dtypes by category: what the op would meet in a real autocast run.
    fn input_dtypes(&self, category: Category, n: usize) -> Vec<FloatDType> {
        let low = self.low;
        (0..n)
            .map(|i| match category {
                Category::Lower => FloatDType::F32,
                Category::F32 => low,
                Category::Promote | Category::Pass if n > 1 && i > 0 => FloatDType::F32,
                Category::Promote | Category::Pass => low,
            })
            .collect()
    }

    fn default_output(&self, category: Category, n: usize) -> FloatDType {
        match category {
            Category::Lower => self.low,
            Category::F32 => FloatDType::F32,
            Category::Promote => FloatDType::F32,
            Category::Pass if n > 1 => FloatDType::F32,
            Category::Pass => self.low,
        }
    }

    pub fn check(
        &mut self,
        op: Op,
        shapes: &[&[usize]],
        expect: Expect,
        run_amp: impl Fn(&B::Device, Vec<FloatTensor<B>>) -> FloatTensor<B>,
        run_ref: impl Fn(&B::Device, Vec<FloatTensor<B>>) -> FloatTensor<B>,
        run_flex: impl Fn(&FlexDevice, Vec<FloatTensor<Amp<Flex>>>) -> FloatTensor<Amp<Flex>>,
    ) {
        if self.against_flex {
            return self.check_against_flex(op, shapes, expect, run_amp, run_flex);
        }
        self.exercised.insert(op.name());
        let category = op.category();
        let dtypes = self.input_dtypes(category, shapes.len());
        let inputs: Vec<_> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| B::float_cast(self.input(s, i), dtypes[i]))
            .collect();
        // The reference sees the same rounded values, in f32.
        let ref_inputs: Vec<_> = inputs
            .iter()
            .map(|t| B::float_cast(t.clone(), FloatDType::F32))
            .collect();

        // An op the backend itself lacks must fail the same way through `Amp`: forwarded,
        // not broken by it.
        let device = &self.device;
        // Lazy backends (fusion) fail on their device thread: only a sync tells.
        let synced = |t: FloatTensor<B>| B::sync(device).map(|_| t).map_err(|e| e.to_string());
        let reference = match catch(|| run_ref(device, ref_inputs)).and_then(&synced) {
            Ok(reference) => reference,
            Err(reason) => {
                let precision = self.precision;
                let amp = catch(|| {
                    let _g = autocast(precision);
                    run_amp(device, inputs)
                })
                .and_then(&synced);
                match amp {
                    Err(amp_reason) if amp_reason == reason => {
                        self.unsupported.push(format!("{}: {reason}", op.name()))
                    }
                    Err(amp_reason) => self.failures.push(format!(
                        "{}: the backend fails with `{reason}`, Amp with `{amp_reason}`",
                        op.name()
                    )),
                    // Ops `Amp` supplies where a backend lacks them (Flex's argtopk: a
                    // descending argsort; its values: tests/autocast_numerics/spectral.rs).
                    Ok(_) if SUPPLIED_BY_AMP.contains(&op.name()) => self
                        .unsupported
                        .push(format!("{}: {reason}; Amp supplies it", op.name())),
                    Ok(_) => self.failures.push(format!(
                        "{}: the backend fails with `{reason}`, Amp succeeds",
                        op.name()
                    )),
                }
                return;
            }
        };
        let out = match catch(|| {
            let _g = autocast(self.precision);
            run_amp(device, inputs)
        })
        .and_then(&synced)
        {
            Ok(out) => out,
            Err(reason) => {
                self.failures
                    .push(format!("{}: panicked under Amp: {reason}", op.name()));
                return;
            }
        };

        let want = expect
            .dtype
            .unwrap_or_else(|| self.default_output(category, shapes.len()));
        let got = out.dtype();
        if got != DType::from(want) {
            self.failures.push(format!(
                "{} ({category:?}): output dtype {got:?}, expected {want:?}",
                op.name()
            ));
            return;
        }
        if out.shape() != reference.shape() {
            self.failures.push(format!(
                "{}: shape {:?}, reference {:?}",
                op.name(),
                out.shape(),
                reference.shape()
            ));
            return;
        }
        if !expect.values {
            return;
        }
        let tol = Tolerance::of(want);
        let got = to_f32::<B>(out);
        let reference = to_f32::<B>(reference);
        if let Some((i, g, r)) = first_difference(&got, &reference, tol) {
            self.failures.push(format!(
                "{}: value {g} at {i}, f32 reference {r} (tolerance {tol:?})",
                op.name()
            ));
        }
    }
}

impl<B: Backend> Harness<B> {
    fn check_against_flex(
        &mut self,
        op: Op,
        shapes: &[&[usize]],
        expect: Expect,
        run_amp: impl Fn(&B::Device, Vec<FloatTensor<B>>) -> FloatTensor<B>,
        run_flex: impl Fn(&FlexDevice, Vec<FloatTensor<Amp<Flex>>>) -> FloatTensor<Amp<Flex>>,
    ) {
        self.exercised.insert(op.name());
        let inputs: Vec<_> = (0..shapes.len())
            .map(|i| self.input(shapes[i], i))
            .collect();
        let flex_inputs: Vec<_> = inputs
            .iter()
            .map(|t| {
                let data = read_sync(B::float_into_data(t.clone())).expect("read back");
                <Amp<Flex> as FloatTensorOps<Amp<Flex>>>::float_from_data(data, &FlexDevice)
            })
            .collect();
        let device = &self.device;
        let synced = |t: FloatTensor<B>| B::sync(device).map(|_| t).map_err(|e| e.to_string());
        let got = catch(|| {
            let _off = autocast(Precision::F32);
            run_amp(device, inputs)
        })
        .and_then(&synced);
        let want = catch(|| {
            let _off = autocast(Precision::F32);
            run_flex(&FlexDevice, flex_inputs)
        });
        let (got, want) = match (got, want) {
            (Ok(got), Ok(want)) => (got, want),
            // Flex lacks it (`ctc_loss_backward`): nothing to hold it to.
            (_, Err(reason)) => {
                self.unsupported
                    .push(format!("{}: on Flex, {reason}", op.name()));
                return;
            }
            (Err(reason), Ok(_)) => {
                self.failures
                    .push(format!("{}: fails where Flex's runs: {reason}", op.name()));
                return;
            }
        };
        if got.shape() != want.shape() {
            self.failures.push(format!(
                "{}: shape {:?}, Flex's {:?}",
                op.name(),
                got.shape(),
                want.shape()
            ));
            return;
        }
        if !expect.values {
            return;
        }
        let got = to_f32::<B>(got);
        let want = to_f32::<Amp<Flex>>(want);
        let tol = if on_wgpu::<B>() && WGSL_INVERSE_TRIGONOMETRY.contains(&op.name()) {
            Tolerance::WGSL_INVERSE_TRIGONOMETRY
        } else if self.tf32 && op.category() == Category::Lower {
            Tolerance::TF32
        } else {
            Tolerance::F32
        };
        if let Some((i, g, r)) = first_difference(&got, &want, tol) {
            self.failures.push(format!(
                "{}: value {g} at {i}, Flex's {r} (tolerance {tol:?})",
                op.name()
            ));
        }
    }
}

/// Ops WGSL computes within "4096 ULP" (`atan`, `atan2`; `asin` and `acos` inherit it): up to
/// 2.4e-4 relative at 0.6, by specification (lavapipe's `asin` 3.3e-4 off, its `acos`
/// 1.2e-4).
const WGSL_INVERSE_TRIGONOMETRY: &[&str] =
    &["float_asin", "float_acos", "float_atan", "float_atan2"];

fn on_wgpu<B: Backend>() -> bool {
    std::any::TypeId::of::<B::Device>() == std::any::TypeId::of::<burn::backend::wgpu::WgpuDevice>()
}

/// The first element of `got` not [`close`] to `want`'s: its index and both values.
fn first_difference(got: &[f32], want: &[f32], tol: Tolerance) -> Option<(usize, f32, f32)> {
    got.iter()
        .zip(want)
        .enumerate()
        .map(|(i, (g, r))| (i, *g, *r))
        .find(|(_, g, r)| !close(*g, *r, tol))
}

pub fn close(g: f32, r: f32, tol: Tolerance) -> bool {
    (g.is_nan() && r.is_nan()) || g == r || (g - r).abs() <= tol.atol + tol.rtol * r.abs()
}

pub fn to_f32<B: Backend>(t: FloatTensor<B>) -> Vec<f32> {
    let t = B::float_cast(t, FloatDType::F32);
    read_sync(B::float_into_data(t))
        .expect("read back")
        .to_vec::<f32>()
        .expect("f32 data")
}

/// Runs `f`, turning a panic into its message. The default hook stays quiet meanwhile.
fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|e| {
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "<non-string panic>".into())
    })
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}
