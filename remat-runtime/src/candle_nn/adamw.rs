//! `candle_nn::AdamW` with a step that holds temporaries of a block of each
//! parameter, not of the whole parameter.

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};

/// Bytes of a parameter a step updates at once by default.
const BLOCK_BYTES: usize = 16 << 20;

/// candle-nn's `AdamW`: the same [`ParamsAdamW`], the same arithmetic in
/// the same order (so the same bits), with a step that updates each
/// parameter a block of rows at a time, in place (`slice_set`). candle-nn's
/// step holds up to fifteen temporaries the size of each parameter at once
/// (the new moments, their bias-corrected copies, the square root, the
/// update, the new values and the products between them) before it writes
/// them back: for a language model's embedding (151,936 x 896 in f32, 519
/// MiB) that is over 7 GiB on top of the step, more than the rest of a
/// fine-tuning step of a 0.5B model. This one holds them for one block of
/// rows (16 MiB of the parameter by default, [`AdamW::with_block_bytes`]).
/// A parameter no larger than a block is updated as candle-nn updates it.
///
/// Works with [`crate::OptimizerInBackward`] as candle-nn's does
/// (`OptimizerInBackward::<remat_runtime::candle_nn::AdamW>`), with the
/// default block (it builds each parameter's optimizer from `ParamsAdamW`
/// alone).
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use candle_nn::{Optimizer, ParamsAdamW};
/// let w = Var::ones((4, 3), DType::F32, &Device::Cpu)?;
/// let mut opt = remat_runtime::candle_nn::AdamW::new(vec![w.clone()], ParamsAdamW::default())?
///     .with_block_bytes(12); // one row at a time
/// let loss = (w.as_tensor() * 2.0)?.sum_all()?;
/// opt.backward_step(&loss)?;
/// // AdamW's first step moves every weight by the learning rate (and decays it).
/// let v = w.to_vec2::<f32>()?[0][0];
/// assert!((v - (1.0 - 0.001 * 0.01 - 0.001)).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct AdamW {
    vars: Vec<State>,
    params: ParamsAdamW,
    step_t: usize,
    block_bytes: usize,
}

/// A parameter and its moments.
#[derive(Debug)]
struct State {
    var: Var,
    first_moment: Var,
    second_moment: Var,
}

