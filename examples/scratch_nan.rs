use burn::backend::{Flex, Wgpu};
use burn::tensor::activation::{
    gelu, hard_sigmoid, leaky_relu, log_sigmoid, log_softmax, mish, relu, sigmoid, silu, softmax,
    softplus,
};
use burn::tensor::backend::Backend;
use burn::tensor::module::{avg_pool1d, max_pool1d};
use burn::tensor::{Tensor, TensorData};
fn show<B: Backend>(name: &str, d: &B::Device) -> Vec<(String, Vec<f32>)> {
    let x = Tensor::<B, 2>::from_data(
        TensorData::new(
            vec![
                1.0f32,
                f32::NAN,
                -2.0,
                f32::INFINITY,
                f32::NEG_INFINITY,
                0.5,
                3.0,
                -0.0,
            ],
            [2, 4],
        ),
        d,
    );
    let v = |t: Tensor<B, 2>| t.into_data().to_vec::<f32>().unwrap();
    let vi = |t: Tensor<B, 2, burn::tensor::Int>| {
        t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
    };
    let seq = |t: Tensor<B, 2>| t.reshape([1, 2, 4]);
    let back = |t: Tensor<B, 3>| {
        let [_, c, l] = t.dims();
        t.reshape([c, l])
    };
    vec![
        ("relu".into(), v(relu(x.clone()))),
        ("clamp".into(), v(x.clone().clamp(-1.0, 1.0))),
        ("clamp_min".into(), v(x.clone().clamp_min(0.0))),
        (
            "max_pair".into(),
            v(x.clone().max_pair(x.clone().flip([1]))),
        ),
        (
            "min_pair".into(),
            v(x.clone().min_pair(x.clone().flip([1]))),
        ),
        ("max_dim".into(), v(x.clone().max_dim(1))),
        ("min_dim".into(), v(x.clone().min_dim(1))),
        ("argmax".into(), vi(x.clone().argmax(1))),
        ("argmin".into(), vi(x.clone().argmin(1))),
        ("sort".into(), v(x.clone().sort(1))),
        ("cummax".into(), v(x.clone().cummax(1))),
        (
            "max_pool1d".into(),
            v(back(max_pool1d(seq(x.clone()), 2, 1, 0, 1, false))),
        ),
        (
            "avg_pool1d".into(),
            v(back(avg_pool1d(seq(x.clone()), 2, 1, 0, true, false))),
        ),
        ("softmax".into(), v(softmax(x.clone(), 1))),
        ("log_softmax".into(), v(log_softmax(x.clone(), 1))),
        ("sigmoid".into(), v(sigmoid(x.clone()))),
        ("log_sigmoid".into(), v(log_sigmoid(x.clone()))),
        ("gelu".into(), v(gelu(x.clone()))),
        ("silu".into(), v(silu(x.clone()))),
        ("mish".into(), v(mish(x.clone()))),
        ("softplus".into(), v(softplus(x.clone(), 1.0))),
        ("leaky_relu".into(), v(leaky_relu(x.clone(), 0.1))),
        ("hard_sigmoid".into(), v(hard_sigmoid(x.clone(), 0.2, 0.5))),
        ("tanh".into(), v(x.clone().tanh())),
        ("sign".into(), v(x.clone().sign())),
        ("abs".into(), v(x.clone().abs())),
        ("sqrt".into(), v(x.clone().sqrt())),
        ("log".into(), v(x.clone().log())),
        ("exp".into(), v(x.clone().exp())),
        ("powf_scalar 2".into(), v(x.clone().powf_scalar(2.0))),
        ("powf_scalar 0.5".into(), v(x.clone().powf_scalar(0.5))),
        ("recip".into(), v(x.clone().recip())),
        ("round".into(), v(x.clone().round())),
        ("floor".into(), v(x.clone().floor())),
        ("remainder 2".into(), v(x.clone().remainder_scalar(2.0))),
        ("is_nan".into(), v(x.clone().is_nan().float())),
        ("is_inf".into(), v(x.clone().is_inf().float())),
        ("equal self".into(), v(x.clone().equal(x.clone()).float())),
        ("greater 0".into(), v(x.clone().greater_elem(0.0).float())),
        ("sum_dim".into(), v(x.clone().sum_dim(1))),
        ("mean_dim".into(), v(x.clone().mean_dim(1))),
        ("prod_dim".into(), v(x.clone().prod_dim(1))),
        ("cumsum".into(), v(x.clone().cumsum(1))),
        ("max_abs_dim".into(), v(x.clone().max_abs_dim(1))),
        ("erf".into(), v(x.clone().erf())),
        ("atan2".into(), v(x.clone().atan2(x.clone().flip([1])))),
        ("int cast".into(), vi(x.clone().int())),
        (
            "mask_fill nan".into(),
            v(x.clone().mask_fill(x.clone().is_nan(), 0.0)),
        ),
    ]
    .into_iter()
    .map(|(n, v): (String, Vec<f32>)| (format!("{name} {n}"), v))
    .collect()
}
fn main() {
    let f = show::<Flex>("flex", &Default::default());
    let w = show::<Wgpu>("wgpu", &Default::default());
    for (a, b) in f.iter().zip(&w) {
        let same = a.1.iter().zip(&b.1).all(|(x, y)| {
            x.to_bits() == y.to_bits()
                || (x.is_nan() && y.is_nan())
                || (x - y).abs() <= 1e-5 * x.abs().max(1.0)
        });
        println!(
            "{} {}\n  {:?}\n  {:?}",
            if same { "same" } else { "DIFF" },
            a.0,
            a.1,
            b.1
        );
    }
}
