//! The units the replay groups statements into, for the backward sweep.

use std::sync::Arc;

use candle_core::{Tensor, TensorId};

use crate::graph::Relayout;
use crate::offload::Offloaded;

/// One step of the backward sweep: a maximal run of recomputed statements
/// or one saved statement, with the saved statements chained to it.
pub(crate) struct Unit {
    /// The statements it covers, for error messages and traces.
    pub label: String,
    /// Its leaves: (the value a leaf stands for, the leaf).
    pub leaves: Vec<(TensorId, Tensor)>,
    /// The values later units or the region outputs need gradients of, with
    /// the tensor to seed: filled when the replay ends.
    pub targets: Vec<(TensorId, Tensor)>,
    /// Offloaded residuals to bring back before the unit's backward.
    pub restore: Vec<Arc<Offloaded>>,
    /// Leaves in memory order, by the leaf: their gradients are turned
    /// into their values' ([`Relayout::grad`]).
    pub relayouts: Vec<(TensorId, Relayout)>,
}

impl Unit {
    /// A unit that starts with statement `name`.
    pub fn new(name: &str, restore: Vec<Arc<Offloaded>>) -> Self {
        Unit {
            label: name.to_string(),
            leaves: Vec::new(),
            targets: Vec::new(),
            restore,
            relayouts: Vec::new(),
        }
    }

    /// Adds the leaf standing for value `source`, unless the unit has it:
    /// saved statements reading one value share its leaf, whose gradient
    /// the unit must route once.
    pub fn add_leaf(&mut self, source: TensorId, leaf: Tensor) {
        if !self.leaves.iter().any(|(_, l)| l.id() == leaf.id()) {
            self.leaves.push((source, leaf));
        }
    }
}
