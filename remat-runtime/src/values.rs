//! The values statements and regions take and give: [`Inputs`], the tensors
//! a statement reads, and [`Outputs`], a value built of tensors and plain
//! parts that a statement or a region returns.
//!
//! `Outputs` is also how `remat!` hands a binding to a later statement: every
//! binding a statement reads is an earlier statement's output (or a
//! parameter), split into its tensors (the statement's inputs) and rebuilt
//! from what the runtime hands back.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash};
use std::rc::Rc;
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};

use crate::{RematError, Result};

/// The tensor inputs of a statement: `&[&a, &b]`, a slice of references, or
/// a `Vec<Tensor>` (what the `remat!` macro builds).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use remat_runtime::Inputs;
/// let t = Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu)?;
/// assert_eq!((&[&t, &t]).into_tensors().len(), 2);
/// assert_eq!(vec![t.clone()].into_tensors().len(), 1);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub trait Inputs {
    /// The input tensors, in order.
    fn into_tensors(self) -> Vec<Tensor>;
}

impl Inputs for &[&Tensor] {
    fn into_tensors(self) -> Vec<Tensor> {
        self.iter().map(|t| (*t).clone()).collect()
    }
}

impl<const N: usize> Inputs for &[&Tensor; N] {
    fn into_tensors(self) -> Vec<Tensor> {
        self.iter().map(|t| (*t).clone()).collect()
    }
}

impl Inputs for Vec<Tensor> {
    fn into_tensors(self) -> Vec<Tensor> {
        self
    }
}

impl Inputs for &Vec<&Tensor> {
    fn into_tensors(self) -> Vec<Tensor> {
        self.iter().map(|t| (*t).clone()).collect()
    }
}

impl Inputs for &[Tensor] {
    fn into_tensors(self) -> Vec<Tensor> {
        self.to_vec()
    }
}

/// A value made of tensors and plain data that a statement or a region can
/// return: a [`Tensor`]; `Vec`s, arrays, `Option`s, tuples, `Box`es,
/// `Arc`s, `Rc`s, `HashMap`s and `BTreeMap`s of such values; and plain
/// values (`usize`, `f64`, [`Shape`], ...) that carry no tensor.
///
/// The runtime splits a value into its tensors and a *skeleton* (the plain
/// data and the structure), and can rebuild it from new tensors and the
/// skeleton. This is how a saved statement returns placeholders during replay
/// without running.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use remat_runtime::Outputs;
/// let t = Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu)?;
/// let mut tensors = Vec::new();
/// let skeleton = (t, 3usize).split_into(&mut tensors);
/// assert_eq!(tensors.len(), 1);
/// let (u, n) = <(Tensor, usize)>::join(&mut tensors.into_iter(), &skeleton)?;
/// assert_eq!((u.dims(), n), (&[2][..], 3));
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the value of a remat statement or region",
    label = "this value is a statement's output",
    note = "statements return tensors, `Vec<Tensor>`, tuples of them, or plain values such as `usize` and `Shape`; clone a borrowed tensor (`x.clone()`) instead of returning a reference; a struct of your own: add `#[derive(remat_runtime::Outputs)]` to it (a field of it that is not `Outputs`, such as a module: `#[outputs(plain)]`)"
)]
pub trait Outputs: Sized {
    /// The plain data and structure of the value.
    type Skeleton: Clone + Send + Sync + 'static;

    /// Moves the tensors of `self`, in order, to `tensors` and returns the rest.
    fn split_into(self, tensors: &mut Vec<Tensor>) -> Self::Skeleton;

    /// Rebuilds a value from tensors (taken in the order `split_into` gave
    /// them) and a skeleton.
    fn join(tensors: &mut dyn Iterator<Item = Tensor>, skeleton: &Self::Skeleton) -> Result<Self>;
}

fn missing() -> RematError {
    candle_core::Error::Msg(
        "remat internal error: fewer tensors than the value's structure needs".into(),
    )
    .into()
}

impl Outputs for Tensor {
    type Skeleton = ();
    fn split_into(self, tensors: &mut Vec<Tensor>) {
        tensors.push(self);
    }
    fn join(tensors: &mut dyn Iterator<Item = Tensor>, _: &()) -> Result<Self> {
        tensors.next().ok_or_else(missing)
    }
}

impl<T: Outputs> Outputs for Vec<T> {
    type Skeleton = Vec<T::Skeleton>;
    fn split_into(self, tensors: &mut Vec<Tensor>) -> Self::Skeleton {
        self.into_iter().map(|v| v.split_into(tensors)).collect()
    }
    fn join(tensors: &mut dyn Iterator<Item = Tensor>, s: &Self::Skeleton) -> Result<Self> {
        s.iter().map(|s| T::join(tensors, s)).collect()
    }
}

impl<T: Outputs> Outputs for Option<T> {
    type Skeleton = Option<T::Skeleton>;
    fn split_into(self, tensors: &mut Vec<Tensor>) -> Self::Skeleton {
        self.map(|v| v.split_into(tensors))
    }
    fn join(tensors: &mut dyn Iterator<Item = Tensor>, s: &Self::Skeleton) -> Result<Self> {
        s.as_ref().map(|s| T::join(tensors, s)).transpose()
    }
}

impl<T: Outputs> Outputs for Box<T> {
    type Skeleton = T::Skeleton;
    fn split_into(self, tensors: &mut Vec<Tensor>) -> Self::Skeleton {
        (*self).split_into(tensors)
    }
    fn join(tensors: &mut dyn Iterator<Item = Tensor>, s: &Self::Skeleton) -> Result<Self> {
        T::join(tensors, s).map(Box::new)
    }
}

