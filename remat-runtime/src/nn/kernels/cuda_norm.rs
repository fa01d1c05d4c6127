//! The launches of `norm.cu`'s kernels on candle's CUDA device.

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{DType, Result, Tensor};
use half::{bf16, f16};

use super::cuda::{device, hand, storage, view};

/// `norm.cu` compiled by `build.rs`.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/norm.ptx"));
const MODULE: &str = "remat_norm";
/// Rows of a column chunk (`NORM_CHUNK` of norm.cu).
const CHUNK: usize = 64;
/// Threads per block: 8 warps, one row each.
const THREADS: u32 = 256;

fn name(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(
            other,
            "norm kernels",
        )),
    }
}

/// `(rows, c)` of `x`, as the kernels' ints.
fn sizes(x: &Tensor) -> Result<(i32, i32)> {
    let (rows, c) = x.dims2()?;
    let int = |n: usize| {
        i32::try_from(n)
            .map_err(|_| candle_core::Error::Msg(format!("norm: {n} does not fit the kernels")))
    };
    Ok((int(rows)?, int(c)?))
}

/// One warp per row.
fn rows_config(rows: i32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows as u32).div_ceil(THREADS / 32), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn forward(
    x: &Tensor,
    gain: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    match x.dtype() {
        DType::F32 => forward_as::<f32>(x, gain, bias, eps),
        DType::F16 => forward_as::<f16>(x, gain, bias, eps),
        DType::BF16 => forward_as::<bf16>(x, gain, bias, eps),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(
            other,
            "norm kernels",
        )),
    }
}

fn forward_as<T: CudaDType + DeviceRepr>(
    x: &Tensor,
    gain: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (x, gain) = (x.contiguous()?, gain.contiguous()?);
    let bias = bias.map(Tensor::contiguous).transpose()?;
    let (rows, c) = sizes(&x)?;
    let dev = device(&x)?;
    let n = x.elem_count();
    let (y, mean, rstd) = {
        let (xs, xl) = storage(&x)?;
        let (gs, gl) = storage(&gain)?;
        let b = bias.as_ref().map(storage).transpose()?;
        let (xv, gv) = (view::<T>(&xs, &xl)?, view::<T>(&gs, &gl)?);
        let bv = match &b {
            Some((s, l)) => view::<T>(s, l)?,
            None => view::<T>(&gs, &gl)?,
        };
        // SAFETY: each of the `rows` warps writes its row of `c` outputs
        // and its mean and rstd.
        let y = unsafe { dev.alloc::<T>(n)? };
        let mean = unsafe { dev.alloc::<f32>(rows as usize)? };
        let rstd = unsafe { dev.alloc::<f32>(rows as usize)? };
        let func = dev.get_or_load_custom_func(
            &format!("norm_forward_{}", name(x.dtype())?),
            MODULE,
            PTX,
        )?;
        let (eps, layer) = (eps as f32, i32::from(bias.is_some()));
        let mut builder = func.builder();
        builder.arg(&rows);
        builder.arg(&c);
        builder.arg(&xv);
        builder.arg(&gv);
        builder.arg(&bv);
        builder.arg(&eps);
        builder.arg(&layer);
        builder.arg(&y);
        builder.arg(&mean);
        builder.arg(&rstd);
        // SAFETY: (int rows, int c, const T* x, gain, bias, float eps, int
        // layer, T* y, float* mean, float* rstd) in order; x is `rows x c`
        // contiguous, gain and bias `c` (bias read only for a layer norm);
        // the grid holds a warp per row.
        unsafe { builder.launch(rows_config(rows)) }.w()?;
        (y, mean, rstd)
    };
    Ok((
        hand(&x, y, &dev, x.shape().clone())?,
        hand(&x, mean, &dev, (rows as usize, 1))?,
        hand(&x, rstd, &dev, (rows as usize, 1))?,
    ))
}

