//! remat's CUDA kernels for `nn` (compiled to PTX by `build.rs`): the
//! backward of the GELU in one pass (`gelu.cu`), the pre-norm of the fused
//! ops forward and backward (`norm.cu`), a linear layer's bias and its
//! gradient (`bias.cu`), and fused attention, the forward
//! and the backward of [`super::attention`] in the manner of
//! FlashAttention-2, with no `(T, S)` tensor, when its arguments allow (a
//! CUDA device, f32/f16/bf16, head sizes up to 128, no tracked mask): f32
//! on the SIMT lanes (`attention.cu`), f16 and bf16 on tensor cores
//! (`attention_tc.cu`). The backward reads each row's maximum score and `1 / sum`, kept
//! from the forward (`(2, B, H, T)` f32), and recomputes the
//! probabilities, as the composed path does.
//!
//! On by default (they passed `attention_kernels_match_the_cpu_in_f64` on
//! an H100); [`cuda_kernels`](crate::nn::cuda_kernels)`(false)` or
//! `REMAT_NN_KERNELS=0` turns them off. On the CPU, the test
//! `the_attention_kernels_on_host_threads_match_f64` runs the same source
//! (each block's threads as POSIX threads) against the composed op in f64.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Result, Tensor};

/// Whether CUDA attention runs on the kernels.
static ON: AtomicBool = AtomicBool::new(true);

/// Turns the kernels on or off.
pub(crate) fn use_kernels(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Whether the kernels are on: [`use_kernels`], or `REMAT_NN_KERNELS`
/// (`0` or `1`) read at the first call.
pub(crate) fn kernels_on() -> bool {
    static FROM_ENV: std::sync::Once = std::sync::Once::new();
    FROM_ENV.call_once(|| match std::env::var("REMAT_NN_KERNELS").as_deref() {
        Ok("1") => ON.store(true, Ordering::Relaxed),
        Ok("0") => ON.store(false, Ordering::Relaxed),
        _ => {}
    });
    ON.load(Ordering::Relaxed)
}

/// Whether f16 and bf16 attention runs on the tensor-core kernels
/// (`attention_tc.cu`; else on `attention.cu`'s SIMT lanes, as f32 does):
/// `REMAT_NN_TENSOR_CORES` (`0` or `1`) read at the first call, on when
/// unset.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn tensor_cores_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("REMAT_NN_TENSOR_CORES").as_deref() != Ok("0"))
}

/// The largest head size the kernels take (their row vectors live in
/// registers).
pub(crate) const MAX_HEAD: usize = 128;

/// Whether the kernels can run attention over `q`, `k`, `v` (and an
/// untracked `mask`, rank 4): on CUDA, with them on, a float dtype of 16 or
/// 32 bits, head sizes up to [`MAX_HEAD`], each row's features contiguous.
pub(crate) fn fit(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let rows_contiguous =
        |t: &Tensor| t.dims().last().is_some_and(|&d| d <= 1) || t.stride()[3] == 1;
    q.device().is_cuda()
        && kernels_on()
        && matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && q.rank() == 4
        // Batch and heads index the grid's y and z (at most 65,535 each).
        && q.dim(0).is_ok_and(|b| b <= 65_535)
        && q.dim(1).is_ok_and(|h| h <= 65_535)
        && q.dim(3).is_ok_and(|d| (1..=MAX_HEAD).contains(&d))
        && v.dim(3).is_ok_and(|d| d <= MAX_HEAD)
        && [q, k, v].into_iter().all(rows_contiguous)
}

/// The sizes and strides every kernel takes by value: `Shape` of
/// `attention.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Shape {
    pub h: i32,
    pub hkv: i32,
    pub t: i32,
    pub s: i32,
    pub d: i32,
    pub dv: i32,
    pub causal: i32,
    pub has_mask: i32,
    pub scale: f32,
    pub q: [i64; 3],
    pub k: [i64; 3],
    pub v: [i64; 3],
    pub mask: [i64; 4],
    pub out: [i64; 3],
    pub dout: [i64; 3],
    /// Where the backward writes `dq`, `dk`, `dv`: an offset, then the
    /// strides of (batch, head, row).
    pub grad_q: [i64; 4],
    pub grad_k: [i64; 4],
    pub grad_v: [i64; 4],
}

