//! Statements during the forward of a region.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Tensor, TensorId, Var};

use crate::memory::{Counter, Seen};
use crate::tape::{Meta, Profile, Record, Saved, Source};
use crate::trace::{self, Phase, TraceEvent};
use crate::{Outputs, Policy, RematError, Result};

/// Copies `t` into a fresh variable: a leaf of a tracked sub-graph whose
/// gradient candle computes.
pub(crate) fn make_leaf(t: &Tensor) -> Result<Tensor> {
    Ok(Var::from_tensor(&t.detach())?.into_inner())
}

/// A statement's policies, as the context decided them.
pub(crate) struct Decided {
    /// The policy written in the code, if any.
    pub declared: Option<Policy>,
    /// The policy the plan gave it.
    pub policy: Policy,
    /// The outputs of a saved statement stay on the tape for the replay.
    pub keep: bool,
}

/// What the forward learns while the block runs.
pub(crate) struct ForwardState {
    /// For every value the block has seen: does it need gradients?
    requires_grad: HashMap<TensorId, bool>,
    /// Every statement output: value -> record.
    producers: HashMap<TensorId, usize>,
    /// Outputs of saved statements: value -> (record, output position).
    saved_outputs: HashMap<TensorId, (usize, usize)>,
    /// Saved outputs a recomputed statement reads: they must stay on the tape.
    ferried: HashSet<(usize, usize)>,
    pub records: Vec<Record>,
    names: HashSet<String>,
    leaf_ids: HashSet<TensorId>,
    pub params: Vec<Tensor>,
    param_ids: HashSet<TensorId>,
    /// First record of the run of chained saved records that ends with the
    /// last record, if the last record is a saved one with a graph.
    chain: Option<usize>,
    /// Measure statements for the budget planner.
    profile: bool,
    /// The call's label in the trace being recorded, if any.
    trace: Option<String>,
    /// Storages already counted in the trace's bytes.
    trace_seen: Seen,
}

impl ForwardState {
    /// `profile`: measure every statement for the budget planner; `trace`:
    /// the call's label in the trace being recorded, if any.
    pub fn new(
        inputs: &[Tensor],
        requires_grad: &[bool],
        profile: bool,
        trace: Option<String>,
    ) -> Self {
        let mut trace_seen = Seen::default();
        if trace.is_some() {
            for t in inputs {
                trace_seen.exclude(t);
            }
        }
        ForwardState {
            requires_grad: inputs
                .iter()
                .zip(requires_grad)
                .map(|(t, r)| (t.id(), *r))
                .collect(),
            producers: HashMap::new(),
            saved_outputs: HashMap::new(),
            ferried: HashSet::new(),
            records: Vec::new(),
            names: HashSet::new(),
            leaf_ids: HashSet::new(),
            params: Vec::new(),
            param_ids: HashSet::new(),
            chain: None,
            profile,
            trace,
            trace_seen,
        }
    }

    /// Records statement `index` in the trace being recorded, if any, with
    /// the bytes it holds on the tape counted as the memory report counts
    /// them (storages once per region call, parameters and their views not).
    fn trace_event(&mut self, index: usize) {
        let Some(label) = &self.trace else { return };
        let record = &self.records[index];
        for p in &self.params {
            self.trace_seen.exclude(p);
        }
        let bytes = record
            .saved
            .as_ref()
            .map_or(0, |saved| Counter::new(&mut self.trace_seen).saved(saved));
        trace::push(TraceEvent::of(Phase::Forward, label, record, bytes));
    }

    fn needs_grad(&self, region: &str, record: &str, index: usize, t: &Tensor) -> Result<bool> {
        if let Some(&r) = self.requires_grad.get(&t.id()) {
            return Ok(r);
        }
        if t.track_op() && !t.is_variable() {
            return Err(RematError::ForeignTrackedInput {
                region: region.to_string(),
                record: record.to_string(),
                index,
            });
        }
        // A constant, or a parameter passed explicitly: candle tracks the
        // latter by itself.
        Ok(false)
    }

    /// Records the variables `t` depends on that are not leaves of this region.
    fn discover_params(&mut self, t: &Tensor) {
        if !t.track_op() {
            return;
        }
        for node in t.sorted_nodes() {
            if node.is_variable()
                && !self.leaf_ids.contains(&node.id())
                && self.param_ids.insert(node.id())
            {
                self.params.push(node.clone());
            }
        }
    }

