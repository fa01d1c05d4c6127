//! Plans: policies chosen at run time for statements the code leaves open.
//! Gradients are compared with the same block run as plain candle code
//! (`Plan::off`); tolerance 1e-6 relative, as in `grad_equality.rs` (f32
//! sums reordered across units), and exact where nothing is reordered.

use crate::common::*;
use candle_core::{DType, Result, Tensor, Var};
use remat_runtime::{remat, MemoryReport, Plan, Policy, Region};

#[derive(Clone)]
pub struct P {
    w1: Var,
    w2: Var,
}

remat! {
    /// Two open statements around one that insists on being saved and one
    /// that insists on being recomputed.
    fn mlp(x: &Tensor, p: &P) -> Result<Tensor> {
        let h = x.matmul(&p.w1)?;
        #[recompute] let g = h.tanh()?;
        let o = g.matmul(&p.w2)?;
        #[save(name = "out")] let y = (o.exp()? + x)?;
        Ok(y)
    }
}

fn params() -> (Var, P) {
    let x = var(&[4, 8], 1, 1.0, DType::F32);
    let p = P {
        w1: var(&[8, 16], 2, 0.3, DType::F32),
        w2: var(&[16, 8], 3, 0.3, DType::F32),
    };
    (x, p)
}

/// Runs the block under `plan`; returns the policies the tape recorded by
/// name and the worst relative gradient difference to plain candle.
fn run(plan: &Plan) -> (Vec<(String, Option<Policy>)>, f64) {
    let (x, p) = params();
    let weights = tensor(&[4, 8], 9, 1.0, DType::F32);
    let loss = |y: &Tensor| (y * &weights).unwrap().sum_all().unwrap();
    let y_ref = Plan::off().scope(|| mlp(x.as_tensor(), &p)).unwrap();
    assert!(
        MemoryReport::capture().entries.is_empty(),
        "off keeps no tape"
    );
    let g_ref = loss(&y_ref).backward().unwrap();
    let y = plan.scope(|| mlp(x.as_tensor(), &p)).unwrap();
    let policies = MemoryReport::capture()
        .entries
        .into_iter()
        .map(|e| (e.statement, e.policy))
        .collect();
    assert_eq!(rel_diff(&y, &y_ref), 0.0);
    // The backward runs outside the scope: the replay must follow the tape.
    let g = loss(&y).backward().unwrap();
    let worst = [&x, &p.w1, &p.w2]
        .iter()
        .map(|v| rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap()))
        .fold(0.0, f64::max);
    (policies, worst)
}

fn expect(entries: &[(&str, Option<Policy>)]) -> Vec<(String, Option<Policy>)> {
    entries.iter().map(|(n, p)| (n.to_string(), *p)).collect()
}

const S: Option<Policy> = Some(Policy::Save);
const R: Option<Policy> = Some(Policy::Recompute);

#[test]
fn declared_plan_recomputes_open_statements() {
    let (policies, worst) = run(&Plan::declared());
    assert_eq!(
        policies,
        expect(&[("(inputs)", None), ("h", R), ("g", R), ("o", R), ("out", S)])
    );
    assert!(worst <= 1e-6, "{worst}");
}

#[test]
fn save_only_saves_named_open_statements_and_keeps_annotations() {
    // `g` is listed but declared `#[recompute]`: the annotation wins.
    let (policies, worst) = run(&Plan::save_only(["h", "g", "o"]));
    assert_eq!(
        policies,
        expect(&[("(inputs)", None), ("h", S), ("g", R), ("o", S), ("out", S)])
    );
    assert!(worst <= 1e-6, "{worst}");
}

#[test]
fn recompute_all_and_save_all_override_annotations() {
    let (policies, worst) = run(&Plan::recompute_all());
    assert_eq!(
        policies,
        expect(&[("(inputs)", None), ("h", R), ("g", R), ("o", R), ("out", R)])
    );
    assert_eq!(worst, 0.0, "one segment: the same graph as plain candle");
    let (policies, worst) = run(&Plan::save_all());
    assert_eq!(
        policies,
        expect(&[("(inputs)", None), ("h", S), ("g", S), ("o", S), ("out", S)])
    );
    assert!(worst <= 1e-6, "{worst}");
}

