//! Bytes in use on a device, for memory figures beyond the CPU.

use candle_core::Device;

use crate::Result;

/// Device memory in use, in bytes, after synchronising the device: on CUDA,
/// total minus free memory as the driver reports it (the whole device: the
/// context, candle's kernels and other processes included, so compare
/// differences). `None` on the CPU, where [`crate::CountingAlloc`] counts
/// exactly.
///
/// ```
/// use candle_core::Device;
/// assert_eq!(remat_runtime::device_memory_in_use(&Device::Cpu)?, None);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn device_memory_in_use(device: &Device) -> Result<Option<usize>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => {
            device.synchronize()?;
            let (free, total) = cuda
                .cuda_stream()
                .context()
                .mem_get_info()
                .map_err(|e| candle_core::Error::Msg(format!("cuMemGetInfo: {e:?}")))?;
            Ok(Some(total.saturating_sub(free)))
        }
        _ => Ok(None),
    }
}
