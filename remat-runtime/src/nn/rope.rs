//! Rotary position embeddings, candle-nn's two layouts.

use candle_core::{CustomOp1, Result, Tensor};

use super::attach::{forward_computed, Computed};
use super::unchanged::Unchanged;

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
    /// The tables' values at the forward, checked before the backward
    /// reads them.
    unchanged: [Unchanged; 2],
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
    let op = match layout {
        Layout::Halves => "rope",
        Layout::Interleaved => "rope_i",
    };
    let &[b, _, t, d] = x.dims() else {
        candle_core::bail!(
            "{op}: the input has shape {:?}; expected (B, H, T, D)",
            x.dims()
        );
    };
    let fits = |c: &Tensor| match c.dims() {
        [rows, half] => (*rows, *half) == (t, d / 2),
        [batch, rows, half] => (*rows, *half) == (t, d / 2) && (*batch == b || *batch == 1),
        _ => false,
    };
    if d % 2 != 0 || !fits(cos) || !fits(sin) {
        candle_core::bail!(
            "{op}: the tables are {:?} (cos) and {:?} (sin) but the input {:?} needs ({t}, {}) or ({b}, {t}, {}): one row per position, half the head size (narrow a longer table to the positions: `cos.narrow(0, offset, {t})`)",
            cos.dims(),
            sin.dims(),
            x.dims(),
            d / 2,
            d / 2
        );
    }
    if cos.track_op() || sin.track_op() {
        // Tables that need gradients (learned or scaled frequencies): the
        // rotation in candle's composed ops, every one with a backward.
        return composed(layout, x, cos, sin);
    }
    let (cos, sin) = (cos.detach().contiguous()?, sin.detach().contiguous()?);
    let y = apply(layout, &x.detach(), &cos, &sin)?;
    x.apply_op1(Rope {
        out: Computed::new(y),
        unchanged: match x.track_op() {
            true => [Unchanged::of(&cos), Unchanged::of(&sin)],
            false => [Unchanged::none(), Unchanged::none()],
        },
        cos,
        sin,
        layout,
    })
}

/// The rotation of `x` `(B, H, T, D)` by tables `(T, D/2)` or `(B, T,
/// D/2)` in composed ops (as candle-nn's `rope_slow` and `rope_i_slow`,
/// with batched tables too).
fn composed(layout: Layout, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = x.dims4()?;
    // The tables with a head dimension: `(1 or B, 1, T, D/2)`.
    let table = |c: &Tensor| match c.rank() {
        2 => c.unsqueeze(0)?.unsqueeze(0),
        3 => c.unsqueeze(1),
        _ => candle_core::bail!(
            "rope: the tables are {:?}, expected (T, D/2) or (B, T, D/2)",
            c.dims()
        ),
    };
    let (cos, sin) = (table(cos)?, table(sin)?);
    match layout {
        Layout::Halves => {
            let cos = Tensor::cat(&[&cos, &cos], 3)?;
            let sin = Tensor::cat(&[&sin, &sin], 3)?;
            let x1 = x.narrow(3, 0, d / 2)?;
            let x2 = x.narrow(3, d / 2, d - d / 2)?;
            let rotated = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
            x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
        }
        Layout::Interleaved => {
            let pairs = x.reshape((b, h, t, d / 2, 2))?;
            let (x0, x1) = (pairs.narrow(4, 0, 1)?, pairs.narrow(4, 1, 1)?);
            let (cos, sin) = (cos.unsqueeze(4)?, sin.unsqueeze(4)?);
            let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
            let y1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
            Tensor::cat(&[y0, y1], 4)?.reshape((b, h, t, d))
        }
    }
}

/// `candle_nn::rotary_emb::rope` (the halves of the last dimension rotated
/// together) with a backward: `x` is `(B, H, T, D)`, `cos` and `sin` are
/// `(T, D/2)`. candle's fused forward; the backward is the same rotation by
/// the opposite angle, so the graph keeps nothing but `x` and the tables.
/// Tables that need gradients (computed from a `Var`: learned frequencies,
/// a learned scaling factor) get them: the rotation is then written in
/// candle's composed ops (as `rope_slow`), every op with its backward.
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
    let _profile = crate::inspect::profile::op("rope");
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
    let _profile = crate::inspect::profile::op("rope_i");
    rope_op(Layout::Interleaved, x, cos, sin)
}

impl CustomOp1 for Rope {
    forward_computed!("remat-rope", s1 l1);
    fn bwd(&self, _: &Tensor, _: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let _profile = crate::inspect::profile::backward("rope");
        let op = match self.layout {
            Layout::Halves => "rope",
            Layout::Interleaved => "rope_i",
        };
        self.unchanged[0].check(&self.cos, op, "the cos table")?;
        self.unchanged[1].check(&self.sin, op, "the sin table")?;
        // A rotation's transpose is the rotation by the opposite angle.
        Ok(Some(apply(
            self.layout,
            &dy.detach(),
            &self.cos,
            &self.sin.neg()?,
        )?))
    }
}
