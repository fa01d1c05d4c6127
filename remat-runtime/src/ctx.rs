//! The handle a block uses to run its statements: as plain candle code,
//! recorded by the forward (`tape/recorder.rs`) or replayed (`replay/`).

use std::collections::HashSet;

use candle_core::Tensor;

use crate::graph::{check_cut, check_reached, Reach};
use crate::random;
use crate::replay::Replay;
use crate::tape::recorder::{Recorder, Statement};
use crate::tape::unread;
use crate::{Inputs, Outputs, Plan, Policy, RematError, Result, StatementInfo};

/// What running a statement does.
// One `Mode` per region call, on the stack: boxing the recorder would add a
// heap allocation to every call for nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Mode {
    /// No checkpointing: statements run as plain candle code. `first`: the
    /// region's first plain run on this thread, which also looks for inputs
    /// a statement's graph does not reach.
    Plain { first: bool },
    /// The region's forward: statements run and are recorded on the tape.
    Record(Recorder),
    /// The replay at the start of the region's backward.
    Replay(Replay),
}

/// Whether code on this thread runs inside a region's replay: a layer
/// called from a checkpointed block or [`Checkpointed`](crate::Checkpointed)
/// runs twice per step, once in the forward and once more when its region
/// replays in the backward. Effects that must happen once per step (a
/// batch norm's running statistics, a counter, logging) are skipped when
/// this is `true`; in a `remat!` block, `#[forward_only]` does it.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::{in_replay, Region};
/// let x = Var::ones(3, DType::F32, &Device::Cpu)?;
/// let seen = Arc::new(Mutex::new(Vec::new()));
/// let log = seen.clone();
/// let y = Region::new("r").run(&[x.as_tensor()], move |ctx, ins| {
///     log.lock().unwrap().push(in_replay());
///     ctx.recompute("s", &[&ins[0]], |t| t[0].exp()?.sum_all())
/// })?;
/// y.backward()?;
/// assert_eq!(*seen.lock().unwrap(), [false, true]); // the forward, the replay
/// assert!(!in_replay());
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn in_replay() -> bool {
    crate::plan::in_replay()
}

/// The context a checkpointed block runs its statements through.
///
/// A block runs twice: once in the forward, where every statement runs and
/// the tape is recorded, and once in the replay at the start of the region's
/// backward, where recomputed statements run again and saved statements are
/// skipped. The block's code is the same both times; `Ctx` decides what each
/// statement does.
///
/// Statements take their tensor inputs explicitly (so that the runtime knows
/// the dataflow between them) and a closure that computes the statement from
/// those inputs. The closure receives the inputs the runtime prepared: during
/// the forward of a saved statement, leaf copies of the inputs that need
/// gradients; during replay, leaves where a value crosses from one unit to
/// another.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use remat_runtime::{Policy, Region};
///
/// let w = Var::ones((3, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let x = Var::ones((2, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let wt = w.as_tensor().clone();
/// let y = Region::new("mlp").run(&[x.as_tensor()], move |ctx, ins| {
///     let h = ctx.save("h", &[&ins[0]], |t| t[0].matmul(&wt))?;
///     let y = ctx.recompute("y", &[&h], |t| t[0].relu()?.sum_all())?;
///     Ok(y)
/// })?;
/// let grads = y.backward()?;
/// assert_eq!(grads.get(&w).unwrap().dims(), &[3, 3]);
/// assert_eq!(grads.get(&x).unwrap().dims(), &[2, 3]);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub struct Ctx {
    region: String,
    pub(crate) mode: Mode,
    plan: Plan,
    /// The region call's seed for [`crate::random`].
    seed: u64,
    /// The statement names used so far (the replay checks names against
    /// the tape instead).
    names: HashSet<String>,
    /// In a plain run, the host reads (hashes of their names): statements
    /// that read values needing gradients for their values and whose value
    /// holds no tensor. A plain value computed from one carries no gradient
    /// ([`Ctx::host_cut`]; the forward asks its records).
    host_reads: HashSet<u64>,
}

impl Ctx {
    pub(crate) fn new(region: &str, mode: Mode, plan: Plan, seed: u64) -> Self {
        Ctx {
            region: region.to_string(),
            mode,
            plan,
            seed,
            names: HashSet::new(),
            host_reads: HashSet::new(),
        }
    }

    /// The plan deciding the policies of this region call.
    ///
    /// ```
    /// # use remat_runtime::{Plan, Region};
    /// let label = Region::new("blk")
    ///     .plan(Plan::save_all())
    ///     .run(&[], |ctx, _| Ok(ctx.plan().to_string()))?;
    /// assert_eq!(label, "save all");
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The name of the region this context belongs to.
    ///
    /// ```
    /// # use remat_runtime::Region;
    /// let name = Region::new("blk").run(&[], |ctx, _| Ok(ctx.region().len()))?;
    /// assert_eq!(name, 3);
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn region(&self) -> &str {
        &self.region
    }

