//! The check that a `#[save]` or `#[offload]` statement's value holds a
//! tensor: `let _: &dyn rt::HoldsTensors = (&&rt::Probe(&h)).saveable();`
//! resolves to [`CheckPlain`] for values with no tensor in them ([`Plain`]:
//! `usize`, `f64`, `Shape`, ..., and `Vec`s, `Option`s and tuples of
//! them), which hands the value to the cast, which
//! fails with the message of [`HoldsTensors`]; to [`CheckTensors`] for
//! everything else, which passes. The check is a cast at the user's span,
//! so that the error points there and nowhere into remat's sources.

use candle_core::{DType, Device, Shape};

use crate::rules::HoldsTensors;

/// A reference to a statement's value, for the check.
pub struct Probe<'a, T: ?Sized>(pub &'a T);

/// Stands for a value that passed the check.
#[doc(hidden)]
pub struct Checked;

impl HoldsTensors for Checked {}

/// A value with no tensor anywhere in it: the plain types of
/// [`crate::Outputs`] (`usize`, `f64`, `Shape`, ...) and the containers
/// `Outputs` takes of them (`Vec<Vec<f32>>` from `to_vec2`).
pub trait Plain {}
macro_rules! plain_leaves {
    ($($t:ty),*) => {$(
        impl Plain for $t {}
    )*};
}
crate::values::for_plain_values!(plain_leaves);
impl<T: Plain> Plain for Vec<T> {}
impl<T: Plain> Plain for Option<T> {}
impl<T: Plain> Plain for Box<T> {}
impl<T: Plain> Plain for std::sync::Arc<T> {}
impl<T: Plain> Plain for std::rc::Rc<T> {}
impl<T: Plain, const N: usize> Plain for [T; N] {}
impl<K, V: Plain, S> Plain for std::collections::HashMap<K, V, S> {}
impl<K, V: Plain> Plain for std::collections::BTreeMap<K, V> {}
macro_rules! plain_tuples {
    ($($name:ident),+) => {
        impl<$($name: Plain),+> Plain for ($($name,)+) {}
    };
}
/// A field's type in a `#[derive(Outputs)]` struct's `Plain` bounds
/// (`for<'f> PlainField<'f, Tensor>: Plain`): a bound over a lifetime is checked
/// where used, not where written, so a struct with a tensor field is simply
/// not `Plain`.
pub struct PlainField<'f, T: ?Sized>(std::marker::PhantomData<&'f T>);
impl<T: Plain + ?Sized> Plain for PlainField<'_, T> {}
plain_tuples!(A);
plain_tuples!(A, B);
plain_tuples!(A, B, C);
plain_tuples!(A, B, C, D);
plain_tuples!(A, B, C, D, E);

/// The failing level: plain values.
pub trait CheckPlain<'a, T> {
    /// The value itself, for the cast to fail on.
    fn saveable(&self) -> &'a T;
}
impl<'a, T: Plain> CheckPlain<'a, T> for &Probe<'a, T> {
    fn saveable(&self) -> &'a T {
        self.0
    }
}

/// The passing level: everything else.
pub trait CheckTensors {
    /// `&Checked`.
    fn saveable(&self) -> &dyn HoldsTensors;
}
impl<T: ?Sized> CheckTensors for Probe<'_, T> {
    fn saveable(&self) -> &dyn HoldsTensors {
        &Checked
    }
}
