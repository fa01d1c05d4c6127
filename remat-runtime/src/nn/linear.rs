//! `x W^T + b`, candle-nn's layout: the weight is `(out, in)`; with a
//! residual added and a GELU before the product fused in.

use candle_core::{CustomOp2, CustomOp3, Result, Tensor};

use super::attach::{forward_computed, Computed};
use super::bundle::{bundle, Slot};
use crate::tape::unread;

struct Linear {
    out: Computed,
    /// The product reads `gelu(x)`, recomputed in the backward.
    gelu: bool,
    args: Args,
}

/// What the node's arguments are.
enum Args {
    /// `(x, w)`.
    Plain,
    /// `(x, w, b)`.
    Bias,
    /// `(x, w, residual)`.
    Residual,
    /// `(x, bundle(w, b), residual)`: four tensors in three arguments; `w`
    /// is read here, its and `b`'s gradients leave through the bundle.
    Bundled { w: Tensor, slot: Slot },
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
    let _profile = crate::inspect::profile::op("linear");
    fused(x, w, b, None, false)
}

/// `residual + x W^T + b`: [`linear`] with the residual add of a
/// transformer block fused in. The graph keeps `x`, `w`, `b` and
/// `residual` (a block's residual stream, which its norm keeps anyway),
/// not the product: `residual + linear(x, w, b)` written as two ops keeps
/// the product too, for an addition whose backward reads neither operand.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// let dev = Device::Cpu;
/// let x = Var::ones((2, 4), DType::F32, &dev)?;
/// let w = Var::ones((3, 4), DType::F32, &dev)?;
/// let r = Var::ones((2, 3), DType::F32, &dev)?;
/// let y = remat_runtime::nn::linear_add(&x, &w, None, &r)?;
/// assert_eq!(y.to_vec2::<f32>()?, vec![vec![5.0; 3]; 2]);
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&r).unwrap().to_vec2::<f32>()?, vec![vec![1.0; 3]; 2]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn linear_add(x: &Tensor, w: &Tensor, b: Option<&Tensor>, residual: &Tensor) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("linear_add");
    fused(x, w, b, Some(residual), false)
}

/// `residual + gelu(x) W^T + b`: the second half of a GPT MLP and its
/// residual add as one node, with GELU's tanh approximation
/// (`Tensor::gelu`, [`gelu`](super::gelu)). The graph keeps `x` (the
/// GELU's input), `w`, `b` and `residual`; `gelu(x)`, four times the width
/// of the residual stream in a GPT block, is recomputed in the backward
/// (one more pass over `x`) instead of kept.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// let dev = Device::Cpu;
/// let x = Var::zeros((2, 4), DType::F32, &dev)?;
/// let w = Var::ones((3, 4), DType::F32, &dev)?;
/// let r = Var::ones((2, 3), DType::F32, &dev)?;
/// let y = remat_runtime::nn::gelu_linear_add(&x, &w, None, &r)?;
/// assert_eq!(y.to_vec2::<f32>()?, vec![vec![1.0; 3]; 2]); // gelu(0) = 0
/// let g = y.sum_all()?.backward()?;
/// // d/dx at 0: gelu'(0) = 1/2, times the 3 outputs each x feeds.
/// assert_eq!(g.get(&x).unwrap().to_vec2::<f32>()?, vec![vec![1.5; 4]; 2]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn gelu_linear_add(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    residual: &Tensor,
) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("gelu_linear_add");
    fused(x, w, b, Some(residual), true)
}

fn fused(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    residual: Option<&Tensor>,
    gelu: bool,
) -> Result<Tensor> {
    let name = match (residual, gelu) {
        (None, _) => "linear",
        (Some(_), false) => "linear_add",
        (Some(_), true) => "gelu_linear_add",
    };
    check_weight(name, x, w, b)?;
    let dims = output_dims(x, w)?;
    if let Some(r) = residual {
        if r.dims() != dims.as_slice() {
            candle_core::bail!(
                "{}: the residual has shape {:?} but the product has {dims:?}: they must be equal",
                if gelu {
                    "gelu_linear_add"
                } else {
                    "linear_add"
                },
                r.dims()
            );
        }
    }
    // The backward reads the inputs, not the output.
    unread::op_output(x, |unread| {
        let y = if unread {
            unread::uncomputed(dims, x.dtype(), x.device())?
        } else {
            let y = product(&activation(&x.detach(), gelu)?, w, b)?.reshape(dims)?;
            match residual {
                Some(r) => (y + r.detach())?,
                None => y,
            }
        };
        let out = Computed::new(y);
        let op = |args| Linear { out, gelu, args };
        match (b, residual) {
            (None, None) => x.apply_op2(w, op(Args::Plain)),
            (Some(b), None) => x.apply_op3(w, b, op(Args::Bias)),
            (None, Some(r)) => x.apply_op3(w, r, op(Args::Residual)),
            (Some(b), Some(r)) => {
                let (wb, slot) = bundle(w, b)?;
                let w = w.detach();
                x.apply_op3(&wb, r, op(Args::Bundled { w, slot }))
            }
        }
    })
}

