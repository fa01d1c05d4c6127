//! A statement that reads several values needing gradients, of which the
//! graph of its outputs reaches only some, is an error naming the region,
//! the statement and the input, under every plan, in the region's first
//! forward (before any backward, whatever cuts the path after the block):
//! candle's backward-less `rope` on the queries and keys while the values
//! flow, and routing weights that leave through the host and come back as
//! a constant. Reads stated as detached, integer paths (comparisons,
//! `argmax`) and host reads of a value that also flows are not errors, and
//! their gradients are plain candle's.

use candle_core::{DType, Device, Module, Result, Tensor, Var, D};
use candle_nn::{Linear, RmsNorm};
use remat_runtime::{backward, remat, Plan};

use crate::common::{rel_diff, tensor, var};

const DTYPES: [DType; 2] = [DType::F32, DType::F64];

/// Every kind of plan; `saved` names statements to save.
fn plans_saving(saved: &'static [&'static str]) -> Vec<Plan> {
    vec![
        Plan::recompute_all(),
        Plan::declared(),
        Plan::save_all(),
        Plan::save_only(saved.iter().copied()),
        Plan::off(),
    ]
}

fn plans() -> Vec<Plan> {
    plans_saving(&["q", "k", "v"])
}

fn linear(i: usize, o: usize, seed: u64, dtype: DType) -> (Linear, Var) {
    let w = var(&[o, i], seed, 0.5 / (i as f64).sqrt(), dtype);
    (Linear::new(w.as_tensor().clone(), None), w)
}

/// Attention as candle-transformers' Gemma 2 lays it out: projections,
/// heads, rotary embedding on the queries and keys, and the product with
/// the values in one statement. `fused`: candle's `rope` (no backward);
/// otherwise its composed `rope_slow`.
#[derive(Clone)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    heads: usize,
    cos: Tensor,
    sin: Tensor,
    fused: bool,
    vars: Vec<Var>,
}

impl Attention {
    fn new(c: usize, heads: usize, t: usize, fused: bool, dtype: DType) -> Self {
        let (q_proj, wq) = linear(c, c, 1, dtype);
        let (k_proj, wk) = linear(c, c, 2, dtype);
        let (v_proj, wv) = linear(c, c, 3, dtype);
        let (o_proj, wo) = linear(c, c, 4, dtype);
        let half = c / heads / 2;
        let angles = Tensor::arange(0u32, (t * half) as u32, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .reshape((t, half))
            .unwrap()
            .affine(0.1, 0.0)
            .unwrap();
        Attention {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            heads,
            cos: angles.cos().unwrap(),
            sin: angles.sin().unwrap(),
            fused,
            vars: vec![wq, wk, wv, wo],
        }
    }

    fn split(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        x.reshape((b, t, self.heads, c / self.heads))?
            .transpose(1, 2)?
            .contiguous()
    }

    fn rotate(&self, x: &Tensor) -> Result<Tensor> {
        match self.fused {
            true => candle_nn::rotary_emb::rope(x, &self.cos, &self.sin),
            false => candle_nn::rotary_emb::rope_slow(x, &self.cos, &self.sin),
        }
    }

    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (q, k) = (self.rotate(q)?, self.rotate(k)?);
        let scale = 1.0 / (q.dim(D::Minus1)? as f64).sqrt();
        let scores = (q.matmul(&k.t()?)? * scale)?;
        candle_nn::ops::softmax(&scores, D::Minus1)?.matmul(v)
    }

    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let (b, t, c) = xs.dims3()?;
            let q = self.split(&self.q_proj.forward(xs)?)?;
            let k = self.split(&self.k_proj.forward(xs)?)?;
            let v = self.split(&self.v_proj.forward(xs)?)?;
            let att = self.attend(&q, &k, &v)?;
            let merged = att.transpose(1, 2)?.reshape((b, t, c))?;
            Ok((xs + self.o_proj.forward(&merged)?)?)
        }
    }

    fn plain(&self, xs: &Tensor) -> Result<Tensor> {
        let (b, t, c) = xs.dims3()?;
        let q = self.split(&self.q_proj.forward(xs)?)?;
        let k = self.split(&self.k_proj.forward(xs)?)?;
        let v = self.split(&self.v_proj.forward(xs)?)?;
        let att = self.attend(&q, &k, &v)?;
        xs + self
            .o_proj
            .forward(&att.transpose(1, 2)?.reshape((b, t, c))?)?
    }
}

