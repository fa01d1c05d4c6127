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
//!   tensor (there is something to save);
//! - [`BlockError`]: a block's error type takes candle's errors and can
//!   cross threads.

use crate::__private::{Args, Block, BlockRegion, Declared, Errors, ResultError};
use crate::error::UserError;
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
    fn run<A: Args, E>(
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
    fn run<A: Args, E>(
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

/// The value of a `remat!` block's `Result`: every [`Outputs`] type (a
/// tensor, tuples, a struct deriving `Outputs`). The macro runs the
/// block's region through this trait, so that a value that is not one is
/// reported in these words at the block's result type.
///
/// ```
/// fn value<T: remat_runtime::rules::BlockValue>() {}
/// value::<(candle_core::Tensor, usize)>();
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the value of a remat! block",
    label = "this block's result",
    note = "a block gives what a statement can give: tensors, `Vec`s, `Option`s, tuples and maps of them, or plain values such as `usize`; a struct of your own: add `#[derive(remat_runtime::Outputs)]` to it (a field of it that is not `Outputs`, such as a module: `#[outputs(plain)]`)"
)]
pub trait BlockValue: Sized {
    /// Runs `region` on `args` (the block's parameters, named `names`):
    /// see `BlockRegion::run`.
    #[doc(hidden)]
    fn run<R, A>(
        region: BlockRegion<R>,
        names: &'static [&'static str],
        args: A,
        body: impl Fn(&mut Block<'_, R::Error>, A::Values) -> Result<Self> + Send + Sync + 'static,
    ) -> std::result::Result<Self, R::Error>
    where
        R: ResultError,
        A: Args + Send + Sync + 'static,
        R::Error: 'static;
}

#[diagnostic::do_not_recommend]
impl<T: Outputs> BlockValue for T {
    fn run<R, A>(
        region: BlockRegion<R>,
        names: &'static [&'static str],
        args: A,
        body: impl Fn(&mut Block<'_, R::Error>, A::Values) -> Result<Self> + Send + Sync + 'static,
    ) -> std::result::Result<Self, R::Error>
    where
        R: ResultError,
        A: Args + Send + Sync + 'static,
        R::Error: 'static,
    {
        region.run(names, args, body)
    }
}

/// The error type of a `remat!` block's `Result` (`candle_core::Error`,
/// [`RematError`], `anyhow::Error`, an enum of your own): statements fail
/// with it (`?` on candle's errors, `return Err(MyError::..)`), so it takes
/// candle's errors (`From<candle_core::Error>`), and it can cross threads
/// (the backward may run elsewhere). An error of this type that a
/// statement returns comes back from the block as it was; one the runtime
/// raises comes back through `From<candle_core::Error>` (a
/// [`RematError`] as itself).
///
/// ```
/// use remat_runtime::rules::BlockError;
/// #[derive(Debug)]
/// enum MyError {
///     Candle(candle_core::Error),
///     EmptyBatch,
/// }
/// impl From<candle_core::Error> for MyError {
///     fn from(e: candle_core::Error) -> Self {
///         MyError::Candle(e)
///     }
/// }
/// fn block_error<E: BlockError>() {}
/// block_error::<MyError>();
/// block_error::<candle_core::Error>();
/// block_error::<remat_runtime::RematError>();
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is the error type of a remat! block, so it must implement `From<candle_core::Error>`, `Debug`, `Send` and `Sync`, and be `'static`",
    label = "this block's result",
    note = "statements run candle ops whose errors `?` turns into the block's error type, and the backward may run on another thread: return `candle_core::Result`, `remat_runtime::Result` or `anyhow::Result`, or implement `From<candle_core::Error>` for your error type"
)]
pub trait BlockError: Sized + std::fmt::Debug + Send + Sync + 'static {
    /// The error as the runtime carries it: a [`RematError`] as itself, a
    /// candle error as [`RematError::Candle`], any other as
    /// [`RematError::User`].
    fn into_remat(self) -> RematError {
        use std::any::{Any, TypeId};
        let id = TypeId::of::<Self>();
        if id != TypeId::of::<RematError>() && id != TypeId::of::<candle_core::Error>() {
            let message = format!("{self:?}");
            return RematError::User(UserError::new(message, Box::new(self)));
        }
        let any: Box<dyn Any> = Box::new(self);
        match any.downcast::<RematError>() {
            Ok(e) => *e,
            Err(any) => match any.downcast::<candle_core::Error>() {
                Ok(e) => RematError::from(*e),
                Err(_) => unreachable!("the type was one of the two"),
            },
        }
    }

    /// The block's error from the runtime's: a [`RematError`] as itself; an
    /// error of this type a statement returned, as it was; any other
    /// through `From<candle_core::Error>`.
    fn from_remat(e: RematError) -> Self;

    /// Both conversions, for the block's region.
    #[doc(hidden)]
    fn errors() -> Errors<Self> {
        Errors {
            into_remat: Self::into_remat,
            from_remat: Self::from_remat,
        }
    }
}

#[diagnostic::do_not_recommend]
impl<E: From<candle_core::Error> + std::fmt::Debug + Send + Sync + 'static> BlockError for E {
    fn from_remat(e: RematError) -> Self {
        use std::any::Any;
        let any: Box<dyn Any> = Box::new(e);
        let e = match any.downcast::<Self>() {
            Ok(same) => return *same,
            Err(any) => match any.downcast::<RematError>() {
                Ok(e) => *e,
                Err(_) => unreachable!("the box holds a RematError"),
            },
        };
        if let RematError::User(user) = e.root() {
            if let Some(own) = user.take::<Self>() {
                return own;
            }
        }
        Self::from(candle_core::Error::from(e))
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
