//! Floats that leave through the host and come back as constants: a
//! mixture of experts in candle-transformers' style reads its routing
//! weights with `to_vec2`, picks and normalises them on the host, and
//! multiplies the experts' outputs by `Tensor::new(&weights, ..)`. The
//! router then gets no gradient, in plain candle too; inside `remat!` the
//! statement that turns those floats into a tensor is `HostCut`, under
//! every plan. Integer indices from the host, host reads for control flow
//! or logging, and floats made from shapes are no cut.

use candle_core::{DType, Result, Tensor, Var, D};
use remat_runtime::rules::constant;
use remat_runtime::{backward, remat, Plan};

use crate::common::{rel_diff, var, weighted_loss};

/// Each token's `k` largest routing weights, normalised, by expert: the
/// tokens each expert takes and their weights (candle-transformers'
/// Mixtral, on the host).
fn route(routing: &[Vec<f32>], experts: usize, k: usize) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let mut tokens = vec![Vec::new(); experts];
    let mut weights = vec![Vec::new(); experts];
    for (token, row) in routing.iter().enumerate() {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let total: f32 = order[..k].iter().map(|&e| row[e]).sum();
        for &e in &order[..k] {
            tokens[e].push(token as u32);
            weights[e].push(row[e] / total);
        }
    }
    (tokens, weights)
}

#[derive(Clone)]
struct SparseMoe {
    router: Var,
    experts: Vec<Var>,
    top_k: usize,
}

impl SparseMoe {
    fn new(c: usize, experts: usize, dtype: DType) -> Self {
        SparseMoe {
            router: var(&[c, experts], 1, 0.5, dtype),
            experts: (0..experts)
                .map(|e| var(&[c, c], 10 + e as u64, 0.3, dtype))
                .collect(),
            top_k: 2,
        }
    }

    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let (b, t, c) = xs.dims3()?;
            let flat = xs.reshape((b * t, c))?;
            let logits = flat.matmul(self.router.as_tensor())?;
            let probs = candle_nn::ops::softmax(&logits, D::Minus1)?;
            let routing = probs.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let (tokens, weights) = route(&routing, self.experts.len(), self.top_k);
            let mut ys = flat.zeros_like()?;
            for (e, expert) in self.experts.iter().enumerate() {
                if tokens[e].is_empty() {
                    continue;
                }
                let index = Tensor::new(tokens[e].as_slice(), xs.device())?;
                let w = Tensor::new(weights[e].as_slice(), xs.device())?
                    .to_dtype(xs.dtype())?
                    .reshape(((), 1))?;
                let h = flat.index_select(&index, 0)?.matmul(expert.as_tensor())?.tanh()?;
                ys = ys.index_add(&index, &h.broadcast_mul(&w)?, 0)?;
            }
            let y = ys.reshape((b, t, c))?;
            Ok(y)
        }
    }

    remat! {
        /// The same, the routing weights read detached: no gradient to the
        /// router is meant.
        fn forward_detached(&self, xs: &Tensor) -> Result<Tensor> {
            let (b, t, c) = xs.dims3()?;
            let flat = xs.reshape((b * t, c))?;
            let logits = flat.matmul(self.router.as_tensor())?;
            let probs = candle_nn::ops::softmax(&logits, D::Minus1)?;
            let routing = probs.to_dtype(DType::F32)?.detach().to_vec2::<f32>()?;
            let (tokens, weights) = route(&routing, self.experts.len(), self.top_k);
            let mut ys = flat.zeros_like()?;
            for (e, expert) in self.experts.iter().enumerate() {
                if tokens[e].is_empty() {
                    continue;
                }
                let index = Tensor::new(tokens[e].as_slice(), xs.device())?;
                let w = Tensor::from_vec(weights[e].clone(), (tokens[e].len(), 1), xs.device())?
                    .to_dtype(xs.dtype())?;
                let h = flat.index_select(&index, 0)?.matmul(expert.as_tensor())?.tanh()?;
                ys = ys.index_add(&index, &h.broadcast_mul(&w)?, 0)?;
            }
            let y = ys.reshape((b, t, c))?;
            Ok(y)
        }
    }
}

fn plans() -> [Plan; 4] {
    [
        Plan::declared(),
        Plan::save_all(),
        Plan::recompute_all(),
        Plan::off(),
    ]
}