/// The error of a step: from the forward when it refuses, else from the
/// backward.
fn step_error(y: Result<Tensor>) -> Option<String> {
    match y {
        Err(e) => Some(e.to_string()),
        Ok(y) => backward(&y.sqr().unwrap().sum_all().unwrap())
            .err()
            .map(|e| e.to_string()),
    }
}

/// A cut in a `remat!` block: it names the input as the block does.
fn assert_input_cut(text: &str, statement: &str) {
    let head = format!("statement `{statement}`: `");
    assert!(
        text.contains(&head) && text.contains("needs gradients and is read for its value"),
        "{text}"
    );
    assert!(
        text.contains("(input ") && text.contains(", shape ["),
        "{text}"
    );
    assert!(text.contains("remat_runtime::candle_nn"), "{text}");
    assert!(text.contains(".detach()"), "{text}");
}

#[test]
fn rope_on_the_queries_and_keys_while_the_values_flow_is_an_error_under_every_plan() {
    // Each dtype on a fresh thread, every plan twice: the first round
    // includes the region's first forward and first plain run (which see
    // every cut in the forward); the second, forwards that run recomputed
    // statements on the values as they are (the replay sees the cut) and
    // saved ones on leaves (the forward does). A plain run looks once per
    // thread (it walks the graph down to the parameters).
    for dtype in DTYPES {
        std::thread::spawn(move || {
            let layer = Attention::new(8, 2, 5, true, dtype);
            let x = var(&[2, 5, 8], 9, 1.0, dtype);
            for round in 0..2 {
                for plan in plans().into_iter().filter(|p| round == 0 || !p.is_off()) {
                    let e = step_error(plan.scope(|| layer.forward(x.as_tensor())));
                    let e = e.unwrap_or_else(|| panic!("{dtype:?} {plan} {round}: no error"));
                    assert_input_cut(&e, "att");
                    // `q`, the first binding the statement mentions.
                    assert!(e.contains("`q` (input 0, shape [2, 2, 5, 4])"), "{e}");
                }
            }
        })
        .join()
        .unwrap();
    }
}

#[test]
fn the_first_forward_reports_the_cut_before_any_backward() {
    // A fresh thread: the region's first forward. Under the default plan
    // every statement of the block is recomputed; the forward itself
    // refuses, so a cut after the block (candle's fused `RmsNorm` on the
    // output, which would keep the backward from ever reaching the block's
    // replay) cannot hide it.
    for plan in [Plan::declared(), Plan::recompute_all(), Plan::off()] {
        let label = plan.to_string();
        // No backward runs: the error is the forward's.
        let e = std::thread::spawn(move || {
            let layer = Attention::new(8, 2, 5, true, DType::F32);
            let norm = RmsNorm::new(Tensor::ones(8, DType::F32, &Device::Cpu)?, 1e-6);
            let x = var(&[2, 5, 8], 9, 1.0, DType::F32);
            let y = plan.scope(|| layer.forward(x.as_tensor()))?;
            norm.forward(&y)
        })
        .join()
        .unwrap()
        .unwrap_err();
        assert!(
            e.to_string().contains("statement `att`: `q` (input 0, "),
            "{label}: {e}"
        );
    }
}

#[test]
fn the_composed_rope_trains_every_projection() {
    for dtype in DTYPES {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let layer = Attention::new(8, 2, 5, false, dtype);
        let x = var(&[2, 5, 8], 9, 1.0, dtype);
        let reference = layer
            .plain(x.as_tensor())
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for plan in plans() {
            let y = plan.scope(|| layer.forward(x.as_tensor())).unwrap();
            let g = backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap();
            for v in layer.vars.iter().chain([&x]) {
                let d = rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
                assert!(d < tol, "{dtype:?} {plan}: {d}");
            }
        }
    }
}

