//! [`Checkpointed`]: a layer one cannot edit, checkpointed whole by a
//! one-line wrap.

use std::any::Any;
use std::sync::Arc;

use candle_core::{Module, ModuleT, Tensor};

use crate::candle_nn::BatchNorm;
use crate::Region;

/// A candle layer checkpointed whole: its forward runs as a region of one
/// statement, `forward`, so that nothing of the layer is kept between the
/// forward and the backward but its input, and the layer runs again at the
/// start of its backward. For code one cannot edit (a layer from
/// candle-transformers, a `candle_nn::Sequential`): wrapping is one line,
/// the layer need not be `Clone` (the wrapper shares it with the tapes), and
/// the wrapper is a `Module` again (a layer that is only a `ModuleT`:
/// [`Checkpointed::forward_t`]).
///
/// Its cost, against writing the layer's forward as a `remat!` block: the
/// whole layer is the unit of recomputation (one more forward of it per
/// step, always, whatever the plan: a plan can only save or recompute the
/// statement `forward` as a whole), and while its backward runs the layer's
/// whole graph is alive, as in plain candle. A `remat!` block names each
/// statement, so that plans can save the expensive ones and recompute the
/// cheap ones. As in a block, a candle op without a backward in the layer
/// (`candle_nn::ops::rms_norm`, `softmax_last_dim`, `rotary_emb::rope`) is
/// an error ([`crate::RematError::GradientCut`]) instead of a missing
/// gradient, and a random op of candle's (`candle_nn::Dropout` in training)
/// is caught by the replay check ([`crate::RematError::ReplayDiverged`]):
/// use [`crate::random`] and [`crate::candle_nn`] inside layers you wrap.
/// The layer's effects run again in the replay, and nothing catches them:
/// candle-nn's `BatchNorm` in training, inside a layer you wrap, would
/// update its running statistics twice per step (use
/// [`crate::candle_nn::BatchNorm`]; a candle-nn `BatchNorm` wrapped by
/// itself runs as that drop-in); code of your own with effects that must
/// happen once per step skips them when [`crate::in_replay`] is `true`.
///
/// The layer must be `Send + Sync + 'static` (its region's tape lives until
/// the backward); it need not be `Clone`: the wrapper shares it with the
/// tapes. (candle's `Sequential` holds `Box<dyn Module>`, which is not
/// `Send`: wrap the struct holding its layers instead.)
///
/// ```
/// use candle_core::{DType, Device, Module, Result, Tensor, Var};
/// use candle_nn::Linear;
/// use remat_runtime::Checkpointed;
///
/// struct Mlp { fc1: Linear, fc2: Linear } // a layer from a crate: not Clone
/// impl Module for Mlp {
///     fn forward(&self, xs: &Tensor) -> Result<Tensor> {
///         self.fc2.forward(&self.fc1.forward(xs)?.gelu()?)
///     }
/// }
///
/// let dev = Device::Cpu;
/// let w1 = Var::randn(0f32, 0.1, (32, 8), &dev)?;
/// let w2 = Var::randn(0f32, 0.1, (8, 32), &dev)?;
/// let mlp = Mlp {
///     fc1: Linear::new(w1.as_tensor().clone(), None),
///     fc2: Linear::new(w2.as_tensor().clone(), None),
/// };
/// let mlp = Checkpointed::new("mlp", mlp); // the one line
/// let x = Var::randn(0f32, 1.0, (4, 8), &dev)?;
/// let y = mlp.forward(x.as_tensor())?;
/// let grads = y.sqr()?.sum_all()?.backward()?; // replays `mlp`, then its backward
/// assert!(grads.get(&w1).is_some() && grads.get(&x).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct Checkpointed<M> {
    name: String,
    /// Shared with the tapes of calls not yet through their backward.
    layer: Arc<M>,
}

impl<M> Clone for Checkpointed<M> {
    fn clone(&self) -> Self {
        Checkpointed {
            name: self.name.clone(),
            layer: Arc::clone(&self.layer),
        }
    }
}

impl<M> Checkpointed<M> {
    /// `layer`, checkpointed as the region `name` (the name in errors and
    /// memory reports).
    ///
    /// ```
    /// let id = remat_runtime::Checkpointed::new("block.0", candle_nn::Activation::Relu);
    /// assert_eq!(id.name(), "block.0");
    /// ```
    pub fn new(name: impl Into<String>, layer: M) -> Self {
        Checkpointed {
            name: name.into(),
            layer: Arc::new(layer),
        }
    }

    /// The region's name.
    ///
    /// ```
    /// let id = remat_runtime::Checkpointed::new("act", candle_nn::Activation::Relu);
    /// assert_eq!(id.name(), "act");
    /// ```
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The wrapped layer.
    ///
    /// ```
    /// let id = remat_runtime::Checkpointed::new("act", candle_nn::Activation::Relu);
    /// assert!(matches!(id.layer(), candle_nn::Activation::Relu));
    /// ```
    pub fn layer(&self) -> &M {
        &self.layer
    }
}

impl<M: Module + Send + Sync + 'static> Module for Checkpointed<M> {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let layer = Arc::clone(&self.layer);
        Ok(Region::new(self.name.as_str()).run(&[xs], move |ctx, ins| {
            ctx.open("forward", &[&ins[0]], |t| layer.forward(&t[0]))
        })?)
    }
}

impl<M: ModuleT + Send + Sync + 'static> Checkpointed<M> {
    /// The forward of a layer that is a `ModuleT` (dropout, batch norm:
    /// `train` switches them), checkpointed. (A wrapped `Module` is a
    /// `ModuleT` through candle's blanket implementation.)
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let drop = remat_runtime::Checkpointed::new("drop", candle_nn::Dropout::new(0.5));
    /// let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    /// assert_eq!(drop.forward_t(&x, false)?.to_vec1::<f32>()?, vec![1.0; 4]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let layer = Arc::clone(&self.layer);
        Ok(Region::new(self.name.as_str()).run(&[xs], move |ctx, ins| {
            ctx.open("forward", &[&ins[0]], |t| {
                // candle-nn's batch norm, wrapped as it is: as the drop-in,
                // whose running statistics the replay leaves alone.
                match (&*layer as &dyn Any).downcast_ref::<candle_nn::BatchNorm>() {
                    Some(bn) => BatchNorm::from(bn.clone()).forward_t(&t[0], train),
                    None => layer.forward_t(&t[0], train),
                }
            })
        })?)
    }
}
