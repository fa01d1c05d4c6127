//! Running a block as a checkpointed region.

use std::sync::Arc;

use candle_core::Tensor;

use crate::backward::{Body, Call};
use crate::ctx::{Ctx, Mode};
use crate::graph::{attach, make_leaf};
use crate::inspect::{memory, trace};
use crate::tape::fingerprint::FieldRead;
use crate::tape::recorder::{constant_outputs, first_forward, first_plain_run, Recorded, Recorder};
use crate::tape::{fingerprint, Kept, Mask, Meta, Tape};
use crate::{plan, random, Inputs, Outputs, Plan, RematError, Result};

/// A checkpointed region: a block of statements whose activations are
/// recomputed (or kept, statement by statement) for the backward.
///
/// [`Region::run`] runs the block on detached inputs, records a tape, and
/// returns outputs attached to candle's graph: a plain `loss.backward()` then
/// gives the gradients of the region's inputs and of every parameter (`Var`)
/// the block used.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use remat_runtime::Region;
///
/// let dev = Device::Cpu;
/// let w1 = Var::randn(0f32, 0.1, (16, 64), &dev)?;
/// let w2 = Var::randn(0f32, 0.1, (64, 16), &dev)?;
/// let x = Var::randn(0f32, 1.0, (8, 16), &dev)?;
/// let (a, b) = (w1.as_tensor().clone(), w2.as_tensor().clone());
/// let y = Region::new("mlp").run(&[x.as_tensor()], move |ctx, ins| {
///     let h = ctx.save("fc1", &[&ins[0]], |t| t[0].matmul(&a))?;
///     let g = ctx.recompute("gelu", &[&h], |t| t[0].gelu_erf())?;
///     ctx.save("fc2", &[&g], |t| t[0].matmul(&b))
/// })?;
/// let grads = y.sqr()?.sum_all()?.backward()?;
/// assert!(grads.get(&w1).is_some() && grads.get(&w2).is_some() && grads.get(&x).is_some());
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Region {
    name: String,
    enabled: bool,
    plan: Option<Plan>,
    /// Its statements declare every value they read by construction (the
    /// code `remat!` and `checkpoint_sequential` write): the first forward
    /// need not look for undeclared reads.
    declares_all_reads: bool,
    /// Tensors the block reads from fields of its parameters
    /// (`remat!`'s `self.mask`): checked for changes in place.
    fields: Vec<FieldRead>,
    /// Per input tensor, the name of the block's parameter holding it.
    input_names: Vec<Option<&'static str>>,
}

impl Region {
    /// A region named `name`; the name appears in errors and memory reports.
    ///
    /// ```
    /// let r = remat_runtime::Region::new("block.3");
    /// assert_eq!(r.name(), "block.3");
    /// ```
    pub fn new(name: impl Into<String>) -> Self {
        Region {
            name: name.into(),
            enabled: true,
            plan: None,
            declares_all_reads: false,
            fields: Vec::new(),
            input_names: Vec::new(),
        }
    }

    /// The region's name.
    ///
    /// ```
    /// assert_eq!(remat_runtime::Region::new("b").name(), "b");
    /// ```
    pub fn name(&self) -> &str {
        &self.name
    }

    /// With `false`, [`Region::run`] runs the block as plain candle code: no
    /// tape, no replay, candle's own graph. Useful to compare against, or to
    /// switch checkpointing off by configuration. Unlike
    /// `.plan(Plan::off())`, which regions nested in the block inherit,
    /// this switches off this region alone: regions it calls run under the
    /// plan they would have run under anyway.
    ///
    /// ```
    /// # use candle_core::{Device, Tensor};
    /// let x = Tensor::ones(2, candle_core::DType::F32, &Device::Cpu)?;
    /// let y = remat_runtime::Region::new("r")
    ///     .enabled(false)
    ///     .run(&[&x], |ctx, ins| ctx.recompute("e", &[&ins[0]], |t| t[0].exp()))?;
    /// assert_eq!(y.dims(), &[2]);
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn enabled(mut self, enabled: bool) -> Self {
        self.enabled = enabled;
        self
    }

