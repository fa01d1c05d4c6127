//! The checksum of a value: every element, with its position, in one pass
//! on the value's device.
//!
//! A checksum is four `f64`s (32 bytes on the tape):
//!
//! * `[0]`: a 53-bit hash of the elements' bits (two 32-bit hashes, one cut
//!   to 21 bits, so that it is an exact `f64`): each element's 32-bit words
//!   mixed with their position by a bijection (murmur3's finalizer) and
//!   summed. A change of any one element changes the hash for certain (the
//!   mix is a bijection of the word, the first sum is modulo 2^32); a swap
//!   or any other change is missed with probability about 2^-53. `0` on
//!   devices other than the CPU, where the sums below serve instead
//!   (computed by candle's own kernels);
//! * `[1]` the sum of the elements, `[2]` the sum of their magnitudes,
//!   `[3]` the sum of each element times a weight in `[0, 1)` set by its
//!   position (the fractional part of `i` times the golden ratio), all
//!   accumulated in `f64`: the part a tolerance can be applied to.
//!
//! Every number depends on the elements in row-major order only, never on
//! the layout (a transposed view and its contiguous copy have one
//! checksum), and is computed in a fixed order (lanes by position, chunks
//! combined in order), so that the same elements give the same bits.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Storage, Tensor};
use rayon::prelude::*;

use crate::Result;

/// Numbers in one checksum.
pub(crate) const WORDS: usize = 4;
/// Where each number stands in a checksum (the hash is at 0).
pub(crate) const SUM: usize = 1;
pub(crate) const MAGNITUDES: usize = 2;
pub(crate) const WEIGHTED: usize = 3;

/// Elements per chunk of the parallel pass: chunks start at positions that
/// are multiples of it, whatever the layout.
const CHUNK: usize = 1 << 16;
/// Elements summed in the element type's precision before the sums move to
/// `f64` (a block starts at a multiple of it).
const BLOCK: usize = 256;
/// Independent accumulators: position `i` goes to lane `i % LANES`.
const LANES: usize = 8;
/// Golden-ratio increment: position `i`'s key is `i * PHI mod 2^32`, its
/// weight the key's top 24 bits over 2^24.
const PHI: u32 = 0x9E37_79B9;

/// The checksum of `t`, a 1-D `f64` tensor of [`WORDS`] elements on `t`'s
/// device.
pub(crate) fn of(t: &Tensor) -> Result<Tensor> {
    let (storage, layout) = t.storage_and_layout();
    let sums = match &*storage {
        Storage::Cpu(cpu) => Some(on_cpu(cpu, layout)),
        _ => None,
    };
    drop(storage);
    match sums {
        Some(sums) => Ok(Tensor::new(&sums.finish(), &candle_core::Device::Cpu)?),
        None => on_device(t),
    }
}

/// The sums of one chunk of elements.
#[derive(Clone, Copy, Default)]
struct Sums {
    h0: u32,
    h1: u32,
    sum: [f64; LANES],
    abs: [f64; LANES],
    weighted: [f64; LANES],
}

impl Sums {
    fn add(mut self, other: &Sums) -> Sums {
        self.h0 = self.h0.wrapping_add(other.h0);
        self.h1 = self.h1.wrapping_add(other.h1);
        for l in 0..LANES {
            self.sum[l] += other.sum[l];
            self.abs[l] += other.abs[l];
            self.weighted[l] += other.weighted[l];
        }
        self
    }

    fn finish(&self) -> [f64; WORDS] {
        let total =
            |s: &[f64; LANES]| ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        let hash = u64::from(self.h0) | (u64::from(self.h1 & 0x1f_ffff) << 32);
        [
            hash as f64,
            total(&self.sum),
            total(&self.abs),
            total(&self.weighted),
        ]
    }
}

/// murmur3's 32-bit finalizer: a bijection that spreads every input bit.
#[inline(always)]
fn fmix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^= x >> 13;
    x = x.wrapping_mul(0xc2b2_ae35);
    x ^ (x >> 16)
}

/// The precision a block of elements is summed in: `f32` for elements of
/// up to 32 bits, `f64` for wider ones.
trait Acc: Copy + Default + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> + Send {
    fn abs(self) -> Self;
    /// The weight of a position's key: its top 24 bits over 2^24 (exact).
    fn weight(key: u32) -> Self;
    fn to_f64(self) -> f64;
}

