//! Blocks written with `remat!`, checked against the same code without
//! checkpointing (the `plain` functions below are the block bodies copied
//! verbatim, run as ordinary candle code). Tolerances as in
//! `grad_equality.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::common::*;
use candle_core::{DType, Result, Tensor, Var, D};
use remat_runtime::remat;

#[derive(Clone)]
pub struct Linear {
    w: Var,
    b: Var,
}

impl Linear {
    fn new(i: usize, o: usize, seed: u64) -> Self {
        let s = 0.5 / (i as f64).sqrt();
        Linear {
            w: var(&[i, o], seed, s, DType::F32),
            b: var(&[o], seed + 1, 0.1, DType::F32),
        }
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.broadcast_matmul(&self.w)?.broadcast_add(&self.b)
    }
}

#[derive(Clone)]
pub struct Norm {
    g: Var,
    b: Var,
}

#[derive(Clone)]
pub struct BlockParams {
    ln1: Norm,
    c_attn: Linear,
    c_proj: Linear,
    ln2: Norm,
    c_fc: Linear,
    mlp_proj: Linear,
    n_head: usize,
}

impl BlockParams {
    fn new(c: usize, n_head: usize, seed: u64) -> Self {
        let norm = |s| Norm {
            g: Var::from_tensor(&(tensor(&[c], s, 0.1, DType::F32) + 1.0).unwrap()).unwrap(),
            b: var(&[c], s + 1, 0.1, DType::F32),
        };
        BlockParams {
            ln1: norm(seed),
            c_attn: Linear::new(c, 3 * c, seed + 2),
            c_proj: Linear::new(c, c, seed + 4),
            ln2: norm(seed + 6),
            c_fc: Linear::new(c, 4 * c, seed + 8),
            mlp_proj: Linear::new(4 * c, c, seed + 10),
            n_head,
        }
    }
    fn vars(&self) -> Vec<Var> {
        let l = |l: &Linear| [l.w.clone(), l.b.clone()];
        let mut v = vec![
            self.ln1.g.clone(),
            self.ln1.b.clone(),
            self.ln2.g.clone(),
            self.ln2.b.clone(),
        ];
        for lin in [&self.c_attn, &self.c_proj, &self.c_fc, &self.mlp_proj] {
            v.extend(l(lin));
        }
        v
    }
}

fn layer_norm(x: &Tensor, n: &Norm) -> Result<Tensor> {
    candle_nn::ops::layer_norm_slow(x, &n.g, &n.b, 1e-5)
}

fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let att = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?.broadcast_add(mask)?;
    let y = candle_nn::ops::softmax(&att, D::Minus1)?.matmul(v)?;
    y.transpose(1, 2)?.reshape((b, t, h * d))
}

remat! {
    /// GPT-2 block, as in the macro issue.
    pub fn block(x: &Tensor, p: &BlockParams, mask: &Tensor) -> Result<Tensor> {
        let h = layer_norm(x, &p.ln1)?;
        #[save(name = "attn.qkv")] let qkv = p.c_attn.forward(&h)?;
        let (q, k, v) = split_heads(&qkv, p.n_head)?;
        #[save] let y = attention(&q, &k, &v, mask)?;
        let x = (x + p.c_proj.forward(&y)?)?;
        let h = layer_norm(&x, &p.ln2)?;
        #[recompute] let f = p.c_fc.forward(&h)?.gelu()?;
        #[save] let o = p.mlp_proj.forward(&f)?;
        Ok((x + o)?)
    }

    /// The same block, everything recomputed.
    pub fn block_recompute(x: &Tensor, p: &BlockParams, mask: &Tensor) -> Result<Tensor> {
        let h = layer_norm(x, &p.ln1)?;
        let qkv = p.c_attn.forward(&h)?;
        let (q, k, v) = split_heads(&qkv, p.n_head)?;
        let y = attention(&q, &k, &v, mask)?;
        let x = (x + p.c_proj.forward(&y)?)?;
        let h = layer_norm(&x, &p.ln2)?;
        let f = p.c_fc.forward(&h)?.gelu()?;
        let o = p.mlp_proj.forward(&f)?;
        Ok((x + o)?)
    }

    /// The same block, everything saved.
    pub fn block_save(x: &Tensor, p: &BlockParams, mask: &Tensor) -> Result<Tensor> {
        #[save(name = "ln1")] let h = layer_norm(x, &p.ln1)?;
        #[save] let qkv = p.c_attn.forward(&h)?;
        #[save(name = "heads")] let (q, k, v) = split_heads(&qkv, p.n_head)?;
        #[save] let y = attention(&q, &k, &v, mask)?;
        #[save(name = "attn.res")] let x = (x + p.c_proj.forward(&y)?)?;
        #[save(name = "ln2")] let h = layer_norm(&x, &p.ln2)?;
        #[save] let f = p.c_fc.forward(&h)?.gelu()?;
        #[save] let o = p.mlp_proj.forward(&f)?;
        Ok((x + o)?)
    }
}

