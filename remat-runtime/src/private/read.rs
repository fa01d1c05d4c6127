//! `rt::read(&x).arg()`: how a value a statement reads is handed over,
//! picked by its type. The macro does not know the types of a block's
//! values; method resolution does: `arg` is looked up on [`Read`], then on
//! what it dereferences to, level by level, and the first level whose
//! bounds hold is used ("autoderef specialization"):
//!
//! 1. [`ByTensors`] on [`Read`], for values made of tensors
//!    ([`Outputs`]`+ Clone`): their tensors become the statement's inputs,
//!    and the statement sees the value rebuilt from what the runtime hands
//!    it back (in the replay, its own leaves);
//! 2. [`FromResult`], for a `Result`: a missing `?`, reported at the
//!    statement that made it; the reader sees the `Ok` type, so the mistake
//!    is one error, not two;
//! 3. [`ByClone`], for every other `Clone` value: cloned;
//! 4. [`NotClone`], everything else: the macro checks these reads
//!    against [`crate::rules::Readable`] where they are written, so this
//!    level never runs.

use std::marker::PhantomData;
use std::ops::Deref;

use crate::tape::fingerprint::FieldRead;
use crate::Outputs;

/// A value a statement reads, before its level is picked.
pub struct Read<'a, T: ?Sized>(Level2<'a, T>);
/// Level 2 of [`Read`].
pub struct Level2<'a, T: ?Sized>(Level3<'a, T>);
/// Level 3 of [`Read`].
pub struct Level3<'a, T: ?Sized>(Level4<'a, T>);
/// Level 4 of [`Read`].
pub struct Level4<'a, T: ?Sized>(&'a T);

/// The value `x` a statement reads.
pub fn read<T: ?Sized>(x: &T) -> Read<'_, T> {
    Read(Level2(Level3(Level4(x))))
}

impl<'a, T: ?Sized> Deref for Read<'a, T> {
    type Target = Level2<'a, T>;
    fn deref(&self) -> &Level2<'a, T> {
        &self.0
    }
}
impl<'a, T: ?Sized> Deref for Level2<'a, T> {
    type Target = Level3<'a, T>;
    fn deref(&self) -> &Level3<'a, T> {
        &self.0
    }
}
impl<'a, T: ?Sized> Deref for Level3<'a, T> {
    type Target = Level4<'a, T>;
    fn deref(&self) -> &Level4<'a, T> {
        &self.0
    }
}

/// A parameter of a block, before its level is picked: the region keeps
/// its own copy until the backward, which may run on another thread, so
/// only `Send + Sync + 'static` values are taken, through their tensors
/// ([`ParamTensors`]) or cloned ([`ParamClone`]); any other (an `Rc`, a
/// `Cell`) is reported by the macro's [`crate::rules::Parameter`] check
/// where it is declared, and gets a stand-in here ([`ParamFailed`]), so
/// that the mistake is one error.
pub struct Param<'a, T: ?Sized>(ParamLevel2<'a, T>);
/// Level 2 of [`Param`].
pub struct ParamLevel2<'a, T: ?Sized>(ParamLevel3<'a, T>);
/// Level 3 of [`Param`].
pub struct ParamLevel3<'a, T: ?Sized>(&'a T);

/// The parameter `x` the region keeps.
pub fn param<T: ?Sized>(x: &T) -> Param<'_, T> {
    Param(ParamLevel2(ParamLevel3(x)))
}

impl<'a, T: ?Sized> Deref for Param<'a, T> {
    type Target = ParamLevel2<'a, T>;
    fn deref(&self) -> &ParamLevel2<'a, T> {
        &self.0
    }
}
impl<'a, T: ?Sized> Deref for ParamLevel2<'a, T> {
    type Target = ParamLevel3<'a, T>;
    fn deref(&self) -> &ParamLevel3<'a, T> {
        &self.0
    }
}

/// Level 1 of [`Param`]: values made of tensors.
pub trait ParamTensors<T> {
    /// The value, kept through its tensors.
    fn arg(&self) -> Tensors<T>;
}
impl<T: Outputs + Clone + Send + Sync + 'static> ParamTensors<T> for Param<'_, T> {
    fn arg(&self) -> Tensors<T> {
        Tensors(self.0 .0 .0.clone())
    }
}

