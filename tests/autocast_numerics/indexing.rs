//! Picks, writes and concatenations under `Amp` (`src/backend/workarounds/empty/indexing.rs`,
//! `int_nd.rs`): on empty tensors, where Burn 0.21's CubeCL backends fail (a `cat` of an empty
//! batch overflows in burn-cubecl on wgpu, a `select_assign` of nothing panics there; on CUDA
//! every such kernel is a refused zero grid), and int `gather_nd`/`scatter_nd`, which
//! burn-autodiff 0.21 does not have.

use burn::backend::Autodiff;
use burn::tensor::{Bool, IndexingUpdateOp, Int, TensorData};
use burn_amp::{Amp, autocast};

use super::*;

const TOKENS: usize = 4;

/// An expert given no token builds its input as a `cat` of its rows of two inputs (an empty
/// batch, `[0, 8]` and `[0, 3]`) and projects it: the result is `[0, 6]`, the projection and
/// both inputs get zero gradients (PyTorch's), none dropped. Then the picks, writes and cats of
/// ints and bools with nothing to pick or write: empty results, tensors unchanged; an int
/// matmul over an empty inner dimension is zeros; `gather_nd` and `scatter_nd` on a tensor
/// without columns.
pub fn empty_picks_writes_and_cats<B: Backend>(device: &B::Device, precision: Precision) {
    type A<B> = Amp<Autodiff<B>>;
    let _autocast = autocast(precision);
    let mut next = uniform(11);
    let mut param = |dims: [usize; 2]| {
        let v: Vec<f32> = (0..dims[0] * dims[1]).map(|_| on_grid(next())).collect();
        Tensor::<A<B>, 2>::from_data(TensorData::new(v, dims), device).require_grad()
    };
    let (x, pos, w) = (param([TOKENS, 8]), param([TOKENS, 3]), param([11, 6]));
    let none =
        || Tensor::<A<B>, 1, Int>::from_data(TensorData::new(Vec::<i64>::new(), [0]), device);
    let input = Tensor::cat(
        vec![x.clone().select(0, none()), pos.clone().select(0, none())],
        1,
    );
    assert_eq!(input.dims(), [0, 11], "the cat of an empty batch");
    let out = input.matmul(w.clone());
    assert_eq!(out.dims(), [0, 6], "its projection");
    let loss = out.sum() + x.clone().sum();
    let want_loss: f32 = values(x.clone()).iter().sum();
    assert!(
        (values(loss.clone())[0] - want_loss).abs() <= 1e-5 * want_loss.abs().max(1.0),
        "the loss is the other term's"
    );
    let grads = loss.backward();
    let grad = |t: &Tensor<A<B>, 2>, name: &str| {
        let g = t
            .grad(&grads)
            .unwrap_or_else(|| panic!("{name} got no gradient"));
        (g.dims().to_vec(), values(g))
    };
    assert_eq!(grad(&w, "w"), (vec![11, 6], vec![0.0; 66]), "w: zeros");
    assert_eq!(
        grad(&pos, "pos"),
        (vec![TOKENS, 3], vec![0.0; TOKENS * 3]),
        "pos: zeros"
    );
    assert_eq!(
        grad(&x, "x"),
        (vec![TOKENS, 8], vec![1.0; TOKENS * 8]),
        "x: its sum's"
    );

    // Float gather_nd and scatter_nd on a tensor without columns (Burn refuses them no index).
    let no_columns = Tensor::<A<B>, 2>::zeros([2, 0], device).require_grad();
    let first_row = || Tensor::<A<B>, 2, Int>::zeros([3, 1], device);
    let gathered = no_columns.clone().gather_nd::<2, 2>(first_row());
    assert_eq!(gathered.dims(), [3, 0], "gather_nd of rows without columns");
    let scattered = no_columns.clone().scatter_nd(
        first_row(),
        Tensor::<A<B>, 2>::zeros([3, 0], device),
        IndexingUpdateOp::Add,
    );
    assert_eq!(scattered.dims(), [2, 0], "scatter_nd of nothing");
    let grads = (gathered.sum() + scattered.sum()).backward();
    let g = no_columns.grad(&grads).expect("a gradient");
    assert_eq!(g.dims(), [2, 0], "an empty gradient");

    let ints = |t: Tensor<A<B>, 2, Int>| {
        let dims = t.dims().to_vec();
        (
            dims,
            t.into_data().convert::<i64>().to_vec::<i64>().unwrap(),
        )
    };
    let bools = |t: Tensor<A<B>, 2, Bool>| {
        let dims = t.dims().to_vec();
        (dims, t.into_data().iter::<bool>().collect::<Vec<_>>())
    };
    let no_rows = || Tensor::<A<B>, 2, Int>::zeros([0, 4], device);
    let row =
        || Tensor::<A<B>, 2, Int>::from_data(TensorData::new(vec![1i64, 2, 3, 4], [1, 4]), device);
    let int_dtype = row().dtype();
    let product = no_rows().matmul(Tensor::ones([4, 3], device));
    assert_eq!(
        (product.dims(), product.dtype()),
        ([0, 3], int_dtype),
        "int matmul of no row"
    );
    let inner = Tensor::<A<B>, 2, Int>::zeros([3, 0], device).matmul(Tensor::zeros([0, 2], device));
    assert_eq!(
        ints(inner),
        (vec![3, 2], vec![0; 6]),
        "int matmul over an empty inner dimension"
    );
    let cat = Tensor::cat(vec![no_rows(), Tensor::zeros([0, 2], device)], 1);
    assert_eq!(
        (cat.dims(), cat.dtype()),
        ([0, 6], int_dtype),
        "int cat of an empty batch"
    );
    let unchanged = (vec![1, 4], vec![1, 2, 3, 4]);
    assert_eq!(
        ints(row().select_assign(0, none(), no_rows(), IndexingUpdateOp::Add)),
        unchanged,
        "int select_assign of nothing"
    );
    let no_index = Tensor::<A<B>, 2, Int>::zeros([0, 4], device);
    assert_eq!(
        ints(row().scatter(0, no_index, no_rows(), IndexingUpdateOp::Add)),
        unchanged,
        "int scatter of nothing"
    );
    let no_int_columns = || Tensor::<A<B>, 2, Int>::zeros([2, 0], device);
    assert_eq!(
        no_int_columns().gather_nd::<2, 2>(first_row()).dims(),
        [3, 0],
        "int gather_nd"
    );
    let scattered = no_int_columns().scatter_nd(
        first_row(),
        Tensor::<A<B>, 2, Int>::zeros([3, 0], device),
        IndexingUpdateOp::Add,
    );
    assert_eq!(scattered.dims(), [2, 0], "int scatter_nd of nothing");

    let mask = || row().greater_elem(2);
    let no_mask_rows = || no_rows().greater_elem(0);
    let bool_dtype = mask().dtype();
    let cat = Tensor::cat(vec![no_mask_rows(), no_mask_rows()], 1);
    assert_eq!(
        (cat.dims(), cat.dtype()),
        ([0, 8], bool_dtype),
        "bool cat of an empty batch"
    );
    assert_eq!(
        mask().select(1, none()).dims(),
        [1, 0],
        "bool select of no index"
    );
    assert_eq!(
        bools(mask().select_assign(0, none(), no_mask_rows(), IndexingUpdateOp::Add)),
        (vec![1, 4], vec![false, false, true, true]),
        "bool select_assign of nothing"
    );
}

