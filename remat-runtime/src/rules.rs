//! The rules a `remat!` block's values follow, as traits. The macro does
//! not know the types of a block's values; rustc checks these rules for it
//! and names these traits (with their messages) in compile errors:
//!
//! - [`Readable`]: a value a statement reads is `Clone` (each statement runs
//!   again in the backward with its own copy of what it reads);
//! - [`Unwrapped`]: a statement's value is not a `Result` (a missing `?`);
//! - [`StatementValue`]: a statement's value is made of tensors and plain
//!   values ([`Outputs`]);
//! - [`HoldsTensors`]: a `#[save]` or `#[offload]` statement's value holds a
//!   tensor (there is something to save).

use candle_core::Tensor;

use crate::__private::Method;
use crate::{Ctx, Outputs, Policy, RematError, Result};

/// A value a statement of a `remat!` block can read: every `Clone` type.
///
/// ```
/// fn readable<T: remat_runtime::rules::Readable>() {}
/// readable::<candle_core::Tensor>();
/// readable::<usize>();
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is read by a statement of a remat! block, so it must be `Clone`",
    label = "read here",
    note = "each statement runs again in the backward with its own copy of the values it reads: derive or implement `Clone` for this type"
)]
pub trait Readable {}

impl<T: Clone> Readable for T {}

/// A value `#[save]` or `#[offload]` can keep: one that holds a tensor.
/// The macro checks the plain types of [`Outputs`] (`usize`, `f64`,
/// `Shape`, ...) against it; nothing implements it for them.
///
/// ```
/// fn saved(_: &dyn remat_runtime::rules::HoldsTensors) {}
/// ```
#[diagnostic::on_unimplemented(
    message = "this saved statement's value is a `{Self}`, which holds no tensor: there is nothing to save",
    label = "a plain value",
    note = "remove the annotation: plain values cost nothing to recompute"
)]
pub trait HoldsTensors {}

/// A statement's value that is not a `Result`. The macro checks `Result`
/// values against it; nothing implements it for them.
///
/// ```
/// fn unwrapped(_: &dyn remat_runtime::rules::Unwrapped) {}
/// ```
#[diagnostic::on_unimplemented(
    message = "this statement's value is a `Result`: add `?`",
    label = "add `?` at the end of this expression",
    note = "a statement's value is what its expression gives after `?`: tensors, tuples of them, or plain values"
)]
pub trait Unwrapped {}

/// A statement's value: every [`Outputs`] type. The macro runs its
/// statements through this trait, so that a value that is not one is
/// reported in these words at the statement.
///
/// ```
/// fn value<T: remat_runtime::rules::StatementValue>() {}
/// value::<(candle_core::Tensor, usize)>();
/// ```
#[diagnostic::on_unimplemented(
    message = "this statement's value is a `{Self}`, which a remat! statement cannot give",
    label = "this statement's value",
    note = "a statement gives tensors, `Vec`s, `Option`s and tuples of them, or plain values such as `usize` and `Shape`; clone a borrowed tensor (`x.clone()`)"
)]
pub trait StatementValue: Sized {
    /// [`Ctx::open`], [`Ctx::save`], [`Ctx::offload`] or
    /// [`Ctx::recompute`], by `method`; `inputs`: the statement's input
    /// tensors, and how many of the first are read for their values (the
    /// rest only for their shapes, or detached).
    #[doc(hidden)]
    fn run<E: Into<RematError>>(
        ctx: &mut Ctx,
        method: Method,
        name: &str,
        inputs: (Vec<Tensor>, usize),
        f: impl FnOnce(&[Tensor]) -> std::result::Result<Self, E>,
    ) -> Result<Self>;
}

#[diagnostic::do_not_recommend]
impl<T: Outputs> StatementValue for T {
    fn run<E2: Into<RematError>>(
        ctx: &mut Ctx,
        method: Method,
        name: &str,
        (inputs, value_inputs): (Vec<Tensor>, usize),
        f: impl FnOnce(&[Tensor]) -> std::result::Result<Self, E2>,
    ) -> Result<Self> {
        let declared = match method {
            Method::Open => None,
            Method::Save => Some(Policy::Save),
            Method::Offload => Some(Policy::Offload),
            Method::Recompute => Some(Policy::Recompute),
        };
        ctx.run(name, declared, false, inputs, value_inputs, f)
    }
}

/// A `Result` value: reported by the [`Unwrapped`] check at the same
/// statement, so that a missing `?` is one error, not two. Never runs.
impl<T, E> StatementValue for std::result::Result<T, E> {
    fn run<E2: Into<RematError>>(
        _: &mut Ctx,
        _: Method,
        name: &str,
        _: (Vec<Tensor>, usize),
        _: impl FnOnce(&[Tensor]) -> std::result::Result<Self, E2>,
    ) -> Result<Self> {
        Err(candle_core::Error::Msg(format!(
            "statement `{name}` of a remat! block gives a `Result`: add `?`"
        ))
        .into())
    }
}