/// A top-1 mixture of two experts whose router is a statement of its own,
/// as candle-transformers' Mixtral routes: the experts run on the tokens
/// each is given, scaled by the routing weight. `host_weights`: the weights
/// are read with `to_vec2` and come back through `Tensor::new` (the
/// router's gradient is lost); otherwise they are gathered on the device.
#[derive(Clone)]
struct Moe {
    gate: Linear,
    experts: [Linear; 2],
    host_weights: bool,
    vars: Vec<Var>,
}

impl Moe {
    fn new(c: usize, host_weights: bool, dtype: DType) -> Self {
        let (gate, wg) = linear(c, 2, 11, dtype);
        let (e0, w0) = linear(c, c, 12, dtype);
        let (e1, w1) = linear(c, c, 13, dtype);
        Moe {
            gate,
            experts: [e0, e1],
            host_weights,
            vars: vec![wg, w0, w1],
        }
    }

    /// Routes every token of `xs` (n, c) to its best expert by `probs`
    /// (n, 2). The indices come from the host in both variants.
    fn mix(&self, xs: &Tensor, probs: &Tensor) -> Result<Tensor> {
        let rows = probs.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        let best: Vec<u32> = rows.iter().map(|r| u32::from(r[1] > r[0])).collect();
        let idx = Tensor::new(best.as_slice(), xs.device())?.unsqueeze(1)?;
        let weights = match self.host_weights {
            true => {
                let w: Vec<f64> = rows
                    .iter()
                    .zip(&best)
                    .map(|(r, &b)| r[b as usize])
                    .collect();
                Tensor::new(w.as_slice(), xs.device())?
                    .to_dtype(xs.dtype())?
                    .unsqueeze(1)?
            }
            false => probs.gather(&idx, 1)?,
        };
        let mut ys = xs.zeros_like()?;
        for (e, expert) in self.experts.iter().enumerate() {
            let mine = idx.eq(e as u32)?.to_dtype(xs.dtype())?;
            ys = (ys + expert.forward(xs)?.broadcast_mul(&mine)?)?;
        }
        ys.broadcast_mul(&weights)
    }

    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let logits = self.gate.forward(xs)?;
            let probs = candle_nn::ops::softmax(&logits, D::Minus1)?;
            let ys = self.mix(xs, &probs)?;
            Ok((xs + ys)?)
        }
    }

    fn plain(&self, xs: &Tensor) -> Result<Tensor> {
        let probs = candle_nn::ops::softmax(&self.gate.forward(xs)?, D::Minus1)?;
        xs + self.mix(xs, &probs)?
    }
}

#[test]
fn routing_weights_through_the_host_are_an_error_under_every_plan() {
    // As for `rope`: each dtype on a fresh thread, so that the plain run
    // is the region's first.
    for dtype in DTYPES {
        std::thread::spawn(move || {
            let moe = Moe::new(6, true, dtype);
            let x = var(&[7, 6], 21, 1.0, dtype);
            for plan in plans_saving(&["logits", "probs"]) {
                let e = step_error(plan.scope(|| moe.forward(x.as_tensor())));
                let e = e.unwrap_or_else(|| panic!("{dtype:?} {plan}: no error"));
                assert_input_cut(&e, "ys");
                // `probs`, after `xs`.
                assert!(e.contains("`probs` (input 1, shape [7, 2])"), "{e}");
                assert!(e.contains("through the host"), "{e}");
            }
        })
        .join()
        .unwrap();
    }
}

#[test]
fn host_indices_beside_weights_on_the_device_are_not_errors() {
    // The routing indices come from the host; the weights flow on the
    // device: the router gets its gradient, as in plain candle.
    for dtype in DTYPES {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let moe = Moe::new(6, false, dtype);
        let x = var(&[7, 6], 21, 1.0, dtype);
        let reference = moe
            .plain(x.as_tensor())
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for plan in plans_saving(&["logits", "probs"]) {
            let y = plan.scope(|| moe.forward(x.as_tensor())).unwrap();
            let g = backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap();
            for v in moe.vars.iter().chain([&x]) {
                let d = rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
                assert!(d < tol, "{dtype:?} {plan}: {d}");
            }
        }
    }
}