/// Level 2 of [`Param`]: other values, cloned.
pub trait ParamClone<T> {
    /// A clone of the value.
    fn arg(&self) -> Cloned<T>;
}
impl<T: Clone + Send + Sync + 'static> ParamClone<T> for ParamLevel2<'_, T> {
    fn arg(&self) -> Cloned<T> {
        Cloned(self.0 .0.clone())
    }
}

/// Level 3 of [`Param`]: a value the region cannot keep, reported where
/// it is declared; never run.
pub trait ParamFailed<T> {
    /// Stands for the value.
    fn arg(&self) -> Failed<T>;
}
impl<T> ParamFailed<T> for ParamLevel3<'_, T> {
    fn arg(&self) -> Failed<T> {
        Failed::new()
    }
}

/// A value made of tensors, read through its tensors.
pub struct Tensors<T>(pub T);
/// A plain value, cloned.
pub struct Cloned<T>(pub T);
/// The tensors held in a field a block reads (none when the field holds
/// no tensor: a module, a number): `rt::read(&self.mask).field(..)`.
pub struct Field(pub(crate) Vec<FieldRead>);
/// A value that cannot be read (a compile error elsewhere); never rebuilt.
pub struct Failed<T>(PhantomData<fn() -> T>);

impl<T> Failed<T> {
    pub(crate) fn new() -> Self {
        Failed(PhantomData)
    }
}

/// How a `mut` binding a statement changed is given back, as part of its
/// value ([`Given`]): through its tensors, as a plain value, or (a value
/// reported at compile time) not at all.
pub struct AsTensors;
/// See [`AsTensors`].
pub struct AsClone;
/// See [`AsTensors`].
pub struct AsNothing;

/// A `mut` binding a statement changed, given back with its value:
/// `rt::Given(rt::read(&h).how(), h)`.
pub struct Given<How, T>(pub How, pub T);

/// Level 1: values made of tensors.
pub trait ByTensors<T> {
    /// The value, read through its tensors.
    fn arg(&self) -> Tensors<T>;
    /// Given back through its tensors.
    fn how(&self) -> AsTensors {
        AsTensors
    }
    /// Read from the field `field` by `statement` first: its tensors.
    fn field(&self, field: &'static str, statement: &'static str) -> Field;
}
impl<T: Outputs + Clone> ByTensors<T> for Read<'_, T> {
    fn arg(&self) -> Tensors<T> {
        Tensors(self.0 .0 .0 .0.clone())
    }
    fn field(&self, field: &'static str, statement: &'static str) -> Field {
        let mut tensors = Vec::new();
        self.0 .0 .0 .0.clone().split_into(&mut tensors);
        Field(
            tensors
                .into_iter()
                .map(|tensor| FieldRead {
                    tensor,
                    field,
                    statement,
                })
                .collect(),
        )
    }
}

/// Level 2: a `Result` (a missing `?`, reported where it was made).
pub trait FromResult<T> {
    /// Stands for the `Ok` value.
    fn arg(&self) -> Failed<T>;
    /// Never given back.
    fn how(&self) -> AsNothing {
        AsNothing
    }
    /// Read from a field: it holds no tensor of its own.
    fn field(&self, _: &'static str, _: &'static str) -> Field {
        Field(Vec::new())
    }
}
impl<T, E> FromResult<T> for Level2<'_, Result<T, E>> {
    fn arg(&self) -> Failed<T> {
        Failed::new()
    }
}

/// Level 3: other `Clone` values.
pub trait ByClone<T> {
    /// A clone of the value.
    fn arg(&self) -> Cloned<T>;
    /// Given back as a plain value.
    fn how(&self) -> AsClone {
        AsClone
    }
    /// Read from a field: it holds no tensor of its own.
    fn field(&self, _: &'static str, _: &'static str) -> Field {
        Field(Vec::new())
    }
}
impl<T: Clone> ByClone<T> for Level3<'_, T> {
    fn arg(&self) -> Cloned<T> {
        Cloned(self.0 .0.clone())
    }
}

/// Level 4: values that are not `Clone`, reported by the macro's
/// [`crate::rules::Readable`] check where they are read.
pub trait NotClone<T> {
    /// Stands for the value.
    fn arg(&self) -> Failed<T>;
    /// Never given back.
    fn how(&self) -> AsNothing {
        AsNothing
    }
    /// Read from a field: it holds no tensor of its own.
    fn field(&self, _: &'static str, _: &'static str) -> Field {
        Field(Vec::new())
    }
}
impl<T> NotClone<T> for Level4<'_, T> {
    fn arg(&self) -> Failed<T> {
        Failed::new()
    }
}
