//! The autocast policy, op by op: output dtypes, values against f32, completeness of the
//! table, and the rules that hold for every op (f64, mixed dtypes, bf16 on wgpu, guards).

mod common;

use std::collections::BTreeSet;

use burn::backend::{Flex, Wgpu};
use burn_amp::backend::{Category, Op};
use burn_amp::{Amp, Precision, autocast};
use burn_backend::ops::FloatTensorOps;
use burn_backend::{Backend, TensorData};
use burn_std::{DType, FloatDType};

use common::harness::{Harness, Tolerance, to_f32};
use common::policy_ops;

fn run_all<B: Backend>(device: B::Device, precision: Precision) {
    let mut h = Harness::<B>::new(device, precision);
    policy_ops::every_op(&mut h);
    assert!(
        h.failures.is_empty(),
        "{} ops broke the policy under {precision}:\n{}",
        h.failures.len(),
        h.failures.join("\n")
    );
    eprintln!(
        "{} ops are not implemented by the backend itself (and fail alike through Amp):\n  {}",
        h.unsupported.len(),
        h.unsupported.join("\n  ")
    );
    let all: BTreeSet<_> = Op::ALL.iter().map(|op| op.name()).collect();
    let missing: Vec<_> = all.difference(&h.exercised).collect();
    assert!(
        missing.is_empty(),
        "ops of the table never exercised: {missing:?}"
    );
}

/// Every op of the table against Flex in f32 (`policy_ops::agree_with_flex`).
#[test]
fn every_op_agrees_with_flex_wgpu() {
    if let Some(device) = common::wgpu_device()
        && let Err(differences) = policy_ops::agree_with_flex::<Wgpu>(&device, false)
    {
        panic!("{differences}");
    }
}

#[test]
fn every_op_follows_the_policy_flex_f16() {
    run_all::<Flex>(Default::default(), Precision::F16);
}

#[test]
fn every_op_follows_the_policy_flex_bf16() {
    run_all::<Flex>(Default::default(), Precision::Bf16);
}

#[test]
fn every_op_follows_the_policy_wgpu_f16() {
    if let Some(device) = common::wgpu_device() {
        run_all::<Wgpu>(device, Precision::F16);
    }
}

/// The table must hold every float op of the three traits, and nothing else: read the
/// trait definitions of the burn-backend sources this crate was built against.
#[test]
fn policy_table_covers_every_trait_op() {
    let traits = [
        ("FloatTensorOps", "backend/ops/tensor.rs"),
        ("ActivationOps", "backend/ops/activation.rs"),
        ("ModuleOps", "backend/ops/modules/base.rs"),
    ];
    let src = burn_backend_src();
    let mut in_traits = BTreeSet::new();
    for (name, file) in traits {
        let text = std::fs::read_to_string(src.join(file)).unwrap();
        let methods = trait_methods(&text, name);
        assert!(methods.len() > 10, "parsed too few methods of {name}");
        in_traits.extend(methods);
    }
    let table: BTreeSet<String> = Op::ALL.iter().map(|op| op.name().to_string()).collect();
    let missing: Vec<_> = in_traits.difference(&table).collect();
    let extra: Vec<_> = table.difference(&in_traits).collect();
    assert!(
        missing.is_empty(),
        "trait ops missing from the policy table: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "policy table names ops the traits lack: {extra:?}"
    );
}

fn burn_backend_src() -> std::path::PathBuf {
    let home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cargo"));
    let registry = home.join("registry/src");
    for index in std::fs::read_dir(&registry).expect("cargo registry sources") {
        let dir = index.unwrap().path().join("burn-backend-0.21.0/src");
        if dir.exists() {
            return dir;
        }
    }
    panic!(
        "burn-backend-0.21.0 sources not found under {}",
        registry.display()
    );
}

/// Names of the methods declared in `pub trait <name>`, comments stripped.
fn trait_methods(text: &str, name: &str) -> Vec<String> {
    let text: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let start = text.find(&format!("pub trait {name}")).unwrap();
    let open = start + text[start..].find('{').unwrap();
    let (mut depth, mut methods, mut i) = (0usize, Vec::new(), open);
    let bytes = text.as_bytes();
    while i < bytes.len() {
        match bytes[i] {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            b'f' if depth == 1 && text[i..].starts_with("fn ") => {
                let rest = &text[i + 3..];
                let end = rest
                    .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .unwrap();
                methods.push(rest[..end].to_string());
            }
            _ => {}
        }
        i += 1;
    }
    methods
}

