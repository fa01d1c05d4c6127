//! The launches of `bias.cu`'s kernels on candle's CUDA device.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp2, Layout, Result, Tensor};
use half::{bf16, f16};

use super::cuda::{device, hand, storage, view};

/// `bias.cu` compiled by `build.rs`.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/bias.ptx"));
const MODULE: &str = "remat_bias";
/// Rows of a chunk (`BIAS_CHUNK` of bias.cu).
const CHUNK: usize = 64;
const THREADS: u32 = 256;

/// A thread per feature, a row of blocks per chunk of rows.
fn config(rows: usize, n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(THREADS), rows.div_ceil(CHUNK) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn name(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(
            other,
            "bias kernels",
        )),
    }
}

/// `(rows, n)` as the kernels' ints.
fn ints(rows: usize, n: usize) -> Result<(i32, i32)> {
    let int = |v: usize| {
        i32::try_from(v)
            .map_err(|_| candle_core::Error::Msg(format!("bias: {v} does not fit the kernels")))
    };
    Ok((int(rows)?, int(n)?))
}

/// Adds a bias `(n)` to the rows of a contiguous `(rows, n)` tensor, in
/// place.
struct BiasAdd;

impl InplaceOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "remat-bias-add"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("remat bias kernels: called on the CPU")
    }
    fn cuda_fwd(
        &self,
        y: &mut CudaStorage,
        ly: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> Result<()> {
        match y.dtype() {
            DType::F32 => add_as::<f32>(y, ly, b, lb),
            DType::F16 => add_as::<f16>(y, ly, b, lb),
            DType::BF16 => add_as::<bf16>(y, ly, b, lb),
            other => Err(candle_core::Error::UnsupportedDTypeForOp(
                other,
                "bias kernels",
            )),
        }
    }
}

fn add_as<T: CudaDType + DeviceRepr + candle_core::WithDType>(
    y: &mut CudaStorage,
    ly: &Layout,
    b: &CudaStorage,
    lb: &Layout,
) -> Result<()> {
    let (Some((y0, _)), Some((b0, _))) = (ly.contiguous_offsets(), lb.contiguous_offsets()) else {
        candle_core::bail!("remat bias kernels: a tensor is not contiguous")
    };
    let (rows, n) = ly.shape().dims2()?;
    if lb.shape().elem_count() != n {
        candle_core::bail!("remat bias kernels: the bias has not {n} elements");
    }
    let (r, c) = ints(rows, n)?;
    let dev = y.device.clone();
    let bv = b.as_cuda_slice::<T>()?.slice(b0..);
    let mut yv = y.as_cuda_slice_mut::<T>()?.slice_mut(y0..);
    let func =
        dev.get_or_load_custom_func(&format!("bias_add_{}", name(T::DTYPE)?), MODULE, PTX)?;
    let mut builder = func.builder();
    builder.arg(&r);
    builder.arg(&c);
    builder.arg(&mut yv);
    builder.arg(&bv);
    // SAFETY: (int rows, int n, T* y, const T* b) in order; y holds `rows x
    // n` contiguous elements from its offset, b `n`; a thread per feature
    // and chunk of rows.
    unsafe { builder.launch(config(rows, n)) }.w()?;
    Ok(())
}

/// `y += b` over the rows of `y` `(rows, n)`, contiguous, in place.
pub(super) fn bias_add(y: &Tensor, b: &Tensor) -> Result<()> {
    y.inplace_op2(b, &BiasAdd)
}

/// The sum of the rows of `x` `(rows, n)`, in f32, then `x`'s dtype.
pub(super) fn sum_rows(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    let (rows, n) = x.dims2()?;
    let (r, c) = ints(rows, n)?;
    let chunks = rows.div_ceil(CHUNK);
    let dev = device(&x)?;
    let sums = {
        let (xs, xl) = storage(&x)?;
        let sums = match x.dtype() {
            DType::F32 => launch_sums::<f32>(&dev, view::<f32>(&xs, &xl)?, r, c, chunks)?,
            DType::F16 => launch_sums::<f16>(&dev, view::<f16>(&xs, &xl)?, r, c, chunks)?,
            DType::BF16 => launch_sums::<bf16>(&dev, view::<bf16>(&xs, &xl)?, r, c, chunks)?,
            other => {
                return Err(candle_core::Error::UnsupportedDTypeForOp(
                    other,
                    "bias kernels",
                ))
            }
        };
        sums
    };
    hand(&x, sums, &dev, (chunks, n))?
        .sum(0)?
        .to_dtype(x.dtype())
}

fn launch_sums<T: CudaDType + DeviceRepr + candle_core::WithDType>(
    dev: &candle_core::CudaDevice,
    x: candle_core::cuda_backend::cudarc::driver::CudaView<'_, T>,
    rows: i32,
    n: i32,
    chunks: usize,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>> {
    // SAFETY: a thread per (chunk, feature) writes each element.
    let sums = unsafe { dev.alloc::<f32>(chunks * n as usize)? };
    let func =
        dev.get_or_load_custom_func(&format!("column_sums_{}", name(T::DTYPE)?), MODULE, PTX)?;
    let mut builder = func.builder();
    builder.arg(&rows);
    builder.arg(&n);
    builder.arg(&x);
    builder.arg(&sums);
    // SAFETY: (int rows, int n, const T* x, float* sums) in order; x holds
    // `rows x n` contiguous elements; a thread per feature and chunk.
    unsafe { builder.launch(config(rows as usize, n as usize)) }.w()?;
    Ok(sums)
}
