//! One op on empty tensors, in a process of its own: plain Burn (`Autodiff<B>`) against
//! `Amp<Autodiff<B>>` at f16. How `scripts/empty-probe.sh` measures, through the stand-in CUDA
//! driver (which refuses a launch over a zero grid, as CUDA does), which ops on empty tensors
//! plain Burn 0.21 cannot run on CUDA and whether `Amp` runs them without a kernel.
//!
//! A case makes its inputs without a kernel (`Tensor::empty`: an allocation), runs its op,
//! checks the result's shape (and reads it where it holds values: a reduction over nothing),
//! syncs the device, and reads a small tensor made afterwards: a launch the driver refused
//! leaves the stream dead and that read fails. (Through the stand-in, which runs no kernel,
//! `EMPTY_PROBE_VALUES=0` reads values without comparing them.) Under `Amp` a float case then runs a backward
//! through the op (its result summed into a loss) and reads the input's gradient. Exit 0 when
//! all of that ran.
//!
//! ```sh
//! cargo run --example empty_probe -- --backend wgpu amp sort_with_indices   # any backend
//! scripts/empty-probe.sh                                                    # all, on CUDA
//! ```

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Bool, IndexingUpdateOp, Int};
use burn_amp::{Amp, Precision, autocast};

const CASES: &[&str] = &[
    // Those of the first probe (2026-12-03): creation, elementwise, matmul, sums, picks.
    "zeros",
    "exp",
    "matmul",
    "sum_dim",
    "select",
    // Reductions, sorts, top-k, views (2026-12-04).
    "prod",
    "prod_dim",
    "any",
    "all_dim",
    "max_abs_dim",
    "sort_with_indices",
    "argsort",
    "topk",
    "argtopk",
    "transpose",
    "permute",
    "expand",
    "unfold_short",
    "deform_conv2d",
    "grid_sample",
    "int_prod",
    "int_mean_dim",
    "int_argmax",
    "int_max_dim",
    "int_min_dim_with_indices",
    "int_any",
    "int_all_dim",
    "int_sort",
    "int_sort_with_indices",
    "int_argsort",
    "int_topk",
    "int_permute",
    "int_expand",
    "int_repeat_dim",
    "int_unfold",
    "bool_any",
    "bool_all_dim",
    "bool_permute",
    "bool_expand",
    "bool_unfold",
    // Picks, writes, cat, int matmul (2026-12-04, second probe).
    "cat_empty_batch",
    "gather_nd",
    "scatter_nd",
    "int_matmul",
    "int_cat",
    "int_gather_nd",
    "int_scatter_nd",
    "int_select_add",
    "int_scatter_add",
    "bool_cat",
    "bool_select",
    "bool_select_or",
];

/// `assert_eq!` of values read back, unless `EMPTY_PROBE_VALUES=0`: through the stand-in
/// driver no kernel runs, so a value is meaningless, but reading it still fails on a stream
/// that a refused launch left dead.
macro_rules! values_eq {
    ($got:expr, $want:expr $(, $($msg:tt)*)?) => {{
        let got = $got;
        if std::env::var("EMPTY_PROBE_VALUES").map_or(true, |v| v != "0") {
            assert_eq!(got, $want $(, $($msg)*)?);
        }
    }};
}

/// A float case's result, for the backward under `Amp`.
type Float<X> = Option<(Tensor<X, 2>, Tensor<X, 2>)>;

