//! Master weights: any candle-nn optimizer updating `f32` copies of a
//! model's `bf16` and `f16` parameters.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};
use candle_nn::Optimizer;

/// Bytes of a master a step writes back at once.
const BLOCK_BYTES: usize = 16 << 20;

/// An optimizer `O` (candle-nn's `AdamW` or `SGD`, remat's
/// [`AdamW`](super::AdamW): an [`Optimizer`] whose update of a parameter
/// depends only on that parameter's gradient and state, and which changes
/// only parameters that have a gradient) that updates an `f32` copy of
/// each `bf16` or `f16` (or 8-bit float) parameter, its *master weight*,
/// and writes the master back into the parameter rounded to the
/// parameter's dtype after each step. The model computes in the low precision; the optimizer's
/// state and the weights it updates stay in `f32`.
///
/// Without it, an update smaller than half a `bf16` step of the weight is
/// lost whole (a `bf16` weight near 1.0 moves in steps of 2^-8; a
/// fine-tuning learning rate of 1e-5 never moves it), and AdamW's moments
/// are kept in `bf16`. This is what mixed-precision training in PyTorch
/// (Megatron-LM's and DeepSpeed's "main params", FSDP's mixed precision)
/// keeps.
///
/// * Parameters in `f32` or `f64` have no master: `O` updates them as it
///   would alone, bit for bit.
/// * A step takes each parameter's gradient (in any float dtype: a
///   gradient already cast to `f32` for clipping is taken as it is) to
///   `f32`, runs `O`'s step on the master, and writes the master back
///   rounded to nearest (candle's `to_dtype`), 16 MiB of the master at a
///   time ([`with_block_bytes`](Self::with_block_bytes)).
/// * Each parameter has its own `O`, stepped every step whether it has a
///   gradient or not (candle-nn's `AdamW` counts steps per optimizer, so
///   its bias correction stays that of one optimizer over all of them).
///   One parameter's `f32` gradient exists at a time. Every gradient's
///   shape is checked before any parameter steps. A parameter passed twice
///   is held once.
/// * The masters are copied from the parameters when the optimizer is
///   built: build it after loading the weights. A parameter changed
///   afterwards by other code (`Var::set`, `VarMap::load`) is overwritten
///   by its master at its next step; change the master instead
///   (`opt.master(&w).unwrap().set(&values)`), which is also how a saved
///   master is restored.
/// * It costs 4 bytes per element of each low-precision parameter for the
///   master, and `O`'s state in `f32` (AdamW: 8 more).
/// * `f16` training also needs loss scaling (its gradients underflow);
///   this type does not scale.
///
/// Works with [`crate::OptimizerInBackward`]:
/// `OptimizerInBackward::<MasterWeights<AdamW>>::from_varmap(&varmap, params)`
/// (one `MasterWeights` per parameter; as with any optimizer there, a
/// parameter's optimizer steps only when it has a gradient, and its master
/// is not reachable from outside).
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use candle_nn::{Optimizer, ParamsAdamW};
/// use remat_runtime::candle_nn::{AdamW, MasterWeights};
/// let w = Var::ones(4, DType::BF16, &Device::Cpu)?;
/// let params = ParamsAdamW { lr: 1e-4, weight_decay: 0.0, ..Default::default() };
/// let mut opt = MasterWeights::<AdamW>::new(vec![w.clone()], params)?;
/// for _ in 0..10 {
///     opt.backward_step(&w.as_tensor().sum_all()?)?;
/// }
/// // Ten steps of 1e-4: the master moved by 1e-3, the bf16 weight (2^-8
/// // apart below 1.0) not yet; a bf16 AdamW alone would never move it.
/// let master = opt.master(&w).unwrap().to_vec1::<f32>()?;
/// assert!((master[0] - 0.999).abs() < 1e-6);
/// assert_eq!(w.to_dtype(DType::F32)?.to_vec1::<f32>()?, vec![1.0; 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct MasterWeights<O> {
    params: Vec<Param<O>>,
    /// An optimizer of no parameter: the learning rate when there are none.
    empty: O,
    block_bytes: usize,
}

/// A parameter, its master and its optimizer.
struct Param<O> {
    var: Var,
    /// `None`: an `f32` or `f64` parameter, updated itself.
    master: Option<Var>,
    optimizer: O,
}

