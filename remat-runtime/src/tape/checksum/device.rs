//! The checksum on a GPU: two kernels of `checksum.cu`, one pass over the
//! value where it lies (a strided view read in place, no copy, no host
//! read), and their emulation on the CPU.
//!
//! 1. `checksum_partials_<dtype>`: one block of [`LANES`] threads per
//!    chunk; thread `t` sums lane `t` of its chunk (the positions `t`,
//!    `t + LANES`, ...: neighbouring threads read neighbouring elements),
//!    the block adds its lanes in shared memory in the tree of
//!    [`Partial::tree`] and writes the chunk's [`PARTIAL`] numbers;
//! 2. `checksum_combine`: one block; thread `t` adds the numbers of chunks
//!    `t, t + LANES, ...` in order, the block adds its lanes in the same
//!    tree, and writes the checksum's four.
//!
//! [`run`] is the one place that decides what is launched, with which
//! grid; [`Emulated`] runs the kernels' code, thread by thread, on the CPU,
//! so that tests on any machine hold the launches and their bits to the
//! CPU path's ([`super::cpu`]).

use candle_core::{CudaStorage, Layout};

use super::CHUNK;

/// Numbers per chunk between the two kernels: the hash words, then the
/// three sums (the words as exact `f64`s).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const PARTIAL: usize = 5;

/// What the checksum asks of a device: its two kernels.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) trait Kernels {
    /// The chunks' numbers, on the device.
    type Partials;
    /// The checksum, on the device.
    type Out;
    /// Launches `checksum_partials` over `chunks` blocks.
    fn partials(&self, chunks: usize) -> candle_core::Result<Self::Partials>;
    /// Launches `checksum_combine` on one block of [`LANES`](super::LANES) threads.
    fn combine(&self, partials: &Self::Partials, chunks: usize) -> candle_core::Result<Self::Out>;
    /// A checksum of zeros (an empty value), launching nothing.
    fn zeros(&self) -> candle_core::Result<Self::Out>;
}

/// The checksum of `n` elements on `k`'s device, and the number of kernels
/// it launched: two, none for an empty value.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn run<K: Kernels>(k: &K, n: usize) -> candle_core::Result<(K::Out, usize)> {
    if n == 0 {
        return Ok((k.zeros()?, 0));
    }
    let chunks = n.div_ceil(CHUNK);
    let partials = k.partials(chunks)?;
    Ok((k.combine(&partials, chunks)?, 2))
}

/// The checksum of a CUDA value by the kernels.
#[cfg(feature = "cuda")]
pub(super) fn on_cuda(storage: &CudaStorage, layout: &Layout) -> candle_core::Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let dev = storage.device.clone();
    use candle_core::DType;
    let converted;
    let (storage, layout) = match storage.dtype() {
        DType::U8
        | DType::U32
        | DType::I16
        | DType::I32
        | DType::I64
        | DType::BF16
        | DType::F16
        | DType::F32
        | DType::F64 => (storage, layout),
        // 8-bit and smaller floats: through `f32`, as on the CPU.
        _ => {
            converted = (
                storage.to_dtype(layout, DType::F32)?,
                Layout::contiguous(layout.shape()),
            );
            (&converted.0, &converted.1)
        }
    };
    let (out, _) = run(
        &cuda::Cuda {
            dev: &dev,
            storage,
            layout,
        },
        layout.shape().elem_count(),
    )?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// Without the `cuda` feature there is no CUDA value to checksum.
