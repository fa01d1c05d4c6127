//! `candle_nn::rotary_emb`'s fused rotations, which have no backward in
//! candle, with one: [`rope`], [`rope_i`], [`rope_thd`]. Each runs candle's
//! fused kernel (the same values, bit for bit); the backward is the same
//! rotation by the opposite angle ([`nn::rope`], [`nn::rope_i`]), so the
//! graph keeps nothing but the input and the tables.
//!
//! `cos` and `sin` are `(seq, head_dim / 2)`, or `(batch, seq, head_dim /
//! 2)` per sequence, with at least as many positions as `xs` (the first
//! ones are used), as in candle. Tables that need gradients (learned or
//! scaled frequencies) get theirs: the rotation then runs as candle's
//! composed ops; tables that need none (candle-transformers computes them
//! from `rope_theta`) take the fused kernel.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use remat_runtime::candle_nn::rotary_emb;
//!
//! let dev = Device::Cpu;
//! let x = Var::randn(0f32, 1.0, (1, 2, 3, 4), &dev)?; // (batch, heads, seq, head_dim)
//! let angles = Tensor::arange(0f32, 6., &dev)?.reshape((3, 2))?;
//! let y = rotary_emb::rope(&x, &angles.cos()?, &angles.sin()?)?;
//! let grads = y.sqr()?.sum_all()?.backward()?;
//! assert!(grads.get(&x).is_some());
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{Result, Tensor};

use crate::nn;

/// `candle_nn::rotary_emb::rope` with a backward: `xs` is `(batch, heads,
/// seq, head_dim)`, the two halves of its last dimension rotated together
/// (GPT-NeoX's and Hugging Face's layout, which Qwen2 and LLaMA use).
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let x = Var::new(&[[[[1f32, 2., 3., 4.]]]], &dev)?;
/// let (cos, sin) = (Tensor::zeros((1, 2), DType::F32, &dev)?, Tensor::ones((1, 2), DType::F32, &dev)?);
/// let y = remat_runtime::candle_nn::rotary_emb::rope(&x, &cos, &sin)?; // a quarter turn
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [-3., -4., 1., 2.]);
/// let grads = y.narrow(3, 0, 1)?.sum_all()?.backward()?;
/// assert_eq!(grads.get(&x).unwrap().flatten_all()?.to_vec1::<f32>()?, [0., 0., -1., 0.]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = tables("rope", xs, cos, sin, 2)?;
    nn::rope(xs, &cos, &sin)
}

/// `candle_nn::rotary_emb::rope_i` with a backward: `xs` is `(batch, heads,
/// seq, head_dim)`, consecutive pairs of its last dimension rotated
/// together (the original RoFormer and GPT-J layout).
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let x = Var::new(&[[[[1f32, 2., 3., 4.]]]], &dev)?;
/// let (cos, sin) = (Tensor::zeros((1, 2), DType::F32, &dev)?, Tensor::ones((1, 2), DType::F32, &dev)?);
/// let y = remat_runtime::candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?; // a quarter turn
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [-2., 1., -4., 3.]);
/// let grads = y.sum_all()?.backward()?;
/// assert!(grads.get(&x).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope_i(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = tables("rope_i", xs, cos, sin, 2)?;
    nn::rope_i(xs, &cos, &sin)
}

/// `candle_nn::rotary_emb::rope_thd` with a backward: [`rope`] for `xs` in
/// `(batch, seq, heads, head_dim)` layout. It rotates the `(batch, heads,
/// seq, head_dim)` view of `xs` and returns the result contiguous in `xs`'s
/// layout, as candle does (that copy is one more node, which keeps one
/// tensor of `xs`'s size until the backward).
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1.0, (2, 5, 3, 4), &dev)?; // (batch, seq, heads, head_dim)
/// let angles = Tensor::randn(0f32, 1.0, (5, 2), &dev)?;
/// let (cos, sin) = (angles.cos()?, angles.sin()?);
/// let y = remat_runtime::candle_nn::rotary_emb::rope_thd(&x, &cos, &sin)?;
/// let want = candle_nn::rotary_emb::rope_thd(x.as_tensor(), &cos, &sin)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?);
/// assert!(y.is_contiguous());
/// let grads = y.sum_all()?.backward()?;
/// assert!(grads.get(&x).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope_thd(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = tables("rope_thd", xs, cos, sin, 1)?;
    nn::rope(&xs.transpose(1, 2)?, &cos, &sin)?
        .transpose(1, 2)?
        .contiguous()
}

/// Checks the shapes of a rotation `op` of `xs` (4 dimensions, positions in
/// dimension `seq_dim`) by `cos` and `sin`, and gives the tables' first
/// `seq` positions; fails naming `op` and the shapes.
fn tables(
    op: &str,
    xs: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    seq_dim: usize,
) -> Result<(Tensor, Tensor)> {
    let layout = match seq_dim {
        1 => "(batch, seq, heads, head_dim)",
        _ => "(batch, heads, seq, head_dim)",
    };
    let error = |why: String| {
        candle_core::Error::Msg(format!(
            "remat_runtime::candle_nn::rotary_emb::{op}: {why} (xs {:?} {layout}, cos {:?}, sin {:?})",
            xs.shape(),
            cos.shape(),
            sin.shape()
        ))
    };
    let &[b, _, _, d] = xs.dims() else {
        return Err(error("xs must have 4 dimensions".into()));
    };
    let seq = xs.dims()[seq_dim];
    if d % 2 != 0 {
        return Err(error(format!("head_dim {d} is odd")));
    }
    if !xs.dtype().is_float() {
        return Err(error(format!(
            "expected a floating-point dtype, got {:?}",
            xs.dtype()
        )));
    }
    let table = |name: &str, t: &Tensor| -> Result<Tensor> {
        let (positions, half, pos_dim) = match *t.dims() {
            [p, h] => (p, h, 0),
            [tb, p, h] if tb == b => (p, h, 1),
            _ => {
                return Err(error(format!(
                    "{name} must be (seq, head_dim / 2) or (batch, seq, head_dim / 2)"
                )))
            }
        };
        if half * 2 != d || positions < seq {
            return Err(error(format!(
                "{name} must have {} columns and at least {seq} positions",
                d / 2
            )));
        }
        if t.dtype() != xs.dtype() || !t.device().same_device(xs.device()) {
            return Err(error(format!(
                "xs is {:?} on {:?} but {name} is {:?} on {:?}",
                xs.dtype(),
                xs.device().location(),
                t.dtype(),
                t.device().location()
            )));
        }
        t.narrow(pos_dim, 0, seq)
    };
    Ok((table("cos", cos)?, table("sin", sin)?))
}
