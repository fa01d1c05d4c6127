//! `remat!` on methods, as candle users write layers: an inherent
//! `forward(&self, ...)`, `impl Module`, `impl ModuleT`, with `self`'s
//! fields read anywhere in the body (macros included). Each block runs
//! under full recompute, save-all and off, against plain candle written
//! separately.

use candle_core::{DType, Device, Module, ModuleT, Result, Tensor, Var, D};
use candle_nn::{Linear, VarBuilder, VarMap};
use remat_runtime::{backward, nn, remat, Plan};

use crate::common::{causal_mask, max_abs, rel_diff, repeat_kv, weighted_loss as loss};

fn plans() -> [Plan; 3] {
    [Plan::off(), Plan::recompute_all(), Plan::save_all()]
}

/// A Qwen2-style decoder layer: GQA attention with q/k/v biases, RMS norms,
/// a SwiGLU MLP; parameters under Hugging Face's names.
#[derive(Clone)]
struct DecoderLayer {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    gate_up: Linear,
    down_proj: Linear,
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
    heads: usize,
    kv_heads: usize,
    eps: f64,
}

impl DecoderLayer {
    fn new(
        vb: VarBuilder,
        hidden: usize,
        inter: usize,
        heads: usize,
        kv_heads: usize,
    ) -> Result<Self> {
        let d = hidden / heads;
        let init = candle_nn::Init::Randn {
            mean: 0.0,
            stdev: 0.2,
        };
        let ones = candle_nn::Init::Const(1.0);
        Ok(DecoderLayer {
            q_proj: candle_nn::linear(hidden, heads * d, vb.pp("self_attn.q_proj"))?,
            k_proj: candle_nn::linear(hidden, kv_heads * d, vb.pp("self_attn.k_proj"))?,
            v_proj: candle_nn::linear(hidden, kv_heads * d, vb.pp("self_attn.v_proj"))?,
            o_proj: Linear::new(
                vb.get_with_hints((hidden, heads * d), "self_attn.o_proj.weight", init)?,
                None,
            ),
            gate_up: Linear::new(
                vb.get_with_hints((2 * inter, hidden), "mlp.gate_up.weight", init)?,
                None,
            ),
            down_proj: Linear::new(
                vb.get_with_hints((hidden, inter), "mlp.down_proj.weight", init)?,
                None,
            ),
            input_layernorm: vb.get_with_hints(hidden, "input_layernorm.weight", ones)?,
            post_attention_layernorm: vb.get_with_hints(
                hidden,
                "post_attention_layernorm.weight",
                ones,
            )?,
            heads,
            kv_heads,
            eps: 1e-6,
        })
    }

