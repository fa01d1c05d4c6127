//! Support for the code the `remat!` macro generates. Not a public API.
//!
//! The macro does not know the types of the bindings a statement reads. It
//! wraps each in a [`Probe`] and calls `tensors` / `rebuild` on
//! `&&&&Probe(&x)`: method resolution picks the first of four levels whose
//! bounds hold (the "autoref specialization" pattern):
//!
//! 1. [`ViaTensor`], on `&&&Probe<T>` with `T:`[`Outputs`]` + Clone`: the
//!    value's tensors become statement inputs and are rebuilt from what the
//!    runtime hands back;
//! 2. [`ViaResult`], on `&&Probe<Result<T, E>>`: a missing `?`, reported at
//!    the statement that made the value (before level 3: candle's `Error`,
//!    hence its `Result`, is `Clone`);
//! 3. [`ViaClone`], on `&Probe<T>` with `T: Clone`: a plain value, cloned;
//! 4. [`Unreadable`], on `Probe<T>`, no bounds.
//!
//! Every level resolves, so a mistake is never reported as a failed method
//! lookup on these types. `tensors` returns what the macro casts to
//! `&dyn Readable`: that cast fails to compile exactly on level 4, with the
//! user's type in the message; levels 2 and 4 therefore never run.
//!
//! The checks are casts to `&dyn Trait` at the user's span: a cast reports
//! the trait's `on_unimplemented` message and no "required by a bound"
//! note pointing into this file.

use candle_core::{Shape, Tensor};

use crate::rules::{HoldsTensors, Readable, Unwrapped};
use crate::{Outputs, RematError, Result};

/// A reference to a value of unknown type, for method-resolution dispatch.
pub struct Probe<'a, T: ?Sized>(pub &'a T);

/// Stands for a value that passed a check (or was reported elsewhere).
pub struct Checked;

/// `Checked` is not `Clone`, so this does not overlap the blanket impl.
impl Readable for Checked {}
impl HoldsTensors for Checked {}
impl Unwrapped for Checked {}

pub(crate) fn error(what: String) -> RematError {
    candle_core::Error::Msg(what).into()
}

/// Level 1: values made of tensors.
pub trait ViaTensor<T> {
    /// Appends the value's tensors to `out`.
    fn tensors(&self, out: &mut Vec<Tensor>) -> &'static Checked;
    /// The value with its tensors taken from `it`.
    fn rebuild(&self, it: &mut dyn Iterator<Item = Tensor>) -> Result<T>;
}

impl<T: Outputs + Clone> ViaTensor<T> for &&&Probe<'_, T> {
    fn tensors(&self, out: &mut Vec<Tensor>) -> &'static Checked {
        self.0.clone().split_into(out);
        &Checked
    }
    fn rebuild(&self, it: &mut dyn Iterator<Item = Tensor>) -> Result<T> {
        let skeleton = self.0.clone().split_into(&mut Vec::new());
        T::join(it, &skeleton)
    }
}

/// Level 3: plain values, cloned.
pub trait ViaClone<T> {
    /// Appends nothing.
    fn tensors(&self, out: &mut Vec<Tensor>) -> &'static Checked;
    /// A clone of the value.
    fn rebuild(&self, it: &mut dyn Iterator<Item = Tensor>) -> Result<T>;
}

impl<T: Clone> ViaClone<T> for &Probe<'_, T> {
    fn tensors(&self, _: &mut Vec<Tensor>) -> &'static Checked {
        &Checked
    }
    fn rebuild(&self, _: &mut dyn Iterator<Item = Tensor>) -> Result<T> {
        Ok(self.0.clone())
    }
}

/// Level 2: a `Result` (a missing `?`), already reported by the statement
/// that made it ([`Unwrapped`]), so it passes here: one error, not two.
/// `rebuild` never runs.
pub trait ViaResult<T> {
    /// Appends nothing.
    fn tensors(&self, out: &mut Vec<Tensor>) -> &'static Checked;
    /// An error.
    fn rebuild(&self, it: &mut dyn Iterator<Item = Tensor>) -> Result<T>;
}

/// Its `rebuild` gives the `Ok` type, so that the reading statement
/// type-checks as if the `?` were there: the missing `?` is one error.
impl<T, E> ViaResult<T> for &&Probe<'_, std::result::Result<T, E>> {
    fn tensors(&self, _: &mut Vec<Tensor>) -> &'static Checked {
        &Checked
    }
    fn rebuild(&self, _: &mut dyn Iterator<Item = Tensor>) -> Result<T> {
        Err(error(
            "a statement of a remat! block read a `Result`: add `?` where it is made".into(),
        ))
    }
}