fn tensor<B: Backend>(values: &[f32], dtype: FloatDType) -> B::FloatTensorPrimitive {
    let t = B::float_from_data(
        TensorData::new(values.to_vec(), [values.len()]),
        &Default::default(),
    );
    B::float_cast(t, dtype)
}

#[test]
fn f64_is_never_cast() {
    type A = Amp<Flex>;
    let _g = autocast(Precision::F16);
    let a = tensor::<A>(&[1.0, 2.0, 3.0, 4.0], FloatDType::F64);
    let a = A::float_reshape(a, [2, 2].into());
    let out = A::float_matmul(a.clone(), a.clone());
    assert_eq!(out.dtype(), DType::F64, "matmul of f64 stays f64");
    let out = A::float_exp(a.clone());
    assert_eq!(out.dtype(), DType::F64, "exp of f64 stays f64");
    // f64 beside f32: promoted to f64, never lowered.
    let b = A::float_reshape(tensor::<A>(&[1.0; 4], FloatDType::F32), [2, 2].into());
    assert_eq!(A::float_matmul(a, b).dtype(), DType::F64);
}

#[test]
fn mixed_dtypes_never_panic_even_with_autocast_off() {
    type A = Amp<Flex>;
    let _g = autocast(Precision::F32);
    let h = tensor::<A>(&[1.0, 2.0], FloatDType::F16);
    let b = tensor::<A>(&[3.0, 4.0], FloatDType::BF16);
    let f = tensor::<A>(&[5.0, 6.0], FloatDType::F32);
    // f16 with bf16 promotes to f32.
    let out = A::float_add(h.clone(), b.clone());
    assert_eq!(out.dtype(), DType::F32);
    assert_eq!(to_f32::<A>(out), vec![4.0, 6.0]);
    assert_eq!(A::float_mul(h.clone(), f.clone()).dtype(), DType::F32);
    assert_eq!(A::float_cat(vec![h, b, f], 0).dtype(), DType::F32);
}

#[test]
fn autocast_off_forwards_unchanged() {
    type A = Amp<Flex>;
    let _g = autocast(Precision::F32);
    let a = A::float_reshape(
        tensor::<A>(&[0.1, 0.2, 0.3, 0.4], FloatDType::F32),
        [2, 2].into(),
    );
    let amp = A::float_matmul(a.clone(), a.clone());
    let plain = Flex::float_matmul(a.clone(), a);
    assert_eq!(amp.dtype(), DType::F32);
    assert_eq!(
        to_f32::<A>(amp),
        to_f32::<Flex>(plain),
        "bit-identical with autocast off"
    );
}

#[test]
fn default_precision_follows_the_device() {
    assert_eq!(
        Precision::default_for::<Flex>(&Default::default()),
        Precision::Bf16
    );
    // No guard: the device default (bf16 on Flex) is used.
    std::thread::spawn(|| {
        assert_eq!(Precision::current(), None);
        type A = Amp<Flex>;
        let a = A::float_reshape(tensor::<A>(&[0.1; 4], FloatDType::F32), [2, 2].into());
        assert_eq!(A::float_matmul(a.clone(), a).dtype(), DType::BF16);
    })
    .join()
    .unwrap();
    if let Some(device) = common::wgpu_device() {
        // WGSL has no bf16.
        assert_eq!(Precision::default_for::<Wgpu>(&device), Precision::F16);
    }
}

#[test]
fn guards_nest_and_are_per_thread() {
    assert_eq!(Precision::current(), None);
    let outer = autocast(Precision::F16);
    {
        let _inner = autocast(Precision::Bf16);
        assert_eq!(Precision::current(), Some(Precision::Bf16));
        std::thread::spawn(|| assert_eq!(Precision::current(), None))
            .join()
            .unwrap();
    }
    assert_eq!(Precision::current(), Some(Precision::F16));
    drop(outer);
    assert_eq!(Precision::current(), None);
}

