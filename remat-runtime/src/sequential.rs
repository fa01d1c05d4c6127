//! A stack of blocks split into checkpointed segments.

use std::sync::Arc;

use candle_core::{Module, Tensor};

use crate::{Region, RematError, Result};

type Block = Arc<dyn Module + Send + Sync>;

/// Runs `blocks` one after the other on `x`, split into `segments`
/// checkpointed regions of consecutive blocks: PyTorch's
/// `checkpoint_sequential`. Only the segments' inputs stay alive between
/// forward and backward; each segment is replayed in the backward, one at a
/// time. With `N` blocks, `segments` near `sqrt(N)` balances what is kept
/// (one input per segment) against what one replay holds (one segment's
/// activations).
///
/// A block is any candle [`Module`]: a closure
/// `Fn(&Tensor) -> candle_core::Result<Tensor>` (candle implements `Module`
/// for those), a `candle_nn::Linear`, a layer type of your own.
///
/// Segment `s` is the region `name[a..b]` (blocks `a` to `b - 1`); each block
/// in it is an open statement named `block.i`, so a [`Plan`](crate::Plan)
/// can save some of them. Blocks may themselves be `remat!` regions (they
/// nest). Segments are as even as possible; the first ones take one block
/// more when `segments` does not divide `N`.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::checkpoint_sequential;
/// let dev = Device::Cpu;
/// let ws: Vec<Var> = (0..6).map(|_| Var::randn(0f32, 0.3, (8, 8), &dev)).collect::<Result<_, _>>()?;
/// let blocks: Vec<_> = ws
///     .iter()
///     .map(|w| {
///         let w = w.as_tensor().clone();
///         move |x: &candle_core::Tensor| (x + x.matmul(&w)?.tanh()?)
///     })
///     .collect();
/// let x = Var::randn(0f32, 1.0, (4, 8), &dev)?;
/// let y = checkpoint_sequential("stack", 2, x.as_tensor(), blocks)?;
/// let grads = y.sum_all()?.backward()?;
/// assert!(ws.iter().all(|w| grads.get(w).is_some()));
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn checkpoint_sequential<M>(
    name: &str,
    segments: usize,
    x: &Tensor,
    blocks: impl IntoIterator<Item = M>,
) -> Result<Tensor>
where
    M: Module + Send + Sync + 'static,
{
    let blocks: Vec<Block> = blocks.into_iter().map(|m| Arc::new(m) as Block).collect();
    let n = blocks.len();
    if segments == 0 || segments > n.max(1) {
        return Err(RematError::SegmentCount {
            name: name.to_string(),
            segments,
            blocks: n,
        });
    }
    let mut h = x.clone();
    let mut start = 0;
    for s in 0..segments {
        let len = n / segments + usize::from(s < n % segments);
        let end = start + len;
        let seg: Vec<(usize, Block)> = (start..end).map(|i| (i, blocks[i].clone())).collect();
        // Each block reads only its statement's declared input.
        let region = Region::new(format!("{name}[{start}..{end}]")).declaring_all_reads();
        h = region.run(&[&h], move |ctx, ins| {
            let mut h = ins[0].clone();
            for (i, f) in &seg {
                h = ctx.open(&format!("block.{i}"), &[&h], |t| f.forward(&t[0]))?;
            }
            Ok(h)
        })?;
        start = end;
    }
    Ok(h)
}
