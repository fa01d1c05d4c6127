//! Mean cross-entropy over logits.

use candle_core::{CustomOp2, DType, Result, Tensor, D};

use super::attach::{forward_computed, Computed};

struct CrossEntropy {
    out: Computed,
    /// Per row, `log(sum(exp(logits)))`, `(N, 1)`.
    lse: Tensor,
}

/// Mean cross-entropy of `logits` `(N, V)` against class indices `targets`
/// `(N)` (`u32` or `i64`), as `candle_nn::loss::cross_entropy` computes it.
/// The graph keeps the logits and one log-sum-exp per row; the backward
/// computes the probabilities from them.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let logits = Var::new(&[[0f32, 0.], [0., 0.]], &dev)?;
/// let targets = Tensor::new(&[0u32, 1], &dev)?;
/// let loss = remat_runtime::nn::cross_entropy(&logits, &targets)?;
/// assert!((loss.to_scalar::<f32>()? - 2f32.ln()).abs() < 1e-6);
/// let g = loss.backward()?;
/// assert_eq!(g.get(&logits).unwrap().to_vec2::<f32>()?, vec![vec![-0.25, 0.25], vec![0.25, -0.25]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let _profile = crate::inspect::profile::op("cross_entropy");
    let l = logits.detach();
    let &[n, _] = l.dims() else {
        candle_core::bail!(
            "cross_entropy: the logits have shape {:?}; expected (N, classes) (flatten the batch and the positions first)",
            l.dims()
        );
    };
    if targets.dims() != [n] || !matches!(targets.dtype(), DType::U8 | DType::U32 | DType::I64) {
        candle_core::bail!(
            "cross_entropy: the targets are {:?} of shape {:?}; expected class indices (u32, u8 or i64) of shape ({n},)",
            targets.dtype(),
            targets.dims()
        );
    }
    let max = l.max_keepdim(D::Minus1)?;
    let lse = (l
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + &max)?;
    let picked = l.gather(&targets.detach().unsqueeze(1)?, 1)?;
    let loss = ((lse.clone() - picked)?.sum_all()? / n as f64)?;
    let op = CrossEntropy {
        out: Computed::new(loss),
        lse,
    };
    logits.apply_op2(targets, op)
}

impl CustomOp2 for CrossEntropy {
    forward_computed!("remat-cross-entropy", s1 l1, s2 l2);
    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _profile = crate::inspect::profile::backward("cross_entropy");
        let l = logits.detach();
        let (n, _) = l.dims2()?;
        let p = l.broadcast_sub(&self.lse)?.exp()?;
        let idx = targets.detach().unsqueeze(1)?;
        let ones = Tensor::ones((n, 1), l.dtype(), l.device())?;
        let onehot = l.zeros_like()?.scatter_add(&idx, &ones, 1)?;
        let scale = (g.detach() / n as f64)?;
        Ok((Some((p - onehot)?.broadcast_mul(&scale)?), None))
    }
}