impl<O: Optimizer> MasterWeights<O> {
    /// Writes each master back in blocks of rows of at most `bytes` of the
    /// master (at least one row; 16 MiB by default). It bounds the
    /// write-back only: `O`'s step has its own temporaries (remat's `AdamW`
    /// its own blocks), and a parameter's gradient is taken to `f32` whole.
    ///
    /// ```
    /// use candle_nn::{Optimizer, SGD};
    /// use remat_runtime::candle_nn::MasterWeights;
    /// let opt = MasterWeights::<SGD>::new(vec![], 0.1)?.with_block_bytes(1 << 20);
    /// assert_eq!(opt.block_bytes(), 1 << 20);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn with_block_bytes(mut self, bytes: usize) -> Self {
        self.block_bytes = bytes;
        self
    }

    /// The most bytes of a master a step writes back at once.
    ///
    /// ```
    /// use candle_nn::{Optimizer, SGD};
    /// use remat_runtime::candle_nn::MasterWeights;
    /// assert_eq!(MasterWeights::<SGD>::new(vec![], 0.1)?.block_bytes(), 16 << 20);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The `f32` master of `var`, the weights the optimizer updates: `None`
    /// for a parameter it does not hold (or one in `f32` or `f64`, which is
    /// its own master). Save the masters beside the model to resume
    /// training from the same weights.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// use candle_nn::{Optimizer, SGD};
    /// use remat_runtime::candle_nn::MasterWeights;
    /// let (w, b) = (Var::ones(2, DType::BF16, &Device::Cpu)?, Var::ones(2, DType::F32, &Device::Cpu)?);
    /// let opt = MasterWeights::<SGD>::new(vec![w.clone(), b.clone()], 0.1)?;
    /// assert_eq!(opt.master(&w).unwrap().dtype(), DType::F32);
    /// assert!(opt.master(&b).is_none());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn master(&self, var: &Var) -> Option<&Var> {
        self.params
            .iter()
            .find(|p| p.var.id() == var.id())
            .and_then(|p| p.master.as_ref())
    }
}

impl<O> Optimizer for MasterWeights<O>
where
    O: Optimizer,
    O::Config: Clone,
{
    type Config = O::Config;

    fn new(vars: Vec<Var>, config: O::Config) -> Result<Self> {
        let mut seen = std::collections::HashSet::new();
        let params = vars
            .into_iter()
            .filter(|var| var.dtype().is_float() && seen.insert(var.id()))
            .map(|var| {
                let master = match var.dtype() {
                    DType::F32 | DType::F64 => None,
                    _ => Some(Var::from_tensor(&var.as_tensor().to_dtype(DType::F32)?)?),
                };
                let updated = master.as_ref().unwrap_or(&var).clone();
                Ok(Param {
                    optimizer: O::new(vec![updated], config.clone())?,
                    var,
                    master,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MasterWeights {
            params,
            empty: O::empty(config)?,
            block_bytes: BLOCK_BYTES,
        })
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        // Every gradient's shape before any parameter steps: a step that
        // failed half way would leave the parameters' step counts apart.
        for p in &self.params {
            if let Some(g) = grads.get(&p.var) {
                if g.shape() != p.var.shape() {
                    return Err(candle_core::Error::ShapeMismatchBinaryOp {
                        lhs: p.var.shape().clone(),
                        rhs: g.shape().clone(),
                        op: "master weights",
                    }
                    .bt());
                }
            }
        }
        for p in &mut self.params {
            let mut store = GradStore::default();
            let grad = grads.get(&p.var);
            match (&p.master, grad) {
                (None, Some(g)) => {
                    store.insert(p.var.as_tensor(), g.clone());
                }
                (Some(master), Some(g)) => {
                    store.insert(master.as_tensor(), g.to_dtype(DType::F32)?);
                }
                (_, None) => {}
            }
            p.optimizer.step(&store)?;
            drop(store);
            if let (Some(master), Some(_)) = (&p.master, grad) {
                write_back(master.as_tensor(), &p.var, self.block_bytes)?;
            }
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.empty.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.empty.set_learning_rate(lr);
        for p in &mut self.params {
            p.optimizer.set_learning_rate(lr);
        }
    }
}

/// Writes `master` into `var`, rounded to `var`'s dtype, a block of rows
/// of at most `block_bytes` of the master at a time.
fn write_back(master: &Tensor, var: &Var, block_bytes: usize) -> Result<()> {
    let rows = if master.rank() == 0 {
        1
    } else {
        master.dim(0)?
    };
    let row_bytes = master.elem_count() / rows.max(1) * master.dtype().size_in_bytes();
    let block = (block_bytes / row_bytes.max(1)).max(1);
    if master.rank() == 0 || block >= rows {
        return var.set(&master.to_dtype(var.dtype())?);
    }
    let mut start = 0;
    while start < rows {
        let len = block.min(rows - start);
        let rounded = master.narrow(0, start, len)?.to_dtype(var.dtype())?;
        var.as_tensor().slice_set(&rounded, 0, start)?;
        start += len;
    }
    Ok(())
}
