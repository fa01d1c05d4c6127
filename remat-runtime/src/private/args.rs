//! What a statement reads, as one tuple of [`Arg`]s: split into the
//! statement's input tensors, and rebuilt from the tensors the runtime
//! hands the statement (in the replay, its own leaves).

use candle_core::Tensor;

use super::read::{Cloned, Failed, Field, Tensors};
use crate::graph::Reach;
use crate::tape::fingerprint::FieldRead;
use crate::{Outputs, Result};

/// The tensors of what a statement reads, as [`Arg::push`] lays them out.
#[derive(Default)]
pub struct Split {
    /// Those read for their values.
    pub values: Vec<Tensor>,
    /// Those read only for their shapes, or detached.
    pub others: Vec<Tensor>,
    /// Values among `values` read only in part, or only on a branch.
    pub(crate) reach: Vec<Reach>,
    /// Tensors a block reads from fields of its parameters (`self.mask`).
    pub(crate) fields: Vec<FieldRead>,
    /// Per value, in order: where its tensors end among `values`.
    pub(crate) ends: Vec<usize>,
}

impl Arg for Field {
    type Value = ();
    fn push(&self, into: &mut Split) {
        into.fields.extend(self.0.iter().cloned());
    }
    fn rebuild(
        &self,
        _: &mut dyn Iterator<Item = Tensor>,
        _: &mut dyn Iterator<Item = Tensor>,
    ) -> Result<()> {
        Ok(())
    }
}

/// One value a statement reads.
pub trait Arg {
    /// The value the statement sees.
    type Value;
    /// Appends the value's tensors: to `values` if the statement reads them
    /// for their values, else to `others`.
    fn push(&self, into: &mut Split);
    /// The value, with its tensors taken from `values` and `others` in the
    /// order [`Arg::push`] gave them.
    fn rebuild(
        &self,
        values: &mut dyn Iterator<Item = Tensor>,
        others: &mut dyn Iterator<Item = Tensor>,
    ) -> Result<Self::Value>;

    /// The value is read only for its shape, dtype or device, or detached:
    /// no gradient flows through this read.
    fn without_grad(self) -> WithoutGrad<Self>
    where
        Self: Sized,
    {
        WithoutGrad(self)
    }

    /// The value is read for its values only in part (`parts[0]`,
    /// `pair.0`, `xs.first()`): one of its tensors reached by the
    /// statement's graph is enough ([`crate::RematError::InputCut`]).
    fn partly(self) -> Partly<Self>
    where
        Self: Sized,
    {
        Partly(self)
    }

    /// The value is read for its values only on some branches of the
    /// statement (`if skip { (h + x)? } else { h }`): the statement's
    /// graph need not reach it ([`crate::RematError::InputCut`]).
    fn on_branch(self) -> OnBranch<Self>
    where
        Self: Sized,
    {
        OnBranch(self)
    }
}

impl<T: Outputs + Clone> Arg for Tensors<T> {
    type Value = T;
    fn push(&self, into: &mut Split) {
        self.0.clone().split_into(&mut into.values);
    }
    fn rebuild(
        &self,
        values: &mut dyn Iterator<Item = Tensor>,
        _: &mut dyn Iterator<Item = Tensor>,
    ) -> Result<T> {
        let skeleton = self.0.clone().split_into(&mut Vec::new());
        T::join(values, &skeleton)
    }
}

impl<T: Clone> Arg for Cloned<T> {
    type Value = T;
    fn push(&self, _: &mut Split) {}
    fn rebuild(
        &self,
        _: &mut dyn Iterator<Item = Tensor>,
        _: &mut dyn Iterator<Item = Tensor>,
    ) -> Result<T> {
        Ok(self.0.clone())
    }
}

impl<T> Arg for Failed<T> {
    type Value = T;
    fn push(&self, _: &mut Split) {}
    fn rebuild(
        &self,
        _: &mut dyn Iterator<Item = Tensor>,
        _: &mut dyn Iterator<Item = Tensor>,
    ) -> Result<T> {
        Err(super::error(
            "a statement of a remat! block read a value it cannot copy".into(),
        ))
    }
}

/// An [`Arg`] read without gradient: see [`Arg::without_grad`].
pub struct WithoutGrad<A>(A);

impl<A: Arg> Arg for WithoutGrad<A> {
    type Value = A::Value;
    fn push(&self, into: &mut Split) {
        let mut inner = Split::default();
        self.0.push(&mut inner);
        // Swapped, as `rebuild` takes them.
        into.others.extend(inner.values);
        into.values.extend(inner.others);
    }
    fn rebuild(
        &self,
        values: &mut dyn Iterator<Item = Tensor>,
        others: &mut dyn Iterator<Item = Tensor>,
    ) -> Result<A::Value> {
        self.0.rebuild(others, values)
    }
}

/// An [`Arg`] read in part: see [`Arg::partly`].
pub struct Partly<A>(A);

