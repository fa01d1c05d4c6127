//! The checksum on the CPU: chunks in parallel, each chunk's lanes eight at
//! a time in vector registers, with the operations and order of the
//! kernels (see the module above).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout};
use rayon::prelude::*;

use super::element::{key, mix, Acc, Element};
use super::{Partial, CHUNK, LANES, ROWS, SPAN};

/// Lanes summed together in registers.
const GROUP: usize = 8;

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
fn offsets(layout: &Layout) -> impl Iterator<Item = usize> + '_ {
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
/// (at most [`CHUNK`] of them), `start` a multiple of [`CHUNK`].
#[inline(always)]
fn chunk<T: Element>(xs: &[T], start: usize) -> Partial {
    let mut lanes = [Partial::default(); LANES];
    for (g, out) in lanes.chunks_exact_mut(GROUP).enumerate() {
        group(xs, start, g * GROUP, out);
    }
    Partial::tree(&mut lanes)
}

/// Lanes `first..first + GROUP` of a chunk, into `out`.
#[inline(always)]
fn group<T: Element>(xs: &[T], start: usize, first: usize, out: &mut [Partial]) {
    let mut h0 = [0u32; GROUP];
    let mut h1 = [0u32; GROUP];
    let mut total = [[0f64; GROUP]; 3];
    for span in 0..ROWS / SPAN {
        let mut sum = [T::Acc::default(); GROUP];
        let mut abs = [T::Acc::default(); GROUP];
        let mut weighted = [T::Acc::default(); GROUP];
        let mut one = |l: usize, i: usize| {
            let k = key(start + i);
            let (a, b) = mix(xs[i], k);
            h0[l] = h0[l].wrapping_add(a);
            h1[l] = h1[l].wrapping_add(b);
            let v = xs[i].value();
            sum[l] = sum[l] + v;
            abs[l] = abs[l] + v.abs();
            weighted[l] = weighted[l] + v * T::Acc::weight(k);
        };
        for r in span * SPAN..(span + 1) * SPAN {
            let base = r * LANES + first;
            if base + GROUP <= xs.len() {
                for l in 0..GROUP {
                    one(l, base + l);
                }
            } else {
                for l in 0..GROUP {
                    if base + l < xs.len() {
                        one(l, base + l);
                    }
                }
            }
        }
        for l in 0..GROUP {
            total[0][l] += sum[l].to_f64();
            total[1][l] += abs[l].to_f64();
            total[2][l] += weighted[l].to_f64();
        }
    }
    for (l, o) in out.iter_mut().enumerate() {
        *o = Partial {
            h0: h0[l],
            h1: h1[l],
            sum: total[0][l],
            abs: total[1][l],
            weighted: total[2][l],
        };
    }
}
