//! The peak of a full-recompute training step, broken down by source: what
//! `bench --explain-peak` prints.

use std::fmt;

use candle_core::{Result, Tensor};
use remat_runtime::Plan;

use crate::gpt::{
    block, block_composed, block_layers, causal_mask, embed, head_loss, head_loss_composed, Gpt,
    Ops,
};

/// A counting allocator's readings, as closures (the allocator is the
/// binary's global one).
pub struct Meter<'a> {
    /// Bytes allocated and not freed.
    pub live: &'a dyn Fn() -> usize,
    /// The highest `live` since the last reset.
    pub peak: &'a dyn Fn() -> usize,
    /// Restarts `peak` from `live`.
    pub reset: &'a dyn Fn(),
}

/// Exact bytes of each source of the peak.
#[derive(Debug, Clone, Copy)]
pub struct Breakdown {
    /// The peak of forward + backward over what was live before.
    pub peak: usize,
    /// The parameters' gradients (one per parameter, held to the end).
    pub parameter_gradients: usize,
    /// What the forward leaves between forward and backward: the regions'
    /// inputs (and the loss).
    pub region_inputs: usize,
    /// The graph one block's replay builds (its forward as plain candle).
    pub block_graph: usize,
    /// The graph of the head and loss region.
    pub head_graph: usize,
    /// The peak of one block's forward and backward as plain candle (its
    /// graph, the gradients flowing through it and the backward's
    /// temporaries): what sweeping one unit costs at most.
    pub block_step: usize,
}

impl Breakdown {
    /// What the listed sources do not cover: the gradients flowing through
    /// the unit being swept, its backward's temporaries, leaf copies.
    pub fn rest(&self) -> isize {
        self.peak as isize
            - (self.parameter_gradients
                + self.region_inputs
                + self.block_graph.max(self.head_graph)) as isize
    }
}

/// Measures `model`'s full-recompute step on `(ids, targets)`: the peak,
/// then each source on its own.
pub fn explain(model: &Gpt, ids: &Tensor, targets: &Tensor, m: &Meter) -> Result<Breakdown> {
    let step = || -> Result<(usize, usize)> {
        let before = (m.live)();
        (m.reset)();
        let loss = Plan::recompute_all().scope(|| model.loss(ids, targets))?;
        let held = (m.live)() - before;
        let grads = loss.backward()?;
        let peak = (m.peak)() - before;
        drop((loss, grads));
        Ok((held, peak))
    };
    step()?; // warm candle's caches
    let (region_inputs, peak) = step()?;
    let parameter_gradients = model
        .vars()
        .iter()
        .map(|v| v.elem_count() * v.dtype().size_in_bytes())
        .sum();
    // One block's and the head's graphs, built by their forwards as plain
    // candle (what a replay builds), on the real activations.
    let off = Plan::off();
    let x = off.scope(|| embed(ids, &model.wte, &model.wpe))?.detach();
    let mask = causal_mask(ids.dim(1)?, ids.device())?;
    let graph = |f: &dyn Fn(&Tensor) -> Result<Tensor>| -> Result<usize> {
        let input = candle_core::Var::from_tensor(&x)?;
        let before = (m.live)();
        let out = off.scope(|| f(input.as_tensor()))?;
        let bytes = (m.live)() - before;
        drop(out);
        Ok(bytes)
    };
    let p = &model.blocks[0];
    let block_graph = match model.ops {
        Ops::Fused => graph(&|x| block(x, p))?,
        Ops::Layers => graph(&|x| block_layers(x, p))?,
        Ops::Composed => graph(&|x| block_composed(x, p, &mask))?,
    };
    let block_step = {
        let input = candle_core::Var::from_tensor(&x)?;
        let before = (m.live)();
        (m.reset)();
        let out = off.scope(|| match model.ops {
            Ops::Fused => block(input.as_tensor(), p),
            Ops::Layers => block_layers(input.as_tensor(), p),
            Ops::Composed => block_composed(input.as_tensor(), p, &mask),
        })?;
        let grads = out.sum_all()?.backward()?;
        let peak = (m.peak)() - before;
        drop((out, grads));
        peak
    };
    let head_graph = match model.ops {
        Ops::Fused | Ops::Layers => graph(&|x| head_loss(x, &model.ln_f, &model.head, targets))?,
        Ops::Composed => graph(&|x| head_loss_composed(x, &model.ln_f, &model.head, targets))?,
    };
    Ok(Breakdown {
        peak,
        parameter_gradients,
        region_inputs,
        block_graph,
        head_graph,
        block_step,
    })
}