    fn split(&self, x: &Tensor, heads: usize) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        x.reshape((b, t, heads, c / heads))?.transpose(1, 2)
    }

    remat! {
        /// The layer's forward, checkpointed where it stands.
        fn forward(&self, xs: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
            let (b, t, c) = xs.dims3()?;
            if c % self.heads != 0 {
                candle_core::bail!("hidden size {c} is not a multiple of {} heads", self.heads);
            }
            let h = nn::rms_norm(xs, &self.input_layernorm, self.eps)?;
            let q = self.split(&self.q_proj.forward(&h)?, self.heads)?;
            let k = self.split(&self.k_proj.forward(&h)?, self.kv_heads)?;
            let v = self.split(&self.v_proj.forward(&h)?, self.kv_heads)?;
            let att = nn::attention(&q, &k, &v, true, mask)?;
            let att = att.transpose(1, 2)?.reshape((b, t, c))?;
            let x = (xs + self.o_proj.forward(&att)?)?;
            let h2 = nn::rms_norm(&x, &self.post_attention_layernorm, self.eps)?;
            let mlp = self.down_proj.forward(&nn::swiglu(&self.gate_up.forward(&h2)?)?)?;
            Ok((x + mlp)?)
        }
    }

    /// The same layer in plain candle (composed ops only).
    fn plain(&self, xs: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, t, c) = xs.dims3()?;
        let h = candle_nn::ops::rms_norm_slow(xs, &self.input_layernorm, self.eps as f32)?;
        let q = self.split(&self.q_proj.forward(&h)?, self.heads)?;
        let k = self.split(&self.k_proj.forward(&h)?, self.kv_heads)?;
        let v = self.split(&self.v_proj.forward(&h)?, self.kv_heads)?;
        let rep = self.heads / self.kv_heads;
        let (k, v) = (repeat_kv(&k, rep)?, repeat_kv(&v, rep)?);
        let d = c / self.heads;
        let mut s = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
        if let Some(m) = mask {
            s = s.broadcast_add(m)?;
        }
        s = s.broadcast_add(&causal_mask(t, s.dtype()))?;
        let p = candle_nn::ops::softmax(&s, D::Minus1)?;
        let att = p
            .matmul(&v.contiguous()?)?
            .transpose(1, 2)?
            .reshape((b, t, c))?;
        let x = (xs + self.o_proj.forward(&att)?)?;
        let h2 =
            candle_nn::ops::rms_norm_slow(&x, &self.post_attention_layernorm, self.eps as f32)?;
        let gu = self.gate_up.forward(&h2)?;
        let inter = gu.dim(D::Minus1)? / 2;
        let gate = gu.narrow(D::Minus1, 0, inter)?;
        let up = gu.narrow(D::Minus1, inter, inter)?;
        let mlp = self
            .down_proj
            .forward(&(candle_nn::ops::silu(&gate)? * up)?)?;
        x + mlp
    }
}

/// A BERT-style encoder layer (post-norm) as a `Module`.
#[derive(Clone)]
struct BertLayer {
    qkv: Linear,
    out: Linear,
    ln1: (Tensor, Tensor),
    up: Linear,
    down: Linear,
    ln2: (Tensor, Tensor),
    heads: usize,
}

impl Module for BertLayer {
    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let (b, t, c) = xs.dims3()?;
            let qkv = self.qkv.forward(xs)?;
            let d = c / self.heads;
            let q = qkv.narrow(2, 0, c)?.reshape((b, t, self.heads, d))?.transpose(1, 2)?;
            let k = qkv.narrow(2, c, c)?.reshape((b, t, self.heads, d))?.transpose(1, 2)?;
            let v = qkv.narrow(2, 2 * c, c)?.reshape((b, t, self.heads, d))?.transpose(1, 2)?;
            let att = nn::attention(&q, &k, &v, false, None)?.transpose(1, 2)?.reshape((b, t, c))?;
            let x = nn::layer_norm(&(xs + self.out.forward(&att)?)?, &self.ln1.0, &self.ln1.1, 1e-12)?;
            let ffn = self.down.forward(&self.up.forward(&x)?.gelu()?)?;
            Ok(nn::layer_norm(&(&x + ffn)?, &self.ln2.0, &self.ln2.1, 1e-12)?)
        }
    }
}