impl<A: Arg> Arg for Partly<A> {
    type Value = A::Value;
    fn push(&self, into: &mut Split) {
        let start = into.values.len();
        self.0.push(into);
        if into.values.len() > start + 1 {
            into.reach.push(Reach::OneOf(start..into.values.len()));
        }
    }
    fn rebuild(
        &self,
        values: &mut dyn Iterator<Item = Tensor>,
        others: &mut dyn Iterator<Item = Tensor>,
    ) -> Result<A::Value> {
        self.0.rebuild(values, others)
    }
}

/// An [`Arg`] read on a branch: see [`Arg::on_branch`].
pub struct OnBranch<A>(A);

impl<A: Arg> Arg for OnBranch<A> {
    type Value = A::Value;
    fn push(&self, into: &mut Split) {
        let start = into.values.len();
        self.0.push(into);
        if into.values.len() > start {
            into.reach.push(Reach::NoneOf(start..into.values.len()));
        }
    }
    fn rebuild(
        &self,
        values: &mut dyn Iterator<Item = Tensor>,
        others: &mut dyn Iterator<Item = Tensor>,
    ) -> Result<A::Value> {
        self.0.rebuild(values, others)
    }
}

/// Everything a statement reads: a tuple of [`Arg`]s (nested when longer
/// than 12).
pub trait Args {
    /// The values the statement sees.
    type Values;
    /// Appends the tensors of every value (see [`Arg::push`]).
    fn push(&self, into: &mut Split);
    /// The values, rebuilt (see [`Arg::rebuild`]).
    fn rebuild(
        &self,
        values: &mut dyn Iterator<Item = Tensor>,
        others: &mut dyn Iterator<Item = Tensor>,
    ) -> Result<Self::Values>;

    /// The input tensors, those read for their values first, how many
    /// those are, and what of the values read in part or on a branch the
    /// statement must reach.
    fn tensors(&self) -> (Vec<Tensor>, usize, Vec<Reach>) {
        let mut split = Split::default();
        self.push(&mut split);
        let n = split.values.len();
        split.values.extend(split.others);
        (split.values, n, split.reach)
    }

    /// The input tensors, as [`Args::tensors`] gives them, and the name of
    /// the value holding each (`names`: the values', in order).
    fn named_tensors(&self, names: &[&'static str]) -> (Vec<Tensor>, Vec<Option<&'static str>>) {
        let mut split = Split::default();
        self.push(&mut split);
        let named: Vec<Option<&'static str>> = (0..split.values.len())
            .map(|i| {
                let value = split.ends.iter().position(|&end| i < end);
                value.and_then(|v| names.get(v)).copied()
            })
            .chain(split.others.iter().map(|_| None))
            .collect();
        split.values.extend(split.others);
        (split.values, named)
    }

    /// Which value (its position among the values read) holds the tensor
    /// at `input` among those read for their values.
    fn value_of(&self, input: usize) -> Option<usize> {
        let mut split = Split::default();
        self.push(&mut split);
        split.ends.iter().position(|&end| input < end)
    }

    /// The values rebuilt from `tensors`, laid out as [`Args::tensors`]
    /// gave them.
    fn values_from(&self, tensors: &[Tensor], n_values: usize) -> Result<Self::Values> {
        let n = n_values.min(tensors.len());
        let mut values = tensors[..n].iter().cloned();
        let mut others = tensors[n..].iter().cloned();
        self.rebuild(&mut values, &mut others)
    }
}

impl<A: Arg> Args for A {
    type Values = A::Value;
    fn push(&self, into: &mut Split) {
        Arg::push(self, into);
        into.ends.push(into.values.len());
    }
    fn rebuild(
        &self,
        values: &mut dyn Iterator<Item = Tensor>,
        others: &mut dyn Iterator<Item = Tensor>,
    ) -> Result<Self::Values> {
        Arg::rebuild(self, values, others)
    }
}

macro_rules! tuple_args {
    ($($name:ident),*) => {
        impl<$($name: Args),*> Args for ($($name,)*) {
            type Values = ($($name::Values,)*);
            #[allow(non_snake_case, unused_variables)]
            fn push(&self, into: &mut Split) {
                let ($($name,)*) = self;
                $($name.push(into);)*
            }
            #[allow(non_snake_case, unused_variables)]
            fn rebuild(
                &self,
                values: &mut dyn Iterator<Item = Tensor>,
                others: &mut dyn Iterator<Item = Tensor>,
            ) -> Result<Self::Values> {
                let ($($name,)*) = self;
                Ok(($($name.rebuild(values, others)?,)*))
            }
        }
    };
}
tuple_args!();
tuple_args!(A);
tuple_args!(A, B);
tuple_args!(A, B, C);
tuple_args!(A, B, C, D);
tuple_args!(A, B, C, D, E);
tuple_args!(A, B, C, D, E, F);
tuple_args!(A, B, C, D, E, F, G);
tuple_args!(A, B, C, D, E, F, G, H);
tuple_args!(A, B, C, D, E, F, G, H, I);
tuple_args!(A, B, C, D, E, F, G, H, I, J);
tuple_args!(A, B, C, D, E, F, G, H, I, J, K);
tuple_args!(A, B, C, D, E, F, G, H, I, J, K, L);
