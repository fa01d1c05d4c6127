//! The forward of a region: runs each statement and writes its record.
//!
//! A statement takes one of two paths, as in the replay: [`Recorder::recompute`]
//! runs it on its inputs as they are and keeps nothing but its metadata;
//! [`Recorder::save`] runs it on leaf copies of the inputs that need
//! gradients and keeps its tracked graph (its residuals) on the tape.
//!
//! Longer than the other files for the replay's reason:
//! the two paths and the checks each runs (inputs, undeclared reads on a
//! region's first forward, fingerprints, the trace) share one state (what
//! each value is, which leaves exist, what the planner measures).

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Tensor, TensorId};

use super::bytes::{Counter, Seen};
use super::checksum::Kind;
use super::Mask;
use super::{fingerprint, unread};
use super::{Meta, Profile, Record, Saved, Source};
use crate::graph::{
    carries_grad, check_cut, check_input, check_reached, check_reads, make_leaf, new_handle, Reach,
    Relayout,
};
use crate::inspect::trace::{self, Phase, TraceEvent};
use crate::{Outputs, Policy, Result};

/// The regions this thread has run, recorded or plain.
#[derive(Default)]
struct FirstRuns {
    /// Recorded: the regions whose first forward saw leaves of every value
    /// (and looked for undeclared reads), each with the outputs that
    /// forward found to be constants (bit `j`: output `j`, a tensor no
    /// statement gave and that carries no gradient).
    recorded: HashMap<String, Mask>,
    /// Recorded, of regions that declare every read (generated code): their
    /// first forward saw leaves for its recomputed statements.
    generated: HashSet<String>,
    /// Plain: the regions whose first plain run looked for cut inputs.
    plain: HashSet<String>,
}

thread_local! {
    static FIRST_RUNS: RefCell<FirstRuns> = RefCell::new(FirstRuns::default());
}

/// Whether this forward of `region` is its first on this thread, which
/// runs statements on leaves of every value that needs gradients: their
/// graphs then show every cut and, unless the region declares every read
/// (`generated`), every undeclared read (a property of the block's code,
/// checked once).
pub(crate) fn first_forward(region: &str, generated: bool) -> bool {
    FIRST_RUNS.with(|c| {
        let mut c = c.borrow_mut();
        if generated {
            return c.generated.insert(region.to_string());
        }
        if c.recorded.contains_key(region) {
            return false;
        }
        c.recorded.insert(region.to_string(), Mask::default());
        true
    })
}

/// Whether this plain run of `region` is its first on this thread, which
/// looks for inputs a statement's graph does not reach (walking the graph
/// down to the parameters: once).
pub(crate) fn first_plain_run(region: &str) -> bool {
    FIRST_RUNS.with(|c| c.borrow_mut().plain.insert(region.to_string()))
}

/// The outputs of `region` that its first forward (which looks at every
/// value) found to be constants. A first forward records them (`record`),
/// later ones read them.
pub(crate) fn constant_outputs(region: &str, record: Option<Mask>) -> Mask {
    FIRST_RUNS.with(|c| {
        let c = &mut c.borrow_mut().recorded;
        match record {
            Some(mask) => {
                c.insert(region.to_string(), mask);
                mask
            }
            None => c.get(region).copied().unwrap_or_default(),
        }
    })
}

/// A statement about to be recorded, as the context decided it.
pub(crate) struct Statement<'a> {
    pub region: &'a str,
    pub name: &'a str,
    /// The policy written in the code, if any.
    pub declared: Option<Policy>,
    /// The policy the plan gave it.
    pub policy: Policy,
    /// The first this many inputs are read for their values (`Ctx::run`).
    pub value_inputs: usize,
    /// Among those, the values read in part (`Ctx::run`).
    pub reach: &'a [Reach],
}

