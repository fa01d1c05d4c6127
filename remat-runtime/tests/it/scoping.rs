//! Names a statement binds itself (in `if let`, `match` arms, `for`,
//! closures, nested blocks, `let`-`else`) shadow the block's bindings of
//! the same names, as in Rust: blocks that do so compile inside `remat!`
//! as they do outside, and give plain candle's values and gradients under
//! every plan.

use candle_core::{DType, Result, Tensor, Var};
use remat_runtime::{backward, remat, Plan};

use crate::common::{rel_diff, tensor, var};

fn plans() -> Vec<Plan> {
    vec![
        Plan::recompute_all(),
        Plan::declared(),
        Plan::save_all(),
        Plan::off(),
    ]
}

/// A decoder layer with an optional cross-attention, as encoder-decoder
/// models in candle-transformers hold it (`Option<(attention, norm)>`).
#[derive(Clone)]
struct DecoderLayer {
    self_w: Var,
    cross: Option<(Var, Var)>,
    out: Var,
}

impl DecoderLayer {
    fn new(c: usize, cross: bool, dtype: DType) -> Self {
        DecoderLayer {
            self_w: var(&[c, c], 1, 0.4, dtype),
            cross: cross.then(|| (var(&[c, c], 2, 0.4, dtype), var(&[c], 3, 1.0, dtype))),
            out: var(&[c, c], 4, 0.4, dtype),
        }
    }

    fn vars(&self) -> Vec<Var> {
        let mut v = vec![self.self_w.clone(), self.out.clone()];
        if let Some((a, n)) = &self.cross {
            v.extend([a.clone(), n.clone()]);
        }
        v
    }

    remat! {
        fn forward(&self, xs: &Tensor, enc: &Tensor) -> Result<Tensor> {
            let attn = xs.matmul(self.self_w.as_tensor())?.tanh()?;
            let mut x = (xs + &attn)?;
            if let Some((attn, ln)) = &self.cross {
                x = (&x + enc.matmul(attn.as_tensor())?.broadcast_mul(ln.as_tensor())?)?;
            }
            let y = (x.matmul(self.out.as_tensor())? + attn)?;
            Ok(y)
        }
    }

    fn plain(&self, xs: &Tensor, enc: &Tensor) -> Result<Tensor> {
        let attn = xs.matmul(self.self_w.as_tensor())?.tanh()?;
        let mut x = (xs + &attn)?;
        if let Some((attn, ln)) = &self.cross {
            x = (&x
                + enc
                    .matmul(attn.as_tensor())?
                    .broadcast_mul(ln.as_tensor())?)?;
        }
        x.matmul(self.out.as_tensor())? + attn
    }
}

remat! {
    /// Every construct that binds names, each shadowing a block binding.
    fn shadowing(x: &Tensor, w: &Tensor, pick: Option<usize>) -> Result<Tensor> {
        let h = x.matmul(w)?;
        let g = match pick {
            Some(h) => (&h_scaled(x, h)? + 0.0)?,
            None => x.clone(),
        };
        let s = [1.0f64, 2.0].iter().map(|h| h * 2.0).sum::<f64>();
        let k = {
            let h = g.exp()?;
            (h * s)?
        };
        let mut acc = h.zeros_like()?;
        for h in [0.5f64, 1.5] {
            acc = (&acc + (&k.sum_keepdim(1)? * h)?.broadcast_as(acc.shape())?)?;
        }
        let tail = if let Some(p) = pick.map(|h| h as f64) { (&h + p)? } else { h.clone() };
        let shown = { let h = 3usize; format!("{h} {}", h + 1) };
        Ok(((acc + tail)? * shown.len() as f64)?)
    }
}

fn h_scaled(x: &Tensor, h: usize) -> Result<Tensor> {
    x * (h as f64 + 1.0)
}