/// `gelu(x)` or `x`.
fn activation(x: &Tensor, gelu: bool) -> Result<Tensor> {
    if gelu {
        x.gelu()
    } else {
        Ok(x.clone())
    }
}

/// `a W^T + b` over `a`'s rows, `(rows, out)`, outside the graph.
pub(super) fn product(a: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("(inside an op) matmul");
    let y = a.reshape(rows(a)?)?.matmul(&w.detach().t()?)?;
    match b {
        Some(b) => super::kernels::add_bias(y, &b.detach()),
        None => Ok(y),
    }
}

/// The shape of `x W^T`: `x`'s, with `w`'s `out` as the last dimension.
pub(super) fn output_dims(x: &Tensor, w: &Tensor) -> Result<Vec<usize>> {
    let mut dims = x.dims().to_vec();
    match dims.last_mut() {
        Some(last) => *last = w.dim(0)?,
        None => candle_core::bail!(
            "remat nn: the input is a scalar; a linear layer reads (.., {}) rows",
            w.dim(candle_core::D::Minus1)?
        ),
    }
    Ok(dims)
}

/// An error naming the weight or the bias of `op`'s product `x W^T + b`
/// when they do not fit: `w` is `(out, in)` with `in` the width of `x`'s
/// rows (candle-nn's `Linear` layout, not transposed), `b` is `(out,)`.
pub(super) fn check_weight(op: &str, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<()> {
    let &[out, input] = w.dims() else {
        candle_core::bail!(
            "{op}: the weight has shape {:?}; a linear layer's weight is (out, in), as candle-nn's `Linear` holds it",
            w.dims()
        );
    };
    let width = x.dims().last().copied();
    if width != Some(input) {
        candle_core::bail!(
            "{op}: the input has shape {:?} but the weight {:?} reads rows {input} wide; a linear layer's weight is (out, in), as candle-nn's `Linear` holds it (not transposed)",
            x.dims(),
            w.dims()
        );
    }
    if let Some(b) = b {
        if b.dims() != [out] {
            candle_core::bail!(
                "{op}: the bias has shape {:?} but the weight {:?} gives {out} outputs: the bias is (out,)",
                b.dims(),
                w.dims()
            );
        }
    }
    Ok(())
}

/// `(rows, in)` of `x`, flattened over all but the last dimension.
pub(super) fn rows(x: &Tensor) -> Result<(usize, usize)> {
    let input = x.dim(candle_core::D::Minus1)?;
    let dims = x.dims();
    Ok((dims[..dims.len() - 1].iter().product(), input))
}

impl Linear {
    /// `dx`, `dw` and `db` (the bias's, if there is one) for the gradient
    /// `g` of the output.
    fn grads(&self, x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor, Bias)> {
        let (rows, input) = rows(x)?;
        let x = x.detach();
        let g2 = g.detach().reshape((rows, g.dim(candle_core::D::Minus1)?))?;
        if !self.gelu {
            let dx = g2.matmul(&w.detach())?.reshape(x.shape())?;
            let dw = g2.t()?.matmul(&x.reshape((rows, input))?)?;
            return Ok((dx, dw, Bias(g2)));
        }
        // With the GELU: `gelu(x)` recomputed as the forward computed it,
        // for `dw` only, and freed before `dx`'s two input-sized tensors
        // exist: at most two such temporaries at once (`gelu(x)`, `dx` and
        // the product `g W` alive together were three, the step's peak in
        // a GPT MLP).
        let dw = {
            let a = x.gelu()?;
            g2.t()?.matmul(&a.reshape((rows, input))?)?
        };
        let da = g2.matmul(&w.detach())?.reshape(x.shape())?;
        let dx = super::gelu::backward(&x, &da)?;
        Ok((dx, dw, Bias(g2)))
    }
}

/// The bias's gradient, computed only where there is a bias: the output's
/// gradient summed over its rows.
struct Bias(Tensor);

impl Bias {
    fn grad(&self) -> Result<Tensor> {
        super::kernels::sum_rows(&self.0)
    }
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
        let _profile = crate::inspect::profile::backward("linear");
        let (dx, dw, _) = self.grads(x, w, g)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for Linear {
    forward_computed!("remat-linear", s1 l1, s2 l2, s3 l3);
    fn bwd(
        &self,
        x: &Tensor,
        second: &Tensor,
        _: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _profile = crate::inspect::profile::backward("linear");
        match &self.args {
            Args::Bias => {
                let (dx, dw, db) = self.grads(x, second, g)?;
                Ok((Some(dx), Some(dw), Some(db.grad()?)))
            }
            Args::Residual => {
                let (dx, dw, _) = self.grads(x, second, g)?;
                Ok((Some(dx), Some(dw), Some(g.detach())))
            }
            Args::Bundled { w, slot } => {
                let (dx, dw, db) = self.grads(x, w, g)?;
                Ok((
                    Some(dx),
                    slot.put(second, dw, db.grad()?)?,
                    Some(g.detach()),
                ))
            }
            Args::Plain => {
                candle_core::bail!("remat nn: a two-argument linear node was given three")
            }
        }
    }
}