#[test]
fn custom_plan_sees_names_and_declarations() {
    let plan = Plan::from_fn("matmuls", |s| {
        assert_eq!(s.region, "mlp");
        s.declared.unwrap_or(if s.name == "o" {
            Policy::Save
        } else {
            Policy::Recompute
        })
    });
    let (policies, worst) = run(&plan);
    assert_eq!(
        policies,
        expect(&[("(inputs)", None), ("h", R), ("g", R), ("o", S), ("out", S)])
    );
    assert!(worst <= 1e-6, "{worst}");
}

#[test]
fn region_plan_beats_scope_and_nested_regions_inherit_it() {
    let (x, p) = params();
    let inner_policy = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = inner_policy.clone();
    let pc = p.clone();
    let outer = Region::new("outer").plan(Plan::save_all());
    let y = Plan::recompute_all()
        .scope(|| {
            outer.run(&[x.as_tensor()], move |ctx, ins| {
                let h = ctx.open("pre", &[&ins[0]], |t| t[0].sqr())?;
                // A region nested in the block: runs in the forward and again
                // in the outer replay, both times under the outer plan.
                let pc = pc.clone();
                seen.lock().unwrap().push(ctx.plan().to_string());
                ctx.open("inner", &[&h], move |t| mlp(&t[0], &pc))
            })
        })
        .unwrap();
    let report = MemoryReport::capture();
    // The outer region's statements and the inner region's statements are
    // all saved: the scope's `recompute_all` is overridden by the region.
    for e in report.entries.iter().filter(|e| e.policy.is_some()) {
        assert_eq!(e.policy, S, "{}/{}", e.region, e.statement);
    }
    assert!(report.entries.iter().any(|e| e.region == "mlp"));
    let g = y.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        *inner_policy.lock().unwrap(),
        vec!["save all".to_string(), "save all".to_string()],
        "forward and replay ran under the region's plan"
    );
    // Plain reference.
    let h = x.as_tensor().sqr().unwrap();
    let w = h
        .matmul(&p.w1)
        .unwrap()
        .tanh()
        .unwrap()
        .matmul(&p.w2)
        .unwrap();
    let y_ref = (w.exp().unwrap() + &h).unwrap();
    let g_ref = y_ref.sum_all().unwrap().backward().unwrap();
    for v in [&x, &p.w1, &p.w2] {
        let d = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
        assert!(d <= 1e-6, "{d}");
    }
}

/// `enabled(false)` switches off its own region only: a region nested in
/// its block keeps the plan of the scope around it (and checkpoints), where
/// `.plan(Plan::off())` is inherited by the nested region (which then runs
/// plain). Both give plain candle's gradients.
#[test]
fn enabled_false_switches_off_one_region_and_plan_off_every_nested_one() {
    let (x, p) = params();
    for (switch, inner_plan, inner_taped) in [
        ("enabled(false)", "recompute all", true),
        ("plan(off)", "off", false),
    ] {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let saw = seen.clone();
        let pc = p.clone();
        let outer = match switch {
            "enabled(false)" => Region::new("outer").enabled(false),
            _ => Region::new("outer").plan(Plan::off()),
        };
        let y = Plan::recompute_all()
            .scope(|| {
                outer.run(&[x.as_tensor()], move |ctx, ins| {
                    let h = ctx.open("pre", &[&ins[0]], |t| t[0].sqr())?;
                    let pc = pc.clone();
                    let saw = saw.clone();
                    ctx.open("inner", &[&h], move |t| {
                        Region::new("nested").run(&[&t[0]], {
                            let (pc, saw) = (pc.clone(), saw.clone());
                            move |ctx, ins| {
                                saw.lock().unwrap().push(ctx.plan().to_string());
                                ctx.open("mlp", &[&ins[0]], |t| mlp(&t[0], &pc))
                            }
                        })
                    })
                })
            })
            .unwrap();
        let report = MemoryReport::capture();
        assert!(
            !report.entries.iter().any(|e| e.region == "outer"),
            "{switch}: the outer region keeps no tape"
        );
        assert_eq!(
            report.entries.iter().any(|e| e.region == "nested"),
            inner_taped,
            "{switch}"
        );
        let g = y.sum_all().unwrap().backward().unwrap();
        assert_eq!(seen.lock().unwrap()[0], inner_plan, "{switch}");
        let h = x.as_tensor().sqr().unwrap();
        let w = h
            .matmul(&p.w1)
            .unwrap()
            .tanh()
            .unwrap()
            .matmul(&p.w2)
            .unwrap();
        let y_ref = (w.exp().unwrap() + &h).unwrap();
        let g_ref = y_ref.sum_all().unwrap().backward().unwrap();
        for v in [&x, &p.w1, &p.w2] {
            let d = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
            assert!(d <= 1e-6, "{switch}: {d}");
        }
    }
}