fn plain(x: &Tensor, p: &BlockParams, mask: &Tensor) -> Result<Tensor> {
    let h = layer_norm(x, &p.ln1)?;
    let qkv = p.c_attn.forward(&h)?;
    let (q, k, v) = split_heads(&qkv, p.n_head)?;
    let y = attention(&q, &k, &v, mask)?;
    let x = (x + p.c_proj.forward(&y)?)?;
    let h = layer_norm(&x, &p.ln2)?;
    let f = p.c_fc.forward(&h)?.gelu()?;
    let o = p.mlp_proj.forward(&f)?;
    x + o
}

type BlockFn = fn(&Tensor, &BlockParams, &Tensor) -> Result<Tensor>;

fn compare(f: BlockFn) -> f64 {
    let p = BlockParams::new(32, 4, 3);
    let x = var(&[2, 8, 32], 4, 1.0, DType::F32);
    let mask = causal_mask(8, DType::F32);
    let wloss = |y: &Tensor| {
        (y * tensor(y.dims(), 9, 1.0, DType::F32))
            .unwrap()
            .sum_all()
            .unwrap()
    };
    let y_ref = plain(x.as_tensor(), &p, &mask).unwrap();
    let g_ref = wloss(&y_ref).backward().unwrap();
    let y = f(x.as_tensor(), &p, &mask).unwrap();
    assert_eq!(rel_diff(&y, &y_ref), 0.0, "forward differs");
    let g = wloss(&y).backward().unwrap();
    let mut vars = vec![x];
    vars.extend(p.vars());
    let worst = vars
        .iter()
        .map(|v| {
            rel_diff(
                g.get(v).expect("gradient"),
                g_ref.get(v).expect("reference gradient"),
            )
        })
        .fold(0.0, f64::max);
    println!("max relative gradient difference {worst:e}");
    worst
}

#[test]
fn gpt_block_mixed() {
    assert!(compare(block) <= 1e-6);
}

#[test]
fn gpt_block_all_recompute_is_exact() {
    assert_eq!(compare(block_recompute), 0.0);
}

#[test]
fn gpt_block_all_save() {
    assert!(compare(block_save) <= 1e-6);
}

static SAVED_RUNS: AtomicUsize = AtomicUsize::new(0);
static RECOMPUTED_RUNS: AtomicUsize = AtomicUsize::new(0);

fn counted(t: &Tensor, counter: &AtomicUsize) -> Result<Tensor> {
    counter.fetch_add(1, Ordering::SeqCst);
    t.tanh()
}

remat! {
    fn counting(x: &Tensor, w: &Var) -> Result<Tensor> {
        #[save] let a = counted(&x.matmul(w)?, &SAVED_RUNS)?;
        let b = counted(&a, &RECOMPUTED_RUNS)?;
        Ok(b.sum_all()?)
    }
}

#[test]
fn saved_statements_run_once_recomputed_twice() {
    let x = var(&[3, 4], 1, 1.0, DType::F32);
    let w = var(&[4, 4], 2, 0.5, DType::F32);
    let y = counting(x.as_tensor(), &w).unwrap();
    assert_eq!(
        (
            SAVED_RUNS.load(Ordering::SeqCst),
            RECOMPUTED_RUNS.load(Ordering::SeqCst)
        ),
        (1, 1)
    );
    let g = y.backward().unwrap();
    assert_eq!(
        (
            SAVED_RUNS.load(Ordering::SeqCst),
            RECOMPUTED_RUNS.load(Ordering::SeqCst)
        ),
        (1, 2)
    );
    // and the gradient is right: d/dw sum(tanh(tanh(x w)))
    let a = x.as_tensor().matmul(&w).unwrap().tanh().unwrap();
    let reference = a.tanh().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(
        rel_diff(g.get(&w).unwrap(), reference.get(&w).unwrap()),
        0.0
    );
}

