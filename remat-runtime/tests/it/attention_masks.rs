//! Masks of `nn::attention` and `nn::attention_qkv` (issue #24, section 2):
//! huge finite mask values, tracked masks, every broadcastable shape, and
//! rows masked with `-inf` on every key.
//!
//! References: plain candle (`q k^T / sqrt(D)`, `broadcast_add` of the
//! mask, `candle_nn::ops::softmax`, the differentiable one, `matmul` with
//! `v`), and f64 central differences of our op's own loss.
//!
//! Tolerances, each relative to the reference tensor's largest element
//! (absolute when the reference is all zeros up to rounding, see `rel`):
//! * f32 against plain candle, `F32` = 1e-5: the same formulas
//!   reassociated (blocked products, `P` rebuilt as `exp(s - max) * (1 /
//!   l)`, mask gradients summed in another order): f32 rounding (6e-8)
//!   accumulated over sums of at most a few hundred terms; the largest seen
//!   is 9e-7.
//! * f64 against plain candle, `F64` = 1e-13: the same at f64's 1.1e-16 (a
//!   factor 50 over the largest seen, 2e-15).
//! * f64 central differences with step 1e-5, `FD` = 1e-7: truncation h^2 |f'''| ~
//!   1e-10 and rounding 1e-16 |L| / h ~ 1e-10 per element; the largest
//!   seen is 2e-8 (a mask gradient that is 0, against the 1e-3 floor).
//! * bf16 and f16: see `half_precision_inputs`.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use remat_runtime::nn;

const F32: f64 = 1e-5;
const F64: f64 = 1e-13;
const FD: f64 = 1e-7;

/// Plain candle: `softmax(q k^T / sqrt(D) + mask [+ causal]) v`.
fn plain(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    is_causal: bool,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let (_, h, t, d) = q.dims4()?;
    let (_, hkv, s, _) = k.dims4()?;
    let (k, v) = (repeat_kv(k, h / hkv)?, repeat_kv(v, h / hkv)?);
    let mut sc = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?;
    if let Some(m) = mask {
        sc = sc.broadcast_add(m)?;
    }
    if is_causal {
        sc = sc.broadcast_add(&causal_mask_over(t, s, q.dtype()))?;
    }
    candle_nn::ops::softmax(&sc, D::Minus1)?.matmul(&v)
}

fn ours(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    is_causal: bool,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    nn::attention(q, k, v, is_causal, mask)
}

type Attn = dyn Fn(&Tensor, &Tensor, &Tensor, bool, Option<&Tensor>) -> Result<Tensor>;

/// One call: inputs, mask, causality, whether the mask is a `Var`.
#[derive(Clone)]
struct Case {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Option<Tensor>,
    causal: bool,
    track_mask: bool,
}

impl Case {
    /// Random `q` `(B, H, T, D)`, `k`, `v` `(B, Hkv, S, D)`, entries in
    /// [-1, 1]: scores stay within +-sqrt(D), far from the rounding grid of
    /// a huge mask value (64 at 1e9 in f32).
    fn new(dtype: DType, (b, h, hkv, t, s, d): (usize, usize, usize, usize, usize, usize)) -> Self {
        Case {
            q: tensor(&[b, h, t, d], 1, 1.0, dtype),
            k: tensor(&[b, hkv, s, d], 2, 1.0, dtype),
            v: tensor(&[b, hkv, s, d], 3, 1.0, dtype),
            mask: None,
            causal: false,
            track_mask: false,
        }
    }

    fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    fn mask(mut self, m: Tensor, tracked: bool) -> Self {
        self.mask = Some(m);
        self.track_mask = tracked;
        self
    }

    fn to_dtype(&self, dtype: DType) -> Self {
        let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
        Case {
            q: c(&self.q),
            k: c(&self.k),
            v: c(&self.v),
            mask: self.mask.as_ref().map(c),
            ..self.clone()
        }
    }
}

/// The fixed weights of the loss `sum(y * W)`.
fn weights(y: &Tensor) -> Tensor {
    tensor(y.dims(), 99, 1.0, y.dtype())
}

/// Output and gradients `[dq, dk, dv, (dmask)]` of `sum(f(case) * W)`.
fn run(f: &Attn, c: &Case) -> (Tensor, Vec<Tensor>) {
    let var = |t: &Tensor| Var::from_tensor(t).unwrap();
    let (q, k, v) = (var(&c.q), var(&c.k), var(&c.v));
    let mask_var = c.mask.as_ref().filter(|_| c.track_mask).map(var);
    let mask = match &mask_var {
        Some(m) => Some(m.as_tensor().clone()),
        None => c.mask.clone(),
    };
    let y = f(&q, &k, &v, c.causal, mask.as_ref()).unwrap();
    let g = (&y * weights(&y))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let mut gs = vec![
        g.get(&q).expect("dq").clone(),
        g.get(&k).expect("dk").clone(),
        g.get(&v).expect("dv").clone(),
    ];
    if let Some(m) = &mask_var {
        gs.push(g.get(m).expect("the mask's gradient").clone());
    }
    (y, gs)
}

fn amax(t: &Tensor) -> f64 {
    f64s(t).iter().fold(0f64, |a, b| a.max(b.abs()))
}

