//! Trains a stack of residual MLP blocks on a toy regression task three ways
//! (plain candle, full recompute, save the matmuls) and prints, for each, the
//! loss curve, the bytes held after the forward and the peak bytes of a step,
//! measured exactly with a counting allocator, and the memory report of the
//! checkpointed tapes by statement name.
//!
//! ```text
//! cargo run --release -p examples --bin mlp_stack [-- --blocks 8 --steps 30]
//! ```

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use remat_runtime::inspect::CountingAlloc;
use remat_runtime::{Ctx, MemoryReport, Policy, Region};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

#[derive(Clone)]
struct Block {
    w1: Var,
    b1: Var,
    w2: Var,
    b2: Var,
}

impl Block {
    fn new(d: usize, hidden: usize, dev: &Device) -> candle_core::Result<Self> {
        let s1 = (1.0 / d as f64).sqrt();
        let s2 = 0.5 * (1.0 / hidden as f64).sqrt();
        Ok(Block {
            w1: Var::randn(0f32, s1 as f32, (d, hidden), dev)?,
            b1: Var::zeros(hidden, DType::F32, dev)?,
            w2: Var::randn(0f32, s2 as f32, (hidden, d), dev)?,
            b2: Var::zeros(d, DType::F32, dev)?,
        })
    }

    fn vars(&self) -> Vec<Var> {
        vec![
            self.w1.clone(),
            self.b1.clone(),
            self.w2.clone(),
            self.b2.clone(),
        ]
    }

    /// `x + W2 gelu(W1 x + b1) + b2`, statement by statement.
    fn body(&self, ctx: &mut Ctx, x: &Tensor, save_matmuls: bool) -> remat_runtime::Result<Tensor> {
        let mm = if save_matmuls {
            Policy::Save
        } else {
            Policy::Recompute
        };
        let h = ctx.statement("fc1", mm, &[x], |t| {
            t[0].matmul(&self.w1)?.broadcast_add(&self.b1)
        })?;
        let g = ctx.recompute("gelu", &[&h], |t| t[0].gelu_erf())?;
        let o = ctx.statement("fc2", mm, &[&g], |t| {
            t[0].matmul(&self.w2)?.broadcast_add(&self.b2)
        })?;
        ctx.recompute("residual", &[x, &o], |t| &t[0] + &t[1])
    }
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    Plain,
    FullRecompute,
    SaveMatmuls,
}

fn forward(blocks: &[Arc<Block>], x: &Tensor, mode: Mode) -> remat_runtime::Result<Tensor> {
    let mut h = x.clone();
    for (i, b) in blocks.iter().enumerate() {
        let b = b.clone();
        let save = matches!(mode, Mode::SaveMatmuls);
        h = Region::new(format!("block.{i}"))
            .enabled(!matches!(mode, Mode::Plain))
            .run(&[&h], move |ctx, ins| b.body(ctx, &ins[0], save))?;
    }
    Ok(h)
}

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> remat_runtime::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let n_blocks = arg(&args, "--blocks", 8);
    let steps = arg(&args, "--steps", 30);
    let (batch, d, hidden) = (64, 128, 512);
    let dev = Device::Cpu;

    // Toy task: regress a fixed random nonlinear function of the input.
    let x = Tensor::randn(0f32, 1.0, (batch, d), &dev)?;
    let target = x.matmul(&Tensor::randn(0f32, 0.2, (d, d), &dev)?)?.tanh()?;
    let init: Vec<Block> = (0..n_blocks)
        .map(|_| Block::new(d, hidden, &dev))
        .collect::<candle_core::Result<_>>()?;

    println!("{n_blocks} residual MLP blocks, batch {batch}, d {d}, hidden {hidden}, f32, {steps} SGD steps\n");
    let mut rows = Vec::new();
    for mode in [Mode::Plain, Mode::FullRecompute, Mode::SaveMatmuls] {
        // Same initial weights for every mode.
        let blocks: Vec<Arc<Block>> = init
            .iter()
            .map(|b| -> candle_core::Result<Arc<Block>> {
                let copy = |v: &Var| Var::from_tensor(&v.as_tensor().copy()?);
                Ok(Arc::new(Block {
                    w1: copy(&b.w1)?,
                    b1: copy(&b.b1)?,
                    w2: copy(&b.w2)?,
                    b2: copy(&b.b2)?,
                }))
            })
            .collect::<candle_core::Result<_>>()?;
        let vars: Vec<Var> = blocks.iter().flat_map(|b| b.vars()).collect();
        let mut opt = candle_nn::SGD::new(vars, 0.05)?;
        let (mut first, mut last, mut held, mut peak) = (0f32, 0f32, 0usize, 0usize);
        for step in 0..steps {
            let base = ALLOC.live();
            ALLOC.reset_peak();
            let y = forward(&blocks, &x, mode)?;
            let loss = (&y - &target)?.sqr()?.mean_all()?;
            if step == 1 {
                held = ALLOC.live() - base;
                if matches!(mode, Mode::SaveMatmuls) {
                    println!(
                        "memory report after the forward ({mode:?}):\n{}\n",
                        MemoryReport::capture()
                    );
                }
            }
            opt.backward_step(&loss)?;
            let l = loss.to_scalar::<f32>()?;
            if step == 0 {
                first = l;
            }
            last = l;
            if step == 1 {
                peak = ALLOC.peak() - base;
            }
        }
        rows.push((mode, first, last, held, peak));
    }
    println!(
        "{:<15} {:>10} {:>10} {:>16} {:>16}",
        "mode", "loss[0]", "loss[end]", "held after fwd", "peak of a step"
    );
    let (plain_held, plain_peak) = (rows[0].3 as f64, rows[0].4 as f64);
    for (mode, first, last, held, peak) in rows {
        println!(
            "{:<15} {first:>10.5} {last:>10.5} {:>9} ({:.2}x) {:>9} ({:.2}x)",
            format!("{mode:?}"),
            held,
            held as f64 / plain_held,
            peak,
            peak as f64 / plain_peak
        );
    }
    Ok(())
}
