//! The tensors a statement reads.

use candle_core::Tensor;

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
