//! The replay check sees every element: each change between a forward and
//! its backward that would make a gradient wrong is an error naming the
//! region and the statement, and no legitimate replay is refused.
//!
//! Every case runs in f32 and f64 against an independent computation
//! (plain candle) where it must pass.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var, D};
use remat_runtime::{backward, remat, Plan, Region, RematError};

use crate::common::{rel_diff, tensor, var};

const DTYPES: [DType; 2] = [DType::F32, DType::F64];

/// A block reading weight `w` in a statement under `policy`.
fn linear_tanh(x: &Var, w: &Var, saved: bool) -> Tensor {
    let wt = w.as_tensor().clone();
    Region::new("blk")
        .run(&[x.as_tensor()], move |ctx, ins| {
            let w = wt.clone();
            let f = move |t: &[Tensor]| t[0].matmul(&w)?.tanh();
            let h = if saved {
                ctx.save("h", &[&ins[0]], f)?
            } else {
                ctx.recompute("h", &[&ins[0]], f)?
            };
            ctx.recompute("loss", &[&h], |t| t[0].sqr()?.sum_all())
        })
        .unwrap()
}

/// `t`'s elements as rows of `f64`, changed by `change`, as a new tensor of
/// `t`'s dtype.
fn edited(t: &Tensor, change: impl FnOnce(&mut Vec<Vec<f64>>)) -> Tensor {
    let mut rows = t.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
    change(&mut rows);
    Tensor::new(rows, &Device::Cpu)
        .unwrap()
        .to_dtype(t.dtype())
        .unwrap()
}

fn set_element(w: &Var, row: usize, col: usize, value: f64) {
    w.set(&edited(w.as_tensor(), |v| v[row][col] = value))
        .unwrap();
}

fn swap_elements(w: &Var, a: (usize, usize), b: (usize, usize)) {
    let swapped = edited(w.as_tensor(), |v| {
        let (va, vb) = (v[a.0][a.1], v[b.0][b.1]);
        v[a.0][a.1] = vb;
        v[b.0][b.1] = va;
    });
    w.set(&swapped).unwrap();
}

/// The next value above `v` in `dtype` (f32 or f64): one unit in the last
/// place.
fn next_up(v: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f32::from_bits((v as f32).to_bits() + 1) as f64,
        _ => f64::from_bits(v.to_bits() + 1),
    }
}

fn assert_parameter_changed(e: &RematError, statement_name: &str) {
    assert!(
        matches!(e, RematError::ParameterChanged { region, statement, shape, .. }
            if region == "blk" && statement == statement_name && shape == &[32, 32]),
        "{e:?}"
    );
}

#[test]
fn one_element_of_a_weight_changed_is_caught_saved_or_recomputed() {
    for dtype in DTYPES {
        for saved in [true, false] {
            for (row, col) in [(0, 0), (17, 5), (31, 31)] {
                let x = var(&[8, 32], 1, 1.0, dtype);
                let w = var(&[32, 32], 2, 0.2, dtype);
                let y = linear_tanh(&x, &w, saved);
                let old: f64 = w
                    .as_tensor()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec2::<f64>()
                    .unwrap()[row][col];
                set_element(&w, row, col, old + 0.25);
                let e = backward(&y).unwrap_err();
                assert_parameter_changed(&e, "h");
                assert!(e.to_string().contains("statement `h`"), "{e}");
            }
        }
    }
}

#[test]
fn the_smallest_change_of_one_element_is_caught() {
    // One unit in the last place of one element of a 32x32 weight.
    for dtype in DTYPES {
        let x = var(&[8, 32], 1, 1.0, dtype);
        let w = var(&[32, 32], 2, 0.2, dtype);
        let y = linear_tanh(&x, &w, true);
        let old = w
            .as_tensor()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec2::<f64>()
            .unwrap()[21][28];
        set_element(&w, 21, 28, next_up(old, dtype));
        assert_parameter_changed(&backward(&y).unwrap_err(), "h");
    }
}

#[test]
fn two_elements_of_a_weight_swapped_are_caught() {
    for dtype in DTYPES {
        for saved in [true, false] {
            for (a, b) in [((0, 0), (0, 1)), ((3, 7), (7, 3)), ((0, 5), (31, 5))] {
                let x = var(&[8, 32], 1, 1.0, dtype);
                let w = var(&[32, 32], 2, 0.2, dtype);
                let y = linear_tanh(&x, &w, saved);
                swap_elements(&w, a, b);
                assert_parameter_changed(&backward(&y).unwrap_err(), "h");
            }
        }
    }
}