/// Level 4: everything else. `tensors` returns the value, whose cast to
/// `&dyn Readable` fails to compile (it is not `Clone`), so `rebuild`
/// never runs.
pub trait Unreadable<'a, T> {
    /// The value, for the check to fail on.
    fn tensors(&self, out: &mut Vec<Tensor>) -> &'a T;
    /// An error.
    fn rebuild(&self, it: &mut dyn Iterator<Item = Tensor>) -> Result<T>;
}

impl<'a, T> Unreadable<'a, T> for Probe<'a, T> {
    fn tensors(&self, _: &mut Vec<Tensor>) -> &'a T {
        self.0
    }
    fn rebuild(&self, _: &mut dyn Iterator<Item = Tensor>) -> Result<T> {
        Err(error(
            "a statement of a remat! block read a value that is not `Clone`".into(),
        ))
    }
}

/// The [`HoldsTensors`] check's two levels: plain types (those
/// [`Outputs`] implements as plain values) are handed to the check, which
/// fails; everything else passes.
pub trait CheckPlain<'a, T> {
    /// The value itself, for the cast to fail on.
    fn saveable(&self) -> &'a T;
}
macro_rules! plain_values {
    ($($t:ty),*) => {$(
        impl<'a> CheckPlain<'a, $t> for &Probe<'a, $t> {
            fn saveable(&self) -> &'a $t {
                self.0
            }
        }
    )*};
}
plain_values!((), bool, usize, u32, u64, i32, i64, f32, f64, Shape, String);
/// See [`CheckPlain`].
pub trait CheckTensors {
    /// `&Checked`.
    fn saveable(&self) -> &dyn HoldsTensors;
}
impl<T> CheckTensors for Probe<'_, T> {
    fn saveable(&self) -> &dyn HoldsTensors {
        &Checked
    }
}

/// The [`Unwrapped`] check's two levels: a `Result` is handed to the check,
/// which fails; everything else passes.
pub trait CheckUnwrapped<'a, T, E> {
    /// The value itself, for the cast to fail on.
    fn unwrapped(&self) -> &'a std::result::Result<T, E>;
}
impl<'a, T, E> CheckUnwrapped<'a, T, E> for &Probe<'a, std::result::Result<T, E>> {
    fn unwrapped(&self) -> &'a std::result::Result<T, E> {
        self.0
    }
}
/// See [`CheckUnwrapped`].
pub trait CheckValue {
    /// `&Checked`.
    fn unwrapped(&self) -> &dyn Unwrapped;
}
impl<T> CheckValue for Probe<'_, T> {
    fn unwrapped(&self) -> &dyn Unwrapped {
        &Checked
    }
}

/// The statement method a `remat!` statement calls, through
/// [`crate::rules::StatementValue::run`].
#[derive(Clone, Copy)]
pub enum Method {
    /// [`crate::Ctx::open`].
    Open,
    /// [`crate::Ctx::save`].
    Save,
    /// [`crate::Ctx::offload`].
    Offload,
    /// [`crate::Ctx::recompute`].
    Recompute,
}

/// The region of a `remat!` block: its statements declare every binding
/// they mention, so the first forward need not look for undeclared reads.
pub fn region(name: &str) -> crate::Region {
    crate::Region::new(name).declaring_all_reads()
}

/// The name of a method's region: `Type::method`, the type without its
/// module path (`DecoderLayer::forward`, `Block<f32>::forward`).
pub fn method_region<T: ?Sized>(method: &str) -> String {
    let full = std::any::type_name::<T>();
    let (path, generics) = full.split_at(full.find('<').unwrap_or(full.len()));
    let ty = path.rsplit("::").next().unwrap_or(path);
    format!("{ty}{generics}::{method}")
}

/// The error type of a block's function (`candle_core::Error` for
/// `candle_core::Result<T>`): its statements fail with it.
pub type ErrorOf<R> = <R as ResultError>::Error;

/// See [`ErrorOf`].
pub trait ResultError {
    /// The error type.
    type Error;
}

impl<T, E> ResultError for std::result::Result<T, E> {
    type Error = E;
}