    pub fn statement<O: Outputs>(
        &mut self,
        region: &str,
        name: &str,
        decided: Decided,
        inputs: &[&Tensor],
        f: impl FnOnce(&[Tensor]) -> Result<O>,
    ) -> Result<O> {
        let Decided {
            declared,
            policy,
            keep,
        } = decided;
        if !self.names.insert(name.to_string()) {
            return Err(RematError::DuplicateName {
                region: region.to_string(),
                record: name.to_string(),
            });
        }
        let index = self.records.len();
        let needs = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| self.needs_grad(region, name, i, t))
            .collect::<Result<Vec<bool>>>()?;
        let input_metas = inputs.iter().map(|t| Meta::of(t)).collect();
        let sources: Vec<Source> = if self.profile {
            inputs
                .iter()
                .zip(&needs)
                .map(|(t, &need)| Source {
                    needs_grad: need,
                    producer: self.producers.get(&t.id()).copied(),
                    bytes: t.elem_count() * t.dtype().size_in_bytes(),
                })
                .collect()
        } else {
            Vec::new()
        };
        let timed = self.profile;
        let mut seconds = 0.0;
        let run = |args: &[Tensor]| -> Result<(Vec<Tensor>, O::Skeleton)> {
            let start = timed.then(Instant::now);
            let out = f(args).map_err(|e| e.in_statement(region, name))?;
            seconds = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
            let mut tensors = Vec::new();
            let skeleton = out.split_into(&mut tensors);
            Ok((tensors, skeleton))
        };
        match policy {
            Policy::Recompute => {
                for t in inputs {
                    if let Some(&slot) = self.saved_outputs.get(&t.id()) {
                        self.ferried.insert(slot);
                    }
                }
                let args: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
                let (tracked, skeleton) = run(&args)?;
                let any_input = needs.iter().any(|&n| n);
                let mut outputs = Vec::with_capacity(tracked.len());
                let mut metas = Vec::with_capacity(tracked.len());
                for t in &tracked {
                    self.discover_params(t);
                    let d = t.detach();
                    self.requires_grad.insert(d.id(), any_input || t.track_op());
                    if self.profile {
                        self.producers.insert(d.id(), index);
                    }
                    metas.push(Meta::of(t));
                    outputs.push(d);
                }
                drop(tracked);
                self.chain = None;
                self.records.push(Record {
                    name: name.to_string(),
                    declared,
                    policy,
                    inputs: input_metas,
                    outputs: metas,
                    saved: None,
                    profile: self.profile.then(|| Box::new(Profile { seconds, sources })),
                });
                self.trace_event(index);
                O::join(&mut outputs.into_iter(), &skeleton)
            }
            Policy::Save | Policy::Offload => {
                // An offloaded statement's graph moves to the host as a whole:
                // it neither continues a saved graph nor is continued.
                let offload = policy == Policy::Offload;
                let mut leaves = Vec::with_capacity(inputs.len());
                let mut args = Vec::with_capacity(inputs.len());
                let mut chained = false;
                for (t, &need) in inputs.iter().zip(&needs) {
                    if let Some(tracked) = (need && !offload).then(|| self.chainable(t)).flatten() {
                        // Continue the previous saved statement's graph: no
                        // leaf copy, and the two records form one unit.
                        chained = true;
                        leaves.push(None);
                        args.push(tracked);
                    } else if need {
                        let leaf = make_leaf(t)?;
                        self.leaf_ids.insert(leaf.id());
                        leaves.push(Some(leaf.clone()));
                        args.push(leaf);
                    } else {
                        leaves.push(None);
                        args.push((*t).clone());
                    }
                }
                let (tracked, skeleton) = run(&args)?;
                drop(args);
                let mut outputs = Vec::with_capacity(tracked.len());
                let mut metas = Vec::with_capacity(tracked.len());
                for (j, t) in tracked.iter().enumerate() {
                    self.discover_params(t);
                    let d = t.detach();
                    self.requires_grad.insert(d.id(), t.track_op());
                    if self.profile {
                        self.producers.insert(d.id(), index);
                    }
                    self.saved_outputs.insert(d.id(), (index, j));
                    metas.push(Meta::of(t));
                    outputs.push(d);
                }
                if keep {
                    self.ferried.extend((0..outputs.len()).map(|j| (index, j)));
                }
                let any_tracked = tracked.iter().any(|t| t.track_op());
                let saved = Saved {
                    leaves: if any_tracked {
                        leaves
                    } else {
                        vec![None; inputs.len()]
                    },
                    outs: if any_tracked { tracked } else { Vec::new() },
                    kept: outputs.iter().cloned().map(Some).collect(),
                    skeleton: Arc::new(skeleton.clone()),
                    chained: chained && any_tracked,
                    offload: None,
                };
                self.chain = match (any_tracked && !offload, chained) {
                    (false, _) => None,
                    (true, true) => self.chain,
                    (true, false) => Some(index),
                };
                self.records.push(Record {
                    name: name.to_string(),
                    declared,
                    policy,
                    inputs: input_metas,
                    outputs: metas,
                    saved: Some(saved),
                    profile: self.profile.then(|| Box::new(Profile { seconds, sources })),
                });
                self.trace_event(index);
                O::join(&mut outputs.into_iter(), &skeleton)
            }
        }
    }

    /// The tracked output behind `t` when `t` is an output of the run of
    /// saved records that ends just before the new statement: the new saved
    /// statement continues that graph instead of copying `t` into a leaf. A
    /// leaf there would be wrong, not only wasteful: its gradient would flow
    /// to a unit the sweep has already finished.
    fn chainable(&self, t: &Tensor) -> Option<Tensor> {
        let start = self.chain?;
        let &(k, j) = self.saved_outputs.get(&t.id())?;
        if k < start {
            return None;
        }
        let tracked = self.records.get(k)?.saved.as_ref()?.outs.get(j)?;
        tracked.track_op().then(|| tracked.clone())
    }

    /// Ends the forward: saved outputs that no recomputed statement reads are
    /// dropped from the tape (replay gives placeholders for them).
    pub fn finish(mut self) -> (Vec<Record>, Vec<Tensor>) {
        for (k, record) in self.records.iter_mut().enumerate() {
            if let Some(saved) = record.saved.as_mut() {
                for (j, kept) in saved.kept.iter_mut().enumerate() {
                    if !self.ferried.contains(&(k, j)) {
                        *kept = None;
                    }
                }
            }
        }
        (self.records, self.params)
    }
}
