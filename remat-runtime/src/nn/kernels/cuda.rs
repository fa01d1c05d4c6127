//! The launches of `attention.cu`'s kernels on candle's CUDA device.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, CustomOp1, DType, Layout, Result, Storage, Tensor,
};
use half::{bf16, f16};

use super::{Shape, MAX_HEAD};

/// `attention.cu` compiled by `build.rs`.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
const MODULE: &str = "remat_attention";
/// `attention_tc.cu` (f16 and bf16 on tensor cores) compiled by `build.rs`.
const TC_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention_tc.ptx"));
const TC_MODULE: &str = "remat_attention_tc";
/// Rows per block, both files (attention.cu: `NT` threads, one per row;
/// attention_tc.cu: 4 warps of 16 rows).
const ROWS: usize = 64;

// SAFETY: `Shape` is `#[repr(C)]` plain data (integers and a float), laid
// out as attention.cu's `struct Shape`, passed to the kernels by value.
unsafe impl DeviceRepr for Shape {}

/// A storage computed outside candle, handed to a tensor: the node's
/// forward takes it (once).
struct Handed(Mutex<Option<(CudaStorage, candle_core::Shape)>>);

impl CustomOp1 for Handed {
    fn name(&self) -> &'static str {
        "remat-attention-kernel-output"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, candle_core::Shape)> {
        candle_core::bail!("remat attention kernels: a CUDA output handed on the CPU")
    }
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, candle_core::Shape)> {
        crate::lock(&self.0).take().ok_or_else(|| {
            candle_core::Error::Msg("remat attention kernels: output taken twice".into())
        })
    }
}

/// A tensor of `slice`, shaped `shape`, on `anchor`'s device.
pub(super) fn hand<T: CudaDType>(
    anchor: &Tensor,
    slice: CudaSlice<T>,
    dev: &CudaDevice,
    shape: impl Into<candle_core::Shape>,
) -> Result<Tensor> {
    let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
    anchor.apply_op1_no_bwd(&Handed(Mutex::new(Some((storage, shape.into())))))
}

/// The kernel's name for a head size: the instance with room for it.
fn instance(stem: &str, dtype: &str, width: usize) -> String {
    let dm = if width <= 64 { 64 } else { MAX_HEAD };
    format!("{stem}_{dtype}_{dm}")
}

/// The grid over `rows` rows of `heads` heads of `batch` items; 128
/// threads a block for the tensor-core kernels, else one per row.
fn config(rows: usize, heads: usize, batch: usize, tensor_cores: bool) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(ROWS) as u32, heads as u32, batch as u32),
        block_dim: (if tensor_cores { 128 } else { ROWS as u32 }, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Whether `dtype` runs on the tensor-core kernels (f16, bf16, with them
/// on) and the PTX has kernel `stem`: built for a compute capability under
/// 8.0 it has none, and the SIMT kernels run instead.
fn tensor_cores(dev: &CudaDevice, dtype: DType, stem: &str, name: &str, width: usize) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
        && super::tensor_cores_on()
        && dev
            .get_or_load_custom_func(&instance(stem, name, width), TC_MODULE, TC_PTX)
            .is_ok()
}

/// The CUDA storage of `t` and its layout.
pub(super) fn storage(t: &Tensor) -> Result<(impl std::ops::Deref<Target = Storage> + '_, Layout)> {
    let (s, l) = t.storage_and_layout();
    if !matches!(&*s, Storage::Cuda(_)) {
        candle_core::bail!("remat attention kernels: a tensor is not on CUDA");
    }
    let l = l.clone();
    Ok((s, l))
}

/// The CUDA device of `t`.
pub(super) fn device(t: &Tensor) -> Result<CudaDevice> {
    match &*t.storage_and_layout().0 {
        Storage::Cuda(c) => Ok(c.device.clone()),
        _ => candle_core::bail!("remat attention kernels: a tensor is not on CUDA"),
    }
}

fn cuda_of(s: &Storage) -> &CudaStorage {
    match s {
        Storage::Cuda(c) => c,
        _ => unreachable!("checked by `storage`"),
    }
}

/// `t`'s elements from its start offset.
pub(super) fn view<'a, T: CudaDType>(s: &'a Storage, l: &Layout) -> Result<CudaView<'a, T>> {
    Ok(cuda_of(s).as_cuda_slice::<T>()?.slice(l.start_offset()..))
}