#[test]
fn scope_is_popped_after_a_panic() {
    let r = std::panic::catch_unwind(|| Plan::save_all().scope(|| panic!("inside")));
    assert!(r.is_err());
    assert_eq!(Plan::current().to_string(), "declared");
}

// ------------------------------------------------------------ budget plans

#[derive(Clone)]
pub struct Block {
    w_qkv: Var,
    w_proj: Var,
    w_fc: Var,
    w_out: Var,
    g: Var,
    b: Var,
}

remat! {
    /// A transformer-like block with every statement left to the plan.
    fn open_block(x: &Tensor, p: &Block, mask: &Tensor) -> Result<Tensor> {
        let ln1 = candle_nn::ops::layer_norm_slow(x, &p.g, &p.b, 1e-5)?;
        let qkv = ln1.broadcast_matmul(&p.w_qkv)?;
        let (q, k, v) = (qkv.narrow(2, 0, 16)?, qkv.narrow(2, 16, 16)?, qkv.narrow(2, 32, 16)?);
        let scores = q.matmul(&k.t()?)?.broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax(&scores, candle_core::D::Minus1)?;
        let att = probs.matmul(&v)?;
        let proj = att.broadcast_matmul(&p.w_proj)?;
        let x = (x + proj)?;
        let fc = x.broadcast_matmul(&p.w_fc)?;
        let act = fc.gelu()?;
        let out = act.broadcast_matmul(&p.w_out)?;
        Ok((x + out)?)
    }
}

fn open_block_setup() -> (Var, Block, Tensor) {
    let x = var(&[2, 8, 16], 11, 1.0, DType::F32);
    let p = Block {
        w_qkv: var(&[16, 48], 12, 0.3, DType::F32),
        w_proj: var(&[16, 16], 13, 0.3, DType::F32),
        w_fc: var(&[16, 64], 14, 0.3, DType::F32),
        w_out: var(&[64, 16], 15, 0.3, DType::F32),
        g: var(&[16], 16, 1.0, DType::F32),
        b: var(&[16], 17, 0.1, DType::F32),
    };
    (x, p, causal_mask(8, DType::F32))
}

/// Bytes the statements of the live tapes hold (region inputs excluded).
fn tape_bytes() -> usize {
    MemoryReport::capture()
        .entries
        .iter()
        .filter(|e| e.policy.is_some())
        .map(|e| e.bytes)
        .sum()
}

#[test]
fn budget_plans_hold_what_the_planner_predicts_and_trade_time_for_memory() {
    let (x, p, mask) = open_block_setup();
    let y_ref = Plan::off()
        .scope(|| open_block(x.as_tensor(), &p, &mask))
        .unwrap();
    let g_ref = y_ref.sum_all().unwrap().backward().unwrap();
    // The previous (smaller) budget's choice: which statements it recomputed.
    let mut last: Option<Vec<(String, Policy)>> = None;
    for fraction in [0.0, 0.2, 0.4, 0.6, 0.8, 1.0] {
        let plan = Plan::budget(fraction);
        // The first call measures (saves everything open), the second one
        // follows the solution.
        for call in 0..2 {
            let y = plan.scope(|| open_block(x.as_tensor(), &p, &mask)).unwrap();
            let held = tape_bytes();
            let solution = plan
                .solutions()
                .pop()
                .expect("planned after the first call");
            if call == 0 {
                assert_eq!(
                    held, solution.max_bytes,
                    "the measuring call saves everything"
                );
            } else {
                // The cost model is exact: the tape holds what it predicted.
                assert_eq!(held, solution.bytes, "fraction {fraction}:\n{solution}");
                assert!(solution.bytes <= solution.budget);
            }
            let g = y.sum_all().unwrap().backward().unwrap();
            for v in [&x, &p.w_qkv, &p.w_proj, &p.w_fc, &p.w_out, &p.g, &p.b] {
                let d = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
                assert!(d <= 1e-6, "fraction {fraction}: {d}");
            }
        }
        let solution = &plan.solutions()[0];
        println!("{solution}");
        assert_eq!(solution.min_bytes, 0);
        if fraction == 0.0 {
            assert!(solution
                .statements
                .iter()
                .all(|s| s.policy == Policy::Recompute));
        }
        if fraction == 1.0 {
            assert_eq!(solution.recompute_seconds, 0.0);
        }
        // A larger budget never recomputes more: the smaller budget's choice
        // fits this one too (bytes are exact), so this one costs at most as
        // much. Both costed with this plan's own measured times (each plan
        // measures its own, and two measurements differ by the machine's
        // noise).
        let cost = |recomputed: &dyn Fn(&str) -> bool| -> f64 {
            solution
                .statements
                .iter()
                .filter(|s| recomputed(&s.name))
                .map(|s| s.seconds)
                .sum()
        };
        if let Some(previous) = &last {
            let before = cost(&|name| {
                previous
                    .iter()
                    .any(|(n, p)| n == name && *p == Policy::Recompute)
            });
            let now = cost(&|name| {
                solution
                    .statements
                    .iter()
                    .any(|s| s.name == name && s.policy == Policy::Recompute)
            });
            assert!(
                now <= before * (1.0 + 1e-9),
                "fraction {fraction}: {now} > {before}\n{solution}"
            );
        }
        last = Some(
            solution
                .statements
                .iter()
                .map(|s| (s.name.clone(), s.policy))
                .collect(),
        );
    }
}

