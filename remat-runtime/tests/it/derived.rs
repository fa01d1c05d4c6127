//! Structs of the user's own with `#[derive(Outputs)]`: returned by blocks
//! and statements (rebuilt from placeholders in the replay), generic and
//! tuple structs, plain fields; and held in a field that a statement reads
//! through a method, checked for a change in place. Gradients against
//! plain candle in f32 and f64.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var, D};
use remat_runtime::{backward, remat, Outputs, Plan, RematError};

use crate::common::{rel_diff, tensor, var};

const DTYPES: [DType; 2] = [DType::F32, DType::F64];

fn plans() -> [Plan; 5] {
    [
        Plan::declared(),
        Plan::recompute_all(),
        Plan::save_all(),
        Plan::save_only(["gated"]),
        Plan::budget(0.5),
    ]
}

/// What an MoE-style layer gives: its states, an auxiliary loss and the
/// plain routing decision.
#[derive(Clone, Outputs)]
struct Routed {
    states: Tensor,
    aux_loss: Tensor,
    #[outputs(plain)]
    top: Vec<usize>,
}

/// A generic pair and a tuple struct.
#[derive(Clone, Outputs)]
struct Pair<T> {
    left: T,
    right: T,
}

#[derive(Clone, Outputs)]
struct Scaled(Tensor, f64);

/// Rotary tables in a struct of their own, applied through a method, as
/// candle-transformers' models do.
#[derive(Clone, Outputs)]
struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    fn apply(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let half = x.dim(D::Minus1)? / 2;
        let (a, b) = (
            x.narrow(D::Minus1, 0, half)?,
            x.narrow(D::Minus1, half, half)?,
        );
        let rotated = Tensor::cat(&[&b.neg()?, &a], D::Minus1)?;
        x.broadcast_mul(&self.cos)? + rotated.broadcast_mul(&self.sin)?
    }
}

#[derive(Clone)]
struct Layer {
    w: Var,
    gate: Var,
    rotary: Rotary,
}

impl Layer {
    fn new(dtype: DType) -> Self {
        let (t, d) = (5, 4);
        Layer {
            w: var(&[d, d], 61, 0.5, dtype),
            gate: var(&[d, d], 62, 0.5, dtype),
            rotary: Rotary {
                cos: tensor(&[t, d], 63, 1.0, dtype),
                sin: tensor(&[t, d], 64, 1.0, dtype),
            },
        }
    }

    fn route(h: &Tensor) -> candle_core::Result<Routed> {
        let top = vec![h.dim(0)?];
        let aux_loss = h.sqr()?.mean_all()?;
        Ok(Routed {
            states: h.tanh()?,
            aux_loss,
            top,
        })
    }

    /// The same ops as `forward`, without a region.
    fn plain(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let h = self.rotary.apply(&x.matmul(self.w.as_tensor())?)?;
        let routed = Self::route(&h)?;
        let pair = Pair {
            left: routed.states.matmul(self.gate.as_tensor())?,
            right: routed.states.exp()?,
        };
        let gated = Scaled((&pair.left * &pair.right)?, 0.5);
        let y = (gated.0 * gated.1)?;
        let n = routed.top[0] as f64;
        Ok((y, (routed.aux_loss * n)?))
    }

    remat! {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Routed> {
            let h = self.rotary.apply(&x.matmul(self.w.as_tensor())?)?;
            let routed = Self::route(&h)?;
            let pair = Pair {
                left: routed.states.matmul(self.gate.as_tensor())?,
                right: routed.states.exp()?,
            };
            #[save]
            let gated = Scaled((&pair.left * &pair.right)?, 0.5);
            let y = (gated.0 * gated.1)?;
            let n = routed.top[0] as f64;
            Ok(Routed { states: y, aux_loss: (routed.aux_loss * n)?, top: routed.top })
        }
    }
}

fn loss(states: &Tensor, aux: &Tensor) -> candle_core::Result<Tensor> {
    let w = Tensor::arange(0u32, states.elem_count() as u32, &Device::Cpu)?
        .to_dtype(states.dtype())?
        .reshape(states.shape())?;
    (states * w)?.sum_all()? + aux
}

/// Statements give and read derived structs (a generic one, a tuple one,
/// one with a plain field), the block returns one: every gradient is plain
/// candle's under every plan.
#[test]
fn derived_structs_flow_through_statements_with_plain_gradients() {
    for dtype in DTYPES {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let layer = Layer::new(dtype);
        let x = var(&[5, 4], 60, 1.0, dtype);
        let (y_ref, aux_ref) = layer.plain(x.as_tensor()).unwrap();
        let g_ref = loss(&y_ref, &aux_ref).unwrap().backward().unwrap();
        for plan in plans() {
            let out = plan.scope(|| layer.forward(x.as_tensor())).unwrap();
            assert_eq!(out.top, vec![5], "{dtype:?} {plan}");
            assert!(rel_diff(&out.states, &y_ref) <= tol, "{dtype:?} {plan}");
            let g = backward(&loss(&out.states, &out.aux_loss).unwrap()).unwrap();
            for v in [&x, &layer.w, &layer.gate] {
                let d = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
                assert!(d <= tol, "{dtype:?} {plan}: {d}");
            }
        }
    }
}

