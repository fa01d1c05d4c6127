//! The state one region call shares between its taps and anchors.

use std::sync::{Mutex, MutexGuard};

use candle_core::Tensor;

use crate::ctx::{Ctx, Mode};
use crate::replay::ReplayState;
use crate::tape::{Meta, Tape};
use crate::{retain, sweep, trace, RematError, Result};

pub(crate) enum Slot {
    Live(Tape),
    Released(String),
}

pub(crate) struct RegionState {
    pub name: String,
    pub slot: Mutex<Slot>,
    /// Per region output: its gradient, stashed by its tap.
    output_grads: Mutex<Vec<Option<Tensor>>>,
    /// Per anchor argument: its gradient, computed by the top anchor.
    results: Mutex<Vec<Option<Tensor>>>,
}

/// Locks `m`, recovering the data of a poisoned lock: every critical section
/// here leaves the data consistent before anything can panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl RegionState {
    pub fn new(name: String, tape: Tape) -> Self {
        let n_outputs = tape.outputs.len();
        RegionState {
            name,
            slot: Mutex::new(Slot::Live(tape)),
            output_grads: Mutex::new(vec![None; n_outputs]),
            results: Mutex::new(Vec::new()),
        }
    }

    pub fn stash_output_grad(&self, index: usize, grad: Tensor) {
        if let Some(slot) = lock(&self.output_grads).get_mut(index) {
            *slot = Some(grad);
        }
    }

    pub fn take_result(&self, index: usize) -> Option<Tensor> {
        lock(&self.results).get_mut(index).and_then(Option::take)
    }

    /// The region's backward: replay, then the reverse sweep over the tape.
    /// Leaves the gradients of the anchor arguments in `results`.
    ///
    /// Without [`retain::retain_tape`] the tape is consumed (released record by
    /// record); with it, the sweep runs on a copy of the tape's handles and
    /// the tape stays whole. On an error the tape is released whole, never
    /// half.
    pub fn backward(&self) -> Result<()> {
        let retain = retain::retaining();
        let tape = {
            let mut slot = lock(&self.slot);
            match &*slot {
                Slot::Released(reason) => {
                    return Err(RematError::TapeReleased {
                        region: self.name.clone(),
                        reason: reason.clone(),
                    })
                }
                Slot::Live(tape) if retain => tape.clone(),
                Slot::Live(_) => {
                    let released = Slot::Released(
                        "it was consumed by an earlier backward that did not retain it".into(),
                    );
                    match std::mem::replace(&mut *slot, released) {
                        Slot::Live(tape) => tape,
                        Slot::Released(_) => unreachable!("checked above"),
                    }
                }
            }
        };
        let output_grads = {
            let mut stashed = lock(&self.output_grads);
            let empty = vec![None; stashed.len()];
            std::mem::replace(&mut *stashed, empty)
        };
        match self.replay_and_sweep(tape, output_grads) {
            Ok(results) => {
                *lock(&self.results) = results;
                Ok(())
            }
            Err(e) => {
                if !retain {
                    *lock(&self.slot) = Slot::Released(format!("an earlier backward failed: {e}"));
                }
                Err(e)
            }
        }
    }

    fn replay_and_sweep(
        &self,
        tape: Tape,
        output_grads: Vec<Option<Tensor>>,
    ) -> Result<Vec<Option<Tensor>>> {
        let Tape {
            body,
            inputs,
            requires_grad,
            records,
            params,
            outputs,
            plan,
            seed,
            trace_label,
        } = tape;
        let mut ctx = Ctx::new(
            &self.name,
            Mode::Replay(ReplayState::new(
                records,
                &inputs,
                &requires_grad,
                trace_label.filter(|_| trace::enabled()),
            )),
            plan.clone(),
            seed,
        );
        // Regions nested in the block run under the plan of the forward too.
        let replay_outputs = plan.scope(|| body(&mut ctx, &inputs))?;
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
        let Mode::Replay(state) = ctx.mode else {
            unreachable!("the context was built in replay mode")
        };
        let replayed = state.finish(&self.name, &replay_outputs)?;
        let output_ids = replay_outputs.iter().map(|t| t.id()).collect::<Vec<_>>();
        drop(replay_outputs);
        let (input_grads, param_grads) =
            sweep::sweep(replayed.units, &output_ids, output_grads, &inputs, &params)?;
        // Anchor arguments: the inputs that need gradients, then the parameters.
        Ok(input_grads
            .into_iter()
            .zip(&requires_grad)
            .filter(|(_, &r)| r)
            .map(|(g, _)| g)
            .chain(param_grads)
            .collect())
    }
}