#[test]
fn an_unchanged_weight_set_again_passes() {
    // `Var::set` with the same values: no change, no error, plain gradients.
    for dtype in DTYPES {
        let x = var(&[8, 32], 1, 1.0, dtype);
        let w = var(&[32, 32], 2, 0.2, dtype);
        let y = linear_tanh(&x, &w, true);
        w.set(&w.as_tensor().copy().unwrap()).unwrap();
        let g = backward(&y).unwrap();
        let plain = x
            .as_tensor()
            .matmul(w.as_tensor())
            .unwrap()
            .tanh()
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap();
        let pg = plain.backward().unwrap();
        assert!(rel_diff(g.get(&w).unwrap(), pg.get(&w).unwrap()) < 1e-6);
        assert!(rel_diff(g.get(&x).unwrap(), pg.get(&x).unwrap()) < 1e-6);
    }
}

/// A statement that gives its input reversed along the last dimension on
/// every call but the first: the same values in another order.
fn reversing_block(x: &Var, calls: Arc<AtomicUsize>, transposed_input: bool) -> Tensor {
    Region::new("blk")
        .run(&[x.as_tensor()], move |ctx, ins| {
            let calls = calls.clone();
            let h = if transposed_input {
                let h = ctx.recompute("h", &[&ins[0]], |t| t[0].tanh()?.t())?;
                // A saved statement between starts another unit: `order`
                // reads `h` through a leaf copy, viewed as `h` is.
                let _cut = ctx.save("cut", &[&ins[0]], |t| t[0].sum_all())?;
                h
            } else {
                ctx.save("h", &[&ins[0]], |t| t[0].tanh())?
            };
            let r = ctx.recompute("order", &[&h], move |t| {
                let n = t[0].dim(D::Minus1)?;
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    t[0].exp()
                } else {
                    let idx = Tensor::arange(0u32, n as u32, t[0].device())?
                        .affine(-1.0, (n - 1) as f64)?;
                    t[0].exp()?.index_select(&idx, D::Minus1)
                }
            })?;
            ctx.save("loss", &[&r], |t| {
                let n = t[0].dim(D::Minus1)?;
                let w = Tensor::arange(0f32, n as f32, t[0].device())?.to_dtype(t[0].dtype())?;
                t[0].broadcast_mul(&w)?.sum_all()
            })
        })
        .unwrap()
}

#[test]
fn a_replay_giving_the_same_values_in_another_order_is_caught() {
    for dtype in DTYPES {
        // Read in the forward's layout, from a saved output and through a
        // leaf copy of a transposed view read with the view's strides: both
        // compared bit for bit.
        for transposed in [false, true] {
            let x = var(&[6, 10], 3, 1.0, dtype);
            let y = reversing_block(&x, Arc::new(AtomicUsize::new(0)), transposed);
            let e = backward(&y).unwrap_err();
            assert!(
                matches!(&e, RematError::ReplayDiverged { region, statement, output: 0, bitwise, .. }
                    if region == "blk" && statement == "order" && *bitwise),
                "{dtype:?} transposed {transposed}: {e:?}"
            );
        }
    }
}