pub(super) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    match q.dtype() {
        DType::F32 => forward_as::<f32>(q, k, v, mask, causal, scale, "f32"),
        DType::F16 => forward_as::<f16>(q, k, v, mask, causal, scale, "f16"),
        DType::BF16 => forward_as::<bf16>(q, k, v, mask, causal, scale, "bf16"),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(
            other,
            "attention kernels",
        )),
    }
}

fn forward_as<T: CudaDType + DeviceRepr>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
    scale: f64,
    name: &str,
) -> Result<(Tensor, Tensor)> {
    let shape = Shape::new(q, k, v, mask, causal, scale)?;
    let (b, h, t, _) = q.dims4()?;
    let dv = v.dim(3)?;
    let dev = device(q)?;
    let (out, stats) = {
        let (qs, ql) = storage(q)?;
        let (ks, kl) = storage(k)?;
        let (vs, vl) = storage(v)?;
        let m = mask.map(storage).transpose()?;
        let (qv, kv, vv) = (
            view::<T>(&qs, &ql)?,
            view::<T>(&ks, &kl)?,
            view::<T>(&vs, &vl)?,
        );
        let mv = match &m {
            Some((s, l)) => view::<T>(s, l)?,
            None => view::<T>(&qs, &ql)?,
        };
        // SAFETY: the forward writes every element of both: each of the
        // B x H x T rows its `Dv` outputs and its two statistics.
        let out = unsafe { dev.alloc::<T>(b * t * h * dv)? };
        let stats = unsafe { dev.alloc::<f32>(2 * b * h * t)? };
        let width = q.dim(3)?.max(dv);
        let tc = tensor_cores(&dev, q.dtype(), "attention_tc_forward", name, width);
        let func = if tc {
            dev.get_or_load_custom_func(
                &instance("attention_tc_forward", name, width),
                TC_MODULE,
                TC_PTX,
            )?
        } else {
            dev.get_or_load_custom_func(&instance("attention_forward", name, width), MODULE, PTX)?
        };
        let mut builder = func.builder();
        builder.arg(&qv);
        builder.arg(&kv);
        builder.arg(&vv);
        builder.arg(&mv);
        builder.arg(&out);
        builder.arg(&stats);
        builder.arg(&shape);
        // SAFETY: the arguments are the kernel's (const T* q, k, v, mask,
        // T* out, float* stats, Shape) in order; `shape` holds the sizes
        // and strides of the views (each row's features contiguous, checked
        // by `fit`); the grid covers the B x H x T rows, ROWS per block,
        // with the block size the kernel was written for.
        unsafe { builder.launch(config(t, h, b, tc)) }.w()?;
        (out, stats)
    };
    Ok((
        hand(q, out, &dev, (b, t, h, dv))?,
        hand(q, stats, &dev, (2, b, h, t))?,
    ))
}

pub(super) fn backward(
    args: super::Args<'_>,
    out: &Tensor,
    dout: &Tensor,
    stats: &Tensor,
    packed: bool,
) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    // Each row's features contiguous for the kernels.
    let dout = if dout.stride()[3] == 1 {
        dout.clone()
    } else {
        dout.contiguous()?
    };
    let out = if out.stride()[3] == 1 {
        out.clone()
    } else {
        out.contiguous()?
    };
    let stats = stats.contiguous()?;
    let (q, k, v, mask, causal, scale) = args;
    // One packed tensor only where q, k and v have one shape.
    let packed = packed && q.dims() == k.dims() && q.dims() == v.dims();
    let args = (q, k, v, mask, causal, scale, &out, &dout, &stats, packed);
    match q.dtype() {
        DType::F32 => backward_as::<f32>(args, "f32"),
        DType::F16 => backward_as::<f16>(args, "f16"),
        DType::BF16 => backward_as::<bf16>(args, "bf16"),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(
            other,
            "attention kernels",
        )),
    }
}