remat! {
    /// Five inputs, two outputs, a tuple statement.
    fn five(a: &Tensor, b: &Tensor, c: &Tensor, d: &Tensor, e: &Tensor, w: &Var) -> Result<(Tensor, Tensor)> {
        let s = (a * b)?;
        #[save] let m = (s.matmul(w)? + c.tanh()?)?;
        let (p, q) = ((&m * d)?.exp()?, (m.sqr()? - e)?);
        #[save] let q2 = (q + a)?;
        Ok((p, q2))
    }

    /// A block calling another checkpointed block inside a statement.
    fn outer(x: &Tensor, w: &Var) -> Result<Tensor> {
        let h = x.matmul(w)?;
        #[save] let inner = five(&h, &h, x, x, &h, w)?;
        let y = (inner.0.sin()? + inner.1)?;
        Ok(y)
    }
}

fn five_plain(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    d: &Tensor,
    e: &Tensor,
    w: &Var,
) -> Result<(Tensor, Tensor)> {
    let s = (a * b)?;
    let m = (s.matmul(w)? + c.tanh()?)?;
    let (p, q) = ((&m * d)?.exp()?, (m.sqr()? - e)?);
    let q2 = (q + a)?;
    Ok((p, q2))
}

type FiveFn = fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, &Var) -> Result<(Tensor, Tensor)>;

#[test]
fn five_inputs_two_outputs_through_the_macro() {
    let ins: Vec<Var> = (0..5)
        .map(|i| var(&[4, 4], 40 + i, 1.0, DType::F32))
        .collect();
    let w = var(&[4, 4], 50, 0.5, DType::F32);
    let t: Vec<&Tensor> = ins.iter().map(|v| v.as_tensor()).collect();
    let run = |f: FiveFn| {
        let (p, q) = f(t[0], t[1], t[2], t[3], t[4], &w).unwrap();
        let g = (weighted_sum(&p, 1) + weighted_sum(&q, 2))
            .unwrap()
            .backward()
            .unwrap();
        let mut out = vec![p, q];
        out.extend(ins.iter().chain([&w]).map(|v| g.get(v).unwrap().clone()));
        out
    };
    for (a, b) in run(five).iter().zip(run(five_plain)) {
        assert_eq!(rel_diff(a, &b), 0.0);
    }
}

#[test]
fn nested_macro_blocks() {
    let x = var(&[4, 4], 60, 1.0, DType::F32);
    let w = var(&[4, 4], 61, 0.5, DType::F32);
    let y = outer(x.as_tensor(), &w).unwrap();
    let g = weighted_sum(&y, 3).backward().unwrap();
    let h = x.as_tensor().matmul(&w).unwrap();
    let (p, q) = five_plain(&h, &h, x.as_tensor(), x.as_tensor(), &h, &w).unwrap();
    let y_ref = (p.sin().unwrap() + q).unwrap();
    let g_ref = weighted_sum(&y_ref, 3).backward().unwrap();
    assert_eq!(rel_diff(&y, &y_ref), 0.0);
    for v in [&x, &w] {
        let d = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
        assert!(d <= 1e-6, "{d:e}");
    }
}

#[test]
fn stack_of_macro_blocks() {
    let layers: Vec<BlockParams> = (0..4)
        .map(|i| BlockParams::new(32, 4, 100 + 20 * i))
        .collect();
    let x = var(&[2, 8, 32], 70, 1.0, DType::F32);
    let mask = causal_mask(8, DType::F32);
    let run = |f: BlockFn| {
        let mut h = x.as_tensor().clone();
        for p in &layers {
            h = f(&h, p, &mask).unwrap();
        }
        let g = weighted_sum(&h, 4).backward().unwrap();
        let mut vars = vec![x.clone()];
        vars.extend(layers.iter().flat_map(|p| p.vars()));
        (
            h,
            vars.iter()
                .map(|v| g.get(v).unwrap().clone())
                .collect::<Vec<_>>(),
        )
    };
    let (y_ref, g_ref) = run(plain);
    let (y, g) = run(block);
    assert_eq!(rel_diff(&y, &y_ref), 0.0);
    let worst = g
        .iter()
        .zip(&g_ref)
        .map(|(a, b)| rel_diff(a, b))
        .fold(0.0, f64::max);
    println!("4-layer macro stack: max relative gradient difference {worst:e}");
    assert!(worst <= 1e-6);
}