/// What the statement's code returned: its tensors (still attached to the
/// graph the code built) and the plain rest of its value.
struct Ran<S> {
    tensors: Vec<Tensor>,
    skeleton: S,
    seconds: f64,
    /// The op call whose tensor is the statement's whole value, and the
    /// input its backward reads ([`unread::sole_call`]); recomputed
    /// statements only.
    sole: Option<(u16, Tensor)>,
    /// For a recomputed statement: the layouts of the values it ran on
    /// ([`fingerprint::layouts`]).
    layouts: u64,
    /// For a recomputed statement: bit `i`, it read value input `i` as a
    /// strided view (not contiguous).
    strided_reads: Mask,
}

/// What one of a statement's two paths gives: the outputs the block sees
/// (detached), what the tape keeps of it, and what its code returned.
type Taken<S> = (Vec<Tensor>, Option<Box<Saved>>, Ran<S>);

/// What a forward leaves for the tape.
pub(crate) struct Recorded {
    pub records: Vec<Record>,
    /// The parameters the block used, in order of first use.
    pub params: Vec<Tensor>,
    /// Per region input: the record of the first statement that reads it
    /// in the backward, if any: a recomputed statement (the replay reads
    /// it), or a saved one whose kept graph holds it as it is (its backward
    /// reads it; an input that needs gradients is read through a copy).
    pub inputs_read: Vec<Option<u32>>,
    /// Per region input: a recomputed statement reads it (the replay does).
    pub replayed: Vec<bool>,
    /// Per parameter: the record of the first statement whose graph used it.
    pub param_statements: Vec<u32>,
    /// Per region input: an output of the block depends on it (returns
    /// it, or a statement whose value an output depends on used it): a
    /// gradient can reach it, and the region anchors it. One that needs
    /// gradients but that no output depends on in this call (not read, read
    /// only on a branch not taken, or only by statements whose values no
    /// output needs) gets none, as in plain candle.
    pub used: Vec<bool>,
    /// The fingerprints of the recomputed outputs, in order, when taken.
    pub fingerprints: Option<Vec<Tensor>>,
}

/// What the forward learns while the block runs.
pub(crate) struct Recorder {
    /// For every value the block has seen: does it need gradients?
    requires_grad: HashMap<TensorId, bool>,
    /// Every statement output: value -> record (measured calls only).
    producers: HashMap<TensorId, usize>,
    /// Outputs of saved statements: value -> (record, output position).
    saved_outputs: HashMap<TensorId, (usize, usize)>,
    /// Saved outputs a recomputed statement reads: ferried to the replay.
    ferried: HashSet<(usize, usize)>,
    /// Every value a recomputed statement reads (what the replay reads),
    /// with the first record that reads it.
    replay_reads: HashMap<TensorId, usize>,
    /// Every value a saved statement's kept graph holds, as it is or as a
    /// leaf copy, with the first record that reads it: its backward reads
    /// it (or the copy, where plain candle's would read it), so a change in
    /// place before then must be seen.
    saved_reads: HashMap<TensorId, usize>,
    /// Recomputed statements whose whole value is one `nn` op call's
    /// tensor: (record, the value). The replay may leave such a value
    /// uncomputed ([`unread`]).
    sole_values: Vec<(usize, TensorId)>,
    /// The last record if it is a recomputed statement whose value is one
    /// `nn` op call's tensor, and that op's input: fingerprinted when the
    /// next statement is a saved one or none follows (the replay may leave
    /// that value uncomputed and compare the input in its place), dropped
    /// unfingerprinted when the next recomputed statement is recorded (the
    /// replay then computes the value and compares it). The replay takes it
    /// at the same points, so that both read it after the same code.
    pending_sole: Option<(usize, Tensor)>,
    records: Vec<Record>,
    leaf_ids: HashSet<TensorId>,
    /// The leaf copy of each value saved statements read: one per value in
    /// a region call, however many statements read it (not offloaded ones:
    /// their graphs move to the host whole).
    shared_leaves: HashMap<TensorId, Tensor>,
    params: Vec<Tensor>,
    /// Per parameter: the record whose graph used it first.
    param_first: Vec<usize>,
    param_ids: HashSet<TensorId>,
    /// First record of the run of chained saved records that ends with the
    /// last record, if the last record is a saved one with a graph.
    chain: Option<usize>,
    /// Measure statements for the budget planner.
    profile: bool,
    /// Fingerprints of recomputed outputs for the replay check, in order;
    /// `None` when this forward takes none.
    fingerprints: Option<Vec<Tensor>>,
    /// A region's first forward: recomputed statements run on leaves of the
    /// values they read that need gradients (copies, for the statement's
    /// run only), so that their graphs show every cut.
    first: bool,
    /// This forward looks for undeclared reads: every value the block sees
    /// that needs gradients is a leaf of its own (a copy), so a statement
    /// that reads one without declaring it shows it in its graph.
    captures: bool,
    /// Those leaves.
    value_leaves: HashSet<TensorId>,
    /// The call's label in the trace being recorded, if any.
    trace: Option<String>,
    /// Per value that needs gradients (a region input, a statement
    /// output): the region inputs it depends on, sorted; `[k]` for region
    /// input `k`. A statement's outputs depend on what the values it used
    /// depend on (see [`Recorded::used`]).
    depends: HashMap<TensorId, Arc<[u32]>>,
    /// The number of the first region call to attach its outputs after
    /// this forward began ([`crate::graph::calls_so_far`]): outputs of
    /// calls before it are not this block's to read but as its inputs.
    start: u64,
    /// Storages already counted in the trace's bytes.
    trace_seen: Seen,
}

