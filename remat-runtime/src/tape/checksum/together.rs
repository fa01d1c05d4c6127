//! The fingerprints of several CPU values taken together: every chunk of
//! every contiguous value is one job for any core, so that a region's
//! parameters (a dozen values, most of them one chunk or less) keep both
//! cores reading, where one value at a time would leave a core idle. A
//! strided view is gathered chunk by chunk as one job; a dtype without
//! bytes to read (sub-byte floats) gets the checksum.

use bytemuck::Pod;
use candle_core::{CpuStorage, DType, Layout, Storage, Tensor};
use rayon::prelude::*;

use super::digest::{gathered, CHUNK_BYTES};
use super::element::Element;
use super::summed::{part, words, Sums, Weights};
use super::{cpu, Kind, WORDS};

/// What one job gives: a chunk's hash and sums, or a whole value's words.
enum Done {
    Chunk(u64, Sums),
    Whole([f64; WORDS]),
}

/// The fingerprints of `values` (CPU tensors; `None`: not compared, four
/// zeros) as `kind` says, [`WORDS`] per value, in order: [`Kind::Bits`] a
/// digest, [`Kind::Sums`] a digest and sums, [`Kind::Checksum`] the
/// checksum. Each job reads its value's storage under its own lock, one at
/// a time on a thread (values may share a storage).
pub(super) fn fingerprints(values: &[Option<&Tensor>], kind: Kind) -> Vec<f64> {
    // Jobs: (value, Some(chunk)) for a contiguous value's chunks, (value,
    // None) for a whole one.
    let mut jobs = Vec::new();
    let mut bytes = 0;
    for (v, value) in values.iter().enumerate() {
        let Some(t) = value else {
            continue;
        };
        match (kind, chunks(t.dtype(), t.layout())) {
            (Kind::Bits | Kind::Sums, Some(n)) => jobs.extend((0..n).map(|c| (v, Some(c)))),
            _ => jobs.push((v, None)),
        }
        bytes += t.elem_count() * t.dtype().size_in_bytes();
    }
    let run = |&(v, c): &(usize, Option<usize>)| {
        let t = values[v].expect("a job's value");
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cpu(storage) = &*storage else {
            unreachable!("a CPU tensor's storage")
        };
        match c {
            Some(c) => {
                let (h, s) = chunk_of(storage, layout, c, kind == Kind::Sums);
                Done::Chunk(h, s)
            }
            None => Done::Whole(whole(storage, layout, kind)),
        }
    };
    // Less than a chunk in all: on this thread, not worth waking a core.
    let done: Vec<Done> = match bytes <= CHUNK_BYTES {
        true => jobs.iter().map(run).collect(),
        false => jobs.par_iter().map(run).collect(),
    };
    let mut out = Vec::with_capacity(values.len() * WORDS);
    let mut done = jobs.iter().zip(done).peekable();
    for (v, value) in values.iter().enumerate() {
        let Some(t) = value else {
            out.extend([0.0; WORDS]);
            continue;
        };
        let mut parts = Vec::new();
        let mut whole = None;
        while let Some((_, d)) = done.next_if(|((w, _), _)| *w == v) {
            match d {
                Done::Chunk(h, s) => parts.push((h, s)),
                Done::Whole(words) => whole = Some(words),
            }
        }
        out.extend(whole.unwrap_or_else(|| words(&parts, t.layout())));
    }
    out
}

/// The chunks of a contiguous value with bytes to read; `None` for a
/// strided view or another dtype.
fn chunks(dtype: DType, layout: &Layout) -> Option<usize> {
    let (start, end) = layout.contiguous_offsets()?;
    match dtype {
        DType::U8
        | DType::U32
        | DType::I16
        | DType::I32
        | DType::I64
        | DType::BF16
        | DType::F16
        | DType::F32
        | DType::F64 => Some(((end - start) * dtype.size_in_bytes()).div_ceil(CHUNK_BYTES)),
        _ => None,
    }
}

/// Runs `$f` on the typed elements of a storage with bytes to read.
macro_rules! typed {
    ($storage:expr, |$d:ident| $f:expr, $other:expr) => {
        match $storage {
            CpuStorage::U8($d) => $f,
            CpuStorage::U32($d) => $f,
            CpuStorage::I16($d) => $f,
            CpuStorage::I32($d) => $f,
            CpuStorage::I64($d) => $f,
            CpuStorage::BF16($d) => $f,
            CpuStorage::F16($d) => $f,
            CpuStorage::F32($d) => $f,
            CpuStorage::F64($d) => $f,
            _ => $other,
        }
    };
}

/// Chunk `c` of a contiguous value: its hash, and its sums if `with_sums`.
fn chunk_of(storage: &CpuStorage, layout: &Layout, c: usize, with_sums: bool) -> (u64, Sums) {
    let (start, end) = layout.contiguous_offsets().expect("a contiguous value");
    typed!(
        storage,
        |d| slice_part(&d[start..end], c, with_sums),
        unreachable!("a dtype with bytes")
    )
}

fn slice_part<T>(xs: &[T], c: usize, with_sums: bool) -> (u64, Sums)
where
    T: Element + Pod,
    T::Acc: Weights,
{
    let per_chunk = CHUNK_BYTES / std::mem::size_of::<T>();
    let chunk = &xs[c * per_chunk..xs.len().min((c + 1) * per_chunk)];
    part(chunk, c, with_sums)
}

/// A whole value's fingerprint: a strided view gathered chunk by chunk,
/// or the checksum.
fn whole(storage: &CpuStorage, layout: &Layout, kind: Kind) -> [f64; WORDS] {
    let checksum = || cpu::checksum(storage, layout).finish();
    if kind == Kind::Checksum {
        return checksum();
    }
    let with_sums = kind == Kind::Sums;
    typed!(
        storage,
        |d| words(&gathered(d, layout, |xs, c| part(xs, c, with_sums)), layout),
        checksum()
    )
}