flex_and_wgpu_tests!(empty_picks_writes_and_cats: empty_indexing_flex_f16, empty_indexing_flex_bf16, empty_indexing_wgpu_f16);

/// `gather_nd` and an adding `scatter_nd` with indices that repeat (a row picked three
/// times, as a batch of lookups does): values, and gradients, against sums by hand (within
/// 1e-6: each is a sum of a few bf16-grid values, in f32). Plain Burn on CubeCL loses all but
/// one of the updates at a repeated index, so a row picked three times got one gradient.
/// Then ints, which burn-autodiff cannot index this way at all: rows of a table, counts added
/// into a histogram, and the ids they give choosing the rows of an embedding that trains.
pub fn gather_nd_and_scatter_nd_at_repeated_indices<B: Backend>(
    device: &B::Device,
    precision: Precision,
) {
    type A<B> = Amp<Autodiff<B>>;
    let _autocast = autocast(precision);
    const ROWS: [[usize; 2]; 6] = [[1, 0], [1, 0], [2, 1], [1, 0], [0, 1], [2, 1]];
    const WIDTH: usize = 4;
    let mut next = uniform(23);
    let mut grid = |n: usize| (0..n).map(|_| on_grid(next() - 0.5)).collect::<Vec<f32>>();
    let (data, c, v) = (grid(3 * 2 * WIDTH), grid(6 * WIDTH), grid(6 * WIDTH));
    let flat = |[i, j]: [usize; 2]| (i * 2 + j) * WIDTH;
    let tensor = |v: &[f32], dims: [usize; 2]| {
        Tensor::<A<B>, 2>::from_data(TensorData::new(v.to_vec(), dims), device)
    };
    let near = |got: Vec<f32>, want: Vec<f32>, what: &str| {
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-6, "{what}: {i}: {g} against {w}");
        }
        assert_eq!(got.len(), want.len(), "{what}");
    };
    let at = || {
        let v: Vec<i64> = ROWS.iter().flatten().map(|&i| i as i64).collect();
        Tensor::<A<B>, 2, Int>::from_data(TensorData::new(v, [ROWS.len(), 2]), device)
    };
    let x = Tensor::<A<B>, 3>::from_data(TensorData::new(data.clone(), [3, 2, WIDTH]), device)
        .require_grad();

    let picked = x.clone().gather_nd::<2, 2>(at());
    let want: Vec<f32> = ROWS
        .iter()
        .flat_map(|&r| data[flat(r)..flat(r) + WIDTH].to_vec())
        .collect();
    near(values(picked.clone()), want, "gather_nd");
    let grads = (picked * tensor(&c, [6, WIDTH])).sum().backward();
    let mut want = vec![0.0f32; data.len()];
    for (p, &r) in ROWS.iter().enumerate() {
        for w in 0..WIDTH {
            want[flat(r) + w] += c[p * WIDTH + w];
        }
    }
    let got = values(x.grad(&grads).expect("gather_nd: a gradient"));
    near(
        got,
        want.clone(),
        "gather_nd's gradient, repeated rows summed",
    );

    let update = tensor(&v, [6, WIDTH]).require_grad();
    let out = x
        .clone()
        .scatter_nd(at(), update.clone(), IndexingUpdateOp::Add);
    let mut sum = data.clone();
    for (p, &r) in ROWS.iter().enumerate() {
        for w in 0..WIDTH {
            sum[flat(r) + w] += v[p * WIDTH + w];
        }
    }
    near(
        values(out.clone().reshape([6, WIDTH])),
        sum,
        "scatter_nd, repeated rows added",
    );
    let weights =
        Tensor::<A<B>, 3>::from_data(TensorData::new(data.clone(), [3, 2, WIDTH]), device);
    let grads = (out * weights).sum().backward();
    near(
        values(x.grad(&grads).expect("data: a gradient")),
        data.clone(),
        "scatter_nd: data's gradient",
    );
    let want: Vec<f32> = ROWS
        .iter()
        .flat_map(|&r| data[flat(r)..flat(r) + WIDTH].to_vec())
        .collect();
    near(
        values(update.grad(&grads).expect("values: a gradient")),
        want,
        "scatter_nd: the updates' gradient",
    );

    let table = Tensor::<A<B>, 3, Int>::from_data(
        TensorData::new((0..12i64).map(|v| 10 * v).collect::<Vec<_>>(), [2, 3, 2]),
        device,
    );
    let ints = |t: Tensor<A<B>, 2, Int>| t.into_data().convert::<i64>().to_vec::<i64>().unwrap();
    let at = Tensor::<A<B>, 2, Int>::from_data(
        TensorData::new(vec![1i64, 2, 0, 0, 1, 2], [3, 2]),
        device,
    );
    assert_eq!(
        ints(table.gather_nd::<2, 2>(at.clone())),
        [100, 110, 0, 10, 100, 110],
        "int gather_nd"
    );
    let counts = Tensor::<A<B>, 2, Int>::zeros([2, 3], device).scatter_nd(
        at,
        Tensor::<A<B>, 1, Int>::from_data(TensorData::new(vec![5i64, 7, 1], [3]), device),
        IndexingUpdateOp::Add,
    );
    assert_eq!(
        ints(counts),
        [7, 0, 0, 0, 0, 6],
        "int scatter_nd, a repeated index added"
    );

    let ids = Tensor::<A<B>, 2, Int>::from_data(TensorData::new(vec![2i64, 0, 2], [3, 1]), device);
    let ids = Tensor::<A<B>, 2, Int>::from_data(TensorData::new(vec![0i64, 1, 2], [3, 1]), device)
        .gather_nd::<2, 2>(ids);
    let embedding = tensor(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [3, 2]).require_grad();
    let rows = embedding.clone().select(0, ids.reshape([3]));
    assert_eq!(
        values(rows.clone()),
        [4.0, 5.0, 0.0, 1.0, 4.0, 5.0],
        "the rows picked"
    );
    let grads = (rows * 2.0).sum().backward();
    let grad = values(embedding.grad(&grads).expect("a gradient"));
    assert_eq!(grad, [2.0, 2.0, 0.0, 0.0, 4.0, 4.0], "their gradient");
}