impl Recorder {
    /// `profile`: measure every statement for the budget planner;
    /// `fingerprints`: take fingerprints of recomputed outputs; `trace`: the
    /// call's label in the trace being recorded, if any.
    pub fn new(
        inputs: &[Tensor],
        requires_grad: &[bool],
        profile: bool,
        fingerprints: bool,
        first: bool,
        captures: bool,
        trace: Option<String>,
    ) -> Self {
        let mut trace_seen = Seen::default();
        if trace.is_some() {
            for t in inputs {
                trace_seen.exclude(t);
            }
        }
        // Region inputs that need gradients are leaves already when the
        // forward looks for captures (the region made them).
        let value_leaves: HashSet<TensorId> = inputs
            .iter()
            .filter(|t| captures && t.is_variable())
            .map(|t| t.id())
            .collect();
        Recorder {
            requires_grad: inputs
                .iter()
                .zip(requires_grad)
                .map(|(t, r)| (t.id(), *r))
                .collect(),
            producers: HashMap::new(),
            saved_outputs: HashMap::new(),
            ferried: HashSet::new(),
            replay_reads: HashMap::new(),
            saved_reads: HashMap::new(),
            sole_values: Vec::new(),
            pending_sole: None,
            records: Vec::new(),
            leaf_ids: value_leaves.clone(),
            shared_leaves: HashMap::new(),
            params: Vec::new(),
            param_first: Vec::new(),
            param_ids: HashSet::new(),
            chain: None,
            profile,
            fingerprints: fingerprints.then(Vec::new),
            first,
            captures,
            value_leaves,
            trace,
            depends: inputs
                .iter()
                .zip(requires_grad)
                .enumerate()
                .filter(|(_, (_, &r))| r)
                .map(|(k, (t, _))| (t.id(), Arc::from([k as u32])))
                .collect(),
            start: crate::graph::calls_so_far(),
            trace_seen,
        }
    }

    /// Whether the statement named `name` is a host read: it read a value
    /// that needs gradients for its value, and its value holds no tensor.
    /// (A scan of the records: asked only before a statement that makes a
    /// tensor of host data.)
    pub fn host_read(&self, name: &str) -> bool {
        self.records.iter().any(|r| r.name == name && r.host_read)
    }

