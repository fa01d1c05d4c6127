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

/// Elements per chunk of the parallel pass (and lanes per chunk).
const CHUNK: usize = 1 << 16;
const LANES: usize = 4;
/// Golden-ratio increment: position `i`'s weight is `(i * PHI mod 2^32) / 2^32`.
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

/// The sums of one run of elements.
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
        let total = |s: &[f64; LANES]| (s[0] + s[1]) + (s[2] + s[3]);
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

/// An element as its 32-bit words (one or two) and its value.
trait Element: Copy + Send + Sync {
    /// The element's bits, as one or two words.
    fn words(self) -> (u32, Option<u32>);
    fn value(self) -> f64;
}

macro_rules! element_32 {
    ($($t:ty => |$v:ident| ($bits:expr, $value:expr)),* $(,)?) => {$(
        impl Element for $t {
            #[inline(always)]
            fn words(self) -> (u32, Option<u32>) {
                let $v = self;
                ($bits, None)
            }
            #[inline(always)]
            fn value(self) -> f64 {
                let $v = self;
                $value
            }
        }
    )*};
}
element_32!(
    u8 => |v| (u32::from(v), f64::from(v)),
    u32 => |v| (v, f64::from(v)),
    i16 => |v| (u32::from(v as u16), f64::from(v)),
    i32 => |v| (v as u32, f64::from(v)),
    f32 => |v| (v.to_bits(), f64::from(v)),
    half::f16 => |v| (u32::from(v.to_bits()), v.to_f64()),
    half::bf16 => |v| (u32::from(v.to_bits()), v.to_f64()),
);

impl Element for f64 {
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

/// Adds `xs`, the elements at positions `start..start + xs.len()`, to `s`.
fn run<T: Element>(s: &mut Sums, xs: &[T], start: usize) {
    for (k, &x) in xs.iter().enumerate() {
        let i = (start + k) as u32;
        let lane = (start + k) % LANES;
        let key = i.wrapping_mul(PHI);
        let (lo, hi) = x.words();
        let a = fmix(lo ^ key);
        s.h0 = s.h0.wrapping_add(a);
        s.h1 = s.h1.wrapping_add(fmix(a ^ 0x5bd1_e995));
        if let Some(hi) = hi {
            let b = fmix(hi ^ key.rotate_left(16));
            s.h0 = s.h0.wrapping_add(b.rotate_left(11));
            s.h1 = s.h1.wrapping_add(fmix(b ^ 0x1b87_3593));
        }
        let v = x.value();
        s.sum[lane] += v;
        s.abs[lane] += v.abs();
        s.weighted[lane] += v * f64::from(key >> 8) * (1.0 / 16_777_216.0);
    }
}

/// The sums of the elements `layout` addresses in `data`, in row-major
/// order: each chunk of [`CHUNK`] positions summed on its own (in parallel
/// when the range is contiguous), the chunks' sums added in order, so that
/// a view and its contiguous copy give the same bits.
fn sums<T: Element>(data: &[T], layout: &Layout) -> Sums {
    let chunks: Vec<Sums> = match layout.contiguous_offsets() {
        Some((start, end)) => data[start..end]
            .par_chunks(CHUNK)
            .enumerate()
            .map(|(c, chunk)| {
                let mut s = Sums::default();
                run(&mut s, chunk, c * CHUNK);
                s
            })
            .collect(),
        None => strided(data, layout),
    };
    chunks.iter().fold(Sums::default(), |acc, s| acc.add(s))
}

/// The chunks' sums of a strided view, read row by row (the last
/// dimension) on this thread.
fn strided<T: Element>(data: &[T], layout: &Layout) -> Vec<Sums> {
    let dims = layout.dims();
    let stride = layout.stride();
    let (row_len, outer, row_stride) = match dims.split_last() {
        Some((&n, outer)) => (n, outer, stride[dims.len() - 1]),
        None => (1, &[][..], 1),
    };
    let rows: usize = outer.iter().product();
    let mut chunks = Vec::new();
    let mut acc = Sums::default();
    let mut position = 0;
    let mut index = vec![0usize; outer.len()];
    let mut gathered = Vec::with_capacity(row_len);
    for _ in 0..rows {
        let start = layout.start_offset()
            + index.iter().zip(stride).map(|(i, s)| i * s).sum::<usize>();
        let mut row = if row_stride == 1 {
            &data[start..start + row_len]
        } else {
            gathered.clear();
            gathered.extend((0..row_len).map(|k| data[start + k * row_stride]));
            &gathered[..]
        };
        while !row.is_empty() {
            let k = row.len().min(CHUNK - position % CHUNK);
            run(&mut acc, &row[..k], position);
            position += k;
            row = &row[k..];
            if position % CHUNK == 0 {
                chunks.push(std::mem::take(&mut acc));
            }
        }
        // The next row's index, the last outer dimension fastest.
        for (i, &d) in index.iter_mut().zip(outer).rev() {
            *i += 1;
            if *i < d {
                break;
            }
            *i = 0;
        }
    }
    if position % CHUNK != 0 {
        chunks.push(acc);
    }
    chunks
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
    let golden = f64::from(PHI) / 4_294_967_296.0;
    let scaled = (positions * golden)?;
    let weights = (&scaled - scaled.floor()?)?;
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
        let base: Vec<f32> = (0..300_000u64).map(|i| ((i * 7919) % 1000) as f32 / 7.0).collect();
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
        let x = Tensor::arange(0f64, 24.0, &dev).unwrap().reshape((2, 3, 4)).unwrap();
        for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16, DType::U32, DType::I64, DType::U8] {
            let t = x.to_dtype(dtype).unwrap();
            let c = words(&t);
            assert_eq!(c[1], 276.0, "{dtype:?}");
            let narrow = t.narrow(2, 1, 2).unwrap();
            assert_eq!(words(&narrow), words(&narrow.contiguous().unwrap()), "{dtype:?}");
            let changed = (t.to_dtype(DType::F64).unwrap() + 0.0)
                .unwrap()
                .slice_assign(&[0..1, 0..1, 0..1], &Tensor::ones((1, 1, 1), DType::F64, &dev).unwrap())
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            assert_ne!(words(&changed)[0], c[0], "{dtype:?}");
        }
        let empty = Tensor::zeros((0, 3), DType::F32, &dev).unwrap();
        assert_eq!(words(&empty), vec![0.0; WORDS]);
    }
}