flex_and_wgpu_tests!(gather_nd_and_scatter_nd_at_repeated_indices: nd_flex_f16, nd_flex_bf16, nd_wgpu_f16);

/// The canary: plain burn-autodiff still has no int `gather_nd`/`scatter_nd`. When this
/// fails, a Burn has them.
#[test]
fn plain_autodiff_has_no_int_gather_nd_or_scatter_nd() {
    type P = Autodiff<burn::backend::Flex>;
    let device = Default::default();
    let data = || Tensor::<P, 2, Int>::zeros([3, 2], &device);
    let at = || Tensor::<P, 2, Int>::zeros([1, 1], &device);
    let fails = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
    assert!(fails(&|| {
        data().gather_nd::<2, 2>(at()).into_data();
    }));
    assert!(fails(&|| {
        data()
            .scatter_nd(
                at(),
                Tensor::<P, 2, Int>::ones([1, 2], &device),
                IndexingUpdateOp::Add,
            )
            .into_data();
    }));
}

/// What plain `X` makes of three updates of 1 added at one row by `scatter_nd`, floats and
/// ints (3 is right): the kernel itself, no autodiff.
pub(crate) fn plain_scatter_nd_at_a_repeated_row<X: Backend>(device: &X::Device) -> (f32, i64) {
    let at = || Tensor::<X, 2, Int>::from_data(TensorData::new(vec![1i64, 1, 1], [3, 1]), device);
    let floats = Tensor::<X, 2>::zeros([2, 4], device).scatter_nd(
        at(),
        Tensor::<X, 2>::ones([3, 4], device),
        IndexingUpdateOp::Add,
    );
    let ints = Tensor::<X, 2, Int>::zeros([2, 4], device).scatter_nd(
        at(),
        Tensor::<X, 2, Int>::ones([3, 4], device),
        IndexingUpdateOp::Add,
    );
    let ints = ints.into_data().convert::<i64>().to_vec::<i64>().unwrap();
    (values(floats)[4], ints[4])
}