impl BertLayer {
    fn plain(&self, xs: &Tensor) -> Result<Tensor> {
        let (b, t, c) = xs.dims3()?;
        let qkv = self.qkv.forward(xs)?;
        let d = c / self.heads;
        let split = |i: usize| -> Result<Tensor> {
            qkv.narrow(2, i * c, c)?
                .reshape((b, t, self.heads, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let s = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
        let p = candle_nn::ops::softmax(&s, D::Minus1)?;
        let att = p.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        let x = candle_nn::ops::layer_norm_slow(
            &(xs + self.out.forward(&att)?)?,
            &self.ln1.0,
            &self.ln1.1,
            1e-12,
        )?;
        let ffn = self.down.forward(&self.up.forward(&x)?.gelu()?)?;
        candle_nn::ops::layer_norm_slow(&(&x + ffn)?, &self.ln2.0, &self.ln2.1, 1e-12)
    }
}

/// A ViT-style MLP block as a `ModuleT`: dropout when training.
#[derive(Clone)]
struct MlpBlock {
    fc1: Linear,
    fc2: Linear,
    p: f64,
}

impl ModuleT for MlpBlock {
    remat! {
        fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
            let h = self.fc1.forward(xs)?.gelu()?;
            let h = if train { nn::dropout(&h, self.p)? } else { h };
            Ok((xs + self.fc2.forward(&h)?)?)
        }
    }
}

fn linear(vm: &VarMap, name: &str, i: usize, o: usize, bias: bool, dtype: DType) -> Linear {
    let vb = VarBuilder::from_varmap(vm, dtype, &Device::Cpu);
    let init = candle_nn::Init::Randn {
        mean: 0.0,
        stdev: 0.3,
    };
    let w = vb
        .get_with_hints((o, i), &format!("{name}.weight"), init)
        .unwrap();
    let b = bias.then(|| vb.get_with_hints(o, &format!("{name}.bias"), init).unwrap());
    Linear::new(w, b)
}

/// Every variable's gradient under `plan`, against the plain loss's.
fn check(
    vm: &VarMap,
    x: &Var,
    plan: &Plan,
    run: impl Fn() -> Result<Tensor>,
    plain: impl Fn() -> Result<Tensor>,
    tol: f64,
) {
    let y = plan.scope(&run).unwrap();
    let g = backward(&loss(&y)).unwrap();
    let pg = loss(&plain().unwrap()).backward().unwrap();
    let mut vars = vm.all_vars();
    vars.push(x.clone());
    assert!(vars.len() >= 2);
    // Relative to the largest gradient element of the layer: some gradients
    // are 0 analytically (a key bias under softmax), where both sides hold
    // rounding noise only.
    let scale = vars
        .iter()
        .map(|v| max_abs(&pg.get(v).unwrap().to_dtype(DType::F64).unwrap()))
        .fold(0f64, f64::max);
    for v in &vars {
        let a = g
            .get(v)
            .unwrap_or_else(|| panic!("{plan}: a variable got no gradient"));
        let b = pg.get(v).unwrap();
        let d =
            max_abs(&(a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap());
        assert!(
            d <= tol * scale,
            "{plan}: {:?} {d} vs scale {scale}",
            v.dims()
        );
    }
}

#[test]
fn an_inherent_forward_method_matches_plain_candle() {
    for dtype in [DType::F32, DType::F64] {
        // Relative to the largest gradient: f32, the same math reassociated
        // (fused norms, attention by blocks); f64, rounding.
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, dtype, &Device::Cpu);
        let layer = DecoderLayer::new(vb.pp("model.layers.0"), 16, 24, 4, 2).unwrap();
        let x = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (2, 5, 16), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let pad: Vec<f32> = (0..5).map(|i| if i == 4 { -1e9 } else { 0.0 }).collect();
        let pad = Tensor::new(pad, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        for mask in [None, Some(&pad)] {
            for plan in plans() {
                check(
                    &vm,
                    &x,
                    &plan,
                    || layer.forward(x.as_tensor(), mask),
                    || layer.plain(x.as_tensor(), mask),
                    tol,
                );
            }
        }
        // `bail!` in the block: an error, from the forward, in the user's words.
        let mut odd = layer.clone();
        odd.heads = 3;
        let e = odd.forward(x.as_tensor(), None).unwrap_err();
        assert!(e.to_string().contains("not a multiple of 3 heads"), "{e}");
    }
}

#[test]
fn a_module_forward_matches_plain_candle() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let vm = VarMap::new();
        let c = 12;
        let vb = VarBuilder::from_varmap(&vm, dtype, &Device::Cpu);
        let ones = candle_nn::Init::Const(1.0);
        let zeros = candle_nn::Init::Const(0.0);
        let layer = BertLayer {
            qkv: linear(&vm, "attention.qkv", c, 3 * c, true, dtype),
            out: linear(&vm, "attention.output.dense", c, c, true, dtype),
            ln1: (
                vb.get_with_hints(c, "attention.output.LayerNorm.weight", ones)
                    .unwrap(),
                vb.get_with_hints(c, "attention.output.LayerNorm.bias", zeros)
                    .unwrap(),
            ),
            up: linear(&vm, "intermediate.dense", c, 2 * c, true, dtype),
            down: linear(&vm, "output.dense", 2 * c, c, true, dtype),
            ln2: (
                vb.get_with_hints(c, "output.LayerNorm.weight", ones)
                    .unwrap(),
                vb.get_with_hints(c, "output.LayerNorm.bias", zeros)
                    .unwrap(),
            ),
            heads: 3,
        };
        let x = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (2, 4, c), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        for plan in plans() {
            // Through the trait, as a model calls it.
            check(
                &vm,
                &x,
                &plan,
                || x.as_tensor().apply(&layer),
                || layer.plain(x.as_tensor()),
                tol,
            );
        }
    }
}

#[test]
fn a_module_t_forward_matches_plain_candle_in_eval_and_replays_its_dropout() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let vm = VarMap::new();
        let block = MlpBlock {
            fc1: linear(&vm, "fc1", 8, 16, true, dtype),
            fc2: linear(&vm, "fc2", 16, 8, true, dtype),
            p: 0.25,
        };
        let x = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (3, 8), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let plain = || -> Result<Tensor> {
            let h = block.fc1.forward(x.as_tensor())?.gelu()?;
            x.as_tensor() + block.fc2.forward(&h)?
        };
        for plan in plans() {
            check(
                &vm,
                &x,
                &plan,
                || block.forward_t(x.as_tensor(), false),
                plain,
                tol,
            );
            // Training: the replay draws the forward's dropout mask (a
            // redrawn mask would be ReplayDiverged).
            remat_runtime::random::seed(7);
            let y = plan.scope(|| block.forward_t(x.as_tensor(), true)).unwrap();
            assert!(backward(&y.sum_all().unwrap()).is_ok(), "{plan}");
        }
    }
}