#[test]
fn routing_weights_through_the_host_are_a_cut_under_every_plan() {
    for dtype in [DType::F32, DType::F64] {
        let moe = SparseMoe::new(8, 4, dtype);
        let x = var(&[2, 5, 8], 2, 1.0, dtype);
        for plan in plans() {
            let e = plan.scope(|| moe.forward(x.as_tensor())).unwrap_err();
            // The statement is the loop, named after the `ys` it gives back.
            let text = e.to_string();
            assert!(
                text.contains(
                    "region `SparseMoe::forward`, statement `ys#2`: makes a tensor from `weights`"
                ) && text.contains("from statement `routing`")
                    && text.contains(".detach()"),
                "{plan} {dtype:?}: {text}"
            );
        }
    }
}

#[test]
fn routing_weights_read_detached_are_meant() {
    for dtype in [DType::F32, DType::F64] {
        let moe = SparseMoe::new(8, 4, dtype);
        let x = var(&[2, 5, 8], 3, 1.0, dtype);
        let reference = Plan::off()
            .scope(|| moe.forward_detached(x.as_tensor()))
            .unwrap();
        let g_ref = backward(&weighted_loss(&reference)).unwrap();
        for plan in plans() {
            let y = plan.scope(|| moe.forward_detached(x.as_tensor())).unwrap();
            let g = backward(&weighted_loss(&y)).unwrap();
            for v in moe.experts.iter().chain([&x]) {
                let r = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
                assert!(r < 1e-6, "{plan} {dtype:?}: {r:e}");
            }
            assert!(g.get(&moe.router).is_none(), "{plan}");
        }
    }
}

/// A switch layer (top-1) that scales each token by its routing weight in
/// the block's return expression, the weights read on the host.
#[derive(Clone)]
struct Switch {
    router: Var,
    expert: Var,
}

impl Switch {
    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let probs = candle_nn::ops::softmax(&xs.matmul(self.router.as_tensor())?, D::Minus1)?;
            let top: Vec<f32> = probs
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?
                .iter()
                .map(|row| row.iter().copied().fold(f32::MIN, f32::max))
                .collect();
            let h = xs.matmul(self.expert.as_tensor())?.tanh()?;
            h.broadcast_mul(&Tensor::new(top.as_slice(), xs.device())?.to_dtype(xs.dtype())?.reshape(((), 1))?)
        }
    }

    remat! {
        /// The same, the weights meant as constants.
        fn forward_constant(&self, xs: &Tensor) -> Result<Tensor> {
            let probs = candle_nn::ops::softmax(&xs.matmul(self.router.as_tensor())?, D::Minus1)?;
            let top: Vec<f32> = probs
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?
                .iter()
                .map(|row| row.iter().copied().fold(f32::MIN, f32::max))
                .collect();
            let h = xs.matmul(self.expert.as_tensor())?.tanh()?;
            h.broadcast_mul(&Tensor::new(constant(top.as_slice()), xs.device())?.to_dtype(xs.dtype())?.reshape(((), 1))?)
        }
    }
}

#[test]
fn routing_weights_through_the_host_in_the_return_expression_are_a_cut() {
    for dtype in [DType::F32, DType::F64] {
        let switch = Switch {
            router: var(&[8, 4], 4, 0.5, dtype),
            expert: var(&[8, 8], 5, 0.3, dtype),
        };
        let x = var(&[6, 8], 6, 1.0, dtype);
        for plan in plans() {
            let e = plan.scope(|| switch.forward(x.as_tensor())).unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains(
                    "region `Switch::forward`, statement `(return)`: makes a tensor from `top`"
                ) && text.contains("from statement `top`"),
                "{plan} {dtype:?}: {text}"
            );
        }
        // Meant: the expert trains as in plain candle (written out here,
        // without the macro), the router not.
        let reference = {
            let xs = x.as_tensor();
            let probs =
                candle_nn::ops::softmax(&xs.matmul(switch.router.as_tensor()).unwrap(), D::Minus1)
                    .unwrap();
            let top = probs.max_keepdim(D::Minus1).unwrap().detach();
            let h = xs
                .matmul(switch.expert.as_tensor())
                .unwrap()
                .tanh()
                .unwrap();
            h.broadcast_mul(&top).unwrap()
        };
        let g_ref = weighted_loss(&reference).backward().unwrap();
        for plan in plans() {
            let y = plan
                .scope(|| switch.forward_constant(x.as_tensor()))
                .unwrap();
            let g = backward(&weighted_loss(&y)).unwrap();
            for v in [&switch.expert, &x] {
                let r = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
                assert!(r < 1e-6, "{plan} {dtype:?}: {r:e}");
            }
            assert!(g.get(&switch.router).is_none(), "{plan}");
        }
    }
}