type BackwardArgs<'a> = (
    &'a Tensor,
    &'a Tensor,
    &'a Tensor,
    Option<&'a Tensor>,
    bool,
    f64,
    &'a Tensor,
    &'a Tensor,
    &'a Tensor,
    bool,
);

fn backward_as<T: CudaDType + DeviceRepr>(
    args: BackwardArgs<'_>,
    name: &str,
) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    let (q, k, v, mask, causal, scale, out, dout, stats, packed) = args;
    let mut shape = Shape::new(q, k, v, mask, causal, scale)?.with_output(out, dout);
    if packed {
        shape = shape.packed_gradients();
    }
    let (b, h, t, d) = q.dims4()?;
    let (_, hkv, s, dv) = v.dims4()?;
    let width = d.max(dv);
    let dev = device(q)?;
    let (dq, rest) = {
        let (qs, ql) = storage(q)?;
        let (ks, kl) = storage(k)?;
        let (vs, vl) = storage(v)?;
        let (os, ol) = storage(out)?;
        let (gs, gl) = storage(dout)?;
        let (ss, sl) = storage(stats)?;
        let m = mask.map(storage).transpose()?;
        let (qv, kv, vv) = (
            view::<T>(&qs, &ql)?,
            view::<T>(&ks, &kl)?,
            view::<T>(&vs, &vl)?,
        );
        let (ov, gv, sv) = (
            view::<T>(&os, &ol)?,
            view::<T>(&gs, &gl)?,
            view::<f32>(&ss, &sl)?,
        );
        let mv = match &m {
            Some((s, l)) => view::<T>(s, l)?,
            None => view::<T>(&qs, &ql)?,
        };
        // SAFETY: every element is written: the dq kernel's B x H x T rows
        // their `D` gradients and their delta, the dk and dv kernels' (or
        // the dkv kernel's) B x Hkv x S key rows their `D` and `Dv`; packed,
        // those are the three thirds of each (B, T) row of `dq`, where
        // `shape` says (`dk` and `dv` are then unused, one element each).
        let (nq, nk, nv) = if packed {
            (3 * b * h * t * d, 1, 1)
        } else {
            (b * h * t * d, b * hkv * s * d, b * hkv * s * dv)
        };
        let dq = unsafe { dev.alloc::<T>(nq)? };
        let delta = unsafe { dev.alloc::<f32>(b * h * t)? };
        let dk_own = unsafe { dev.alloc::<T>(nk)? };
        let dv_own = unsafe { dev.alloc::<T>(nv)? };
        let (dk, dvv) = if packed {
            (&dq, &dq)
        } else {
            (&dk_own, &dv_own)
        };
        let tc = tensor_cores(&dev, q.dtype(), "attention_tc_backward_dq", name, width);
        let (module, ptx, stem) = if tc {
            (TC_MODULE, TC_PTX, "attention_tc_backward")
        } else {
            (MODULE, PTX, "attention_backward")
        };
        let func = dev.get_or_load_custom_func(
            &instance(&format!("{stem}_dq"), name, width),
            module,
            ptx,
        )?;
        let mut builder = func.builder();
        builder.arg(&qv);
        builder.arg(&kv);
        builder.arg(&vv);
        builder.arg(&mv);
        builder.arg(&ov);
        builder.arg(&gv);
        builder.arg(&sv);
        builder.arg(&dq);
        builder.arg(&delta);
        builder.arg(&shape);
        // SAFETY: (const T* q, k, v, mask, out, dout, const float* stats,
        // T* dq, float* delta, Shape) in order, `shape` describing the
        // views; the grid covers the B x H x T rows.
        unsafe { builder.launch(config(t, h, b, tc)) }.w()?;
        // The key rows: dk and dv in one kernel on tensor cores, else one
        // kernel each.
        let grads: &[(&str, &[&CudaSlice<T>])] = if tc {
            &[("dkv", &[dk, dvv])]
        } else {
            &[("dk", &[dk]), ("dv", &[dvv])]
        };
        for (what, outs) in grads {
            let func = dev.get_or_load_custom_func(
                &instance(&format!("{stem}_{what}"), name, width),
                module,
                ptx,
            )?;
            let mut builder = func.builder();
            builder.arg(&qv);
            builder.arg(&kv);
            builder.arg(&vv);
            builder.arg(&mv);
            builder.arg(&gv);
            builder.arg(&sv);
            builder.arg(&delta);
            for grad in *outs {
                builder.arg(*grad);
            }
            builder.arg(&shape);
            // SAFETY: (const T* q, k, v, mask, dout, const float* stats,
            // const float* delta, T* grad (dk, dv for "dkv"), Shape) in
            // order; `delta` was written by the dq kernel, queued before on
            // the same stream; the grid covers the B x Hkv x S key rows.
            unsafe { builder.launch(config(s, hkv, b, tc)) }.w()?;
        }
        if packed {
            (dq, None)
        } else {
            (dq, Some((dk_own, dv_own)))
        }
    };
    match rest {
        None => {
            let all = hand(q, dq, &dev, (b, t, 3 * h * d))?;
            let third = |i| -> Result<Tensor> {
                all.reshape((b, t, 3, h, d))?
                    .narrow(2, i, 1)?
                    .squeeze(2)?
                    .transpose(1, 2)
            };
            Ok((third(0)?, third(1)?, third(2)?, Some(all)))
        }
        Some((dk, dvv)) => Ok((
            hand(q, dq, &dev, (b, h, t, d))?,
            hand(q, dk, &dev, (b, hkv, s, d))?,
            hand(q, dvv, &dev, (b, hkv, s, dv))?,
            None,
        )),
    }
}

