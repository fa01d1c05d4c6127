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

use candle_core::{CudaStorage, DType, Layout};

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

/// Values per launch of the batch kernels (`BATCH` in `checksum.cu`).
pub(crate) const BATCH: usize = 16;
/// Dims of a strided value the batch kernels take (`MAX_DIMS`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const MAX_DIMS: usize = 6;

/// One launch of the batch kernels: the places, among the values asked
/// for, of up to [`BATCH`] values of one dtype.
#[derive(Debug, PartialEq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Launch {
    /// The dtype of its values (`None`: it has only values not compared).
    pub dtype: Option<DType>,
    pub members: Vec<usize>,
}

/// How values go to the batch kernels: one launch per dtype (in the order
/// the dtypes first come) and [`BATCH`] values, the values of a dtype in
/// order; those not compared (`None`, four zeros, any dtype) go with the
/// first launch that has room.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn launches(dtypes: &[Option<DType>]) -> Vec<Launch> {
    let mut groups: Vec<(Option<DType>, Vec<usize>)> = Vec::new();
    for (i, d) in dtypes.iter().enumerate() {
        let Some(d) = d else { continue };
        match groups.iter_mut().find(|(g, _)| *g == Some(*d)) {
            Some((_, members)) => members.push(i),
            None => groups.push((Some(*d), vec![i])),
        }
    }
    let mut out: Vec<Launch> = groups
        .into_iter()
        .flat_map(|(dtype, members)| {
            members
                .chunks(BATCH)
                .map(|m| Launch {
                    dtype,
                    members: m.to_vec(),
                })
                .collect::<Vec<_>>()
        })
        .collect();
    for (i, _) in dtypes.iter().enumerate().filter(|(_, d)| d.is_none()) {
        match out.iter_mut().find(|l| l.members.len() < BATCH) {
            Some(l) => l.members.push(i),
            None => out.push(Launch {
                dtype: None,
                members: vec![i],
            }),
        }
    }
    out
}

/// The kernels' name of a dtype they take: every dtype but the floats of
/// 8 bits or fewer.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn kernel_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::U8 => "u8",
        DType::U32 => "u32",
        DType::I16 => "i16",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        DType::F64 => "f64",
        _ => return None,
    })
}

/// A value as the batch kernels take it (`Value` in `checksum.cu`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq)]
pub(crate) struct Value {
    /// The address of its first element (the view's start).
    pub src: u64,
    pub n: u64,
    /// Its first chunk among the launch's.
    pub first_chunk: u64,
    /// Where its checksum goes, in checksums.
    pub slot: u64,
    /// 0: contiguous; else the number of dims and strides in `info`.
    pub num_dims: u64,
    pub info: [u64; 2 * MAX_DIMS],
}

/// The batch kernels' first parameter (`Batch` in `checksum.cu`), passed
/// by value: 2,184 bytes, under CUDA's 4 KiB of parameters.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq)]
pub(crate) struct Batch {
    pub count: u64,
    pub values: [Value; BATCH],
}

// The layout `checksum.cu` declares: 8-byte fields in order, no padding.
const _: () = {
    assert!(std::mem::size_of::<Value>() == 17 * 8);
    assert!(std::mem::offset_of!(Value, num_dims) == 32);
    assert!(std::mem::offset_of!(Value, info) == 40);
    assert!(std::mem::size_of::<Batch>() == 8 + BATCH * 17 * 8);
    assert!(std::mem::offset_of!(Batch, values) == 8);
};

impl Batch {
    /// The launch's parameter: each member's address and layout (`None`:
    /// not compared, no elements), its chunks after the previous members',
    /// its slot its place among the values asked for. Also the number of
    /// chunks, the grid of the partials kernel.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn pack(launch: &Launch, values: &[Option<(u64, &Layout)>]) -> (Batch, usize) {
        let mut batch = Batch {
            count: launch.members.len() as u64,
            ..Batch::default()
        };
        let mut chunks = 0usize;
        for (v, &i) in batch.values.iter_mut().zip(&launch.members) {
            v.slot = i as u64;
            v.first_chunk = chunks as u64;
            let Some((src, layout)) = values[i] else {
                continue;
            };
            v.src = src;
            v.n = layout.shape().elem_count() as u64;
            if !layout.is_contiguous() {
                let dims = layout.dims();
                v.num_dims = dims.len() as u64;
                for (k, &x) in dims.iter().chain(layout.stride()).enumerate() {
                    v.info[k] = x as u64;
                }
            }
            chunks += layout.shape().elem_count().div_ceil(CHUNK);
        }
        (batch, chunks)
    }

    /// The parameter's bytes as the kernel reads them (little-endian).
    #[cfg(test)]
    pub fn to_bytes(self) -> Vec<u8> {
        let mut out = self.count.to_le_bytes().to_vec();
        for v in &self.values {
            for x in [v.src, v.n, v.first_chunk, v.slot, v.num_dims]
                .iter()
                .chain(&v.info)
            {
                out.extend(x.to_le_bytes());
            }
        }
        out
    }
}