impl AdamW {
    /// An optimizer of `vars` with learning rate `learning_rate` and
    /// `ParamsAdamW`'s other defaults, as candle-nn's `AdamW::new_lr`.
    ///
    /// ```
    /// let opt = remat_runtime::candle_nn::AdamW::new_lr(vec![], 0.01)?;
    /// assert_eq!(opt.params().lr, 0.01);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn new_lr(vars: Vec<Var>, learning_rate: f64) -> Result<Self> {
        let params = ParamsAdamW {
            lr: learning_rate,
            ..ParamsAdamW::default()
        };
        <Self as Optimizer>::new(vars, params)
    }

    /// Replaces the hyperparameters, as candle-nn's `AdamW::set_params`.
    ///
    /// ```
    /// use candle_nn::ParamsAdamW;
    /// let mut opt = remat_runtime::candle_nn::AdamW::new_lr(vec![], 0.01)?;
    /// opt.set_params(ParamsAdamW { weight_decay: 0.0, ..ParamsAdamW::default() });
    /// assert_eq!(opt.params().weight_decay, 0.0);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn set_params(&mut self, params: ParamsAdamW) {
        self.params = params;
    }

    /// Updates each parameter in blocks of rows of at most `bytes` (at
    /// least one row).
    ///
    /// ```
    /// use candle_nn::{Optimizer, ParamsAdamW};
    /// let opt = remat_runtime::candle_nn::AdamW::new(vec![], ParamsAdamW::default())?
    ///     .with_block_bytes(1 << 20);
    /// assert_eq!(opt.block_bytes(), 1 << 20);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn with_block_bytes(mut self, bytes: usize) -> Self {
        self.block_bytes = bytes;
        self
    }

    /// The most bytes of a parameter a step updates at once.
    ///
    /// ```
    /// use candle_nn::{Optimizer, ParamsAdamW};
    /// let opt = remat_runtime::candle_nn::AdamW::new(vec![], ParamsAdamW::default())?;
    /// assert_eq!(opt.block_bytes(), 16 << 20);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The optimizer's hyperparameters.
    ///
    /// ```
    /// use candle_nn::{Optimizer, ParamsAdamW};
    /// let opt = remat_runtime::candle_nn::AdamW::new(vec![], ParamsAdamW::default())?;
    /// assert_eq!(opt.params().beta1, 0.9);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }
}

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        let vars = vars
            .into_iter()
            .filter(|var| var.dtype().is_float())
            .map(|var| {
                let (shape, dtype, device) = (var.shape(), var.dtype(), var.device());
                Ok(State {
                    first_moment: Var::zeros(shape, dtype, device)?,
                    second_moment: Var::zeros(shape, dtype, device)?,
                    var,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW {
            vars,
            params,
            step_t: 0,
            block_bytes: BLOCK_BYTES,
        })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step_t += 1;
        let p = &self.params;
        let step = Step {
            lr: p.lr,
            decay: 1f64 - p.lr * p.weight_decay,
            beta1: p.beta1,
            beta2: p.beta2,
            eps: p.eps,
            scale_m: 1f64 / (1f64 - p.beta1.powi(self.step_t as i32)),
            scale_v: 1f64 / (1f64 - p.beta2.powi(self.step_t as i32)),
        };
        for s in &self.vars {
            let Some(g) = grads.get(&s.var) else {
                continue;
            };
            let (theta, m, v) = (
                s.var.as_tensor(),
                s.first_moment.as_tensor(),
                s.second_moment.as_tensor(),
            );
            // Refused before anything is written, as candle-nn's first op
            // would refuse it.
            if g.shape() != theta.shape() {
                return Err(candle_core::Error::ShapeMismatchBinaryOp {
                    lhs: theta.shape().clone(),
                    rhs: g.shape().clone(),
                    op: "adamw",
                }
                .bt());
            }
            let rows = if theta.rank() == 0 { 1 } else { theta.dim(0)? };
            let row_bytes = theta.elem_count() / rows.max(1) * theta.dtype().size_in_bytes();
            let block = (self.block_bytes / row_bytes.max(1)).max(1);
            if theta.rank() == 0 || block >= rows {
                // The whole parameter at once, as candle-nn.
                let (next_m, next_v, next_theta) = step.apply(theta, m, v, g)?;
                s.first_moment.set(&next_m)?;
                s.second_moment.set(&next_v)?;
                s.var.set(&next_theta)?;
                continue;
            }
            let mut start = 0;
            while start < rows {
                let len = block.min(rows - start);
                let rows_of = |t: &Tensor| t.narrow(0, start, len);
                let (next_m, next_v, next_theta) =
                    step.apply(&rows_of(theta)?, &rows_of(m)?, &rows_of(v)?, &rows_of(g)?)?;
                m.slice_set(&next_m, 0, start)?;
                v.slice_set(&next_v, 0, start)?;
                theta.slice_set(&next_theta, 0, start)?;
                start += len;
            }
        }
        Ok(())
    }
}

/// One step's numbers.
struct Step {
    lr: f64,
    /// `1 - lr * weight_decay`.
    decay: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    /// `1 / (1 - beta1^t)`.
    scale_m: f64,
    /// `1 / (1 - beta2^t)`.
    scale_v: f64,
}

impl Step {
    /// The new moments and values of `theta` (or of a block of its rows):
    /// candle-nn's `AdamW::step`, op for op.
    fn apply(
        &self,
        theta: &Tensor,
        m: &Tensor,
        v: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let next_m = ((m * self.beta1)? + (g * (1.0 - self.beta1))?)?;
        let next_v = ((v * self.beta2)? + (g.sqr()? * (1.0 - self.beta2))?)?;
        let m_hat = (&next_m * self.scale_m)?;
        let v_hat = (&next_v * self.scale_v)?;
        let next_theta = (theta * self.decay)?;
        let adjusted_grad = (m_hat / (v_hat.sqrt()? + self.eps)?)?;
        let next_theta = (next_theta - (adjusted_grad * self.lr)?)?;
        Ok((next_m, next_v, next_theta))
    }
}