#[derive(Clone)]
struct GatheredMoe {
    router: Var,
    experts: Vec<Var>,
}

impl GatheredMoe {
    remat! {
        /// The host picks only which experts: indices (integers), and a
        /// scalar for control flow and logging. The weights stay tensors.
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let logits = xs.matmul(self.router.as_tensor())?;
            let probs = candle_nn::ops::softmax(&logits, D::Minus1)?;
            let routing = probs.to_vec2::<f32>()?;
            let (tokens, _) = route(&routing, self.experts.len(), 1);
            let confident = probs.max_keepdim(D::Minus1)?.mean_all()?.to_scalar::<f32>()?;
            if confident > 2.0 {
                println!("routing confidence {confident}");
            }
            let width = xs.dim(D::Minus1)? as f32;
            let mut ys = xs.zeros_like()?;
            for (e, expert) in self.experts.iter().enumerate() {
                if tokens[e].is_empty() {
                    continue;
                }
                let index = Tensor::new(tokens[e].as_slice(), xs.device())?;
                let p = probs.index_select(&index, 0)?.narrow(1, e, 1)?;
                let h = xs.index_select(&index, 0)?.matmul(expert.as_tensor())?;
                ys = ys.index_add(&index, &h.broadcast_mul(&p)?, 0)?;
            }
            let scale = Tensor::full(width.sqrt(), (), xs.device())?;
            let y = ys.broadcast_div(&scale)?;
            Ok(y)
        }
    }
}

#[test]
fn indices_control_flow_and_shapes_from_the_host_are_no_cut() {
    let moe = GatheredMoe {
        router: var(&[6, 3], 4, 0.5, DType::F32),
        experts: (0..3)
            .map(|e| var(&[6, 6], 20 + e, 0.3, DType::F32))
            .collect(),
    };
    let x = var(&[7, 6], 5, 1.0, DType::F32);
    let reference = Plan::off().scope(|| moe.forward(x.as_tensor())).unwrap();
    let g_ref = backward(&weighted_loss(&reference)).unwrap();
    assert!(g_ref.get(&moe.router).is_some());
    for plan in plans() {
        let y = plan
            .scope(|| moe.forward(x.as_tensor()))
            .unwrap_or_else(|e| panic!("{plan}: {e}"));
        let g = backward(&weighted_loss(&y)).unwrap_or_else(|e| panic!("{plan}: {e}"));
        for v in moe.experts.iter().chain([&moe.router, &x]) {
            let r = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
            assert!(r < 1e-6, "{plan}: {r:e}");
        }
    }
}

#[derive(Clone)]
struct BalancedMoe {
    router: Var,
    experts: Vec<Var>,
}

impl BalancedMoe {
    remat! {
        /// Routing weights kept as tensors; each expert's load (a count,
        /// computed on the host from the routing decisions) and a host
        /// accumulator the loop gives back beside its tensors, made
        /// tensors through `constant`: no cut, plain candle's gradients.
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let logits = xs.matmul(self.router.as_tensor())?;
            let probs = candle_nn::ops::softmax(&logits, D::Minus1)?;
            let routing = probs.to_vec2::<f32>()?;
            let (tokens, _) = route(&routing, self.experts.len(), 1);
            let load: Vec<f32> = tokens.iter().map(|t| t.len() as f32).collect();
            let mut ys = xs.zeros_like()?;
            let mut seen: Vec<f32> = Vec::new();
            for (e, expert) in self.experts.iter().enumerate() {
                if tokens[e].is_empty() {
                    continue;
                }
                let index = Tensor::new(tokens[e].as_slice(), xs.device())?;
                let p = probs.index_select(&index, 0)?.narrow(1, e, 1)?;
                let h = xs.index_select(&index, 0)?.matmul(expert.as_tensor())?;
                seen.push(p.sum_all()?.to_scalar::<f32>()?);
                ys = ys.index_add(&index, &h.broadcast_mul(&p)?, 0)?;
            }
            let balance = Tensor::new(constant(load.as_slice()), xs.device())?;
            let weights = Tensor::new(constant(seen.as_slice()), xs.device())?;
            let y = (ys * (balance.sum_all()? + weights.sum_all()?)?.to_scalar::<f32>()? as f64)?;
            Ok(y)
        }
    }
}

