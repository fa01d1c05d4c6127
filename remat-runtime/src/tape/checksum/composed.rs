//! The checksum on a device other than the CPU without the kernels: the
//! three sums by candle's own kernels over an `f64` copy, no hash (`0`).
//! About a dozen kernels and a host-built position ramp per value: the
//! replay check then costs several times the step on a GPU
//! (docs/performance.md); the default there until the kernels of
//! `checksum.cu` have been run on a GPU.

use candle_core::{DType, Tensor};

use super::element::PHI;
use crate::Result;

/// The checksum of `t` by candle's kernels, on `t`'s device.
pub(super) fn of(t: &Tensor) -> Result<Tensor> {
    let x = t.detach().flatten_all()?.to_dtype(DType::F64)?;
    let n = x.elem_count();
    let positions = Tensor::arange(0u32, n as u32, x.device())?.to_dtype(DType::F64)?;
    // The CPU's weights: the top 24 bits of `p * PHI mod 2^32` (exact for
    // positions below 2^21, where `p * PHI` fits an `f64`'s mantissa).
    let golden = f64::from(PHI) / 4_294_967_296.0;
    let scaled = (positions * golden)?;
    let weights = ((&scaled - scaled.floor()?)? * 16_777_216.0)?
        .floor()?
        .affine(1.0 / 16_777_216.0, 0.0)?;
    let zero = Tensor::zeros(1, DType::F64, x.device())?;
    let sums = Tensor::stack(
        &[x.sum_all()?, x.abs()?.sum_all()?, (x * weights)?.sum_all()?],
        0,
    )?;
    Ok(Tensor::cat(&[zero, sums], 0)?)
}
