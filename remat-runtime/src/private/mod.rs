//! Support for the code the `remat!` macro generates. Not a public API.
//!
//! A block expands to one call of [`BlockValue::run`]`(`[`region`]`::<R>(name,
//! errors), names, args, body)`: `args` are the block's parameters, `names`
//! their names, `body` the block, in which every
//! statement is one call of [`StatementValue::run`] with its name, its
//! declared policy ([`Declared`]), what it reads (an [`Args`] tuple) and its
//! code as a closure of what it reads. The forward runs `body` once; the
//! backward runs it again (the replay).
//!
//! * `read`: each value a statement reads is handed over as
//!   `rt::read(&x).arg()`, which picks how by the value's type;
//! * `args`: the tuples of what a statement reads, split into tensors and
//!   rebuilt from the tensors the runtime hands the statement;
//! * `block`: the region of a block and the context its statements run in;
//! * `given`: a `mut` binding a statement changed, given back with its
//!   value;
//! * `saved`: the check that a `#[save]` statement's value holds a tensor;
//! * `names!`: registers the names of a block's statements, which a plan
//!   may use before the block first runs.

mod args;
mod block;
mod given;
mod read;
mod saved;

pub use crate::__remat_statement_names as names;
pub use crate::graph::Reach;
pub use crate::plan::compiled::StatementNames;
pub use crate::rules::{BlockError, BlockValue, HoldsTensors, Parameter, Readable, StatementValue};
pub use args::{Arg, Args, OnBranch, Partly, Split, WithoutGrad};
pub use block::{
    method_region, region, Block, BlockRegion, Declared, Declared::*, ErrorOf, Errors, ResultError,
};
pub use inventory;
pub use read::{
    param, read, AsClone, AsNothing, AsTensors, ByClone, ByTensors, Cloned, Failed, Field,
    FromResult, Given, NotClone, Param, ParamClone, ParamFailed, ParamLevel2, ParamLevel3,
    ParamTensors, Read, Tensors,
};
pub use saved::{CheckPlain, CheckTensors, Checked, Plain, PlainField, Probe};
pub use std::result::Result::Ok;

/// Drops `value` after its last reader (also a `Copy` one, without a lint).
pub fn drop<T>(value: T) {
    std::mem::drop(value)
}

pub(crate) fn error(what: String) -> crate::RematError {
    candle_core::Error::Msg(what).into()
}