remat! {
    /// Reads of values needing gradients that give none by nature or by
    /// statement: a host read for control flow of a value read detached, a
    /// comparison, `argmax`, and a value that also flows.
    fn gated(x: &Tensor, w: &Tensor, s: &Tensor) -> Result<Tensor> {
        let h = x.matmul(w)?;
        let scale = if s.detach().max_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()? > 0.0 { 2.0 } else { 0.5 };
        let on = h.ge(0.0)?.to_dtype(h.dtype())?;
        let best = h.argmax_keepdim(D::Minus1)?;
        let logged = h.mean_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let y = ((h.relu()? * scale)? * (logged.is_finite() as u8 as f64))?;
        let z = y.broadcast_mul(&on)?.broadcast_add(&best.to_dtype(s.dtype())?.broadcast_mul(s)?)?;
        Ok(z)
    }
}

fn plain_gated(x: &Tensor, w: &Tensor, s: &Tensor) -> Result<Tensor> {
    let h = x.matmul(w)?;
    let scale = if s.max_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()? > 0.0 {
        2.0
    } else {
        0.5
    };
    let on = h.ge(0.0)?.to_dtype(h.dtype())?;
    let best = h.argmax_keepdim(D::Minus1)?.to_dtype(h.dtype())?;
    let y = (h.relu()? * scale)?;
    y.broadcast_mul(&on)?.broadcast_add(&best.broadcast_mul(s)?)
}

#[test]
fn detached_reads_integer_paths_and_host_reads_of_flowing_values_are_not_errors() {
    for dtype in DTYPES {
        let tol = if dtype == DType::F32 { 1e-6 } else { 1e-12 };
        let x = var(&[4, 3], 31, 1.0, dtype);
        let w = var(&[3, 5], 32, 0.5, dtype);
        let s = var(&[4, 1], 33, 1.0, dtype);
        let weights = tensor(&[4, 5], 34, 1.0, dtype);
        let loss = |y: Tensor| (y * &weights).unwrap().sum_all().unwrap();
        let reference = loss(plain_gated(x.as_tensor(), w.as_tensor(), s.as_tensor()).unwrap())
            .backward()
            .unwrap();
        for plan in plans_saving(&["h", "on", "best"]) {
            let y = plan
                .scope(|| gated(x.as_tensor(), w.as_tensor(), s.as_tensor()))
                .unwrap_or_else(|e| panic!("{dtype:?} {plan}: {e}"));
            let g = backward(&loss(y)).unwrap_or_else(|e| panic!("{dtype:?} {plan}: {e}"));
            for v in [&x, &w, &s] {
                let d = rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
                assert!(d < tol, "{dtype:?} {plan}: {d}");
            }
        }
    }
}

remat! {
    /// Hard gating: `g` is read only through a comparison, beside `v`,
    /// which flows. The gate gets no gradient by nature, which the graph
    /// cannot tell from a cut.
    fn hard_gate(v: &Tensor, g: &Tensor) -> Result<Tensor> {
        let y = v.broadcast_mul(&g.gt(0.0)?.to_dtype(v.dtype())?)?;
        Ok(y)
    }
}

remat! {
    /// The same gate, stated: `g` is read detached.
    fn stated_gate(v: &Tensor, g: &Tensor) -> Result<Tensor> {
        let y = v.broadcast_mul(&g.detach().gt(0.0)?.to_dtype(v.dtype())?)?;
        Ok(y)
    }
}

#[test]
fn a_value_read_only_through_a_comparison_beside_one_that_flows_is_read_detached() {
    let v = var(&[3, 4], 41, 1.0, DType::F32);
    let g = var(&[3, 1], 42, 1.0, DType::F32);
    for plan in plans_saving(&["y"]) {
        let e = step_error(plan.scope(|| hard_gate(v.as_tensor(), g.as_tensor())));
        assert_input_cut(&e.unwrap_or_else(|| panic!("{plan}: no error")), "y");
        let y = plan
            .scope(|| stated_gate(v.as_tensor(), g.as_tensor()))
            .unwrap();
        let grads = backward(&y.sum_all().unwrap()).unwrap();
        let on = g.as_tensor().gt(0.0).unwrap().to_dtype(DType::F32).unwrap();
        let expected = on.broadcast_as((3, 4)).unwrap();
        assert!(
            rel_diff(grads.get(&v).unwrap(), &expected) < 1e-12,
            "{plan}"
        );
        assert!(grads.get(&g).is_none(), "{plan}");
    }
}

