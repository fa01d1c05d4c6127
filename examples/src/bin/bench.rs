//! Step time and exact memory of the example GPT under each checkpointing
//! policy, measured side by side in one process: the policies take turns
//! (ABCD ABCD ...) on the same weights and the same batch, so that machine
//! noise hits them alike. Memory comes from a counting global allocator
//! (exact bytes, CPU); on a GPU, from the device's memory pool (bytes in use after the
//! forward, its high-water mark over the step, exact to the allocation), with the host
//! bytes the step holds (offloaded residuals) in a column of their own.
//!
//! ```text
//! cargo run --release -p examples --bin bench [-- --steps 10 --out docs/bench]
//! ```
//!
//! Writes `results.csv`, `results.md` and `tradeoff.svg` into `--out`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Device};
use examples::cli::{device, Flags};
use examples::data::{default_text, Corpus};
use examples::gpt::{Checkpointing, Config, Gpt, Ops};
use examples::peak;
use examples::rng::Rng;
use plotters::prelude::*;
use remat_runtime::inspect::{
    device_memory_in_use, device_memory_peak, reset_device_memory_peak, CountingAlloc,
};
use remat_runtime::Plan;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

const USAGE: &str = "\
bench: step time and exact memory of the example GPT under each checkpointing policy

usage: cargo run --release -p examples --bin bench -- [flags]

  --layers N   [4]      --d-model N [256]   --heads N [4]
  --seq N      [128]    --batch N   [8]
  --steps N    measured steps per policy [20]
  --warmup N   unmeasured steps per policy first [2]
  --policies P,Q,..  which policies, starting with none
               [none,full,selective,save-all,budget=0.25,budget=0.5,budget=0.75];
               offload (selective's statements in host memory) is for GPUs
  --save A,B   also measure a plan saving these statements (e.g. qkv,fc)
  --unchecked P,Q  also measure these policies without the replay check by
               fingerprints (`remat_runtime::without_fingerprints`): its cost
  --device cpu|cuda [cpu]
  --dtype f32|bf16|f16  the parameters' and activations' dtype (the loss in
               f32; gradients compared with plain candle's in the same dtype) [f32]
  --checksum kernels|batches|composed  how the replay check checksums CUDA
               tensors: remat's kernels (one pass each), the same kernels
               several values a launch (`remat_runtime::inspect::checksum_batches`,
               not yet run on a GPU) or candle's kernels composed
               (`remat_runtime::inspect::checksum_kernels`) [kernels]
  --nn kernels|composed  how nn's ops run on CUDA: remat's fused kernels
               (attention, GELU's backward) or candle's kernels composed
               (`remat_runtime::nn::cuda_kernels`) [kernels]
  --peak-plan true  instead: a PeakPlan asked for 8 peaks from full
                  recomputation's to plain candle's, each plan's measured peak
                  and time (--steps steps, interleaved with plain candle)
  --explain-peak true  instead: the peak of a full-recompute step (first of
               --ops) broken down by source, exact bytes (CPU) [false]
  --profile true  instead: milliseconds per step of each nn op and of the
               replay check, region forward, replay and backward, by phase,
               under each policy (and each --unchecked), the device waited
               for around each (`remat_runtime::inspect::Profile`); writes
               profile.md into --out [false]
  --ops O,..   fused (remat_runtime::nn's ops, a sublayer per op), layers
               (nn's ops, a layer per op) and/or composed (candle's composed
               ops): every policy runs with each, the first is the
               reference (`none` of it is plain candle) [fused]
  --move-on-cpu true  offloaded residuals move out of the graph and back on a
               CPU too (what a GPU does; measures the bookkeeping) [false]
  --out DIR    where results.csv, results.md and tradeoff.svg go [docs/bench]
";

struct Variant {
    name: String,
    /// The model, with the ops this variant runs.
    model: Gpt,
    plan: Plan,
    /// The replay is checked by fingerprints (the default).
    checked: bool,
    times: Vec<f64>,
    /// Forward part of each measured step.
    forward: Vec<f64>,
    held: usize,
    /// Host bytes held after the forward, on a GPU.
    host: usize,
    peak: usize,
    loss: f32,
    /// Gradients of the last step (until compared with plain candle's),
    grad_diff: Option<Vec<candle_core::Tensor>>,
    /// then the largest relative difference to them.
    max_rel_diff: f64,
}

/// Largest |a - b| over largest |b|, over all parameters.
fn rel_diff(a: &[candle_core::Tensor], b: &[candle_core::Tensor]) -> candle_core::Result<f64> {
    let mut worst: f64 = 0.0;
    for (a, b) in a.iter().zip(b) {
        let (a, b) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
        let d = (&a - &b)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()?;
        let s = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
        worst = worst.max(if d == 0.0 { 0.0 } else { d / s.max(1e-30) });
    }
    Ok(worst)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut flags = Flags::from_env(USAGE)?;
    let layers = flags.get("layers", 4usize)?;
    let d_model = flags.get("d-model", 256usize)?;
    let heads = flags.get("heads", 4usize)?;
    let seq = flags.get("seq", 128usize)?;
    let batch = flags.get("batch", 8usize)?;
    let steps = flags.get("steps", 20usize)?.max(1);
    // At least one: a budget plan measures its regions on the first call.
    let warmup = flags.get("warmup", 2usize)?.max(1);
    let save: Option<String> = flags.opt("save")?;
    let unchecked: Option<String> = flags.opt("unchecked")?;
    let unchecked = unchecked
        .map(|u| {
            u.split(',')
                .map(|p| p.trim().parse::<Checkpointing>())
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?
        .unwrap_or_default();
    let policies: String = flags.get(
        "policies",
        "none,full,selective,save-all,budget=0.25,budget=0.5,budget=0.75".to_string(),
    )?;
    let policies = policies
        .split(',')
        .map(|p| p.trim().parse::<Checkpointing>())
        .collect::<Result<Vec<_>, _>>()?;
    if policies.first() != Some(&Checkpointing::None) {
        return Err("--policies must start with none: ratios are to plain candle".into());
    }
    let dev = device(&flags.get("device", "cpu".to_string())?)?;
    let out = flags.get("out", PathBuf::from("docs/bench"))?;
    let move_on_cpu = flags.get("move-on-cpu", false)?;
    let explain_peak = flags.get("explain-peak", false)?;
    let peak_plan = flags.get("peak-plan", false)?;
    let profile = flags.get("profile", false)?;
    let ops: String = flags.get("ops", "fused".to_string())?;
    let dtype = match flags.get("dtype", "f32".to_string())?.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => return Err(format!("--dtype {other}: f32, bf16 or f16").into()),
    };
    let checksum: String = flags.get("checksum", "kernels".to_string())?;
    match checksum.as_str() {
        "kernels" => remat_runtime::inspect::checksum_kernels(true),
        "batches" => {
            remat_runtime::inspect::checksum_kernels(true);
            remat_runtime::inspect::checksum_batches(true);
        }
        "composed" => remat_runtime::inspect::checksum_kernels(false),
        other => return Err(format!("--checksum {other}: kernels, batches or composed").into()),
    }
    let nn_kernels: String = flags.get("nn", "kernels".to_string())?;
    match nn_kernels.as_str() {
        "kernels" => remat_runtime::nn::cuda_kernels(true),
        "composed" => remat_runtime::nn::cuda_kernels(false),
        other => return Err(format!("--nn {other}: kernels or composed").into()),
    }
    let ops = ops
        .split(',')
        .map(|o| o.trim().parse::<Ops>())
        .collect::<Result<Vec<_>, _>>()?;
    flags.finish()?;

    let corpus = Corpus::new(&default_text());
    let config = Config {
        vocab: corpus.vocab_size(),
        layers,
        d_model,
        heads,
        seq,
    };
    let model = Gpt::new(config, &mut Rng::new(0), &dev)?.to_dtype(dtype)?;
    let (x, y) = Corpus::batch(&corpus.train, batch, seq, &mut Rng::new(1), &dev)?;
    // The first `--ops`, measured with the counting allocator: the
    // `--peak-plan` and `--explain-peak` modes.
    let mut m = model.clone();
    m.ops = ops[0];
    let meter = peak::Meter {
        live: &|| ALLOC.live(),
        peak: &|| ALLOC.peak(),
        reset: &|| ALLOC.reset_peak(),
    };
    if peak_plan {
        println!(
            "A PeakPlan on the GPT ({layers} layers, d_model {d_model}, {heads} heads, T {seq}, B {batch}, \
             {}, {} ops), asked for 8 peaks from full recomputation's to plain candle's:\n",
            dtype.as_str(),
            ops[0]
        );
        println!("{}", peak::peak_plans(&m, &x, &y, &meter, 8, steps.max(3))?);
        return Ok(());
    }
    if explain_peak {
        println!(
            "The peak of a full-recompute step (GPT {layers} layers, d_model {d_model}, {heads} heads, \
             T {seq}, B {batch}, {}, {} ops), by source:\n",
            dtype.as_str(),
            ops[0]
        );
        print!("{}", peak::explain(&m, &x, &y, &meter)?);
        println!("\nThe peak of a training step with its AdamW update, the update after or in the backward:\n");
        print!("{}", peak::with_update(&m, &x, &y, &meter)?);
        return Ok(());
    }

    if profile {
        let named = policies
            .iter()
            .map(|c| (c.to_string(), c.plan(), true))
            .chain(
                unchecked
                    .iter()
                    .map(|c| (format!("{c} (unchecked)"), c.plan(), false)),
            )
            .map(|(name, plan, checked)| examples::profile::Policy {
                name,
                plan,
                checked,
            })
            .collect::<Vec<_>>();
        let header = format!(
            "Milliseconds per step by op and phase (GPT {layers} layers, d_model {d_model}, {heads} heads, \
             T {seq}, B {batch}, {}, {}, {} ops{}; {warmup} warm-up + {steps} profiled steps each):",
            dtype.as_str(),
            device_name(&dev),
            ops[0],
            match (dev.is_cpu(), checksum.as_str()) {
                (true, _) => "",
                (false, "kernels") => ", replay check by remat's checksum kernels",
                (false, "batches") => ", replay check by remat's checksum kernels in batches",
                (false, _) => ", replay check by candle's kernels composed",
            }
        );
        let table = examples::profile::table(&m, &x, &y, &dev, &named, warmup, steps)?;
        let md = format!("{header}\n\n{table}");
        print!("{md}");
        std::fs::create_dir_all(&out)?;
        std::fs::write(out.join("profile.md"), md)?;
        return Ok(());
    }

    let mut variants: Vec<Variant> = Vec::new();
    for (k, &o) in ops.iter().enumerate() {
        let suffix = if k == 0 {
            String::new()
        } else {
            format!(" ({o})")
        };
        let mut m = model.clone();
        m.ops = o;
        let named = policies
            .iter()
            .map(|c| (c.to_string(), c.plan(), true))
            .chain(save.iter().map(|s| {
                let names: Vec<String> = s.split(',').map(|n| n.trim().to_string()).collect();
                (
                    format!("save {}", names.join("+")),
                    Plan::save_only(names),
                    true,
                )
            }))
            .chain(
                unchecked
                    .iter()
                    .map(|c| (format!("{c} (unchecked)"), c.plan(), false)),
            );
        variants.extend(named.map(|(name, plan, checked)| Variant {
            name: format!("{name}{suffix}"),
            model: m.clone(),
            plan,
            checked,
            times: Vec::new(),
            forward: Vec::new(),
            held: 0,
            host: 0,
            peak: 0,
            loss: 0.0,
            grad_diff: None,
            max_rel_diff: 0.0,
        }));
    }

    let malloc: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("MALLOC_"))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let header = format!(
        "GPT {layers} layers, d_model {d_model}, {heads} heads, T {seq}, B {batch}, {}, {}; \
         {warmup} warm-up + {steps} measured steps per policy, interleaved; allocator: {}{}",
        dtype.as_str(),
        device_name(&dev),
        if malloc.is_empty() {
            "glibc defaults".to_string()
        } else {
            malloc.join(" ")
        },
        match (dev.is_cpu(), checksum.as_str()) {
            (true, _) => "",
            (false, "kernels") => "; replay check by remat's checksum kernels",
            (false, "batches") => "; replay check by remat's checksum kernels in batches",
            (false, _) => "; replay check by candle's kernels composed",
        }
    );
    println!("{header}");
    let vars = model.vars();
    let n = variants.len();
    let mut reference: Option<Vec<candle_core::Tensor>> = None;
    let bar = indicatif::ProgressBar::new((warmup + steps) as u64);
    for round in 0..warmup + steps {
        bar.inc(1);
        // Rotate who goes first: ABCD, BCDA, ...
        for i in 0..n {
            let v = &mut variants[(round + i) % n];
            let before = ALLOC.live();
            let device_before = device_memory_in_use(&dev)?;
            reset_device_memory_peak(&dev)?;
            // Right after a reset the mark is what is in use now.
            let device_peak_before = device_memory_peak(&dev)?;
            ALLOC.reset_peak();
            let start = Instant::now();
            let checked = v.checked;
            let forward_pass = || {
                let run = || v.plan.scope(|| v.model.loss(&x, &y));
                if checked {
                    run()
                } else {
                    remat_runtime::without_fingerprints(run)
                }
            };
            let loss = if move_on_cpu {
                remat_runtime::offload::swap_on_cpu(forward_pass)?
            } else {
                forward_pass()?
            };
            dev.synchronize()?;
            let forward = start.elapsed().as_secs_f64();
            // On a GPU, what the device holds (driver figures; the host's
            // counting allocator sees none of it, but sees offloaded bytes).
            let host = ALLOC.live().saturating_sub(before);
            let held = match (device_before, device_memory_in_use(&dev)?) {
                (Some(b), Some(a)) => a.saturating_sub(b),
                _ => host,
            };
            let grads = loss.backward()?;
            dev.synchronize()?;
            let elapsed = start.elapsed().as_secs_f64();
            let peak = match (device_peak_before, device_memory_peak(&dev)?) {
                (Some(b), Some(a)) => a.saturating_sub(b),
                _ => ALLOC.peak().saturating_sub(before),
            };
            v.loss = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
            if round == warmup + steps - 1 {
                // Gradients against plain candle's (the first variant).
                let g: Vec<candle_core::Tensor> = vars
                    .iter()
                    .map(|p| grads.get(p).cloned().ok_or("a parameter got no gradient"))
                    .collect::<Result<_, _>>()?;
                match &reference {
                    None if v.name == "none" => reference = Some(g),
                    _ => v.grad_diff = Some(g),
                }
            }
            drop((loss, grads));
            if round >= warmup {
                v.times.push(elapsed);
                v.forward.push(forward);
            }
            // Exact and the same every step; keep the last.
            v.held = held;
            v.host = host;
            v.peak = peak;
        }
    }

    bar.finish_and_clear();
    let reference = reference.ok_or("plain candle did not run")?;
    for v in variants.iter_mut() {
        if let Some(g) = v.grad_diff.take() {
            v.max_rel_diff = rel_diff(&g, &reference)?;
        }
    }
    let base = &variants[0];
    let (t0, h0, p0) = (median(&base.times), base.held as f64, base.peak as f64);
    let mut csv = String::from(
        "policy,median_step_s,median_forward_s,time_ratio,held_bytes,held_ratio,peak_bytes,peak_ratio,loss,grad_max_rel_diff,host_held_bytes\n",
    );
    let gpu = !dev.is_cpu();
    let mut md = format!("{header}\n\n");
    md.push_str(if gpu {
        "| policy | step (ms, median) | forward (ms) | time vs plain | held on device after forward (MiB) | held vs plain | peak fwd+bwd, device pool (MiB) | peak vs plain | max grad rel. diff | held on host (MiB) |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    } else {
        "| policy | step (ms, median) | forward (ms) | time vs plain | held after forward (MiB) | held vs plain | peak fwd+bwd (MiB) | peak vs plain | max grad rel. diff |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    });
    for v in &variants {
        let t = median(&v.times);
        writeln!(
            csv,
            "{},{t:.6},{:.6},{:.4},{},{:.4},{},{:.4},{},{:e},{}",
            v.name,
            median(&v.forward),
            t / t0,
            v.held,
            v.held as f64 / h0,
            v.peak,
            v.peak as f64 / p0,
            v.loss,
            v.max_rel_diff,
            if gpu { v.host } else { v.held }
        )?;
        writeln!(
            md,
            "| {} | {:.1} | {:.1} | {:.2}x | {:.1} | {:.3}x | {:.1} | {:.3}x | {:.1e} |{}",
            v.name,
            t * 1e3,
            median(&v.forward) * 1e3,
            t / t0,
            mib(v.held),
            v.held as f64 / h0,
            mib(v.peak),
            v.peak as f64 / p0,
            v.max_rel_diff,
            if gpu {
                format!(" {:.1} |", mib(v.host))
            } else {
                String::new()
            }
        )?;
    }
    print!("{md}");
    let same_loss = variants.iter().all(|v| v.loss == base.loss);
    println!(
        "loss {} under every policy{}",
        base.loss,
        if same_loss {
            ""
        } else {
            " (DIFFERS: investigate)"
        }
    );
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("results.csv"), csv)?;
    std::fs::write(out.join("results.md"), md)?;
    plot(
        &variants,
        t0,
        &out.join("tradeoff.svg"),
        &format!(
            "GPT {layers}x{d_model}, T {seq}, B {batch}: step time vs memory held after forward"
        ),
    )?;
    println!("wrote {}", out.display());
    Ok(())
}

fn device_name(dev: &Device) -> String {
    match dev {
        Device::Cpu => format!(
            "CPU ({} threads)",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        ),
        other => format!("{:?}", other.location()),
    }
}

/// Step time (relative to plain) against memory held after the forward, one
/// labelled point per policy, with the Pareto front drawn through them.
fn plot(
    variants: &[Variant],
    t0: f64,
    path: &std::path::Path,
    title: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let points: Vec<(f64, f64, &str)> = variants
        .iter()
        .map(|v| (mib(v.held), median(&v.times) / t0, v.name.as_str()))
        .collect();
    let xmax = points.iter().map(|p| p.0).fold(0.0, f64::max) * 1.15;
    let ymin = points.iter().map(|p| p.1).fold(f64::MAX, f64::min).min(1.0) * 0.95;
    let ymax = points.iter().map(|p| p.1).fold(0.0, f64::max).max(1.0) * 1.05;
    let root = SVGBackend::new(path, (720, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..xmax, ymin..ymax)?;
    chart
        .configure_mesh()
        .x_desc("memory held after forward (MiB)")
        .y_desc("step time / plain candle")
        .draw()?;
    let mut front: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| {
            !points
                .iter()
                .any(|q| q.0 <= p.0 && q.1 <= p.1 && (q.0 < p.0 || q.1 < p.1))
        })
        .map(|p| (p.0, p.1))
        .collect();
    front.sort_by(|a, b| a.0.total_cmp(&b.0));
    chart.draw_series(LineSeries::new(front, BLUE.mix(0.5).stroke_width(2)))?;
    for (x, y, name) in &points {
        chart.draw_series(std::iter::once(Circle::new((*x, *y), 5, RED.filled())))?;
        chart.draw_series(std::iter::once(Text::new(
            name.to_string(),
            (*x, *y),
            ("sans-serif", 14).into_font(),
        )))?;
    }
    root.present()?;
    Ok(())
}
