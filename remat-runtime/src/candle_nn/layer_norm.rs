//! `candle_nn::layer_norm`'s `LayerNorm` and `RmsNorm`, whose forward has
//! a backward on every input: candle's call the fused, backward-less
//! `ops::layer_norm` / `ops::rms_norm` when the input is contiguous, which
//! it nearly always is.
//!
//! The builders take a `VarBuilder` exactly as candle's do (they call
//! candle's, so the tensor names, the `gamma`/`beta` aliases and the
//! initial values are candle's): with a `VarMap`, the gains and biases are
//! its `Var`s and train.
//!
//! ```
//! use candle_core::{DType, Device, Module, Var};
//! use candle_nn::{VarBuilder, VarMap};
//! use remat_runtime::candle_nn::{layer_norm, LayerNormConfig};
//!
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let ln = layer_norm(8, LayerNormConfig::default(), vb.pp("ln"))?; // "ln.weight", "ln.bias"
//! let x = Var::randn(0f32, 1.0, (2, 8), &Device::Cpu)?;
//! let grads = ln.forward(&x)?.sqr()?.sum_all()?.backward()?;
//! assert_eq!(varmap.all_vars().iter().filter(|v| grads.get(v).is_some()).count(), 2);
//! # Ok::<(), candle_core::Error>(())
//! ```

use ::candle_nn::VarBuilder;
use candle_core::{Module, Result, Tensor};

use super::ops::{check_norm, norm};

/// The configuration of [`layer_norm`]: candle-nn's own type (`eps`,
/// `remove_mean`, `affine`; `From<f64>` for an `eps`).
pub use ::candle_nn::LayerNormConfig;

/// `candle_nn::LayerNorm` with a backward: a layer norm over the last
/// dimension (an RMS norm if built with [`LayerNorm::rms_norm`] or a config
/// with `remove_mean: false`), gain `weight`, optional `bias`. Its forward is
/// [`ops::layer_norm`](super::ops::layer_norm) / [`ops::rms_norm`](super::ops::rms_norm)
/// whatever the input's layout.
///
/// ```
/// use candle_core::{Device, Module, Tensor};
/// use remat_runtime::candle_nn::LayerNorm;
/// let w = Tensor::new(&[1f32, 1., 1.], &Device::Cpu)?;
/// let b = Tensor::new(&[0f32, 0., 0.], &Device::Cpu)?;
/// let ln = LayerNorm::new(w, b, 1e-5);
/// let y = ln.forward(&Tensor::new(&[[1f32, 2., 3.]], &Device::Cpu)?)?;
/// let y = y.to_vec2::<f32>()?;
/// assert!((y[0][0] + 1.2247).abs() < 1e-4 && y[0][1].abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    remove_mean: bool,
    eps: f64,
}

impl LayerNorm {
    /// A layer norm with gain `weight` and bias `bias`, as candle-nn's.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let dev = Device::Cpu;
    /// let ln = remat_runtime::candle_nn::LayerNorm::new(
    ///     Tensor::ones(4, DType::F32, &dev)?, Tensor::zeros(4, DType::F32, &dev)?, 1e-5);
    /// assert!(ln.remove_mean() && ln.bias().is_some());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias: Some(bias),
            remove_mean: true,
            eps,
        }
    }

    /// A layer norm with gain `weight` and no bias, as candle-nn's.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let ln = remat_runtime::candle_nn::LayerNorm::new_no_bias(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-5);
    /// assert!(ln.remove_mean() && ln.bias().is_none());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn new_no_bias(weight: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias: None,
            remove_mean: true,
            eps,
        }
    }

    /// An RMS norm with gain `weight` (the mean is not removed), as
    /// candle-nn's.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let ln = remat_runtime::candle_nn::LayerNorm::rms_norm(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-6);
    /// assert!(!ln.remove_mean());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn rms_norm(weight: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias: None,
            remove_mean: false,
            eps,
        }
    }

    /// The gain.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let ln = remat_runtime::candle_nn::LayerNorm::rms_norm(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-6);
    /// assert_eq!(ln.weight().dims(), [4]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, if any.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let ln = remat_runtime::candle_nn::LayerNorm::new_no_bias(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-5);
    /// assert!(ln.bias().is_none());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Epsilon.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let ln = remat_runtime::candle_nn::LayerNorm::new_no_bias(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-5);
    /// assert_eq!(ln.eps(), 1e-5);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Whether the mean is removed (a layer norm) or not (an RMS norm).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let ln = remat_runtime::candle_nn::LayerNorm::new_no_bias(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-5);
    /// assert!(ln.remove_mean());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn remove_mean(&self) -> bool {
        self.remove_mean
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let op = if self.remove_mean {
            "LayerNorm::forward"
        } else {
            "LayerNorm::forward (an RMS norm)"
        };
        check_norm(op, x, &self.weight, self.bias.as_ref())?;
        norm(
            x,
            &self.weight,
            self.bias.as_ref(),
            self.remove_mean,
            self.eps,
        )
    }
}