fn plain_shadowing(x: &Tensor, w: &Tensor, pick: Option<usize>) -> Result<Tensor> {
    let h = x.matmul(w)?;
    let g = match pick {
        Some(h) => (&h_scaled(x, h)? + 0.0)?,
        None => x.clone(),
    };
    let s = [1.0f64, 2.0].iter().map(|h| h * 2.0).sum::<f64>();
    let k = (g.exp()? * s)?;
    let mut acc = h.zeros_like()?;
    for f in [0.5f64, 1.5] {
        acc = (&acc + (&k.sum_keepdim(1)? * f)?.broadcast_as(acc.shape())?)?;
    }
    let tail = match pick.map(|p| p as f64) {
        Some(p) => (&h + p)?,
        None => h.clone(),
    };
    (acc + tail)? * "3 4".len() as f64
}

#[test]
fn a_cross_attention_bound_in_if_let_shadows_the_blocks_attn() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-6 } else { 1e-12 };
        for cross in [true, false] {
            let layer = DecoderLayer::new(4, cross, dtype);
            let xs = var(&[3, 4], 5, 1.0, dtype);
            let enc = tensor(&[3, 4], 6, 1.0, dtype);
            let reference = layer
                .plain(xs.as_tensor(), &enc)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for plan in plans() {
                let y = plan.scope(|| layer.forward(xs.as_tensor(), &enc)).unwrap();
                let g = backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap();
                for v in layer.vars().iter().chain([&xs]) {
                    let d = rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
                    assert!(d < tol, "{dtype:?} cross {cross} {plan}: {d}");
                }
            }
        }
    }
}

#[test]
fn match_arms_closures_loops_nested_blocks_and_macros_shadow_too() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        for pick in [Some(2), None] {
            let x = var(&[3, 4], 7, 0.5, dtype);
            let w = var(&[4, 4], 8, 0.5, dtype);
            let reference = plain_shadowing(x.as_tensor(), w.as_tensor(), pick)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for plan in plans() {
                let y = plan
                    .scope(|| shadowing(x.as_tensor(), w.as_tensor(), pick))
                    .unwrap();
                let g = backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap();
                for v in [&x, &w] {
                    let d = rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
                    assert!(d < tol, "{dtype:?} {pick:?} {plan}: {d}");
                }
            }
        }
    }
}