/// `rel_diff`, absolute when the reference is below 1e-6 everywhere (a mask
/// broadcast over the keys has gradient 0 in exact arithmetic; plain candle
/// gives rounding noise there). Refuses NaN.
fn rel(a: &Tensor, r: &Tensor) -> f64 {
    assert!(f64s(a).iter().all(|x| !x.is_nan()), "NaN in {a}");
    if amax(r) < 1e-6 {
        amax(&(a.to_dtype(DType::F64).unwrap() - r.to_dtype(DType::F64).unwrap()).unwrap())
    } else {
        rel_diff(a, r)
    }
}

/// The largest [`rel`] of the outputs and of each gradient.
fn worst(a: &(Tensor, Vec<Tensor>), r: &(Tensor, Vec<Tensor>)) -> f64 {
    assert_eq!(a.1.len(), r.1.len());
    a.1.iter()
        .zip(&r.1)
        .fold(rel(&a.0, &r.0), |w, (x, y)| w.max(rel(x, y)))
}

/// Ours against plain candle, in `c`'s dtype, within `tol`.
fn against_plain(c: &Case, tol: f64, what: &str) {
    let err = worst(&run(&ours, c), &run(&plain, c));
    assert!(err <= tol, "{what}: {err:e} > {tol:e} against plain candle");
}