#[test]
fn counts_made_constants_and_host_accumulators_beside_tensors_are_no_cut() {
    let moe = BalancedMoe {
        router: var(&[6, 3], 6, 0.5, DType::F32),
        experts: (0..3)
            .map(|e| var(&[6, 6], 30 + e, 0.3, DType::F32))
            .collect(),
    };
    let x = var(&[7, 6], 7, 1.0, DType::F32);
    let reference = Plan::off().scope(|| moe.forward(x.as_tensor())).unwrap();
    let g_ref = backward(&weighted_loss(&reference)).unwrap();
    for plan in plans() {
        let y = plan
            .scope(|| moe.forward(x.as_tensor()))
            .unwrap_or_else(|e| panic!("{plan}: {e}"));
        let g = backward(&weighted_loss(&y)).unwrap_or_else(|e| panic!("{plan}: {e}"));
        for v in moe.experts.iter().chain([&moe.router, &x]) {
            let r = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
            assert!(r < 1e-6, "{plan}: {r:e}");
        }
    }
}

/// Layers whose floats leave through the host and come back other than
/// through a constructor in the statement: as a scalar (`/ top`,
/// `affine`), through a helper function, or bound by a loop.
#[derive(Clone)]
struct Gated {
    proj: Var,
    gate: Var,
}

/// Makes one row's weights a tensor: the constructor the statement calls
/// is out of the macro's sight.
fn row_weights(row: &[f32], like: &Tensor) -> Result<Tensor> {
    Tensor::new(row, like.device())?.to_dtype(like.dtype())
}

impl Gated {
    fn new(c: usize, dtype: DType, seed: u64) -> Self {
        Gated {
            proj: var(&[c, c], seed, 0.4, dtype),
            gate: var(&[c, c], seed + 1, 0.4, dtype),
        }
    }

    remat! {
        /// Scaled by the largest gate value, read on the host.
        fn by_host_max(&self, xs: &Tensor) -> Result<Tensor> {
            let g = xs.matmul(self.gate.as_tensor())?.tanh()?;
            let top = g.abs()?.max_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let h = xs.matmul(self.proj.as_tensor())?;
            let y = ((h * g)? / top)?;
            Ok(y)
        }
    }

    remat! {
        /// Centred on a mean read on the host (`affine`).
        fn centred_on_host(&self, xs: &Tensor) -> Result<Tensor> {
            let h = xs.matmul(self.proj.as_tensor())?;
            let mean = h.mean_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let centred = h.affine(1.0, -mean)?;
            let y = centred.tanh()?;
            Ok(y)
        }
    }

    remat! {
        /// Each row scaled by its gate weights, read on the host and made a
        /// tensor by a helper function, in a loop.
        fn rows_by_helper(&self, xs: &Tensor) -> Result<Tensor> {
            let g = candle_nn::ops::softmax(&xs.matmul(self.gate.as_tensor())?, D::Minus1)?;
            let rows = g.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let h = xs.matmul(self.proj.as_tensor())?;
            let mut out = Vec::new();
            for (i, row) in rows.iter().enumerate() {
                out.push(h.narrow(0, i, 1)?.broadcast_mul(&row_weights(row, &h)?)?);
            }
            let y = Tensor::cat(&out, 0)?;
            Ok(y)
        }
    }

    remat! {
        /// The same with the constructor in the loop, on the loop's name.
        fn rows_in_loop(&self, xs: &Tensor) -> Result<Tensor> {
            let g = candle_nn::ops::softmax(&xs.matmul(self.gate.as_tensor())?, D::Minus1)?;
            let rows = g.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let h = xs.matmul(self.proj.as_tensor())?;
            let mut out = Vec::new();
            for (i, row) in rows.iter().enumerate() {
                let w = Tensor::new(row.as_slice(), h.device())?.to_dtype(h.dtype())?;
                out.push(h.narrow(0, i, 1)?.broadcast_mul(&w)?);
            }
            let y = Tensor::cat(&out, 0)?;
            Ok(y)
        }
    }

