//! The kernels of `checksum.cu` run on the CPU, thread by thread, in their
//! order (tests only): what a GPU computes, checked on any machine against
//! the CPU path, launches counted by `device::run`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout};

use super::device::{run, Kernels, PARTIAL};
use super::element::{key, mix, Acc, Element};
use super::{Partial, CHUNK, LANES, ROWS, SPAN, WORDS};

/// The kernels' code run on the CPU, thread by thread, in the kernels'
/// order: what the device computes, for tests on any machine.
pub(crate) struct Emulated<'a, T> {
    data: &'a [T],
    layout: &'a Layout,
}

/// The storage offset of position `p` of a strided layout (the kernel's
/// `strided_offset`: the last dimension fastest).
fn strided_offset(mut p: usize, dims: &[usize], strides: &[usize]) -> usize {
    let mut offset = 0;
    for d in (0..dims.len()).rev() {
        offset += (p % dims[d]) * strides[d];
        p /= dims[d];
    }
    offset
}

impl<T: Element> Emulated<'_, T> {
    /// One block of `checksum_partials`: chunk `c`.
    fn block(&self, c: usize) -> Partial {
        let n = self.layout.shape().elem_count();
        let contiguous = self.layout.is_contiguous();
        let src = &self.data[self.layout.start_offset()..];
        let mut lanes = [Partial::default(); LANES];
        for (t, lane) in lanes.iter_mut().enumerate() {
            for span in 0..ROWS / SPAN {
                let mut sum = T::Acc::default();
                let mut abs = T::Acc::default();
                let mut weighted = T::Acc::default();
                for r in span * SPAN..(span + 1) * SPAN {
                    let p = c * CHUNK + r * LANES + t;
                    if p >= n {
                        break;
                    }
                    let offset = match contiguous {
                        true => p,
                        false => strided_offset(p, self.layout.dims(), self.layout.stride()),
                    };
                    let x = src[offset];
                    let k = key(p);
                    let (a, b) = mix(x, k);
                    lane.h0 = lane.h0.wrapping_add(a);
                    lane.h1 = lane.h1.wrapping_add(b);
                    let v = x.value();
                    sum = sum + v;
                    abs = abs + v.abs();
                    weighted = weighted + v * T::Acc::weight(k);
                }
                lane.sum += sum.to_f64();
                lane.abs += abs.to_f64();
                lane.weighted += weighted.to_f64();
            }
        }
        Partial::tree(&mut lanes)
    }
}

impl<T: Element> Kernels for Emulated<'_, T> {
    type Partials = Vec<f64>;
    type Out = [f64; WORDS];

    fn partials(&self, chunks: usize) -> candle_core::Result<Vec<f64>> {
        let mut out = Vec::with_capacity(chunks * PARTIAL);
        for c in 0..chunks {
            let p = self.block(c);
            out.extend([f64::from(p.h0), f64::from(p.h1), p.sum, p.abs, p.weighted]);
        }
        Ok(out)
    }

    fn combine(&self, partials: &Vec<f64>, chunks: usize) -> candle_core::Result<[f64; WORDS]> {
        // One block: thread `t` adds chunks `t, t + LANES, ...` in order.
        let mut lanes = [Partial::default(); LANES];
        for (t, lane) in lanes.iter_mut().enumerate() {
            for c in (t..chunks).step_by(LANES) {
                let p = &partials[c * PARTIAL..][..PARTIAL];
                let chunk = Partial {
                    h0: p[0] as u32,
                    h1: p[1] as u32,
                    sum: p[2],
                    abs: p[3],
                    weighted: p[4],
                };
                *lane = lane.add(&chunk);
            }
        }
        Ok(Partial::tree(&mut lanes).finish())
    }

    fn zeros(&self) -> candle_core::Result<[f64; WORDS]> {
        Ok([0.0; WORDS])
    }
}

/// The device's checksum of a CPU value, emulated, and the number of
/// kernels it launches.
pub(crate) fn emulate(
    storage: &CpuStorage,
    layout: &Layout,
) -> candle_core::Result<([f64; WORDS], usize)> {
    let n = layout.shape().elem_count();
    fn go<T: Element>(
        data: &[T],
        layout: &Layout,
        n: usize,
    ) -> candle_core::Result<([f64; WORDS], usize)> {
        run(&Emulated { data, layout }, n)
    }
    match storage {
        CpuStorage::U8(d) => go(d, layout, n),
        CpuStorage::U32(d) => go(d, layout, n),
        CpuStorage::I16(d) => go(d, layout, n),
        CpuStorage::I32(d) => go(d, layout, n),
        CpuStorage::I64(d) => go(d, layout, n),
        CpuStorage::BF16(d) => go(d, layout, n),
        CpuStorage::F16(d) => go(d, layout, n),
        CpuStorage::F32(d) => go(d, layout, n),
        CpuStorage::F64(d) => go(d, layout, n),
        other => match other.to_dtype(layout, DType::F32)? {
            CpuStorage::F32(d) => go(&d, &Layout::contiguous(layout.shape()), n),
            _ => Ok(([0.0; WORDS], 0)),
        },
    }
}
