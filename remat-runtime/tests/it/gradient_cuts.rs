//! A statement that reads values needing gradients and gives a
//! floating-point output carrying none (candle's backward-less fused ops)
//! is an error naming the region and the statement, under every plan; a
//! statement that reads them only for their shapes, builds constants,
//! gives integers or states its cut with `.detach()` is not.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use remat_runtime::{backward, remat, Plan, Region, RematError};

use crate::common::{rel_diff, var};

const DTYPES: [DType; 2] = [DType::F32, DType::F64];
/// candle's fused norms run in these (not in f64).
const NORM_DTYPES: [DType; 2] = [DType::F32, DType::F16];

fn plans() -> Vec<Plan> {
    vec![
        Plan::recompute_all(),
        Plan::declared(),
        Plan::save_all(),
        Plan::off(),
    ]
}

/// A pre-norm MLP layer as candle-transformers writes it.
#[derive(Clone)]
struct Layer {
    norm: Var,
    up: Var,
    down: Var,
}

impl Layer {
    fn new(d: usize, dtype: DType) -> Self {
        Layer {
            norm: Var::from_tensor(&(var(&[d], 1, 0.1, dtype).as_tensor() + 1.0).unwrap()).unwrap(),
            up: var(&[d, 2 * d], 2, 0.3, dtype),
            down: var(&[2 * d, d], 3, 0.3, dtype),
        }
    }
}

remat! {
    /// candle's fused `rms_norm`, which has no backward.
    fn fused_norm_layer(xs: &Tensor, p: &Layer) -> Result<Tensor> {
        let (_b, _t, _c) = xs.dims3()?;
        let h = candle_nn::ops::rms_norm(xs, p.norm.as_tensor(), 1e-6)?;
        let up = h.broadcast_matmul(p.up.as_tensor())?.silu()?;
        let down = up.broadcast_matmul(p.down.as_tensor())?;
        Ok((xs + down)?)
    }
}

remat! {
    /// The same layer with candle's composed (differentiable) norm.
    fn slow_norm_layer(xs: &Tensor, p: &Layer) -> Result<Tensor> {
        let (_b, _t, _c) = xs.dims3()?;
        let h = candle_nn::ops::rms_norm_slow(xs, p.norm.as_tensor(), 1e-6)?;
        let up = h.broadcast_matmul(p.up.as_tensor())?.silu()?;
        let down = up.broadcast_matmul(p.down.as_tensor())?;
        Ok((xs + down)?)
    }
}

remat! {
    /// Attention scores through candle's backward-less `softmax_last_dim`.
    fn fused_softmax(q: &Tensor, k: &Tensor) -> Result<Tensor> {
        let scores = q.matmul(&k.t()?)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let loss = probs.sqr()?.sum_all()?;
        Ok(loss)
    }
}

/// The error of a call, as the runtime's error when it is one (the
/// statement API, `backward`) and as text otherwise (a `remat!` function
/// returning `candle_core::Result` wraps it): from the forward (saved
/// statements, plain runs) or from the backward (recomputed statements).
fn error_of<E: std::fmt::Display + 'static>(
    y: std::result::Result<Tensor, E>,
) -> (Option<RematError>, String) {
    match y {
        Err(e) => {
            let text = e.to_string();
            let typed = (&e as &dyn std::any::Any)
                .downcast_ref::<RematError>()
                .cloned();
            (typed, text)
        }
        Ok(y) => {
            let e = backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap_err();
            let text = e.to_string();
            (Some(e), text)
        }
    }
}

fn assert_cut(
    (typed, text): (Option<RematError>, String),
    region_name: &str,
    statement_name: &str,
) {
    if let Some(e) = &typed {
        assert!(
            matches!(e, RematError::GradientCut { region, statement, output: 0 }
                if region == region_name && statement == statement_name),
            "{e:?}"
        );
    }
    let head = format!(
        "region `{region_name}`, statement `{statement_name}`: output 0 carries no gradient"
    );
    assert!(text.contains(&head), "{text}");
    assert!(text.contains("remat_runtime::candle_nn"), "{text}");
    assert!(text.contains(".detach()"), "{text}");
}

