//! The fingerprint of a recomputed output on the CPU ([`Kind::Sums`]): the
//! [digest](super::digest) of its bytes for the bitwise comparison, and the
//! three sums of the tolerance path, both from one read of each chunk.
//!
//! The checksum's hash mixes every element with its position (two integer
//! multiplies and a murmur finaliser per element) so that the CUDA kernels
//! give the CPU's bits; a value compared only on the CPU needs neither, and
//! this runs at about memory speed where the checksum runs at a third of it.
//!
//! Sums, per chunk of the digest (in row-major order; the chunks' sums
//! then added in order): [`LANES`] lanes, each
//! summing [`SPAN`] rows in the element's precision (`f32` up to 32 bits)
//! before `f64`, as the checksum does. The weight of position `p` is
//! `w[p mod BLOCK] x g[p / BLOCK]`: `w` a table of [`BLOCK`] weights in
//! `(0, 1)` (the golden-ratio sequence, read from L1), `g` in `[1/2, 1)`
//! set by the block (another such sequence), so that swapping any two
//! elements of different values moves the weighted sum. The four numbers
//! of a value are not the checksum's (`Kind::Sums` is compared only with
//! itself: a forward and its replay on the CPU).
//!
//! [`Kind::Sums`]: super::Kind::Sums
//! [`SPAN`]: super::SPAN

use std::sync::LazyLock;

use bytemuck::Pod;
use candle_core::Layout;

use super::digest::{combine, hash, CHUNK_BYTES};
use super::element::{Acc, Element, PHI};
use super::{SPAN, WORDS};

/// Lanes a chunk's rows are summed in (two AVX2 registers of `f32`).
const LANES: usize = 16;
/// Positions that share a block weight: the table is 16 KiB of `f32`.
const BLOCK: usize = 4096;
/// A second odd constant for the blocks' weights (murmur3's).
const BLOCK_STEP: u32 = 0x85eb_ca6b;

/// The in-block weights: position `i` of a block weighs `((i + 1) x PHI
/// mod 2^32) / 2^32`, cut to 24 bits (exact in `f32`, never zero).
static WEIGHTS: LazyLock<Vec<f32>> = LazyLock::new(|| {
    (0..BLOCK)
        .map(|i| top24((i as u32 + 1).wrapping_mul(PHI)) as f32 / 16_777_216.0)
        .collect()
});
static WEIGHTS_F64: LazyLock<Vec<f64>> =
    LazyLock::new(|| WEIGHTS.iter().map(|&w| f64::from(w)).collect());

/// The top 24 bits of a key.
#[inline(always)]
fn top24(key: u32) -> u32 {
    key >> 8
}

/// The weight of block `b`, in `[1/2, 1)`.
fn block_weight(b: usize) -> f64 {
    let key = (b as u32).wrapping_add(1).wrapping_mul(BLOCK_STEP);
    0.5 + f64::from(top24(key)) / 33_554_432.0
}

/// An accumulator's table of in-block weights.
pub(super) trait Weights: Acc + 'static {
    fn weights() -> &'static [Self];
}

impl Weights for f32 {
    fn weights() -> &'static [f32] {
        &WEIGHTS
    }
}

impl Weights for f64 {
    fn weights() -> &'static [f64] {
        &WEIGHTS_F64
    }
}

/// The sums of one chunk: sum, magnitudes, weighted.
pub(super) type Sums = [f64; 3];

/// The hash of chunk `c` of a value, `xs` its elements, and its sums if
/// `with_sums` (zeros otherwise).
pub(super) fn part<T>(xs: &[T], c: usize, with_sums: bool) -> (u64, Sums)
where
    T: Element + Pod,
    T::Acc: Weights,
{
    let per_chunk = CHUNK_BYTES / std::mem::size_of::<T>();
    let sums = match with_sums {
        true => chunk_fast(xs, c * per_chunk / BLOCK),
        false => [0.0; 3],
    };
    (hash(xs, c), sums)
}

/// A value's fingerprint from its chunks' [`part`]s, in order: the hash
/// of their hashes (low 53 bits, an exact `f64`), then the sums added in
/// order.
pub(super) fn words(parts: &[(u64, Sums)], layout: &Layout) -> [f64; WORDS] {
    let hashes: Vec<u64> = parts.iter().map(|p| p.0).collect();
    let mut out = [0.0; WORDS];
    out[0] = (combine(&hashes, layout) & ((1 << 53) - 1)) as f64;
    for (_, sums) in parts {
        for (total, part) in out[1..].iter_mut().zip(sums) {
            *total += part;
        }
    }
    out
}

/// [`chunk`], with AVX2 where the CPU has it.
fn chunk_fast<T>(xs: &[T], first_block: usize) -> Sums
where
    T: Element,
    T::Acc: Weights,
{
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: `chunk_avx2` only asks the compiler to use AVX2 and FMA
        // instructions, and the CPU has them (checked just above).
        return unsafe { chunk_avx2(xs, first_block) };
    }
    chunk(xs, first_block)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunk_avx2<T>(xs: &[T], first_block: usize) -> Sums
where
    T: Element,
    T::Acc: Weights,
{
    chunk(xs, first_block)
}

/// The sums of a chunk whose first block is `first_block`: each block's
/// rows of [`LANES`] in order, the lanes' sums in the element's precision
/// for [`SPAN`] rows, then in `f64`.
#[inline(always)]
fn chunk<T>(xs: &[T], first_block: usize) -> Sums
where
    T: Element,
    T::Acc: Weights,
{
    let weights = T::Acc::weights();
    let mut out = [0.0; 3];
    for (k, block) in xs.chunks(BLOCK).enumerate() {
        let mut total = [[0f64; LANES]; 3];
        for (s, span) in block.chunks(LANES * SPAN).enumerate() {
            let mut sum = [T::Acc::default(); LANES];
            let mut abs = [T::Acc::default(); LANES];
            let mut weighted = [T::Acc::default(); LANES];
            let mut rows = span.chunks_exact(LANES);
            let mut at = s * LANES * SPAN;
            for row in rows.by_ref() {
                let w = &weights[at..at + LANES];
                for t in 0..LANES {
                    let v = row[t].value();
                    sum[t] = sum[t] + v;
                    abs[t] = abs[t] + v.abs();
                    weighted[t] = weighted[t] + v * w[t];
                }
                at += LANES;
            }
            // A block's last, partial row.
            for (t, &x) in rows.remainder().iter().enumerate() {
                let v = x.value();
                sum[t] = sum[t] + v;
                abs[t] = abs[t] + v.abs();
                weighted[t] = weighted[t] + v * weights[at + t];
            }
            for t in 0..LANES {
                total[0][t] += sum[t].to_f64();
                total[1][t] += abs[t].to_f64();
                total[2][t] += weighted[t].to_f64();
            }
        }
        let [sum, abs, weighted] = total.map(|lanes| lanes.iter().sum::<f64>());
        out[0] += sum;
        out[1] += abs;
        out[2] += weighted * block_weight(first_block + k);
    }
    out
}