#[test]
fn a_method_region_is_named_after_its_type() {
    let vm = VarMap::new();
    let block = MlpBlock {
        fc1: linear(&vm, "fc1", 4, 4, true, DType::F32),
        fc2: linear(&vm, "fc2", 4, 4, true, DType::F32),
        p: 0.0,
    };
    let x = Var::randn(0f32, 1.0, (2, 4), &Device::Cpu).unwrap();
    let _y = block.forward_t(x.as_tensor(), false).unwrap();
    let report = remat_runtime::MemoryReport::capture();
    assert!(
        report
            .entries
            .iter()
            .all(|e| e.region.starts_with("MlpBlock::forward_t")),
        "{report}"
    );
}

/// BatchNorm-style running statistics: state that must change once per
/// step, in the forward, never again in the replay.
#[derive(Clone)]
struct BatchNorm {
    gamma: Var,
    beta: Var,
    running_mean: std::sync::Arc<std::sync::Mutex<Tensor>>,
    updates: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    momentum: f64,
}

impl BatchNorm {
    fn update(&self, mean: &Tensor) -> Result<()> {
        let mut running = self.running_mean.lock().unwrap();
        *running = ((&*running * (1.0 - self.momentum))? + (mean.detach() * self.momentum)?)?;
        self.updates
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    remat! {
        fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
            let mean = xs.mean_keepdim(0)?;
            #[forward_only]
            if train {
                self.update(&mean.squeeze(0)?)?;
            }
            let centered = xs.broadcast_sub(&mean)?;
            let var = centered.sqr()?.mean_keepdim(0)?;
            let normed = centered.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
            let y = normed.broadcast_mul(self.gamma.as_tensor())?.broadcast_add(self.beta.as_tensor())?;
            Ok(y)
        }
    }
}