pub(super) fn backward(
    x: &Tensor,
    gain: &Tensor,
    dy: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    layer: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    match x.dtype() {
        DType::F32 => backward_as::<f32>(x, gain, dy, mean, rstd, layer),
        DType::F16 => backward_as::<f16>(x, gain, dy, mean, rstd, layer),
        DType::BF16 => backward_as::<bf16>(x, gain, dy, mean, rstd, layer),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(
            other,
            "norm kernels",
        )),
    }
}

fn backward_as<T: CudaDType + DeviceRepr>(
    x: &Tensor,
    gain: &Tensor,
    dy: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    layer: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (x, gain) = (x.contiguous()?, gain.contiguous()?);
    let dy = dy.to_dtype(x.dtype())?.contiguous()?;
    let (mean, rstd) = (mean.contiguous()?, rstd.contiguous()?);
    let (rows, c) = sizes(&x)?;
    let chunks = (rows as usize).div_ceil(CHUNK);
    let dev = device(&x)?;
    let n = x.elem_count();
    let (dx, dgain, dbias) = {
        let (xs, xl) = storage(&x)?;
        let (gs, gl) = storage(&gain)?;
        let (ds, dl) = storage(&dy)?;
        let (ms, ml) = storage(&mean)?;
        let (rs, rl) = storage(&rstd)?;
        let (xv, gv, dv) = (
            view::<T>(&xs, &xl)?,
            view::<T>(&gs, &gl)?,
            view::<T>(&ds, &dl)?,
        );
        let (mv, rv) = (view::<f32>(&ms, &ml)?, view::<f32>(&rs, &rl)?);
        // SAFETY: the dx kernel's warps write each row of `dx`; the column
        // kernel's threads each (chunk, feature) of both sums.
        let dx = unsafe { dev.alloc::<f32>(n)? };
        let dgain = unsafe { dev.alloc::<f32>(chunks * c as usize)? };
        let dbias = unsafe { dev.alloc::<f32>(chunks * c as usize)? };
        let dtype = name(x.dtype())?;
        let layer = i32::from(layer);
        let func =
            dev.get_or_load_custom_func(&format!("norm_backward_dx_{dtype}"), MODULE, PTX)?;
        let mut builder = func.builder();
        builder.arg(&rows);
        builder.arg(&c);
        builder.arg(&xv);
        builder.arg(&gv);
        builder.arg(&dv);
        builder.arg(&mv);
        builder.arg(&rv);
        builder.arg(&layer);
        builder.arg(&dx);
        // SAFETY: (int rows, int c, const T* x, gain, dy, const float* mean,
        // rstd, int layer, float* dx) in order; x and dy `rows x c`
        // contiguous, mean and rstd `rows`; a warp per row.
        unsafe { builder.launch(rows_config(rows)) }.w()?;
        let func =
            dev.get_or_load_custom_func(&format!("norm_backward_columns_{dtype}"), MODULE, PTX)?;
        let mut builder = func.builder();
        builder.arg(&rows);
        builder.arg(&c);
        builder.arg(&xv);
        builder.arg(&dv);
        builder.arg(&mv);
        builder.arg(&rv);
        builder.arg(&dgain);
        builder.arg(&dbias);
        let cfg = LaunchConfig {
            grid_dim: ((c as u32).div_ceil(THREADS), chunks as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: (int rows, int c, const T* x, dy, const float* mean, rstd,
        // float* dgain, float* dbias) in order; the grid holds a thread per
        // feature and a row of blocks per chunk of CHUNK rows (`fit` keeps
        // the chunks within the grid's 65,535).
        unsafe { builder.launch(cfg) }.w()?;
        (dx, dgain, dbias)
    };
    let sum = |t| -> Result<Tensor> { hand(&x, t, &dev, (chunks, c as usize))?.sum(0) };
    Ok((
        hand(&x, dx, &dev, x.shape().clone())?,
        sum(dgain)?,
        sum(dbias)?,
    ))
}