    /// Records one statement: checks its inputs, runs it on the path its
    /// policy gives, and writes its record.
    pub fn statement<O: Outputs>(
        &mut self,
        s: Statement,
        inputs: &[&Tensor],
        f: impl FnOnce(&[Tensor]) -> Result<O>,
    ) -> Result<O> {
        // Before a saved statement, the pending op input is taken; a
        // recomputed one replaces it once it is recorded (one that fails
        // leaves it pending).
        if s.policy != Policy::Recompute {
            self.fingerprint_pending_sole()?;
        }
        let needs = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| self.needs_grad(s.region, s.name, i, t))
            .collect::<Result<Vec<bool>>>()?;
        // Only floats carry gradients (a mask from a comparison does not).
        let reads_tracked_floats = needs
            .iter()
            .zip(inputs)
            .take(s.value_inputs)
            .any(|(&n, t)| n && t.dtype().is_float());
        let sources = self.sources(inputs, &needs);
        let unsure = self.unsure_reads(&s, inputs, &needs);
        let timed = self.profile;
        let run = |args: &[Tensor]| -> Result<Ran<O::Skeleton>> {
            let start = timed.then(Instant::now);
            let out = f(args).map_err(|e| e.in_statement(s.region, s.name))?;
            let seconds = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
            let mut tensors = Vec::new();
            let skeleton = out.split_into(&mut tensors);
            Ok(Ran {
                tensors,
                skeleton,
                seconds,
                sole: None,
                layouts: 0,
                strided_reads: Mask::default(),
            })
        };
        let (outputs, saved, ran) = match s.policy {
            Policy::Recompute => self.recompute(&s, inputs, &needs, &unsure, run)?,
            Policy::Save | Policy::Offload => self.save(&s, inputs, &needs, &unsure, run)?,
        };
        if let (Policy::Recompute, Some(fingerprints)) = (s.policy, &mut self.fingerprints) {
            let taken: Vec<Option<&Tensor>> = outputs.iter().map(Some).collect();
            fingerprints.extend(fingerprint::of_all(&taken, Kind::Sums)?);
        }
        let outputs_need_grad = Mask::of(outputs.len(), |j| {
            self.requires_grad.get(&outputs[j].id()) == Some(&true)
        });
        let index = self.records.len();
        self.records.push(Record {
            name: s.name.to_string(),
            declared: s.declared,
            policy: s.policy,
            inputs: inputs.iter().map(|t| Meta::of(t)).collect(),
            outputs: outputs.iter().map(Meta::of).collect(),
            outputs_need_grad,
            layouts: ran.layouts,
            strided_reads: ran.strided_reads,
            sole_call: ran.sole.as_ref().map(|s| s.0),
            sole_fingerprinted: false,
            unread: false,
            host_read: reads_tracked_floats && outputs.is_empty(),
            saved,
            profile: self.profile.then(|| {
                Box::new(Profile {
                    seconds: ran.seconds,
                    sources,
                })
            }),
        });
        if s.policy == Policy::Recompute && self.fingerprints.is_some() {
            self.pending_sole = ran.sole.map(|(_, input)| (index, input));
        }
        self.trace_event(index);
        O::join(&mut outputs.into_iter(), &ran.skeleton)
    }

    /// A recomputed statement: runs on its inputs as they are; its outputs
    /// are detached, and nothing of its graph is kept.
    fn recompute<S>(
        &mut self,
        s: &Statement,
        inputs: &[&Tensor],
        needs: &[bool],
        unsure: &[bool],
        run: impl FnOnce(&[Tensor]) -> Result<Ran<S>>,
    ) -> Result<Taken<S>> {
        let index = self.records.len();
        for t in inputs {
            self.replay_reads.entry(t.id()).or_insert(index);
            if let Some(&output) = self.saved_outputs.get(&t.id()) {
                self.ferried.insert(output);
            }
        }
        // A first forward runs the statement on leaves of what it reads for
        // its values that needs gradients, as the replay does (one per
        // value): its graph shows every cut. Later forwards run it on the
        // values as they are, but on leaves of the region inputs it may not
        // use (`unsure`): its graph shows whether it did. The leaves are not
        // parameters.
        let mut leaves: HashMap<TensorId, Tensor> = HashMap::new();
        let mut args = Vec::with_capacity(inputs.len());
        for (i, (t, &need)) in inputs.iter().zip(needs).enumerate() {
            let leaf = (self.first && need && i < s.value_inputs) || unsure[i];
            if !leaf || t.is_variable() {
                args.push((*t).clone());
                continue;
            }
            // Read through a view with the strides of `t`, as a replay reads it.
            let read = match leaves.get(&t.id()) {
                Some(read) => read.clone(),
                None => {
                    let (leaf, read) = match Relayout::of(t.layout(), t.device()) {
                        Some(r) => {
                            let leaf = r.leaf(t)?;
                            let read = r.read(&leaf)?;
                            (leaf, read)
                        }
                        None => {
                            let leaf = make_leaf(t)?;
                            (leaf.clone(), leaf)
                        }
                    };
                    self.leaf_ids.insert(leaf.id());
                    leaves.insert(t.id(), read.clone());
                    read
                }
            };
            args.push(read);
        }
        drop(leaves);
        let (ran, calls) = unread::watch(None, || run(&args));
        let mut ran = ran?;
        // What it read for its values, and how it is laid out: a replay on
        // the same bits in the same layouts computes the same bits.
        ran.layouts = fingerprint::layouts(args.iter().take(s.value_inputs));
        ran.strided_reads = strided_reads(args.iter().take(s.value_inputs));
        self.check_captures(s, &args, &ran.tensors)?;
        if self.first {
            check_paths(s, needs, &args, &ran.tensors)?;
        }
        let unreached = unreached(unsure, &args, &ran.tensors);
        ran.sole = unread::sole_call::<S>(&calls, &ran.tensors)
            .map(|c| (c, calls[usize::from(c)].input.clone()));
        // Its float outputs need gradients if it read for its value a value
        // that does (not one it read only for its shape, device or dtype);
        // integer and boolean outputs never carry one (candle's backward
        // skips them). The replay takes this decision as it is.
        let any_input = needs.iter().take(s.value_inputs).any(|&n| n);
        let tracked = std::mem::take(&mut ran.tensors);
        let outputs = tracked
            .iter()
            .map(|t| {
                let requires_grad = t.dtype().is_float() && (any_input || t.track_op());
                Ok(self.detach_output(s, t, requires_grad)?.0)
            })
            .collect::<Result<Vec<Tensor>>>()?;
        if ran.sole.is_some() {
            self.sole_values.push((index, outputs[0].id()));
        }
        self.record_depends(s, inputs, needs, &unreached, &outputs);
        self.chain = None;
        Ok((outputs, None, ran))
    }

    /// A saved (or offloaded) statement: runs on leaf copies of the inputs
    /// that need gradients, or continues the graph of the saved statement
    /// just before it; keeps its tracked graph.
    fn save<S: Clone + Send + Sync + 'static>(
        &mut self,
        s: &Statement,
        inputs: &[&Tensor],
        needs: &[bool],
        unsure: &[bool],
        run: impl FnOnce(&[Tensor]) -> Result<Ran<S>>,
    ) -> Result<Taken<S>> {
        // An offloaded statement's graph moves to the host as a whole: it
        // neither continues a saved graph nor is continued.
        let offload = s.policy == Policy::Offload;
        let index = self.records.len();
        let mut leaves = Vec::with_capacity(inputs.len());
        let mut args = Vec::with_capacity(inputs.len());
        let mut chained = false;
        // The inputs its backward depends on: those it reads for their
        // values as they are (no copy), and those it reads through leaf
        // copies (its backward reads the copies, where plain candle's reads
        // the tensors: a change in place before the backward must be seen).
        let mut read = Vec::new();
        for (i, (t, &need)) in inputs.iter().zip(needs).enumerate() {
            // An input read for its shape or detached needs no leaf.
            let need = need && i < s.value_inputs;
            if let Some(tracked) = (need && !offload).then(|| self.chainable(t)).flatten() {
                // Continue the previous saved statement's graph: no leaf
                // copy, and the two records form one unit.
                chained = true;
                leaves.push(None);
                args.push(tracked);
            } else if need {
                read.push(t.id());
                let leaf = match self.shared_leaves.get(&t.id()) {
                    Some(leaf) if !offload => leaf.clone(),
                    _ => {
                        let leaf = make_leaf(t)?;
                        self.leaf_ids.insert(leaf.id());
                        if !offload {
                            self.shared_leaves.insert(t.id(), leaf.clone());
                        }
                        leaf
                    }
                };
                leaves.push(Some(leaf.clone()));
                args.push(leaf);
            } else {
                leaves.push(None);
                args.push((*t).clone());
                if i < s.value_inputs {
                    read.push(t.id());
                }
            }
        }
        // Its op calls count in no other statement.
        let mut ran = unread::watch(None, || run(&args)).0?;
        self.check_captures(s, &args, &ran.tensors)?;
        check_paths(s, needs, &args, &ran.tensors)?;
        let unreached = unreached(unsure, &args, &ran.tensors);
        drop(args);
        let tracked = std::mem::take(&mut ran.tensors);
        let mut outputs = Vec::with_capacity(tracked.len());
        let mut detached = Vec::with_capacity(tracked.len());
        for (j, t) in tracked.iter().enumerate() {
            let (visible, d) = self.detach_output(s, t, carries_grad(t))?;
            self.saved_outputs.insert(visible.id(), (index, j));
            outputs.push(visible);
            detached.push(d);
        }
        self.record_depends(s, inputs, needs, &unreached, &outputs);
        let any_tracked = tracked.iter().any(|t| t.track_op());
        if any_tracked {
            for id in read {
                self.saved_reads.entry(id).or_insert(index);
            }
        }
        let saved = Saved {
            leaves: if any_tracked {
                leaves
            } else {
                vec![None; inputs.len()]
            },
            outs: if any_tracked { tracked } else { Vec::new() },
            ferried: detached.into_iter().map(Some).collect(),
            skeleton: Arc::new(ran.skeleton.clone()),
            chained: chained && any_tracked,
            offloaded: None,
        };
        self.chain = match (any_tracked && !offload, chained) {
            (false, _) => None,
            (true, true) => self.chain,
            (true, false) => Some(index),
        };
        Ok((outputs, Some(Box::new(saved)), ran))
    }

    /// The value the block sees in place of `t`, an output of the statement
    /// being recorded, and `t` detached. They are the same tensor, unless
    /// this forward looks for captures and the output needs gradients: the
    /// block then sees a leaf copy.
    fn detach_output(
        &mut self,
        s: &Statement,
        t: &Tensor,
        requires_grad: bool,
    ) -> Result<(Tensor, Tensor)> {
        self.discover_params(s, t)?;
        // A value the block holds already, given back as it is (`h.clone()`,
        // `h.detach()` of the detached `h` the block sees) gets a handle of
        // its own: what is recorded of it is this statement's, and the value
        // it came from keeps its own.
        let d = match self.requires_grad.contains_key(&t.id()) {
            true => new_handle(t)?,
            false => t.detach(),
        };
        let visible = if self.captures && requires_grad {
            let leaf = make_leaf(&d)?;
            self.value_leaves.insert(leaf.id());
            self.leaf_ids.insert(leaf.id());
            leaf
        } else {
            d.clone()
        };
        self.requires_grad.insert(visible.id(), requires_grad);
        if self.profile {
            self.producers.insert(visible.id(), self.records.len());
        }
        Ok((visible, d))
    }

    /// When this forward looks for captures: the graph of the statement's
    /// `outputs` may reach no value leaf but the `args` it was handed (a
    /// saved statement is handed copies: the block's own value in its graph
    /// was read some other way).
    fn check_captures(&self, s: &Statement, args: &[Tensor], outputs: &[Tensor]) -> Result<()> {
        if !self.captures {
            return Ok(());
        }
        let declared: HashSet<TensorId> = args.iter().map(|t| t.id()).collect();
        check_reads(s.region, s.name, outputs, |node| {
            self.value_leaves.contains(&node.id()) && !declared.contains(&node.id())
        })
    }

    /// Where each input came from, for the budget planner (measured calls
    /// only).
    fn sources(&self, inputs: &[&Tensor], needs: &[bool]) -> Vec<Source> {
        if !self.profile {
            return Vec::new();
        }
        inputs
            .iter()
            .zip(needs)
            .map(|(t, &need)| Source {
                needs_grad: need,
                producer: self.producers.get(&t.id()).copied(),
                bytes: t.elem_count() * t.dtype().size_in_bytes(),
                value: t.id(),
            })
            .collect()
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

    fn needs_grad(&self, region: &str, statement: &str, index: usize, t: &Tensor) -> Result<bool> {
        if let Some(&r) = self.requires_grad.get(&t.id()) {
            return Ok(r);
        }
        check_input(region, statement, index, t)?;
        Ok(false)
    }

    /// Per input of statement `s`: whether `s` reads it for its value on a
    /// branch, in part or through a closure (it may not use it: its graph
    /// will say), and it depends on some region input. Such an input runs
    /// on a leaf copy of it, also when the statement is recomputed.
    fn unsure_reads(&self, s: &Statement, inputs: &[&Tensor], needs: &[bool]) -> Vec<bool> {
        let maybe = |i: usize| {
            s.reach.iter().any(|r| match r {
                Reach::OneOf(range) | Reach::NoneOf(range) => range.contains(&i),
            })
        };
        (0..inputs.len())
            .map(|i| {
                i < s.value_inputs
                    && needs[i]
                    && maybe(i)
                    && self
                        .depends
                        .get(&inputs[i].id())
                        .is_some_and(|d| !d.is_empty())
            })
            .collect()
    }

    /// Records the region inputs the outputs of statement `s` depend on:
    /// those the values it used depend on. A value it read for its value
    /// counts, but one read on a branch, in part or through a closure
    /// (`unsure`) that its graph did not reach (`unreached`).
    fn record_depends(
        &mut self,
        s: &Statement,
        inputs: &[&Tensor],
        needs: &[bool],
        unreached: &[bool],
        outputs: &[Tensor],
    ) {
        let mut from: Vec<u32> = Vec::new();
        for (i, t) in inputs.iter().enumerate().take(s.value_inputs) {
            if needs[i] && !unreached[i] {
                if let Some(d) = self.depends.get(&t.id()) {
                    from.extend_from_slice(d);
                }
            }
        }
        from.sort_unstable();
        from.dedup();
        let from: Arc<[u32]> = from.into();
        for t in outputs {
            if self.requires_grad.get(&t.id()) == Some(&true) {
                self.depends.insert(t.id(), from.clone());
            }
        }
    }

    /// Records the variables `t`, an output of statement `s`, depends on
    /// that are not leaves of this region; an output of an earlier region
    /// call it depends on is [`RematError::CapturedOutput`](crate::RematError::CapturedOutput).
    fn discover_params(&mut self, s: &Statement, t: &Tensor) -> Result<()> {
        if !t.track_op() {
            return Ok(());
        }
        for node in t.sorted_nodes() {
            if let Some(from) = crate::graph::given_before(node, self.start) {
                return Err(crate::RematError::CapturedOutput {
                    region: s.region.to_string(),
                    statement: s.name.to_string(),
                    from,
                });
            }
            if node.is_variable()
                && !self.leaf_ids.contains(&node.id())
                && self.param_ids.insert(node.id())
            {
                self.params.push(node.clone());
                self.param_first.push(self.records.len());
            }
        }
        Ok(())
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

    /// Whether `t` is a region input or a statement output of this call.
    pub fn knows(&self, t: &Tensor) -> bool {
        self.requires_grad.contains_key(&t.id())
    }

    /// Fingerprints the input of the pending sole call, if any, after
    /// every fingerprint of its record (see `pending_sole`).
    fn fingerprint_pending_sole(&mut self) -> Result<()> {
        let (Some((k, input)), Some(fingerprints)) =
            (self.pending_sole.take(), &mut self.fingerprints)
        else {
            return Ok(());
        };
        fingerprints.extend(fingerprint::of_all(&[Some(&input)], Kind::Sums)?);
        self.records[k].sole_fingerprinted = true;
        Ok(())
    }

    /// Ends the forward: saved outputs that no recomputed statement reads are
    /// dropped from the tape (replay gives placeholders for them), and so
    /// are the region `inputs` no statement's backward reads.
    pub fn finish(mut self, inputs: &[Tensor], outputs: &[Tensor]) -> Result<Recorded> {
        self.fingerprint_pending_sole()?;
        // An input some output depends on gets a gradient, one the block
        // returns as it is too; one that no output depends on (unread, read
        // on a branch not taken, or read only by statements whose values
        // no output needs: a statistic for a log) gets none.
        let mut used = vec![false; inputs.len()];
        for t in outputs {
            for &k in self.depends.get(&t.id()).into_iter().flat_map(|d| d.iter()) {
                used[k as usize] = true;
            }
        }
        let inputs_read = inputs
            .iter()
            .map(|t| {
                let replay = self.replay_reads.get(&t.id());
                let saved = self.saved_reads.get(&t.id());
                replay.into_iter().chain(saved).min().map(|&k| k as u32)
            })
            .collect();
        let replayed = inputs
            .iter()
            .map(|t| self.replay_reads.contains_key(&t.id()))
            .collect();
        let param_statements = self.param_first.iter().map(|&k| k as u32).collect();
        for (k, record) in self.records.iter_mut().enumerate() {
            if let Some(saved) = record.saved.as_mut() {
                for (j, ferried) in saved.ferried.iter_mut().enumerate() {
                    if !self.ferried.contains(&(k, j)) {
                        *ferried = None;
                    }
                }
            }
        }

        // Only the last recomputed statement's value can be unread: code
        // that runs after a statement in the replay (a later statement's,
        // or the block's own feeding one a value derived from it) could
        // read it without declaring it.
        let last = self
            .records
            .iter()
            .rposition(|r| r.policy == Policy::Recompute);
        for &(k, value) in &self.sole_values {
            self.records[k].unread = Some(k) == last && !self.replay_reads.contains_key(&value);
        }
        // The tape keeps the records as long as it lives: no spare capacity.
        self.records.shrink_to_fit();
        Ok(Recorded {
            records: self.records,
            params: self.params,
            inputs_read,
            replayed,
            param_statements,
            used,
            fingerprints: self.fingerprints,
        })
    }
}

/// The gradient paths of statement `s`, which ran on `args` (`needs`: which
/// need gradients) and gave `outputs`: one carries a gradient if it read
/// values that need one ([`check_cut`]), and their graph reaches each
/// of those ([`check_reached`]).
fn check_paths(s: &Statement, needs: &[bool], args: &[Tensor], outputs: &[Tensor]) -> Result<()> {
    let reads_tracked = needs.iter().take(s.value_inputs).any(|&n| n);
    check_cut(s.region, s.name, reads_tracked, outputs)?;
    check_reached(s.region, s.name, args, s.value_inputs, s.reach, outputs)
}

/// Per argument: it is `unsure` (read on a branch, in part or through a
/// closure) and the graph of `outputs` does not reach it. Where an output
/// is empty (candle builds no graph for it), every one is taken as reached.
fn unreached(unsure: &[bool], args: &[Tensor], outputs: &[Tensor]) -> Vec<bool> {
    if !unsure.contains(&true) {
        return vec![false; args.len()];
    }
    let floats = || outputs.iter().filter(|t| t.dtype().is_float());
    if floats().any(|t| t.elem_count() == 0) {
        return vec![false; args.len()];
    }
    let reached: HashSet<TensorId> = floats()
        .filter(|t| t.track_op())
        .flat_map(|t| {
            t.sorted_nodes()
                .into_iter()
                .map(Tensor::id)
                .collect::<Vec<_>>()
        })
        .collect();
    args.iter()
        .zip(unsure)
        .map(|(arg, &u)| u && !reached.contains(&arg.id()))
        .collect()
}

/// The values of `args` that are strided views.
fn strided_reads<'a>(args: impl Iterator<Item = &'a Tensor>) -> Mask {
    Mask::from_bits(args.map(|t| !t.is_contiguous()))
}