remat! {
    /// Raw identifiers, as parameters, bindings and shadowed names.
    fn raw_names(r#type: &Tensor, w: &Tensor) -> Result<Tensor> {
        let r#match = r#type.matmul(w)?;
        let r#match = { let r#type = r#match.tanh()?; (r#type * 2.0)? };
        Ok((r#match + r#type)?)
    }
}

/// Raw identifiers (`r#type`) compile inside `remat!` as outside (the
/// macro panicked on them), and give plain candle's gradients.
#[test]
fn raw_identifiers_are_names_like_any_other() {
    let x = var(&[3, 4], 21, 1.0, DType::F64);
    let w = var(&[4, 4], 22, 0.5, DType::F64);
    let plain = |x: &Tensor, w: &Tensor| -> Result<Tensor> {
        let m = x.matmul(w)?.tanh()?;
        ((m * 2.0)? + x)?.sqr()?.sum_all()
    };
    let reference = plain(x.as_tensor(), w.as_tensor())
        .unwrap()
        .backward()
        .unwrap();
    for plan in plans() {
        let y = plan
            .scope(|| raw_names(x.as_tensor(), w.as_tensor())?.sqr()?.sum_all())
            .unwrap();
        let g = backward(&y).unwrap();
        for v in [&x, &w] {
            let d = rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
            assert!(d < 1e-12, "{plan}: {d}");
        }
    }
}

/// One template, once inside `remat!` and once as a plain function: the
/// template's `h` and `g` are its own, hygienic bindings, and the caller's
/// names (`$x`, `$k`, and those `$extra` and `$more` read) are spelt alike.
macro_rules! gated {
    ($remat:ident, $plain:ident, $x:ident, $k:ident, $extra:expr, $more:expr) => {
        remat! {
            fn $remat($x: &Tensor, $k: &Tensor, w: &Tensor) -> Result<Tensor> {
                #[save] let h = $x.matmul(w)?.exp()?;
                let y = ($extra + &h)?;
                let g = y.tanh()?;
                let z = { let h = g.sin()?; let g = ($more * &h)?; (g + &h)? };
                Ok((z + &y)?)
            }
        }
        fn $plain($x: &Tensor, $k: &Tensor, w: &Tensor) -> Result<Tensor> {
            let h = $x.matmul(w)?.exp()?;
            let y = ($extra + &h)?;
            let g = y.tanh()?;
            let z = {
                let h = g.sin()?;
                let g = ($more * &h)?;
                (g + &h)?
            };
            z + &y
        }
    };
}
gated!(gated_remat, gated_plain, h, g, (h * 2.0)?, (h.cos()? + g)?);

/// A caller's `h` passed into a `macro_rules!` template that binds its own
/// `h` (and `g`) is another binding, as rustc has it (hygiene): the
/// statements reading the caller's `h` read the block's input, and its
/// gradient flows under every plan. The macro took them for one name and
/// lost the input's gradient through them under saving plans.
#[test]
fn a_macro_rules_templates_names_are_not_its_callers() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let x = var(&[4, 4], 31, 0.5, dtype);
        let k = var(&[4, 4], 33, 0.5, dtype);
        let w = var(&[4, 4], 32, 0.5, dtype);
        let reference = gated_plain(x.as_tensor(), k.as_tensor(), w.as_tensor())
            .and_then(|y| y.sqr()?.sum_all())
            .unwrap()
            .backward()
            .unwrap();
        for plan in plans() {
            let y = plan
                .scope(|| {
                    gated_remat(x.as_tensor(), k.as_tensor(), w.as_tensor())?
                        .sqr()?
                        .sum_all()
                })
                .unwrap();
            let g = backward(&y).unwrap();
            for v in [&x, &k, &w] {
                let d = match g.get(v) {
                    Some(got) => rel_diff(got, reference.get(v).unwrap()),
                    None => f64::INFINITY,
                };
                assert!(d < tol, "{dtype:?} {plan}: {d}");
            }
        }
    }
}

remat! {
    /// A closure of the block borrowing statements' outputs (`bias`, and
    /// `scale` through an alias), called by later statements, and by a
    /// closure whose parameter's type is inferred from its call; and a
    /// closure over a plain value. Later bindings take the names of what
    /// the closures borrow (`bias`, `k`) before they are called: the calls
    /// read what the closures borrowed, as in Rust. (A statement that
    /// calls such a closure and reads the later binding too is a compile
    /// error, UI case `closure_capture_shadowed`.)
    fn closure_captures(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let h = x.matmul(w)?;
        #[save] let bias = (h.sum_keepdim(0)? * 0.1)?;
        let scale = h.tanh()?;
        let s = &scale;
        let add_bias = |t: &Tensor| (t.broadcast_add(&bias)? * s)?.exp();
        let twice = |t| add_bias(&add_bias(t)?);
        let k = 0.5;
        let half = |t: &Tensor| t * k;
        let k = 3.0;
        let bias = (h.sin()? * k)?;
        let c = h.cos()?;
        let g = h.sin()?;
        let z = add_bias(&g)?;
        let u = (twice(&z)? + half(&c)?)?;
        Ok(((u + &h)? + bias)?)
    }
}

remat! {
    /// A closure borrowing a reference parameter and an optional one, both
    /// names then taken by later bindings before the calls.
    fn closure_over_parameters(x: &Tensor, g: &Tensor, m: Option<&Tensor>) -> Result<Tensor> {
        let f = |t: &Tensor| t * g;
        let gate = |t: &Tensor| match m {
            Some(m) => t.broadcast_mul(m),
            None => Ok(t.clone()),
        };
        let g = g.exp()?;
        let m = 2.0;
        let y = f(x)?;
        let z = gate(&y)?;
        Ok(((z * m)? + &g)?)
    }
}

