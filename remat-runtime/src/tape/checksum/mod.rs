//! The checksum of a value: every element, with its position, in one pass
//! over it on its own device.
//!
//! A checksum is four `f64`s (32 bytes on the tape):
//!
//! * `[0]`: a 53-bit hash of the elements' bits (two 32-bit hashes, one cut
//!   to 21 bits, so that it is an exact `f64`): each element's 32-bit words
//!   mixed with their position by a bijection (murmur3's finalizer) and
//!   summed. A change of any one element of up to 32 bits changes the hash
//!   for certain (the mix is a bijection of the word, the first sum is
//!   modulo 2^32); a change of both words of a 64-bit element, a swap, or
//!   any other change is missed with probability about 2^-53. Switch the
//!   CUDA kernels on or off between steps, not between a forward and its
//!   backward: the two algorithms' numbers differ (the replay would report
//!   a changed value);
//! * `[1]` the sum of the elements, `[2]` the sum of their magnitudes,
//!   `[3]` the sum of each element times a weight in `[0, 1)` set by its
//!   position (the fractional part of `p` times the golden ratio): the part
//!   a tolerance can be applied to.
//!
//! One algorithm, on every device, fixes every operation and its order, so
//! that the same elements give the same bits on the CPU and on a GPU,
//! however they are laid out (a transposed view and its contiguous copy
//! have one checksum). Positions are taken in row-major order and cut into
//! chunks of [`CHUNK`] = [`LANES`] x [`ROWS`]; in a chunk, lane `t` reads
//! the positions `t, t + LANES, t + 2 LANES, ...` (on a GPU: one block per
//! chunk, one thread per lane, every read coalesced), summing each span of
//! [`SPAN`] of them in the element's precision (`f32` up to 32 bits) and
//! the spans in `f64`; the lanes of a chunk are added pairwise in a fixed
//! tree. The chunks are added the same way: lane `t` adds the chunks `t,
//! t + LANES, ...` in order, then the same tree ([`Partial::fold`]). The
//! hashes are sums modulo 2^32, in any order.
//!
//! * `cpu`: the algorithm on the CPU, vectorised across lanes;
//! * `device`: the same on a GPU as two kernels (`checksum.cu`), and their
//!   emulation on the CPU that tests every launch's logic; the same two
//!   again for up to [`device::BATCH`] values of a dtype at once ([`of_all`]);
//! * `composed`: the sums by candle's own kernels, without the hash: the
//!   default on a GPU until the kernels have been run on one (see
//!   [`crate::inspect::checksum_kernels`]);
//! * `digest`: on the CPU, for a value compared only bit for bit
//!   ([`Kind::Bits`]: parameters, block inputs), a hash of its bytes
//!   without the sums, at memory speed;
//! * `summed`: on the CPU, for a recomputed output ([`Kind::Sums`]), that
//!   digest and three sums of its own, in one read: the forward and its
//!   replay on the CPU compare it with itself, never with a GPU's.

mod composed;
mod cpu;
pub(crate) mod device;
mod digest;
mod element;
#[cfg(test)]
mod emulated;
mod summed;
mod together;

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{CpuStorage, CudaStorage, Device, Layout, Shape, Tensor};

use crate::Result;

/// Numbers in one checksum.
pub(crate) const WORDS: usize = 4;
/// Where each number stands in a checksum (the hash is at 0).
pub(crate) const SUM: usize = 1;
pub(crate) const MAGNITUDES: usize = 2;
pub(crate) const WEIGHTED: usize = 3;

/// Lanes of a chunk (threads of a block on a GPU).
pub(crate) const LANES: usize = 256;
/// Positions each lane of a chunk reads: small enough that a value of a
/// few million elements makes a block for every streaming multiprocessor
/// of a large GPU several times over.
pub(crate) const ROWS: usize = 64;
/// Positions a lane sums in the element's precision before `f64`.
pub(crate) const SPAN: usize = 32;
/// Positions of a chunk.
pub(crate) const CHUNK: usize = LANES * ROWS;

