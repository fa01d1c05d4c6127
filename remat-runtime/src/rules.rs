//! The rules a `remat!` block's values follow, as traits. The macro does
//! not know the types of a block's values; rustc checks these rules for it
//! and names these traits (with their messages) in compile errors:
//!
//! - [`Readable`]: a value a statement reads is `Clone` (each statement runs
//!   again in the backward with its own copy of what it reads);
//! - [`Parameter`]: a block's parameter is `Clone + Send + Sync + 'static`
//!   (the region keeps it until the backward, maybe on another thread);
//! - [`StatementValue`]: a statement's value is made of tensors and plain
//!   values ([`Outputs`]), not a `Result` (a missing `?`);
//! - [`HoldsTensors`]: a `#[save]` or `#[offload]` statement's value holds a
//!   tensor (there is something to save).

use crate::__private::{Args, Block, Declared};
use crate::{Outputs, RematError, Result};

/// A value a statement of a `remat!` block can read: every `Clone` type.
///
/// ```
/// fn readable<T: remat_runtime::rules::Readable>() {}
/// readable::<candle_core::Tensor>();
/// readable::<usize>();
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is read by a remat! block, so it must be `Clone`",
    label = "read here",
    note = "the block runs again in the backward, each statement with its own copy of the values it reads: derive or implement `Clone` for this type"
)]
pub trait Readable {}

impl<T: Clone> Readable for T {}

/// A parameter of a `remat!` block: the region keeps its own copy until
/// the backward, which may run on another thread, so it is `Clone`,
/// `Send`, `Sync` and `'static` (an `Arc` rather than an `Rc`, an atomic
/// or a `Mutex` rather than a `Cell`).
///
/// ```
/// fn parameter<T: remat_runtime::rules::Parameter>() {}
/// parameter::<candle_core::Tensor>();
/// parameter::<std::sync::Arc<Vec<f32>>>();
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is a parameter of a remat! block, so it must be `Clone`, `Send`, `Sync` and `'static`",
    label = "this parameter",
    note = "the region keeps its own copy of each parameter until the backward, which may run on another thread: hold shared values in an `Arc` (not an `Rc`), changing ones in an atomic or a `Mutex` (not a `Cell`), own what it borrows, and derive or implement `Clone`"
)]
pub trait Parameter {}

impl<T: Clone + Send + Sync + 'static> Parameter for T {}

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
    note = "a statement gives what its expression gives after `?`: tensors, `Vec`s, `Option`s, tuples and maps of them, or plain values such as `usize` and `Shape`",
    note = "a `Result`: add `?`; a reference: clone it (`x.clone()`); a struct of your own: add `#[derive(remat_runtime::Outputs)]` to it"
)]
pub trait StatementValue: Sized {
    /// Runs the statement `name` of a block: `f` on what it reads (`args`;
    /// `reads` names those read for their values, in order), under the
    /// policy it declares.
    #[doc(hidden)]
    fn run<A: Args, E: Into<RematError>>(
        block: &mut Block<'_, E>,
        name: &str,
        reads: &[&str],
        declared: Declared,
        args: A,
        f: impl FnOnce(A::Values) -> std::result::Result<Self, E>,
    ) -> Result<Self>;
}

#[diagnostic::do_not_recommend]
impl<T: Outputs> StatementValue for T {
    fn run<A: Args, E: Into<RematError>>(
        block: &mut Block<'_, E>,
        name: &str,
        reads: &[&str],
        declared: Declared,
        args: A,
        f: impl FnOnce(A::Values) -> std::result::Result<Self, E>,
    ) -> Result<Self> {
        block.statement(name, reads, declared, args, f)
    }
}

/// Says that host data a `remat!` statement turns into a tensor is meant to
/// carry no gradient: `Tensor::new(constant(&load).as_slice(), dev)?`. The
/// block's check of floats that left the graph through the host
/// ([`RematError::HostCut`]) skips values read inside it (counts, sizes or
/// a schedule computed from routing decisions, not from the weights'
/// values). Returns `value` as it is.
///
/// ```
/// use remat_runtime::rules::constant;
/// let load = vec![2.0f32, 1.0];
/// assert_eq!(constant(&load), &load);
/// ```
pub fn constant<T>(value: T) -> T {
    value
}