fn closure_over_parameters_plain(x: &Tensor, g: &Tensor, m: Option<&Tensor>) -> Result<Tensor> {
    let y = (x * g)?;
    let z = match m {
        Some(m) => y.broadcast_mul(m)?,
        None => y,
    };
    (z * 2.0)? + g.exp()?
}

#[test]
fn closures_over_shadowed_parameters_read_the_parameters() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let x = var(&[3, 4], 43, 0.5, dtype);
        let g = var(&[3, 4], 44, 0.5, dtype);
        let mv = var(&[4], 45, 0.5, dtype);
        for gated in [false, true] {
            let m = gated.then_some(mv.as_tensor());
            let reference = closure_over_parameters_plain(x.as_tensor(), g.as_tensor(), m)
                .and_then(|y| y.sqr()?.sum_all())
                .unwrap()
                .backward()
                .unwrap();
            for plan in plans() {
                let y = plan
                    .scope(|| {
                        closure_over_parameters(x.as_tensor(), g.as_tensor(), m)?
                            .sqr()?
                            .sum_all()
                    })
                    .unwrap();
                let grads = backward(&y).unwrap();
                for v in [&x, &g, &mv] {
                    match (grads.get(v), reference.get(v)) {
                        (Some(a), Some(b)) => {
                            let d = rel_diff(a, b);
                            assert!(d < tol, "{dtype:?} {plan} gated {gated}: {d}");
                        }
                        (None, None) => {}
                        _ => panic!("{dtype:?} {plan} gated {gated}: presence differs"),
                    }
                }
            }
        }
    }
}

fn closure_captures_plain(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let h = x.matmul(w)?;
    let bias = (h.sum_keepdim(0)? * 0.1)?;
    let scale = h.tanh()?;
    let add_bias = |t: &Tensor| (t.broadcast_add(&bias)? * &scale)?.exp();
    let twice = |t| add_bias(&add_bias(t)?);
    let half = |t: &Tensor| t * 0.5;
    let later_bias = (h.sin()? * 3.0)?;
    let z = add_bias(&h.sin()?)?;
    let u = (twice(&z)? + half(&h.cos()?)?)?;
    (u + &h)? + later_bias
}

/// A closure that borrows statements' outputs keeps them alive while it
/// lives (the macro dropped them after the closure's definition, their
/// last mention: rustc's E0505), and the statements calling it get the
/// gradients through what it captured under every plan, saving ones
/// included.
#[test]
fn closures_borrowing_statements_outputs_keep_them_and_their_gradients() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let x = var(&[3, 4], 41, 0.5, dtype);
        let w = var(&[4, 4], 42, 0.5, dtype);
        let reference = closure_captures_plain(x.as_tensor(), w.as_tensor())
            .and_then(|y| y.sqr()?.sum_all())
            .unwrap()
            .backward()
            .unwrap();
        let mut all = plans();
        all.push(Plan::save_only(["bias", "scale"]));
        all.push(Plan::save_only(["g", "z"]));
        for plan in all {
            let y = plan
                .scope(|| {
                    closure_captures(x.as_tensor(), w.as_tensor())?
                        .sqr()?
                        .sum_all()
                })
                .unwrap();
            let g = backward(&y).unwrap();
            for v in [&x, &w] {
                let d = match g.get(v) {
                    Some(got) => rel_diff(got, reference.get(v).unwrap()),
                    None => f64::INFINITY,
                };
                assert!(d < tol, "{dtype:?} {plan}: {d}");
            }
        }
    }
}

remat! {
    /// References taken to a binding, to a reference parameter and to an
    /// optional one (and to a reference), the first two then shadowed: the
    /// references still read the first values.
    fn alias_then_shadow(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let xr = &x;
        let br = &bias;
        let h = x.matmul(w)?;
        let r = &h;
        let rr = &r;
        #[save]
        let h = h.exp()?;
        let x = (x * 0.5)?;
        let g = (rr.sqr()? * 2.0)?;
        let h = (&h + &g)?.broadcast_add(br.unwrap())?;
        let y = ((r + &h)?.tanh()? + (xr.sum_keepdim(1)? + x.sum_keepdim(1)?)?.broadcast_as(h.shape())?)?;
        Ok(y)
    }
}

