//! The tape: what one call of a region keeps from its forward for the
//! replay, one record per statement.
//!
//! * this file: the [`Tape`] and its [`Record`]s, and moving an offloaded
//!   record's residuals to the host when the forward ends
//!   ([`Tape::swap_out`]);
//! * `recorder`: the forward, which runs the block and writes the records;
//! * `bytes`: the one rule for counting what a tape holds, shared by the
//!   memory report, the budget planner, the trace and offload;
//! * `fingerprint`: what the replay check compares, and how;
//! * `checksum`: the checksum of every element of a value;
//! * `unread`: outputs nothing in the replay reads, left uncomputed there.

pub(crate) mod bytes;
pub(crate) mod checksum;
pub(crate) mod fingerprint;
pub(crate) mod mask;
pub(crate) mod recorder;
pub(crate) mod unread;

use std::any::Any;
use std::collections::HashSet;
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};

pub(crate) use mask::Mask;

use crate::offload::{moves, Offloaded};
use crate::storage::storage_extent;
use crate::{Mismatch, Plan, Policy, RematError, Result};

/// Shape, dtype and device of a value: what the replay is checked against.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    pub shape: Shape,
    pub dtype: DType,
    pub device: Device,
}

impl Meta {
    pub fn of(t: &Tensor) -> Self {
        Meta {
            shape: t.shape().clone(),
            dtype: t.dtype(),
            device: t.device().clone(),
        }
    }

    /// Checks that `replay` matches this forward meta; `value` says which
    /// value of `statement` it is (`input 0`, `output 1`).
    pub fn check(&self, replay: &Meta, region: &str, statement: &str, value: String) -> Result<()> {
        let mismatch = |what, forward: String, replay: String| {
            RematError::mismatch(
                region,
                statement,
                Mismatch {
                    value: value.clone(),
                    what,
                    forward,
                    replay,
                },
            )
        };
        if self.shape != replay.shape {
            return Err(mismatch(
                "shape",
                format!("{:?}", self.shape.dims()),
                format!("{:?}", replay.shape.dims()),
            ));
        }
        if self.dtype != replay.dtype {
            return Err(mismatch(
                "dtype",
                format!("{:?}", self.dtype),
                format!("{:?}", replay.dtype),
            ));
        }
        if self.device.location() != replay.device.location() {
            return Err(mismatch(
                "device",
                format!("{:?}", self.device.location()),
                format!("{:?}", replay.device.location()),
            ));
        }
        Ok(())
    }
}

/// What a `Save` statement keeps.
#[derive(Clone)]
pub(crate) struct Saved {
    /// Per input: the leaf stand-in the statement ran on, when the input needed
    /// gradients.
    pub leaves: Vec<Option<Tensor>>,
    /// The statement's tracked outputs; their graph holds the residuals. Empty
    /// when nothing in the statement needs gradients.
    pub outs: Vec<Tensor>,
    /// Per output: the value ferried to the replay, because a recomputed
    /// statement reads it.
    pub ferried: Vec<Option<Tensor>>,
    /// The plain part of the statement's return value.
    pub skeleton: Arc<dyn Any + Send + Sync>,
    /// The statement ran on the tracked outputs of the saved statement just
    /// before it (no leaf copies between them): the two graphs are one, and
    /// the sweep runs them as one unit.
    pub chained: bool,
    /// For an offloaded statement whose residuals were moved: where they are.
    pub offloaded: Option<Arc<Offloaded>>,
}

