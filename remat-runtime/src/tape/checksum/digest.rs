//! The digest of a CPU value's bytes: XXH3 over its elements in row-major
//! order, at memory speed. A value compared only bit for bit (a parameter,
//! a block input the backward reads) is fingerprinted by its digest alone;
//! a recomputed output by its digest and sums ([`summed`](super::summed)).
//!
//! The elements are cut into chunks of [`CHUNK_BYTES`] in row-major order;
//! each chunk is hashed with its index as the seed (every core takes
//! chunks: [`together`](super::together)), and the chunks' hashes, in
//! order, are hashed again with the element count as the seed. A strided
//! view is gathered into the same chunks, so a view and its contiguous copy
//! have one digest. Any change of the elements (one bit, a swap, a shift)
//! is missed with probability about 2^-53, the bits kept; there is no
//! certainty for a single element as the checksum's hash gives, and none
//! is needed at that probability.

use bytemuck::Pod;
use candle_core::Layout;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::cpu::offsets;

/// Bytes per chunk: a multiple of every element's size, large enough that
/// a chunk's hash runs at memory speed, small enough that a block's
/// parameters make a chunk for every core.
pub(super) const CHUNK_BYTES: usize = 256 * 1024;

/// The hash of chunk `c` of a value, `xs` its elements.
pub(super) fn hash<T: Pod>(xs: &[T], c: usize) -> u64 {
    xxh3_64_with_seed(bytemuck::cast_slice(xs), c as u64)
}

/// The chunks' hashes, in order, hashed again with the element count as
/// the seed: the value's hash.
pub(super) fn combine(chunks: &[u64], layout: &Layout) -> u64 {
    let count = layout.shape().elem_count() as u64;
    xxh3_64_with_seed(bytemuck::cast_slice(chunks), count)
}

/// `f` of each chunk of a strided view's elements, gathered in row-major
/// order one chunk at a time, with the chunk's index.
pub(super) fn gathered<T: Pod, R>(
    data: &[T],
    layout: &Layout,
    f: impl Fn(&[T], usize) -> R,
) -> Vec<R> {
    let per_chunk = CHUNK_BYTES / std::mem::size_of::<T>();
    let n = layout.shape().elem_count();
    let mut chunks = Vec::with_capacity(n.div_ceil(per_chunk));
    let mut buffer = Vec::with_capacity(per_chunk.min(n));
    for offset in offsets(layout) {
        buffer.push(data[offset]);
        if buffer.len() == per_chunk {
            chunks.push(f(&buffer, chunks.len()));
            buffer.clear();
        }
    }
    if !buffer.is_empty() {
        chunks.push(f(&buffer, chunks.len()));
    }
    chunks
}