/// A field of a derived type read through a method (`self.rotary.apply`)
/// and written in place between the forward and the backward is
/// `FieldChanged` naming it, under every plan, saving ones included.
#[test]
fn a_derived_field_read_through_a_method_and_changed_in_place_is_caught() {
    for dtype in DTYPES {
        for plan in plans() {
            for table in 0..2 {
                let layer = Layer::new(dtype);
                let x = var(&[5, 4], 60, 1.0, dtype);
                let out = plan.scope(|| layer.forward(x.as_tensor())).unwrap();
                let t = [&layer.rotary.cos, &layer.rotary.sin][table];
                let bumped = (t.narrow(0, 0, 1).unwrap() + 0.25).unwrap();
                t.slice_set(&bumped, 0, 0).unwrap();
                let e = backward(&loss(&out.states, &out.aux_loss).unwrap()).unwrap_err();
                assert!(
                    matches!(&e, RematError::FieldChanged { region, statement, field, shape }
                        if region == "Layer::forward" && statement == "h"
                            && field == "self.rotary" && shape == &[5, 4]),
                    "{dtype:?} {plan} table {table}: {e:?}"
                );
            }
        }
    }
}

remat! {
    /// A derived parameter read in part by two statements, and a map of
    /// tensors given by one statement and read by key by others.
    fn heads(p: &Pair<Tensor>, w: &Tensor) -> candle_core::Result<Tensor> {
        let left = p.left.matmul(w)?;
        let right = p.right.exp()?;
        let named = HashMap::from([
            ("k".to_string(), left.tanh()?),
            ("q".to_string(), (&right * 2.0)?),
            ("v".to_string(), left.sin()?),
        ]);
        #[save]
        let kq = (&named["k"] * &named["q"])?;
        let y = (kq + &named["v"])?;
        Ok(y)
    }
}

fn heads_plain(p: &Pair<Tensor>, w: &Tensor) -> candle_core::Result<Tensor> {
    let left = p.left.matmul(w)?;
    let right = p.right.exp()?;
    let kq = (left.tanh()? * (&right * 2.0)?)?;
    kq + left.sin()?
}

/// A parameter of a derived type read in part (`p.left` by one statement,
/// `p.right` by another) was refused (`InputCut`); a `HashMap` a statement
/// gives was split in its own order, which the replay's map does not keep
/// (wrong gradients or `ReplayDiverged`). Every gradient is plain candle's.
#[test]
fn derived_parameters_read_in_part_and_maps_of_tensors_give_plain_gradients() {
    for dtype in DTYPES {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let (a, b, w) = (
            var(&[4, 4], 81, 0.5, dtype),
            var(&[4, 4], 82, 0.5, dtype),
            var(&[4, 4], 83, 0.5, dtype),
        );
        let p = Pair {
            left: a.as_tensor().clone(),
            right: b.as_tensor().clone(),
        };
        let reference = heads_plain(&p, w.as_tensor())
            .and_then(|y| y.sqr()?.sum_all())
            .unwrap()
            .backward()
            .unwrap();
        for plan in plans() {
            // Several calls: every map is a new one, in an order of its own.
            for step in 0..3 {
                let y = plan
                    .scope(|| heads(&p, w.as_tensor())?.sqr()?.sum_all())
                    .unwrap();
                let g = backward(&y).unwrap();
                for v in [&a, &b, &w] {
                    let d = rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
                    assert!(d <= tol, "{dtype:?} {plan} step {step}: {d}");
                }
            }
        }
    }
}

/// A token count beside the tokens, as vision embeddings return them.
#[derive(Clone, Outputs)]
struct Tokens(Tensor, usize);

#[derive(Clone, Outputs)]
struct Grid {
    h: usize,
    w: usize,
}

/// Patches and their grid, as a vision transformer's embedding gives them.
#[derive(Clone, Outputs)]
struct Patches {
    tokens: Tensor,
    grid: Grid,
}

remat! {
    /// The tail reads the saved value's count and the parameter's grid
    /// only, cast to numbers.
    fn scaled_tokens(p: &Patches, w: &Tensor) -> candle_core::Result<Tensor> {
        #[save]
        let t = Tokens(p.tokens.matmul(w)?, p.tokens.dim(0)?);
        let y = t.0.tanh()?;
        Ok((y * (t.1 as f64 / (p.grid.h * p.grid.w) as f64))?)
    }
}