impl fmt::Display for Breakdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        let share = |b: usize| 100.0 * b as f64 / self.peak as f64;
        writeln!(f, "| source | bytes | MiB | share of the peak |")?;
        writeln!(f, "|---|---:|---:|---:|")?;
        for (name, b) in [
            (
                "parameter gradients (held to the end of the backward)",
                self.parameter_gradients,
            ),
            ("region inputs kept from the forward", self.region_inputs),
            (
                "the replayed graph of one block (one unit)",
                self.block_graph,
            ),
            ("(the graph of the head and loss region)", self.head_graph),
        ] {
            writeln!(f, "| {name} | {b} | {:.1} | {:.0}% |", mib(b), share(b))?;
        }
        let rest = self.rest();
        writeln!(
            f,
            "| the rest: gradients in flight through the unit, its backward's temporaries, leaf copies | {rest} | {:.1} | {:.0}% |",
            rest as f64 / (1024.0 * 1024.0),
            100.0 * rest as f64 / self.peak as f64
        )?;
        writeln!(
            f,
            "| **peak of the step** | {} | {:.1} | 100% |",
            self.peak,
            mib(self.peak)
        )?;
        writeln!(
            f,
            "| (for scale: one block's forward + backward as plain candle, its peak) | {} | {:.1} | {:.0}% |",
            self.block_step,
            mib(self.block_step),
            share(self.block_step)
        )
    }
}

/// The peak of a training step with its AdamW update (forward, backward,
/// update; the optimizer's state allocated by earlier steps), under plain
/// candle and full recomputation, the update after the backward (candle-nn's
/// `AdamW`) or inside it ([`remat_runtime::OptimizerInBackward`]).
pub struct WithUpdate {
    /// (plan, where the update runs, peak bytes over what was live before).
    pub rows: Vec<(&'static str, &'static str, usize)>,
}

/// Measures [`WithUpdate`] on `model` (whose weights it updates).
pub fn with_update(model: &Gpt, ids: &Tensor, targets: &Tensor, m: &Meter) -> Result<WithUpdate> {
    use candle_nn::{AdamW, Optimizer, ParamsAdamW};
    use remat_runtime::OptimizerInBackward;
    let mut rows = Vec::new();
    for (name, plan) in [("plain", Plan::off()), ("full", Plan::recompute_all())] {
        let mut after = AdamW::new(model.vars(), ParamsAdamW::default())?;
        let mut inside = OptimizerInBackward::<AdamW>::new(model.vars(), ParamsAdamW::default())
            .map_err(candle_core::Error::wrap)?;
        // Two steps first: the optimizers' state exists, and the first
        // step of `inside` (which finds the parameters read outside the
        // regions) is behind it.
        let mut peak_after = 0;
        let mut peak_inside = 0;
        for _ in 0..3 {
            let before = (m.live)();
            (m.reset)();
            let loss = plan.scope(|| model.loss(ids, targets))?;
            after.backward_step(&loss)?;
            drop(loss);
            peak_after = (m.peak)() - before;
            let before = (m.live)();
            (m.reset)();
            let loss = plan.scope(|| model.loss(ids, targets))?;
            inside
                .backward_step(&loss)
                .map_err(candle_core::Error::wrap)?;
            drop(loss);
            peak_inside = (m.peak)() - before;
        }
        rows.push((name, "after the backward (candle-nn AdamW)", peak_after));
        rows.push((
            name,
            "in the backward (OptimizerInBackward<AdamW>)",
            peak_inside,
        ));
    }
    Ok(WithUpdate { rows })
}