fn alias_then_shadow_plain(x: &Tensor, w: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let h1 = x.matmul(w)?;
    let h2 = h1.exp()?;
    let g = (h1.sqr()? * 2.0)?;
    let h3 = (&h2 + &g)?.broadcast_add(bias)?;
    let xs = (x.sum_keepdim(1)? + (x * 0.5)?.sum_keepdim(1)?)?;
    (&h1 + &h3)?.tanh()? + xs.broadcast_as(h3.shape())?
}

/// `let r = &h; let h = ...; ... r ...` failed to compile (E0382: the first
/// `h` was released by name after its last reader through `r`, where `h`
/// named the second); `let xr = &x;` of a parameter `x: &Tensor` (and
/// `let rr = &r;`) was read as a plain value, and saving plans lost the
/// gradient through it silently. Every gradient is plain candle's.
#[test]
fn a_reference_to_a_binding_shadowed_later_reads_the_first_value() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let x = var(&[3, 4], 51, 0.5, dtype);
        let w = var(&[4, 4], 52, 0.5, dtype);
        let b = var(&[4], 53, 0.5, dtype);
        let reference = alias_then_shadow_plain(x.as_tensor(), w.as_tensor(), b.as_tensor())
            .and_then(|y| y.sqr()?.sum_all())
            .unwrap()
            .backward()
            .unwrap();
        let mut all = plans();
        all.push(Plan::save_only(["g"]));
        for plan in all {
            let y = plan
                .scope(|| {
                    alias_then_shadow(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()))?
                        .sqr()?
                        .sum_all()
                })
                .unwrap();
            let g = backward(&y).unwrap();
            for (name, v) in [("x", &x), ("w", &w), ("bias", &b)] {
                let d = match g.get(v) {
                    Some(got) => rel_diff(got, reference.get(v).unwrap()),
                    None => f64::INFINITY,
                };
                assert!(d < tol, "{dtype:?} {plan} {name}: {d}");
            }
        }
    }
}

remat! {
    /// A helper closure over a saved output, a number it moves (a `f64`
    /// parameter) and a count made by plain code.
    fn closure_moves_numbers(x: &Tensor, w: &Tensor, k: f64) -> Result<Tensor> {
        #[save]
        let g = x.matmul(w)?.tanh()?;
        let n = g.dim(1)?;
        let gate = |t: &Tensor| -> Result<Tensor> { ((t * g.exp()?)? * k)? / n as f64 };
        let b = gate(&x.sin()?)?;
        Ok((b + &g)?)
    }
}

fn closure_moves_numbers_plain(x: &Tensor, w: &Tensor, k: f64) -> Result<Tensor> {
    let g = x.matmul(w)?.tanh()?;
    let n = g.dim(1)?;
    let gate = |t: &Tensor| -> Result<Tensor> { ((t * g.exp()?)? * k)? / n as f64 };
    let b = gate(&x.sin()?)?;
    b + &g
}

/// A closure that reads a statement's output and moves a number: under
/// saving plans its caller read the forward's output (the closure was left
/// to plain code) and the gradient through it was lost silently. Every
/// gradient is plain candle's.
#[test]
fn a_closure_moving_a_number_keeps_the_outputs_it_borrows_and_their_gradients() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let x = var(&[3, 4], 61, 0.5, dtype);
        let w = var(&[4, 4], 62, 0.5, dtype);
        let reference = closure_moves_numbers_plain(x.as_tensor(), w.as_tensor(), 1.5)
            .and_then(|y| y.sqr()?.sum_all())
            .unwrap()
            .backward()
            .unwrap();
        let mut all = plans();
        all.push(Plan::save_only(["b"]));
        all.push(Plan::budget(0.5));
        for plan in all {
            let y = plan
                .scope(|| {
                    closure_moves_numbers(x.as_tensor(), w.as_tensor(), 1.5)?
                        .sqr()?
                        .sum_all()
                })
                .unwrap();
            let g = backward(&y).unwrap();
            for (name, v) in [("x", &x), ("w", &w)] {
                let d = match g.get(v) {
                    Some(got) => rel_diff(got, reference.get(v).unwrap()),
                    None => f64::INFINITY,
                };
                assert!(d < tol, "{dtype:?} {plan} {name}: {d}");
            }
        }
    }
}

