//! Soak: many training steps of the example GPT under each policy, with the
//! bytes live after every step from a counting allocator. Writes
//! `soak.csv`, `soak.md` and `soak.svg` into `--out`.
//!
//! ```text
//! cargo run --release -p examples --bin soak [-- --steps 1000 --out docs/soak]
//! ```

use std::fmt::Write as _;
use std::path::PathBuf;

use examples::cli::Flags;
use examples::data::{default_text, Corpus};
use examples::gpt::Checkpointing;
use examples::soak::{soak, Shape};
use remat_runtime::inspect::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

const USAGE: &str = "\
soak: bytes live after each of many training steps, per policy

usage: cargo run --release -p examples --bin soak -- [flags]

  --steps N [1000]   --layers N [2]   --d-model N [64]   --heads N [4]
  --seq N [32]       --batch N [8]    --out DIR [docs/soak]
";

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut flags = Flags::from_env(USAGE)?;
    let steps = flags.get("steps", 1000usize)?.max(20);
    let shape = Shape {
        layers: flags.get("layers", 2)?,
        d_model: flags.get("d-model", 64)?,
        heads: flags.get("heads", 4)?,
        seq: flags.get("seq", 32)?,
        batch: flags.get("batch", 8)?,
    };
    let out = flags.get("out", PathBuf::from("docs/soak"))?;
    flags.finish()?;
    let corpus = Corpus::new(&default_text());
    let policies = [
        Checkpointing::None,
        Checkpointing::Full,
        Checkpointing::Selective,
        Checkpointing::SaveAll,
        Checkpointing::Budget(0.5),
    ];
    let mut curves = Vec::new();
    for p in policies {
        let live = soak(&corpus, shape, p, steps, &ALLOC)?;
        println!("{p}: {} steps", live.len());
        curves.push((p.to_string(), live));
    }
    let mut csv = format!(
        "step,{}\n",
        curves
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(",")
    );
    for s in 0..steps {
        let row: Vec<String> = curves.iter().map(|(_, l)| l[s].to_string()).collect();
        writeln!(csv, "{},{}", s + 1, row.join(","))?;
    }
    let mut md = format!(
        "{steps} steps per policy; GPT {} layers, d_model {}, {} heads, T {}, B {}; bytes live \
         after each step (weights, AdamW state, caches), from a counting allocator.\n\n\
         | policy | after step 10 | min, steps 10..{steps} | max, steps 10..{steps} | after step {steps} | growth after step 10 |\n\
         |---|---:|---:|---:|---:|---:|\n",
        shape.layers, shape.d_model, shape.heads, shape.seq, shape.batch
    );
    for (name, live) in &curves {
        let tail = &live[9..];
        let (min, max) = (tail.iter().min().unwrap(), tail.iter().max().unwrap());
        writeln!(
            md,
            "| {name} | {} | {min} | {max} | {} | {} |",
            live[9],
            live[steps - 1],
            live[steps - 1] as i64 - live[9] as i64
        )?;
    }
    print!("{md}");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("soak.csv"), csv)?;
    std::fs::write(out.join("soak.md"), &md)?;
    plot(&curves, &out.join("soak.svg"))?;
    println!("wrote {}", out.display());
    Ok(())
}

/// The live bytes of each policy after each step, in KiB.
fn plot(
    curves: &[(String, Vec<usize>)],
    path: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    let runs: Vec<(String, Vec<f64>)> = curves
        .iter()
        .map(|(name, live)| {
            (
                name.clone(),
                live.iter().map(|&b| b as f64 / 1024.0).collect(),
            )
        })
        .collect();
    let top = runs
        .iter()
        .flat_map(|(_, l)| l.iter().copied())
        .fold(0.0, f64::max)
        * 1.1;
    examples::curves::plot_steps(
        path,
        "bytes live after each training step",
        "live KiB",
        0.0..top,
        &runs,
    )
}