    remat! {
        /// `rows_by_helper` with the rows read detached: no gradient to the
        /// gate is meant.
        fn rows_detached(&self, xs: &Tensor) -> Result<Tensor> {
            let g = candle_nn::ops::softmax(&xs.matmul(self.gate.as_tensor())?, D::Minus1)?;
            let rows = g.to_dtype(DType::F32)?.detach().to_vec2::<f32>()?;
            let h = xs.matmul(self.proj.as_tensor())?;
            let mut out = Vec::new();
            for (i, row) in rows.iter().enumerate() {
                out.push(h.narrow(0, i, 1)?.broadcast_mul(&row_weights(row, &h)?)?);
            }
            let y = Tensor::cat(&out, 0)?;
            Ok(y)
        }
    }

    remat! {
        /// `by_host_max` with the scale wrapped in `constant`.
        fn by_constant_max(&self, xs: &Tensor) -> Result<Tensor> {
            let g = xs.matmul(self.gate.as_tensor())?.tanh()?;
            let top = g.abs()?.max_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let h = xs.matmul(self.proj.as_tensor())?;
            let y = ((h * g)? / constant(top))?;
            Ok(y)
        }
    }

    remat! {
        /// A host read that chooses a constant and a branch, is formatted,
        /// is compared with the values, picks a row by an index and sets a length: none
        /// of its floats reaches a float tensor.
        fn host_control(&self, xs: &Tensor) -> Result<Tensor> {
            let g = xs.matmul(self.gate.as_tensor())?.tanh()?;
            let conf = g.abs()?.mean_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let s = if conf > 0.5 { 0.5f64 } else { 2.0 };
            let h = xs.matmul(self.proj.as_tensor())?;
            let note = format!("confidence {conf:.3}");
            let y = if conf.is_nan() || note.is_empty() { h.clone() } else { ((h * g)? * s)? };
            let keep = y.ge(-conf)?.to_dtype(y.dtype())?;
            let first = Tensor::new(&[(conf * 0.0) as u32], xs.device())?;
            let z = (y * keep)?.broadcast_add(&xs.index_select(&first, 0)?)?;
            let rows = z.narrow(0, 0, 2 + (conf * 0.0) as usize)?;
            Ok(rows)
        }
    }
}

/// `Gated::host_control` as plain candle code, written out.
fn host_control_by_hand(layer: &Gated, xs: &Tensor) -> Result<Tensor> {
    let g = xs.matmul(layer.gate.as_tensor())?.tanh()?;
    let conf = g
        .abs()?
        .mean_all()?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    let s = if conf > 0.5 { 0.5f64 } else { 2.0 };
    let y = ((xs.matmul(layer.proj.as_tensor())? * g)? * s)?;
    let keep = y.ge(-conf)?.to_dtype(y.dtype())?;
    (y * keep)?
        .broadcast_add(&xs.narrow(0, 0, 1)?)?
        .narrow(0, 0, 2)
}

/// `Gated::rows_detached` and `by_constant_max` as plain candle code: the
/// host's values are constants.
fn rows_by_hand(layer: &Gated, xs: &Tensor) -> Result<Tensor> {
    let g = candle_nn::ops::softmax(&xs.matmul(layer.gate.as_tensor())?, D::Minus1)?;
    // The rows went to the host in f32.
    let rows = g.to_dtype(DType::F32)?.to_dtype(xs.dtype())?.detach();
    xs.matmul(layer.proj.as_tensor())?.mul(&rows)
}

fn by_constant_max_by_hand(layer: &Gated, xs: &Tensor) -> Result<Tensor> {
    let g = xs.matmul(layer.gate.as_tensor())?.tanh()?;
    let top = g
        .abs()?
        .max_all()?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    (xs.matmul(layer.proj.as_tensor())? * g)? / top
}

#[test]
fn host_floats_as_scalars_through_helpers_and_loops_are_a_cut() {
    type Forward = fn(&Gated, &Tensor) -> Result<Tensor>;
    let cases: [(&str, Forward, &str, &str, &str); 4] = [
        ("by_host_max", Gated::by_host_max, "y", "top", "top"),
        (
            "centred_on_host",
            Gated::centred_on_host,
            "centred",
            "mean",
            "mean",
        ),
        (
            "rows_by_helper",
            Gated::rows_by_helper,
            "out#2",
            "rows",
            "rows",
        ),
        ("rows_in_loop", Gated::rows_in_loop, "out#2", "rows", "rows"),
    ];
    for dtype in [DType::F32, DType::F64] {
        let layer = Gated::new(6, dtype, 40);
        let x = var(&[5, 6], 41, 1.0, dtype);
        for (method, forward, statement, value, from) in cases {
            for plan in plans() {
                let e = plan.scope(|| forward(&layer, x.as_tensor())).unwrap_err();
                let text = e.to_string();
                let expected = format!(
                    "region `Gated::{method}`, statement `{statement}`: makes a tensor from \
                     `{value}`, but `{value}` holds floats computed on the host from statement \
                     `{from}`"
                );
                assert!(text.contains(&expected), "{plan} {dtype:?}: {text}");
            }
        }
    }
}