/// Whether CUDA tensors are checksummed by the kernels of `checksum.cu`
/// (see [`crate::inspect::checksum_kernels`]).
static KERNELS: AtomicBool = AtomicBool::new(true);

/// Turns the checksum kernels on or off for CUDA tensors.
pub(crate) fn use_kernels(on: bool) {
    from_env();
    KERNELS.store(on, Ordering::Relaxed);
}

/// Whether the checksum kernels are on (the default): [`use_kernels`], or
/// the `REMAT_CHECKSUM_KERNELS` environment variable (`0` or `1`) if that
/// was never called.
pub(crate) fn kernels_on() -> bool {
    from_env();
    KERNELS.load(Ordering::Relaxed)
}

/// Sets the switches from `REMAT_CHECKSUM_KERNELS` and
/// `REMAT_CHECKSUM_BATCHES` (`0` or `1`), once, before the first use or
/// change of either: a call changes what the environment set, never the
/// other way round.
fn from_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for (name, switch) in [
            ("REMAT_CHECKSUM_KERNELS", &KERNELS),
            ("REMAT_CHECKSUM_BATCHES", &BATCHES),
        ] {
            match std::env::var(name).as_deref() {
                Ok("1") => switch.store(true, Ordering::Relaxed),
                Ok("0") => switch.store(false, Ordering::Relaxed),
                _ => {}
            }
        }
    });
}

/// Whether checksums of several CUDA values are taken by the batch kernels
/// (see [`crate::inspect::checksum_batches`]; off by default until they have
/// run on a GPU).
static BATCHES: AtomicBool = AtomicBool::new(false);

/// Turns the batch kernels on or off for CUDA tensors.
pub(crate) fn use_batches(on: bool) {
    from_env();
    BATCHES.store(on, Ordering::Relaxed);
}

/// Whether the batch kernels are on: [`use_batches`], or the
/// `REMAT_CHECKSUM_BATCHES` environment variable (`0` or `1`) if that was
/// never called.
pub(crate) fn batches_on() -> bool {
    from_env();
    BATCHES.load(Ordering::Relaxed)
}

/// How the fingerprints a call takes will be compared.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    /// Bit for bit only (parameters, block inputs): on the CPU, a digest of
    /// the bytes without the sums (`digest`); elsewhere the checksum.
    Bits,
    /// Bit for bit or within a tolerance (recomputed outputs): on the CPU,
    /// the digest and sums of their own (`summed`); elsewhere the checksum.
    Sums,
    /// The checksum on every device (what [`crate::inspect::checksums`]
    /// gives).
    Checksum,
}

/// The checksums of `values` one after the other (`None`: a value not
/// compared, four zeros), [`WORDS`] `f64`s per value, as 1-D tensors to be
/// joined in order: none for no value, one on the CPU (no op and no tensor
/// per value), one on CUDA with the batch kernels (two launches per dtype
/// and [`device::BATCH`] values), otherwise one per value ([`of`]; zeros on
/// the CPU for a value not compared). On the CPU, [`Kind::Bits`] takes a
/// value's digest and [`Kind::Sums`] its digest and sums.
pub(crate) fn of_all(values: &[Option<&Tensor>], kind: Kind) -> Result<Vec<Tensor>> {
    if values.is_empty() {
        return Ok(Vec::new());
    }
    let device = values
        .iter()
        .flatten()
        .next()
        .map_or(Device::Cpu, |t| t.device().clone());
    let on_one = values
        .iter()
        .flatten()
        .all(|t| t.device().same_device(&device));
    if device.is_cpu() && on_one {
        let words = together::fingerprints(values, kind);
        return Ok(vec![Tensor::from_vec(
            words,
            values.len() * WORDS,
            &device,
        )?]);
    }
    if device.is_cuda() && on_one && kernels_on() && batches_on() {
        if let Some(sums) = device::on_cuda_batched(values, &device)? {
            return Ok(vec![sums]);
        }
    }
    values
        .iter()
        .map(|v| match v {
            Some(t) => of(t),
            None => Ok(Tensor::zeros(WORDS, candle_core::DType::F64, &Device::Cpu)?),
        })
        .collect()
}

