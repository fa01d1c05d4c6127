//! GELU (tanh approximation, candle's `Tensor::gelu`).

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType,
};

use super::attach::{forward_computed, Computed};

struct Gelu {
    out: Computed,
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, candle's
/// `Tensor::gelu`, with a backward that computes the derivative in one pass
/// (on a CPU in f32, f64, f16 and bf16: one temporary; candle's own backward of `gelu`
/// holds about eighteen input-sized temporaries at once). The graph keeps
/// `x`, as candle's does. The derivative uses the exact constants
/// (`sqrt(2/pi)`, `3 * 0.044715 * sqrt(2/pi)`), where candle's backward
/// rounds them to six digits: in f64 the two gradients differ by up to
/// about 3e-7 relative (in f32 they agree to rounding); compare a block
/// using it with a plain twin that calls `nn::gelu` too.
///
/// ```
/// use candle_core::{Device, Var};
/// let x = Var::new(&[-1f32, 0., 2.], &Device::Cpu)?;
/// let y = remat_runtime::nn::gelu(&x)?;
/// let g = y.sum_all()?.backward()?.get(&x).unwrap().to_vec1::<f32>()?;
/// assert!((g[1] - 0.5).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("gelu");
    let y = x.detach().gelu()?;
    x.apply_op1(Gelu {
        out: Computed::new(y),
    })
}

const C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const A: f64 = 0.044_715;

/// d gelu / dx.
pub(super) fn derivative(x: f64) -> f64 {
    let t = (C * (x + A * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + 3.0 * A * x * x)
}

impl CustomOp1 for Gelu {
    forward_computed!("remat-gelu", s1 l1);
    fn bwd(&self, x: &Tensor, _: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let _profile = crate::inspect::profile::backward("gelu");
        backward(x, dy).map(Some)
    }
}

/// `dy * gelu'(x)`: one pass on a CPU (computed in f64, rounded once to the
/// dtype) and on CUDA, tensor ops elsewhere.
pub(super) fn backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let _profile = crate::inspect::profile::backward("(inside an op) gelu");
    let (x, dy) = (x.detach().contiguous()?, dy.detach().contiguous()?);
    let fused = match x.device() {
        candle_core::Device::Cpu => matches!(
            x.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        ),
        candle_core::Device::Cuda(_) => {
            super::kernels::kernels_on()
                && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        }
        _ => false,
    };
    // (Nothing to launch for an empty tensor.)
    if fused && dy.dtype() == x.dtype() && x.elem_count() > 0 {
        return x.apply_op2_no_bwd(&dy, &GeluGrad);
    }
    // Elsewhere, the same formula with tensor ops.
    let x2 = x.sqr()?;
    let t = ((&x + (&x2 * &x)?.affine(A, 0.0)?)? * C)?.tanh()?;
    let left = ((&t + 1.0)? * 0.5)?;
    let right = ((&x * (1.0 - t.sqr()?)?)? * (x2.affine(3.0 * A, 1.0)? * (0.5 * C))?)?;
    (left + right)? * dy
}

/// `dy * gelu'(x)` element by element, computed in f64.
fn grad_pass<T: WithDType>(x: &[T], dy: &[T]) -> Vec<T> {
    x.iter()
        .zip(dy)
        .map(|(&x, &g)| T::from_f64(derivative(x.to_f64()) * g.to_f64()))
        .collect()
}

/// `dy * gelu'(x)` in one pass over contiguous tensors: on the CPU in f64,
/// on CUDA by `kernels/gelu.cu` in f32.
struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "remat-gelu-grad"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (Some((a1, b1)), Some((a2, b2))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("remat nn: gelu's backward wants contiguous tensors")
        };
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(dy)) => {
                CpuStorage::F32(grad_pass(&x[a1..b1], &dy[a2..b2]))
            }
            (CpuStorage::F64(x), CpuStorage::F64(dy)) => {
                CpuStorage::F64(grad_pass(&x[a1..b1], &dy[a2..b2]))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(dy)) => {
                CpuStorage::BF16(grad_pass(&x[a1..b1], &dy[a2..b2]))
            }
            (CpuStorage::F16(x), CpuStorage::F16(dy)) => {
                CpuStorage::F16(grad_pass(&x[a1..b1], &dy[a2..b2]))
            }
            _ => candle_core::bail!("remat nn: gelu's one-pass backward is for float tensors"),
        };
        Ok((out, l1.shape().clone()))
    }
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::kernels::gelu_backward(s1, l1, s2, l2)?;
        Ok((out, l1.shape().clone()))
    }
}