#[test]
fn host_floats_meant_as_constants_or_used_for_control_give_plain_candles_gradients() {
    type Forward = fn(&Gated, &Tensor) -> Result<Tensor>;
    let cases: [(&str, Forward, Forward); 3] = [
        ("host_control", Gated::host_control, host_control_by_hand),
        ("rows_detached", Gated::rows_detached, rows_by_hand),
        (
            "by_constant_max",
            Gated::by_constant_max,
            by_constant_max_by_hand,
        ),
    ];
    for dtype in [DType::F32, DType::F64] {
        let tolerance = if dtype == DType::F32 { 1e-6 } else { 1e-12 };
        for (seed, scale) in [(50, 1.0), (60, 0.05)] {
            let layer = Gated::new(6, dtype, seed);
            let x = var(&[5, 6], seed + 2, scale, dtype);
            for (method, forward, by_hand) in cases {
                let reference = by_hand(&layer, x.as_tensor()).unwrap();
                let g_ref = weighted_loss(&reference).backward().unwrap();
                for plan in plans() {
                    let y = plan
                        .scope(|| forward(&layer, x.as_tensor()))
                        .unwrap_or_else(|e| panic!("{method} {plan} {dtype:?}: {e}"));
                    let r = rel_diff(&y, &reference);
                    assert!(r < tolerance, "{method} {plan} {dtype:?}: output {r:e}");
                    let g = backward(&weighted_loss(&y)).unwrap();
                    for v in [&layer.proj, &layer.gate, &x] {
                        match (g.get(v), g_ref.get(v)) {
                            (Some(a), Some(b)) => {
                                let r = rel_diff(a, b);
                                assert!(r < tolerance, "{method} {plan} {dtype:?}: {r:e}");
                            }
                            (None, None) => {}
                            (a, b) => panic!(
                                "{method} {plan} {dtype:?}: gradient {} here, {} by hand",
                                a.is_some(),
                                b.is_some()
                            ),
                        }
                    }
                }
            }
        }
    }
}

#[derive(Clone)]
struct RoutedMoe {
    router: Var,
    experts: Vec<Var>,
}

impl RoutedMoe {
    remat! {
        /// The routing weights reach the experts through a field of a
        /// tuple: a cut.
        fn through_a_tuple(&self, xs: &Tensor) -> Result<Tensor> {
            let probs = candle_nn::ops::softmax(&xs.matmul(self.router.as_tensor())?, D::Minus1)?;
            let rows = probs.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let routed = route(&rows, self.experts.len(), 1);
            let mut ys = xs.zeros_like()?;
            for (e, expert) in self.experts.iter().enumerate() {
                if routed.0[e].is_empty() {
                    continue;
                }
                let index = Tensor::new(routed.0[e].as_slice(), xs.device())?;
                let w = Tensor::new(routed.1[e].as_slice(), xs.device())?
                    .to_dtype(xs.dtype())?
                    .reshape(((), 1))?;
                let h = xs.index_select(&index, 0)?.matmul(expert.as_tensor())?;
                ys = ys.index_add(&index, &h.broadcast_mul(&w)?, 0)?;
            }
            Ok(ys)
        }
    }

    remat! {
        /// Only the indices of a tuple that also holds the weights are
        /// used; the weights stay tensors: no cut.
        fn tuple_indices(&self, xs: &Tensor) -> Result<Tensor> {
            let probs = candle_nn::ops::softmax(&xs.matmul(self.router.as_tensor())?, D::Minus1)?;
            let rows = probs.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let mut ys = xs.zeros_like()?;
            // Reads `ys` (for its shape) and so hands it back unchanged:
            // no float tensor made here.
            let routed = route(&rows[..ys.dim(0)?], self.experts.len(), 1);
            for (e, expert) in self.experts.iter().enumerate() {
                if routed.0[e].is_empty() {
                    continue;
                }
                let index = Tensor::new(routed.0[e].as_slice(), xs.device())?;
                let p = probs.index_select(&index, 0)?.narrow(1, e, 1)?;
                let h = xs.index_select(&index, 0)?.matmul(expert.as_tensor())?;
                ys = ys.index_add(&index, &h.broadcast_mul(&p)?, 0)?;
            }
            Ok(ys)
        }
    }
}