impl ModuleT for BatchNorm {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        BatchNorm::forward_t(self, xs, train)
    }
}

/// A block that calls the batch norm from one of its statements: the
/// norm's region runs again in this block's replay.
#[derive(Clone)]
struct Around {
    bn: BatchNorm,
}

impl Around {
    remat! {
        fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
            let h = xs.sin()?;
            let y = self.bn.forward_t(&h, train)?;
            let z = y.tanh()?;
            Ok(z)
        }
    }
}

#[test]
fn running_statistics_change_once_per_step_under_every_plan() {
    // The norm called directly, from a statement of another block, and
    // wrapped in `Checkpointed`: in the last two its region runs again
    // when the enclosing region replays.
    for caller in ["direct", "nested", "checkpointed"] {
        for plan in plans() {
            let dev = Device::Cpu;
            let bn = BatchNorm {
                gamma: Var::ones(3, DType::F64, &dev).unwrap(),
                beta: Var::zeros(3, DType::F64, &dev).unwrap(),
                running_mean: std::sync::Arc::new(std::sync::Mutex::new(
                    Tensor::zeros(3, DType::F64, &dev).unwrap(),
                )),
                updates: Default::default(),
                momentum: 0.1,
            };
            let around = Around { bn: bn.clone() };
            let wrapped = remat_runtime::Checkpointed::new("bn", bn.clone());
            let forward = |x: &Tensor, train: bool| match caller {
                "direct" => bn.forward_t(x, train),
                "nested" => around.forward_t(x, train),
                _ => wrapped.forward_t(x, train),
            };
            let x = Var::from_tensor(
                &Tensor::arange(0f64, 12.0, &dev)
                    .unwrap()
                    .reshape((4, 3))
                    .unwrap(),
            )
            .unwrap();
            let seen = if caller == "nested" {
                x.sin().unwrap()
            } else {
                x.as_tensor().clone()
            };
            for step in 1..=3 {
                let y = plan.scope(|| forward(x.as_tensor(), true)).unwrap();
                backward(&loss(&y)).unwrap();
                // One update per step, forward only: the replay did not update.
                assert_eq!(
                    bn.updates.load(std::sync::atomic::Ordering::SeqCst),
                    step,
                    "{caller}, {plan}"
                );
            }
            // After three updates from 0 with momentum 0.1: m * (1 - 0.9^3),
            // m the mean of the norm's input's columns.
            let running = bn.running_mean.lock().unwrap().to_vec1::<f64>().unwrap();
            let means = seen.mean(0).unwrap().to_vec1::<f64>().unwrap();
            let factor = 1.0 - 0.9f64.powi(3);
            for (r, m) in running.iter().zip(means) {
                assert!(
                    (r - m * factor).abs() < 1e-12,
                    "{caller}, {plan}: {running:?}"
                );
            }
            // Evaluation does not update.
            let _ = plan.scope(|| forward(x.as_tensor(), false)).unwrap();
            assert_eq!(
                bn.updates.load(std::sync::atomic::Ordering::SeqCst),
                3,
                "{caller}, {plan}"
            );
        }
    }
}

