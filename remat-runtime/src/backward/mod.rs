//! The backward of a region call: the replay (`replay/`), then the reverse
//! sweep.
//!
//! * this file: [`Call`], one region call between its forward and its
//!   backward, and the driver [`Call::backward`] that candle's top anchor
//!   runs;
//! * `sweep`: the units' backwards, last to first;
//! * `retain`: [`retain_tape`] and the typed [`backward`], how user code
//!   enters a backward;
//! * `optimizer`: [`OptimizerInBackward`], parameters updated during the
//!   backward;
//! * `pending`: which parameters live region calls still need.

mod optimizer;
mod pending;
mod retain;
mod sweep;

pub use optimizer::OptimizerInBackward;
pub use retain::{backward, retain_tape};

use std::sync::{Arc, Mutex};

use candle_core::{Tensor, TensorId};

use crate::ctx::{Ctx, Mode};
use crate::graph::{make_leaf, Relayout};
use crate::replay::{self, Replay};
use crate::tape::{Kept, Meta, Tape};
use crate::{inspect, lock, RematError, Result};
use pending::Pending;

/// The type-erased block a region runs, for the replay.
pub(crate) type Body = Arc<dyn Fn(&mut Ctx, &[Tensor]) -> Result<Vec<Tensor>> + Send + Sync>;

/// A region call's tape and the block that replays it, until its backward
/// consumes them.
// One per region call, behind the call's `Arc`: boxing the live tape would
// only add an allocation per call.
#[allow(clippy::large_enum_variant)]
pub(crate) enum TapeState {
    Live {
        tape: Tape,
        body: Body,
    },
    /// Consumed or dropped, with the reason, for the error of a later
    /// backward.
    Released(String),
}

/// One region call: its tape and block, and the gradients its taps and
/// anchors hand each other during the backward.
pub(crate) struct Call {
    pub name: String,
    pub tape: Mutex<TapeState>,
    /// Per region output: its gradient, set by its tap.
    output_grads: Mutex<Vec<Option<Tensor>>>,
    /// Per anchor argument: its gradient, computed by the top anchor.
    anchor_grads: Mutex<Vec<Option<Tensor>>>,
    /// Its claim on the variables it anchors (parameters, and inputs that
    /// are variables), until its backward has handed their gradients over.
    pending: Mutex<Option<Pending>>,
    /// Those variables, by their position among the anchor arguments.
    variables: Vec<(usize, Tensor)>,
    /// The ids of the outputs it gave candle (its taps' values).
    pub given: Mutex<Vec<TensorId>>,
}

impl Drop for Call {
    fn drop(&mut self) {
        crate::graph::forget(&lock(&self.given));
        inspect::memory::forget_ended();
    }
}

impl Call {
    /// The call of region `name`, whose anchor chain ties `anchored` to it.
    pub fn new(name: String, body: Body, tape: Tape, anchored: &[Tensor]) -> Self {
        let n_outputs = tape.outputs.len();
        let variables: Vec<(usize, Tensor)> = anchored
            .iter()
            .enumerate()
            .filter(|(_, t)| t.is_variable())
            .map(|(i, t)| (i, t.clone()))
            .collect();
        let pending = Pending::new(variables.iter().map(|(_, t)| t));
        Call {
            name,
            tape: Mutex::new(TapeState::Live { tape, body }),
            output_grads: Mutex::new(vec![None; n_outputs]),
            anchor_grads: Mutex::new(Vec::new()),
            pending: Mutex::new(Some(pending)),
            variables,
            given: Mutex::new(Vec::new()),
        }
    }

    /// Called by the tap of output `index` with the output's gradient.
    pub fn set_output_grad(&self, index: usize, grad: Tensor) {
        if let Some(slot) = lock(&self.output_grads).get_mut(index) {
            *slot = Some(grad);
        }
    }

    /// Called by each anchor for the gradient of its argument.
    pub fn take_anchor_grad(&self, index: usize) -> Option<Tensor> {
        lock(&self.anchor_grads)
            .get_mut(index)
            .and_then(Option::take)
    }

    /// The region's backward: replay, then the reverse sweep over the tape.
    /// Leaves the gradients of the anchor arguments for the anchors.
    ///
    /// Without [`retain_tape`] the tape is consumed (released record by
    /// record); with it, the sweep runs on a copy of the tape's handles and
    /// the tape stays whole. On an error the tape is released whole, never
    /// half.
    pub fn backward(&self) -> Result<()> {
        let retain = retain::retaining();
        let (tape, body) = {
            let mut state = lock(&self.tape);
            match &*state {
                TapeState::Released(reason) => {
                    return Err(RematError::TapeReleased {
                        region: self.name.clone(),
                        reason: reason.clone(),
                    })
                }
                TapeState::Live { tape, body } if retain => (tape.clone(), body.clone()),
                TapeState::Live { .. } => {
                    let released = TapeState::Released(
                        "it was consumed by an earlier backward that did not retain it".into(),
                    );
                    match std::mem::replace(&mut *state, released) {
                        TapeState::Live { tape, body } => (tape, body),
                        TapeState::Released(_) => unreachable!("checked above"),
                    }
                }
            }
        };
        let output_grads = {
            let mut set = lock(&self.output_grads);
            let empty = vec![None; set.len()];
            std::mem::replace(&mut *set, empty)
        };
        match optimizer::nested(|| self.replay_and_sweep(tape, body, output_grads)) {
            Ok(mut grads) => {
                // An optimizer stepping in the backward takes the gradients
                // of variables; it may update one once no live region call
                // needs it.
                optimizer::offer(&self.name, &self.variables, &mut grads)?;
                *lock(&self.anchor_grads) = grads;
                if !retain {
                    if let Some(claim) = lock(&self.pending).take() {
                        let ids = claim.ids().to_vec();
                        drop(claim);
                        optimizer::released(&ids)?;
                    }
                }
                Ok(())
            }
            Err(e) => {
                if !retain {
                    *lock(&self.tape) =
                        TapeState::Released(format!("an earlier backward failed: {e}"));
                    lock(&self.pending).take();
                }
                Err(e)
            }
        }
    }