#[test]
fn budget_plans_keep_annotations() {
    // `out` is declared saved, `g` declared recomputed in `mlp`: a zero
    // budget still saves `out` and a full one still recomputes `g`.
    let (x, p) = params();
    for (fraction, expected) in [(0.0, [R, R, R, S]), (1.0, [S, R, S, S])] {
        let plan = Plan::budget(fraction);
        for _ in 0..2 {
            let y = plan.scope(|| mlp(x.as_tensor(), &p)).unwrap();
            y.sum_all().unwrap().backward().unwrap();
        }
        let got: Vec<Option<Policy>> = plan.solutions()[0]
            .statements
            .iter()
            .map(|s| Some(s.policy))
            .collect();
        assert_eq!(got, expected, "fraction {fraction}");
    }
}

#[test]
fn byte_budgets_are_respected() {
    let (x, p, mask) = open_block_setup();
    let plan = Plan::budget_bytes(6000);
    for call in 0..2 {
        let y = plan.scope(|| open_block(x.as_tensor(), &p, &mask)).unwrap();
        if call == 1 {
            assert!(tape_bytes() <= 6000);
        }
        y.sum_all().unwrap().backward().unwrap();
    }
    let solution = &plan.solutions()[0];
    assert_eq!(solution.budget, 6000);
    assert!(solution.bytes <= 6000 && solution.bytes > 0, "{solution}");
}

remat! {
    /// A second block, whose statement `e` a plan may name.
    fn head(x: &Tensor) -> Result<Tensor> {
        let e = x.exp()?;
        Ok(e.sum_all()?)
    }
}

