//! A `mut` binding that a statement changed is given back as part of the
//! statement's value, `(value, rt::Given(rt::read(&h).how(), h))`: values
//! made of tensors through their tensors (the statement's outputs), other
//! `Clone` values (a layer, a list of names) as plain data.

use candle_core::Tensor;

use super::read::{AsClone, AsNothing, AsTensors, Given};
use crate::{Outputs, Result};

impl<T: Outputs> Outputs for Given<AsTensors, T> {
    type Skeleton = T::Skeleton;
    fn split_into(self, tensors: &mut Vec<Tensor>) -> Self::Skeleton {
        self.1.split_into(tensors)
    }
    fn join(tensors: &mut dyn Iterator<Item = Tensor>, skeleton: &Self::Skeleton) -> Result<Self> {
        Ok(Given(AsTensors, T::join(tensors, skeleton)?))
    }
}

impl<T: Clone + Send + Sync + 'static> Outputs for Given<AsClone, T> {
    type Skeleton = T;
    fn split_into(self, _: &mut Vec<Tensor>) -> T {
        self.1
    }
    fn join(_: &mut dyn Iterator<Item = Tensor>, skeleton: &T) -> Result<Self> {
        Ok(Given(AsClone, skeleton.clone()))
    }
}

/// A value reported at compile time (a `Result`, or not `Clone`): a program
/// holding one does not compile, so this never runs.
impl<T> Outputs for Given<AsNothing, T> {
    type Skeleton = ();
    fn split_into(self, _: &mut Vec<Tensor>) {}
    fn join(_: &mut dyn Iterator<Item = Tensor>, _: &()) -> Result<Self> {
        Err(super::error(
            "a statement of a remat! block gave back a value it cannot copy".into(),
        ))
    }
}