    /// Whether the block is running as the replay of a backward: its own,
    /// or that of a region it runs inside (a block called by a recomputed
    /// statement of another block runs again in that block's replay). Code
    /// with effects that must happen once per step (running statistics, a
    /// counter) runs only when this is `false`; see also [`in_replay`].
    ///
    /// ```
    /// # use remat_runtime::Region;
    /// let replaying = Region::new("blk").run(&[], |ctx, _| Ok(ctx.is_replay()))?;
    /// assert!(!replaying);
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn is_replay(&self) -> bool {
        matches!(self.mode, Mode::Replay(_)) || in_replay()
    }

    /// Runs a statement under `policy`.
    ///
    /// `name` must be unique within the region call. `inputs` are the tensors
    /// the statement reads; `f` computes its outputs from the tensors it is
    /// handed, in the same order.
    ///
    /// ```
    /// use candle_core::{Device, Tensor, Var};
    /// use remat_runtime::{Policy, Region};
    /// let x = Var::ones(4, candle_core::DType::F32, &Device::Cpu)?;
    /// let y = Region::new("r").run(&[x.as_tensor()], |ctx, ins| {
    ///     ctx.statement("sq", Policy::Save, &[&ins[0]], |t| t[0].sqr()?.sum_all())
    /// })?;
    /// let g = y.backward()?;
    /// assert_eq!(g.get(&x).unwrap().to_vec1::<f32>()?, vec![2.0; 4]);
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn statement<O: Outputs, E: Into<RematError>>(
        &mut self,
        name: &str,
        policy: Policy,
        inputs: impl Inputs,
        f: impl FnOnce(&[Tensor]) -> std::result::Result<O, E>,
    ) -> Result<O> {
        self.run(name, Some(policy), inputs, (usize::MAX, &[]), f)
    }

    /// Runs an *open* statement: one whose policy the region's [`Plan`]
    /// decides (recomputed under the default plan). Unannotated `remat!`
    /// statements are these.
    ///
    /// ```
    /// use candle_core::{Device, Var};
    /// use remat_runtime::{MemoryReport, Plan, Policy, Region};
    /// let x = Var::ones(4, candle_core::DType::F32, &Device::Cpu)?;
    /// let y = Region::new("r").plan(Plan::save_all()).run(&[x.as_tensor()], |ctx, ins| {
    ///     ctx.open("sq", &[&ins[0]], |t| t[0].sqr()?.sum_all())
    /// })?;
    /// assert_eq!(MemoryReport::capture().entries[1].policy, Some(Policy::Save));
    /// assert_eq!(y.backward()?.get(&x).unwrap().to_vec1::<f32>()?, vec![2.0; 4]);
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn open<O: Outputs, E: Into<RematError>>(
        &mut self,
        name: &str,
        inputs: impl Inputs,
        f: impl FnOnce(&[Tensor]) -> std::result::Result<O, E>,
    ) -> Result<O> {
        self.run(name, None, inputs, (usize::MAX, &[]), f)
    }

    /// Every statement method ends here. `declared`: the policy written in
    /// the code, if any; `value_inputs`: the first this many inputs are
    /// read for their values, the rest only for their shapes or detached
    /// (the `remat!` macro sees which), so that only the first can make an
    /// untracked output a cut ([`RematError::GradientCut`]); `reach`: among
    /// those, the values read only in part (`parts[0]`, `pair.0`), of which
    /// one tensor reached is enough, and those read only on a branch, which
    /// need none ([`RematError::InputCut`]).
    pub(crate) fn run<O: Outputs, E: Into<RematError>>(
        &mut self,
        name: &str,
        declared: Option<Policy>,
        inputs: impl Inputs,
        (value_inputs, reach): (usize, &[Reach]),
        f: impl FnOnce(&[Tensor]) -> std::result::Result<O, E>,
    ) -> Result<O> {
        let owned = inputs.into_tensors();
        // Draws in the statement come from its own stream: the same in the
        // forward, the replay and a plain run.
        let seed = self.seed;
        let f =
            move |args: &[Tensor]| random::in_statement(seed, name, || f(args).map_err(Into::into));
        let inputs: Vec<&Tensor> = owned.iter().collect();
        let inputs = inputs.as_slice();
        if !matches!(self.mode, Mode::Replay(_)) && !self.names.insert(name.to_string()) {
            return Err(RematError::DuplicateName {
                region: self.region.clone(),
                statement: name.to_string(),
            });
        }
        match &mut self.mode {
            Mode::Plain { first } => {
                let tracked = owned.iter().take(value_inputs).any(|t| t.track_op());
                // Its op calls count in no other statement.
                let out = unread::watch(None, || f(&owned)).0;
                let out = out.map_err(|e| e.in_statement(&self.region, name))?;
                if !tracked {
                    return Ok(out);
                }
                let mut tensors = Vec::new();
                let skeleton = out.split_into(&mut tensors);
                // Only floats carry gradients (a mask from a comparison
                // does not).
                let reads_floats = owned
                    .iter()
                    .take(value_inputs)
                    .any(|t| t.track_op() && t.dtype().is_float());
                if tensors.is_empty() && reads_floats {
                    self.host_reads.insert(name_hash(name));
                }
                check_cut(&self.region, name, tracked, &tensors)?;
                if *first {
                    check_reached(&self.region, name, &owned, value_inputs, reach, &tensors)?;
                }
                O::join(&mut tensors.into_iter(), &skeleton)
            }
            Mode::Record(recorder) => {
                let policy = self.plan.policy(&StatementInfo {
                    region: &self.region,
                    name,
                    declared,
                });
                let statement = Statement {
                    region: &self.region,
                    name,
                    declared,
                    policy,
                    value_inputs,
                    reach,
                };
                recorder.statement(statement, inputs, f)
            }
            Mode::Replay(replay) => replay.statement(
                &self.region,
                name,
                declared,
                inputs,
                (value_inputs, reach),
                f,
            ),
        }
    }