/// Plain Burn on wgpu: an adding `scatter_nd` keeps one of three updates at a repeated row,
/// floats and ints (unfused CubeCL). When this fails, a Burn adds them all and `nd.rs`'s
/// `select` form is needed only for ints under autodiff.
#[test]
fn plain_wgpu_scatter_nd_loses_repeated_updates() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    type Bare = burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
    let row = plain_scatter_nd_at_a_repeated_row::<Bare>(&device);
    assert!(
        row.0 < 3.0 && row.1 < 3,
        "plain Burn 0.21 on wgpu: three updates of 1 at one row give {row:?}, not 3"
    );
}

/// And plain Burn on wgpu still fails on a `cat` of an empty batch and a `select_assign` of
/// nothing (measured on the unfused CubeCL backend, where the op's own panic is raised; under
/// fusion the same overflow comes out of the thread that flushes). When this fails, those
/// guards can go there (CUDA's refused zero grid is `scripts/empty-probe.sh`'s to measure).
#[test]
fn plain_wgpu_fails_on_empty_cats_and_writes() {
    let Some(device) = common::wgpu_device() else {
        return;
    };
    type Bare = burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
    type P = Autodiff<Bare>;
    let fails = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
    let no_rows = || Tensor::<P, 2>::zeros([0, 8], &device);
    let cat = fails(&|| {
        Tensor::cat(vec![no_rows(), Tensor::zeros([0, 3], &device)], 1).into_data();
    });
    let none = || Tensor::<P, 1, Int>::from_data(TensorData::new(Vec::<i64>::new(), [0]), &device);
    let int_row = || Tensor::<P, 2, Int>::ones([1, 4], &device);
    let write = fails(&|| {
        int_row()
            .select_assign(
                0,
                none(),
                Tensor::zeros([0, 4], &device),
                IndexingUpdateOp::Add,
            )
            .into_data();
    });
    assert_eq!(
        (cat, write),
        (true, true),
        "plain Burn 0.21 on wgpu: a cat of an empty batch, an int select_assign of nothing"
    );
}