#[test]
fn the_batch_norm_drop_in_updates_its_statistics_once_per_step() {
    use candle_nn::BatchNormConfig;
    use remat_runtime::candle_nn::batch_norm;
    // candle-nn's `BatchNorm` in plain candle against the drop-in called
    // directly, wrapped in `Checkpointed`, and from a block's statement:
    // the same outputs, gradients and running statistics after each step.
    let dev = Device::Cpu;
    let config = BatchNormConfig {
        momentum: 0.2,
        ..Default::default()
    };
    let xs: Vec<f64> = (0..24).map(|i| ((i * 7 % 11) as f64 - 5.0) / 3.0).collect();
    let x = Var::from_vec(xs, (2, 3, 4), &dev).unwrap();
    // Last: candle-nn's own layer wrapped by itself in `Checkpointed`, which
    // runs it as the drop-in.
    for caller in ["direct", "checkpointed", "nested", "candle-nn checkpointed"] {
        for plan in plans() {
            let map = VarMap::new();
            let bn =
                batch_norm(3, config, VarBuilder::from_varmap(&map, DType::F64, &dev)).unwrap();
            let wrapped = remat_runtime::Checkpointed::new("bn", bn.clone());
            let candle_wrapped = remat_runtime::Checkpointed::new("bn", bn.inner().clone());
            let block = NormBlock { bn: bn.clone() };
            let fresh = candle_nn::batch_norm(
                3,
                config,
                VarBuilder::from_varmap(&VarMap::new(), DType::F64, &dev),
            )
            .unwrap();
            for step in 0..3 {
                let y = plan
                    .scope(|| match caller {
                        "direct" => bn.forward_t(x.as_tensor(), true),
                        "checkpointed" => wrapped.forward_t(x.as_tensor(), true),
                        "candle-nn checkpointed" => candle_wrapped.forward_t(x.as_tensor(), true),
                        _ => block.forward(x.as_tensor()),
                    })
                    .unwrap();
                let g = backward(&loss(&y)).unwrap();
                let mut y_ref = fresh.forward_t(x.as_tensor(), true).unwrap();
                if caller == "nested" {
                    y_ref = y_ref.tanh().unwrap();
                }
                let g_ref = loss(&y_ref).backward().unwrap();
                let what = format!("{caller}, {plan}, step {step}");
                assert!(rel_diff(&y, &y_ref) < 1e-12, "{what}");
                assert!(
                    rel_diff(g.get(&x).unwrap(), g_ref.get(&x).unwrap()) < 1e-12,
                    "{what}"
                );
                assert!(
                    rel_diff(bn.running_mean(), fresh.running_mean()) < 1e-14,
                    "{what}"
                );
                assert!(
                    rel_diff(bn.running_var(), fresh.running_var()) < 1e-14,
                    "{what}"
                );
            }
        }
    }
}

/// A block whose statement calls the drop-in batch norm in training.
#[derive(Clone)]
struct NormBlock {
    bn: remat_runtime::candle_nn::BatchNorm,
}

impl NormBlock {
    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let y = self.bn.forward_t(xs, true)?;
            let z = y.tanh()?;
            Ok(z)
        }
    }
}

/// A span that counts how often it is entered (a stand-in for tracing's).
#[derive(Clone, Default)]
struct Span(std::sync::Arc<std::sync::atomic::AtomicUsize>);

struct Entered;

impl Span {
    fn enter(&self) -> Entered {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Entered
    }
}

/// candle-transformers' `with_tracing` idioms: a guard held to the end of
/// the forward, and a helper closure bound with `let` and called later.
#[derive(Clone)]
struct Traced {
    w: Var,
    span: Span,
}

impl Traced {
    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let _enter = self.span.enter();
            let act = |t: &Tensor| -> Result<Tensor> { t.tanh()?.sqr() };
            let h = xs.matmul(self.w.as_tensor())?;
            let y = act(&h)?;
            Ok((y + xs)?)
        }
    }
}