/// candle-nn's layer norm, as this module's: the same tensors (a `Var`'s
/// stay `Var`s), now with a backward.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// let w = Tensor::ones(4, DType::F32, &Device::Cpu)?;
/// let ln: remat_runtime::candle_nn::LayerNorm = candle_nn::LayerNorm::new_no_bias(w, 1e-5).into();
/// assert!(ln.bias().is_none());
/// # Ok::<(), candle_core::Error>(())
/// ```
impl From<::candle_nn::LayerNorm> for LayerNorm {
    fn from(ln: ::candle_nn::LayerNorm) -> Self {
        LayerNorm {
            weight: ln.weight().clone(),
            bias: ln.bias().cloned(),
            remove_mean: ln.remove_mean(),
            eps: ln.eps(),
        }
    }
}

/// `candle_nn::RmsNorm` with a backward: an RMS norm over the last
/// dimension with gain `weight`. Its forward is
/// [`ops::rms_norm`](super::ops::rms_norm) whatever the input's layout.
///
/// ```
/// use candle_core::{DType, Device, Module, Var};
/// use remat_runtime::candle_nn::RmsNorm;
/// let dev = Device::Cpu;
/// let w = Var::ones(4, DType::F32, &dev)?;
/// let norm = RmsNorm::new(w.as_tensor().clone(), 1e-6);
/// let x = Var::randn(0f32, 1.0, (3, 4), &dev)?;
/// let grads = norm.forward(&x)?.sqr()?.sum_all()?.backward()?;
/// assert!(grads.get(&w).is_some() && grads.get(&x).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct RmsNorm(LayerNorm);

impl RmsNorm {
    /// An RMS norm with gain `weight`, as candle-nn's.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let norm = remat_runtime::candle_nn::RmsNorm::new(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-6);
    /// assert_eq!(norm.eps(), 1e-6);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm(LayerNorm::rms_norm(weight, eps))
    }

    /// The [`LayerNorm`] it is (with `remove_mean` false).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let norm = remat_runtime::candle_nn::RmsNorm::new(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-6);
    /// assert!(!norm.into_inner().remove_mean());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn into_inner(self) -> LayerNorm {
        self.0
    }

    /// The gain.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let norm = remat_runtime::candle_nn::RmsNorm::new(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-6);
    /// assert_eq!(norm.weight().dims(), [4]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn weight(&self) -> &Tensor {
        self.0.weight()
    }

    /// Epsilon.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// let norm = remat_runtime::candle_nn::RmsNorm::new(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-6);
    /// assert_eq!(norm.eps(), 1e-6);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn eps(&self) -> f64 {
        self.0.eps()
    }

    /// The forward, as [`Module::forward`] (candle-nn has this method for
    /// its composed forward, the one with a backward; here both have one).
    ///
    /// ```
    /// use candle_core::{DType, Device, Module, Tensor};
    /// let norm = remat_runtime::candle_nn::RmsNorm::new(Tensor::ones(2, DType::F32, &Device::Cpu)?, 0.0);
    /// let x = Tensor::new(&[[3f32, 4.]], &Device::Cpu)?;
    /// assert_eq!(norm.forward_diff(&x)?.to_vec2::<f32>()?, norm.forward(&x)?.to_vec2::<f32>()?);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn forward_diff(&self, xs: &Tensor) -> Result<Tensor> {
        self.0.forward(xs)
    }
}

impl Module for RmsNorm {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.0.forward(xs)
    }
}

/// candle-nn's RMS norm, as this module's: the same gain (a `Var` stays a
/// `Var`), now with a backward.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// let w = Tensor::ones(4, DType::F32, &Device::Cpu)?;
/// let norm: remat_runtime::candle_nn::RmsNorm = candle_nn::RmsNorm::new(w, 1e-6).into();
/// assert_eq!(norm.eps(), 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
impl From<::candle_nn::RmsNorm> for RmsNorm {
    fn from(norm: ::candle_nn::RmsNorm) -> Self {
        RmsNorm(norm.into_inner().into())
    }
}

/// `candle_nn::layer_norm`: a [`LayerNorm`] of `size` whose gain (and bias,
/// if `config.affine`) come from `vb` under candle's names (`weight` or
/// `gamma`, `bias` or `beta`; ones and zeros when a `VarMap` creates them).
///
/// ```
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let ln = remat_runtime::candle_nn::layer_norm(16, 1e-5, vb.pp("ln_f"))?;
/// assert!(ln.bias().is_some() && varmap.data().lock().unwrap().contains_key("ln_f.weight"));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn layer_norm<C: Into<LayerNormConfig>>(
    size: usize,
    config: C,
    vb: VarBuilder,
) -> Result<LayerNorm> {
    ::candle_nn::layer_norm(size, config, vb).map(LayerNorm::from)
}

/// `candle_nn::layer_norm_no_bias`: a [`LayerNorm`] of `size` with a gain
/// from `vb` and no bias.
///
/// ```
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let ln = remat_runtime::candle_nn::layer_norm_no_bias(16, 1e-5, vb.pp("ln"))?;
/// assert!(ln.bias().is_none() && ln.remove_mean());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn layer_norm_no_bias(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    ::candle_nn::layer_norm_no_bias(size, eps, vb).map(LayerNorm::from)
}

/// `candle_nn::rms_norm`: an [`RmsNorm`] of `size` whose gain comes from
/// `vb` (`weight`, ones when a `VarMap` creates it), as candle-transformers'
/// models build theirs.
///
/// ```
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let norm = remat_runtime::candle_nn::rms_norm(16, 1e-6, vb.pp("model.norm"))?;
/// assert!(varmap.data().lock().unwrap().contains_key("model.norm.weight"));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
    ::candle_nn::rms_norm(size, eps, vb).map(RmsNorm::from)
}
