//! The memory report, byte for byte, against sizes computed by hand from the
//! shapes (f32: 4 bytes per element).

use crate::common::*;
use candle_core::{DType, Tensor};
use remat_runtime::inspect::MemoryEntry;
use remat_runtime::{MemoryReport, Policy, Region};

const F32: usize = 4;

fn entry<'a>(
    report: &'a MemoryReport,
    region: &str,
    call: usize,
    statement: &str,
) -> &'a MemoryEntry {
    report
        .entries
        .iter()
        .find(|e| e.region == region && e.call == call && e.statement == statement)
        .unwrap_or_else(|| panic!("no entry {region}#{call}/{statement}"))
}

#[test]
fn report_by_region_and_record_with_exact_bytes() {
    // x: (8, 16) input needing gradients; w: (16, 32) and b: (32) parameters.
    let x = var(&[8, 16], 1, 1.0, DType::F32);
    let w = var(&[16, 32], 2, 0.3, DType::F32);
    let b = var(&[32], 3, 0.1, DType::F32);
    let (wt, bt) = (w.as_tensor().clone(), b.as_tensor().clone());
    let body = move |ctx: &mut remat_runtime::Ctx, ins: &[Tensor]| {
        // Saved linear: leaf copy of x (8x16), matmul (8x32), bias add (8x32).
        let h = ctx.save("lin", &[&ins[0]], |t| t[0].matmul(&wt)?.broadcast_add(&bt))?;
        // Saved right after: chained, no leaf copy. Its outputs are a view
        // of h (reshape of a contiguous tensor: same storage, counted in
        // `lin` already) and tanh (8x32).
        let (v, a) = ctx.save("view+tanh", &[&h], |t| {
            Ok::<_, remat_runtime::RematError>((t[0].reshape((4, 64))?, t[0].tanh()?))
        })?;
        // Recomputed: holds nothing.
        ctx.recompute("out", &[&v, &a], |t| {
            (t[0].reshape((8, 32))? + &t[1])?.sum_all()
        })
    };
    let y0 = Region::new("blk")
        .run(&[x.as_tensor()], body.clone())
        .unwrap();
    let y1 = Region::new("blk").run(&[x.as_tensor()], body).unwrap();
    let report = MemoryReport::capture();

    for call in 0..2 {
        let inputs = entry(&report, "blk", call, "(inputs)");
        // The saved `lin` reads x through its own leaf copy; the tape holds
        // x too, to see a change in place before the backward (the caller
        // holds the same storage: no byte more in fact). Counted once, in
        // the first call.
        assert_eq!(inputs.bytes, if call == 0 { 8 * 16 * F32 } else { 0 });
        assert_eq!(inputs.shapes, vec![vec![8, 16]]);
        assert_eq!(inputs.policy, None);

        let lin = entry(&report, "blk", call, "lin");
        assert_eq!(lin.bytes, (8 * 16 + 8 * 32 + 8 * 32) * F32);
        assert_eq!(lin.policy, Some(Policy::Save));
        assert_eq!(lin.shapes, vec![vec![8, 32]]);
        assert_eq!(lin.dtype, Some(DType::F32));

        let vt = entry(&report, "blk", call, "view+tanh");
        assert_eq!(vt.bytes, 8 * 32 * F32, "the view is counted once, in `lin`");
        assert_eq!(vt.shapes, vec![vec![4, 64], vec![8, 32]]);

        let out = entry(&report, "blk", call, "out");
        assert_eq!(out.bytes, 0);
        assert_eq!(out.policy, Some(Policy::Recompute));
    }
    let per_call = (8 * 16 + 8 * 32 + 8 * 32 + 8 * 32) * F32;
    // And x, once.
    assert_eq!(report.total_bytes(), 2 * per_call + 8 * 16 * F32);
    // Parameters are not tape memory.
    assert!(report.entries.iter().all(|e| e.statement != "w"));
    // The printed report names every record.
    let text = report.to_string();
    for name in ["(inputs)", "lin", "view+tanh", "out", "blk#1"] {
        assert!(text.contains(name), "{text}");
    }
    drop(y0);
    assert_eq!(
        MemoryReport::capture().entries.len(),
        4,
        "only the second call is left"
    );
    drop(y1);
    assert!(MemoryReport::capture().entries.is_empty());
}

remat_runtime::remat! {
    /// q, k and v projections of one norm output, each saved.
    fn qkv(x: &Tensor, wq: &Tensor, wk: &Tensor, wv: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.tanh()?;
        #[save] let q = h.matmul(wq)?;
        #[save] let k = h.matmul(wk)?;
        #[save] let v = h.matmul(wv)?;
        Ok(((q + k)? + v)?)
    }
}

#[test]
fn saved_statements_reading_one_value_share_one_copy_of_it() {
    // x, h: (8, 16); q, k, v: (8, 32). `h` is recomputed; the three saved
    // statements read it through one leaf copy.
    let x = var(&[8, 16], 1, 1.0, DType::F32);
    let ws: Vec<_> = (0..3)
        .map(|i| var(&[16, 32], 2 + i, 0.3, DType::F32))
        .collect();
    let y = qkv(x.as_tensor(), &ws[0], &ws[1], &ws[2]).unwrap();
    let report = MemoryReport::capture();
    // Each holds its output and its weight (a region input, whose leaf
    // copy its graph keeps); the copy of `h` is counted once, with the
    // first statement that holds it (three copies before statements
    // shared them: 2 * 512 bytes more).
    let (h, w, out) = (8 * 16 * F32, 16 * 32 * F32, 8 * 32 * F32);
    assert_eq!(entry(&report, "qkv", 0, "q").bytes, out + w + h);
    assert_eq!(entry(&report, "qkv", 0, "k").bytes, out + w);
    assert_eq!(entry(&report, "qkv", 0, "v").bytes, out + w);
    // Gradients against plain candle: the shared copy routes each
    // statement's contribution once.
    let g = y.sum_all().unwrap().backward().unwrap();
    let plain = {
        let h = x.as_tensor().tanh().unwrap();
        let q = h.matmul(&ws[0]).unwrap();
        let k = h.matmul(&ws[1]).unwrap();
        let v = h.matmul(&ws[2]).unwrap();
        ((q + k).unwrap() + v).unwrap()
    };
    let g_ref = plain.sum_all().unwrap().backward().unwrap();
    for t in [&x].into_iter().chain(&ws) {
        assert!(rel_diff(g.get(t).unwrap(), g_ref.get(t).unwrap()) <= 1e-6);
    }
}
