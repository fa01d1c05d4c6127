//! Which `Var`s get a gradient: exactly those plain candle gives one. A
//! tracked block input that no statement used in a call (read only on a
//! branch not taken, read only in part, read only for its shape, not read
//! at all) gets no gradient, so the `Var`s behind it that nothing else
//! reaches get none either, as in plain candle; one that was used gets
//! plain candle's. Every plan, f32 and f64; values by the tolerance of
//! each dtype (the same ops in another grouping: a few ulps).

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Result, Tensor, Var};
use remat_runtime::{backward, remat, without_fingerprints, Plan, Policy, RematError};

use crate::common::{rel_diff, tensor, var};

fn plans() -> Vec<Plan> {
    vec![
        Plan::off(),
        Plan::declared(),
        Plan::recompute_all(),
        Plan::save_all(),
        Plan::budget(0.5),
        Plan::from_fn("offload all", |_| Policy::Offload),
    ]
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::F32 {
        1e-5
    } else {
        1e-12
    }
}

/// Compares the gradients of `vars` in `got` with `reference`: present in
/// both or in neither, and equal where present.
fn same_gradients(
    label: &str,
    vars: &[(&str, &Var)],
    got: &candle_core::backprop::GradStore,
    reference: &candle_core::backprop::GradStore,
    tol: f64,
) {
    for (name, v) in vars {
        match (got.get(v), reference.get(v)) {
            (Some(a), Some(b)) => {
                let d = rel_diff(a, b);
                assert!(d < tol, "{label}: `{name}` differs by {d:e}");
            }
            (None, None) => {}
            (a, b) => panic!(
                "{label}: `{name}` has a gradient {} but {} in plain candle",
                if a.is_some() { "here" } else { "nowhere" },
                if b.is_some() { "one" } else { "none" },
            ),
        }
    }
}

/// A decoder layer whose cross-attention is optional, as encoder-decoder
/// models hold it: without it the encoder's output is read by no statement
/// this call runs.
#[derive(Clone)]
struct Decoder {
    w: Var,
    cross: Option<Var>,
    gate: Var,
}

impl Decoder {
    remat! {
        fn forward(&self, x: &Tensor, enc: &Tensor, use_gate: bool) -> Result<Tensor> {
            let h = x.matmul(self.w.as_tensor())?.tanh()?;
            let mut y = (x + &h)?;
            if let Some(cross) = &self.cross {
                y = (&y + enc.matmul(cross.as_tensor())?.sin()?)?;
            }
            let gated = if use_gate {
                (&y * enc.matmul(self.gate.as_tensor())?.exp()?)?
            } else {
                y.cos()?
            };
            let mask = Tensor::ones(enc.dims(), enc.dtype(), enc.device())?;
            Ok((gated * mask)?)
        }
    }

    fn plain(&self, x: &Tensor, enc: &Tensor, use_gate: bool) -> Result<Tensor> {
        let h = x.matmul(self.w.as_tensor())?.tanh()?;
        let mut y = (x + &h)?;
        if let Some(cross) = &self.cross {
            y = (&y + enc.matmul(cross.as_tensor())?.sin()?)?;
        }
        let gated = if use_gate {
            (&y * enc.matmul(self.gate.as_tensor())?.exp()?)?
        } else {
            y.cos()?
        };
        let mask = Tensor::ones(enc.dims(), enc.dtype(), enc.device())?;
        gated * mask
    }
}

/// The encoder's output of a (plain candle) encoder layer, whose weight
/// only the decoder's reads can reach.
fn encode(src: &Tensor, w: &Var) -> Result<Tensor> {
    src.matmul(w.as_tensor())?.tanh()
}

#[test]
fn an_encoders_weights_get_a_gradient_only_where_a_statement_read_its_output() {
    for dtype in [DType::F32, DType::F64] {
        for (cross, use_gate) in [(false, false), (true, false), (false, true), (true, true)] {
            let dec = Decoder {
                w: var(&[4, 4], 1, 0.5, dtype),
                cross: cross.then(|| var(&[4, 4], 2, 0.5, dtype)),
                gate: var(&[4, 4], 3, 0.5, dtype),
            };
            let enc_w = var(&[4, 4], 4, 0.5, dtype);
            let x = var(&[3, 4], 5, 1.0, dtype);
            let src = tensor(&[3, 4], 6, 1.0, dtype);
            let mut vars = vec![
                ("w", &dec.w),
                ("gate", &dec.gate),
                ("enc_w", &enc_w),
                ("x", &x),
            ];
            if let Some(c) = &dec.cross {
                vars.push(("cross", c));
            }
            let loss = |y: Tensor| y.sqr()?.sum_all();
            let enc = encode(&src, &enc_w).unwrap();
            let reference = loss(dec.plain(x.as_tensor(), &enc, use_gate).unwrap())
                .unwrap()
                .backward()
                .unwrap();
            for plan in plans() {
                let label = format!("{dtype:?} cross {cross} gate {use_gate} {plan}");
                let enc = encode(&src, &enc_w).unwrap();
                let y = plan
                    .scope(|| dec.forward(x.as_tensor(), &enc, use_gate))
                    .unwrap();
                let got = backward(&loss(y).unwrap()).unwrap();
                same_gradients(&label, &vars, &got, &reference, tol(dtype));
            }
        }
    }
}