/// Closures over `mut` bindings, as model code writes them: one reading a
/// binding assigned before it, one reading a binding that a statement
/// reads again between the closure and its calls, one changing what it
/// borrows (`FnMut`: a counter and a list it pushes to), closures calling
/// closures, a `move` closure and one giving back what it took (`FnOnce`).
/// They were left to plain code: saving plans read the forward's values
/// through them and the gradient was lost without an error (x and w off by
/// 5.8 and 9.0 under `save_all`), or the block did not compile (E0505,
/// E0277; a `move` closure: E0382 with a help naming the expansion's
/// `value`). Each calling statement now defines the closure again over its
/// own copies, and gives back what it changed.
mod mut_closures {
    use super::*;

    remat! {
        /// A closure indexing a list of tensors, called in a loop and by a
        /// statement reading one of them through it: read in part, as
        /// `ws[2]` written in the statement is (it was `InputCut`).
        pub fn indexing(x: &Tensor, w: &Tensor) -> Result<Tensor> {
            let ws = vec![w.tanh()?, (w * 0.5)?, w.sin()?];
            let b = w.sum_keepdim(0)?;
            let step = |i: usize, t: &Tensor| t.matmul(&ws[i])?.broadcast_add(&b);
            let mut h = x.clone();
            for i in 0..3 {
                h = step(i, &h)?.tanh()?;
            }
            let last = step(2, &h)?;
            Ok(last)
        }
    }

    remat! {
        pub fn assigned_before(x: &Tensor, w: &Tensor) -> Result<Tensor> {
            let mut g = x.matmul(w)?.tanh()?;
            g = (g * 2.0)?;
            let gate = |t: &Tensor| -> Result<Tensor> { t * g.exp()? };
            let b = gate(&x.sin()?)?;
            Ok((b + &g)?)
        }
    }

    remat! {
        pub fn read_between(x: &Tensor, w: &Tensor) -> Result<Tensor> {
            let mut g = x.matmul(w)?.tanh()?;
            let gate = |t: &Tensor| -> Result<Tensor> { t * g.exp()? };
            let n = g.sum_all()?;
            let b = gate(&x.sin()?)?;
            let c = gate(&b)?;
            g = (g * 2.0)?;
            Ok((b.broadcast_add(&n)? + &g + c)?)
        }
    }

    remat! {
        pub fn changing(x: &Tensor, w: &Tensor) -> Result<Tensor> {
            let h = x.matmul(w)?.tanh()?;
            let mut outs: Vec<Tensor> = Vec::new();
            let mut k = 0usize;
            let mut keep = |t: &Tensor| -> Result<()> {
                k += 1;
                outs.push((t * k as f64)?.exp()?);
                Ok(())
            };
            keep(&h)?;
            keep(&x.sin()?)?;
            let mut acc = x.cos()?;
            let mut mul = |t: &Tensor| -> Result<()> {
                acc = (&acc * t)?;
                Ok(())
            };
            mul(&h)?;
            mul(&outs[0])?;
            let scale = |t: &Tensor| -> Result<Tensor> { t * h.sqr()? };
            let twice = |t: &Tensor| -> Result<Tensor> { scale(&scale(t)?) };
            let z = twice(&outs[1])?;
            let all = Tensor::cat(&outs, 1)?.sum_keepdim(1)?;
            let g = all.exp()?;
            let moved = move |t: &Tensor| -> Result<Tensor> { t.broadcast_mul(&g) };
            let taken = || acc;
            Ok(((moved(&z)? * k as f64)? + taken())?)
        }
    }
}