/// A shared value (`Arc<Tensor>`, an `Arc` of a table): split from a clone
/// of what it points to where others share it (a tensor's clone shares its
/// storage), rebuilt as a new `Arc`.
impl<T: Outputs + Clone> Outputs for Arc<T> {
    type Skeleton = T::Skeleton;
    fn split_into(self, tensors: &mut Vec<Tensor>) -> Self::Skeleton {
        Arc::unwrap_or_clone(self).split_into(tensors)
    }
    fn join(tensors: &mut dyn Iterator<Item = Tensor>, s: &Self::Skeleton) -> Result<Self> {
        T::join(tensors, s).map(Arc::new)
    }
}

/// As `Arc<T>`.
impl<T: Outputs + Clone> Outputs for Rc<T> {
    type Skeleton = T::Skeleton;
    fn split_into(self, tensors: &mut Vec<Tensor>) -> Self::Skeleton {
        Rc::unwrap_or_clone(self).split_into(tensors)
    }
    fn join(tensors: &mut dyn Iterator<Item = Tensor>, s: &Self::Skeleton) -> Result<Self> {
        T::join(tensors, s).map(Rc::new)
    }
}

impl<T: Outputs, const N: usize> Outputs for [T; N] {
    type Skeleton = Vec<T::Skeleton>;
    fn split_into(self, tensors: &mut Vec<Tensor>) -> Self::Skeleton {
        self.into_iter().map(|v| v.split_into(tensors)).collect()
    }
    fn join(tensors: &mut dyn Iterator<Item = Tensor>, s: &Self::Skeleton) -> Result<Self> {
        let values = s
            .iter()
            .map(|s| T::join(tensors, s))
            .collect::<Result<Vec<T>>>()?;
        values.try_into().map_err(|_| missing())
    }
}

/// A map of values (`HashMap<String, Tensor>`): its tensors in the order
/// of its keys (not the map's own order, which differs from one map to the
/// next: the replay's map must give its tensors in the forward's order),
/// its keys in the skeleton.
impl<K, V, S> Outputs for HashMap<K, V, S>
where
    K: Ord + Hash + Clone + Send + Sync + 'static,
    V: Outputs,
    S: BuildHasher + Default,
{
    type Skeleton = Vec<(K, V::Skeleton)>;
    fn split_into(self, tensors: &mut Vec<Tensor>) -> Self::Skeleton {
        let mut entries: Vec<(K, V)> = self.into_iter().collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries
            .into_iter()
            .map(|(k, v)| (k, v.split_into(tensors)))
            .collect()
    }
    fn join(tensors: &mut dyn Iterator<Item = Tensor>, s: &Self::Skeleton) -> Result<Self> {
        s.iter()
            .map(|(k, s)| Ok((k.clone(), V::join(tensors, s)?)))
            .collect()
    }
}

/// As `HashMap<K, V>`, in the keys' order.
impl<K, V> Outputs for BTreeMap<K, V>
where
    K: Ord + Clone + Send + Sync + 'static,
    V: Outputs,
{
    type Skeleton = Vec<(K, V::Skeleton)>;
    fn split_into(self, tensors: &mut Vec<Tensor>) -> Self::Skeleton {
        self.into_iter()
            .map(|(k, v)| (k, v.split_into(tensors)))
            .collect()
    }
    fn join(tensors: &mut dyn Iterator<Item = Tensor>, s: &Self::Skeleton) -> Result<Self> {
        s.iter()
            .map(|(k, s)| Ok((k.clone(), V::join(tensors, s)?)))
            .collect()
    }
}

/// Calls `$m!` with the plain values of [`Outputs`] (values that carry no
/// tensor): one list, which the `#[save]` check (`private/saved.rs`) reads
/// too.
macro_rules! for_plain_values {
    ($m:ident) => {
        $m!(
            (),
            bool,
            char,
            u8,
            u16,
            u32,
            u64,
            usize,
            i8,
            i16,
            i32,
            i64,
            isize,
            f32,
            f64,
            Shape,
            String,
            DType,
            Device
        );
    };
}
pub(crate) use for_plain_values;

macro_rules! plain_outputs {
    ($($t:ty),*) => {$(
        impl Outputs for $t {
            type Skeleton = $t;
            fn split_into(self, _: &mut Vec<Tensor>) -> $t {
                self
            }
            fn join(_: &mut dyn Iterator<Item = Tensor>, s: &$t) -> Result<Self> {
                Ok(s.clone())
            }
        }
    )*};
}
for_plain_values!(plain_outputs);

macro_rules! tuple_outputs {
    ($($name:ident),+) => {
        impl<$($name: Outputs),+> Outputs for ($($name,)+) {
            type Skeleton = ($($name::Skeleton,)+);
            #[allow(non_snake_case)]
            fn split_into(self, tensors: &mut Vec<Tensor>) -> Self::Skeleton {
                let ($($name,)+) = self;
                ($($name.split_into(tensors),)+)
            }
            #[allow(non_snake_case)]
            fn join(tensors: &mut dyn Iterator<Item = Tensor>, s: &Self::Skeleton) -> Result<Self> {
                let ($($name,)+) = s;
                Ok(($(<$name as Outputs>::join(tensors, $name)?,)+))
            }
        }
    };
}
tuple_outputs!(A);
tuple_outputs!(A, B);
tuple_outputs!(A, B, C);
tuple_outputs!(A, B, C, D);
tuple_outputs!(A, B, C, D, E);
tuple_outputs!(A, B, C, D, E, F);