impl Acc for f32 {
    #[inline(always)]
    fn abs(self) -> Self {
        f32::abs(self)
    }
    #[inline(always)]
    fn weight(key: u32) -> Self {
        (key >> 8) as f32 * (1.0 / 16_777_216.0)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Acc for f64 {
    #[inline(always)]
    fn abs(self) -> Self {
        f64::abs(self)
    }
    #[inline(always)]
    fn weight(key: u32) -> Self {
        f64::from(key >> 8) * (1.0 / 16_777_216.0)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
}

/// An element: its 32-bit words (one or two) and its value.
trait Element: Copy + Send + Sync + Default {
    type Acc: Acc;
    /// The element's bits, as one or two words.
    fn words(self) -> (u32, Option<u32>);
    fn value(self) -> Self::Acc;
}

macro_rules! element_32 {
    ($($t:ty => |$v:ident| ($bits:expr, $value:expr)),* $(,)?) => {$(
        impl Element for $t {
            type Acc = f32;
            #[inline(always)]
            fn words(self) -> (u32, Option<u32>) {
                let $v = self;
                ($bits, None)
            }
            #[inline(always)]
            fn value(self) -> f32 {
                let $v = self;
                $value
            }
        }
    )*};
}
element_32!(
    u8 => |v| (u32::from(v), f32::from(v)),
    u32 => |v| (v, v as f32),
    i16 => |v| (u32::from(v as u16), f32::from(v)),
    i32 => |v| (v as u32, v as f32),
    f32 => |v| (v.to_bits(), v),
    half::f16 => |v| (u32::from(v.to_bits()), v.to_f32()),
    half::bf16 => |v| (u32::from(v.to_bits()), v.to_f32()),
);

impl Element for f64 {
    type Acc = f64;
    #[inline(always)]
    fn words(self) -> (u32, Option<u32>) {
        let b = self.to_bits();
        (b as u32, Some((b >> 32) as u32))
    }
    #[inline(always)]
    fn value(self) -> f64 {
        self
    }
}

impl Element for i64 {
    type Acc = f64;
    #[inline(always)]
    fn words(self) -> (u32, Option<u32>) {
        let b = self as u64;
        (b as u32, Some((b >> 32) as u32))
    }
    #[inline(always)]
    fn value(self) -> f64 {
        self as f64
    }
}

/// The two hash terms of an element whose position's key is `key`: a
/// bijection of its first word (so that any change of one element changes
/// the first term), and that term times an odd number set by the position.
#[inline(always)]
fn mix<T: Element>(x: T, key: u32) -> (u32, u32) {
    let (lo, hi) = x.words();
    let a = fmix(lo ^ key);
    let mut h0 = a;
    let mut h1 = a.wrapping_mul(key | 1);
    if let Some(hi) = hi {
        let b = fmix(hi ^ key.rotate_left(16));
        h0 = h0.wrapping_add(b.rotate_left(11));
        h1 = h1.wrapping_add(b.wrapping_mul(key.rotate_left(16) | 1));
    }
    (h0, h1)
}

/// [`chunk`], with AVX2 where the CPU has it (8 lanes of 32-bit integer
/// multiplies in one instruction; the same operations in the same order, so
/// the same bits).
fn chunk_fast<T: Element>(xs: &[T], start: usize) -> Sums {
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
unsafe fn chunk_avx2<T: Element>(xs: &[T], start: usize) -> Sums {
    chunk(xs, start)
}

/// The sums of one chunk: `xs` are the elements at positions `start..`,
/// `start` a multiple of [`CHUNK`]. Blocks of [`BLOCK`] elements are summed
/// lane by lane in the element's precision, then added to the `f64` sums.
#[inline(always)]
fn chunk<T: Element>(xs: &[T], start: usize) -> Sums {
    let mut s = Sums::default();
    let mut h0 = [0u32; LANES];
    let mut h1 = [0u32; LANES];
    for (b, block) in xs.chunks(BLOCK).enumerate() {
        let first = (start + b * BLOCK) as u32;
        let mut sum = [T::Acc::default(); LANES];
        let mut abs = [T::Acc::default(); LANES];
        let mut weighted = [T::Acc::default(); LANES];
        let mut lanes = block.chunks_exact(LANES);
        for (g, group) in (&mut lanes).enumerate() {
            let base = first.wrapping_add((g * LANES) as u32);
            for l in 0..LANES {
                let key = base.wrapping_add(l as u32).wrapping_mul(PHI);
                let (a, c) = mix(group[l], key);
                h0[l] = h0[l].wrapping_add(a);
                h1[l] = h1[l].wrapping_add(c);
                let v = group[l].value();
                sum[l] = sum[l] + v;
                abs[l] = abs[l] + v.abs();
                weighted[l] = weighted[l] + v * T::Acc::weight(key);
            }
        }
        let base = first.wrapping_add((block.len() - lanes.remainder().len()) as u32);
        for (l, &x) in lanes.remainder().iter().enumerate() {
            let key = base.wrapping_add(l as u32).wrapping_mul(PHI);
            let (a, c) = mix(x, key);
            h0[l] = h0[l].wrapping_add(a);
            h1[l] = h1[l].wrapping_add(c);
            let v = x.value();
            sum[l] = sum[l] + v;
            abs[l] = abs[l] + v.abs();
            weighted[l] = weighted[l] + v * T::Acc::weight(key);
        }
        for l in 0..LANES {
            s.sum[l] += sum[l].to_f64();
            s.abs[l] += abs[l].to_f64();
            s.weighted[l] += weighted[l].to_f64();
        }
    }
    for l in 0..LANES {
        s.h0 = s.h0.wrapping_add(h0[l]);
        s.h1 = s.h1.wrapping_add(h1[l]);
    }
    s
}

/// The sums of the elements `layout` addresses in `data`, in row-major
/// order: each chunk of [`CHUNK`] positions summed on its own (in parallel
/// when the range is contiguous; a strided view is gathered chunk by
/// chunk), the chunks' sums added in order, so that a view and its
/// contiguous copy give the same bits.
fn sums<T: Element>(data: &[T], layout: &Layout) -> Sums {
    let chunks: Vec<Sums> = match layout.contiguous_offsets() {
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
    chunks.iter().fold(Sums::default(), |acc, s| acc.add(s))
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

fn on_cpu(storage: &CpuStorage, layout: &Layout) -> Sums {
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
        other => other_dtype(other, layout),
    }
}

/// Any other dtype: its elements converted to `f32` by candle.
fn other_dtype(storage: &CpuStorage, layout: &Layout) -> Sums {
    match storage.to_dtype(layout, DType::F32) {
        Ok(CpuStorage::F32(d)) => sums(&d, &Layout::contiguous(layout.shape())),
        // A dtype candle cannot convert: checked by shape alone.
        _ => Sums::default(),
    }
}

/// The checksum on a device other than the CPU: the three sums by candle's
/// kernels (which sum in a fixed order: the same elements give the same
/// bits), no hashes.
fn on_device(t: &Tensor) -> Result<Tensor> {
    let x = t.detach().flatten_all()?.to_dtype(DType::F64)?;
    let n = x.elem_count();
    let positions = Tensor::arange(0u32, n as u32, x.device())?.to_dtype(DType::F64)?;
    // The CPU's weights: the top 24 bits of `i * PHI mod 2^32` (exact for
    // positions below 2^21, where `i * PHI` fits an `f64`'s mantissa).
    let golden = f64::from(PHI) / 4_294_967_296.0;
    let scaled = (positions * golden)?;
    let weights = ((&scaled - scaled.floor()?)? * 16_777_216.0)?
        .floor()?
        .affine(1.0 / 16_777_216.0, 0.0)?;
    let zero = Tensor::zeros(1, DType::F64, x.device())?;
    let sums = Tensor::stack(
        &[x.sum_all()?, x.abs()?.sum_all()?, (x * weights)?.sum_all()?],
        0,
    )?;
    Ok(Tensor::cat(&[zero, sums], 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn words(t: &Tensor) -> Vec<f64> {
        of(t).unwrap().to_vec1::<f64>().unwrap()
    }

    #[test]
    fn every_element_and_its_position_count() {
        let dev = Device::Cpu;
        let base: Vec<f32> = (0..300_000u64)
            .map(|i| ((i * 7919) % 1000) as f32 / 7.0)
            .collect();
        let t = Tensor::new(base.as_slice(), &dev).unwrap();
        let c = words(&t);
        // One element, one ulp.
        let mut one = base.clone();
        one[123_457] = f32::from_bits(one[123_457].to_bits() + 1);
        let d = words(&Tensor::new(one.as_slice(), &dev).unwrap());
        assert_ne!(c[0], d[0]);
        // Two elements swapped: the plain sums agree, the hashes and the
        // weighted sum do not.
        let mut swapped = base.clone();
        swapped.swap(10, 250_000);
        let s = words(&Tensor::new(swapped.as_slice(), &dev).unwrap());
        assert_eq!(c[1], s[1]);
        assert_ne!(c[0], s[0]);
        assert_ne!(c[3], s[3]);
        // The same elements give the same bits, however they are laid out.
        let m = t.reshape((600, 500)).unwrap();
        let tt = m.t().unwrap().contiguous().unwrap().t().unwrap();
        assert!(!tt.is_contiguous());
        assert_eq!(words(&m), words(&tt));
        assert_eq!(c, words(&t));
    }

    #[test]
    fn every_dtype_and_views() {
        let dev = Device::Cpu;
        let x = Tensor::arange(0f64, 24.0, &dev)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        for dtype in [
            DType::F64,
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::U32,
            DType::I64,
            DType::U8,
        ] {
            let t = x.to_dtype(dtype).unwrap();
            let c = words(&t);
            assert_eq!(c[1], 276.0, "{dtype:?}");
            let narrow = t.narrow(2, 1, 2).unwrap();
            assert_eq!(
                words(&narrow),
                words(&narrow.contiguous().unwrap()),
                "{dtype:?}"
            );
            let changed = (t.to_dtype(DType::F64).unwrap() + 0.0)
                .unwrap()
                .slice_assign(
                    &[0..1, 0..1, 0..1],
                    &Tensor::ones((1, 1, 1), DType::F64, &dev).unwrap(),
                )
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            assert_ne!(words(&changed)[0], c[0], "{dtype:?}");
        }
        let empty = Tensor::zeros((0, 3), DType::F32, &dev).unwrap();
        assert_eq!(words(&empty), vec![0.0; WORDS]);
    }

    #[test]
    fn the_device_path_computes_the_same_sums() {
        // The path other devices take, run on the CPU: candle's kernels for
        // the three sums, no hash.
        let t = Tensor::arange(0f32, 3000.0, &Device::Cpu)
            .unwrap()
            .affine(0.37, -400.0)
            .unwrap()
            .sin()
            .unwrap()
            .reshape((30, 100))
            .unwrap();
        for view in [t.clone(), t.t().unwrap()] {
            let cpu = words(&view);
            let device = on_device(&view).unwrap().to_vec1::<f64>().unwrap();
            assert_eq!(device.len(), WORDS);
            assert_eq!(device[0], 0.0);
            for k in 1..WORDS {
                // The CPU sums blocks of 256 elements in f32 first.
                let scale = cpu[2].abs().max(1.0);
                assert!(
                    (cpu[k] - device[k]).abs() <= 1e-6 * scale,
                    "{k}: {cpu:?} {device:?}"
                );
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    #[test]
    #[ignore]
    fn checksum_speed() {
        let t = Tensor::randn(0f32, 1.0, (4 << 20,), &candle_core::Device::Cpu).unwrap();
        let _ = of(&t).unwrap();
        let start = std::time::Instant::now();
        for _ in 0..20 {
            let _ = of(&t).unwrap();
        }
        let ns = start.elapsed().as_nanos() as f64 / 20.0 / (4 << 20) as f64;
        let start = std::time::Instant::now();
        for _ in 0..20 {
            let _ = t.sum_all().unwrap();
        }
        let sum = start.elapsed().as_nanos() as f64 / 20.0 / (4 << 20) as f64;
        println!("checksum {ns:.3} ns/element; candle sum_all {sum:.3} ns/element");
    }
}
