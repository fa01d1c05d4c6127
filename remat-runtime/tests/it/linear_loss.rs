//! `nn::linear_cross_entropy` against the composed head (candle's ops:
//! norm, matmul, log-softmax, gather, masked mean) in f64 to 1e-10
//! relative, against central differences, and in bf16/f16 against the
//! composed head in f32: every option (norms, bias, ignored tokens, label
//! smoothing, chunk sizes), all-ignored batches, one token, huge logits.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use remat_runtime::nn::{linear_cross_entropy, LinearCrossEntropy, PreNorm};

/// Which norm comes first.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Norm {
    None,
    Layer,
    Rms,
}

/// One head: hidden states `(B, T, C)`, weight `(V, C)`, optional bias and
/// norm parameters, labels.
struct Head {
    x: Var,
    w: Var,
    b: Option<Var>,
    gain: Var,
    shift: Var,
    norm: Norm,
    labels: Tensor,
}

const EPS: f64 = 1e-5;

impl Head {
    fn new(b: usize, t: usize, c: usize, v: usize, norm: Norm, bias: bool, dtype: DType) -> Self {
        // Labels in 0..V, with every fifth token ignored.
        let labels: Vec<i64> = (0..b * t)
            .map(|i| {
                if i % 5 == 3 {
                    -100
                } else {
                    ((i * 7919) % v) as i64
                }
            })
            .collect();
        Head {
            x: var(&[b, t, c], 11, 2.0, dtype),
            w: var(&[v, c], 12, 0.5, dtype),
            b: bias.then(|| var(&[v], 13, 0.5, dtype)),
            gain: var(&[c], 14, 1.0, dtype),
            shift: var(&[c], 15, 0.5, dtype),
            norm,
            labels: Tensor::from_vec(labels, (b, t), &Device::Cpu).unwrap(),
        }
    }

    fn vars(&self) -> Vec<&Var> {
        let mut v = vec![&self.x, &self.w];
        v.extend(&self.b);
        match self.norm {
            Norm::None => {}
            Norm::Rms => v.push(&self.gain),
            Norm::Layer => v.extend([&self.gain, &self.shift]),
        }
        v
    }

    fn options(&self) -> LinearCrossEntropy<'_> {
        LinearCrossEntropy {
            norm: match self.norm {
                Norm::None => None,
                Norm::Layer => Some(PreNorm::Layer {
                    gain: self.gain.as_tensor(),
                    bias: self.shift.as_tensor(),
                    eps: EPS,
                }),
                Norm::Rms => Some(PreNorm::Rms {
                    gain: self.gain.as_tensor(),
                    eps: EPS,
                }),
            },
            bias: self.b.as_ref().map(|b| b.as_tensor()),
            ..Default::default()
        }
    }

    fn fused(&self, o: &LinearCrossEntropy) -> Result<Tensor> {
        linear_cross_entropy(self.x.as_tensor(), self.w.as_tensor(), &self.labels, o)
    }

    /// The composed head, in `dtype` (statistics in it too).
    fn composed(&self, o: &LinearCrossEntropy, dtype: DType) -> Result<Tensor> {
        let to = |v: &Var| v.as_tensor().to_dtype(dtype);
        let (x, w) = (to(&self.x)?, to(&self.w)?);
        let c = x.dim(D::Minus1)?;
        let h = match self.norm {
            Norm::None => x,
            Norm::Layer => {
                let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
                let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
                let xhat = centered.broadcast_div(&(var + EPS)?.sqrt()?)?;
                xhat.broadcast_mul(&to(&self.gain)?)?
                    .broadcast_add(&to(&self.shift)?)?
            }
            Norm::Rms => {
                let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
                x.broadcast_div(&(ms + EPS)?.sqrt()?)?
                    .broadcast_mul(&to(&self.gain)?)?
            }
        };
        let h = h.reshape(((), c))?;
        let mut z = h.matmul(&w.t()?)?;
        if let Some(b) = &self.b {
            z = z.broadcast_add(&to(b)?)?;
        }
        let logp = candle_nn::ops::log_softmax(&z, D::Minus1)?;
        let labels: Vec<i64> = self.labels.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
        let counted: Vec<f64> = labels
            .iter()
            .map(|&l| if Some(l) == o.ignore_index { 0.0 } else { 1.0 })
            .collect();
        let index: Vec<u32> = labels.iter().map(|&l| l.max(0) as u32).collect();
        let n = labels.len();
        let index = Tensor::from_vec(index, (n, 1), z.device())?;
        let counted = Tensor::from_vec(counted, (n, 1), z.device())?.to_dtype(dtype)?;
        let eps = o.label_smoothing;
        let token =
            ((logp.gather(&index, 1)? * -(1.0 - eps))? - (logp.mean_keepdim(D::Minus1)? * eps)?)?;
        let count = counted
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
        (token * counted)?.sum_all()? / count.max(1.0)
    }

    /// Loss and gradients of `f`, in f64.
    fn run(&self, f: impl Fn() -> Result<Tensor>) -> (f64, Vec<Tensor>) {
        let loss = f().unwrap();
        let grads = loss.backward().unwrap();
        let value = loss
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        let gs = self
            .vars()
            .iter()
            .map(|v| {
                grads
                    .get(v)
                    .unwrap_or_else(|| panic!("no gradient for {:?}", v.dims()))
                    .to_dtype(DType::F64)
                    .unwrap()
            })
            .collect();
        (value, gs)
    }
}

