//! Finding parameters that silently got no gradient.

use candle_core::backprop::GradStore;
use candle_core::Var;

use crate::{RematError, Result};

/// Checks that every named parameter has a gradient in `grads`, and names
/// those that have none.
///
/// candle cuts gradients silently at ops without a backward: in candle 0.11
/// the fused `candle_nn::LayerNorm` (on contiguous inputs), `ops::layer_norm`,
/// `ops::rms_norm`, `ops::softmax_last_dim`, `ops::sdpa` and
/// `rotary_emb::rope`/`rope_i`/`rope_thd` train nothing behind them.
/// Call this once after the first `backward` of a training run.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::{check_gradients, RematError};
/// let dev = Device::Cpu;
/// let (w, g, b) = (
///     Var::ones((4, 4), DType::F32, &dev)?,
///     Var::ones(4, DType::F32, &dev)?,
///     Var::zeros(4, DType::F32, &dev)?,
/// );
/// let x = Var::ones((2, 4), DType::F32, &dev)?;
/// // the fused layer norm has no backward: `g` and `b` get nothing
/// let h = candle_nn::ops::layer_norm(&x.matmul(&w)?, &g, &b, 1e-5)?;
/// let grads = (h.matmul(&w)?.sum_all()?).backward()?;
/// let err = check_gradients(&grads, [("w", &w), ("ln.g", &g), ("ln.b", &b)]).unwrap_err();
/// assert!(matches!(&err, RematError::MissingGradients { names } if names == &["ln.g", "ln.b"]));
/// // the differentiable one trains everything
/// let h = candle_nn::ops::layer_norm_slow(&x.matmul(&w)?, &g, &b, 1e-5)?;
/// let grads = (h.matmul(&w)?.sum_all()?).backward()?;
/// check_gradients(&grads, [("w", &w), ("ln.g", &g), ("ln.b", &b)])?;
/// # Ok::<(), RematError>(())
/// ```
pub fn check_gradients<'a, S: AsRef<str>>(
    grads: &GradStore,
    params: impl IntoIterator<Item = (S, &'a Var)>,
) -> Result<()> {
    let names: Vec<String> = params
        .into_iter()
        .filter(|(_, v)| grads.get(v).is_none())
        .map(|(n, _)| n.as_ref().to_string())
        .collect();
    if names.is_empty() {
        Ok(())
    } else {
        Err(RematError::MissingGradients { names })
    }
}