#[test]
fn a_replay_off_by_one_ulp_is_caught_where_it_is_compared_bit_for_bit() {
    // A statement that reads a counter and adds a tiny amount on the replay:
    // bit for bit, any change is caught.
    for dtype in DTYPES {
        let calls = Arc::new(AtomicUsize::new(0));
        let x = var(&[4, 8], 5, 1.0, dtype);
        let y = Region::new("blk")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let calls = calls.clone();
                let h = ctx.recompute("h", &[&ins[0]], move |t| {
                    let tiny = if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                        0.0
                    } else {
                        1e-30
                    };
                    t[0].tanh()?.affine(1.0, tiny)
                })?;
                ctx.save("loss", &[&h], |t| t[0].sqr()?.sum_all())
            })
            .unwrap();
        // 1e-30 added to values of magnitude ~0.5 changes no f32 and no
        // f64 value: no change, no error.
        assert!(backward(&y).is_ok(), "{dtype:?}");

        let calls = Arc::new(AtomicUsize::new(0));
        let y = Region::new("blk")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let calls = calls.clone();
                let h = ctx.recompute("h", &[&ins[0]], move |t| {
                    let h = t[0].tanh()?;
                    if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                        return Ok(h);
                    }
                    // The smallest change: one element one ulp up (adding
                    // the gap to the next value is exact).
                    let v = h.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                    let gap = next_up(v[13], h.dtype()) - v[13];
                    let mut delta = vec![0.0; v.len()];
                    delta[13] = gap;
                    let delta =
                        Tensor::from_vec(delta, h.shape(), h.device())?.to_dtype(h.dtype())?;
                    h + delta
                })?;
                ctx.save("loss", &[&h], |t| t[0].sqr()?.sum_all())
            })
            .unwrap();
        let e = backward(&y).unwrap_err();
        assert!(
            matches!(&e, RematError::ReplayDiverged { statement, bitwise: true, .. } if statement == "h"),
            "{dtype:?}: {e:?}"
        );
    }
}

#[derive(Clone)]
struct Masked {
    mask: Tensor,
}

remat! {
    fn masked_scores(q: &Tensor, k: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let scores = q.matmul(&k.t()?)?;
        let s = scores.broadcast_add(mask)?;
        let p = candle_nn::ops::softmax(&s, D::Minus1)?;
        let loss = (p.sqr()?.sum_all()? + s.sqr()?.sum_all()?)?;
        Ok(loss)
    }
}

remat! {
    fn masked_by_field(q: &Tensor, k: &Tensor, m: &Masked) -> candle_core::Result<Tensor> {
        let scores = q.matmul(&k.t()?)?;
        let s = scores.broadcast_add(&m.mask)?;
        let loss = s.exp()?.sum_all()?;
        Ok(loss)
    }
}

remat! {
    /// The mask copied by plain code first (`let mask = m.mask.clone();`: a
    /// handle on the same storage), then read by a saved statement, whose
    /// backward reads it again.
    fn masked_by_copy(q: &Tensor, k: &Tensor, m: &Masked) -> candle_core::Result<Tensor> {
        let mask = m.mask.clone();
        let scores = q.matmul(&k.t()?)?;
        #[save] let s = scores.broadcast_mul(&mask)?;
        let loss = s.exp()?.sum_all()?;
        Ok(loss)
    }
}