    /// The cut of statement `statement` reading the plain value `value` as
    /// data, if `value` holds floats (`floats`) and was computed from a
    /// statement among `sources` that read values needing gradients for
    /// their values and gave no tensor (a host read): those floats left
    /// candle's graph through the host (`to_vec2`, `to_scalar`), and a
    /// tensor made of them is a constant that no gradient flows back
    /// through ([`RematError::HostCut`], raised by the block if the
    /// statement gives a floating-point tensor). Found in the forward and in
    /// a plain run; the replay runs what the forward checked.
    pub(crate) fn host_cut(
        &self,
        statement: &str,
        value: &str,
        floats: bool,
        sources: &[&str],
    ) -> Option<RematError> {
        let read = |source: &str| match &self.mode {
            Mode::Plain { .. } => self.host_reads.contains(&name_hash(source)),
            Mode::Record(recorder) => recorder.host_read(source),
            Mode::Replay(_) => false,
        };
        let source = sources.iter().find(|s| floats && read(s))?;
        Some(RematError::HostCut {
            region: self.region.clone(),
            statement: statement.to_string(),
            value: value.to_string(),
            from: source.to_string(),
        })
    }

    /// Runs a statement whose backward residuals are kept from the forward:
    /// [`Ctx::statement`] with [`Policy::Save`].
    ///
    /// ```
    /// # use candle_core::{Device, Tensor};
    /// # use remat_runtime::Region;
    /// let x = Tensor::ones(2, candle_core::DType::F32, &Device::Cpu)?;
    /// let y = Region::new("r").run(&[&x], |ctx, ins| {
    ///     ctx.save("double", &[&ins[0]], |t| &t[0] * 2.0)
    /// })?;
    /// assert_eq!(y.to_vec1::<f32>()?, vec![2.0, 2.0]);
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn save<O: Outputs, E: Into<RematError>>(
        &mut self,
        name: &str,
        inputs: impl Inputs,
        f: impl FnOnce(&[Tensor]) -> std::result::Result<O, E>,
    ) -> Result<O> {
        self.statement(name, Policy::Save, inputs, f)
    }

    /// Runs a statement whose backward residuals are kept from the forward
    /// in host memory: [`Ctx::statement`] with [`Policy::Offload`]. On a CPU
    /// device this is [`Ctx::save`]; see [`crate::offload`].
    ///
    /// ```
    /// use candle_core::{Device, Var};
    /// use remat_runtime::{MemoryReport, Policy, Region};
    /// let x = Var::ones(2, candle_core::DType::F32, &Device::Cpu)?;
    /// let y = Region::new("r").run(&[x.as_tensor()], |ctx, ins| {
    ///     let e = ctx.offload("e", &[&ins[0]], |t| t[0].exp())?;
    ///     ctx.recompute("s", &[&e], |t| t[0].sum_all())
    /// })?;
    /// assert_eq!(MemoryReport::capture().entries[1].policy, Some(Policy::Offload));
    /// assert_eq!(y.backward()?.get(&x).unwrap().to_vec1::<f32>()?, vec![1f32.exp(); 2]);
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn offload<O: Outputs, E: Into<RematError>>(
        &mut self,
        name: &str,
        inputs: impl Inputs,
        f: impl FnOnce(&[Tensor]) -> std::result::Result<O, E>,
    ) -> Result<O> {
        self.statement(name, Policy::Offload, inputs, f)
    }

    /// Runs a statement that is computed again during replay:
    /// [`Ctx::statement`] with [`Policy::Recompute`].
    ///
    /// ```
    /// # use candle_core::{Device, Tensor};
    /// # use remat_runtime::Region;
    /// let x = Tensor::ones(2, candle_core::DType::F32, &Device::Cpu)?;
    /// let y = Region::new("r").run(&[&x], |ctx, ins| {
    ///     ctx.recompute("exp", &[&ins[0]], |t| t[0].exp())
    /// })?;
    /// assert_eq!(y.dims(), &[2]);
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn recompute<O: Outputs, E: Into<RematError>>(
        &mut self,
        name: &str,
        inputs: impl Inputs,
        f: impl FnOnce(&[Tensor]) -> std::result::Result<O, E>,
    ) -> Result<O> {
        self.statement(name, Policy::Recompute, inputs, f)
    }
}

/// A hash of a statement's name.
fn name_hash(name: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    h.finish()
}
