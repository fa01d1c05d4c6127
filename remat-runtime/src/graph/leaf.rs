//! Leaves: the fresh variables statements run on, and the tensors a
//! statement may read that the region does not know.

use std::collections::HashSet;
use std::ops::Range;

use candle_core::{Tensor, Var};

use crate::{RematError, Result};

/// Copies `t` into a fresh variable: a leaf of a tracked sub-graph whose
/// gradient candle computes.
pub(crate) fn make_leaf(t: &Tensor) -> Result<Tensor> {
    Ok(Var::from_tensor(&t.detach())?.into_inner())
}

/// A new handle to `t`'s elements with no graph: the same storage and
/// layout under an id of its own (no copy). A statement that gives back a
/// value the block holds (`h.clone()`, `h.detach()` of a value the forward
/// holds detached) gets a value of its own: whether it needs gradients is
/// that statement's to decide, not the value's it came from.
pub(crate) fn new_handle(t: &Tensor) -> Result<Tensor> {
    let d = t.detach();
    Ok(d.broadcast_as(d.shape())?)
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
    // An empty output carries nothing (candle gives a tensor of no
    // elements no graph: an expert no token chose, an empty batch).
    let mut floats = outputs
        .iter()
        .enumerate()
        .filter(|(_, t)| t.dtype().is_float() && t.elem_count() > 0);
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

/// What the graph of a statement must reach of a value it reads for its
/// values, where not every tensor of it ([`crate::RematError::InputCut`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// One of these tensors: a value read in part (`parts[0]`, `pair.0`).
    OneOf(Range<usize>),
    /// None of them: a value read only on some branches of the statement
    /// (`if skip { (h + x)? } else { h }`), which the branch taken may not
    /// read.
    NoneOf(Range<usize>),
}

/// Checks that the graph of a statement's `outputs` reaches every one of
/// its first `value_inputs` arguments that carries a gradient (but as
/// `reach` says for the values read in part or on a branch), when some output is a float (integer and boolean outputs carry no gradient by
/// nature). Paths through integer values (a comparison, `argmax`) and
/// `affine(0.0, ..)` do not count: candle's backward skips them. The forward's, the replay's and a
/// plain run's check, wherever the arguments are tracked; after
/// [`check_cut`].
pub(crate) fn check_reached(
    region: &str,
    statement: &str,
    args: &[Tensor],
    value_inputs: usize,
    reach: &[Reach],
    outputs: &[Tensor],
) -> Result<()> {
    let mut tracked = args
        .iter()
        .take(value_inputs)
        .enumerate()
        .filter(|(_, t)| carries_grad(t))
        .peekable();
    // An empty float output has no graph in candle, so what it depends on
    // is unknown: the statement's reads are not checked in this run (a
    // gradient through it would be empty anyway).
    let floats = || outputs.iter().filter(|t| t.dtype().is_float());
    if tracked.peek().is_none()
        || floats().next().is_none()
        || floats().any(|t| t.elem_count() == 0)
    {
        return Ok(());
    }
    let mut reached = HashSet::new();
    for t in outputs.iter().filter(|t| carries_grad(t)) {
        reached.extend(t.sorted_nodes().into_iter().map(Tensor::id));
    }
    // Outputs that reach nothing carry no gradient by nature (made from
    // integers: `x.ge(0.0)?.to_dtype(..)`, `argmax`), or are cut whole,
    // which `check_cut` reports.
    if reached.is_empty() {
        return Ok(());
    }
    // An input that is not reached is a cut when a gradient could have
    // reached it: it has elements and a path to a variable of its own (not
    // one made from integers: `x.ge(0)?.to_dtype(..)`, which candle tracks
    // and its backward skips).
    let cut = |t: &Tensor| {
        !reached.contains(&t.id()) && t.elem_count() > 0 && !t.sorted_nodes().is_empty()
    };
    // A value read in part is cut only if none of its tensors is reached;
    // one read on a branch, never.
    let part_reached = |i: usize| {
        reach.iter().any(|r| match r {
            Reach::OneOf(range) => {
                range.contains(&i)
                    && args[range.clone()]
                        .iter()
                        .any(|t| carries_grad(t) && reached.contains(&t.id()))
            }
            Reach::NoneOf(range) => range.contains(&i),
        })
    };
    match tracked.find(|(i, t)| cut(t) && !part_reached(*i)) {
        Some((input, t)) => Err(RematError::InputCut {
            region: region.to_string(),
            statement: statement.to_string(),
            input,
            name: None,
            shape: t.dims().to_vec(),
        }),
        None => Ok(()),
    }
}
