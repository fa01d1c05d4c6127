//! [`BatchNorm`]: candle-nn's batch norm, whose running statistics change
//! once per training step even when its forward runs again in a replay.

use candle_core::{ModuleT, Result, Tensor, Var};
use candle_nn::{BatchNormConfig, VarBuilder};

use crate::in_replay;

/// candle-nn's `BatchNorm`, the same values, for layers that checkpointing
/// runs twice per step. In training, candle-nn's `forward_t` writes the
/// running mean and variance in place (`Var::set`); a layer in a
/// checkpointed block or a [`Checkpointed`](crate::Checkpointed) runs again
/// when its region replays, so candle-nn's statistics would be updated
/// twice per step, silently. This one computes the same output in the
/// replay and leaves the statistics as the forward left them
/// ([`in_replay`]).
///
/// ```
/// use candle_core::{DType, Device, ModuleT, Var};
/// use candle_nn::{VarBuilder, VarMap};
/// use remat_runtime::candle_nn::batch_norm;
/// use remat_runtime::Checkpointed;
///
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu);
/// let bn = Checkpointed::new("bn", batch_norm(2, 1e-5, vb)?);
/// let x = Var::from_slice(&[1.0f64, 2.0, 3.0, 4.0], (2, 2), &Device::Cpu)?;
/// let y = bn.forward_t(x.as_tensor(), true)?;
/// (y * x.as_tensor())?.sum_all()?.backward()?; // replays the layer
/// // One update from zero with momentum 0.1: 0.1 x the batch means (2, 3).
/// let mean = bn.layer().running_mean().to_vec1::<f64>()?;
/// assert!((mean[0] - 0.2).abs() < 1e-12 && (mean[1] - 0.3).abs() < 1e-12);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct BatchNorm(candle_nn::BatchNorm);

impl BatchNorm {
    /// The running mean.
    ///
    /// ```
    /// # use candle_core::{DType, Device, Tensor};
    /// let (m, v) = (Tensor::zeros(3, DType::F32, &Device::Cpu)?, Tensor::ones(3, DType::F32, &Device::Cpu)?);
    /// let bn = remat_runtime::candle_nn::BatchNorm::from(candle_nn::BatchNorm::new_no_bias(3, m, v, 1e-5)?);
    /// assert_eq!(bn.running_mean().dims(), [3]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn running_mean(&self) -> &Tensor {
        self.0.running_mean()
    }

    /// The running variance.
    ///
    /// ```
    /// # use candle_core::{DType, Device, Tensor};
    /// let (m, v) = (Tensor::zeros(3, DType::F32, &Device::Cpu)?, Tensor::ones(3, DType::F32, &Device::Cpu)?);
    /// let bn = remat_runtime::candle_nn::BatchNorm::from(candle_nn::BatchNorm::new_no_bias(3, m, v, 1e-5)?);
    /// assert_eq!(bn.running_var().to_vec1::<f32>()?, [1.0; 3]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn running_var(&self) -> &Tensor {
        self.0.running_var()
    }

    /// The layer as candle-nn's.
    ///
    /// ```
    /// # use candle_core::{DType, Device, Tensor};
    /// let (m, v) = (Tensor::zeros(3, DType::F32, &Device::Cpu)?, Tensor::ones(3, DType::F32, &Device::Cpu)?);
    /// let bn = remat_runtime::candle_nn::BatchNorm::from(candle_nn::BatchNorm::new_no_bias(3, m, v, 1e-5)?);
    /// assert_eq!(bn.inner().eps(), 1e-5);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn inner(&self) -> &candle_nn::BatchNorm {
        &self.0
    }
}

impl From<candle_nn::BatchNorm> for BatchNorm {
    fn from(inner: candle_nn::BatchNorm) -> Self {
        BatchNorm(inner)
    }
}

impl ModuleT for BatchNorm {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        if !(train && in_replay()) {
            return self.0.forward_t(xs, train);
        }
        // candle-nn's forward writes the statistics through the variables
        // it holds; these handles share them: put back what it wrote.
        let mean = Var::from_tensor(self.0.running_mean())?;
        let var = Var::from_tensor(self.0.running_var())?;
        let before = (mean.as_tensor().copy()?, var.as_tensor().copy()?);
        let ys = self.0.forward_t(xs, true);
        mean.set(&before.0)?;
        var.set(&before.1)?;
        ys
    }
}

/// candle-nn's `batch_norm` (the same variables, under the same names), as
/// a [`BatchNorm`] whose running statistics change once per step.
///
/// ```
/// use candle_core::{DType, Device, ModuleT, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let bn = remat_runtime::candle_nn::batch_norm(4, 1e-5, vb.pp("bn"))?;
/// let y = bn.forward_t(&Tensor::ones((2, 4, 3), DType::F32, &Device::Cpu)?, false)?;
/// assert_eq!(y.dims(), [2, 4, 3]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn batch_norm<C: Into<BatchNormConfig>>(
    num_features: usize,
    config: C,
    vb: VarBuilder,
) -> Result<BatchNorm> {
    candle_nn::batch_norm(num_features, config, vb).map(BatchNorm)
}