/// The fingerprint of a CPU value compared only bit for bit, read now: its
/// digest (`digest`), or its checksum for a dtype without one. `None` off
/// the CPU.
pub(crate) fn bits_on_cpu(t: &Tensor) -> Option<[f64; WORDS]> {
    if !t.device().is_cpu() {
        return None;
    }
    let words = together::fingerprints(&[Some(t)], Kind::Bits);
    let mut out = [0.0; WORDS];
    out.copy_from_slice(&words);
    Some(out)
}

/// The checksum of `t`, a 1-D `f64` tensor of [`WORDS`] elements on `t`'s
/// device.
pub(crate) fn of(t: &Tensor) -> Result<Tensor> {
    if t.device().is_cpu() || (t.device().is_cuda() && kernels_on()) {
        Ok(t.detach().apply_op1_no_bwd(&Checksum)?)
    } else {
        composed::of(t)
    }
}

/// The sums of one lane, one chunk, or a whole value: the two hash words
/// and the three sums.
#[derive(Clone, Copy, Default, Debug, PartialEq)]
pub(crate) struct Partial {
    pub h0: u32,
    pub h1: u32,
    pub sum: f64,
    pub abs: f64,
    pub weighted: f64,
}

impl Partial {
    /// `self + other`, hash words modulo 2^32.
    #[inline(always)]
    pub fn add(self, other: &Partial) -> Partial {
        Partial {
            h0: self.h0.wrapping_add(other.h0),
            h1: self.h1.wrapping_add(other.h1),
            sum: self.sum + other.sum,
            abs: self.abs + other.abs,
            weighted: self.weighted + other.weighted,
        }
    }

    /// A chunk's lanes added pairwise: lane `t` takes lane `t + s` for
    /// `s = LANES / 2, ..., 1` (a block's reduction in shared memory).
    pub fn tree(lanes: &mut [Partial; LANES]) -> Partial {
        let mut s = LANES / 2;
        while s > 0 {
            for t in 0..s {
                lanes[t] = lanes[t].add(&lanes[t + s]);
            }
            s /= 2;
        }
        lanes[0]
    }

    /// The chunks' sums added as one block of the combine kernel does: lane
    /// `t` adds chunks `t, t + LANES, ...` in order, from zero; then the
    /// lanes' [`tree`](Self::tree).
    pub fn fold(chunks: &[Partial]) -> Partial {
        let mut lanes = [Partial::default(); LANES];
        for (c, chunk) in chunks.iter().enumerate() {
            lanes[c % LANES] = lanes[c % LANES].add(chunk);
        }
        Partial::tree(&mut lanes)
    }

    /// The four numbers of a checksum.
    pub fn finish(&self) -> [f64; WORDS] {
        let hash = u64::from(self.h0) | (u64::from(self.h1 & 0x1f_ffff) << 32);
        [hash as f64, self.sum, self.abs, self.weighted]
    }
}

/// The checksum as a candle op without a backward: its output is the
/// checksum, computed on the input's device.
struct Checksum;

impl candle_core::CustomOp1 for Checksum {
    fn name(&self) -> &'static str {
        "remat-checksum"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let words = cpu::checksum(storage, layout).finish();
        Ok((CpuStorage::F64(words.to_vec()), Shape::from(WORDS)))
    }

    fn cuda_fwd(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        device::on_cuda(storage, layout).map(|s| (s, Shape::from(WORDS)))
    }
}

#[cfg(test)]
mod tests;