remat! {
    /// Reads the first of a list of states in full and a closure over the
    /// second on a branch; the third is read for its shape only.
    fn pick(states: &[Tensor], w: &Tensor, second: bool) -> Result<Tensor> {
        let h = states[0].matmul(w)?;
        let mix = |t: &Tensor| t + &states[1];
        let g = if second { mix(&h)? } else { h.exp()? };
        let z = Tensor::zeros(states[2].dims(), states[2].dtype(), states[2].device())?;
        Ok((g + z)?)
    }
}

fn plain_pick(states: &[Tensor], w: &Tensor, second: bool) -> Result<Tensor> {
    let h = states[0].matmul(w)?;
    let g = if second { (&h + &states[1])? } else { h.exp()? };
    let z = Tensor::zeros(states[2].dims(), states[2].dtype(), states[2].device())?;
    g + z
}

#[test]
fn states_read_in_part_on_a_branch_or_for_their_shape_get_plain_candles_gradients() {
    for dtype in [DType::F32, DType::F64] {
        for second in [false, true] {
            let w = var(&[4, 4], 11, 0.5, dtype);
            let sources: Vec<Var> = (0..3).map(|i| var(&[3, 4], 12 + i, 1.0, dtype)).collect();
            let vars: Vec<(&str, &Var)> = [("w", &w), ("s0", &sources[0]), ("s1", &sources[1])]
                .into_iter()
                .chain([("s2", &sources[2])])
                .collect();
            // The states are computed from the sources (not `Var`s themselves).
            let states = || -> Vec<Tensor> {
                sources
                    .iter()
                    .map(|s| s.as_tensor().sin().unwrap())
                    .collect()
            };
            let loss = |y: Tensor| y.sqr()?.sum_all();
            let reference = loss(plain_pick(&states(), w.as_tensor(), second).unwrap())
                .unwrap()
                .backward()
                .unwrap();
            for plan in plans() {
                let label = format!("{dtype:?} second {second} {plan}");
                let s = states();
                let y = plan.scope(|| pick(&s, w.as_tensor(), second)).unwrap();
                let got = backward(&loss(y).unwrap()).unwrap();
                same_gradients(&label, &vars, &got, &reference, tol(dtype));
            }
        }
    }
}

remat! {
    /// Takes a tracked input it never reads, and a `Var` handed as a plain
    /// tensor that it reads on one branch.
    fn unread(x: &Tensor, _spare: &Tensor, w: &Tensor, scale: bool) -> Result<Tensor> {
        let h = x.exp()?;
        let y = if scale { h.broadcast_mul(w)? } else { h.sqr()? };
        Ok(y)
    }
}

#[test]
fn an_input_no_statement_reads_and_a_var_on_a_branch_not_taken_get_no_gradient() {
    for dtype in [DType::F32, DType::F64] {
        for scale in [false, true] {
            let x = var(&[2, 3], 21, 1.0, dtype);
            let spare_src = var(&[2, 3], 22, 1.0, dtype);
            let w = var(&[3], 23, 1.0, dtype);
            let vars = [("x", &x), ("spare_src", &spare_src), ("w", &w)];
            let plain = |x: &Tensor, w: &Tensor| -> Result<Tensor> {
                let h = x.exp()?;
                let y = if scale { h.broadcast_mul(w)? } else { h.sqr()? };
                y.sqr()?.sum_all()
            };
            let reference = plain(x.as_tensor(), w.as_tensor())
                .unwrap()
                .backward()
                .unwrap();
            for plan in plans() {
                let label = format!("{dtype:?} scale {scale} {plan}");
                let spare = spare_src.as_tensor().cos().unwrap();
                let y = plan
                    .scope(|| unread(x.as_tensor(), &spare, w.as_tensor(), scale))
                    .unwrap();
                let got = backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap();
                same_gradients(&label, &vars, &got, &reference, tol(dtype));
            }
        }
    }
}

static TAKE_ENC: AtomicBool = AtomicBool::new(false);

