//! Bytes in use on a device, for memory figures beyond the CPU.

use candle_core::Device;

use crate::Result;

/// Device memory in use, in bytes, after synchronising the device: on CUDA,
/// the bytes candle has allocated and not freed from the device's memory
/// pool (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`; candle allocates with
/// `cuMemAllocAsync`), exact to the allocation, unmoved by what the pool
/// keeps reserved. On a CUDA device without memory pools: total minus free
/// memory as the driver reports it (the whole device, in the pool's
/// reservations of tens of MiB: compare differences). `None` on the CPU,
/// where [`CountingAlloc`](crate::inspect::CountingAlloc) counts exactly.
///
/// ```
/// use candle_core::Device;
/// assert_eq!(remat_runtime::inspect::device_memory_in_use(&Device::Cpu)?, None);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn device_memory_in_use(device: &Device) -> Result<Option<usize>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => {
            device.synchronize()?;
            if let Some(used) = pool::used(cuda)? {
                return Ok(Some(used));
            }
            let (free, total) = cuda
                .cuda_stream()
                .context()
                .mem_get_info()
                .map_err(driver_error)?;
            Ok(Some(total.saturating_sub(free)))
        }
        _ => Ok(None),
    }
}

/// The most bytes candle had allocated on the device at once since the last
/// [`reset_device_memory_peak`], after synchronising it: on CUDA, the
/// high-water mark of the device's memory pool, which candle's
/// stream-ordered allocations come from (`cuMemAllocAsync`). `None` on the
/// CPU (use [`CountingAlloc::peak`](crate::inspect::CountingAlloc::peak)) and on CUDA devices without
/// memory pools.
///
/// ```
/// use candle_core::Device;
/// remat_runtime::inspect::reset_device_memory_peak(&Device::Cpu)?;
/// assert_eq!(remat_runtime::inspect::device_memory_peak(&Device::Cpu)?, None);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn device_memory_peak(device: &Device) -> Result<Option<usize>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => {
            device.synchronize()?;
            pool::used_high(cuda)
        }
        _ => Ok(None),
    }
}

/// Starts a new high-water mark for [`device_memory_peak`] at what is in
/// use now; a no-op on the CPU.
///
/// ```
/// remat_runtime::inspect::reset_device_memory_peak(&candle_core::Device::Cpu)?;
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn reset_device_memory_peak(device: &Device) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => {
            device.synchronize()?;
            pool::reset_high(cuda)
        }
        _ => Ok(()),
    }
}

/// A CUDA driver error as a candle error.
#[cfg(feature = "cuda")]
pub(crate) fn driver_error(
    e: candle_core::cuda_backend::cudarc::driver::DriverError,
) -> candle_core::Error {
    candle_core::Error::Msg(format!("CUDA driver: {e:?}"))
}

#[cfg(feature = "cuda")]
mod pool {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    use candle_core::CudaDevice;

    use super::driver_error;
    use crate::Result;

    /// The memory pool candle's allocations on `dev` come from: cudarc
    /// allocates with `cuMemAllocAsync`, from the device's current pool,
    /// exactly when the context supports it; `None` otherwise.
    fn current_pool(dev: &CudaDevice) -> Result<Option<sys::CUmemoryPool>> {
        let ctx = dev.cuda_stream().context().clone();
        if !ctx.has_async_alloc() {
            return Ok(None);
        }
        ctx.bind_to_thread().map_err(driver_error)?;
        // SAFETY: `cu_device()` is the handle cudarc obtained from
        // `cuDeviceGet` when it created this context, which stays alive for
        // the call (we hold an `Arc` to it): the requirement of
        // `cuDeviceGetMemPool`.
        let pool =
            unsafe { result::device::get_mem_pool(ctx.cu_device()) }.map_err(driver_error)?;
        Ok(Some(pool))
    }

    /// A byte count of the pool: `attr` read, or with `reset` set to zero
    /// (which the driver accepts for the high-water marks only; the value
    /// returned is then meaningless).
    fn attribute(
        dev: &CudaDevice,
        attr: sys::CUmemPool_attribute_enum,
        reset: bool,
    ) -> Result<Option<usize>> {
        let Some(pool) = current_pool(dev)? else {
            return Ok(None);
        };
        let mut value: u64 = 0;
        let ptr = (&mut value as *mut u64).cast();
        // SAFETY: `pool` was just returned by the driver for a live context;
        // the attributes asked here (`USED_MEM_CURRENT`, `USED_MEM_HIGH`)
        // are `cuuint64_t`s and `value` is a valid, aligned `u64` that
        // outlives the call, read by the setter and written by the getter.
        let done = unsafe {
            if reset {
                result::mem_pool::set_attribute(pool, attr, ptr)
            } else {
                result::mem_pool::get_attribute(pool, attr, ptr)
            }
        };
        done.map_err(driver_error)?;
        Ok(Some(value as usize))
    }

    /// The bytes allocated from the pool and not freed.
    pub(super) fn used(dev: &CudaDevice) -> Result<Option<usize>> {
        let attr = sys::CUmemPool_attribute_enum::CU_MEMPOOL_ATTR_USED_MEM_CURRENT;
        attribute(dev, attr, false)
    }

    /// The pool's high-water mark; with `reset`, resets it to what is in
    /// use now instead.
    fn high_water(dev: &CudaDevice, reset: bool) -> Result<Option<usize>> {
        let attr = sys::CUmemPool_attribute_enum::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        attribute(dev, attr, reset)
    }

    pub(super) fn used_high(dev: &CudaDevice) -> Result<Option<usize>> {
        high_water(dev, false)
    }

    pub(super) fn reset_high(dev: &CudaDevice) -> Result<()> {
        high_water(dev, true).map(|_| ())
    }
}