/// Strides of `t` (rank 4) in the order the kernels read them: `order`
/// picks the dimensions; a dimension of size 1 gets 0 (a broadcast mask).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn strides<const N: usize>(t: &Tensor, order: [usize; N]) -> [i64; N] {
    let (dims, st) = (t.dims(), t.stride());
    order.map(|i| if dims[i] == 1 { 0 } else { st[i] as i64 })
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl Shape {
    /// The shape of attention over `q` `(B, H, T, D)`, `k` `(B, Hkv, S, D)`,
    /// `v` `(B, Hkv, S, Dv)` and a rank-4 `mask` broadcast to `(B, H, T,
    /// S)`.
    pub fn new(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        causal: bool,
        scale: f64,
    ) -> Result<Self> {
        let (_, h, t, d) = q.dims4()?;
        let (_, hkv, s, _) = k.dims4()?;
        let dv = v.dim(3)?;
        let int = |n: usize| {
            i32::try_from(n).map_err(|_| {
                candle_core::Error::Msg(format!("attention: {n} does not fit the kernels' sizes"))
            })
        };
        Ok(Shape {
            h: int(h)?,
            hkv: int(hkv)?,
            t: int(t)?,
            s: int(s)?,
            d: int(d)?,
            dv: int(dv)?,
            causal: causal.into(),
            has_mask: mask.is_some().into(),
            scale: scale as f32,
            q: strides(q, [0, 1, 2]),
            k: strides(k, [0, 1, 2]),
            v: strides(v, [0, 1, 2]),
            mask: mask.map_or([0; 4], |m| strides(m, [0, 1, 2, 3])),
            out: [0; 3],
            dout: [0; 3],
            // Contiguous `(B, H, T, D)`, `(B, Hkv, S, D)`, `(B, Hkv, S, Dv)`.
            grad_q: [0, (h * t * d) as i64, (t * d) as i64, d as i64],
            grad_k: [0, (hkv * s * d) as i64, (s * d) as i64, d as i64],
            grad_v: [0, (hkv * s * dv) as i64, (s * dv) as i64, dv as i64],
        })
    }

    /// With the gradients written into one `(B, T, 3, H, D)` tensor, as
    /// `attention_qkv`'s projection packs them (q, k, v of one shape).
    pub fn packed_gradients(mut self) -> Self {
        let (h, t, d) = (self.h as i64, self.t as i64, self.d as i64);
        let row = 3 * h * d;
        for (i, g) in [&mut self.grad_q, &mut self.grad_k, &mut self.grad_v]
            .into_iter()
            .enumerate()
        {
            *g = [i as i64 * h * d, t * row, d, row];
        }
        self
    }

    /// With the output and its gradient `(B, T, H, Dv)`, for the backward.
    pub fn with_output(mut self, out: &Tensor, dout: &Tensor) -> Self {
        self.out = strides(out, [0, 1, 2]);
        self.dout = strides(dout, [0, 1, 2]);
        self
    }
}

/// The attention's output `(B, T, H, Dv)` and the rows' statistics `(2, B,
/// H, T)` f32 (maximum score, `1 / sum`), by the kernels.
#[cfg(feature = "cuda")]
pub(crate) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    cuda::forward(q, k, v, mask, causal, scale)
}

/// The attention's arguments: `q`, `k`, `v`, the mask, causal, the scale.
pub(crate) type Args<'a> = (
    &'a Tensor,
    &'a Tensor,
    &'a Tensor,
    Option<&'a Tensor>,
    bool,
    f64,
);

/// The gradients `(dq, dk, dv)` by the kernels, shaped as `q`, `k`, `v`:
/// contiguous, or with `packed` (q, k, v of one shape) views of one `(B,
/// T, 3C)` tensor, returned too.
#[cfg(feature = "cuda")]
pub(crate) fn backward(
    args: Args<'_>,
    out: &Tensor,
    dout: &Tensor,
    stats: &Tensor,
    packed: bool,
) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    cuda::backward(args, out, dout, stats, packed)
}

/// Without the `cuda` feature no tensor is on CUDA, so [`fit`] is false.
#[cfg(not(feature = "cuda"))]
pub(crate) fn forward(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: Option<&Tensor>,
    _: bool,
    _: f64,
) -> Result<(Tensor, Tensor)> {
    Err(candle_core::Error::NotCompiledWithCudaSupport)
}

/// Without the `cuda` feature no tensor is on CUDA, so [`fit`] is false.
#[cfg(not(feature = "cuda"))]
pub(crate) fn backward(
    _: Args<'_>,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: bool,
) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    Err(candle_core::Error::NotCompiledWithCudaSupport)
}

/// `dy * gelu'(x)` for contiguous `x` and `dy` on CUDA, by `gelu.cu`.
#[cfg(feature = "cuda")]
pub(crate) fn gelu_backward(
    x: &candle_core::CudaStorage,
    lx: &candle_core::Layout,
    dy: &candle_core::CudaStorage,
    ldy: &candle_core::Layout,
) -> Result<candle_core::CudaStorage> {
    cuda::gelu_backward(x, lx, dy, ldy)
}

/// Without the `cuda` feature there is no CUDA storage.
#[cfg(not(feature = "cuda"))]
pub(crate) fn gelu_backward(
    _: &candle_core::CudaStorage,
    _: &candle_core::Layout,
    _: &candle_core::CudaStorage,
    _: &candle_core::Layout,
) -> Result<candle_core::CudaStorage> {
    Err(candle_core::Error::NotCompiledWithCudaSupport)
}