impl RoutedMoe {
    remat! {
        /// Indices and weights from one statement that also makes a tensor
        /// of the indices: the weights are a cut where they come back.
        fn through_a_mixed_statement(&self, xs: &Tensor) -> Result<Tensor> {
            let probs = candle_nn::ops::softmax(&xs.matmul(self.router.as_tensor())?, D::Minus1)?;
            let rows = probs.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let (index, weights) = {
                let (tokens, weights) = route(&rows, self.experts.len(), 1);
                (Tensor::new(tokens.concat().as_slice(), xs.device())?, weights)
            };
            let h = xs.index_select(&index, 0)?.matmul(self.experts[0].as_tensor())?;
            let y = (h * weights.iter().flatten().sum::<f32>() as f64)?;
            Ok(y)
        }
    }
}

/// `RoutedMoe::tuple_indices` as plain candle code, written out.
fn tuple_indices_by_hand(moe: &RoutedMoe, xs: &Tensor) -> Result<Tensor> {
    let probs = candle_nn::ops::softmax(&xs.matmul(moe.router.as_tensor())?, D::Minus1)?;
    let rows = probs.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let (tokens, _) = route(&rows, moe.experts.len(), 1);
    let mut ys = xs.zeros_like()?;
    for (e, expert) in moe.experts.iter().enumerate() {
        if tokens[e].is_empty() {
            continue;
        }
        let index = Tensor::new(tokens[e].as_slice(), xs.device())?;
        let p = probs.index_select(&index, 0)?.narrow(1, e, 1)?;
        let h = xs.index_select(&index, 0)?.matmul(expert.as_tensor())?;
        ys = ys.index_add(&index, &h.broadcast_mul(&p)?, 0)?;
    }
    Ok(ys)
}

#[test]
fn fields_of_a_tuple_are_checked_by_their_own_type() {
    for dtype in [DType::F32, DType::F64] {
        let moe = RoutedMoe {
            router: var(&[6, 3], 70, 0.5, dtype),
            experts: (0..3).map(|e| var(&[6, 6], 71 + e, 0.3, dtype)).collect(),
        };
        let x = var(&[7, 6], 75, 1.0, dtype);
        for plan in plans() {
            let e = plan
                .scope(|| moe.through_a_tuple(x.as_tensor()))
                .unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains(
                    "region `RoutedMoe::through_a_tuple`, statement `ys#2`: makes a tensor from \
                     `routed.1`, but `routed.1` holds floats computed on the host from \
                     statement `rows`"
                ),
                "{plan} {dtype:?}: {text}"
            );
        }
        for plan in plans() {
            let e = plan
                .scope(|| moe.through_a_mixed_statement(x.as_tensor()))
                .unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains(
                    "region `RoutedMoe::through_a_mixed_statement`, statement `y`: makes a tensor \
                     from `weights`, but `weights` holds floats computed on the host from \
                     statement `rows`"
                ),
                "{plan} {dtype:?}: {text}"
            );
        }
        let reference = tuple_indices_by_hand(&moe, x.as_tensor()).unwrap();
        let g_ref = weighted_loss(&reference).backward().unwrap();
        let tolerance = if dtype == DType::F32 { 1e-6 } else { 1e-12 };
        for plan in plans() {
            let y = plan
                .scope(|| moe.tuple_indices(x.as_tensor()))
                .unwrap_or_else(|e| panic!("{plan} {dtype:?}: {e}"));
            let g = backward(&weighted_loss(&y)).unwrap();
            for v in moe.experts.iter().chain([&moe.router, &x]) {
                let r = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
                assert!(r < tolerance, "{plan} {dtype:?}: {r:e}");
            }
        }
    }
}