    fn replay_and_sweep(
        &self,
        tape: Tape,
        body: Body,
        output_grads: Vec<Option<Tensor>>,
    ) -> Result<Vec<Option<Tensor>>> {
        let Tape {
            inputs,
            input_metas,
            requires_grad,
            anchored,
            records,
            params,
            fingerprints,
            outputs,
            plan,
            seed,
            trace_label,
        } = tape;
        // Every region of the forward has run: a name the plan lists that
        // none of their statements has is a mistake (a misspelt name).
        if let Some((names, known)) = plan.unknown_names() {
            return Err(RematError::UnknownStatement {
                region: self.name.clone(),
                plan: plan.to_string(),
                names,
                known,
            });
        }
        // Inputs no statement's backward reads were released after the
        // forward, and those only saved statements read through their own
        // copies are kept for the check alone: the block sees placeholders
        // for both. The others that need gradients are leaves (one copy
        // each, which every unit reading them shares), so that a statement
        // reading one without declaring it shows in its graph; a strided
        // one's leaf is in memory order, and the block sees it through the
        // input's view.
        let mut relaid = Vec::with_capacity(inputs.len());
        let checked: Vec<Option<Tensor>> = inputs
            .iter()
            .map(|k| match k {
                Kept::Checked(t) => Some(t.clone()),
                _ => None,
            })
            .collect();
        let inputs = inputs
            .into_iter()
            .zip(&input_metas)
            .zip(&requires_grad)
            .map(|((kept, meta), &grad)| {
                relaid.push(None);
                match kept {
                    Kept::Read(t) if grad => match Relayout::of(t.layout(), t.device()) {
                        Some(r) => {
                            let leaf = r.leaf(&t)?;
                            let seen = r.read(&leaf)?;
                            if let Some(slot) = relaid.last_mut() {
                                *slot = Some((leaf, r));
                            }
                            Ok(seen)
                        }
                        None => make_leaf(&t),
                    },
                    Kept::Read(t) => Ok(t),
                    Kept::Checked(_) | Kept::Released => replay::placeholder(meta),
                }
            })
            .collect::<Result<Vec<Tensor>>>()?;
        let mut ctx = Ctx::new(
            &self.name,
            Mode::Replay(Replay::new(
                records,
                &inputs,
                &checked,
                relaid,
                &requires_grad,
                &params,
                fingerprints,
                trace_label.filter(|_| inspect::trace::enabled()),
            )?),
            plan.clone(),
            seed,
        );
        // Regions nested in the block run under the plan of the forward too.
        let replay_outputs = crate::plan::replaying(|| {
            let _profile = crate::inspect::profile::op("region");
            plan.inherit(|| body(&mut ctx, &inputs))
        })?;
        if replay_outputs.len() != outputs.len() {
            return Err(RematError::OutputCount {
                region: self.name.clone(),
                forward: outputs.len(),
                replay: replay_outputs.len(),
            });
        }
        for (j, (meta, t)) in outputs.iter().zip(&replay_outputs).enumerate() {
            meta.check(&Meta::of(t), &self.name, "(region)", format!("output {j}"))?;
        }
        let Mode::Replay(replay) = ctx.mode else {
            unreachable!("the context was built in replay mode")
        };
        let _profile = crate::inspect::profile::backward("region backward");
        let units = replay.finish(&self.name, &replay_outputs)?;
        let output_ids = replay_outputs.iter().map(|t| t.id()).collect::<Vec<_>>();
        drop(replay_outputs);
        let (input_grads, param_grads) = sweep::sweep(
            &self.name,
            units,
            &output_ids,
            output_grads,
            &inputs,
            &params,
        )?;
        // Anchor arguments: the inputs anchored, then the parameters. An
        // input the forward did not use cannot get a gradient in the replay
        // unless the replay ran other code.
        let mut grads = Vec::with_capacity(input_grads.len() + param_grads.len());
        for (i, (g, (&r, &a))) in input_grads
            .into_iter()
            .zip(requires_grad.iter().zip(&anchored))
            .enumerate()
        {
            match g {
                _ if a => grads.push(g),
                Some(g) if r && g.elem_count() > 0 => {
                    return Err(RematError::desync(
                        &self.name,
                        "none that did (a branch taken another way, or state that changed \
                         between the forward and the backward)",
                        format!("statements that used input {i} of the block for its values"),
                    ))
                }
                _ => {}
            }
        }
        grads.extend(param_grads);
        Ok(grads)
    }
}