#[test]
fn a_tracing_guard_and_a_helper_closure_run_as_plain_code() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-6 } else { 1e-13 };
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, dtype, &Device::Cpu);
        let init = candle_nn::Init::Randn {
            mean: 0.0,
            stdev: 0.3,
        };
        vb.get_with_hints((6, 6), "w", init).unwrap();
        let w = vm.data().lock().unwrap()["w"].clone();
        let layer = Traced {
            w,
            span: Span::default(),
        };
        let x = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (3, 6), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let plain = || -> Result<Tensor> {
            let h = x.as_tensor().matmul(layer.w.as_tensor())?;
            h.tanh()?.sqr()? + x.as_tensor()
        };
        // Entered once by the forward, and once more by the replay (none
        // under `off`): the guard is plain code, in both runs.
        for (plan, entered) in plans().into_iter().zip([1, 3, 5]) {
            check(&vm, &x, &plan, || layer.forward(x.as_tensor()), plain, tol);
            let n = layer.span.0.load(std::sync::atomic::Ordering::SeqCst);
            assert_eq!(n, entered, "{plan}");
        }
    }
}

/// A layer from a crate, not `Clone`, written as candle-transformers writes
/// them.
struct Ffn {
    fc1: Linear,
    fc2: Linear,
    act: candle_nn::Activation,
}

impl Module for Ffn {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        xs.apply(&self.fc1)?.apply(&self.act)?.apply(&self.fc2)
    }
}

/// The same with a fused candle op that has no backward.
struct FusedHead {
    proj: Linear,
}

impl Module for FusedHead {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        candle_nn::ops::softmax_last_dim(&self.proj.forward(xs)?)
    }
}

/// A layer one cannot edit, checkpointed by one line: exact gradients under
/// every plan; a fused candle op without a backward inside it is an error,
/// not a missing gradient.
#[test]
fn a_wrapped_module_matches_plain_candle() {
    use remat_runtime::Checkpointed;
    for dtype in [DType::F32, DType::F64] {
        // Relative to the largest gradient; the same ops in the same order
        // (one statement), so f64 agrees to rounding.
        let tol = if dtype == DType::F32 { 1e-6 } else { 1e-12 };
        let vm = VarMap::new();
        let ffn = || Ffn {
            fc1: linear(&vm, "fc1", 8, 24, true, dtype),
            fc2: linear(&vm, "fc2", 24, 8, true, dtype),
            act: candle_nn::Activation::GeluPytorchTanh,
        };
        let (plain, wrapped) = (ffn(), Checkpointed::new("ffn", ffn()));
        let x = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (3, 5, 8), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        for plan in plans() {
            check(
                &vm,
                &x,
                &plan,
                || wrapped.forward(x.as_tensor()),
                || plain.forward(x.as_tensor()),
                tol,
            );
        }
        // One region per dtype: the first forward of each sees the cut.
        let name = format!("head.{dtype:?}");
        let fused = Checkpointed::new(
            name.as_str(),
            FusedHead {
                proj: linear(&vm, "head", 8, 8, false, dtype),
            },
        );
        // Seen in the region's first forward, whose statements run on
        // leaves, before any backward.
        let e = Plan::recompute_all()
            .scope(|| fused.forward(x.as_tensor()))
            .unwrap_err();
        assert!(
            e.to_string().contains(&format!(
                "region `{name}`, statement `forward`: output 0 carries no gradient"
            )),
            "{e}"
        );
    }
}

/// A layer whose fields are of every kind a block may read in place: a
/// generic module passed by reference, a shared `dyn Module`, a tensor
/// behind a mutex, a tuple with a tensor and a number, an optional bias, a
/// `Vec` of tables, a name, a number. Only the tensors among them are
/// handed to the region (`FieldChanged` checks them); the others must
/// still compile as written.
#[derive(Clone)]
struct Fields<M: Module + Clone> {
    module: M,
    shared: std::sync::Arc<dyn Module + Send + Sync>,
    locked: std::sync::Arc<std::sync::Mutex<Tensor>>,
    pair: (Tensor, f64),
    bias: Option<Tensor>,
    tables: Vec<Tensor>,
    name: String,
    scale: f64,
}