#[test]
fn bf16_on_wgpu_is_a_clear_error() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    type A = Amp<Wgpu>;
    let a = A::float_from_data(TensorData::new(vec![0.5f32; 4], [2, 2]), &device);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _g = autocast(Precision::Bf16);
        A::float_matmul(a.clone(), a)
    }));
    let err = result.expect_err("bf16 matmul on wgpu must fail");
    let msg = err
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(
        msg.contains("bf16") && msg.contains("Precision::F16"),
        "unclear message: {msg}"
    );
    assert!(
        msg.contains("Wgpu") || msg.contains("wgpu") || msg.contains("Device"),
        "{msg}"
    );
}

#[test]
fn categories_match_the_shared_policy() {
    // Spot checks of the contract in shared/AUTOCAST_POLICY.md, one per group.
    use Category::*;
    for (op, cat) in [
        (Op::float_matmul, Lower),
        (Op::linear, Lower),
        (Op::attention, Lower),
        (Op::conv2d, Lower),
        (Op::float_exp, F32),
        (Op::float_sum, F32),
        (Op::softmax, F32),
        (Op::layer_norm, F32),
        (Op::float_add, Promote),
        (Op::float_cat, Promote),
        (Op::float_equal, Promote),
        (Op::relu, Pass),
        (Op::embedding, Pass),
        (Op::float_cast, Pass),
        (Op::conv2d_weight_backward, Pass),
        // Moved to f32: average pooling (kernels sum in the element type), deformable
        // convolution (sampling coordinates), sigmoid (probabilities).
        (Op::avg_pool1d, F32),
        (Op::avg_pool2d, F32),
        (Op::adaptive_avg_pool1d, F32),
        (Op::adaptive_avg_pool2d, F32),
        (Op::deform_conv2d, F32),
        (Op::sigmoid, F32),
        (Op::hard_sigmoid, Pass),
        (Op::max_pool2d, Pass),
        (Op::avg_pool2d_backward, Pass),
        (Op::deform_conv2d_backward, Pass),
    ] {
        assert_eq!(op.category(), cat, "{}", op.name());
    }
    let _ = Tolerance::F32;
}

/// Batch norm and group norm have no backend op in 0.21: burn-nn composes them from
/// mean/sub/powi. The composition must accumulate in f32: given f16 activations they
/// return f32, close to the f32 reference.
#[test]
fn composed_norms_accumulate_in_f32() {
    use burn::nn::{BatchNormConfig, GroupNormConfig};
    use burn::tensor::{Distribution, Tensor};
    type A = Amp<Flex>;
    let device = Default::default();
    let x = Tensor::<Flex, 4>::random([4, 6, 5, 5], Distribution::Normal(3.0, 2.0), &device);
    let bn = BatchNormConfig::new(6).init::<Flex>(&device);
    let gn = GroupNormConfig::new(2, 6).init::<Flex>(&device);
    let bn_ref = bn.forward(x.clone());
    let gn_ref = gn.forward(x.clone());

    let _g = autocast(Precision::F16);
    let x_amp = Tensor::<A, 4>::from_data(x.to_data(), &device).cast(DType::F16);
    let bn_amp = BatchNormConfig::new(6).init::<A>(&device);
    let gn_amp = GroupNormConfig::new(2, 6).init::<A>(&device);
    for (name, out, reference) in [
        ("batch norm", bn_amp.forward(x_amp.clone()), bn_ref),
        ("group norm", gn_amp.forward(x_amp), gn_ref),
    ] {
        assert_eq!(out.dtype(), DType::F32, "{name} accumulates in f32");
        let got = out.into_data().to_vec::<f32>().unwrap();
        let want = reference.into_data().to_vec::<f32>().unwrap();
        // Inputs rounded to f16 (|x| < ~12: error < 4e-3), normalised by std ~2.
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0, f32::max);
        assert!(worst < 5e-3, "{name}: max error {worst}");
    }
}

#[cfg(feature = "cuda")]
#[test]
fn every_op_follows_the_policy_cuda_f16() {
    run_all::<burn_cuda::Cuda>(Default::default(), Precision::F16);
}

#[cfg(feature = "cuda")]
#[test]
fn every_op_follows_the_policy_cuda_bf16() {
    run_all::<burn_cuda::Cuda>(Default::default(), Precision::Bf16);
}
