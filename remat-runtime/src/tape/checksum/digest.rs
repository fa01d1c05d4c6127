//! The digest of a CPU value that is only ever compared bit for bit (a
//! parameter, a block input the backward reads): XXH3 over its elements'
//! bytes in row-major order, at memory speed, where the
//! [checksum](super) also sums the values for the tolerance path and runs
//! at a third of it.
//!
//! The elements are cut into chunks of [`CHUNK_BYTES`] in row-major order;
//! each chunk is hashed with its index as the seed (every core takes
//! chunks), and the chunks' hashes, in order, are hashed again with the
//! element count as the seed. A strided view is gathered into the same
//! chunks, so a view and its contiguous copy have one digest. Any change of
//! the elements (one bit, a swap, a shift) is missed with probability about
//! 2^-53, the bits kept; there is no certainty for a single element as the
//! checksum's hash gives, and none is needed at that probability.

use bytemuck::Pod;
use candle_core::{CpuStorage, Layout};
use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::cpu::offsets;
use super::WORDS;

/// Bytes per chunk: a multiple of every element's size, large enough that
/// a chunk's hash runs at memory speed, small enough that a block's
/// parameters make a chunk for every core.
const CHUNK_BYTES: usize = 256 * 1024;

/// The digest of the elements `layout` addresses in `storage`, as a
/// fingerprint: the hash's low 53 bits (an exact `f64`), then zeros.
/// `None` for a dtype it has no bytes for (sub-byte floats): take the
/// checksum.
pub(super) fn digest(storage: &CpuStorage, layout: &Layout) -> Option<[f64; WORDS]> {
    let hash = match storage {
        CpuStorage::U8(d) => of(d, layout),
        CpuStorage::U32(d) => of(d, layout),
        CpuStorage::I16(d) => of(d, layout),
        CpuStorage::I32(d) => of(d, layout),
        CpuStorage::I64(d) => of(d, layout),
        CpuStorage::BF16(d) => of(d, layout),
        CpuStorage::F16(d) => of(d, layout),
        CpuStorage::F32(d) => of(d, layout),
        CpuStorage::F64(d) => of(d, layout),
        _ => return None,
    };
    let mut words = [0.0; WORDS];
    words[0] = (hash & ((1 << 53) - 1)) as f64;
    Some(words)
}

/// The hash of the elements `layout` addresses in `data`.
fn of<T: Pod + Send + Sync>(data: &[T], layout: &Layout) -> u64 {
    let chunks: Vec<u64> = match layout.contiguous_offsets() {
        Some((start, end)) => bytemuck::cast_slice::<T, u8>(&data[start..end])
            .par_chunks(CHUNK_BYTES)
            .enumerate()
            .map(|(c, bytes)| xxh3_64_with_seed(bytes, c as u64))
            .collect(),
        None => {
            let per_chunk = CHUNK_BYTES / std::mem::size_of::<T>();
            let n = layout.shape().elem_count();
            let mut chunks = Vec::with_capacity(n.div_ceil(per_chunk));
            let mut buffer = Vec::with_capacity(per_chunk.min(n));
            let flush = |buffer: &mut Vec<T>, chunks: &mut Vec<u64>| {
                let seed = chunks.len() as u64;
                chunks.push(xxh3_64_with_seed(bytemuck::cast_slice(buffer), seed));
                buffer.clear();
            };
            for offset in offsets(layout) {
                buffer.push(data[offset]);
                if buffer.len() == per_chunk {
                    flush(&mut buffer, &mut chunks);
                }
            }
            if !buffer.is_empty() {
                flush(&mut buffer, &mut chunks);
            }
            chunks
        }
    };
    let count = layout.shape().elem_count() as u64;
    xxh3_64_with_seed(bytemuck::cast_slice(&chunks), count)
}