/// Runs `name`; `Err` for a case not listed.
fn case<X: AutodiffBackend>(name: &str, device: &X::Device) -> Result<Float<X>, String> {
    let empty = || Tensor::<X, 2>::empty([0, 8], device).require_grad();
    let ints = || Tensor::<X, 2, Int>::empty([0, 4], device);
    let bools = || Tensor::<X, 2, Bool>::empty([0, 4], device);
    let row = || Tensor::<X, 2>::ones([1, 8], device).require_grad();
    let int_row = || Tensor::<X, 2, Int>::ones([1, 4], device);
    let int_values = |t: Tensor<X, 2, Int>| t.into_data().iter::<i64>().collect::<Vec<_>>();
    // `gather_nd`/`scatter_nd` (Burn refuses them no index): rows of a tensor without
    // columns, three times the first.
    let no_columns = || Tensor::<X, 2>::empty([2, 0], device).require_grad();
    let no_int_columns = || Tensor::<X, 2, Int>::empty([2, 0], device);
    let first_row = || Tensor::<X, 2, Int>::zeros([3, 1], device);
    let bool_values = |t: Tensor<X, 2, Bool>| t.into_data().iter::<bool>().collect::<Vec<_>>();
    let dims = |got: Vec<usize>, want: &[usize]| assert_eq!(got, want, "{name}: shape");
    // A float op over `x`: its result, to check and to sum into a loss.
    let float = |x: Tensor<X, 2>, out: Tensor<X, 2>, want: &[usize]| {
        dims(out.dims().to_vec(), want);
        Some((x, out))
    };
    Ok(match name {
        "zeros" => {
            dims(
                Tensor::<X, 2>::zeros([0, 8], device).dims().to_vec(),
                &[0, 8],
            );
            None
        }
        "exp" => {
            let x = empty();
            float(x.clone(), x.exp(), &[0, 8])
        }
        "matmul" => {
            let x = empty();
            float(x.clone(), x.matmul(Tensor::ones([8, 4], device)), &[0, 4])
        }
        "sum_dim" => {
            let x = empty();
            let out = x.clone().sum_dim(0);
            values_eq!(out.to_data().iter::<f32>().collect::<Vec<_>>(), [0.0; 8]);
            float(x, out, &[1, 8])
        }
        "select" => {
            let w = row();
            let none = Tensor::<X, 1, Int>::empty([0], device);
            float(w.clone(), w.select(0, none), &[0, 8])
        }
        "prod" => {
            let x = empty();
            let out = x.clone().prod().reshape([1, 1]);
            values_eq!(out.to_data().iter::<f32>().collect::<Vec<_>>(), [1.0]);
            float(x, out, &[1, 1])
        }
        "prod_dim" => {
            let x = empty();
            float(x.clone(), x.prod_dim(1), &[0, 1])
        }
        "any" => {
            let any = empty().any().into_data().iter::<bool>().collect::<Vec<_>>();
            values_eq!(any, [false], "any of nothing");
            None
        }
        "all_dim" => {
            values_eq!(bool_values(empty().all_dim(0)), [true; 8], "all of nothing");
            None
        }
        "max_abs_dim" => {
            let x = empty();
            float(x.clone(), x.max_abs_dim(1), &[0, 1])
        }
        "sort_with_indices" => {
            let x = empty();
            let (sorted, at) = x.clone().sort_with_indices(1);
            dims(at.dims().to_vec(), &[0, 8]);
            float(x, sorted, &[0, 8])
        }
        "argsort" => {
            dims(empty().argsort(1).dims().to_vec(), &[0, 8]);
            None
        }
        "topk" => {
            let x = empty();
            float(x.clone(), x.topk(2, 1), &[0, 2])
        }
        "argtopk" => {
            dims(empty().argtopk(2, 1).dims().to_vec(), &[0, 2]);
            None
        }
        "transpose" => {
            let x = empty();
            float(x.clone(), x.transpose(), &[8, 0])
        }
        "permute" => {
            let x = empty();
            float(x.clone(), x.permute([1, 0]), &[8, 0])
        }
        "expand" => {
            let w = row();
            float(w.clone(), w.expand::<2, _>(Shape::new([0, 8])), &[0, 8])
        }
        "unfold_short" => {
            let w = row();
            let out = w.clone().unfold::<3, _>(1, 9, 1).flatten::<2>(1, 2);
            float(w, out, &[1, 0])
        }
        "deform_conv2d" => {
            let x = Tensor::<X, 2>::empty([0, 75], device).require_grad();
            let out = burn::tensor::module::deform_conv2d(
                x.clone().reshape([0, 3, 5, 5]),
                Tensor::<X, 4>::empty([0, 18, 3, 3], device),
                Tensor::<X, 4>::ones([4, 3, 3, 3], device),
                None,
                None,
                burn::tensor::ops::DeformConvOptions::new([1, 1], [0, 0], [1, 1], 1, 1),
            );
            float(x, out.flatten::<2>(1, 3), &[0, 36])
        }
        "grid_sample" => {
            let features = Tensor::<X, 2>::ones([3, 64], device).require_grad();
            let out = features.clone().reshape([1, 3, 8, 8]).grid_sample_2d(
                Tensor::<X, 4>::empty([0, 7, 7, 2], device),
                burn::tensor::ops::GridSampleOptions::default(),
            );
            float(features, out.flatten::<2>(1, 3), &[0, 147])
        }
        "int_prod" => {
            let prod = ints()
                .prod_dim(0)
                .into_data()
                .iter::<i64>()
                .collect::<Vec<_>>();
            values_eq!(prod, [1; 4], "the int product of nothing");
            None
        }
        "int_mean_dim" => {
            dims(ints().mean_dim(1).dims().to_vec(), &[0, 1]);
            None
        }
        "int_argmax" => {
            dims(ints().argmax(1).dims().to_vec(), &[0, 1]);
            None
        }
        "int_max_dim" => {
            dims(ints().max_dim(1).dims().to_vec(), &[0, 1]);
            None
        }
        "int_min_dim_with_indices" => {
            let (min, at) = ints().min_dim_with_indices(1);
            dims(min.dims().to_vec(), &[0, 1]);
            dims(at.dims().to_vec(), &[0, 1]);
            None
        }
        "int_any" => {
            let any = ints().any().into_data().iter::<bool>().collect::<Vec<_>>();
            values_eq!(any, [false], "any of no int");
            None
        }
        "int_all_dim" => {
            values_eq!(bool_values(ints().all_dim(0)), [true; 4], "all of no int");
            None
        }
        "int_sort" => {
            dims(ints().sort(1).dims().to_vec(), &[0, 4]);
            None
        }
        "int_sort_with_indices" => {
            let (sorted, at) = ints().sort_with_indices(1);
            dims(sorted.dims().to_vec(), &[0, 4]);
            dims(at.dims().to_vec(), &[0, 4]);
            None
        }
        "int_argsort" => {
            dims(ints().argsort(1).dims().to_vec(), &[0, 4]);
            None
        }
        "int_topk" => {
            dims(ints().topk(2, 1).dims().to_vec(), &[0, 2]);
            None
        }
        "int_permute" => {
            dims(ints().permute([1, 0]).dims().to_vec(), &[4, 0]);
            None
        }
        "int_expand" => {
            let row = Tensor::<X, 2, Int>::ones([1, 4], device);
            dims(
                row.expand::<2, _>(Shape::new([0, 4])).dims().to_vec(),
                &[0, 4],
            );
            None
        }
        "int_repeat_dim" => {
            dims(ints().repeat_dim(1, 2).dims().to_vec(), &[0, 8]);
            None
        }
        "int_unfold" => {
            let row = Tensor::<X, 2, Int>::ones([1, 4], device);
            dims(row.unfold::<3, _>(1, 5, 1).dims().to_vec(), &[1, 0, 5]);
            None
        }
        "bool_any" => {
            let any = bools().any().into_data().iter::<bool>().collect::<Vec<_>>();
            values_eq!(any, [false], "any of no bool");
            None
        }
        "bool_all_dim" => {
            values_eq!(bool_values(bools().all_dim(0)), [true; 4], "all of no bool");
            None
        }
        "bool_permute" => {
            dims(bools().permute([1, 0]).dims().to_vec(), &[4, 0]);
            None
        }
        "bool_expand" => {
            let row = Tensor::<X, 2, Int>::ones([1, 4], device).greater_elem(0);
            dims(
                row.expand::<2, _>(Shape::new([0, 4])).dims().to_vec(),
                &[0, 4],
            );
            None
        }
        "bool_unfold" => {
            let row = Tensor::<X, 2, Int>::ones([1, 4], device).greater_elem(0);
            dims(row.unfold::<3, _>(1, 5, 1).dims().to_vec(), &[1, 0, 5]);
            None
        }
        "cat_empty_batch" => {
            let x = empty();
            let pos = Tensor::<X, 2>::empty([0, 3], device);
            float(x.clone(), Tensor::cat(vec![x, pos], 1), &[0, 11])
        }
        "gather_nd" => {
            let x = no_columns();
            float(x.clone(), x.gather_nd::<2, 2>(first_row()), &[3, 0])
        }
        "scatter_nd" => {
            let x = no_columns();
            let values = Tensor::<X, 2>::empty([3, 0], device);
            let out = x
                .clone()
                .scatter_nd(first_row(), values, IndexingUpdateOp::Add);
            float(x, out, &[2, 0])
        }
        "int_matmul" => {
            let out = ints().matmul(Tensor::<X, 2, Int>::ones([4, 3], device));
            dims(out.dims().to_vec(), &[0, 3]);
            None
        }
        "int_cat" => {
            let out = Tensor::cat(vec![ints(), Tensor::<X, 2, Int>::empty([0, 2], device)], 1);
            dims(out.dims().to_vec(), &[0, 6]);
            None
        }
        "int_gather_nd" => {
            let out = no_int_columns().gather_nd::<2, 2>(first_row());
            dims(out.dims().to_vec(), &[3, 0]);
            None
        }
        "int_scatter_nd" => {
            let values = Tensor::<X, 2, Int>::empty([3, 0], device);
            let out = no_int_columns().scatter_nd(first_row(), values, IndexingUpdateOp::Add);
            dims(out.dims().to_vec(), &[2, 0]);
            None
        }
        "int_select_add" => {
            let none = Tensor::<X, 1, Int>::empty([0], device);
            let out = int_row().select_assign(0, none, ints(), IndexingUpdateOp::Add);
            values_eq!(int_values(out), [1; 4], "int select_assign of nothing");
            None
        }
        "int_scatter_add" => {
            let at = Tensor::<X, 2, Int>::empty([0, 4], device);
            let out = int_row().scatter(0, at, ints(), IndexingUpdateOp::Add);
            values_eq!(int_values(out), [1; 4], "int scatter of nothing");
            None
        }
        "bool_cat" => {
            let out = Tensor::cat(vec![bools(), bools()], 1);
            dims(out.dims().to_vec(), &[0, 8]);
            None
        }
        "bool_select" => {
            let none = Tensor::<X, 1, Int>::empty([0], device);
            dims(
                int_row().greater_elem(0).select(1, none).dims().to_vec(),
                &[1, 0],
            );
            None
        }
        "bool_select_or" => {
            let none = Tensor::<X, 1, Int>::empty([0], device);
            let mask = int_row().greater_elem(0);
            let out = mask.select_assign(0, none, bools(), IndexingUpdateOp::Add);
            values_eq!(bool_values(out), [true; 4], "bool select_assign of nothing");
            None
        }
        other => return Err(format!("no case {other:?}; the cases: {}", CASES.join(" "))),
    })
}