    /// A region whose statements declare every value they read by
    /// construction (generated code): its first forward skips the search
    /// for undeclared reads and the leaf copies it takes.
    pub(crate) fn declaring_all_reads(mut self) -> Self {
        self.declares_all_reads = true;
        self
    }

    /// A region whose block reads `fields` from its parameters: each is
    /// fingerprinted with the parameters at the end of the forward and
    /// compared in the replay.
    pub(crate) fn with_fields(mut self, fields: Vec<FieldRead>) -> Self {
        self.fields = fields;
        self
    }

    /// A region whose input tensors are held by the block's parameters of
    /// these names (per tensor), for its errors.
    pub(crate) fn with_input_names(mut self, names: Vec<Option<&'static str>>) -> Self {
        self.input_names = names;
        self
    }

    /// Runs the region under `plan`, whatever [`Plan::scope`] is active.
    ///
    /// ```
    /// # use candle_core::{Device, Var};
    /// use remat_runtime::{MemoryReport, Plan, Policy, Region};
    /// let x = Var::ones(8, candle_core::DType::F32, &Device::Cpu)?;
    /// let region = Region::new("r").plan(Plan::recompute_all());
    /// let y = region.run(&[x.as_tensor()], |ctx, ins| {
    ///     ctx.save("e", &[&ins[0]], |t| t[0].exp()?.sum_all())
    /// })?;
    /// // `recompute_all` overrides the `save`: the tape holds nothing for `e`
    /// assert_eq!(MemoryReport::capture().entries[1].policy, Some(Policy::Recompute));
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn plan(mut self, plan: Plan) -> Self {
        self.plan = Some(plan);
        self
    }