/// The largest error of our analytic gradients (f64) against central
/// differences of our loss, relative to each gradient's largest element.
fn finite_differences(c: &Case) -> f64 {
    let (_, analytic) = run(&ours, c);
    let loss = |c: &Case| -> f64 {
        let y = ours(&c.q, &c.k, &c.v, c.causal, c.mask.as_ref()).unwrap();
        (&y * weights(&y))
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let mut worst = 0f64;
    for (i, g) in analytic.iter().enumerate() {
        let input = [&c.q, &c.k, &c.v, c.mask.as_ref().unwrap_or(&c.q)][i];
        // Floored at 1e-3: a mask broadcast over the keys has gradient 0,
        // and rounding of the loss (1e-16 |L| / h) is all the differences
        // see there. A `-inf` entry moved stays `-inf` (its NaN quotient
        // counts as 0).
        let (err, _, _) = worst_difference(
            &f64s(input),
            &f64s(g),
            1e-3,
            Quotient::Central(1e-5),
            |moved| {
                let t = Tensor::from_vec(moved, input.shape(), &Device::Cpu).unwrap();
                let mut c = c.clone();
                match i {
                    0 => c.q = t,
                    1 => c.k = t,
                    2 => c.v = t,
                    _ => c.mask = Some(t),
                }
                loss(&c)
            },
        );
        worst = worst.max(err);
    }
    worst
}

fn check_fd(c: &Case, what: &str) {
    let err = finite_differences(c);
    assert!(
        err <= FD,
        "{what}: {err:e} > {FD:e} against finite differences"
    );
}

/// A masked_fill-style `(B, 1, T, S)` mask: small random biases, query row 1
/// of batch 0 `fill` on every key, the last two keys of batch 1 `fill` on
/// every row, key 0 of row 3 of batch 0 `fill`.
fn padding_mask(b: usize, t: usize, s: usize, fill: f64, dtype: DType) -> Tensor {
    let mut m = lcg(b * t * s, 7, 0.5);
    for j in 0..s {
        m[s + j] = fill;
    }
    if b > 1 {
        for i in 0..t {
            m[t * s + i * s + s - 2] = fill;
            m[t * s + i * s + s - 1] = fill;
        }
    }
    m[3 * s] = fill;
    Tensor::from_vec(m, (b, 1, t, s), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

// 1. Huge finite mask values.

#[test]
fn a_row_masked_with_minus_1e9_on_every_key_matches_plain_candle_in_f32() {
    // The example: before the fix dq of such a row was off by a
    // relative 5.0 (p = 1 instead of 1/6 on each of the 6 keys), silently.
    for (hkv, t, s, is_causal) in [
        (2, 5, 6, false),
        (2, 5, 6, true),
        (1, 5, 6, true),
        (2, 70, 72, true),
        (2, 70, 70, false),
    ] {
        let mask = padding_mask(2, t, s, -1e9, DType::F32);
        let c = Case::new(DType::F32, (2, 2, hkv, t, s, 3))
            .causal(is_causal)
            .mask(mask, false);
        let what = format!("-1e9, T {t}, S {s}, Hkv {hkv}, causal {is_causal}");
        against_plain(&c, F32, &what);
        // Plain candle's row is uniform over the keys: the row's output is
        // the mean of the values of each head.
        if !is_causal && hkv == 2 {
            let y = ours(&c.q, &c.k, &c.v, false, c.mask.as_ref()).unwrap();
            let row = y.narrow(0, 0, 1).unwrap().narrow(2, 1, 1).unwrap();
            let mean = c.v.narrow(0, 0, 1).unwrap().mean_keepdim(2).unwrap();
            assert!(rel(&row, &mean) <= F32, "{what}: not the mean of v");
        }
    }
}

#[test]
fn a_row_masked_with_minus_1e30_on_every_key_matches_plain_candle_in_f64() {
    // The f64 example: before the fix a relative 2.89, silently.
    for (hkv, is_causal) in [(2, false), (2, true), (1, false)] {
        let mask = padding_mask(2, 5, 6, -1e30, DType::F64);
        let c = Case::new(DType::F64, (2, 2, hkv, 5, 6, 3))
            .causal(is_causal)
            .mask(mask, false);
        against_plain(&c, F64, &format!("-1e30, Hkv {hkv}, causal {is_causal}"));
    }
}

#[test]
fn any_finite_mask_value_matches_plain_candle() {
    let f32s = [
        -1e9,
        -1e30,
        f32::MIN as f64,
        -(f32::MAX as f64) / 2.0,
        1e9,
        f32::MAX as f64 / 2.0,
    ];
    let f64s = [
        -1e30,
        -1e300,
        f64::MIN,
        -f64::MAX / 2.0,
        1e30,
        f64::MAX / 2.0,
    ];
    for (dtype, fills, tol) in [(DType::F32, &f32s, F32), (DType::F64, &f64s, F64)] {
        for &fill in fills {
            for (is_causal, tracked) in [(false, false), (true, false), (false, true), (true, true)]
            {
                let c = Case::new(dtype, (2, 2, 1, 5, 6, 3))
                    .causal(is_causal)
                    .mask(padding_mask(2, 5, 6, fill, dtype), tracked);
                let what = format!("{dtype:?} {fill:e}, causal {is_causal}, tracked {tracked}");
                against_plain(&c, tol, &what);
            }
        }
    }
}

#[test]
fn attention_qkv_with_a_minus_1e9_padding_row_matches_plain_candle() {
    const HEADS: usize = 2;
    for (dtype, fill, tol) in [(DType::F32, -1e9, F32), (DType::F64, -1e30, F64)] {
        for is_causal in [false, true] {
            let mask = padding_mask(2, 5, 5, fill, dtype);
            for tracked in [false, true] {
                let err = qkv_against_plain(dtype, 5, HEADS, is_causal, &mask, tracked);
                assert!(
                    err <= tol,
                    "{dtype:?} causal {is_causal} tracked {tracked}: {err:e}"
                );
            }
        }
    }
}

/// `attention_qkv` against plain candle on the same packed `(B, T, 3 C)`
/// projection split with candle's views (2 batches, heads of 3).
fn qkv_against_plain(
    dtype: DType,
    t: usize,
    heads: usize,
    is_causal: bool,
    mask: &Tensor,
    tracked: bool,
) -> f64 {
    let c3 = 3 * heads * 3;
    let qkv = tensor(&[2, t, c3], 5, 1.0, dtype);
    let split_plain = move |x: &Tensor, m: Option<&Tensor>| -> Result<Tensor> {
        let c = c3 / 3;
        let part = |i: usize| {
            x.narrow(2, i * c, c)?
                .reshape((2, t, heads, 3))?
                .transpose(1, 2)?
                .contiguous()
        };
        let y = plain(&part(0)?, &part(1)?, &part(2)?, is_causal, m)?;
        y.transpose(1, 2)?.reshape((2, t, c))
    };
    let go = |f: &dyn Fn(&Tensor, Option<&Tensor>) -> Result<Tensor>| {
        let x = Var::from_tensor(&qkv).unwrap();
        let m = tracked.then(|| Var::from_tensor(mask).unwrap());
        let mt = m.as_ref().map_or(mask.clone(), |m| m.as_tensor().clone());
        let y = f(&x, Some(&mt)).unwrap();
        let g = (&y * weights(&y))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut gs = vec![g.get(&x).unwrap().clone()];
        if let Some(m) = &m {
            gs.push(g.get(m).expect("the mask's gradient").clone());
        }
        (y, gs)
    };
    let a = go(&|x, m| nn::attention_qkv(x, heads, is_causal, m));
    let r = go(&split_plain);
    worst(&a, &r)
}

// 2. Tracked masks.

/// Mask shapes that broadcast to `(B, H, T, S)` = `(2, 4, 5, 6)`.
const SHAPES: &[&[usize]] = &[
    &[6],
    &[5, 6],
    &[1, 6],
    &[1, 1, 5, 6],
    &[2, 1, 1, 6],
    &[2, 1, 5, 6],
    &[2, 4, 5, 6],
    &[4, 5, 6],
    &[1, 4, 1, 6],
    &[4, 1, 1],
    &[5, 1],
    &[],
];

#[test]
fn a_tracked_mask_of_every_broadcastable_shape_gets_its_gradient() {
    // 4 query heads over 2 key/value heads.
    for &shape in SHAPES {
        for is_causal in [false, true] {
            let what = format!("mask {shape:?}, causal {is_causal}");
            let c = Case::new(DType::F64, (2, 4, 2, 5, 6, 3))
                .causal(is_causal)
                .mask(tensor(shape, 11, 1.0, DType::F64), true);
            check_fd(&c, &what);
            against_plain(&c, F64, &what);
            against_plain(&c.to_dtype(DType::F32), F32, &what);
            // The same mask untracked: the same output and q, k, v
            // gradients, and no gradient for the mask.
            let mut untracked = c.clone();
            untracked.track_mask = false;
            against_plain(&untracked, F64, &what);
        }
    }
}

#[test]
fn a_tracked_mask_over_two_blocks_of_query_rows() {
    // T = 70 spans two blocks of 64 rows: the mask's gradient is one term
    // per block (masks with rows) or their sum (masks without), and under
    // causal masking the first block reads fewer keys than the mask has.
    for shape in [
        &[70usize, 72][..],
        &[72],
        &[2, 1, 70, 72],
        &[2, 1, 1, 72],
        &[1, 2, 70, 1],
    ] {
        for is_causal in [false, true] {
            let what = format!("mask {shape:?}, causal {is_causal}");
            let c = Case::new(DType::F32, (2, 2, 1, 70, 72, 4))
                .causal(is_causal)
                .mask(tensor(shape, 12, 1.0, DType::F32), true);
            against_plain(&c, F32, &what);
            against_plain(&c.to_dtype(DType::F64), F64, &what);
        }
    }
}

#[test]
fn a_mask_computed_from_a_var_gets_its_gradient() {
    // ALiBi: per-head slopes (a Var) times -|i - j|, `(H, T, S)`; and a
    // learned relative-position bias: a table (a Var) indexed by i - j.
    let (t, s, h) = (5, 6, 4);
    let dist: Vec<f64> = (0..t * s)
        .map(|x| -((x / s) as f64 - (x % s) as f64).abs())
        .collect();
    let idx: Vec<u32> = (0..t * s).map(|x| (x % s + t - 1 - x / s) as u32).collect();
    for dtype in [DType::F32, DType::F64] {
        let dist = Tensor::from_vec(dist.clone(), (t, s), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let idx = Tensor::from_vec(idx.clone(), t * s, &Device::Cpu).unwrap();
        let slopes = tensor(&[h], 21, 1.0, dtype);
        let table = tensor(&[t + s - 1], 22, 1.0, dtype);
        let alibi = |p: &Tensor| p.reshape((h, 1, 1))?.broadcast_mul(&dist);
        let relative = |p: &Tensor| p.index_select(&idx, 0)?.reshape((t, s));
        type Build<'a> = &'a dyn Fn(&Tensor) -> Result<Tensor>;
        let builders: [(&str, &Tensor, Build); 2] = [
            ("alibi", &slopes, &alibi),
            ("relative bias", &table, &relative),
        ];
        for (name, param, build) in builders {
            for is_causal in [false, true] {
                let c = Case::new(dtype, (2, h, 2, t, s, 3)).causal(is_causal);
                let go = |f: &Attn| {
                    let p = Var::from_tensor(param).unwrap();
                    let (q, k, v) = (
                        Var::from_tensor(&c.q).unwrap(),
                        Var::from_tensor(&c.k).unwrap(),
                        Var::from_tensor(&c.v).unwrap(),
                    );
                    let y = f(&q, &k, &v, is_causal, Some(&build(&p).unwrap())).unwrap();
                    let g = (&y * weights(&y))
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let gs = [&q, &k, &v, &p].map(|x| g.get(x).expect("a gradient").clone());
                    (y, gs.to_vec())
                };
                let err = worst(&go(&ours), &go(&plain));
                let tol = if dtype == DType::F32 { F32 } else { F64 };
                assert!(err <= tol, "{name} {dtype:?} causal {is_causal}: {err:e}");
                if dtype == DType::F64 {
                    // Central differences on the parameter through the
                    // mask it builds.
                    let analytic = f64s(&go(&ours).1[3]);
                    let scale = analytic.iter().fold(0f64, |a, b| a.max(b.abs()));
                    let base = f64s(param);
                    for j in 0..base.len() {
                        let at = |d: f64| {
                            let mut moved = base.clone();
                            moved[j] += d;
                            let p = Tensor::from_vec(moved, param.shape(), &Device::Cpu).unwrap();
                            let y = ours(&c.q, &c.k, &c.v, is_causal, Some(&build(&p).unwrap()))
                                .unwrap();
                            (&y * weights(&y))
                                .unwrap()
                                .sum_all()
                                .unwrap()
                                .to_scalar::<f64>()
                                .unwrap()
                        };
                        let numeric = (at(1e-5) - at(-1e-5)) / 2e-5;
                        let err = (numeric - analytic[j]).abs() / scale;
                        assert!(
                            err <= FD,
                            "{name} causal {is_causal}: parameter {j}: {err:e}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn attention_qkv_with_a_tracked_mask() {
    for shape in [&[5usize, 5][..], &[5], &[2, 1, 1, 5], &[2, 2, 5, 5]] {
        for is_causal in [false, true] {
            for (dtype, tol) in [(DType::F32, F32), (DType::F64, F64)] {
                let mask = tensor(shape, 13, 1.0, dtype);
                let err = qkv_against_plain(dtype, 5, 2, is_causal, &mask, true);
                assert!(
                    err <= tol,
                    "mask {shape:?} {dtype:?} causal {is_causal}: {err:e}"
                );
            }
        }
    }
    // Two blocks of query rows.
    let mask = tensor(&[70, 70], 14, 1.0, DType::F32);
    let err = qkv_against_plain(DType::F32, 70, 2, true, &mask, true);
    assert!(err <= F32, "T = 70: {err:e}");
}

#[test]
fn an_untracked_mask_gets_no_gradient_a_tracked_one_does() {
    let c =
        Case::new(DType::F32, (1, 2, 2, 5, 6, 3)).mask(tensor(&[5, 6], 15, 1.0, DType::F32), false);
    let q = Var::from_tensor(&c.q).unwrap();
    let y = nn::attention(&q, &c.k, &c.v, false, c.mask.as_ref()).unwrap();
    let g = y.sum_all().unwrap().backward().unwrap();
    assert!(g.get(c.mask.as_ref().unwrap()).is_none());
    assert!(g.get(&q).is_some());
    // A tracked one is its own argument of the node: its gradient is there.
    let m = Var::from_tensor(c.mask.as_ref().unwrap()).unwrap();
    let y = nn::attention(&q, &c.k, &c.v, false, Some(&m)).unwrap();
    let g = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(g.get(&m).expect("the mask's gradient").dims(), &[5, 6]);
}

// 3. Shapes, dtypes, empty sequences.

#[test]
fn masks_that_do_not_broadcast_to_the_scores_are_errors() {
    // Scores (B, H, T, S) = (2, 4, 5, 6).
    let c = Case::new(DType::F32, (2, 4, 2, 5, 6, 3));
    for shape in [
        &[7usize][..],
        &[6, 5],
        &[6, 6],
        &[3, 1, 1, 6],
        &[2, 3, 5, 6],
        &[1, 1, 1, 5, 6],
        &[2, 4, 5, 6, 1],
        &[4, 5, 1, 6],
        &[0],
    ] {
        let m = tensor(shape, 16, 1.0, DType::F32);
        for is_causal in [false, true] {
            let err = nn::attention(&c.q, &c.k, &c.v, is_causal, Some(&m))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("attention:")
                    && err.contains(&format!("{shape:?}"))
                    && err.contains("[2, 4, 5, 6]"),
                "{err}"
            );
        }
    }
    // attention_qkv: scores (2, 2, 5, 5).
    let qkv = tensor(&[2, 5, 18], 17, 1.0, DType::F32);
    let err = nn::attention_qkv(&qkv, 2, true, Some(&tensor(&[6], 1, 1.0, DType::F32)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("attention_qkv:") && err.contains("[6]") && err.contains("[2, 2, 5, 5]"),
        "{err}"
    );
}

#[test]
fn a_mask_of_another_dtype_is_an_error() {
    let c = Case::new(DType::F32, (1, 2, 2, 5, 6, 3));
    for dtype in [DType::F64, DType::BF16, DType::U8, DType::U32] {
        let m = Tensor::zeros((5, 6), dtype, &Device::Cpu).unwrap();
        let err = nn::attention(&c.q, &c.k, &c.v, false, Some(&m))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("attention:")
                && err.contains(&format!("{dtype:?}"))
                && err.contains("F32"),
            "{err}"
        );
    }
}

#[test]
fn mismatched_queries_keys_and_values_are_errors() {
    let t = |dims: &[usize]| tensor(dims, 1, 1.0, DType::F32);
    let cases: [(Tensor, Tensor, Tensor); 6] = [
        (t(&[2, 5, 3]), t(&[2, 2, 6, 3]), t(&[2, 2, 6, 3])),
        (t(&[2, 2, 5, 3]), t(&[2, 2, 6, 4]), t(&[2, 2, 6, 4])),
        (t(&[2, 2, 5, 3]), t(&[2, 2, 6, 3]), t(&[2, 2, 7, 3])),
        (t(&[2, 2, 5, 3]), t(&[1, 2, 6, 3]), t(&[1, 2, 6, 3])),
        (t(&[2, 2, 5, 3]), t(&[2, 2, 6, 3]), t(&[2, 1, 6, 3])),
        (t(&[2, 0, 5, 3]), t(&[2, 2, 6, 3]), t(&[2, 2, 6, 3])),
    ];
    for (q, k, v) in cases {
        let err = nn::attention(&q, &k, &v, false, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("attention:") && err.contains(&format!("{:?}", q.dims())),
            "{err}"
        );
    }
    let q = t(&[1, 2, 5, 3]).to_dtype(DType::F64).unwrap();
    let err = nn::attention(&q, &t(&[1, 2, 6, 3]), &t(&[1, 2, 6, 3]), false, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("attention:") && err.contains("F64"), "{err}");
    // A head count whose 3 x overflows.
    let err = nn::attention_qkv(&t(&[2, 5, 18]), usize::MAX, false, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("attention_qkv:") && err.contains("18 wide"),
        "{err}"
    );
    let err = nn::attention_qkv(&t(&[2, 18]), 2, false, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("attention_qkv:") && err.contains("[2, 18]"),
        "{err}"
    );
}

#[test]
fn empty_sequences_give_zeros_and_zero_gradients() {
    // (B, H, Hkv, T, S, D): no queries, no keys, no batch; causal needs
    // S >= T, so with no keys only with no queries.
    for (dims, is_causal) in [
        ((2, 2, 1, 0, 6, 3), false),
        ((2, 2, 1, 0, 6, 3), true),
        ((2, 2, 1, 0, 0, 3), true),
        ((2, 2, 1, 5, 0, 3), false),
        ((0, 2, 1, 5, 6, 3), true),
        ((2, 2, 1, 5, 6, 0), true),
    ] {
        let (b, _, _, t, s, _) = dims;
        for shape in [vec![s], vec![b, 1, t, s]] {
            let what = format!("{dims:?} causal {is_causal} mask {shape:?}");
            let c = Case::new(DType::F32, dims)
                .causal(is_causal)
                .mask(tensor(&shape, 18, 1.0, DType::F32), true);
            let (y, g) = run(&ours, &c);
            assert_eq!(y.dims(), c.q.dims(), "{what}");
            for (x, like) in [&y, &g[0], &g[1], &g[2], &g[3]].into_iter().zip([
                &c.q,
                &c.q,
                &c.k,
                &c.v,
                c.mask.as_ref().unwrap(),
            ]) {
                assert_eq!(x.dims(), like.dims(), "{what}");
                assert_eq!(amax(x), 0.0, "{what}");
            }
        }
    }
    // attention_qkv over no tokens.
    let qkv = Var::from_tensor(&tensor(&[2, 0, 12], 1, 1.0, DType::F32)).unwrap();
    let y = nn::attention_qkv(&qkv, 2, true, None).unwrap();
    assert_eq!(y.dims(), &[2, 0, 4]);
    let g = y.sum_all().unwrap().backward().unwrap();
    assert_eq!(g.get(&qkv).unwrap().dims(), &[2, 0, 12]);
}

#[test]
fn a_head_size_of_one() {
    for is_causal in [false, true] {
        // Batch 1 of the padding mask: small biases, its last two keys
        // at -inf.
        let mask = padding_mask(2, 5, 6, f64::NEG_INFINITY, DType::F64);
        let c = Case::new(DType::F64, (2, 2, 1, 5, 6, 1))
            .causal(is_causal)
            .mask(mask.narrow(0, 1, 1).unwrap(), true);
        check_fd(&c, "D = 1");
        against_plain(&c, F64, "D = 1");
        against_plain(&c.to_dtype(DType::F32), F32, "D = 1");
    }
}

#[test]
fn a_value_head_size_other_than_the_queries() {
    // v (B, Hkv, S, 5) with q, k (.., 3): the output is (B, H, T, 5).
    for is_causal in [false, true] {
        let mut c = Case::new(DType::F64, (2, 2, 1, 5, 6, 3))
            .causal(is_causal)
            .mask(tensor(&[2, 1, 1, 6], 23, 1.0, DType::F64), true);
        c.v = tensor(&[2, 1, 6, 5], 24, 1.0, DType::F64);
        check_fd(&c, "Dv = 5");
        against_plain(&c, F64, "Dv = 5");
        against_plain(&c.to_dtype(DType::F32), F32, "Dv = 5");
    }
    // No query/key features (D = 0): every score is 0, the output is
    // softmax(mask) v.
    let mut c =
        Case::new(DType::F64, (2, 2, 1, 5, 6, 0)).mask(tensor(&[5, 6], 25, 1.0, DType::F64), true);
    c.v = tensor(&[2, 1, 6, 4], 26, 1.0, DType::F64);
    let by_hand: &Attn = &|q, k, v, _, m| {
        // q k^T over no features: zeros (2, 2, 5, 6), unscaled.
        let sc = q
            .matmul(&repeat_kv(k, 2)?.t()?)?
            .broadcast_add(m.unwrap())?;
        candle_nn::ops::softmax(&sc, D::Minus1)?.matmul(&repeat_kv(v, 2)?)
    };
    let (a, r) = (run(&ours, &c), run(by_hand, &c));
    assert_eq!(a.0.dims(), &[2, 2, 5, 4]);
    // dq and dk are empty.
    assert!(worst(&a, &r) <= F64, "D = 0: {:e}", worst(&a, &r));
}

#[test]
fn half_precision_inputs() {
    // bf16 and f16 compute in their own dtype; against plain candle in f32
    // on the same (rounded) inputs, ours must be about as close as plain
    // candle in the same half dtype is: within twice its error plus 2^-8
    // (seen: bf16 1.0e-2 against plain's 1.6e-2, f16 1.4e-3 against
    // 1.6e-3).
    for dtype in [DType::BF16, DType::F16] {
        for is_causal in [false, true] {
            // Small biases and -inf on two keys: a huge finite value would
            // absorb the scores in bf16/f16 (ulp 64 at 1e4 in bf16) but not
            // in f32, a different function.
            let mask = padding_mask(2, 5, 6, f64::NEG_INFINITY, dtype);
            let c = Case::new(dtype, (2, 2, 1, 5, 6, 4))
                .causal(is_causal)
                .mask(mask.narrow(0, 1, 1).unwrap(), true);
            let exact = run(&plain, &c.to_dtype(DType::F32));
            let up = |r: (Tensor, Vec<Tensor>)| {
                let c = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                (c(&r.0), r.1.iter().map(c).collect::<Vec<_>>())
            };
            let err = worst(&up(run(&ours, &c)), &exact);
            let plain_err = worst(&up(run(&plain, &c)), &exact);
            assert!(
                err <= 2.0 * plain_err + 1.0 / 256.0,
                "{dtype:?} causal {is_causal}: {err:e}, plain candle in {dtype:?}: {plain_err:e}"
            );
            // A huge finite value absorbs the scores as in plain candle in
            // the same dtype (-1e4: finite in both; f16's largest is
            // 65504).
            let c = c.mask(padding_mask(2, 5, 6, -1e4, dtype), true);
            let err = worst(&up(run(&ours, &c)), &up(run(&plain, &c)));
            // 16 units of the dtype's rounding, 2^-8 and 2^-11 (seen: 1.2e-2
            // in bf16, 2.6e-3 in f16, 3 and 5 units).
            let tol = if dtype == DType::BF16 {
                16.0 / 256.0
            } else {
                16.0 / 2048.0
            };
            assert!(
                err <= tol,
                "{dtype:?} causal {is_causal}, -1e4: {err:e} against plain candle in {dtype:?}"
            );
            // A row masked with -inf everywhere: zeros, no NaN.
            let c = c.mask(padding_mask(2, 5, 6, f64::NEG_INFINITY, dtype), false);
            let (y, g) = run(&ours, &c);
            for x in [&y, &g[0], &g[1], &g[2]] {
                assert!(f64s(x).iter().all(|x| x.is_finite()), "{dtype:?}");
            }
            assert_eq!(
                amax(&y.narrow(0, 0, 1).unwrap().narrow(2, 1, 1).unwrap()),
                0.0
            );
        }
    }
}

// 4. Rows masked with -inf on every key.

/// Plain candle per batch element, on the query rows that see at least one
/// key (the others removed): the same loss as ours, whose removed rows
/// have output 0 and no gradient. The mask has no head dimension (`(S,)`,
/// `(T, S)`, `(B, 1, 1, S)`, `(B, 1, T, S)`); causality is applied as an
/// explicit `(T, S)` mask so that removing rows keeps the diagonal.
fn plain_on_live_rows(c: &Case) -> (Tensor, Vec<Tensor>) {
    let (b, h, t, d) = c.q.dims4().unwrap();
    let s = c.k.dim(2).unwrap();
    let dtype = c.q.dtype();
    let var = |t: &Tensor| Var::from_tensor(t).unwrap();
    let (q, k, v) = (var(&c.q), var(&c.k), var(&c.v));
    let mask_var = c.mask.as_ref().filter(|_| c.track_mask).map(var);
    let mask = match &mask_var {
        Some(m) => Some(m.as_tensor().clone()),
        None => c.mask.clone(),
    };
    let mut full = Tensor::zeros((b, 1, t, s), dtype, &Device::Cpu).unwrap();
    if let Some(m) = &mask {
        full = full.broadcast_add(m).unwrap();
    }
    if c.causal {
        full = full.broadcast_add(&causal_mask_over(t, s, dtype)).unwrap();
    }
    assert_eq!(
        full.dims(),
        &[b, 1, t, s],
        "a mask without a head dimension"
    );
    let w = tensor(&[b, h, t, d], 99, 1.0, dtype);
    let mut loss = Tensor::zeros((), dtype, &Device::Cpu).unwrap();
    let mut ys = Vec::new();
    for i in 0..b {
        let rows = f64s(&full.get(i).unwrap());
        let live: Vec<u32> = (0..t)
            .filter(|&r| {
                rows[r * s..(r + 1) * s]
                    .iter()
                    .any(|x| *x != f64::NEG_INFINITY)
            })
            .map(|r| r as u32)
            .collect();
        let mut y_full = Tensor::zeros((1, h, t, d), dtype, &Device::Cpu).unwrap();
        if !live.is_empty() {
            let idx = Tensor::new(live.as_slice(), &Device::Cpu).unwrap();
            let pick = |x: &Tensor| x.narrow(0, i, 1).unwrap().index_select(&idx, 2).unwrap();
            let y = plain(
                &pick(&q),
                &k.narrow(0, i, 1).unwrap(),
                &v.narrow(0, i, 1).unwrap(),
                false,
                Some(&pick(&full)),
            )
            .unwrap();
            loss = (loss + (&y * pick(&w)).unwrap().sum_all().unwrap()).unwrap();
            y_full = y_full.index_add(&idx, &y.detach(), 2).unwrap();
        }
        ys.push(y_full);
    }
    let g = loss.backward().unwrap();
    let zeros = |x: &Tensor| x.zeros_like().unwrap();
    let mut gs: Vec<Tensor> = [&q, &k, &v]
        .iter()
        .map(|x| g.get(x).cloned().unwrap_or_else(|| zeros(x)))
        .collect();
    if let Some(m) = &mask_var {
        gs.push(g.get(m).cloned().unwrap_or_else(|| zeros(m)));
    }
    (Tensor::cat(&ys, 0).unwrap(), gs)
}

/// Ours against [`plain_on_live_rows`], no NaN anywhere, and the rows in
/// `dead` (batch, row) exactly 0 in the output and in `dq` (and the mask's
/// gradient, when it has those rows).
fn check_dead_rows(c: &Case, dead: &[(usize, usize)], tol: f64, what: &str) {
    let (y, g) = run(&ours, c);
    for x in std::iter::once(&y).chain(&g) {
        assert!(f64s(x).iter().all(|x| !x.is_nan()), "{what}: NaN");
    }
    for &(b, r) in dead {
        let row = |x: &Tensor| x.narrow(0, b, 1).unwrap().narrow(2, r, 1).unwrap();
        assert_eq!(amax(&row(&y)), 0.0, "{what}: output row {r} of batch {b}");
        assert_eq!(amax(&row(&g[0])), 0.0, "{what}: dq row {r} of batch {b}");
        if let Some(dm) = g.get(3).filter(|m| m.rank() == 4 && m.dim(2).unwrap() > 1) {
            assert_eq!(
                amax(&row(dm)),
                0.0,
                "{what}: mask gradient row {r} of batch {b}"
            );
        }
    }
    let err = worst(&(y, g), &plain_on_live_rows(c));
    assert!(
        err <= tol,
        "{what}: {err:e} > {tol:e} against plain candle on the live rows"
    );
}

#[test]
fn a_row_masked_with_minus_inf_on_every_key_gives_zero_and_no_nan() {
    let inf = f64::NEG_INFINITY;
    for (dtype, tol) in [(DType::F32, F32), (DType::F64, F64)] {
        for (hkv, t, s, is_causal, tracked) in [
            (2, 5, 6, false, false),
            (2, 5, 6, true, true),
            (1, 5, 6, false, true),
            (2, 70, 72, true, true),
            (1, 70, 70, false, false),
        ] {
            let what =
                format!("{dtype:?} T {t} S {s} Hkv {hkv} causal {is_causal} tracked {tracked}");
            let c = Case::new(dtype, (2, 2, hkv, t, s, 3))
                .causal(is_causal)
                .mask(padding_mask(2, t, s, inf, dtype), tracked);
            check_dead_rows(&c, &[(0, 1)], tol, &what);
            // Plain candle gives NaN there (and in dk, dv).
            let (y, _) = run(&plain, &c);
            assert!(
                f64s(&y).iter().any(|x| x.is_nan()),
                "{what}: plain candle has no NaN"
            );
        }
    }
}

#[test]
fn left_padding_under_causal_masking_leaves_rows_with_no_key() {
    // Key padding (B, 1, 1, S) with -inf on the first 2 keys of batch 0
    // and causal masking: query rows 0 and 1 of batch 0 see only padding.
    let inf = f64::NEG_INFINITY;
    for (dtype, tol) in [(DType::F32, F32), (DType::F64, F64)] {
        for (hkv, t, shape) in [(2, 5, vec![2, 1, 1, 5]), (1, 70, vec![2, 1, 1, 70])] {
            let mut m = vec![0.0; 2 * t];
            m[0] = inf;
            m[1] = inf;
            m[t + t - 1] = -1e9; // a finite huge value in batch 1
            let mask = Tensor::from_vec(m, shape.as_slice(), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            for tracked in [false, true] {
                let what = format!("{dtype:?} T {t} Hkv {hkv} tracked {tracked}");
                let c = Case::new(dtype, (2, 2, hkv, t, t, 3))
                    .causal(true)
                    .mask(mask.clone(), tracked);
                check_dead_rows(&c, &[(0, 0), (0, 1)], tol, &what);
            }
        }
    }
}

#[test]
fn minus_inf_rows_against_finite_differences() {
    // f64 central differences of our own loss: the dead rows' output is 0
    // whatever q, k, v and the finite mask entries are, so their
    // derivatives are 0 too; the other rows' are plain softmax's.
    let inf = f64::NEG_INFINITY;
    for is_causal in [false, true] {
        let c = Case::new(DType::F64, (2, 2, 1, 5, 6, 3))
            .causal(is_causal)
            .mask(padding_mask(2, 5, 6, inf, DType::F64), true);
        check_fd(&c, &format!("-inf rows, causal {is_causal}"));
    }
    // Left padding through attention_qkv: the first row of batch 0 sees only
    // padding.
    let mut m = vec![0.0; 10];
    m[0] = inf;
    let mask = Tensor::from_vec(m, (2, 1, 1, 5), &Device::Cpu).unwrap();
    let qkv = tensor(&[2, 5, 12], 19, 1.0, DType::F64);
    let x = Var::from_tensor(&qkv).unwrap();
    let y = nn::attention_qkv(&x, 2, true, Some(&mask)).unwrap();
    assert_eq!(
        amax(&y.narrow(0, 0, 1).unwrap().narrow(1, 0, 1).unwrap()),
        0.0
    );
    let g = (&y * weights(&y))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let analytic = f64s(g.get(&x).unwrap());
    let scale = analytic.iter().fold(0f64, |a, b| a.max(b.abs()));
    let base = f64s(&qkv);
    for j in 0..base.len() {
        let at = |d: f64| {
            let mut moved = base.clone();
            moved[j] += d;
            let p = Tensor::from_vec(moved, qkv.shape(), &Device::Cpu).unwrap();
            let y = nn::attention_qkv(&p, 2, true, Some(&mask)).unwrap();
            (&y * weights(&y))
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        let err = ((at(1e-5) - at(-1e-5)) / 2e-5 - analytic[j]).abs() / scale;
        assert!(err <= FD, "attention_qkv, element {j}: {err:e}");
    }
}
