//! Rotary position embeddings, candle-nn's two layouts.

use candle_core::{CustomOp1, Result, Tensor};

use super::attach::{forward_computed, Computed};

/// Which of candle-nn's layouts.
#[derive(Clone, Copy)]
enum Layout {
    /// `rope`: the two halves of the last dimension are rotated together.
    Halves,
    /// `rope_i`: consecutive pairs are rotated together.
    Interleaved,
}

struct Rope {
    out: Computed,
    cos: Tensor,
    sin: Tensor,
    layout: Layout,
}

fn apply(layout: Layout, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    match layout {
        Layout::Halves => candle_nn::rotary_emb::rope(&x, cos, sin),
        Layout::Interleaved => candle_nn::rotary_emb::rope_i(&x, cos, sin),
    }
}

fn rope_op(layout: Layout, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if cos.track_op() || sin.track_op() {
        // Tables that need gradients (learned or scaled frequencies):
        // candle's composed rotation, whose every op has a backward.
        return match layout {
            Layout::Halves => candle_nn::rotary_emb::rope_slow(x, cos, sin),
            Layout::Interleaved => candle_nn::rotary_emb::rope_i_slow(x, cos, sin),
        };
    }
    let (cos, sin) = (cos.detach().contiguous()?, sin.detach().contiguous()?);
    let y = apply(layout, &x.detach(), &cos, &sin)?;
    x.apply_op1(Rope {
        out: Computed::new(y),
        cos,
        sin,
        layout,
    })
}

/// `candle_nn::rotary_emb::rope` (the halves of the last dimension rotated
/// together) with a backward: `x` is `(B, H, T, D)`, `cos` and `sin` are
/// `(T, D/2)`. candle's fused forward; the backward is the same rotation by
/// the opposite angle, so the graph keeps nothing but `x` and the tables.
/// Tables that need gradients (computed from a `Var`: learned frequencies,
/// a learned scaling factor) get them: the rotation is then candle's
/// composed one (`rope_slow`), every op with its backward.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1., (1, 2, 3, 4), &dev)?;
/// let (cos, sin) = (Tensor::ones((3, 2), candle_core::DType::F32, &dev)?, Tensor::zeros((3, 2), candle_core::DType::F32, &dev)?);
/// let y = remat_runtime::nn::rope(&x, &cos, &sin)?; // angle 0: the identity
/// let g = y.sum_all()?.backward()?;
/// assert_eq!(g.get(&x).unwrap().flatten_all()?.to_vec1::<f32>()?, vec![1.0; 24]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope_op(Layout::Halves, x, cos, sin)
}

/// `candle_nn::rotary_emb::rope_i` (consecutive pairs rotated together)
/// with a backward; shapes and tables that need gradients as in [`rope`].
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let x = Var::randn(0f32, 1., (1, 1, 2, 4), &dev)?;
/// let cos = Tensor::zeros((2, 2), candle_core::DType::F32, &dev)?;
/// let sin = Tensor::ones((2, 2), candle_core::DType::F32, &dev)?;
/// let y = remat_runtime::nn::rope_i(&x, &cos, &sin)?; // a quarter turn
/// let g = y.sum_all()?.backward()?;
/// assert!(g.get(&x).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope_i(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope_op(Layout::Interleaved, x, cos, sin)
}

impl CustomOp1 for Rope {
    forward_computed!("remat-rope", s1 l1);
    fn bwd(&self, _: &Tensor, _: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        // A rotation's transpose is the rotation by the opposite angle.
        Ok(Some(apply(
            self.layout,
            &dy.detach(),
            &self.cos,
            &self.sin.neg()?,
        )?))
    }
}