remat! {
    /// Mean pooling over the tokens that are not padding, divided by their
    /// count read to the host (sentence-transformers' pooling): the count
    /// comes from a comparison, which carries no gradient, in one
    /// statement and through a mask of its own.
    fn pooled_by_count(h: &Tensor, w: &Tensor) -> Result<Tensor> {
        let states = h.matmul(w)?.tanh()?;
        let kept = h.abs()?.gt(0.5)?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        let mask = states.ge(0.0)?;
        let positive = mask.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        let top = states.argmax_keepdim(1)?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        let scaled = h.gt(0.0)?.to_dtype(DType::F64)?.affine(2.0, 1.0)?.sum_all()?.to_scalar::<f64>()?;
        let rows = mask.to_dtype(DType::F64)?.sum_keepdim(1)?.flatten_all()?.to_vec1::<f64>()?;
        let counts = Tensor::new(rows.as_slice(), h.device())?.to_dtype(h.dtype())?;
        let picked = mask.to_dtype(DType::F64)?.gather(&mask.to_dtype(DType::U32)?, 1)?.sum_all()?.to_scalar::<f64>()?;
        let y = ((states.sum(0)? / kept)? * (positive + top + scaled + picked))?;
        Ok((y.unsqueeze(0)?.broadcast_mul(&counts.unsqueeze(1)?)? + states)?)
    }
}

fn pooled_by_count_by_hand(h: &Tensor, w: &Tensor) -> Result<Tensor> {
    let states = h.matmul(w)?.tanh()?;
    let kept = h
        .abs()?
        .gt(0.5)?
        .to_dtype(DType::F64)?
        .sum_all()?
        .to_scalar::<f64>()?;
    let mask = states.ge(0.0)?;
    let positive = mask.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    let top = states
        .argmax_keepdim(1)?
        .to_dtype(DType::F64)?
        .sum_all()?
        .to_scalar::<f64>()?;
    let scaled = h
        .gt(0.0)?
        .to_dtype(DType::F64)?
        .affine(2.0, 1.0)?
        .sum_all()?
        .to_scalar::<f64>()?;
    let rows = mask
        .to_dtype(DType::F64)?
        .sum_keepdim(1)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let counts = Tensor::new(rows.as_slice(), h.device())?.to_dtype(h.dtype())?;
    let picked = mask
        .to_dtype(DType::F64)?
        .gather(&mask.to_dtype(DType::U32)?, 1)?
        .sum_all()?
        .to_scalar::<f64>()?;
    let y = ((states.sum(0)? / kept)? * (positive + top + scaled + picked))?;
    y.unsqueeze(0)?.broadcast_mul(&counts.unsqueeze(1)?)? + states
}

remat! {
    /// The same count read from a value that carries a gradient: a cut.
    fn pooled_by_norm(h: &Tensor, w: &Tensor) -> Result<Tensor> {
        let states = h.matmul(w)?.tanh()?;
        let norm = states.abs()?.gt(0.5)?.to_dtype(states.dtype())?.mul(&states)?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let y = (states.sum(0)? / norm)?;
        Ok(y)
    }
}

/// Counts read to the host from comparisons and arg-reductions of values
/// that need gradients (`x.gt(0.5)?.to_dtype(F64)?.sum_all()?.to_scalar()`,
/// a mask of its own, `argmax`, an `affine` of a count, a `gather`, per-row
/// counts handed to `Tensor::new`) carry no gradient: no `HostCut` (it was raised
/// under every plan, `off` too), and plain candle's gradients. A
/// value multiplied back by a tracked tensor before the read is still a
/// cut.
#[test]
fn counts_from_comparisons_read_to_the_host_are_no_cut() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let h = var(&[5, 4], 51, 1.0, dtype);
        let w = var(&[4, 3], 52, 0.6, dtype);
        let reference =
            weighted_loss(&pooled_by_count_by_hand(h.as_tensor(), w.as_tensor()).unwrap())
                .backward()
                .unwrap();
        for plan in plans() {
            let y = plan
                .scope(|| {
                    Ok::<_, candle_core::Error>(weighted_loss(&pooled_by_count(
                        h.as_tensor(),
                        w.as_tensor(),
                    )?))
                })
                .unwrap();
            let g = backward(&y).unwrap();
            for (name, v) in [("h", &h), ("w", &w)] {
                let d = rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
                assert!(d < tol, "{plan} {dtype:?} {name}: {d}");
            }
            let e = plan
                .scope(|| pooled_by_norm(h.as_tensor(), w.as_tensor()))
                .unwrap_err();
            assert!(
                e.to_string()
                    .contains("statement `y`: makes a tensor from `norm`"),
                "{plan} {dtype:?}: {e}"
            );
        }
    }
}