/// A name no statement has (a misspelling) is an error from the backward,
/// naming the region, the plan, the unknown name and the names a plan may
/// use; names found in different regions of one step are not.
#[test]
fn a_plan_naming_no_statement_is_an_error() {
    let (x, p) = params();
    let step = |plan: &Plan| {
        let y = plan.scope(|| head(&mlp(x.as_tensor(), &p)?))?;
        y.backward().map(|_| ())
    };
    // `h` is in `mlp`, `e` in `head`: both found.
    step(&Plan::save_only(["h", "e"])).unwrap();
    step(&Plan::save_and_offload_only(["o"], ["e"])).unwrap();
    for plan in [
        Plan::save_only(["h", "h_misspelt"]),
        Plan::save_and_offload_only(["e"], ["o_misspelt"]),
    ] {
        let e = step(&plan).unwrap_err().to_string();
        let unknown = if e.contains("\"h_misspelt\"") {
            "h_misspelt"
        } else {
            "o_misspelt"
        };
        assert!(e.contains(&format!("[\"{unknown}\"]")), "{e}");
        assert!(
            e.contains("region `head`") && e.contains(&plan.to_string()),
            "{e}"
        );
        // The names a plan may use: those of the statements that ran, and
        // of every `remat!` block of the program (this test binary's).
        for known in ["e", "g", "h", "o", "out", "(a, b)", "skipped_h"] {
            assert!(e.contains(&format!("\"{known}\"")), "{known}: {e}");
        }
        assert!(!e.contains("\"(return)\""), "{e}");
    }
    // The tapes of a failed backward are released, and the next step with
    // correct names works.
    step(&Plan::save_only(["h"])).unwrap();
    // A tuple's name is written as the block writes it.
    let pair_step = |plan: &Plan| {
        let y = plan.scope(|| pair(x.as_tensor(), &p))?;
        y.backward().map(|_| ())
    };
    pair_step(&Plan::save_only(["(a, b)"])).unwrap();
    let e = pair_step(&Plan::save_only(["(a,b)"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[\"(a,b)\"]") && e.contains("\"(a, b)\""), "{e}");
}

remat! {
    /// A layer a model runs on some steps only (enabled later, an expert no
    /// token reached, a tower for images in a text-only batch).
    fn skipped(x: &Tensor, p: &P) -> Result<Tensor> {
        let skipped_h = x.matmul(&p.w1)?;
        let skipped_o = skipped_h.tanh()?.matmul(&p.w2)?;
        Ok((skipped_o + x)?)
    }
}

/// A plan may name a statement of a block that did not run in its first
/// step: the block's names are known where it is compiled. When the block
/// runs in a later step, the plan saves the statement, and the gradients
/// equal plain candle's in every step.
#[test]
fn a_plan_may_name_a_statement_of_a_block_that_has_not_run_yet() {
    let (x, p) = params();
    let plan = Plan::save_only(["h", "skipped_h"]);
    let weights = tensor(&[4, 8], 9, 1.0, DType::F32);
    for with_layer in [false, true, false, true] {
        let forward = || -> Result<Tensor> {
            let y = mlp(x.as_tensor(), &p)?;
            let y = if with_layer { skipped(&y, &p)? } else { y };
            (y * &weights)?.sum_all()
        };
        let reference = Plan::off().scope(forward).unwrap();
        let g_ref = reference.backward().unwrap();
        let loss = plan.scope(forward).unwrap();
        let saved: Vec<String> = MemoryReport::capture()
            .entries
            .into_iter()
            .filter(|e| e.policy == S)
            .map(|e| e.statement)
            .collect();
        let expected: &[&str] = if with_layer {
            &["h", "out", "skipped_h"]
        } else {
            &["h", "out"]
        };
        assert_eq!(saved, expected, "with the layer: {with_layer}");
        assert_eq!(rel_diff(&loss, &reference), 0.0);
        let g = loss.backward().unwrap();
        for v in [&x, &p.w1, &p.w2] {
            let d = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
            assert!(d <= 1e-6, "with the layer: {with_layer}: {d}");
        }
    }
    // A name no block of the program has is still refused in that step.
    let typo = Plan::save_only(["skiped_h"]);
    let e = typo
        .scope(|| mlp(x.as_tensor(), &p)?.sum_all())
        .unwrap()
        .backward()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[\"skiped_h\"]") && e.contains("\"skipped_h\""),
        "{e}"
    );
}

remat! {
    /// A tuple statement, named `(a, b)`.
    fn pair(x: &Tensor, p: &P) -> Result<Tensor> {
        let (a, b) = (x.matmul(&p.w1)?, x.exp()?);
        let s = (a.sum_all()? + b.sum_all()?)?;
        Ok(s)
    }
}

remat! {
    /// Integer and boolean values made by statements that read values
    /// needing gradients: an index from `argmax`, a causal mask that reads
    /// `x` only for its device, and a comparison (which candle tracks, and
    /// whose backward it skips). Saved and recomputed statements read them.
    fn routed(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let h = x.matmul(w)?;
        let idx = h.argmax_keepdim(candle_core::D::Minus1)?;
        let n = h.dim(0)?;
        let causal = Tensor::tril2(n, DType::U8, x.device())?;
        let picked = h.gather(&idx, candle_core::D::Minus1)?;
        let masked = causal.where_cond(&h.sqr()?, &h)?;
        let positive = h.ge(0.0)?;
        let gate = positive.to_dtype(DType::F32)?;
        Ok(masked.broadcast_mul(&picked)?.broadcast_mul(&gate)?)
    }
}

#[test]
fn saved_statements_reading_integer_values_of_recomputed_ones_replay() {
    // A recomputed statement that reads a value needing gradients gives
    // integer outputs that carry none, in the forward as in the replay: a
    // saved statement reading them keeps no leaf of them, and a statement
    // reading only them gives values that need none (before, the replay
    // failed with `ReplayDesync` or `UndeclaredInput`).
    let x = var(&[6, 6], 1, 1.0, DType::F32);
    let w = var(&[6, 6], 2, 0.5, DType::F32);
    let weights = tensor(&[6, 6], 3, 1.0, DType::F32);
    let grads = |plan: &Plan| {
        let y = plan.scope(|| routed(x.as_tensor(), w.as_tensor())).unwrap();
        let g = (y * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        [g.get(&x).unwrap().clone(), g.get(&w).unwrap().clone()]
    };
    let reference = grads(&Plan::off());
    // The first plan runs the region's first forward on this thread, the
    // one that hands the block leaf copies to look for undeclared reads.
    for plan in [
        Plan::save_only(["picked", "masked"]),
        Plan::recompute_all(),
        Plan::save_all(),
        Plan::save_only(["picked"]),
        Plan::save_only(["masked"]),
        Plan::save_only(["idx", "masked"]),
        Plan::save_only(["positive"]),
        Plan::save_only(["positive", "gate", "picked"]),
    ] {
        for _ in 0..2 {
            for (a, b) in grads(&plan).iter().zip(&reference) {
                assert_eq!(rel_diff(a, b), 0.0, "{plan}");
            }
        }
    }
}

#[test]
fn every_plan_a_peak_profile_keeps_gives_plain_candle_s_gradients() {
    use remat_runtime::plan::PeakPlan;
    // Three calls of `mlp`: a plan that decides call by call saves `h` in
    // some calls only, and `g` (recomputed) then reads the saved `h`.
    let x = var(&[4, 8], 1, 1.0, DType::F32);
    let ps: Vec<P> = (0..3)
        .map(|i| P {
            w1: var(&[8, 16], 10 + i, 0.3, DType::F32),
            w2: var(&[16, 8], 20 + i, 0.3, DType::F32),
        })
        .collect();
    let weights = tensor(&[4, 8], 9, 1.0, DType::F32);
    let step = |plan: &Plan| -> remat_runtime::Result<(usize, Vec<Tensor>)> {
        let y = plan.scope(|| {
            let mut h = x.as_tensor().clone();
            for p in &ps {
                h = mlp(&h, p)?;
            }
            Ok::<_, remat_runtime::RematError>(h)
        })?;
        // A stand-in for a measured peak: the bytes the tapes hold, and
        // more than any of them for plain candle (whose graph holds all).
        let held = if plan.is_off() {
            1 << 30
        } else {
            MemoryReport::capture().total_bytes()
        };
        let g = (y * &weights)?.sum_all()?.backward()?;
        let mut grads = vec![g.get(&x).unwrap().clone()];
        for p in &ps {
            grads.push(g.get(&p.w1).unwrap().clone());
            grads.push(g.get(&p.w2).unwrap().clone());
        }
        Ok((held, grads))
    };
    let profile = PeakPlan::profile(|plan| Ok(step(plan)?.0)).unwrap();
    assert!(profile.candidates().len() >= 3, "{profile}");
    println!("{profile}");
    let (_, reference) = step(&Plan::off()).unwrap();
    for c in profile.candidates() {
        let (held, grads) = step(&c.plan).unwrap();
        assert_eq!(held, c.peak, "{}", c.plan);
        for (a, b) in grads.iter().zip(&reference) {
            let d = rel_diff(a, b);
            assert!(d <= 1e-6, "{}: {d:e}", c.plan);
        }
    }
    // Larger requests never get a plan that holds less.
    let mut last = 0;
    for c in profile.candidates() {
        let plan = profile.for_peak(c.peak).unwrap();
        let (held, _) = step(&plan).unwrap();
        assert!(held >= last && held <= c.peak);
        last = held;
    }
}

#[test]
fn a_saved_statement_returning_a_parameter_as_it_is_counts_its_gradient_once() {
    // `to_dtype` to its own dtype returns the parameter itself: the saved
    // output is the parameter, read again by recomputed statements in two
    // units.
    for dtype in [DType::F32, DType::F64] {
        let x = var(&[3], 1, 1.0, dtype);
        let w = var(&[3], 2, 0.5, dtype);
        let run = |plan: Plan| {
            let param = w.clone();
            let y = plan
                .scope(|| {
                    Region::new("r").run(&[x.as_tensor()], move |ctx, ins| {
                        let w = param.clone();
                        let wf = ctx.save("wf", &[], move |_| w.to_dtype(dtype))?;
                        let h1 = ctx.recompute("h1", &[&ins[0], &wf], |t| &t[0] * &t[1])?;
                        let s2 = ctx.save("s2", &[&h1], |t| t[0].sin())?;
                        let h2 = ctx.recompute("h2", &[&s2, &wf], |t| &t[0] * &t[1])?;
                        ctx.recompute("out", &[&h2], |t| t[0].sum_all())
                    })
                })
                .unwrap();
            let g = y.backward().unwrap();
            (g.get(&x).unwrap().clone(), g.get(&w).unwrap().clone())
        };
        let (gx, gw) = run(Plan::declared());
        let (rx, rw) = run(Plan::off());
        assert_eq!(rel_diff(&gw, &rw), 0.0, "{dtype:?}");
        assert_eq!(rel_diff(&gx, &rx), 0.0, "{dtype:?}");
    }
}

remat! {
    /// Two statements binding `h`, neither annotated.
    fn two_hs(x: &Tensor, p: &P) -> Result<Tensor> {
        let h = x.matmul(&p.w1)?;
        let g = h.tanh()?;
        let h = g.matmul(&p.w2)?;
        Ok(h)
    }
}

remat! {
    /// The same, with the second `h` saved and `g` named.
    fn two_hs_annotated(x: &Tensor, p: &P) -> Result<Tensor> {
        let h = x.matmul(&p.w1)?;
        #[recompute(name = "act")] let g = h.tanh()?;
        #[save] let h = g.matmul(&p.w2)?;
        Ok(h)
    }
}

/// Annotating or naming a statement renames no other: a plan listing `h`
/// and `h#2` points at the same statements in both blocks.
#[test]
fn annotating_a_statement_renames_no_other() {
    let (x, p) = params();
    let names = |block: &dyn Fn(&Tensor, &P) -> Result<Tensor>| {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        let plan = Plan::from_fn("names", move |s| {
            log.lock().unwrap().push(s.name.to_string());
            s.declared.unwrap_or(Policy::Recompute)
        });
        let y = plan.scope(|| block(x.as_tensor(), &p)).unwrap();
        y.sum_all().unwrap().backward().unwrap();
        let names = seen.lock().unwrap().clone();
        names
    };
    let (plain, annotated) = (names(&two_hs), names(&two_hs_annotated));
    assert_eq!(plain, ["h", "g", "h#2"], "{plain:?}");
    assert_eq!(annotated, ["h", "act", "h#2"], "{annotated:?}");
}

remat! {
    /// A parameter's tensor copied in a plain `let` and read by a saved
    /// statement.
    fn copied_weight(x: &Tensor, w: &Var) -> Result<Tensor> {
        let wt = w.as_tensor().clone();
        #[save] let h = x.matmul(&wt)?;
        let y = h.tanh()?;
        Ok(y)
    }
}

/// Budget plans over a block whose forced saves alone hold more than its
/// open statements saved too (a plain copy of a parameter read by a saved
/// statement): they plan, keep the annotation and give plain candle's
/// gradients, where they panicked with an overflow.
#[test]
fn budget_plans_where_saving_more_holds_less() {
    let x = var(&[3, 4], 133, 1.0, DType::F32);
    let w = var(&[4, 4], 134, 0.5, DType::F32);
    let weights = tensor(&[3, 4], 135, 1.0, DType::F32);
    let loss = |y: Tensor| (y * &weights)?.sum_all();
    let g_ref = Plan::off()
        .scope(|| loss(copied_weight(x.as_tensor(), &w)?))
        .unwrap()
        .backward()
        .unwrap();
    for fraction in [0.0, 0.5, 1.0] {
        let plan = Plan::budget(fraction);
        let g = plan
            .scope(|| loss(copied_weight(x.as_tensor(), &w)?))
            .unwrap()
            .backward()
            .unwrap();
        for v in [&x, &w] {
            let d = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
            assert!(d <= 1e-6, "budget({fraction}): {d}");
        }
        let solution = &plan.solutions()[0];
        assert!(
            solution.min_bytes <= solution.bytes
                && solution.bytes <= solution.budget.max(solution.min_bytes)
                && solution.budget <= solution.max_bytes,
            "{solution:?}"
        );
        // `h` is declared saved whatever the budget.
        let h = solution.statements.iter().find(|s| s.name == "h").unwrap();
        assert_eq!(h.policy, Policy::Save, "{solution:?}");
    }
}
