//! Support for the code the `remat!` macro generates. Not a public API.
//!
//! The macro does not know the types of the bindings a statement reads. It
//! wraps each in a [`Probe`] and calls `__remat_collect` / `__remat_rebuild`
//! on `&&Probe(..)`: method resolution picks [`ViaTensor`] when the value's
//! type is [`Outputs`] (its tensors become statement inputs and are rebuilt
//! from what the runtime hands back) and falls back to [`ViaPlain`]
//! otherwise (the value is cloned and carries no statement input). This is
//! the "autoref specialization" pattern: the `ViaTensor` impl is on
//! `&Probe<T>`, found first; the `ViaPlain` impl is on `Probe<T>`, found one
//! auto-deref later.

use candle_core::Tensor;

use crate::{Outputs, RematError, Result};

/// A reference to a value of unknown type, for method-resolution dispatch.
pub struct Probe<'a, T>(pub &'a T);

/// Dispatch for values made of tensors.
pub trait ViaTensor<T> {
    /// Appends the value's tensors to `out`.
    fn __remat_collect(&self, out: &mut Vec<Tensor>);
    /// The value with its tensors taken from `it`.
    fn __remat_rebuild(&self, it: &mut dyn Iterator<Item = Tensor>) -> Result<T>;
}

impl<T: Outputs + Clone> ViaTensor<T> for &Probe<'_, T> {
    fn __remat_collect(&self, out: &mut Vec<Tensor>) {
        self.0.clone().split_into(out);
    }
    fn __remat_rebuild(&self, it: &mut dyn Iterator<Item = Tensor>) -> Result<T> {
        let skeleton = self.0.clone().split_into(&mut Vec::new());
        T::join(it, &skeleton)
    }
}

/// Dispatch for everything else: no tensors, cloned.
pub trait ViaPlain<T> {
    /// Appends nothing.
    fn __remat_collect(&self, out: &mut Vec<Tensor>);
    /// A clone of the value.
    fn __remat_rebuild(&self, it: &mut dyn Iterator<Item = Tensor>) -> Result<T>;
}

impl<T: Clone> ViaPlain<T> for Probe<'_, T> {
    fn __remat_collect(&self, _: &mut Vec<Tensor>) {}
    fn __remat_rebuild(&self, _: &mut dyn Iterator<Item = Tensor>) -> Result<T> {
        Ok(self.0.clone())
    }
}

/// Drops a binding after its last reader (a no-op for `Copy` values).
pub fn release<T>(_: T) {}

/// The region of a `remat!` block: its statements declare every binding
/// they mention, so the first forward need not look for undeclared reads.
pub fn region(name: &str) -> crate::Region {
    crate::Region::new(name).declaring_all_reads()
}

/// Converts the error of a block's tail expression.
pub fn tail<T, E: Into<RematError>>(r: std::result::Result<T, E>) -> Result<T> {
    r.map_err(Into::into)
}

/// The inputs of a `remat!` statement or region: the tensors of the bindings
/// it reads (`own x` for a value, `ref x` for a `&T`), as a `Vec<Tensor>`.
#[doc(hidden)]
#[macro_export]
macro_rules! __remat_inputs {
    ($($how:ident $x:ident),*) => {{
        #[allow(unused_imports)]
        use $crate::__private::{ViaPlain as _, ViaTensor as _};
        #[allow(unused_mut)]
        let mut __inputs = ::std::vec::Vec::new();
        $($crate::__remat_binding!(collect $how $x __inputs);)*
        __inputs
    }};
}

/// Inside a statement: rebinds each name it reads to the value rebuilt from
/// the tensors the runtime handed the statement (leaf copies where the
/// gradient is cut), in the order of [`__remat_inputs!`].
#[doc(hidden)]
#[macro_export]
macro_rules! __remat_rebind {
    ($args:ident; $($how:ident $x:ident),*) => {
        #[allow(unused_imports)]
        use $crate::__private::{ViaPlain as _, ViaTensor as _};
        #[allow(unused_mut, unused_variables)]
        let mut __it = $args.iter().cloned();
        $($crate::__remat_binding!(rebind $how $x __it);)*
    };
}

/// One binding of [`__remat_inputs!`] and [`__remat_rebind!`].
#[doc(hidden)]
#[macro_export]
macro_rules! __remat_binding {
    (collect own $x:ident $out:ident) => {
        (&&$crate::__private::Probe(&$x)).__remat_collect(&mut $out);
    };
    (collect ref $x:ident $out:ident) => {
        (&&$crate::__private::Probe($x)).__remat_collect(&mut $out);
    };
    (rebind own $x:ident $args:ident) => {
        #[allow(unused_variables)]
        let $x = (&&$crate::__private::Probe(&$x)).__remat_rebuild(&mut $args)?;
    };
    (rebind ref $x:ident $args:ident) => {
        let __own = (&&$crate::__private::Probe($x)).__remat_rebuild(&mut $args)?;
        #[allow(unused_variables)]
        let $x = &__own;
    };
    // A `&T` parameter, captured by the region as an owned copy.
    (rebind as_ref $x:ident $args:ident) => {
        let __own = (&&$crate::__private::Probe(&$x)).__remat_rebuild(&mut $args)?;
        #[allow(unused_variables)]
        let $x = &__own;
    };
    // A `mut` parameter taken by value.
    (rebind own_mut $x:ident $args:ident) => {
        #[allow(unused_variables, unused_mut)]
        let mut $x = (&&$crate::__private::Probe(&$x)).__remat_rebuild(&mut $args)?;
    };
}
