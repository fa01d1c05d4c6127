//! The checksum on the CPU: chunks in parallel, each chunk's rows in order
//! with the lanes vectorised, with the operations and order of the kernels
//! (see the module above).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout};
use rayon::prelude::*;

use super::element::{key, mix, Acc, Element, PHI};
use super::{Partial, CHUNK, LANES, ROWS, SPAN};

/// The sums of the elements `layout` addresses in `storage`.
pub(super) fn checksum(storage: &CpuStorage, layout: &Layout) -> Partial {
    match storage {
        CpuStorage::U8(d) => sums(d, layout),
        CpuStorage::U32(d) => sums(d, layout),
        CpuStorage::I64(d) => sums(d, layout),
        CpuStorage::BF16(d) => sums(d, layout),
        CpuStorage::F16(d) => sums(d, layout),
        CpuStorage::F32(d) => sums(d, layout),
        CpuStorage::F64(d) => sums(d, layout),
        CpuStorage::I16(d) => sums(d, layout),
        CpuStorage::I32(d) => sums(d, layout),
        // 8-bit and smaller floats: through `f32`.
        other => match other.to_dtype(layout, DType::F32) {
            Ok(CpuStorage::F32(d)) => sums(&d, &Layout::contiguous(layout.shape())),
            // A dtype candle cannot convert: checked by shape alone.
            _ => Partial::default(),
        },
    }
}

/// The sums of the elements `layout` addresses in `data`, in row-major
/// order: the chunks of a contiguous range in parallel, a strided view's
/// gathered chunk by chunk; the chunks' sums added in order.
pub(super) fn sums<T: Element>(data: &[T], layout: &Layout) -> Partial {
    let chunks: Vec<Partial> = match layout.contiguous_offsets() {
        Some((start, end)) => data[start..end]
            .par_chunks(CHUNK)
            .enumerate()
            .map(|(c, xs)| chunk_fast(xs, c * CHUNK))
            .collect(),
        None => {
            let mut chunks = Vec::new();
            let mut buffer = Vec::with_capacity(CHUNK.min(layout.shape().elem_count()));
            for offset in offsets(layout) {
                buffer.push(data[offset]);
                if buffer.len() == CHUNK {
                    chunks.push(chunk_fast(&buffer, chunks.len() * CHUNK));
                    buffer.clear();
                }
            }
            if !buffer.is_empty() {
                chunks.push(chunk_fast(&buffer, chunks.len() * CHUNK));
            }
            chunks
        }
    };
    Partial::fold(&chunks)
}

/// The storage offsets of a strided layout's elements, in row-major order.
pub(super) fn offsets(layout: &Layout) -> impl Iterator<Item = usize> + '_ {
    let dims = layout.dims();
    let stride = layout.stride();
    let n = layout.shape().elem_count();
    let mut index = vec![0usize; dims.len()];
    let mut offset = layout.start_offset();
    (0..n).map(move |_| {
        let here = offset;
        // The next index, the last dimension fastest.
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            offset += stride[d];
            if index[d] < dims[d] {
                break;
            }
            offset -= stride[d] * dims[d];
            index[d] = 0;
        }
        here
    })
}

/// [`chunk`], with AVX2 where the CPU has it (eight lanes of 32-bit integer
/// multiplies in one instruction; the same operations in the same order, so
/// the same bits).
fn chunk_fast<T: Element>(xs: &[T], start: usize) -> Partial {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: `chunk_avx2` only asks the compiler to use AVX2
        // instructions, and the CPU has them (checked just above).
        return unsafe { chunk_avx2(xs, start) };
    }
    chunk(xs, start)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn chunk_avx2<T: Element>(xs: &[T], start: usize) -> Partial {
    chunk(xs, start)
}

/// The sums of one chunk: `xs` are the elements at positions `start..`
/// (at most [`CHUNK`] of them), `start` a multiple of [`CHUNK`]. Rows of
/// [`LANES`] elements are read in order (one element per lane, the lanes'
/// sums in arrays the compiler keeps in vector registers and L1).
#[inline(always)]
fn chunk<T: Element>(xs: &[T], start: usize) -> Partial {
    let mut h0 = [0u32; LANES];
    let mut h1 = [0u32; LANES];
    let mut total = [[0f64; LANES]; 3];
    for span in 0..ROWS / SPAN {
        let mut sum = [T::Acc::default(); LANES];
        let mut abs = [T::Acc::default(); LANES];
        let mut weighted = [T::Acc::default(); LANES];
        for r in span * SPAN..(span + 1) * SPAN {
            let base = r * LANES;
            if base >= xs.len() {
                break;
            }
            let p0 = (start + base) as u32;
            let row = &xs[base..xs.len().min(base + LANES)];
            if let Ok(row) = <&[T; LANES]>::try_from(row) {
                for t in 0..LANES {
                    let k = p0.wrapping_add(t as u32).wrapping_mul(PHI);
                    let (a, b) = mix(row[t], k);
                    h0[t] = h0[t].wrapping_add(a);
                    h1[t] = h1[t].wrapping_add(b);
                    let v = row[t].value();
                    sum[t] = sum[t] + v;
                    abs[t] = abs[t] + v.abs();
                    weighted[t] = weighted[t] + v * T::Acc::weight(k);
                }
            } else {
                // The chunk's last, partial row.
                for (t, &x) in row.iter().enumerate() {
                    let k = key(start + base + t);
                    let (a, b) = mix(x, k);
                    h0[t] = h0[t].wrapping_add(a);
                    h1[t] = h1[t].wrapping_add(b);
                    let v = x.value();
                    sum[t] = sum[t] + v;
                    abs[t] = abs[t] + v.abs();
                    weighted[t] = weighted[t] + v * T::Acc::weight(k);
                }
            }
        }
        for t in 0..LANES {
            total[0][t] += sum[t].to_f64();
            total[1][t] += abs[t].to_f64();
            total[2][t] += weighted[t].to_f64();
        }
    }
    let mut lanes = [Partial::default(); LANES];
    for (t, lane) in lanes.iter_mut().enumerate() {
        *lane = Partial {
            h0: h0[t],
            h1: h1[t],
            sum: total[0][t],
            abs: total[1][t],
            weighted: total[2][t],
        };
    }
    Partial::tree(&mut lanes)
}
