//! The byte rule: what a tape holds, counted once per storage.
//!
//! A storage is counted the first time any tensor on it is seen, as large as
//! the farthest any tensor on it reaches (`storage.rs`); parameters and region inputs are
//! excluded by the caller. The memory report, the budget planner's costs,
//! the trace's bytes and offload's host bytes all count with this rule.

use std::collections::HashMap;

use candle_core::Tensor;

use crate::storage::storage_extent;
use crate::tape::{Record, Saved};

/// The storages counted so far, with the bytes counted for each.
#[derive(Default)]
pub(crate) struct Seen(HashMap<usize, usize>);

impl Seen {
    /// Never counts the storage `t` uses (a parameter's, a region input's).
    pub(crate) fn exclude(&mut self, t: &Tensor) {
        self.exclude_key(storage_extent(t).0);
    }

    /// Never counts storage `key`.
    pub(crate) fn exclude_key(&mut self, key: usize) {
        self.0.insert(key, usize::MAX);
    }

    /// Counts `bytes` of storage `key`: what they add to what was counted of
    /// it before. A storage is as large as the farthest any tensor on it
    /// reaches (a narrow view first seen reaches less than its source).
    fn add(&mut self, key: usize, bytes: usize) -> usize {
        let counted = self.0.entry(key).or_insert(0);
        let more = bytes.saturating_sub(*counted);
        *counted = (*counted).max(bytes);
        more
    }
}

/// Counts bytes of storages not counted before: the one rule behind the
/// memory report, the budget planner's costs and the trace's bytes.
pub(crate) struct Counter<'a> {
    seen: &'a mut Seen,
}

impl<'a> Counter<'a> {
    /// A counter that skips what `seen` counted and adds what it counts.
    pub(crate) fn new(seen: &'a mut Seen) -> Self {
        Counter { seen }
    }

    /// Bytes a saved record holds on its device that were not counted
    /// before: its tracked graph, its leaf copies and its ferried outputs, less
    /// what an offloaded record holds on the host.
    pub(crate) fn saved(&mut self, saved: &Saved) -> usize {
        if let Some(offloaded) = &saved.offloaded {
            for (key, _) in offloaded.on_host() {
                self.seen.exclude_key(key);
            }
        }
        let graph: usize = saved.outs.iter().map(|t| self.count(t, true)).sum();
        let rest: usize = saved
            .leaves
            .iter()
            .chain(&saved.ferried)
            .flatten()
            .map(|t| self.count(t, false))
            .sum();
        graph + rest
    }

    /// Bytes of the storages of `t` (and, with `graph`, of its tracked
    /// ancestors) not seen before.
    pub(crate) fn count(&mut self, t: &Tensor, graph: bool) -> usize {
        let nodes: Vec<Tensor> = if graph && t.track_op() {
            t.sorted_nodes().into_iter().cloned().collect()
        } else {
            vec![t.clone()]
        };
        nodes
            .iter()
            .map(|n| {
                let (key, bytes) = storage_extent(n);
                self.seen.add(key, bytes)
            })
            .sum()
    }
}

/// Bytes of each record's own saved graph (leaf copies, region inputs and
/// parameters excluded), counted as [`MemoryReport`] counts them: what the
/// budget planner charges for saving the statement.
pub(crate) fn own_bytes(records: &[Record], params: &[Tensor], inputs: &[Tensor]) -> Vec<usize> {
    let mut seen = Seen::default();
    for t in params.iter().chain(inputs) {
        seen.exclude(t);
    }
    for saved in records.iter().filter_map(|r| r.saved.as_ref()) {
        for leaf in saved.leaves.iter().flatten() {
            seen.exclude(leaf);
        }
    }
    let mut counter = Counter::new(&mut seen);
    records
        .iter()
        .map(|r| r.saved.as_ref().map_or(0, |saved| counter.saved(saved)))
        .collect()
}