/// `gelu.cu` compiled by `build.rs`.
const GELU_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gelu.ptx"));

pub(super) fn gelu_backward(
    x: &CudaStorage,
    lx: &Layout,
    dy: &CudaStorage,
    ldy: &Layout,
) -> Result<CudaStorage> {
    let (Some((a, b)), Some((c, _))) = (lx.contiguous_offsets(), ldy.contiguous_offsets()) else {
        candle_core::bail!("remat nn: gelu's backward wants contiguous tensors")
    };
    let n = b - a;
    if ldy.shape().elem_count() != n {
        candle_core::bail!("remat nn: gelu's backward: x and dy differ in size");
    }
    match x.dtype() {
        DType::F32 => gelu_as::<f32>(x, dy, a, c, n, "f32"),
        DType::F16 => gelu_as::<f16>(x, dy, a, c, n, "f16"),
        DType::BF16 => gelu_as::<bf16>(x, dy, a, c, n, "bf16"),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(
            other,
            "gelu backward kernel",
        )),
    }
}

fn gelu_as<T: CudaDType + DeviceRepr>(
    x: &CudaStorage,
    dy: &CudaStorage,
    a: usize,
    c: usize,
    n: usize,
    name: &str,
) -> Result<CudaStorage> {
    let dev = x.device.clone();
    let xs = x.as_cuda_slice::<T>()?.slice(a..);
    let gs = dy.as_cuda_slice::<T>()?.slice(c..);
    if n == 0 {
        candle_core::bail!("remat nn: gelu's backward kernel over no elements");
    }
    // SAFETY: the grid-stride loop writes each of the `n` elements.
    let out = unsafe { dev.alloc::<T>(n)? };
    {
        let func =
            dev.get_or_load_custom_func(&format!("gelu_backward_{name}"), "remat_gelu", GELU_PTX)?;
        let mut builder = func.builder();
        builder.arg(&n);
        builder.arg(&xs);
        builder.arg(&gs);
        builder.arg(&out);
        let threads = 256;
        let blocks = n.div_ceil(threads).min(65_535) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: (size_t n, const T* x, const T* dy, T* out) in order; `x`
        // and `dy` hold `n` elements from their offsets (contiguous, checked).
        unsafe { builder.launch(cfg) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