/// A part of a value cast to a number (`t.1 as f64`, `(p.grid.h *
/// p.grid.w) as f64`) is not a read of its tensors: the tail reading only
/// those was refused (`InputCut`). Every gradient is plain candle's.
#[test]
fn a_part_cast_to_a_number_is_no_read_of_the_values_tensors() {
    for dtype in DTYPES {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let (x, w) = (var(&[3, 4], 91, 0.5, dtype), var(&[4, 4], 92, 0.5, dtype));
        let p = Patches {
            tokens: x.as_tensor().clone(),
            grid: Grid { h: 1, w: 2 },
        };
        let reference = ((x.matmul(&w).unwrap().tanh().unwrap() * 1.5).unwrap())
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for plan in plans() {
            let y = plan
                .scope(|| scaled_tokens(&p, w.as_tensor())?.sqr()?.sum_all())
                .unwrap();
            let g = backward(&y).unwrap();
            for v in [&x, &w] {
                let d = rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
                assert!(d <= tol, "{dtype:?} {plan}: {d}");
            }
        }
    }
}

remat! {
    /// A derived struct built by moving statements' values into it (a
    /// statement: each reading statement defining it again would move
    /// them again), returned and read through its fields.
    fn built_pair(x: &Tensor, w: &Tensor) -> candle_core::Result<Pair<Tensor>> {
        let h = x.matmul(w)?;
        let g = h.tanh()?;
        let both = Pair { left: h, right: g };
        let y = (&both.left * &both.right)?;
        let out = Pair { left: y, right: both.right };
        Ok(out)
    }
}

/// `let both = Pair { left: h, right: g };` moving `h` and `g`, read by a
/// later statement and the tail: plain candle's gradients under every
/// plan (it did not compile while such a `let` was taken for plain code).
#[test]
fn a_derived_struct_built_of_statement_values_matches_plain_candle() {
    for dtype in [DType::F32, DType::F64] {
        let x = var(&[3, 4], 41, 1.0, dtype);
        let w = var(&[4, 5], 42, 0.5, dtype);
        let loss = |p: Pair<Tensor>| {
            ((p.left * 2.0).unwrap() + p.right.sqr().unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
        };
        let h = x.as_tensor().matmul(w.as_tensor()).unwrap();
        let g = h.tanh().unwrap();
        let expected = loss(Pair {
            left: (&h * &g).unwrap(),
            right: g,
        })
        .backward()
        .unwrap();
        for plan in plans() {
            let out = plan
                .scope(|| built_pair(x.as_tensor(), w.as_tensor()))
                .unwrap();
            let got = backward(&loss(out)).unwrap();
            for v in [&x, &w] {
                let d = rel_diff(got.get(v).unwrap(), expected.get(v).unwrap());
                assert!(
                    d < if dtype == DType::F64 { 1e-12 } else { 1e-5 },
                    "{dtype:?} {plan}: {d}"
                );
            }
        }
    }
}

/// A key/value cache of the user's own, kept outside the block and handed
/// to it as an `Option`, as chunked prefill does.
#[derive(Clone, Outputs)]
struct KvCache {
    k: Tensor,
    v: Tensor,
}

remat! {
    /// One attention step over the cache and this chunk: the cache is
    /// taken apart by `match` in one statement and read through
    /// `unwrap()` in another; each reads one of its tensors.
    #[allow(clippy::unnecessary_unwrap)]
    fn attend(x: &Tensor, wk: &Tensor, wv: &Tensor, cache: Option<&KvCache>) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let k = x.matmul(wk)?;
        let v = x.matmul(wv)?;
        let k = match cache {
            Some(c) => Tensor::cat(&[&c.k, &k], 0)?,
            None => k,
        };
        let v = if cache.is_some() { Tensor::cat(&[&cache.unwrap().v, &v], 0)? } else { v };
        let scores = x.matmul(&k.t()?)?;
        let y = candle_nn::ops::softmax(&scores, 1)?.matmul(&v)?;
        Ok((y, k, v))
    }
}

fn attend_plain(
    x: &Tensor,
    wk: &Tensor,
    wv: &Tensor,
    cache: Option<&KvCache>,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (mut k, mut v) = (x.matmul(wk)?, x.matmul(wv)?);
    if let Some(c) = cache {
        k = Tensor::cat(&[&c.k, &k], 0)?;
        v = Tensor::cat(&[&c.v, &v], 0)?;
    }
    let scores = x.matmul(&k.t()?)?;
    let e = scores.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(1)?)?;
    Ok((p.matmul(&v)?, k, v))
}

/// One chunk through `attend`: its output, keys and values.
type Attend<'a> =
    dyn Fn(&Tensor, Option<&KvCache>) -> candle_core::Result<(Tensor, Tensor, Tensor)> + 'a;

