//! The reverse sweep over the units of a replayed region.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Tensor, TensorId};

use crate::graph::Seed;
use crate::replay::Unit;
use crate::{RematError, Result};

fn accumulate(grads: &mut HashMap<TensorId, Tensor>, id: TensorId, g: Tensor) -> Result<()> {
    match grads.remove(&id) {
        Some(prev) => grads.insert(id, (prev + g)?),
        None => grads.insert(id, g),
    };
    Ok(())
}

/// Adds `g` to the gradient in `slot`, or puts it there.
fn add_to(slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        None => g,
        Some(prev) => (prev + g)?,
    });
    Ok(())
}

/// Gradients by position; `None` where nothing flowed.
pub(crate) type Grads = Vec<Option<Tensor>>;

/// Walks the units from last to first. Each unit's backward is one candle
/// backward seeded with the accumulated gradients of its values; the
/// gradients of its leaves flow to the values they stand for, and parameter
/// gradients accumulate. Each unit is dropped as soon as it is done, so the
/// memory of the replay falls during the sweep.
///
/// Returns the gradients of the region inputs and of the parameters.
pub(crate) fn sweep(
    region: &str,
    mut units: Vec<Unit>,
    output_ids: &[TensorId],
    output_grads: Vec<Option<Tensor>>,
    inputs: &[Tensor],
    params: &[Tensor],
) -> Result<(Grads, Grads)> {
    let mut grads = HashMap::new();
    for (&id, g) in output_ids.iter().zip(output_grads) {
        if let Some(g) = g {
            accumulate(&mut grads, id, g)?;
        }
    }
    let mut param_grads: Grads = vec![None; params.len()];
    while let Some(unit) = units.pop() {
        if unit.targets.iter().any(|(id, _)| grads.contains_key(id)) {
            // Offloaded residuals come back just before they are needed.
            for offloaded in &unit.restore {
                offloaded.restore()?;
            }
        }
        let mut root: Option<Tensor> = None;
        for (id, target) in &unit.targets {
            if let Some(g) = grads.remove(id) {
                let seed = target.apply_op1(Seed::new(g))?;
                root = Some(match root {
                    None => seed,
                    Some(r) => (r + seed)?,
                });
            }
        }
        let Some(root) = root else { continue };
        // An op's backward that fails names the region and the unit's
        // statements.
        let store = root.backward().map_err(|e| RematError::Statement {
            region: region.to_string(),
            statement: unit.label.clone(),
            source: Arc::new(e.into()),
        })?;
        drop(root);
        // Gradients candle computes from a variable (a leaf or a parameter)
        // are themselves tracked and hold the graph that made them: detach
        // them (zero-copy) so the unit's memory is freed with the unit.
        for (source, leaf) in &unit.leaves {
            if let Some(g) = store.get(leaf) {
                let g = match unit.relayouts.iter().find(|(id, _)| *id == leaf.id()) {
                    Some((_, r)) => r.grad(g)?,
                    None => g.detach(),
                };
                accumulate(&mut grads, *source, g)?;
            }
        }
        for (slot, p) in param_grads.iter_mut().zip(params) {
            if let Some(g) = store.get(p) {
                add_to(slot, g.detach())?;
            }
        }
    }
    // A parameter returned as a region output receives that output's
    // gradient directly.
    for (slot, p) in param_grads.iter_mut().zip(params) {
        if let Some(g) = grads.remove(&p.id()) {
            add_to(slot, g)?;
        }
    }
    let input_grads = inputs.iter().map(|t| grads.remove(&t.id())).collect();
    Ok((input_grads, param_grads))
}