impl fmt::Display for WithUpdate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "| plan | update | peak (bytes) | peak (MiB) |")?;
        writeln!(f, "|---|---|---:|---:|")?;
        for (plan, update, peak) in &self.rows {
            writeln!(
                f,
                "| {plan} | {update} | {peak} | {:.1} |",
                *peak as f64 / (1024.0 * 1024.0)
            )?;
        }
        Ok(())
    }
}

/// A [`remat_runtime::plan::PeakPlan`] asked for peaks spread from full
/// recomputation's to plain candle's: what each request got.
pub struct PeakPlans {
    /// The candidates the profile kept.
    pub candidates: usize,
    /// The lowest peak among them, bytes.
    pub lowest: usize,
    /// The steps the profile ran.
    pub profiled: usize,
    /// (requested bytes, measured bytes, time vs plain, plan).
    pub rows: Vec<(usize, usize, f64, String)>,
}

/// Profiles `model`'s step with a `PeakPlan`, asks it for `requests` peaks
/// from full recomputation's to plain candle's, and measures each plan it
/// gives: its peak (one step after a warm-up) and its median step time over
/// `steps` steps, interleaved with plain candle's (each first in turn).
pub fn peak_plans(
    model: &Gpt,
    ids: &Tensor,
    targets: &Tensor,
    m: &Meter,
    requests: usize,
    steps: usize,
) -> Result<PeakPlans> {
    use remat_runtime::plan::PeakPlan;
    use std::time::Instant;
    let peak = |plan: &Plan| -> Result<usize> {
        let before = (m.live)();
        (m.reset)();
        let loss = plan.scope(|| model.loss(ids, targets))?;
        let grads = loss.backward()?;
        let peak = (m.peak)() - before;
        drop((loss, grads));
        Ok(peak)
    };
    let mut profiled = 0;
    let profile = PeakPlan::profile(|plan| {
        profiled += 1;
        peak(plan).map_err(Into::into)
    })
    .map_err(candle_core::Error::wrap)?;
    let full = {
        peak(&Plan::recompute_all())?;
        peak(&Plan::recompute_all())?
    };
    let plain = peak(&Plan::off())?;
    let seconds = |plan: &Plan| -> Result<f64> {
        let start = Instant::now();
        let loss = plan.scope(|| model.loss(ids, targets))?;
        loss.backward()?;
        Ok(start.elapsed().as_secs_f64())
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut rows = Vec::new();
    for i in 0..requests {
        let request = full + (plain.max(full) - full) * i / (requests - 1).max(1);
        let plan = profile
            .for_peak(request)
            .map_err(candle_core::Error::wrap)?;
        peak(&plan)?;
        let measured = peak(&plan)?;
        // Turn about (plain first, then the plan first), so that whatever
        // the second of two steps gains or loses falls on both alike.
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for i in 0..steps {
            if i % 2 == 0 {
                theirs.push(seconds(&Plan::off())?);
                ours.push(seconds(&plan)?);
            } else {
                ours.push(seconds(&plan)?);
                theirs.push(seconds(&Plan::off())?);
            }
        }
        rows.push((
            request,
            measured,
            median(ours) / median(theirs),
            plan.to_string(),
        ));
    }
    Ok(PeakPlans {
        candidates: profile.candidates().len(),
        lowest: profile.candidates()[0].peak,
        profiled,
        rows,
    })
}

impl fmt::Display for PeakPlans {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        writeln!(
            f,
            "| requested peak (MiB) | measured peak (MiB) | measured / requested | time vs plain | plan |"
        )?;
        writeln!(f, "|---:|---:|---:|---:|---|")?;
        for (request, measured, time, plan) in &self.rows {
            writeln!(
                f,
                "| {:.1} | {:.1} | {:.3} | {:.2}x | {plan} |",
                mib(*request),
                mib(*measured),
                *measured as f64 / *request as f64,
                time
            )?;
        }
        write!(
            f,
            "({} plans kept by the profile of {} steps, the lowest peaking at {:.1} MiB)",
            self.candidates,
            self.profiled,
            mib(self.lowest)
        )
    }
}