/// Two chunks of a prefill through a cache struct that derives `Outputs`,
/// its tensors carrying gradients from the first chunk: a statement that
/// takes the `Option` apart (`match cache { Some(c) => .. }`) or reads
/// `cache.unwrap().v` reads one of its tensors, not both. Both were
/// `InputCut` (false alarm) under every plan; now every gradient is plain
/// candle's.
#[test]
fn a_cache_struct_taken_apart_by_match_or_unwrap_is_read_in_part() {
    for dtype in DTYPES {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let wk = var(&[4, 4], 71, 0.5, dtype);
        let wv = var(&[4, 4], 72, 0.5, dtype);
        let x1 = var(&[3, 4], 73, 1.0, dtype);
        let x2 = var(&[2, 4], 74, 1.0, dtype);
        let vars = [&wk, &wv, &x1, &x2];
        let run = |f: &Attend<'_>| {
            let (y1, k, v) = f(x1.as_tensor(), None)?;
            let (y2, _, _) = f(x2.as_tensor(), Some(&KvCache { k, v }))?;
            Tensor::cat(&[&y1, &y2], 0)?.sqr()?.sum_all()?.backward()
        };
        let reference = run(&|x, c| attend_plain(x, wk.as_tensor(), wv.as_tensor(), c)).unwrap();
        for plan in plans() {
            let got = run(&|x, c| plan.scope(|| attend(x, wk.as_tensor(), wv.as_tensor(), c)))
                .unwrap_or_else(|e| panic!("{dtype:?} {plan}: {e}"));
            for (i, v) in vars.iter().enumerate() {
                let d = rel_diff(got.get(v).unwrap(), reference.get(v).unwrap());
                assert!(d < tol, "{dtype:?} {plan}: var {i} differs by {d:e}");
            }
        }
    }
}

/// A cache of the user's own that does not derive `Outputs`.
#[derive(Clone)]
struct PlainCache {
    k: Tensor,
}

remat! {
    fn keys(x: &Tensor, wk: &Tensor) -> candle_core::Result<Tensor> {
        let k = x.matmul(wk)?.tanh()?;
        Ok(k)
    }
}

remat! {
    fn with_plain_cache(x: &Tensor, cache: &PlainCache) -> remat_runtime::Result<Tensor> {
        let y = x.matmul(&cache.k.t()?)?;
        Ok(y)
    }
}

remat! {
    fn with_cache(x: &Tensor, cache: &KvCache) -> candle_core::Result<Tensor> {
        let y = x.matmul(&cache.k.t()?)?;
        Ok(y)
    }
}

/// A region's output held in a struct that does not derive `Outputs` is
/// not one of the reading block's tensors: candle would run the first
/// region's backward inside the second's and again for the output's other
/// use (it was `TapeReleased` at the backward, advising `retain_tape`).
/// It is `CapturedOutput` in the forward, naming both regions and the
/// derive to add; with the derive, the gradients are plain candle's.
#[test]
fn a_region_output_in_a_struct_without_outputs_is_refused_with_the_fix() {
    let dtype = DType::F64;
    let wk = var(&[4, 4], 81, 0.5, dtype);
    let x = var(&[3, 4], 82, 1.0, dtype);
    for plan in plans() {
        let k = plan.scope(|| keys(x.as_tensor(), wk.as_tensor())).unwrap();
        let cache = PlainCache { k: k.clone() };
        let err = plan
            .scope(|| with_plain_cache(x.as_tensor(), &cache))
            .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(&err, RematError::CapturedOutput { region, statement, from }
                if region == "with_plain_cache" && statement == "y" && from == "keys"),
            "{plan}: {text}"
        );
        assert!(text.contains("derive `Outputs`"), "{text}");
    }
    // The same with a cache that derives `Outputs`, the keys also used on
    // their own: plain candle's gradients.
    let reference = {
        let k = x
            .as_tensor()
            .matmul(wk.as_tensor())
            .unwrap()
            .tanh()
            .unwrap();
        let y = x.as_tensor().matmul(&k.t().unwrap()).unwrap();
        ((y.sqr().unwrap().sum_all().unwrap() + k.sum_all().unwrap()).unwrap())
            .backward()
            .unwrap()
    };
    for plan in plans() {
        let k = plan.scope(|| keys(x.as_tensor(), wk.as_tensor())).unwrap();
        let cache = KvCache {
            k: k.clone(),
            v: k.clone(),
        };
        let y = plan.scope(|| with_cache(x.as_tensor(), &cache)).unwrap();
        let g = backward(&(y.sqr().unwrap().sum_all().unwrap() + k.sum_all().unwrap()).unwrap())
            .unwrap();
        for v in [&wk, &x] {
            let d = rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
            assert!(d < 1e-12, "{plan}: {d:e}");
        }
    }
}