remat! {
    /// Reads the encoder's output on a branch chosen by state that changes
    /// between the forward and the backward (what a block must not do).
    fn flips(x: &Tensor, enc: &Tensor) -> Result<Tensor> {
        let h = x.exp()?;
        let y = if TAKE_ENC.load(Ordering::SeqCst) { (&h * enc)? } else { h.sin()? };
        Ok(y)
    }
}

/// With the replay check off, a replay that uses an input the forward did
/// not use is an error, not a gradient handed nowhere.
#[test]
fn a_replay_using_an_input_the_forward_did_not_is_an_error() {
    let x = var(&[2, 3], 31, 1.0, DType::F64);
    let enc_src = var(&[2, 3], 32, 1.0, DType::F64);
    for plan in [Plan::recompute_all(), Plan::declared()] {
        TAKE_ENC.store(false, Ordering::SeqCst);
        let enc = enc_src.as_tensor().cos().unwrap();
        let y = without_fingerprints(|| plan.scope(|| flips(x.as_tensor(), &enc))).unwrap();
        TAKE_ENC.store(true, Ordering::SeqCst);
        let err = backward(&y.sum_all().unwrap()).unwrap_err();
        TAKE_ENC.store(false, Ordering::SeqCst);
        assert!(
            matches!(&err, RematError::ReplayDesync { region, found, .. }
                if region == "flips" && found.contains("input 1")),
            "{plan}: {err}"
        );
    }
}

/// A layer that logs statistics of what it reads: values no output of the
/// block depends on. The encoder's output feeds only them, a value made of
/// it, and (with `cross`) reads on a branch, so without `cross` plain
/// candle gives the encoder's weight no gradient.
#[derive(Clone)]
struct Logged {
    w: Var,
    probe: Var,
    cross: bool,
}

impl Logged {
    remat! {
        fn forward(&self, x: &Tensor, enc: &Tensor) -> Result<(Tensor, f64)> {
            let h = x.matmul(self.w.as_tensor())?.tanh()?;
            // A statistic kept as a tensor, saved or not, and one read to
            // the host: no output depends on either.
            let spread = enc.sqr()?.mean_all()?;
            #[save]
            let probe = enc.broadcast_mul(self.probe.as_tensor())?.sin()?;
            let _mixed = (&probe.sum_all()? + &spread)?;
            let peak = enc.abs()?.max_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            // An input, and a value made of it, read only on a branch.
            let scaled = (enc * 0.5)?;
            let y = if self.cross { (&h + enc)? } else { h.exp()? };
            let y = if self.cross { (&y * scaled.cos()?)? } else { y };
            Ok((y, peak))
        }
    }

    fn plain(&self, x: &Tensor, enc: &Tensor) -> Result<Tensor> {
        let h = x.matmul(self.w.as_tensor())?.tanh()?;
        let spread = enc.sqr()?.mean_all()?;
        let probe = enc.broadcast_mul(self.probe.as_tensor())?.sin()?;
        let _mixed = (&probe.sum_all()? + &spread)?;
        let scaled = (enc * 0.5)?;
        let y = if self.cross { (&h + enc)? } else { h.exp()? };
        if self.cross {
            &y * scaled.cos()?
        } else {
            Ok(y)
        }
    }
}

#[test]
fn an_input_read_only_by_statements_no_output_depends_on_gets_no_gradient() {
    for dtype in [DType::F32, DType::F64] {
        for cross in [false, true] {
            let layer = Logged {
                w: var(&[4, 4], 41, 0.5, dtype),
                probe: var(&[4], 42, 0.5, dtype),
                cross,
            };
            let enc_w = var(&[4, 4], 43, 0.5, dtype);
            let x = var(&[3, 4], 44, 1.0, dtype);
            let src = tensor(&[3, 4], 45, 1.0, dtype);
            let vars = [
                ("w", &layer.w),
                ("probe", &layer.probe),
                ("enc_w", &enc_w),
                ("x", &x),
            ];
            let loss = |y: Tensor| y.sqr()?.sum_all();
            let enc = encode(&src, &enc_w).unwrap();
            let reference = loss(layer.plain(x.as_tensor(), &enc).unwrap())
                .unwrap()
                .backward()
                .unwrap();
            for plan in plans() {
                let label = format!("{dtype:?} cross {cross} {plan}");
                let enc = encode(&src, &enc_w).unwrap();
                let (y, peak) = plan.scope(|| layer.forward(x.as_tensor(), &enc)).unwrap();
                assert!(peak > 0.0, "{label}");
                let got = backward(&loss(y).unwrap()).unwrap();
                same_gradients(&label, &vars, &got, &reference, tol(dtype));
            }
        }
    }
}
