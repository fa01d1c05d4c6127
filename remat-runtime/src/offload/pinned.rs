//! Offloaded CUDA storages in page-locked (pinned) host memory.
//!
//! Both copies are queued on the stream candle runs everything on, so they
//! are ordered with candle's kernels without events: the device-to-host copy
//! runs after the kernels that wrote the storage, the device buffer is freed
//! after the copy (cudarc frees stream-ordered), and the host-to-device copy
//! runs before the kernels of the backward that read it. The host does not
//! wait for either copy; cudarc's pinned buffer waits for its last copy
//! before it is freed.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, PinnedHostSlice};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::CudaStorage;

use crate::inspect::device_memory::driver_error;

/// The bytes of one CUDA storage in pinned host memory.
pub(crate) struct Pinned(PinnedHostSlice<u8>);

fn no_view() -> candle_core::Error {
    candle_core::Error::Msg("remat: a byte view of a CUDA buffer did not fit it".into())
}

/// Queues a copy of `s` into a new pinned buffer.
fn out<T: DeviceRepr>(s: &CudaSlice<T>) -> candle_core::Result<Pinned> {
    let stream = s.stream();
    let n = s.num_bytes();
    // SAFETY: the buffer is uninitialised; the copy queued below writes all
    // `n` bytes of it, and nothing reads it except the copy back, which is
    // queued on the same stream after this one.
    let mut host =
        unsafe { stream.context().alloc_pinned_with_flags::<u8>(n, 0) }.map_err(driver_error)?;
    // SAFETY: a view of the slice's own `n` bytes as `u8`, for which every
    // bit pattern is valid.
    let bytes = unsafe { s.transmute::<u8>(n) }.ok_or_else(no_view)?;
    stream
        .memcpy_dtoh(&bytes, &mut host)
        .map_err(driver_error)?;
    Ok(Pinned(host))
}

/// A new device buffer like `like`, filled from `host` by a queued copy.
fn back<T: DeviceRepr>(like: &CudaSlice<T>, host: &Pinned) -> candle_core::Result<CudaSlice<T>> {
    let stream = like.stream();
    let n = host.0.len();
    let size = std::mem::size_of::<T>();
    if size == 0 || n % size != 0 {
        return Err(candle_core::Error::Msg(format!(
            "remat: {n} offloaded bytes are not a whole number of {size}-byte elements"
        )));
    }
    // SAFETY: the buffer is uninitialised; the copy queued below overwrites
    // all of it before any kernel, queued later on the same stream, reads it.
    let mut dst = unsafe { stream.alloc::<T>(n / size) }.map_err(driver_error)?;
    {
        // SAFETY: a view of `dst`'s own `n` bytes as `u8`.
        let mut bytes = unsafe { dst.transmute_mut::<u8>(n) }.ok_or_else(no_view)?;
        stream
            .memcpy_htod(&host.0, &mut bytes)
            .map_err(driver_error)?;
    }
    Ok(dst)
}

/// `$body` with `$x` bound to the typed slice of any variant.
macro_rules! each_variant {
    ($slice:expr, $x:ident => $body:expr) => {
        match $slice {
            CudaStorageSlice::U8($x) => $body,
            CudaStorageSlice::U32($x) => $body,
            CudaStorageSlice::I16($x) => $body,
            CudaStorageSlice::I32($x) => $body,
            CudaStorageSlice::I64($x) => $body,
            CudaStorageSlice::BF16($x) => $body,
            CudaStorageSlice::F16($x) => $body,
            CudaStorageSlice::F32($x) => $body,
            CudaStorageSlice::F64($x) => $body,
            CudaStorageSlice::F8E4M3($x) => $body,
            CudaStorageSlice::F6E2M3($x) => $body,
            CudaStorageSlice::F6E3M2($x) => $body,
            CudaStorageSlice::F4($x) => $body,
            CudaStorageSlice::F8E8M0($x) => $body,
        }
    };
}

/// The same variant, with the slice `$body` makes from `$x`.
macro_rules! same_variant {
    ($slice:expr, $x:ident => $body:expr) => {
        match $slice {
            CudaStorageSlice::U8($x) => CudaStorageSlice::U8($body),
            CudaStorageSlice::U32($x) => CudaStorageSlice::U32($body),
            CudaStorageSlice::I16($x) => CudaStorageSlice::I16($body),
            CudaStorageSlice::I32($x) => CudaStorageSlice::I32($body),
            CudaStorageSlice::I64($x) => CudaStorageSlice::I64($body),
            CudaStorageSlice::BF16($x) => CudaStorageSlice::BF16($body),
            CudaStorageSlice::F16($x) => CudaStorageSlice::F16($body),
            CudaStorageSlice::F32($x) => CudaStorageSlice::F32($body),
            CudaStorageSlice::F64($x) => CudaStorageSlice::F64($body),
            CudaStorageSlice::F8E4M3($x) => CudaStorageSlice::F8E4M3($body),
            CudaStorageSlice::F6E2M3($x) => CudaStorageSlice::F6E2M3($body),
            CudaStorageSlice::F6E3M2($x) => CudaStorageSlice::F6E3M2($body),
            CudaStorageSlice::F4($x) => CudaStorageSlice::F4($body),
            CudaStorageSlice::F8E8M0($x) => CudaStorageSlice::F8E8M0($body),
        }
    };
}

/// Queues a copy of the whole storage into pinned host memory.
pub(crate) fn copy_out(s: &CudaStorage) -> candle_core::Result<Pinned> {
    each_variant!(&s.slice, x => out(x))
}

/// Replaces the storage's (one-element) buffer by a full one filled from
/// `host`, of the same dtype.
pub(crate) fn copy_back(s: &mut CudaStorage, host: &Pinned) -> candle_core::Result<()> {
    s.slice = same_variant!(&s.slice, x => back(x, host)?);
    Ok(())
}