#[cfg(not(feature = "cuda"))]
pub(super) fn on_cuda(_: &CudaStorage, _: &Layout) -> candle_core::Result<CudaStorage> {
    Err(candle_core::Error::NotCompiledWithCudaSupport)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, SlicePtrOrNull, WrapErr};
    use candle_core::{CudaDevice, CudaStorage, DType, Layout};

    use super::super::{LANES, WORDS};
    use super::{Kernels, PARTIAL};

    /// `checksum.cu` compiled by `build.rs` (nvcc, PTX for the build's
    /// compute capability).
    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/checksum.ptx"));
    const MODULE: &str = "remat_checksum";

    pub(super) struct Cuda<'a> {
        pub dev: &'a CudaDevice,
        pub storage: &'a CudaStorage,
        pub layout: &'a Layout,
    }

    impl Cuda<'_> {
        fn launch<T: CudaDType + DeviceRepr>(
            &self,
            dtype: &str,
            chunks: usize,
        ) -> candle_core::Result<CudaSlice<f64>> {
            let func = self.dev.get_or_load_custom_func(
                &format!("checksum_partials_{dtype}"),
                MODULE,
                PTX,
            )?;
            let n = self.layout.shape().elem_count();
            let dims = self.layout.dims().len();
            // Dims and strides of a strided view (none for a contiguous one).
            let info = SlicePtrOrNull::params_from_layout(self.dev, self.layout)?;
            let src = self.storage.as_cuda_slice::<T>()?;
            let src = src.slice(self.layout.start_offset()..);
            // SAFETY: every element is written before it is read: block `c`
            // writes the `PARTIAL` numbers of chunk `c`, for every `c`.
            let out = unsafe { self.dev.alloc::<f64>(chunks * PARTIAL)? };
            let mut b = func.builder();
            b.arg(&n);
            b.arg(&dims);
            info.builder_arg(&mut b);
            b.arg(&src);
            b.arg(&out);
            let cfg = LaunchConfig {
                grid_dim: (chunks as u32, 1, 1),
                block_dim: (LANES as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match `checksum_partials`' parameters in
            // order and type (size_t, size_t, const size_t*, const T*,
            // double*); `src` holds the `n` elements `info` addresses, `out`
            // `chunks * PARTIAL` numbers, one block per chunk.
            unsafe { b.launch(cfg) }.w()?;
            Ok(out)
        }
    }

    impl Kernels for Cuda<'_> {
        type Partials = CudaSlice<f64>;
        type Out = CudaSlice<f64>;

        fn partials(&self, chunks: usize) -> candle_core::Result<CudaSlice<f64>> {
            use half::{bf16, f16};
            match self.storage.dtype() {
                DType::U8 => self.launch::<u8>("u8", chunks),
                DType::U32 => self.launch::<u32>("u32", chunks),
                DType::I16 => self.launch::<i16>("i16", chunks),
                DType::I32 => self.launch::<i32>("i32", chunks),
                DType::I64 => self.launch::<i64>("i64", chunks),
                DType::BF16 => self.launch::<bf16>("bf16", chunks),
                DType::F16 => self.launch::<f16>("f16", chunks),
                DType::F32 => self.launch::<f32>("f32", chunks),
                DType::F64 => self.launch::<f64>("f64", chunks),
                other => Err(candle_core::Error::UnsupportedDTypeForOp(other, "checksum")),
            }
        }

        fn combine(
            &self,
            partials: &CudaSlice<f64>,
            chunks: usize,
        ) -> candle_core::Result<CudaSlice<f64>> {
            let func = self
                .dev
                .get_or_load_custom_func("checksum_combine", MODULE, PTX)?;
            // SAFETY: `checksum_combine` writes all `WORDS` numbers.
            let out = unsafe { self.dev.alloc::<f64>(WORDS)? };
            let mut b = func.builder();
            b.arg(&chunks);
            b.arg(partials);
            b.arg(&out);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (LANES as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: (size_t, const double*, double*) as the kernel takes
            // them; `partials` holds `chunks * PARTIAL` numbers.
            unsafe { b.launch(cfg) }.w()?;
            Ok(out)
        }

        fn zeros(&self) -> candle_core::Result<CudaSlice<f64>> {
            self.dev.alloc_zeros::<f64>(WORDS)
        }
    }
}