remat! {
    /// `r` is read, in a macro, only for its shape.
    fn checked_shapes(h: &Tensor, r: &Tensor) -> Result<Tensor> {
        let y = {
            debug_assert_eq!(h.dims(), r.dims());
            h.exp()?
        };
        Ok(y)
    }
}

#[test]
fn shapes_read_in_a_macro_and_an_input_declared_twice_are_not_cuts() {
    let h = var(&[3, 4], 51, 1.0, DType::F64);
    let r = var(&[3, 4], 52, 1.0, DType::F64);
    let expected = h.as_tensor().exp().unwrap();
    for plan in plans_saving(&["y"]) {
        let y = plan
            .scope(|| checked_shapes(h.as_tensor(), r.as_tensor()))
            .unwrap_or_else(|e| panic!("{plan}: {e}"));
        let g = backward(&y.sum_all().unwrap()).unwrap();
        assert!(rel_diff(g.get(&h).unwrap(), &expected) < 1e-12, "{plan}");
        assert!(g.get(&r).is_none(), "{plan}");
    }
    // The statement API: one value declared twice, read once, in the
    // region's first forward (one leaf for both).
    let x = var(&[5], 53, 1.0, DType::F64);
    let y = remat_runtime::Region::new("twice")
        .run(&[x.as_tensor()], |ctx, ins| {
            ctx.recompute("s", &[&ins[0], &ins[0]], |t| t[0].exp()?.sum_all())
        })
        .unwrap();
    let g = backward(&y).unwrap();
    assert!(rel_diff(g.get(&x).unwrap(), &x.as_tensor().exp().unwrap()) < 1e-12);
}

remat! {
    /// The cut is on one tensor of a list the statement reads whole (every
    /// element; `enumerate()` would make it a read in part, as `skip` or
    /// `zip` do, which needs one element reached).
    fn cut_in_a_list(h: &Tensor, xs: &[Tensor]) -> Result<Tensor> {
        let y = {
            let mut acc = h.clone();
            for x in xs.iter() {
                let x = if x.id() == xs[2].id() {
                    candle_nn::ops::softmax_last_dim(x)?
                } else {
                    x.clone()
                };
                acc = (acc * x)?;
            }
            acc
        };
        Ok(y)
    }
}

#[test]
fn the_error_names_the_input_as_the_block_reads_it() {
    let h = var(&[2, 3], 61, 1.0, DType::F32);
    let xs: Vec<Var> = (0..4)
        .map(|i| var(&[2, 3], 62 + i, 1.0, DType::F32))
        .collect();
    let xs: Vec<Tensor> = xs.iter().map(|x| x.as_tensor().clone()).collect();
    for plan in plans_saving(&["y"]) {
        let e = step_error(plan.scope(|| cut_in_a_list(h.as_tensor(), &xs)));
        let e = e.unwrap_or_else(|| panic!("{plan}: no error"));
        assert_input_cut(&e, "y");
        // `h` is input 0, the list's tensors 1 to 4: the third is input 3.
        assert!(e.contains("`xs` (input 3, shape [2, 3])"), "{plan}: {e}");
    }
    // The statement API's inputs have no names: by position.
    let (a, b) = (
        var(&[2, 3], 71, 1.0, DType::F32),
        var(&[2, 3], 72, 1.0, DType::F32),
    );
    let y = remat_runtime::Region::new("api").run(&[a.as_tensor(), b.as_tensor()], |ctx, ins| {
        ctx.recompute("s", &[&ins[0], &ins[1]], |t| {
            (candle_nn::ops::softmax_last_dim(&t[0])? + &t[1])?.sum_all()
        })
    });
    let e = step_error(y.map_err(Into::into)).expect("no error");
    assert!(
        e.contains("statement `s`: input 0 (shape [2, 3]) needs gradients"),
        "{e}"
    );
}