/// The checksums of several CUDA values (`None`: four zeros) by the batch
/// kernels, one after the other: two launches per [`Launch`], nothing
/// copied to the device first. `None` back if a value is not one the batch
/// kernels take (a float of 8 bits or fewer, or a view of more than
/// [`MAX_DIMS`] dims): the caller takes them one by one.
#[cfg(feature = "cuda")]
pub(super) fn on_cuda_batched(
    values: &[Option<&candle_core::Tensor>],
    device: &candle_core::Device,
) -> crate::Result<Option<candle_core::Tensor>> {
    let candle_core::Device::Cuda(dev) = device else {
        return Ok(None);
    };
    let taken = |t: &candle_core::Tensor| {
        kernel_name(t.dtype()).is_some()
            && (t.is_contiguous() || t.layout().dims().len() <= MAX_DIMS)
    };
    if !values.iter().flatten().all(|t| taken(t)) {
        return Ok(None);
    }
    let dtypes: Vec<Option<DType>> = values.iter().map(|v| v.map(|t| t.dtype())).collect();
    let out = cuda::batches(dev, values, &launches(&dtypes))?;
    Ok(Some(candle_core::Tensor::from_storage(
        candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev.clone())),
        values.len() * super::WORDS,
        candle_core::op::BackpropOp::none(),
        false,
    )))
}

/// Without the `cuda` feature there is no CUDA value to checksum.
#[cfg(not(feature = "cuda"))]
pub(super) fn on_cuda_batched(
    _: &[Option<&candle_core::Tensor>],
    _: &candle_core::Device,
) -> crate::Result<Option<candle_core::Tensor>> {
    Ok(None)
}

/// The checksum of a CUDA value by the kernels.
#[cfg(feature = "cuda")]
pub(super) fn on_cuda(storage: &CudaStorage, layout: &Layout) -> candle_core::Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let dev = storage.device.clone();
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
    use candle_core::{CudaDevice, CudaStorage, DType, Layout, Tensor};

    use super::super::{LANES, WORDS};
    use super::{Batch, Kernels, PARTIAL};

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

    // SAFETY: `Batch` is `repr(C)` plain data (integers only), laid out as
    // `checksum.cu`'s `Batch` (asserted beside it; `size_t` and pointers are
    // 64 bits on every target CUDA supports), passed by value as a kernel
    // parameter.
    unsafe impl DeviceRepr for Batch {}

    /// The device address of a CUDA value's first element.
    fn address(dev: &CudaDevice, t: &Tensor) -> candle_core::Result<u64> {
        use candle_core::cuda_backend::cudarc::driver::DevicePtr;
        use half::{bf16, f16};
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cuda(storage) = &*storage else {
            candle_core::bail!("checksum: a CUDA value on another device")
        };
        let stream = dev.cuda_stream();
        macro_rules! at {
            ($t:ty) => {{
                // cudarc records its read event (for other streams) when
                // `_read` drops, before the launch: candle runs every op
                // of a device on one stream, so no other stream waits on it.
                let (ptr, _read) = storage.as_cuda_slice::<$t>()?.device_ptr(&stream);
                ptr + (layout.start_offset() * std::mem::size_of::<$t>()) as u64
            }};
        }
        Ok(match storage.dtype() {
            DType::U8 => at!(u8),
            DType::U32 => at!(u32),
            DType::I16 => at!(i16),
            DType::I32 => at!(i32),
            DType::I64 => at!(i64),
            DType::BF16 => at!(bf16),
            DType::F16 => at!(f16),
            DType::F32 => at!(f32),
            DType::F64 => at!(f64),
            other => return Err(candle_core::Error::UnsupportedDTypeForOp(other, "checksum")),
        })
    }

    /// Runs `launches` over `values` into one buffer of their checksums.
    pub(super) fn batches(
        dev: &CudaDevice,
        values: &[Option<&Tensor>],
        launches: &[super::Launch],
    ) -> candle_core::Result<CudaSlice<f64>> {
        // SAFETY: every slot is written: each value is a member of exactly
        // one launch, whose combine kernel writes its `WORDS` numbers.
        let out = unsafe { dev.alloc::<f64>((values.len() * WORDS).max(1))? };
        // Each value's address and layout. The storages' guards are not
        // held over the launches: the values are borrowed for all of this
        // function, and the kernels run on the one stream of every candle
        // op on this device, after every earlier write and before any
        // later write or free.
        let placed = values
            .iter()
            .map(|v| match v {
                Some(t) => Ok(Some((address(dev, t)?, t.layout()))),
                None => Ok(None),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        for launch in launches {
            let (batch, chunks) = Batch::pack(launch, &placed);
            let name = launch.dtype.and_then(super::kernel_name).unwrap_or("f32");
            // SAFETY: block `g` writes the `PARTIAL` numbers of chunk `g`,
            // for every `g < chunks`, before the combine reads them.
            let partials = unsafe { dev.alloc::<f64>((chunks * PARTIAL).max(1))? };
            let lanes = (LANES as u32, 1, 1);
            if chunks > 0 {
                let func = dev.get_or_load_custom_func(
                    &format!("checksum_batch_partials_{name}"),
                    MODULE,
                    PTX,
                )?;
                let mut b = func.builder();
                b.arg(&batch);
                b.arg(&partials);
                let cfg = LaunchConfig {
                    grid_dim: (chunks as u32, 1, 1),
                    block_dim: lanes,
                    shared_mem_bytes: 0,
                };
                // SAFETY: (Batch, double*) as the kernel takes them; each
                // value's address holds the `n` elements its dims and
                // strides reach, of the launch's dtype; one block per chunk.
                unsafe { b.launch(cfg) }.w()?;
            }
            let func = dev.get_or_load_custom_func("checksum_batch_combine", MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&batch);
            b.arg(&partials);
            b.arg(&out);
            let cfg = LaunchConfig {
                grid_dim: (launch.members.len() as u32, 1, 1),
                block_dim: lanes,
                shared_mem_bytes: 0,
            };
            // SAFETY: (Batch, const double*, double*) as the kernel takes
            // them; `out` holds `WORDS` numbers per value, every slot below
            // `values.len()`; one block per member.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(out)
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
