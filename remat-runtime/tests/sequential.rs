//! `checkpoint_sequential`: gradients equal plain candle's, and the memory
//! held after the forward is exactly one block input per segment, with the
//! peak following `k * input + (N / k) * activations` (exact bytes from a
//! counting allocator; one test function, since the allocator is global).

mod common;

use candle_core::{DType, Tensor, Var};
use common::*;
use remat_runtime::inspect::CountingAlloc;
use remat_runtime::{checkpoint_sequential, MemoryReport, Plan};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

const N: usize = 16;
const BATCH: usize = 16;
const D: usize = 32;
const HIDDEN: usize = 128;

type Block = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

fn blocks(ws: &[(Var, Var)]) -> Vec<Block> {
    ws.iter()
        .map(|(w1, w2)| {
            let (w1, w2) = (w1.as_tensor().clone(), w2.as_tensor().clone());
            Box::new(move |x: &Tensor| x + x.matmul(&w1)?.gelu_erf()?.matmul(&w2)?) as Block
        })
        .collect()
}

struct Measured {
    held: usize,
    tape: usize,
    peak: usize,
    grads: Vec<Tensor>,
}

fn step(ws: &[(Var, Var)], x: &Var, segments: Option<usize>) -> Measured {
    let base = ALLOC.live();
    ALLOC.reset_peak();
    let y = match segments {
        Some(k) => checkpoint_sequential("stack", k, x.as_tensor(), blocks(ws)).unwrap(),
        None => {
            let mut h = x.as_tensor().clone();
            for b in blocks(ws) {
                h = b(&h).unwrap();
            }
            h
        }
    };
    let loss = y.sum_all().unwrap();
    let held = ALLOC.live() - base;
    let tape = MemoryReport::capture().total_bytes();
    let g = loss.backward().unwrap();
    let grads = ws
        .iter()
        .flat_map(|(a, b)| [a, b])
        .chain([x])
        .map(|v| g.get(v).unwrap().clone())
        .collect();
    drop((g, loss, y));
    Measured {
        held,
        tape,
        peak: ALLOC.peak() - base,
        grads,
    }
}

#[test]
fn segments_hold_one_input_each_and_trade_peak_for_count() {
    let ws: Vec<(Var, Var)> = (0..N as u64)
        .map(|i| {
            (
                var(&[D, HIDDEN], 10 * i, 0.2, DType::F32),
                var(&[HIDDEN, D], 10 * i + 1, 0.1, DType::F32),
            )
        })
        .collect();
    let x = var(&[BATCH, D], 999, 1.0, DType::F32);
    let input = BATCH * D * 4;
    // Warm candle's lazily created pools and caches, and the runtime's
    // record of the regions each segment count names (their first forward
    // runs on leaves).
    step(&ws, &x, None);
    // The process's first checkpointed call makes the runtime's lazily
    // created state: under another name, so that each count's first forward
    // below is its regions' first.
    let warm = checkpoint_sequential("warm", 2, x.as_tensor(), blocks(&ws)).unwrap();
    drop(warm.sum_all().unwrap().backward().unwrap());
    let firsts: Vec<usize> = [1, 2, 4, 8, 16]
        .iter()
        .map(|&k| step(&ws, &x, Some(k)).held)
        .collect();
    let plain = step(&ws, &x, None);
    println!("plain: held {} peak {}", plain.held, plain.peak);
    let mut peaks = Vec::new();
    for k in [1, 2, 4, 8, 16] {
        let m = step(&ws, &x, Some(k));
        println!(
            "{k:>2} segments: held {:>8} (tape {:>6}), peak {:>8}",
            m.held, m.tape, m.peak
        );
        // The tapes hold the segments' inputs, nothing else.
        assert_eq!(m.tape, k * input, "{k} segments");
        // So does the first forward of each segment's region (which runs
        // its statements on leaf copies, for that run only): beyond a later
        // forward, only the runtime's note of the regions' names.
        let first = firsts[k.trailing_zeros() as usize];
        assert!(
            first <= m.held + 2048,
            "{k} segments: the first forward held {first}, a later one {}",
            m.held
        );
        // The final output and bookkeeping (records, closures, anchors) on
        // top: under 1 KiB per statement and 4 KiB per segment.
        let bound = m.tape + input + N * 1024 + k * 4096;
        assert!(m.held >= m.tape + input && m.held <= bound, "{k} segments");
        for (a, b) in m.grads.iter().zip(&plain.grads) {
            // One block per statement: the sweep sums nothing differently.
            assert_eq!(rel_diff(a, b), 0.0, "{k} segments");
        }
        peaks.push((k, m.peak));
    }
    // One segment replays the whole stack at once: plain's peak plus
    // bookkeeping. More segments peak lower.
    assert!(peaks.iter().skip(1).all(|&(_, p)| p < plain.peak));

    // The sqrt(N) trade-off, where each block keeps one activation of the
    // input's size (`tanh`): k segments keep k inputs, and the backward
    // replays N/k blocks at a time, so the peak above the inputs follows
    // k + N/k (in inputs) and is lowest at k = sqrt(N) = 4.
    let tanh_step = |k: usize| {
        let base = ALLOC.live();
        ALLOC.reset_peak();
        let blocks = (0..N).map(|_| |x: &Tensor| x.tanh());
        let y = checkpoint_sequential("tanh", k, x.as_tensor(), blocks).unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        drop((g, y));
        ALLOC.peak() - base
    };
    for k in [1, 2, 4, 8, 16] {
        tanh_step(k);
    }
    let tanh_peaks: Vec<(usize, usize)> = [1, 2, 4, 8, 16]
        .iter()
        .map(|&k| (k, tanh_step(k)))
        .collect();
    println!("tanh stack peaks: {tanh_peaks:?}");
    let best = tanh_peaks.iter().min_by_key(|&&(_, p)| p).unwrap().0;
    assert_eq!(best, 4);
    // And the differences between neighbours follow k + N/k, to within the
    // bookkeeping of the extra segments (under 4 KiB each).
    for w in tanh_peaks.windows(2) {
        let ((k1, p1), (k2, p2)) = (w[0], w[1]);
        let predicted = (k2 + N / k2) as i64 - (k1 + N / k1) as i64;
        let measured = p2 as i64 - p1 as i64;
        let slack = (4096 * (k2 - k1)) as i64 + input as i64;
        assert!(
            (measured - predicted * input as i64).abs() <= slack,
            "{k1}->{k2}: measured {measured}, predicted {} inputs",
            predicted
        );
    }

    // Under a plan, segments' blocks can be saved by name.
    let saved = Plan::save_only(["block.3"]).scope(|| step(&ws, &x, Some(4)));
    assert!(saved.tape > 4 * input);
}