#[test]
fn a_backward_less_op_on_a_tracked_value_is_an_error_under_every_plan() {
    for dtype in NORM_DTYPES {
        for plan in plans() {
            let p = Layer::new(8, dtype);
            let x = var(&[2, 3, 8], 4, 1.0, dtype);
            let y = plan.scope(|| fused_norm_layer(x.as_tensor(), &p));
            assert_cut(error_of(y), "fused_norm_layer", "h");
        }
    }
    for dtype in DTYPES {
        for plan in plans() {
            let q = var(&[4, 8], 5, 1.0, dtype);
            let k = var(&[6, 8], 6, 1.0, dtype);
            let y = plan.scope(|| fused_softmax(q.as_tensor(), k.as_tensor()));
            assert_cut(error_of(y), "fused_softmax", "probs");
        }
    }
}

#[test]
fn the_same_layer_with_differentiable_ops_matches_plain_candle() {
    for dtype in DTYPES {
        for plan in plans() {
            let p = Layer::new(8, dtype);
            let x = var(&[2, 3, 8], 4, 1.0, dtype);
            let y = plan.scope(|| slow_norm_layer(x.as_tensor(), &p)).unwrap();
            let g = backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap();
            let h = candle_nn::ops::rms_norm_slow(x.as_tensor(), p.norm.as_tensor(), 1e-6).unwrap();
            let up = h
                .broadcast_matmul(p.up.as_tensor())
                .unwrap()
                .silu()
                .unwrap();
            let down = up.broadcast_matmul(p.down.as_tensor()).unwrap();
            let plain = (x.as_tensor() + down).unwrap();
            let pg = plain.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &p.norm, &p.up, &p.down] {
                let d = rel_diff(g.get(v).unwrap(), pg.get(v).unwrap());
                assert!(d < 1e-6, "{dtype:?} {plan}: {d}");
            }
        }
    }
}

#[test]
fn rope_and_layer_norm_without_backward_are_errors_too() {
    for dtype in DTYPES {
        for plan in plans() {
            let x = var(&[1, 2, 4, 8], 7, 1.0, dtype);
            let cos = Tensor::ones((4, 4), dtype, &Device::Cpu).unwrap();
            let sin = Tensor::zeros((4, 4), dtype, &Device::Cpu).unwrap();
            let region = Region::new("rope");
            let y = region
                .plan(plan.clone())
                .run(&[x.as_tensor()], move |ctx, ins| {
                    let (cos, sin) = (cos.clone(), sin.clone());
                    let r = ctx.open("rotated", &[&ins[0]], move |t| {
                        candle_nn::rotary_emb::rope(&t[0].contiguous()?, &cos, &sin)
                    })?;
                    ctx.open("loss", &[&r], |t| t[0].sqr()?.sum_all())
                });
            assert_cut(error_of(y), "rope", "rotated");
        }
    }
    for dtype in NORM_DTYPES {
        for plan in plans() {
            let x = var(&[1, 2, 4, 8], 7, 1.0, dtype);
            let g = Tensor::ones(8, dtype, &Device::Cpu).unwrap();
            let b = Tensor::zeros(8, dtype, &Device::Cpu).unwrap();
            let y = Region::new("ln")
                .plan(plan.clone())
                .run(&[x.as_tensor()], move |ctx, ins| {
                    let (g, b) = (g.clone(), b.clone());
                    let n = ctx.open("normed", &[&ins[0]], move |t| {
                        candle_nn::ops::layer_norm(&t[0], &g, &b, 1e-5)
                    })?;
                    ctx.open("loss", &[&n], |t| t[0].sqr()?.sum_all())
                });
            assert_cut(error_of(y), "ln", "normed");
        }
    }
}

/// A causal mask built from an input's shape.
fn causal(t: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let v: Vec<f64> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f64::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(v, (t, t), device)?.to_dtype(dtype)
}