    /// Runs `body` as a checkpointed region on `inputs`.
    ///
    /// `body` receives a [`Ctx`] and the inputs (detached; the runtime
    /// reattaches them) and returns any [`Outputs`]. It runs once now and once
    /// more at the start of the region's backward, so it must be a `Fn` that
    /// owns what it captures (clone parameters into it: candle tensors are
    /// reference counted) and computes the same thing both times.
    ///
    /// Tensors that need gradients must reach the block as `inputs` or be
    /// parameters (`Var`s); a tracked tensor captured any other way is an
    /// error ([`crate::RematError::ForeignTrackedInput`]). Every output must
    /// be a statement's output, a region input, a `Var` or a constant (a
    /// tensor that carries no gradient): a tensor op on values that need
    /// gradients outside any statement is an error
    /// ([`crate::RematError::OutputOutsideStatement`]), since nothing in the
    /// replay would produce it. Statements must declare every value they
    /// read that needs gradients ([`crate::RematError::UndeclaredInput`]),
    /// and compute the same values in the replay as in the forward
    /// ([`crate::RematError::ReplayDiverged`]).
    ///
    /// When no input needs gradients and the block uses no parameter, the
    /// region is inert: no tape is kept and the outputs are plain tensors.
    ///
    /// ```
    /// # use candle_core::{Device, Tensor};
    /// let x = Tensor::arange(0f32, 4.0, &Device::Cpu)?;
    /// let y = remat_runtime::Region::new("r")
    ///     .run(&[&x], |ctx, ins| ctx.recompute("sq", &[&ins[0]], |t| t[0].sqr()))?;
    /// assert_eq!(y.to_vec1::<f32>()?, vec![0.0, 1.0, 4.0, 9.0]);
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn run<O, F>(&self, inputs: impl Inputs, body: F) -> Result<O>
    where
        O: Outputs,
        F: Fn(&mut Ctx, &[Tensor]) -> Result<O> + Send + Sync + 'static,
    {
        let inputs = inputs.into_tensors();
        let plan = self.plan.clone().unwrap_or_else(Plan::current);
        // Every call takes a seed, checkpointed or not, so that a plain run
        // draws what a checkpointed one does.
        let seed = random::call_seed();
        if !self.enabled || plan.is_off() {
            let first = first_plain_run(&self.name);
            let mut ctx = Ctx::new(&self.name, Mode::Plain { first }, plan.clone(), seed);
            return plan.inherit(|| body(&mut ctx, &inputs));
        }
        let _profile = crate::inspect::profile::op("region");
        let forward = self.forward(&inputs, &plan, seed, &body)?;
        let Forward {
            outputs,
            skeleton,
            known,
            recorded:
                Recorded {
                    records,
                    mut params,
                    inputs_read,
                    replayed,
                    param_statements,
                    used,
                    fingerprints: output_fingerprints,
                },
            detached,
            requires_grad,
            trace_label,
            profile,
            captures,
        } = forward;
        let kept_inputs: Vec<Kept> = detached
            .iter()
            .enumerate()
            .map(|(i, t)| match inputs_read[i] {
                None => Kept::Released,
                Some(_) if requires_grad[i] && !replayed[i] => Kept::Checked(t.clone()),
                Some(_) => Kept::Read(t.clone()),
            })
            .collect();
        // A `Var` returned as it is keeps its gradient path: it is anchored
        // like every parameter, and the sweep hands it its output's gradient.
        // (A statement's output is not one, though the first forward's block
        // sees it as a leaf copy.)
        for (t, &given) in outputs.iter().zip(&known) {
            if !given && t.is_variable() && !params.iter().any(|p| p.id() == t.id()) {
                params.push(t.clone());
            }
        }
        // An input that needs gradients but that no output depends on gets
        // none, as in plain candle: it is not anchored (an anchor would have
        // to hand candle zeros for it, and the `Var`s behind it would get
        // zero gradients).
        let anchored_inputs: Vec<bool> = requires_grad
            .iter()
            .zip(&used)
            .map(|(&r, &u)| r && u)
            .collect();
        let anchored: Vec<Tensor> = inputs
            .iter()
            .zip(&anchored_inputs)
            .filter(|(_, &a)| a)
            .map(|(t, _)| t.clone())
            .chain(params.iter().cloned())
            .collect();
        if anchored.is_empty() && !requires_grad.contains(&true) {
            // Inert: nothing needs gradients, the outputs are plain values.
            return O::join(&mut outputs.into_iter(), &skeleton);
        }
        let constant = self.constants(&outputs, &known, captures)?;
        if anchored.is_empty() {
            // No statement used what needs gradients: neither do the outputs.
            return O::join(&mut outputs.into_iter(), &skeleton);
        }
        if profile {
            // It saved every open statement: plan the region from what that
            // cost.
            plan.plan_region(&self.name, plan::items(&records, &params, &detached));
        }
        let body: Body = Arc::new(move |ctx: &mut Ctx, ins: &[Tensor]| {
            let mut tensors = Vec::new();
            body(ctx, ins)?.split_into(&mut tensors);
            Ok(tensors)
        });
        let fingerprints = match output_fingerprints {
            Some(outputs) => Some(fingerprint::Forward::new(
                &params,
                &inputs,
                &detached,
                inputs_read,
                param_statements,
                &self.fields,
                &self.input_names,
                outputs,
            )?),
            None => None,
        };
        let tape = Tape {
            input_metas: detached.iter().map(Meta::of).collect(),
            inputs: kept_inputs,
            requires_grad,
            anchored: anchored_inputs,
            records,
            params,
            fingerprints,
            outputs: outputs.iter().map(Meta::of).collect(),
            plan,
            seed,
            trace_label,
        };
        let call = Arc::new(Call::new(self.name.clone(), body, tape, &anchored));
        memory::register(&call);
        let attached = attach(&call, &anchored, outputs, &constant)?;
        O::join(&mut attached.into_iter(), &skeleton)
    }