/// One statement of the forward.
#[derive(Clone)]
pub(crate) struct Record {
    pub name: String,
    /// The policy written in the code, if any.
    pub declared: Option<Policy>,
    /// The policy the plan gave the statement in the forward.
    pub policy: Policy,
    pub inputs: Vec<Meta>,
    pub outputs: Vec<Meta>,
    /// The outputs that needed gradients in the forward (past the mask's
    /// capacity: those that carry one in the replay).
    pub outputs_need_grad: Mask,
    /// For a recomputed statement: the layouts of the values it ran on in
    /// the forward ([`fingerprint::layouts`]); a replay on the same bits in
    /// the same layouts computes the same bits (on the CPU).
    pub layouts: u64,
    /// For a recomputed statement: the value inputs it read as strided
    /// views, which the replay reads the same way (the region's first
    /// forward may read leaf copies instead; past the mask's capacity: every
    /// input that has a view to read).
    pub strided_reads: Mask,
    /// For a recomputed statement whose whole value is the tensor of one
    /// of its `nn` op calls: that call ([`unread::sole_call`]).
    pub sole_call: Option<u16>,
    /// That op's input was fingerprinted after the statement's outputs:
    /// the statement was followed by a saved one, or by none (the replay
    /// may then leave its value uncomputed and compare the input in its
    /// place). Before a recomputed statement it is not: the replay
    /// computes the value and compares that.
    pub sole_fingerprinted: bool,
    /// Nothing in the replay reads that value: the replay leaves it
    /// uncomputed ([`unread`]).
    pub unread: bool,
    /// A host read: it read a value that needs gradients for its value,
    /// and its value holds no tensor; a plain value computed from it
    /// carries no gradient (`Ctx::host_cut`).
    pub host_read: bool,
    /// `Some` exactly for `Save` and `Offload` statements (boxed: most
    /// records of a recomputing tape have none, and every byte of a record
    /// is held for as long as the tape).
    pub saved: Option<Box<Saved>>,
    /// What the budget planner needs to know about the statement; measured
    /// only on the call a budget plan profiles.
    pub profile: Option<Box<Profile>>,
}

/// Where one statement input came from, for the budget planner.
#[derive(Debug, Clone)]
pub(crate) struct Source {
    pub needs_grad: bool,
    /// The record that produced it; `None` for region inputs and constants.
    pub producer: Option<usize>,
    /// Its size, the bytes of a leaf copy of it.
    pub bytes: usize,
    /// Which value it is: statements reading one value share its copy.
    pub value: candle_core::TensorId,
}

/// Measurements of one statement in the forward.
#[derive(Debug, Clone, Default)]
pub(crate) struct Profile {
    /// Wall time of the statement's code.
    pub seconds: f64,
    /// Per input.
    pub sources: Vec<Source>,
}

/// A region input as a tape keeps it: detached (sharing storage with the
/// caller's), or not at all.
#[derive(Clone)]
pub(crate) enum Kept {
    /// Read by the replay: the block sees it (a leaf copy of it where it
    /// needs gradients).
    Read(Tensor),
    /// Needing gradients and read only by saved statements, through their
    /// own leaf copies: kept to see a change in place before their
    /// backward (plain candle's would read the changed values); the replay
    /// sees a placeholder.
    Checked(Tensor),
    /// Read by no statement's backward: the replay sees a placeholder.
    Released,
}

impl Kept {
    /// The tensor kept, if any.
    pub fn tensor(&self) -> Option<&Tensor> {
        match self {
            Kept::Read(t) | Kept::Checked(t) => Some(t),
            Kept::Released => None,
        }
    }
}

/// Everything one region call keeps between its forward and its backward,
/// but the block itself (which the call holds next to its tape).
#[derive(Clone)]
pub(crate) struct Tape {
    /// The region inputs, as the tape keeps them.
    pub inputs: Vec<Kept>,
    /// Shape, dtype and device of every region input.
    pub input_metas: Vec<Meta>,
    /// Which inputs need gradients.
    pub requires_grad: Vec<bool>,
    /// Which inputs the anchor chain ties to the call: those that need
    /// gradients and that a statement used in the forward.
    pub anchored: Vec<bool>,
    pub records: Vec<Record>,
    /// The parameters (`Var`s) the block used, in order of first use.
    pub params: Vec<Tensor>,
    /// The forward's fingerprints (`None` when the forward took none).
    pub fingerprints: Option<fingerprint::Forward>,
    pub outputs: Vec<Meta>,
    /// The plan the forward ran under: the replay runs under it too.
    pub plan: Plan,
    /// The call's seed for [`crate::random`]: the replay draws the same.
    pub seed: u64,
    /// The call's label in the trace recorded during its forward, if any.
    pub trace_label: Option<String>,
}

impl Tape {
    /// Moves the residuals of the offloaded statements of this tape, the
    /// tape of a call of `region` whose forward just ended, to host memory
    /// where [`moves`] says so.
    pub fn swap_out(&mut self, region: &str) -> Result<()> {
        let params: HashSet<usize> = self.params.iter().map(|p| storage_extent(p).0).collect();
        for record in &mut self.records {
            if record.policy != Policy::Offload {
                continue;
            }
            let Some(saved) = record.saved.as_mut() else {
                continue;
            };
            if !saved.outs.first().is_some_and(|t| moves(t.device())) {
                continue;
            }
            saved.offloaded =
                Offloaded::swap_out(region, &record.name, &saved.leaves, &saved.outs, &params)?
                    .map(Arc::new);
        }
        Ok(())
    }
}
