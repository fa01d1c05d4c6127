//! `x W^T + b`, candle-nn's layout: the weight is `(out, in)`.

use candle_core::{CustomOp2, CustomOp3, Result, Tensor};

use super::attach::{forward_computed, Computed};

struct Linear {
    out: Computed,
}

/// `x W^T + b` over the last dimension of `x`, with `w` of shape
/// `(out, in)` as in `candle_nn::Linear`. The graph keeps `x`, `w` and `b`
/// (what the backward reads), not the product before the bias.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let x = Var::ones((2, 3, 4), candle_core::DType::F32, &dev)?;
/// let w = Var::ones((5, 4), candle_core::DType::F32, &dev)?;
/// let y = remat_runtime::nn::linear(&x, &w, None)?;
/// assert_eq!(y.dims(), &[2, 3, 5]);
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&w).unwrap().to_vec2::<f32>()?, vec![vec![6.0; 4]; 5]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (rows, input) = rows(x)?;
    let y = x
        .detach()
        .reshape((rows, input))?
        .matmul(&w.detach().t()?)?;
    let y = match b {
        Some(b) => y.broadcast_add(&b.detach())?,
        None => y,
    };
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank >= 1") = w.dim(0)?;
    let op = Linear {
        out: Computed::new(y.reshape(dims)?),
    };
    match b {
        Some(b) => x.apply_op3(w, b, op),
        None => x.apply_op2(w, op),
    }
}

/// `(rows, in)` of `x`, flattened over all but the last dimension.
fn rows(x: &Tensor) -> Result<(usize, usize)> {
    let input = x.dim(candle_core::D::Minus1)?;
    Ok((x.elem_count() / input.max(1), input))
}

/// `dx`, `dw` and, with `bias`, `db` for the gradient `g` of the output.
fn grads(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    bias: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let (rows, input) = rows(x)?;
    let g2 = g.detach().reshape((rows, ()))?;
    let dx = g2.matmul(&w.detach())?.reshape(x.shape())?;
    let dw = g2.t()?.matmul(&x.detach().reshape((rows, input))?)?;
    let db = bias.then(|| g2.sum(0)).transpose()?;
    Ok((dx, dw, db))
}

impl CustomOp2 for Linear {
    forward_computed!("remat-linear", s1 l1, s2 l2);
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = grads(x, w, g, false)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for Linear {
    forward_computed!("remat-linear", s1 l1, s2 l2, s3 l3);
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = grads(x, w, g, true)?;
        Ok((Some(dx), Some(dw), db))
    }
}