fn indexing_plain(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let ws = [w.tanh()?, (w * 0.5)?, w.sin()?];
    let b = w.sum_keepdim(0)?;
    let step = |i: usize, t: &Tensor| t.matmul(&ws[i])?.broadcast_add(&b);
    let mut h = x.clone();
    for i in 0..3 {
        h = step(i, &h)?.tanh()?;
    }
    step(2, &h)
}

fn assigned_before_plain(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let mut g = x.matmul(w)?.tanh()?;
    g = (g * 2.0)?;
    let gate = |t: &Tensor| -> Result<Tensor> { t * g.exp()? };
    let b = gate(&x.sin()?)?;
    b + &g
}

fn read_between_plain(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let mut g = x.matmul(w)?.tanh()?;
    let gate = |t: &Tensor| -> Result<Tensor> { t * g.exp()? };
    let n = g.sum_all()?;
    let b = gate(&x.sin()?)?;
    let c = gate(&b)?;
    g = (g * 2.0)?;
    b.broadcast_add(&n)? + &g + c
}

fn changing_plain(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let h = x.matmul(w)?.tanh()?;
    let mut outs: Vec<Tensor> = Vec::new();
    let mut k = 0usize;
    let mut keep = |t: &Tensor| -> Result<()> {
        k += 1;
        outs.push((t * k as f64)?.exp()?);
        Ok(())
    };
    keep(&h)?;
    keep(&x.sin()?)?;
    let mut acc = x.cos()?;
    let mut mul = |t: &Tensor| -> Result<()> {
        acc = (&acc * t)?;
        Ok(())
    };
    mul(&h)?;
    mul(&outs[0])?;
    let scale = |t: &Tensor| -> Result<Tensor> { t * h.sqr()? };
    let twice = |t: &Tensor| -> Result<Tensor> { scale(&scale(t)?) };
    let z = twice(&outs[1])?;
    let all = Tensor::cat(&outs, 1)?.sum_keepdim(1)?;
    let g = all.exp()?;
    let moved = move |t: &Tensor| -> Result<Tensor> { t.broadcast_mul(&g) };
    let taken = || acc;
    (moved(&z)? * k as f64)? + taken()
}

type Block2 = fn(&Tensor, &Tensor) -> Result<Tensor>;

#[test]
fn closures_over_mut_bindings_keep_every_gradient() {
    let blocks: [(&str, Block2, Block2); 4] = [
        ("indexing", mut_closures::indexing, indexing_plain),
        (
            "assigned_before",
            mut_closures::assigned_before,
            assigned_before_plain,
        ),
        (
            "read_between",
            mut_closures::read_between,
            read_between_plain,
        ),
        ("changing", mut_closures::changing, changing_plain),
    ];
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let x = var(&[3, 4], 71, 0.5, dtype);
        let w = var(&[4, 4], 72, 0.5, dtype);
        for (block, remat, plain) in blocks {
            let reference = plain(x.as_tensor(), w.as_tensor())
                .and_then(|y| y.sqr()?.sum_all())
                .unwrap()
                .backward()
                .unwrap();
            let mut all = plans();
            all.push(Plan::save_only(["b", "z"]));
            all.push(Plan::budget(0.5));
            for plan in all {
                let y = plan
                    .scope(|| remat(x.as_tensor(), w.as_tensor())?.sqr()?.sum_all())
                    .unwrap();
                let g = backward(&y).unwrap();
                for (name, v) in [("x", &x), ("w", &w)] {
                    let d = match g.get(v) {
                        Some(got) => rel_diff(got, reference.get(v).unwrap()),
                        None => f64::INFINITY,
                    };
                    assert!(d < tol, "{block} {dtype:?} {plan} {name}: {d}");
                }
            }
        }
    }
}