// The idioms candle code writes that the macro takes unchanged: a slice of
// candle-nn layers, an optional mask, a `mut` binding updated by a loop and
// by an assignment, a value moved into a match.
remat! {
    fn idioms(x: &Tensor, layers: &[candle_nn::Linear], mask: Option<&Tensor>) -> Result<Tensor> {
        let mut h = x.clone();
        for l in layers {
            h = candle_nn::Module::forward(l, &h)?.tanh()?;
        }
        h = (h * 2.0)?;
        let h = match mask {
            Some(m) => h.broadcast_mul(m)?,
            None => h,
        };
        Ok(h.sin()?)
    }
}

/// `idioms`' body, copied verbatim, as plain candle code.
#[allow(clippy::needless_question_mark)]
fn idioms_plain(x: &Tensor, layers: &[candle_nn::Linear], mask: Option<&Tensor>) -> Result<Tensor> {
    let mut h = x.clone();
    for l in layers {
        h = candle_nn::Module::forward(l, &h)?.tanh()?;
    }
    h = (h * 2.0)?;
    let h = match mask {
        Some(m) => h.broadcast_mul(m)?,
        None => h,
    };
    Ok(h.sin()?)
}

#[test]
fn slices_optional_masks_and_mut_loops_match_plain_candle() {
    use remat_runtime::Plan;
    let ws: Vec<Var> = (0..3)
        .map(|i| var(&[6, 6], 20 + i, 0.4, DType::F32))
        .collect();
    let bs: Vec<Var> = (0..3).map(|i| var(&[6], 30 + i, 0.1, DType::F32)).collect();
    let layers: Vec<candle_nn::Linear> = ws
        .iter()
        .zip(&bs)
        .map(|(w, b)| candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone())))
        .collect();
    let x = var(&[4, 6], 40, 1.0, DType::F32);
    let mask = tensor(&[6], 41, 1.0, DType::F32);
    let wloss = |y: &Tensor| (y * tensor(y.dims(), 42, 1.0, DType::F32))?.sum_all();
    for m in [Some(&mask), None] {
        let g_ref = wloss(&idioms_plain(x.as_tensor(), &layers, m).unwrap())
            .unwrap()
            .backward()
            .unwrap();
        for plan in [Plan::default(), Plan::save_all()] {
            let y = plan.scope(|| idioms(x.as_tensor(), &layers, m)).unwrap();
            let g = wloss(&y).unwrap().backward().unwrap();
            let mut vars = vec![&x];
            vars.extend(ws.iter().chain(&bs));
            for v in vars {
                // Full recompute runs the same ops in the same order: exact.
                // Saving changes nothing in the arithmetic either.
                assert_eq!(
                    rel_diff(g.get(v).expect("gradient"), g_ref.get(v).unwrap()),
                    0.0,
                    "mask {:?}, plan {plan:?}",
                    m.is_some()
                );
            }
        }
    }
}

#[test]
fn checkpoint_sequential_takes_candle_modules() {
    use candle_core::Module;
    let ws: Vec<Var> = (0..4)
        .map(|i| var(&[5, 5], 50 + i, 0.4, DType::F32))
        .collect();
    let layers: Vec<candle_nn::Linear> = ws
        .iter()
        .map(|w| candle_nn::Linear::new(w.as_tensor().clone(), None))
        .collect();
    let x = var(&[3, 5], 60, 1.0, DType::F32);
    let mut h = x.as_tensor().clone();
    for l in &layers {
        h = l.forward(&h).unwrap();
    }
    let g_ref = h.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let y = remat_runtime::checkpoint_sequential("linears", 2, x.as_tensor(), layers).unwrap();
    let g = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    for v in ws.iter().chain([&x]) {
        // The same ops in the same order, replayed: exact.
        assert_eq!(rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap()), 0.0);
    }
}