/// Syncs, then reads a tensor made now: a refused launch before leaves the stream dead.
fn alive<X: Backend>(device: &X::Device) {
    X::sync(device).expect("the device syncs after the op");
    let read = Tensor::<X, 1>::from_data([1.0, 2.0], device).mul_scalar(2.0);
    let read = read.into_data().iter::<f32>().collect::<Vec<_>>();
    values_eq!(read, [2.0, 4.0], "a read after the op");
}

fn probe<X: AutodiffBackend>(name: &str, device: &X::Device, backward: bool) -> Result<(), String> {
    let float = case::<X>(name, device)?;
    alive::<X>(device);
    if let (true, Some((x, out))) = (backward, float) {
        let loss = out.sum() + Tensor::<X, 1>::ones([1], device);
        let grads = loss.backward();
        let grad = x
            .grad(&grads)
            .ok_or(format!("{name}: the input got no gradient"))?;
        assert_eq!(grad.dims(), x.dims(), "{name}: the gradient's shape");
        alive::<X::InnerBackend>(&grad.device());
    }
    Ok(())
}

fn run<B: Backend>(stack: &str, name: &str) -> Result<(), String> {
    let device = B::Device::default();
    match stack {
        // Plain Burn: the op alone (its backward would sum the empty result: a kernel of its
        // own, which fails on CUDA whatever the op).
        "plain" => probe::<Autodiff<B>>(name, &device, false),
        "amp" => {
            let _autocast = autocast(Precision::F16);
            probe::<Amp<Autodiff<B>>>(name, &device, true)
        }
        other => Err(format!("no stack {other:?}: plain or amp")),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (backend, rest) = match args.as_slice() {
        [flag, backend, rest @ ..] if flag == "--backend" => (backend.as_str(), rest),
        rest => (
            if cfg!(feature = "cuda") {
                "cuda"
            } else {
                "wgpu"
            },
            rest,
        ),
    };
    let outcome = match rest {
        [list] if list == "list" => {
            println!("{}", CASES.join("\n"));
            return;
        }
        [stack, name] => match backend {
            "wgpu" => run::<burn::backend::Wgpu>(stack, name),
            "flex" => run::<burn::backend::Flex>(stack, name),
            #[cfg(feature = "cuda")]
            "cuda" => run::<burn_cuda::Cuda>(stack, name),
            other => Err(format!("no backend {other:?} in this build")),
        },
        _ => Err("usage: empty_probe [--backend B] (plain|amp) CASE | list".into()),
    };
    if let Err(e) = outcome {
        eprintln!("empty_probe: {e}");
        std::process::exit(2);
    }
    println!("ok");
}