/// Whether the norm kernels (`norm.cu`) can normalize the rows of `x`
/// `(rows, C)` with `gain` (and `bias`) `(C)`: on CUDA, with the kernels
/// on, f32/f16/bf16, at least one row and one feature, the parameters in
/// `x`'s dtype and on its device, the column sums' chunks of 64 rows
/// within the grid.
pub(crate) fn norm_fit(x: &Tensor, gain: &Tensor, bias: Option<&Tensor>) -> bool {
    let param = |p: &Tensor| {
        p.dtype() == x.dtype() && p.dims() == [x.dims()[1]] && p.device().same_device(x.device())
    };
    x.device().is_cuda()
        && kernels_on()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && x.rank() == 2
        && x.dims()[0] >= 1
        && x.dims()[1] >= 1
        && x.dims()[0].div_ceil(64) <= 65_535
        && param(gain)
        && bias.is_none_or(param)
}

/// The rows of `x` `(rows, C)` normalized (layer norm with a `bias`, RMS
/// norm without), with each row's mean (0 for RMS) and `1 / std`, `(rows,
/// 1)` f32, by `norm.cu`.
#[cfg(feature = "cuda")]
pub(crate) fn norm_forward(
    x: &Tensor,
    gain: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    cuda_norm::forward(x, gain, bias, eps)
}

/// The gradients of `x` `(rows, C)`, of the gain and of the bias (`(C)`),
/// f32, for the gradient `dy` of [`norm_forward`]'s output.
#[cfg(feature = "cuda")]
pub(crate) fn norm_backward(
    x: &Tensor,
    gain: &Tensor,
    dy: &Tensor,
    (mean, rstd): (&Tensor, &Tensor),
    layer: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    cuda_norm::backward(x, gain, dy, mean, rstd, layer)
}

/// Without the `cuda` feature no tensor is on CUDA, so [`norm_fit`] is
/// false.
#[cfg(not(feature = "cuda"))]
pub(crate) fn norm_forward(
    _: &Tensor,
    _: &Tensor,
    _: Option<&Tensor>,
    _: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    Err(candle_core::Error::NotCompiledWithCudaSupport)
}

/// Without the `cuda` feature no tensor is on CUDA, so [`norm_fit`] is
/// false.
#[cfg(not(feature = "cuda"))]
pub(crate) fn norm_backward(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: (&Tensor, &Tensor),
    _: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    Err(candle_core::Error::NotCompiledWithCudaSupport)
}

/// Whether the bias kernels (`bias.cu`) take `y` `(rows, n)` (and a bias
/// `b` `(n)`): on CUDA, with the kernels on, f32/f16/bf16, at least one
/// row and one feature, `b` in `y`'s dtype and on its device, the chunks
/// of 64 rows within the grid.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn bias_fit(y: &Tensor, b: Option<&Tensor>) -> bool {
    y.device().is_cuda()
        && kernels_on()
        && matches!(y.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && y.rank() == 2
        && y.dims()[0] >= 1
        && y.dims()[1] >= 1
        && y.dims()[0].div_ceil(64) <= 65_535
        && b.is_none_or(|b| {
            b.dtype() == y.dtype()
                && b.dims() == [y.dims()[1]]
                && b.device().same_device(y.device())
        })
}

/// `y + b` over the rows of `y` `(rows, n)` (a new tensor from a matmul,
/// which nothing else reads yet): in place by `bias.cu` where
/// [`bias_fit`], else candle's `broadcast_add`.
pub(crate) fn add_bias(y: Tensor, b: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if bias_fit(&y, Some(b)) && y.is_contiguous() {
        cuda_bias::bias_add(&y, &b.contiguous()?)?;
        return Ok(y);
    }
    y.broadcast_add(b)
}

/// The sum of the rows of `x` `(rows, n)`: a bias's gradient. By `bias.cu`
/// in f32 where [`bias_fit`], else candle's `sum(0)`.
pub(crate) fn sum_rows(x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if bias_fit(x, None) {
        return cuda_bias::sum_rows(x);
    }
    x.sum(0)
}

/// `g^T a`, the gradient `(out, in)` of a weight whose product read `a`
/// `(rows, in)` and got `g` `(rows, out)`. On the CPU computed as `(a^T
/// g)^T` (candle's CPU product copies its transposed left operand, and `a`
/// is the narrower); on CUDA as `g^T a`, contiguous (cuBLAS reads either
/// operand transposed in place).
pub(crate) fn weight_grad(a: &Tensor, g: &Tensor) -> Result<Tensor> {
    if a.device().is_cuda() {
        g.t()?.matmul(a)
    } else {
        a.t()?.matmul(g)?.t()
    }
}

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_bias;
#[cfg(feature = "cuda")]
mod cuda_norm;

#[cfg(test)]
mod tests;