    /// The forward of a checkpointed call: runs the block on detached
    /// inputs (leaf copies of those that need gradients on a statement-API
    /// region's first forward), recording its statements.
    fn forward<O, F>(
        &self,
        inputs: &[Tensor],
        plan: &Plan,
        seed: u64,
        body: &F,
    ) -> Result<Forward<O>>
    where
        O: Outputs,
        F: Fn(&mut Ctx, &[Tensor]) -> Result<O>,
    {
        let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
        let trace_label = trace::begin_call(&self.name);
        let requires_grad: Vec<bool> = inputs.iter().map(|t| t.track_op()).collect();
        // The first call of the region under a budget plan measures it.
        let profile = plan.wants_profile(&self.name);
        let fingerprints = fingerprint::enabled();
        // The first forward of a region runs its statements on leaves, so
        // that their graphs show every cut; for a statement-API region, the
        // block sees leaf copies of the inputs that need gradients, so that
        // they show every undeclared read too.
        let first = first_forward(&self.name, self.declares_all_reads);
        let captures = first && !self.declares_all_reads;
        let visible: Vec<Tensor> = if captures {
            detached
                .iter()
                .zip(&requires_grad)
                .map(|(t, &grad)| if grad { make_leaf(t) } else { Ok(t.clone()) })
                .collect::<Result<_>>()?
        } else {
            detached.clone()
        };
        let mut ctx = Ctx::new(
            &self.name,
            Mode::Record(Recorder::new(
                &visible,
                &requires_grad,
                profile,
                fingerprints,
                first,
                captures,
                trace_label.clone(),
            )),
            plan.clone(),
            seed,
        );
        // Regions nested in the block inherit its plan, in the forward as in
        // the replay.
        let out = plan.inherit(|| body(&mut ctx, &visible))?;
        let mut outputs = Vec::new();
        let skeleton = out.split_into(&mut outputs);
        let Mode::Record(recorder) = ctx.mode else {
            unreachable!("the context was built in record mode")
        };
        let known: Vec<bool> = outputs.iter().map(|t| recorder.knows(t)).collect();
        let recorded = recorder.finish(&visible, &outputs)?;
        Ok(Forward {
            outputs,
            skeleton,
            known,
            recorded,
            detached,
            requires_grad,
            trace_label,
            profile,
            captures,
        })
    }

    /// Which of the outputs are constants, or the error of the first output
    /// that is none of a statement output, a `Var` or a constant.
    ///
    /// An output that no statement gave is a constant when it carries no
    /// gradient (`Tensor::zeros(..)`: nothing to lose). The first forward of
    /// a statement-API region sees leaves for every value that needs
    /// gradients, so an op on one outside any statement is tracked there and
    /// refused; later forwards accept untracked outputs where that one found
    /// constants (`captures`: this is that forward). Generated regions give
    /// every output from a statement.
    fn constants(&self, outputs: &[Tensor], known: &[bool], captures: bool) -> Result<Vec<bool>> {
        let untracked = |j: usize| !known[j] && !outputs[j].is_variable() && !outputs[j].track_op();
        let accepted = if self.declares_all_reads {
            Mask::ALL
        } else {
            let found = Mask::of(outputs.len(), untracked);
            constant_outputs(&self.name, captures.then_some(found))
        };
        // Past the mask's capacity, no output is taken for a constant.
        let constant: Vec<bool> = (0..outputs.len())
            .map(|j| untracked(j) && accepted.get(j) == Some(true))
            .collect();
        match (0..outputs.len()).find(|&j| !known[j] && !outputs[j].is_variable() && !constant[j]) {
            Some(index) => Err(RematError::OutputOutsideStatement {
                region: self.name.clone(),
                index,
            }),
            None => Ok(constant),
        }
    }
}

/// What a checkpointed call's forward gives the rest of the call.
struct Forward<O: Outputs> {
    /// The block's outputs, as the block returned them, and the plain rest
    /// of its value.
    outputs: Vec<Tensor>,
    skeleton: O::Skeleton,
    /// Per output: a statement gave it.
    known: Vec<bool>,
    recorded: Recorded,
    /// The region inputs, detached.
    detached: Vec<Tensor>,
    /// Per region input: it needs gradients.
    requires_grad: Vec<bool>,
    trace_label: Option<String>,
    /// This call measures the region for a budget plan.
    profile: bool,
    /// This forward looked for undeclared reads.
    captures: bool,
}
