//! The replay that starts a region's backward: the block runs again,
//! recomputing what was not saved and grouping the statements into units
//! for the sweep.
//!
//! The forward (`tape/recorder.rs`) and the replay are the two modes a
//! statement runs in; the tape is the only hand-off between them.
//!
//! * this file: [`Replay`], statements during the replay;
//! * `unit`: [`Unit`], one step of the backward sweep;
//! * `timed`: replay times of statements, for `PeakPlan`'s time model.
//!
//! Longer than the other files for a reason: the replay's two statement
//! paths, `recompute` and `skip_saved`, and the checks of each (against the
//! record, undeclared reads, fingerprints to collect) share one state
//! (values, units, open leaves); split into files, every piece would take
//! that whole state as an argument. Each path is one short function that
//! names its steps, each step a method of its own.

pub(crate) mod timed;
mod unit;

pub(crate) use unit::Unit;

use std::collections::{HashMap, HashSet};

use candle_core::{Layout, Tensor, TensorId};

use crate::graph::{
    carries_grad, check_cut, check_input, check_reached, check_reads, make_leaf, Reach, Relayout,
};
use crate::inspect::trace::{self, Phase, TraceEvent};
use crate::tape::checksum::Kind;
use crate::tape::fingerprint::{self, Checks, Compare, Subject};
use crate::tape::unread;
use crate::tape::{Meta, Record, Saved};
use crate::{Outputs, Policy, RematError, Result};

/// A value seen during replay.
struct Value {
    /// The unit that produced it; `None` for region inputs and constants.
    unit: Option<usize>,
    requires_grad: bool,
    /// What statements read. A region input that needs gradients is a leaf
    /// of its own (a variable): a statement that reads it without declaring
    /// it then shows in its graph. A saved output that needs gradients is
    /// the saved graph's own output, which the recomputed statements after
    /// it continue.
    tensor: Tensor,
    /// The leaf copy later units read, made once and shared by them (saved
    /// outputs only; other values get one copy per unit).
    leaf: Option<Tensor>,
    /// Whether `leaf` is shared.
    share: bool,
    /// What the backward of the producing unit is seeded on: the value itself
    /// for a unit of recomputed statements, the tracked output kept from the forward for
    /// a saved statement.
    target: Option<Tensor>,
    /// Its bits are the forward's: a region input, a ferried output, or the
    /// output of a recomputed statement whose replay was bitwise.
    bitwise: bool,
    /// The layout the forward read it in, if not contiguous: statements
    /// read its leaf through a view with these strides ([`as_read_in`]).
    layout: Option<Layout>,
}

/// The block's second run, at the start of the region's backward.
pub(crate) struct Replay {
    records: Vec<Record>,
    next: usize,
    values: HashMap<TensorId, Value>,
    /// The keys of `values` in the order they were first seen, so that the
    /// backward seeds (and sums gradients) in the same order every time.
    order: Vec<TensorId>,
    placeholders: HashMap<TensorId, String>,
    units: Vec<Unit>,
    /// The unit recomputed statements currently add to.
    open: Option<usize>,
    /// Leaves of the open unit, by the value they stand for.
    open_leaves: HashMap<TensorId, Tensor>,
    /// What statements read in place of a leaf, by the leaf: a view with
    /// the forward's strides, or the leaf itself.
    reads: HashMap<TensorId, Tensor>,
    /// The leaves in memory order, by the leaf: how to read each and turn
    /// its gradient into the value's.
    relayouts: HashMap<TensorId, Relayout>,
    /// Values some unit holds a leaf of, or that are region outputs.
    needed: HashSet<TensorId>,
    /// The call's label in the current trace, when one is recorded.
    trace: Option<String>,
    /// The parameters the block used in the forward.
    params: HashSet<TensorId>,
    /// Fingerprints to compare when the replay ends (`None` when the
    /// forward took none).
    checks: Option<Checks>,
    /// The input of the last statement's sole op call, to fingerprint at
    /// the start of the next statement or at the end, as the forward did
    /// (`Recorder::pending_sole`).
    pending_sole: Option<(Subject, Tensor)>,
}

/// `save`, `recompute` or `(plan)`, for side-by-side traces.
fn declared_label(declared: Option<Policy>) -> String {
    declared.map_or("(plan)".to_string(), |p| p.to_string())
}