impl<M: Module + Clone + Send + Sync + 'static> Fields<M> {
    fn plain(&self, x: &Tensor) -> Result<Tensor> {
        let h = Module::forward(&self.module, x)?;
        let h = self.shared.forward(&h)?;
        let t = self.locked.lock().unwrap().clone();
        let h = (h.broadcast_mul(&t)? * self.scale)?;
        let h = h.broadcast_add(&self.pair.0)?.affine(self.pair.1, 0.0)?;
        let h = match &self.bias {
            Some(b) => h.broadcast_add(b)?,
            None => h,
        };
        let h = h.broadcast_mul(&self.tables[1])?;
        let upper = self.name.to_uppercase();
        assert_eq!(upper, "LAYER");
        h.tanh()?.sqr()?.sum_all()
    }

    remat! {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let h = Module::forward(&self.module, x)?;
            let h = self.shared.forward(&h)?;
            let t = self.locked.lock().unwrap().clone();
            let h = (h.broadcast_mul(&t)? * self.scale)?;
            let h = h.broadcast_add(&self.pair.0)?.affine(self.pair.1, 0.0)?;
            let h = match &self.bias {
                Some(b) => h.broadcast_add(b)?,
                None => h,
            };
            let h = h.broadcast_mul(&self.tables[1])?;
            let upper = self.name.to_uppercase();
            assert_eq!(upper, "LAYER");
            Ok(h.tanh()?.sqr()?.sum_all()?)
        }
    }
}

#[test]
fn fields_of_every_kind_compile_and_those_holding_tensors_are_checked() {
    use remat_runtime::RematError;
    for dtype in [DType::F32, DType::F64] {
        let vm = VarMap::new();
        let make = || Fields {
            module: linear(&vm, "a", 4, 4, true, dtype),
            shared: std::sync::Arc::new(linear(&vm, "b", 4, 4, false, dtype)),
            locked: std::sync::Arc::new(std::sync::Mutex::new(
                Tensor::new(&[0.5f32, -1.0, 2.0, 0.25], &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )),
            pair: (
                Tensor::new(&[0.1f32, 0.2, -0.3, 0.4], &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
                1.5,
            ),
            bias: Some(
                Tensor::full(0.3, 4, &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            ),
            tables: vec![
                Tensor::ones(4, dtype, &Device::Cpu).unwrap(),
                Tensor::new(&[1.0f32, 0.5, 2.0, -1.0], &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            ],
            name: "layer".to_string(),
            scale: 0.7,
        };
        let layer = make();
        let x = Var::from_tensor(
            &Tensor::arange(0f32, 12.0, &Device::Cpu)
                .unwrap()
                .reshape((3, 4))
                .unwrap()
                .affine(0.1, -0.5)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let reference = layer.plain(x.as_tensor()).unwrap().backward().unwrap();
        for plan in plans() {
            let y = plan.scope(|| layer.forward(x.as_tensor())).unwrap();
            let g = backward(&y).unwrap();
            for v in vm.all_vars().iter().chain([&x]) {
                let d = crate::common::rel_diff(g.get(v).unwrap(), reference.get(v).unwrap());
                assert!(d <= 1e-6, "{dtype:?} {plan}: {d}");
            }
            // The tuple's tensor, written in place: an error under every
            // checkpointing plan.
            if !plan.is_off() {
                let y = plan.scope(|| layer.forward(x.as_tensor())).unwrap();
                let first = layer.pair.0.narrow(0, 0, 1).unwrap();
                layer
                    .pair
                    .0
                    .slice_set(&(first + 1.0).unwrap(), 0, 0)
                    .unwrap();
                let e = backward(&y).unwrap_err();
                assert!(
                    matches!(&e, RematError::FieldChanged { field, .. } if field == "self.pair.0"),
                    "{dtype:?} {plan}: {e:?}"
                );
                layer
                    .pair
                    .0
                    .slice_set(
                        &(layer.pair.0.narrow(0, 0, 1).unwrap() - 1.0).unwrap(),
                        0,
                        0,
                    )
                    .unwrap();
            }
        }
    }
}
