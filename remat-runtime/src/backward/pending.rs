//! Which variables region calls still need: for each variable (a parameter,
//! or an input that is one), the number of live region calls that read it
//! and whose backward has not finished.
//! [`OptimizerInBackward`](super::OptimizerInBackward) updates a parameter
//! only once that number is zero.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::{Tensor, TensorId};

use crate::lock;

fn counts() -> &'static Mutex<HashMap<TensorId, usize>> {
    static COUNTS: OnceLock<Mutex<HashMap<TensorId, usize>>> = OnceLock::new();
    COUNTS.get_or_init(Default::default)
}

/// A region call's claim on the parameters it read, from its forward until
/// its backward has handed their gradients over (or until it is dropped).
pub(crate) struct Pending(Vec<TensorId>);

impl Pending {
    pub fn new<'a>(variables: impl IntoIterator<Item = &'a Tensor>) -> Self {
        let ids: Vec<TensorId> = variables.into_iter().map(Tensor::id).collect();
        let mut counts = lock(counts());
        for id in &ids {
            *counts.entry(*id).or_insert(0) += 1;
        }
        Pending(ids)
    }

    /// The parameters it claims.
    pub fn ids(&self) -> &[TensorId] {
        &self.0
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut counts = lock(counts());
        for id in &self.0 {
            if let Some(n) = counts.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    counts.remove(id);
                }
            }
        }
    }
}

/// Whether a live region call still needs parameter `id`.
pub(crate) fn is_pending(id: TensorId) -> bool {
    lock(counts()).contains_key(&id)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;

    #[test]
    fn a_parameter_is_pending_while_a_claim_on_it_lives() {
        let v = Var::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let t = v.as_tensor().clone();
        assert!(!is_pending(t.id()));
        let first = Pending::new([&t]);
        let second = Pending::new([&t]);
        drop(first);
        assert!(is_pending(t.id()));
        drop(second);
        assert!(!is_pending(t.id()));
    }
}