fn padding_mask(t: usize, s: usize, dtype: DType) -> Tensor {
    // 0 on the first s - 2 keys, -1e9 on the last two.
    let v: Vec<f64> = (0..t * s)
        .map(|i| if i % s >= s - 2 { -1e9 } else { 0.0 })
        .collect();
    Tensor::from_vec(v, (t, s), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

#[test]
fn one_column_of_a_mask_changed_in_place_is_caught() {
    for dtype in DTYPES {
        // Read by a recomputed statement (the replay reads it) or only by
        // saved ones (their backward reads it): caught either way.
        let plans = [
            Plan::recompute_all(),
            Plan::declared(),
            Plan::save_all(),
            Plan::save_only(["s"]),
            Plan::save_only(["s", "p", "loss"]),
        ];
        for plan in plans {
            for col in [0, 3, 7] {
                let q = var(&[6, 4], 7, 1.0, dtype);
                let k = var(&[8, 4], 8, 1.0, dtype);
                let mask = padding_mask(6, 8, dtype);
                let y = plan
                    .scope(|| masked_scores(q.as_tensor(), k.as_tensor(), &mask))
                    .unwrap();
                // One column of the mask, in place (candle's `slice_set`
                // writes into the tensor's own storage).
                let column = Tensor::full(-1e9, (6, 1), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let column = if col == 7 {
                    column.zeros_like().unwrap()
                } else {
                    column
                };
                let m = mask.narrow(1, col, 1).unwrap().contiguous().unwrap();
                assert!(
                    m.ne(&column)
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_dtype(DType::F64)
                        .unwrap()
                        .to_scalar::<f64>()
                        .unwrap()
                        > 0.0
                );
                slice_set_column(&mask, &column, col);
                let e = backward(&y).unwrap_err();
                assert!(
                    matches!(&e, RematError::InputChanged { region, index: 2, statement, name, .. }
                        if region == "masked_scores" && statement == "s"
                            && name.as_deref() == Some("mask")),
                    "{dtype:?} column {col}: {e:?}"
                );
                assert!(
                    e.to_string().contains(
                        "`mask` (input 2, shape [6, 8]) of the block, read by statement `s`"
                    ),
                    "{e}"
                );
            }
        }
    }
}

/// Writes `column` into column `col` of the 2-D `t`, in place.
fn slice_set_column(t: &Tensor, column: &Tensor, col: usize) {
    // `slice_set` writes along dimension 0: write the whole tensor back with
    // the column changed.
    let c = column
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    let new = edited(t, |rows| {
        for (r, v) in rows.iter_mut().zip(c) {
            r[col] = v;
        }
    });
    t.slice_set(&new, 0, 0).unwrap();
}

#[test]
fn a_mask_in_a_field_changed_in_place_is_caught_under_every_plan() {
    for dtype in DTYPES {
        for plan in [
            Plan::declared(),
            Plan::recompute_all(),
            Plan::save_all(),
            Plan::save_only(["s"]),
        ] {
            let q = var(&[6, 4], 7, 1.0, dtype);
            let k = var(&[8, 4], 8, 1.0, dtype);
            let m = Masked {
                mask: padding_mask(6, 8, dtype).affine(1e-9, 0.0).unwrap(),
            };
            let y = plan
                .scope(|| masked_by_field(q.as_tensor(), k.as_tensor(), &m))
                .unwrap();
            let column = Tensor::full(-3.0, (6, 1), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            slice_set_column(&m.mask, &column, 2);
            let e = backward(&y).unwrap_err();
            assert!(
                matches!(&e, RematError::FieldChanged { region, statement, field, shape }
                    if region == "masked_by_field" && statement == "s" && field == "m.mask"
                        && shape == &[6, 8]),
                "{dtype:?} {plan}: {e:?}"
            );
        }
    }
}

/// A field copied by plain code (`let mask = m.mask.clone();`) and read by
/// a saved statement is checked as a field read in place is: written in
/// place between the forward and the backward, it is `FieldChanged` naming
/// the copy, under every plan (saving plans gave a wrong gradient, silently).
#[test]
fn a_field_copied_by_plain_code_and_changed_in_place_is_caught_under_every_plan() {
    for dtype in DTYPES {
        for plan in [
            Plan::declared(),
            Plan::recompute_all(),
            Plan::save_all(),
            Plan::budget(0.5),
        ] {
            let q = var(&[6, 4], 7, 1.0, dtype);
            let k = var(&[8, 4], 8, 1.0, dtype);
            let m = Masked {
                mask: tensor(&[6, 8], 9, 1.0, dtype),
            };
            let y = plan
                .scope(|| masked_by_copy(q.as_tensor(), k.as_tensor(), &m))
                .unwrap();
            let column = Tensor::full(-3.0, (6, 1), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            slice_set_column(&m.mask, &column, 2);
            let e = backward(&y).unwrap_err();
            assert!(
                matches!(&e, RematError::FieldChanged { region, statement, field, .. }
                    if region == "masked_by_copy" && statement == "mask" && field == "m.mask"),
                "{dtype:?} {plan}: {e:?}"
            );
        }
    }
}

/// Rotary tables as candle-transformers keeps them, in a struct of their own.
#[derive(Clone)]
struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

/// A layer with constants in its fields, neither block inputs nor
/// parameters, each read by candle's own ops (whose backward reads them
/// again): an additive bias, rotary tables in a nested struct, per-layer
/// scales in a `Vec`, an optional mask, a frozen weight that shares its
/// storage with a `Var` (a detached view of it).
#[derive(Clone)]
struct Constants {
    w: Var,
    bias: Tensor,
    rotary: Rotary,
    scales: Vec<Tensor>,
    mask: Option<Tensor>,
    frozen: Tensor,
    shared: Arc<Tensor>,
    tables: HashMap<String, Tensor>,
    boxed: Box<Tensor>,
    levels: BTreeMap<usize, Tensor>,
    pair: [Tensor; 2],
}

const FIELDS: [&str; 11] = [
    "self.bias",
    "self.rotary.cos",
    "self.rotary.sin",
    "self.scales",
    "self.mask",
    "self.frozen",
    "self.shared",
    "self.tables",
    "self.boxed",
    "self.levels",
    "self.pair",
];

impl Constants {
    /// `frozen` shares the storage of `source`.
    fn new(dtype: DType, source: &Var) -> Self {
        let (t, d) = (5, 4);
        Constants {
            w: var(&[d, d], 31, 0.5, dtype),
            bias: tensor(&[t, t], 32, 1.0, dtype),
            rotary: Rotary {
                cos: tensor(&[t, d], 33, 1.0, dtype),
                sin: tensor(&[t, d], 34, 1.0, dtype),
            },
            scales: vec![tensor(&[t], 35, 1.0, dtype), tensor(&[t], 36, 1.0, dtype)],
            mask: Some(tensor(&[t, t], 37, 1.0, dtype)),
            frozen: source.as_tensor().detach(),
            shared: Arc::new(tensor(&[d], 40, 1.0, dtype)),
            tables: [("gate", 41), ("up", 42)]
                .into_iter()
                .map(|(k, seed)| (k.to_string(), tensor(&[d], seed, 1.0, dtype)))
                .collect(),
            boxed: Box::new(tensor(&[d], 43, 1.0, dtype)),
            levels: (1..4)
                .map(|l| (l, tensor(&[d], 43 + l as u64, 1.0, dtype)))
                .collect(),
            pair: [tensor(&[d], 47, 1.0, dtype), tensor(&[d], 48, 1.0, dtype)],
        }
    }

    /// The same ops as `forward`, without a region.
    fn plain(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.matmul(self.w.as_tensor())?;
        let r = (h.broadcast_mul(&self.rotary.cos)? + h.broadcast_mul(&self.rotary.sin)?)?;
        let s = r.matmul(&h.t()?)?.broadcast_add(&self.bias)?;
        let m = match &self.mask {
            Some(m) => s.mul(m)?,
            None => s,
        };
        let z = m.broadcast_mul(&self.scales[1])?.matmul(&h)?;
        let f = z.matmul(&self.frozen)?;
        let e = f
            .broadcast_mul(&self.shared)?
            .broadcast_add(&self.tables["gate"])?
            .broadcast_mul(&self.boxed)?
            .broadcast_add(&self.levels[&2])?
            .broadcast_mul(&self.pair[1])?;
        e.tanh()?.sqr()?.sum_all()
    }

    remat! {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            let h = x.matmul(self.w.as_tensor())?;
            let r = (h.broadcast_mul(&self.rotary.cos)? + h.broadcast_mul(&self.rotary.sin)?)?;
            let s = r.matmul(&h.t()?)?.broadcast_add(&self.bias)?;
            let m = match &self.mask {
                Some(m) => s.mul(m)?,
                None => s,
            };
            let z = m.broadcast_mul(&self.scales[1])?.matmul(&h)?;
            let f = z.matmul(&self.frozen)?;
            let e = f
                .broadcast_mul(&self.shared)?
                .broadcast_add(&self.tables["gate"])?
                .broadcast_mul(&self.boxed)?
                .broadcast_add(&self.levels[&2])?
                .broadcast_mul(&self.pair[1])?;
            Ok(e.tanh()?.sqr()?.sum_all()?)
        }
    }
}

/// Each of a layer's constant fields written in place between the forward
/// and the backward (`slice_set`, or `Var::set` on the variable whose
/// storage it shares) is an error naming the region, the field and the
/// first statement reading it (an indexed field, `self.scales[1]`, is
/// checked whole; fields behind an `Arc` or a `Box`, in a map or an array
/// too), under every plan, saved statements
/// included (their backward would read the new values: plain candle's
/// gradients would be silently wrong); unchanged, or given a new tensor
/// instead, every gradient is plain candle's.
#[test]
fn constants_held_in_fields_changed_in_place_are_caught_under_every_plan() {
    let plans = || {
        [
            Plan::declared(),
            Plan::recompute_all(),
            Plan::save_all(),
            Plan::save_only(["h", "s"]),
            Plan::budget(0.5),
        ]
    };
    let statements = ["s", "r", "r", "z", "m", "f", "e", "e", "e", "e", "e"];
    for dtype in DTYPES {
        let x = var(&[5, 4], 30, 1.0, dtype);
        for plan in plans() {
            // Unchanged: plain candle's gradients.
            let source = var(&[4, 4], 38, 0.5, dtype);
            let c = Constants::new(dtype, &source);
            let y = plan.scope(|| c.forward(x.as_tensor())).unwrap();
            let g = backward(&y).unwrap();
            let g_ref = c.plain(x.as_tensor()).unwrap().backward().unwrap();
            for v in [&x, &c.w] {
                let d = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
                assert!(d <= 1e-6, "{dtype:?} {plan}: {d}");
            }
            // A field given a new tensor after the forward: the region
            // kept its own copy of the layer, so nothing changed for it.
            let mut c2 = c.clone();
            let y = plan.scope(|| c2.forward(x.as_tensor())).unwrap();
            c2.bias = c2.bias.affine(2.0, 1.0).unwrap();
            let g = backward(&y).unwrap();
            let d = rel_diff(g.get(&c.w).unwrap(), g_ref.get(&c.w).unwrap());
            assert!(d <= 1e-6, "{dtype:?} {plan}: {d}");

            for (i, field) in FIELDS.iter().enumerate() {
                let source = var(&[4, 4], 38, 0.5, dtype);
                let c = Constants::new(dtype, &source);
                let y = plan.scope(|| c.forward(x.as_tensor())).unwrap();
                let t = match i {
                    0 => &c.bias,
                    1 => &c.rotary.cos,
                    2 => &c.rotary.sin,
                    3 => &c.scales[1],
                    4 => c.mask.as_ref().unwrap(),
                    5 => &c.frozen,
                    6 => &c.shared,
                    7 => &c.tables["gate"],
                    8 => &c.boxed,
                    9 => &c.levels[&2],
                    _ => &c.pair[1],
                };
                // One element up by a quarter, in place.
                let bumped = {
                    let v = t.to_dtype(DType::F64).unwrap();
                    let one = v.flatten_all().unwrap().narrow(0, 0, 1).unwrap();
                    let one = (one + 0.25).unwrap().reshape(vec![1; t.rank()]).unwrap();
                    v.slice_assign(&vec![0..1; t.rank()], &one)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                if i == 5 {
                    source.set(&bumped).unwrap();
                } else {
                    t.slice_set(&bumped, 0, 0).unwrap();
                }
                let e = backward(&y).unwrap_err();
                assert!(
                    matches!(&e, RematError::FieldChanged { region, statement, field: f, shape }
                        if region == "Constants::forward" && statement == statements[i]
                            && f == field && shape == t.dims()),
                    "{dtype:?} {plan} {field}: {e:?}"
                );
                let text = e.to_string();
                assert!(text.contains(&format!("`{field}`")), "{text}");
            }
        }
    }
}

/// An attention layer as candle-transformers writes one, its additive
/// bias (ALiBi, a relative-position table) and rotary tables held in
/// fields: neither a block argument nor a parameter.
#[derive(Clone)]
struct Tables {
    wq: Var,
    bias: Tensor,
    cos: Tensor,
    sin: Tensor,
}

impl Tables {
    fn new(dtype: DType) -> Self {
        let (t, d) = (6, 8);
        Tables {
            wq: var(&[d * 2, d * 2], 21, 0.3, dtype),
            bias: tensor(&[2, t, t], 22, 1.0, dtype),
            cos: tensor(&[t, d / 2], 23, 1.0, dtype),
            sin: tensor(&[t, d / 2], 24, 1.0, dtype),
        }
    }
}

impl Tables {
    remat! {
        fn attend(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            let q = x.matmul(&self.wq)?.reshape((1, 6, 2, 8))?.transpose(1, 2)?;
            let r = remat_runtime::nn::rope(&q.contiguous()?, &self.cos, &self.sin)?;
            let a = remat_runtime::nn::attention(&r, &r, &r, false, Some(&self.bias))?;
            let y = a.tanh()?.sum_all()?;
            Ok(y)
        }
    }
}

/// A fused op's untracked argument that its backward reads again (an
/// attention bias, rotary tables), held in a field and written in place
/// between the forward and the backward: an error naming the op and the
/// argument outside any region, and in a region the region, the field and
/// the statement, under every plan, never a silent gradient; unchanged, every
/// gradient is plain candle's (the same ops without a region).
#[test]
fn a_fused_op_s_kept_bias_or_table_changed_in_place_is_caught() {
    for dtype in DTYPES {
        let x = var(&[6, 16], 25, 1.0, dtype);
        for plan in [
            Plan::off(),
            Plan::declared(),
            Plan::recompute_all(),
            Plan::save_all(),
            Plan::save_only(["a"]),
        ] {
            // Unchanged: the gradients of the same code run plain.
            let p = Tables::new(dtype);
            let y = plan.scope(|| p.attend(x.as_tensor())).unwrap();
            let g = backward(&y).unwrap();
            let y_ref = Plan::off().scope(|| p.attend(x.as_tensor())).unwrap();
            let g_ref = backward(&y_ref).unwrap();
            for v in [&x, &p.wq] {
                let d = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
                assert!(d <= 1e-6, "{dtype:?} {plan}: {d}");
            }
            for (what, table) in [("the mask", 0), ("the cos table", 1), ("the sin table", 2)] {
                let p = Tables::new(dtype);
                let y = plan.scope(|| p.attend(x.as_tensor())).unwrap();
                let t = [&p.bias, &p.cos, &p.sin][table];
                // One element, in place.
                let first = t.flatten_all().unwrap().narrow(0, 0, 1).unwrap();
                let bumped = (first + 0.5).unwrap().reshape(vec![1; t.rank()]).unwrap();
                let mut edited = t.to_dtype(DType::F64).unwrap();
                edited = edited
                    .slice_assign(&vec![0..1; t.rank()], &bumped.to_dtype(DType::F64).unwrap())
                    .unwrap();
                t.slice_set(&edited.to_dtype(dtype).unwrap(), 0, 0).unwrap();
                let e = backward(&y).unwrap_err().to_string();
                let what_ = format!("{dtype:?} {plan}, {what}: {e}");
                assert!(e.contains("changed between"), "{what_}");
                if plan.is_off() {
                    // The op's own check names the op's argument.
                    assert!(e.contains(&format!("{what} [")), "{what_}");
                } else {
                    // The region's check of the fields the block reads
                    // comes first, and names the field.
                    let field = ["`self.bias`", "`self.cos`", "`self.sin`"][table];
                    assert!(e.contains("region `Tables::attend`"), "{what_}");
                    assert!(e.contains(field), "{what_}");
                }
            }
        }
    }
}

// A block whose recomputed statements read views across units: a
// transposed block input, the transpose of a saved output, a narrow.
remat! {
    fn views(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        #[save] let h = x.t()?.matmul(w)?.t()?;
        let a = h.sum_keepdim(1)?;
        let b = h.narrow(0, 1, 2)?.exp()?;
        #[save] let c = b.t()?;
        let d = (c.sqr()?.sum_all()? + a.tanh()?.sum_all()?)?;
        let e = x.t()?.sum_keepdim(0)?.sqr()?.sum_all()?;
        Ok((d + e)?)
    }
}

fn plain_views(x: &Tensor, w: &Tensor) -> Tensor {
    let h = x.t().unwrap().matmul(w).unwrap().t().unwrap();
    let a = h.sum_keepdim(1).unwrap();
    let b = h.narrow(0, 1, 2).unwrap().exp().unwrap();
    let c = b.t().unwrap();
    let d = (c.sqr().unwrap().sum_all().unwrap() + a.tanh().unwrap().sum_all().unwrap()).unwrap();
    let e = x
        .t()
        .unwrap()
        .sum_keepdim(0)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    (d + e).unwrap()
}

#[test]
fn legitimate_replays_over_views_and_copies_pass_in_every_dtype_and_plan() {
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for plan in [
            Plan::recompute_all(),
            Plan::declared(),
            Plan::save_all(),
            Plan::save_only(["a"]),
        ] {
            // The block's input is itself a view (a transpose).
            let x0 = var(&[7, 5], 11, 0.5, dtype);
            let w = var(&[5, 6], 12, 0.5, dtype);
            let x = x0.as_tensor().t().unwrap();
            let y = plan.scope(|| views(&x, w.as_tensor())).unwrap();
            let g = backward(&y).unwrap_or_else(|e| panic!("{dtype:?} {plan}: {e}"));
            let pg = plain_views(&x, w.as_tensor()).backward().unwrap();
            // bf16/f16: the same ops in the same order as plain candle.
            for v in [&x0, &w] {
                let d = rel_diff(g.get(v).unwrap(), pg.get(v).unwrap());
                assert!(d < 1e-6, "{dtype:?} {plan}: {d}");
            }
        }
    }
}

#[test]
fn repeated_steps_with_parameter_updates_between_them_pass() {
    // The usual loop: forward, backward, update; the next forward sees the
    // new weights and its replay checks against them.
    for dtype in DTYPES {
        let x = var(&[8, 32], 1, 1.0, dtype);
        let w = var(&[32, 32], 2, 0.2, dtype);
        for step in 0..3 {
            for saved in [true, false] {
                let y = linear_tanh(&x, &w, saved);
                let g = backward(&y).unwrap_or_else(|e| panic!("step {step}: {e}"));
                let gw = g.get(&w).unwrap().clone();
                w.set(&(w.as_tensor() - (gw * 1e-3).unwrap()).unwrap())
                    .unwrap();
            }
        }
    }
}

#[test]
fn a_block_input_unchanged_but_read_through_a_view_passes() {
    // The input is a narrow of a bigger tensor whose other rows change after
    // the forward: the block's input itself did not change.
    for dtype in DTYPES {
        let big = tensor(&[10, 8], 21, 1.0, dtype);
        let x = Var::from_tensor(&tensor(&[4, 8], 22, 1.0, dtype)).unwrap();
        let mask = big.narrow(0, 2, 4).unwrap();
        let y = Plan::recompute_all()
            .scope(|| masked_scores(x.as_tensor(), x.as_tensor(), &mask.narrow(1, 0, 4).unwrap()))
            .unwrap();
        let other = Tensor::ones((2, 8), dtype, &Device::Cpu).unwrap();
        big.slice_set(&other, 0, 8).unwrap();
        assert!(backward(&y).is_ok(), "{dtype:?}");
    }
}

remat! {
    /// A gated projection: the weight comes in as a block input (a `Var`
    /// handed over as `&Tensor`, as `Linear::new(w, b)` users do).
    fn gated_projection(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.matmul(w)?;
        let gate = h.tanh()?;
        let y = (&gate * &h)?.sum_keepdim(1)?;
        Ok(y)
    }
}

/// Block inputs that need gradients, changed in place between the forward
/// and the backward (an optimizer step on the `Var` handed in, `slice_set`
/// on a tracked activation): `InputChanged` naming them under every plan.
/// Saving plans keep copies of such inputs for the saved statements'
/// backward; that backward then gave the gradient of the values before the
/// change, where plain candle's reads the new ones: a silent difference.
#[test]
fn tracked_block_inputs_changed_in_place_are_caught_under_every_plan() {
    for dtype in DTYPES {
        for plan in [
            Plan::declared(),
            Plan::recompute_all(),
            Plan::save_all(),
            Plan::budget(0.5),
            Plan::budget_bytes(0),
            Plan::save_only(["h"]),
            Plan::save_only(["gate", "y"]),
        ] {
            for changed in ["w", "x"] {
                let x0 = var(&[5, 6], 31, 1.0, dtype);
                let w = var(&[6, 4], 32, 0.5, dtype);
                // A tracked activation, not a `Var`.
                let x = (x0.as_tensor() * 2.0).unwrap();
                let y = plan.scope(|| gated_projection(&x, w.as_tensor())).unwrap();
                let loss = y.sqr().unwrap().sum_all().unwrap();
                match changed {
                    // An SGD step from another loss before this backward.
                    "w" => w.set(&(w.as_tensor() * 0.9).unwrap()).unwrap(),
                    _ => x
                        .slice_set(&x.narrow(0, 2, 1).unwrap().neg().unwrap(), 0, 0)
                        .unwrap(),
                }
                let e = backward(&loss)
                    .err()
                    .unwrap_or_else(|| panic!("{dtype:?} {plan} `{changed}`: no error"));
                let index = usize::from(changed == "w");
                assert!(
                    matches!(&e, RematError::InputChanged { region, index: i, name, .. }
                        if region == "gated_projection" && *i == index
                            && name.as_deref() == Some(changed)),
                    "{dtype:?} {plan} `{changed}`: {e:?}"
                );
            }
        }
    }
}
