//! The check that a `#[save]` or `#[offload]` statement's value holds a
//! tensor: `let _: &dyn rt::HoldsTensors = (&&rt::Probe(&h)).saveable();`
//! resolves to [`CheckPlain`] for the plain types of [`crate::Outputs`]
//! (`usize`, `f64`, `Shape`, ...), which hands the value to the cast, which
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

/// The failing level: plain values.
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
crate::values::for_plain_values!(plain_values);

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