remat! {
    /// Statements that read tracked values only for their shapes, build
    /// constants from them, give integers, or detach on purpose: none is a
    /// cut.
    fn shapes_and_constants(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let (t, c) = x.dims2()?;
        let zeros = Tensor::zeros((x.dim(0)?, w.dim(1)?), x.dtype(), x.device())?;
        let unused = Tensor::zeros(x.shape(), x.dtype(), x.device())?;
        let ones = x.ones_like()?;
        let mask = causal(t, x.dtype(), x.device())?;
        let shifted = causal(x.dim(0)?, x.dtype(), x.device())?.detach();
        let best = x.argmax_keepdim(D::Minus1)?;
        let positive = x.ge(0.0)?;
        let frozen = x.detach().sqr()?;
        let h = (x.matmul(w)? + zeros)?.broadcast_mul(&ones.narrow(1, 0, 1)?)?;
        let s = h.matmul(&h.t()?)?;
        let masked = (s.broadcast_add(&mask)? + shifted)?;
        let p = candle_nn::ops::softmax(&masked, D::Minus1)?;
        let picked = best.to_dtype(x.dtype())?.sum_all()?;
        let count = positive.to_dtype(x.dtype())?.sum_all()?;
        let loss = ((p.sqr()?.sum_all()? + frozen.mean_all()?)? + (picked + count)?.affine(0.0, c as f64)?)?;
        drop(unused);
        Ok(loss)
    }
}

fn plain_shapes_and_constants(x: &Tensor, w: &Tensor) -> Tensor {
    let (t, c) = x.dims2().unwrap();
    let mask = causal(t, x.dtype(), x.device()).unwrap();
    let h = x.matmul(w).unwrap();
    let s = h.matmul(&h.t().unwrap()).unwrap();
    let masked = (s.broadcast_add(&mask).unwrap() + &mask).unwrap();
    let p = candle_nn::ops::softmax(&masked, D::Minus1).unwrap();
    let frozen = x.detach().sqr().unwrap();
    (p.sqr().unwrap().sum_all().unwrap() + frozen.mean_all().unwrap())
        .unwrap()
        .affine(1.0, c as f64)
        .unwrap()
}

#[test]
fn shapes_constants_integers_and_stated_cuts_are_not_errors() {
    for dtype in DTYPES {
        for plan in plans() {
            let x = var(&[5, 4], 8, 1.0, dtype);
            let w = var(&[4, 3], 9, 0.5, dtype);
            let y = plan
                .scope(|| shapes_and_constants(x.as_tensor(), w.as_tensor()))
                .unwrap_or_else(|e| panic!("{dtype:?} {plan}: {e}"));
            let g = backward(&y).unwrap_or_else(|e| panic!("{dtype:?} {plan}: {e}"));
            let pg = plain_shapes_and_constants(x.as_tensor(), w.as_tensor())
                .backward()
                .unwrap();
            for v in [&x, &w] {
                let d = rel_diff(g.get(v).unwrap(), pg.get(v).unwrap());
                assert!(d < 1e-6, "{dtype:?} {plan}: {d}");
            }
        }
    }
}

#[test]
fn the_statement_api_reports_cuts_in_declared_inputs_only() {
    for dtype in NORM_DTYPES {
        let x = var(&[3, 4], 10, 1.0, dtype);
        let w = var(&[4], 11, 0.5, dtype);
        let wt = w.as_tensor().clone();
        let y = Region::new("api").run(&[x.as_tensor()], move |ctx, ins| {
            let w = wt.clone();
            let n = ctx.recompute("n", &[&ins[0]], move |t| {
                candle_nn::ops::rms_norm(&t[0], &w, 1e-6)
            })?;
            ctx.save("loss", &[&n], |t| t[0].sqr()?.sum_all())
        });
        assert_cut(error_of(y), "api", "n");
        // A statement that reads an input without declaring it (for its
        // shape) builds a constant: no cut.
        let xt = x.as_tensor().clone();
        let y = Region::new("api")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let shape = xt.shape().clone();
                let z = ctx.recompute("zeros", &[], move |_| {
                    Tensor::ones(shape.clone(), dtype, &Device::Cpu)
                })?;
                ctx.recompute("loss", &[&ins[0], &z], |t| (&t[0] * &t[1])?.sum_all())
            })
            .unwrap();
        let g = backward(&y).unwrap();
        assert!(rel_diff(g.get(&x).unwrap(), &x.ones_like().unwrap()) < 1e-12);
    }
}
