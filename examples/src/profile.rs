//! Where a training step's time goes, by `nn` op and phase, under each
//! policy: what `bench --profile` prints.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Instant;

use candle_core::{Device, Tensor};
use remat_runtime::inspect::{Phase, Profile};
use remat_runtime::Plan;

use crate::gpt::Gpt;

/// One policy to profile: its name, its plan, and whether the replay is
/// checked by fingerprints.
pub struct Policy {
    /// As the bench names it (`full (unchecked)`).
    pub name: String,
    /// The plan its steps run under.
    pub plan: Plan,
    /// The replay check is on (the default).
    pub checked: bool,
}

/// A Markdown table of milliseconds per step: one row per (what, phase),
/// one column per policy, then each step's own time (profiled: the waits
/// included) and the time outside every scope (candle's ops outside `nn`
/// and regions, and their backward). Each policy runs `warmup` unprofiled
/// steps, then `steps` profiled ones (the mean is reported).
pub fn table(
    model: &Gpt,
    x: &Tensor,
    y: &Tensor,
    dev: &Device,
    policies: &[Policy],
    warmup: usize,
    steps: usize,
) -> Result<String, Box<dyn std::error::Error>> {
    let step = |p: &Policy| -> Result<(), Box<dyn std::error::Error>> {
        let run = || p.plan.scope(|| model.loss(x, y));
        let loss = if p.checked {
            run()?
        } else {
            remat_runtime::without_fingerprints(run)?
        };
        drop(loss.backward()?);
        Ok(())
    };
    // (what, phase) -> ms per step, per policy.
    let mut rows: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    let mut totals = Vec::new();
    for (k, p) in policies.iter().enumerate() {
        for _ in 0..warmup {
            step(p)?;
        }
        let mut wall = 0.0;
        let mut profiled = 0.0;
        for _ in 0..steps {
            dev.synchronize()?;
            let start = Instant::now();
            let (done, profile) = Profile::record(dev, || step(p))?;
            done?;
            dev.synchronize()?;
            wall += start.elapsed().as_secs_f64();
            profiled += profile.total();
            for r in &profile.rows {
                let key = (r.what.to_string(), phase(r.phase).to_string());
                let v = rows.entry(key).or_insert_with(|| vec![0.0; policies.len()]);
                v[k] += r.seconds * 1e3 / steps as f64;
            }
        }
        totals.push((wall * 1e3 / steps as f64, profiled * 1e3 / steps as f64));
    }
    let mut md = String::from("| what | phase |");
    for p in policies {
        write!(md, " {} (ms) |", p.name)?;
    }
    md.push_str("\n|---|---|");
    md.push_str(&"---:|".repeat(policies.len()));
    md.push('\n');
    // Longest first, by the first policy that is not plain.
    let col = policies.len().min(2) - 1;
    let mut sorted: Vec<_> = rows.into_iter().collect();
    sorted.sort_by(|a, b| b.1[col].total_cmp(&a.1[col]));
    for ((what, phase), ms) in sorted {
        write!(md, "| {what} | {phase} |")?;
        for v in ms {
            write!(md, " {v:.1} |")?;
        }
        md.push('\n');
    }
    md.push_str(
        "| outside the scopes: candle's ops outside `nn` and regions, their backward | all |",
    );
    for (wall, profiled) in &totals {
        write!(md, " {:.1} |", wall - profiled)?;
    }
    md.push_str("\n| **step, profiled** (a wait on the device around each scope) | all |");
    for (wall, _) in &totals {
        write!(md, " **{wall:.1}** |")?;
    }
    md.push('\n');
    Ok(md)
}

fn phase(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "forward",
        Phase::Replay => "replay",
        Phase::Backward => "backward",
        _ => "other",
    }
}
