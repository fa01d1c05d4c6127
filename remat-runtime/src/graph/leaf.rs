//! Leaves: the fresh variables statements run on, and the tensors a
//! statement may read that the region does not know.

use candle_core::{Tensor, Var};

use crate::{RematError, Result};

/// Copies `t` into a fresh variable: a leaf of a tracked sub-graph whose
/// gradient candle computes.
pub(crate) fn make_leaf(t: &Tensor) -> Result<Tensor> {
    Ok(Var::from_tensor(&t.detach())?.into_inner())
}

/// Whether a gradient can flow through `t`: a float tensor with a graph.
/// candle records ops on integer and boolean results too (a comparison of a
/// tracked value), but its backward skips them.
pub(crate) fn carries_grad(t: &Tensor) -> bool {
    t.track_op() && t.dtype().is_float()
}

/// Checks input `index` of `statement`, a tensor that is neither a region
/// input nor a statement output: a constant or a parameter (candle tracks
/// the latter by itself) is fine; a tracked tensor from elsewhere would lose
/// its gradient. The forward and the replay both check with this.
pub(crate) fn check_input(region: &str, statement: &str, index: usize, t: &Tensor) -> Result<()> {
    if t.track_op() && !t.is_variable() {
        return Err(RematError::ForeignTrackedInput {
            region: region.to_string(),
            statement: statement.to_string(),
            index,
        });
    }
    Ok(())
}

/// Checks that the graph of `statement`'s `outputs` reaches no node
/// `foreign` picks: a leaf of a value the statement read without declaring
/// it. The forward's check and the replay's both walk with this.
pub(crate) fn check_reads(
    region: &str,
    statement: &str,
    outputs: &[Tensor],
    foreign: impl Fn(&Tensor) -> bool,
) -> Result<()> {
    for t in outputs.iter().filter(|t| t.track_op()) {
        if t.sorted_nodes().into_iter().any(&foreign) {
            return Err(RematError::UndeclaredInput {
                region: region.to_string(),
                statement: statement.to_string(),
            });
        }
    }
    Ok(())
}

/// Checks that a statement that read values needing gradients
/// (`reads_tracked`) does not give only floating-point outputs that carry
/// none: an op without a backward would have cut the path without a word.
/// Integer and boolean outputs (comparisons, `argmax`) carry no gradient by
/// nature; a constant beside a tracked output (`(y, Tensor::zeros(..))`)
/// is not a cut. The forward's, the replay's and a plain run's check.
pub(crate) fn check_cut(
    region: &str,
    statement: &str,
    reads_tracked: bool,
    outputs: &[Tensor],
) -> Result<()> {
    if !reads_tracked {
        return Ok(());
    }
    let mut floats = outputs
        .iter()
        .enumerate()
        .filter(|(_, t)| t.dtype().is_float());
    let first = floats.clone().next();
    match first {
        Some((output, _)) if floats.all(|(_, t)| !t.track_op()) => Err(RematError::GradientCut {
            region: region.to_string(),
            statement: statement.to_string(),
            output,
        }),
        _ => Ok(()),
    }
}