/// Loss and gradients of the fused head against the composed one.
fn compare(head: &Head, o: &LinearCrossEntropy, dtype: DType) -> f64 {
    let (l, g) = head.run(|| head.fused(o));
    let (lr, gr) = head.run(|| head.composed(o, dtype));
    let mut worst = (l - lr).abs() / lr.abs().max(1e-30);
    for (a, b) in g.iter().zip(&gr) {
        worst = worst.max(rel_diff(a, b));
    }
    worst
}

#[test]
fn every_option_matches_the_composed_head_in_f64() {
    for norm in [Norm::None, Norm::Layer, Norm::Rms] {
        for bias in [false, true] {
            let head = Head::new(2, 5, 6, 11, norm, bias, DType::F64);
            for smoothing in [0.0, 0.1] {
                // One chunk, and chunks of 3 rows (10 tokens: a short last one).
                for chunk_bytes in [None, Some(3 * 5 * 11 * 8)] {
                    let o = LinearCrossEntropy {
                        label_smoothing: smoothing,
                        chunk_bytes,
                        ..head.options()
                    };
                    let d = compare(&head, &o, DType::F64);
                    assert!(
                        d <= 1e-10,
                        "{norm:?} bias {bias} smoothing {smoothing} chunks {chunk_bytes:?}: {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn matches_central_differences() {
    let head = Head::new(1, 3, 4, 7, Norm::Layer, true, DType::F64);
    let o = LinearCrossEntropy {
        label_smoothing: 0.2,
        chunk_bytes: Some(1),
        ..head.options()
    };
    let (_, grads) = head.run(|| head.fused(&o));
    for (v, g) in head.vars().iter().zip(&grads) {
        let base = f64s(v.as_tensor());
        let analytic = f64s(g);
        let (err, j, numeric) =
            worst_difference(&base, &analytic, 1e-6, Quotient::Central(1e-6), |moved| {
                v.set(&Tensor::from_vec(moved, v.shape(), v.device()).unwrap())
                    .unwrap();
                head.fused(&o).unwrap().to_scalar::<f64>().unwrap()
            });
        v.set(&Tensor::from_vec(base, v.shape(), v.device()).unwrap())
            .unwrap();
        assert!(
            err <= 1e-7,
            "{:?}[{j}]: {numeric} vs {}",
            v.dims(),
            analytic[j]
        );
    }
}

#[test]
fn ignored_tokens_all_ignored_one_token_and_huge_logits() {
    // Every token ignored: loss 0, every gradient 0 (not NaN).
    let mut head = Head::new(1, 4, 3, 5, Norm::Rms, false, DType::F64);
    head.labels = Tensor::new(&[[-100i64, -100, -100, -100]], &Device::Cpu).unwrap();
    let (l, grads) = head.run(|| head.fused(&head.options()));
    assert_eq!(l, 0.0);
    for g in grads {
        assert_eq!(max_abs(&g), 0.0);
    }
    // One token.
    let head = Head::new(1, 1, 3, 5, Norm::Layer, true, DType::F64);
    assert!(compare(&head, &head.options(), DType::F64) <= 1e-10);
    // Logits in the thousands: the statistics stay finite and exact.
    let mut head = Head::new(2, 3, 4, 9, Norm::None, false, DType::F64);
    head.w = Var::from_tensor(&(head.w.as_tensor() * 3000.0).unwrap()).unwrap();
    let (l, _) = head.run(|| head.fused(&head.options()));
    assert!(l.is_finite() && l > 100.0, "{l}");
    assert!(compare(&head, &head.options(), DType::F64) <= 1e-10);
    // No ignored label: -100 is then an error naming the token.
    let head = Head::new(1, 5, 3, 5, Norm::None, false, DType::F64);
    let o = LinearCrossEntropy {
        ignore_index: None,
        ..head.options()
    };
    let e = head.fused(&o).unwrap_err().to_string();
    assert!(e.contains("label -100 of token 3"), "{e}");
    // Labels as u32; a label past the vocabulary.
    let mut head = Head::new(1, 2, 3, 5, Norm::None, false, DType::F64);
    head.labels = Tensor::new(&[[1u32, 4]], &Device::Cpu).unwrap();
    assert!(compare(&head, &head.options(), DType::F64) <= 1e-10);
    head.labels = Tensor::new(&[[1u32, 5]], &Device::Cpu).unwrap();
    let e = head.fused(&head.options()).unwrap_err().to_string();
    assert!(e.contains("label 5 of token 1 is not a class"), "{e}");
    // Shapes that do not fit.
    let w = Tensor::zeros((5, 4), DType::F64, &Device::Cpu).unwrap();
    let e = linear_cross_entropy(head.x.as_tensor(), &w, &head.labels, &head.options())
        .unwrap_err()
        .to_string();
    assert!(e.contains("last dimensions must be equal"), "{e}");
}

/// A tied head: the weight is also the token embedding; its gradient is
/// the sum of both uses', as candle's composed head gives it.
#[test]
fn a_tied_embedding_gets_both_gradients() {
    let (v, c) = (13, 6);
    let emb = var(&[v, c], 21, 1.0, DType::F64);
    let ids = Tensor::new(&[[1u32, 4, 4, 12], [0, 3, 7, 7]], &Device::Cpu).unwrap();
    let labels = Tensor::new(&[[4i64, 4, 12, -100], [3, 7, 7, 1]], &Device::Cpu).unwrap();
    let gain = var(&[c], 22, 1.0, DType::F64);
    let run = |fused: bool| {
        let x = emb
            .as_tensor()
            .embedding(&ids.flatten_all()?)?
            .reshape((2, 4, c))?;
        let loss = if fused {
            let o = LinearCrossEntropy {
                norm: Some(PreNorm::Rms {
                    gain: gain.as_tensor(),
                    eps: EPS,
                }),
                ..Default::default()
            };
            linear_cross_entropy(&x, emb.as_tensor(), &labels, &o)?
        } else {
            let h = remat_runtime::nn::rms_norm(&x, gain.as_tensor(), EPS)?.reshape((8, c))?;
            let logp = candle_nn::ops::log_softmax(&h.matmul(&emb.as_tensor().t()?)?, 1)?;
            let l: Vec<i64> = labels.flatten_all()?.to_vec1()?;
            let idx = Tensor::from_vec(
                l.iter().map(|&l| l.max(0) as u32).collect::<Vec<_>>(),
                (8, 1),
                x.device(),
            )?;
            let keep = Tensor::from_vec(
                l.iter()
                    .map(|&l| f64::from(u8::from(l >= 0)))
                    .collect::<Vec<_>>(),
                (8, 1),
                x.device(),
            )?;
            ((logp.gather(&idx, 1)? * keep)?.sum_all()? / -7.0)?
        };
        let g = loss.backward()?;
        Ok::<_, candle_core::Error>((g.get(&emb).unwrap().clone(), g.get(&gain).unwrap().clone()))
    };
    let (fused, reference) = (run(true).unwrap(), run(false).unwrap());
    assert!(rel_diff(&fused.0, &reference.0) <= 1e-10);
    assert!(rel_diff(&fused.1, &reference.1) <= 1e-10);
}

/// bf16 and f16 heads: logits in the model's dtype, statistics in f32,
/// against the composed head in f32 on the same (rounded) values.
#[test]
fn half_precision_heads_match_the_f32_composed_head() {
    for dtype in [DType::BF16, DType::F16] {
        let head = Head::new(2, 6, 16, 40, Norm::Rms, false, dtype);
        let o = LinearCrossEntropy {
            label_smoothing: 0.05,
            chunk_bytes: Some(4 * 40 * 4 * 5),
            ..head.options()
        };
        let d = compare(&head, &o, DType::F32);
        // The logits and the gradients' matmuls round to the dtype (unit
        // roundoff 2^-9 in bf16, 2^-12 in f16): a few units (seen: 6.1e-3
        // and 7.6e-4).
        let tol = if dtype == DType::BF16 { 1e-2 } else { 2e-3 };
        assert!(d <= tol, "{dtype:?}: {d}");
        let loss = head.fused(&o).unwrap();
        assert_eq!(loss.dtype(), DType::F32);
    }
}

/// A real vocabulary and many tokens in f16: each token's softmax entries
/// (about 1 / V) divided by the count of tokens (the mean) would be below
/// f16's smallest subnormal (6e-8); the mean's 1 / count is applied after
/// the 16-bit products, in f32, so the gradients keep them.
#[test]
fn an_f16_head_keeps_the_mean_of_many_tokens_over_a_wide_vocabulary() {
    // 4 x 256 tokens (819 counted), V = 16,384: 1 / V / 819 = 7.5e-8,
    // most entries below that; scaled first, in f16, they round to 0 or a
    // subnormal with a few bits.
    let head = Head::new(4, 256, 8, 16_384, Norm::Rms, false, DType::F16);
    let o = head.options();
    let d = compare(&head, &o, DType::F32);
    // A few units of f16's roundoff (2^-11) over sums of 16,384 logits:
    // seen 2.4e-3. Scaling before the 16-bit product gives 0.1.
    assert!(d <= 5e-3, "{d}");
}

/// A loss scale of 2^16 (PyTorch's GradScaler's first) on an f16 head:
/// the gradients are 2^16 times the unscaled ones, finite; and a bf16 gain's
/// gradient summed over many chunks is as close to the f32 head's as over
/// one chunk (the sums are kept in f32, rounded once).
#[test]
fn scaled_f16_losses_and_many_bf16_chunks() {
    let head = Head::new(2, 32, 16, 64, Norm::Rms, false, DType::F16);
    let o = head.options();
    let (_, plain) = head.run(|| head.fused(&o));
    let (_, scaled) = head.run(|| head.fused(&o)? * 65536.0);
    for (p, s) in plain.iter().zip(&scaled) {
        assert!(max_abs(s).is_finite());
        let unscaled = (s / 65536.0).unwrap();
        assert!(rel_diff(&unscaled, p) <= 1e-3, "{}", rel_diff(&unscaled, p));
    }
    let head = Head::new(4, 64, 16, 64, Norm::Rms, false, DType::BF16);
    let one = LinearCrossEntropy {
        chunk_bytes: Some(1 << 30),
        ..head.options()
    };
    let many = LinearCrossEntropy {
        chunk_bytes: Some(64 * 4 * 5 * 2),
        ..head.options()
    };
    let (_, g1) = head.run(|| head.fused(&one));
    let (_, gm) = head.run(|| head.fused(&many));
    let (_, reference) = head.run(|| head.composed(&one, DType::F32));
    let gain = g1.len() - 1;
    let (d1, dm) = (
        rel_diff(&g1[gain], &reference[gain]),
        rel_diff(&gm[gain], &reference[gain]),
    );
    assert!(dm <= 2.0 * d1.max(4e-3), "128 chunks {dm}, one chunk {d1}");
}

/// An ignored token whose label's logit is -inf (a bias masking class 0)
/// adds nothing: the loss stays finite.
#[test]
fn an_ignored_token_with_an_infinite_logit() {
    let mut head = Head::new(1, 4, 3, 5, Norm::None, true, DType::F64);
    let mut bias = vec![0f64; 5];
    bias[0] = f64::NEG_INFINITY;
    head.b = Some(Var::new(bias.as_slice(), &Device::Cpu).unwrap());
    head.labels = Tensor::new(&[[-100i64, 1, 2, 3]], &Device::Cpu).unwrap();
    let loss = head
        .fused(&head.options())
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    assert!(loss.is_finite(), "{loss}");
}

/// A model's last layer and loss, with the options of the head written
/// where they are used, inside a block.
#[derive(Clone)]
struct FinalLayer {
    gain: Tensor,
    w: Tensor,
    b: Tensor,
}

impl FinalLayer {
    remat_runtime::remat! {
        fn loss(&self, x: &Tensor, labels: &Tensor) -> Result<Tensor> {
            let h = (x.tanh()? * 2.0)?;
            let bias = (&self.b * 0.5)?;
            // Options borrowing a field, a statement's value and a block
            // input, read by two statements.
            let o = LinearCrossEntropy {
                norm: Some(PreNorm::Rms { gain: &self.gain, eps: EPS }),
                bias: Some(&bias),
                label_smoothing: 0.1,
                ..Default::default()
            };
            let main = linear_cross_entropy(&h, &self.w, labels, &o)?;
            let plain_head = LinearCrossEntropy { norm: None, bias: None, ..o };
            let aux = linear_cross_entropy(x, &self.w, labels, &plain_head)?;
            let defaults = LinearCrossEntropy::default();
            let third = linear_cross_entropy(&h, &self.w, labels, &defaults)?;
            let loss = ((main + (aux * 0.25)?)? + (third * 0.5)?)?;
            Ok(loss)
        }
    }

    fn loss_plain(&self, x: &Tensor, labels: &Tensor) -> Result<Tensor> {
        let h = (x.tanh()? * 2.0)?;
        let bias = (&self.b * 0.5)?;
        let o = LinearCrossEntropy {
            norm: Some(PreNorm::Rms {
                gain: &self.gain,
                eps: EPS,
            }),
            bias: Some(&bias),
            label_smoothing: 0.1,
            ..Default::default()
        };
        let main = linear_cross_entropy(&h, &self.w, labels, &o)?;
        let plain_head = LinearCrossEntropy {
            norm: None,
            bias: None,
            ..o
        };
        let aux = linear_cross_entropy(x, &self.w, labels, &plain_head)?;
        let defaults = LinearCrossEntropy::default();
        let third = linear_cross_entropy(&h, &self.w, labels, &defaults)?;
        (main + (aux * 0.25)?)? + (third * 0.5)?
    }
}

/// Options of the fused head built inside a block (a struct literal
/// borrowing fields and statements' values) are plain code, defined again
/// in each statement that reads them: the gradients equal plain candle's
/// under every plan.
#[test]
fn head_options_built_inside_a_block_match_plain_candle() {
    for dtype in [DType::F32, DType::F64] {
        let head = Head::new(2, 3, 8, 11, Norm::Rms, true, dtype);
        let layer = FinalLayer {
            gain: head.gain.as_tensor().clone(),
            w: head.w.as_tensor().clone(),
            b: head.b.as_ref().unwrap().as_tensor().clone(),
        };
        let (_, expected) = head.run(|| layer.loss_plain(head.x.as_tensor(), &head.labels));
        for plan in [
            remat_runtime::Plan::declared(),
            remat_runtime::Plan::recompute_all(),
            remat_runtime::Plan::save_all(),
            remat_runtime::Plan::save_only(["bias", "aux"]),
        ] {
            let (_, got) = head.run(|| {
                plan.scope(|| layer.loss(head.x.as_tensor(), &head.labels))
                    .map_err(candle_core::Error::wrap)
            });
            for (g, e) in got.iter().zip(&expected) {
                let d = rel_diff(g, e);
                let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
                assert!(d < tol, "{dtype:?} {plan}: {d}");
            }
        }
    }
}