/// How a statement was written, for desync messages.
fn describe(declared: Option<Policy>) -> String {
    match declared {
        Some(p) => format!("{p} statement"),
        None => "statement".to_string(),
    }
}

/// The layout of `t` if it is not contiguous: what a replay must keep.
pub(crate) fn strided(t: &Tensor) -> Option<Layout> {
    (!t.is_contiguous()).then(|| t.layout().clone())
}

/// A stand-in for a saved output that was not ferried: a broadcast scalar with
/// the right shape, dtype and device and one element of memory. Statements
/// that declare it as an input get [`RematError::PlaceholderRead`]; code that
/// reads it any other way computes with NaN (for float dtypes), so that the
/// mistake shows in the gradients instead of passing silently.
pub(crate) fn placeholder(meta: &Meta) -> Result<Tensor> {
    let scalar = crate::graph::nan_scalar(meta.dtype, &meta.device)?;
    Ok(scalar.broadcast_as(meta.shape.clone())?)
}

impl Replay {
    /// `checked`: the region inputs the tape kept, to fingerprint (the
    /// block may see leaf copies of them, or placeholders).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        records: Vec<Record>,
        inputs: &[Tensor],
        checked: &[Option<Tensor>],
        relaid: Vec<Option<(Tensor, Relayout)>>,
        requires_grad: &[bool],
        params: &[Tensor],
        fingerprints: Option<fingerprint::Forward>,
        trace: Option<String>,
    ) -> Result<Self> {
        let order = inputs.iter().map(|t| t.id()).collect();
        let mut reads = HashMap::new();
        let mut relayouts = HashMap::new();
        let values = inputs
            .iter()
            .zip(relaid)
            .zip(requires_grad)
            .map(|((t, relaid), &r)| {
                // A strided input's leaf is in memory order: `t` is the
                // view of it the block sees, which units share.
                let leaf = relaid.map(|(leaf, relayout)| {
                    reads.insert(leaf.id(), t.clone());
                    relayouts.insert(leaf.id(), relayout);
                    leaf
                });
                let v = Value {
                    unit: None,
                    requires_grad: r,
                    tensor: t.clone(),
                    share: leaf.is_some(),
                    leaf,
                    target: None,
                    bitwise: true,
                    layout: strided(t),
                };
                (t.id(), v)
            })
            .collect();
        // Parameters first, then inputs: a changed one is the cause to report.
        let statement = |k: u32| {
            records
                .get(k as usize)
                .map_or_else(|| "(region output)".to_string(), |r| r.name.clone())
        };
        let checks = match fingerprints {
            Some(forward) => {
                let mut taken = Vec::new();
                for ((index, p), &k) in params.iter().enumerate().zip(&forward.params) {
                    let subject = Subject::Parameter {
                        index,
                        shape: p.dims().to_vec(),
                        statement: statement(k),
                    };
                    taken.push((subject, Some(p)));
                }
                for &(index, k, name) in &forward.inputs {
                    let t = checked[index as usize]
                        .as_ref()
                        .unwrap_or(&inputs[index as usize]);
                    let subject = Subject::Input {
                        index: index as usize,
                        name,
                        shape: t.dims().to_vec(),
                        statement: statement(k),
                    };
                    taken.push((subject, Some(t)));
                }
                for f in &forward.fields {
                    let subject = Subject::Field {
                        field: f.field,
                        shape: f.tensor.dims().to_vec(),
                        statement: f.statement,
                    };
                    taken.push((subject, Some(&f.tensor)));
                }
                let mut checks = Checks {
                    forward: forward.sums,
                    subjects: Vec::new(),
                    replay: Vec::new(),
                };
                checks.take(taken, Kind::Bits)?;
                Some(checks)
            }
            None => None,
        };
        Ok(Replay {
            records,
            next: 0,
            values,
            order,
            placeholders: HashMap::new(),
            units: Vec::new(),
            open: None,
            open_leaves: HashMap::new(),
            reads,
            relayouts,
            needed: HashSet::new(),
            trace,
            params: params.iter().map(|p| p.id()).collect(),
            checks,
            pending_sole: None,
        })
    }

    /// Finds the forward record this statement replays and checks its inputs.
    /// Returns its index and the policy the forward gave it.
    fn expect(
        &mut self,
        region: &str,
        name: &str,
        declared: Option<Policy>,
        inputs: &[&Tensor],
    ) -> Result<(usize, Policy)> {
        let k = self.next;
        let found = format!("{} `{name}`", describe(declared));
        let here = format!("{name} {}", declared_label(declared));
        let Some(record) = self.records.get(k) else {
            return Err(RematError::desync(region, "no further statement", found)
                .with_trace(self.side_by_side(k, &here)));
        };
        if record.name != name || record.declared != declared || record.inputs.len() != inputs.len()
        {
            let expected = format!(
                "{} `{}` with {} inputs",
                describe(record.declared),
                record.name,
                record.inputs.len()
            );
            let found = format!("{found} with {} inputs", inputs.len());
            let at = format!("{here}, {} inputs", inputs.len());
            return Err(
                RematError::desync(region, expected, found).with_trace(self.side_by_side(k, &at))
            );
        }
        for (i, (meta, t)) in record.inputs.iter().zip(inputs).enumerate() {
            let replay = Meta::of(t);
            meta.check(&replay, region, name, format!("input {i}"))
                .map_err(|e| {
                    let at = format!("{here}, input {i} {:?}", replay.shape.dims());
                    e.with_trace(self.side_by_side(k, &at))
                })?;
        }
        self.next += 1;
        Ok((k, record.policy))
    }

    /// The forward's records next to the replay so far, diverging at `k`.
    fn side_by_side(&self, k: usize, found: &str) -> String {
        let forward: Vec<(String, String)> = self
            .records
            .iter()
            .map(|r| (r.name.clone(), trace::policy_label(r.policy, r.declared)))
            .collect();
        trace::side_by_side(&forward, k, found)
    }

    pub fn statement<O: Outputs>(
        &mut self,
        region: &str,
        name: &str,
        declared: Option<Policy>,
        inputs: &[&Tensor],
        (value_inputs, reach): (usize, &[Reach]),
        f: impl FnOnce(&[Tensor]) -> Result<O>,
    ) -> Result<O> {
        let (k, policy) = self.expect(region, name, declared, inputs)?;
        let out = match policy {
            Policy::Recompute => {
                self.recompute(region, name, k, inputs, (value_inputs, reach), f)?
            }
            Policy::Save | Policy::Offload => self.skip_saved(region, name, k, inputs)?,
        };
        if let Some(label) = &self.trace {
            let record = &self.records[k];
            let bytes = match policy {
                Policy::Recompute => record
                    .outputs
                    .iter()
                    .map(|m| m.shape.elem_count() * m.dtype.size_in_bytes())
                    .sum(),
                Policy::Save | Policy::Offload => 0,
            };
            trace::push(TraceEvent::of(Phase::Replay, label, record, bytes));
        }
        Ok(out)
    }

    /// A recomputed statement: runs again on the values of the replay (in
    /// the open unit, or a new one), checked against its record, its
    /// fingerprints taken, its outputs registered as values.
    fn recompute<O: Outputs>(
        &mut self,
        region: &str,
        name: &str,
        k: usize,
        inputs: &[&Tensor],
        (value_inputs, reach): (usize, &[Reach]),
        f: impl FnOnce(&[Tensor]) -> Result<O>,
    ) -> Result<O> {
        self.fingerprint_pending_sole()?;
        self.check_no_placeholder(region, name, inputs)?;
        let u = self.open_unit(name);
        let (args, bitwise) = self.args(region, name, k, u, inputs, value_inputs)?;
        let reads_tracked = args.iter().take(value_inputs).any(|t| t.track_op());
        let (sole_call, unread) = (self.records[k].sole_call, self.records[k].unread);
        let skip = sole_call.filter(|_| unread).map(usize::from);
        let (out, calls) = timed::replay(region, name, || unread::watch(skip, || f(&args)));
        let out = out.map_err(|e| e.in_statement(region, name))?;
        let mut tensors = Vec::new();
        let skeleton = out.split_into(&mut tensors);
        check_cut(region, name, reads_tracked, &tensors)?;
        check_reached(region, name, &args, value_inputs, reach, &tensors)?;
        drop(args);
        self.check_outputs(region, name, k, &tensors)?;
        // The statement's value is the same op call's output as in the
        // forward (or no op call's alone): what the record decided holds.
        if unread::sole_call::<O::Skeleton>(&calls, &tensors) != sole_call {
            let expected = match sole_call {
                Some(c) => format!("`{name}` giving as its value the output of its op call {c}"),
                None => format!("`{name}` giving a value that is no op call's output alone"),
            };
            return Err(RematError::desync(region, expected, "another value"));
        }
        // What the forward fingerprinted of the op's input, taken again.
        let sole_input = sole_call
            .filter(|_| self.records[k].sole_fingerprinted)
            .map(|c| calls[usize::from(c)].input.clone());
        drop(calls);
        self.check_declared(region, name, u, &tensors)?;
        self.check_gained(region, name, k, &tensors)?;
        self.take_fingerprints(name, unread, bitwise, &tensors, sole_input.as_ref())?;
        self.register(u, k, bitwise, &tensors);
        O::join(&mut tensors.into_iter(), &skeleton)
    }

    /// A statement reading a placeholder (a saved output not yet computed
    /// in this replay) is an error naming the statement that makes it.
    fn check_no_placeholder(&self, region: &str, name: &str, inputs: &[&Tensor]) -> Result<()> {
        for t in inputs {
            if let Some(producer) = self.placeholders.get(&t.id()) {
                return Err(RematError::PlaceholderRead {
                    region: region.to_string(),
                    statement: name.to_string(),
                    producer: producer.clone(),
                });
            }
        }
        Ok(())
    }

    /// The open unit, `name` added to its label, or a new one.
    fn open_unit(&mut self, name: &str) -> usize {
        match self.open {
            Some(u) => {
                self.units[u].label.push_str(&format!(", {name}"));
                u
            }
            None => {
                self.units.push(Unit::new(name, Vec::new()));
                self.open = Some(self.units.len() - 1);
                self.units.len() - 1
            }
        }
    }

    /// What recomputed statement `k` of unit `u` runs on, and whether its
    /// replay computes the forward's bits: every input it reads for its
    /// value has the forward's bits and layout, on the CPU.
    fn args(
        &mut self,
        region: &str,
        name: &str,
        k: usize,
        u: usize,
        inputs: &[&Tensor],
        value_inputs: usize,
    ) -> Result<(Vec<Tensor>, bool)> {
        let mut args = Vec::with_capacity(inputs.len());
        let mut bitwise = true;
        for (i, t) in inputs.iter().enumerate() {
            let value = self.values.get(&t.id());
            bitwise &=
                i >= value_inputs || (t.device().is_cpu() && value.is_none_or(|v| v.bitwise));
            match value {
                // Read for its value: a leaf, so that the gradient through it
                // reaches its unit (one copy, shared by the units reading it).
                Some(v) if v.requires_grad && v.unit != Some(u) && i < value_inputs => {
                    // Read as the forward read it: strided, or a contiguous
                    // copy (a first forward's leaf).
                    let strided = self.records[k].strided_reads.get(i).unwrap_or(true);
                    let leaf = self.open_leaf(u, t, strided)?;
                    args.push(self.read_of(&leaf, strided)?);
                }
                // A value that carries no gradient (an integer one made
                // from tracked values: a comparison) is read detached, as
                // the forward read it.
                Some(v) if !v.requires_grad => args.push(t.detach()),
                // Read for its shape or detached: as it is, no copy.
                Some(_) => args.push((*t).clone()),
                None => {
                    check_input(region, name, i, t)?;
                    args.push((*t).clone());
                }
            }
        }
        bitwise &= fingerprint::layouts(args.iter().take(value_inputs)) == self.records[k].layouts;
        Ok((args, bitwise))
    }

    /// The leaf unit `u` reads the value `t` through: the one the unit
    /// opened already, the value itself if it is a leaf, the shared copy of
    /// a saved output, or a new copy (laid out as the forward read it if
    /// `strided`), added to the unit.
    fn open_leaf(&mut self, u: usize, t: &Tensor, strided: bool) -> Result<Tensor> {
        if let Some(leaf) = self.open_leaves.get(&t.id()) {
            return Ok(leaf.clone());
        }
        let v = &self.values[&t.id()];
        let (tensor, shared, share) = (v.tensor.clone(), v.leaf.clone(), v.share);
        let layout = v.layout.clone().filter(|_| strided);
        // A value that is a leaf already serves every unit that reads it:
        // no copy. Not a parameter a statement gave as it is (`w.clone()`):
        // the gradient through the value belongs to the statement's unit,
        // which passes it on to the parameter.
        let own_leaf = tensor.is_variable() && !self.params.contains(&tensor.id());
        let leaf = match (own_leaf, shared) {
            (true, _) => tensor,
            (false, Some(leaf)) => leaf,
            (false, None) => self.leaf_of(&tensor, layout.as_ref())?,
        };
        if share {
            if let Some(v) = self.values.get_mut(&t.id()) {
                v.leaf = Some(leaf.clone());
            }
        }
        self.open_leaves.insert(t.id(), leaf.clone());
        self.units[u].add_leaf(t.id(), leaf.clone());
        if let Some(r) = self.relayouts.get(&leaf.id()) {
            self.units[u].relayouts.push((leaf.id(), r.clone()));
        }
        self.needed.insert(t.id());
        Ok(leaf)
    }

    /// The replay's outputs of statement `k` are as many as the forward's,
    /// each of the same shape, dtype and device.
    fn check_outputs(&self, region: &str, name: &str, k: usize, tensors: &[Tensor]) -> Result<()> {
        let record = &self.records[k];
        if tensors.len() != record.outputs.len() {
            return Err(RematError::desync(
                region,
                format!("`{name}` returning {} tensors", record.outputs.len()),
                format!("`{name}` returning {} tensors", tensors.len()),
            ));
        }
        for (j, (meta, t)) in record.outputs.iter().zip(tensors).enumerate() {
            let replay = Meta::of(t);
            if let Err(e) = meta.check(&replay, region, name, format!("output {j}")) {
                let at = format!("{name} recompute, output {j} {:?}", replay.shape.dims());
                return Err(e.with_trace(self.side_by_side(k, &at)));
            }
        }
        Ok(())
    }

    /// An output that needs gradients only in the replay got them through a
    /// value the statement read without declaring it: the forward handed
    /// it on as a constant, and saved statements reading it kept no way
    /// back.
    fn check_gained(&self, region: &str, name: &str, k: usize, tensors: &[Tensor]) -> Result<()> {
        let needed = self.records[k].outputs_need_grad;
        let gained = tensors
            .iter()
            .enumerate()
            .any(|(j, t)| carries_grad(t) && needed.get(j) == Some(false));
        match gained {
            true => Err(RematError::UndeclaredInput {
                region: region.to_string(),
                statement: name.to_string(),
            }),
            false => Ok(()),
        }
    }

    /// The fingerprints of a recomputed statement's outputs (none compared
    /// for an output left `unread`), and, in place of an output the replay
    /// may leave uncomputed, of what its op's backward reads.
    fn take_fingerprints(
        &mut self,
        name: &str,
        unread: bool,
        bitwise: bool,
        tensors: &[Tensor],
        sole_input: Option<&Tensor>,
    ) -> Result<()> {
        let Some(checks) = &mut self.checks else {
            return Ok(());
        };
        let compare = |t: &Tensor| {
            if bitwise && t.device().is_cpu() {
                Compare::Bitwise
            } else {
                Compare::Within(fingerprint::tolerance(t.dtype()))
            }
        };
        let mut taken = Vec::new();
        for (output, t) in tensors.iter().enumerate() {
            let (compare, t) = match unread {
                true => (Compare::Unread, None),
                false => (compare(t), Some(t)),
            };
            let subject = Subject::Output {
                statement: name.to_string(),
                output,
                compare,
            };
            taken.push((subject, t));
        }
        if let Some(input) = sole_input {
            let subject = Subject::Output {
                statement: name.to_string(),
                output: 0,
                compare: compare(input),
            };
            self.pending_sole = Some((subject, input.clone()));
        }
        checks.take(taken, Kind::Sums)
    }

    /// Fingerprints the pending sole call's input, if any: at the start of
    /// the next statement or at the end of the replay, when the forward
    /// took it.
    fn fingerprint_pending_sole(&mut self) -> Result<()> {
        let (Some((subject, input)), Some(checks)) = (self.pending_sole.take(), &mut self.checks)
        else {
            return Ok(());
        };
        checks.take(vec![(subject, Some(&input))], Kind::Sums)
    }

    /// The outputs of recomputed statement `k`, run in unit `u`, as values
    /// of the replay (an output that is one of the unit's own leaves stays
    /// what it is).
    fn register(&mut self, u: usize, k: usize, bitwise: bool, tensors: &[Tensor]) {
        let needed = self.records[k].outputs_need_grad;
        for (j, t) in tensors.iter().enumerate() {
            // An output that is one of the unit's own leaves stays what it is.
            if !self.values.contains_key(&t.id()) {
                self.order.push(t.id());
                // Needs gradients as the forward decided (the same for every
                // plan): an output that turns out a constant here (built
                // from a tracked value's shape) passes no gradient on.
                let requires_grad = carries_grad(t) || needed.get(j) == Some(true);
                let value = Value {
                    unit: Some(u),
                    requires_grad,
                    tensor: t.clone(),
                    leaf: None,
                    share: false,
                    target: Some(t.clone()),
                    bitwise,
                    layout: strided(t),
                };
                self.values.insert(t.id(), value);
            }
        }
    }

    /// A leaf standing for `t`, a value the forward read laid out as
    /// `layout` where that is not contiguous: in memory order, so that it
    /// reads as the forward's view at no cost.
    fn leaf_of(&mut self, t: &Tensor, layout: Option<&Layout>) -> Result<Tensor> {
        match layout.and_then(|l| Relayout::of(l, t.device())) {
            Some(r) => {
                let leaf = r.leaf(t)?;
                self.reads.insert(leaf.id(), r.read(&leaf)?);
                self.relayouts.insert(leaf.id(), r);
                Ok(leaf)
            }
            None => make_leaf(t),
        }
    }

    /// What a statement reads in place of `leaf`: for a leaf in memory
    /// order, the view of it with the forward's strides (made once), or a
    /// contiguous copy of that view where the forward read one (a region's
    /// first forward); any other leaf as it is.
    fn read_of(&self, leaf: &Tensor, strided: bool) -> Result<Tensor> {
        match self.reads.get(&leaf.id()) {
            Some(read) if strided => Ok(read.clone()),
            Some(read) => Ok(read.contiguous()?),
            None => Ok(leaf.clone()),
        }
    }

    /// The variables the outputs of a recomputed statement depend on must be
    /// leaves of its own unit or parameters. Another unit's leaf means the
    /// closure captured a value computed elsewhere instead of declaring it:
    /// that unit's backward would never see the gradient through it.
    fn check_declared(&self, region: &str, name: &str, u: usize, outputs: &[Tensor]) -> Result<()> {
        let own = &self.units[u].leaves;
        check_reads(region, name, outputs, |node| {
            node.is_variable()
                && !self.params.contains(&node.id())
                && !own.iter().any(|(_, leaf)| leaf.id() == node.id())
        })
    }

    /// A saved (or offloaded) statement: not run; its outputs are the
    /// values the forward ferried (or placeholders), in the unit of its
    /// kept graph (a new one, or the last if it continued the saved
    /// statement before it).
    fn skip_saved<O: Outputs>(
        &mut self,
        region: &str,
        name: &str,
        k: usize,
        inputs: &[&Tensor],
    ) -> Result<O> {
        self.fingerprint_pending_sole()?;
        self.open = None;
        self.open_leaves.clear();
        let saved = self.records[k].saved.take().ok_or_else(|| {
            RematError::desync(
                region,
                format!("saved statement `{name}` with its record"),
                "a record that was already consumed",
            )
        })?;
        // A chained record joins the unit of the saved record before it,
        // which is the last unit.
        let u = match (saved.chained, self.units.len()) {
            (true, n) if n > 0 => n - 1,
            (_, n) => n,
        };
        let leaves = self.saved_leaves(region, name, &saved, inputs)?;
        // Offloaded residuals come back when the sweep reaches the unit, or
        // now if a recomputed statement reads one of the outputs.
        let mut restore = Vec::new();
        if let Some(offloaded) = &saved.offloaded {
            if saved.ferried.iter().any(Option::is_some) {
                offloaded.restore()?;
            } else {
                restore.push(offloaded.clone());
            }
        }
        let (outputs, continued) = self.saved_outputs(name, k, u, &saved)?;
        let skeleton = saved
            .skeleton
            .downcast_ref::<O::Skeleton>()
            .ok_or_else(|| {
                RematError::desync(
                    region,
                    format!("`{name}` returning the same type as in the forward"),
                    "another type",
                )
            })?
            .clone();
        if u < self.units.len() {
            self.units[u].label.push_str(&format!(", {name}"));
        } else {
            self.units.push(Unit::new(name, Vec::new()));
        }
        let unit = &mut self.units[u];
        for (source, leaf) in leaves {
            unit.add_leaf(source, leaf);
        }
        unit.restore.extend(restore);
        if continued {
            // The recomputed statements after it join its unit, sharing its
            // leaves.
            self.open = Some(u);
            self.open_leaves = unit.leaves.iter().cloned().collect();
        }
        O::join(&mut outputs.into_iter(), &skeleton)
    }

    /// The leaves a saved statement's kept graph starts from, each with the
    /// value it stands for: an input that needs gradients in the replay as
    /// it did in the forward.
    fn saved_leaves(
        &mut self,
        region: &str,
        name: &str,
        saved: &Saved,
        inputs: &[&Tensor],
    ) -> Result<Vec<(TensorId, Tensor)>> {
        let mut leaves = Vec::new();
        for (i, leaf) in saved.leaves.iter().enumerate() {
            let Some(leaf) = leaf else { continue };
            let t = inputs[i];
            match self.values.get(&t.id()) {
                Some(v) if v.requires_grad => {
                    leaves.push((t.id(), leaf.clone()));
                    self.needed.insert(t.id());
                }
                _ => {
                    return Err(RematError::desync(
                        region,
                        format!("input {i} of `{name}` needing gradients"),
                        "an input that needs none",
                    ))
                }
            }
        }
        Ok(leaves)
    }

    /// The outputs of saved statement `k` as values of unit `u`: a ferried
    /// output (continued by the recomputed statements after it when it
    /// needs gradients: the flag returned), or a placeholder that no
    /// statement may read.
    fn saved_outputs(
        &mut self,
        name: &str,
        k: usize,
        u: usize,
        saved: &Saved,
    ) -> Result<(Vec<Tensor>, bool)> {
        let metas = &self.records[k].outputs;
        let mut outputs = Vec::with_capacity(metas.len());
        // Recomputed statements reading an output that needs gradients
        // continue this statement's graph, in its unit: no leaf copy of the
        // output (it would sit beside the graph's own until the sweep).
        let mut continued = false;
        for (j, meta) in metas.iter().enumerate() {
            let target = saved.outs.get(j).cloned();
            let requires_grad = target.as_ref().is_some_and(carries_grad);
            let ferried = saved.ferried.get(j).cloned().flatten();
            // An input returned as it is (`None => xs`) is the statement's
            // own leaf: continued as any other output of its graph.
            let graph_node = |t: &Tensor| {
                !t.is_variable() || saved.leaves.iter().flatten().any(|l| l.id() == t.id())
            };
            // The layout the forward's block read: the ferried output's.
            let value = match (ferried, &target) {
                (Some(_), Some(tracked)) if requires_grad && graph_node(tracked) => {
                    continued = true;
                    tracked.clone()
                }
                // A parameter returned as it is (`w.clone()`): statements
                // of this unit read the parameter, later units a leaf copy
                // whose gradient reaches it through this unit's target.
                (Some(_), Some(tracked)) if requires_grad => tracked.clone(),
                (Some(ferried), _) => ferried,
                (None, _) => {
                    let p = placeholder(meta)?;
                    self.placeholders.insert(p.id(), name.to_string());
                    p
                }
            };
            outputs.push(value.clone());
            // A parameter some statement gave as its value already is that
            // statement's value.
            if self.values.contains_key(&value.id()) {
                continue;
            }
            self.order.push(value.id());
            self.values.insert(
                value.id(),
                Value {
                    unit: Some(u),
                    requires_grad,
                    share: requires_grad,
                    tensor: value.clone(),
                    leaf: None,
                    target,
                    bitwise: true,
                    layout: strided(&value),
                },
            );
        }
        Ok((outputs, continued))
    }

    /// Ends the replay: checks every record was consumed and decides which
    /// values each unit seeds. Returns the units for the sweep.
    pub fn finish(mut self, region: &str, outputs: &[Tensor]) -> Result<Vec<Unit>> {
        if self.next < self.records.len() {
            return Err(RematError::NotReplayed {
                region: region.to_string(),
                statements: self.records[self.next..]
                    .iter()
                    .map(|r| r.name.clone())
                    .collect(),
            });
        }
        self.fingerprint_pending_sole()?;
        if let Some(checks) = self.checks.take() {
            checks.compare(region)?;
        }
        self.needed.extend(outputs.iter().map(|t| t.id()));
        for id in self.order {
            if !self.needed.contains(&id) {
                continue;
            }
            let Some(value) = self.values.remove(&id) else {
                continue;
            };
            if let (Some(u), Some(target)) = (value.unit, value.target) {
                if target.track_op() {
                    self.units[u].targets.push((id, target));
                }
            }
        }
        Ok(self.units)
    }
}
