//! The optimizer step inside the backward: each parameter is updated as
//! soon as its gradient is complete, and the gradient freed, instead of
//! every gradient being held to the end of the backward.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};
use candle_nn::{Optimizer, VarMap};

use super::pending::is_pending;
use crate::ambient::{deeper, depth, scoped, Depth};
use crate::{lock, RematError, Result};

/// What a region call's backward hands its parameter gradients to while an
/// [`OptimizerInBackward`] step runs.
pub(crate) trait Sink: Send {
    /// Takes the gradient of `param` computed by `region`, or hands it back
    /// (a parameter the optimizer does not update in the backward).
    fn offer(&mut self, region: &str, param: &Tensor, grad: Tensor) -> Result<Option<Tensor>>;
    /// Region call `region` has finished with the parameters `ids`: updates
    /// those no other live region call needs.
    fn released(&mut self, ids: &[TensorId]) -> Result<()>;
}

thread_local! {
    /// The sink of the [`OptimizerInBackward::backward_step`] running on
    /// this thread.
    static SINK: RefCell<Option<Arc<Mutex<dyn Sink>>>> = const { RefCell::new(None) };
}

/// Runs a region call's replay and sweep. The regions nested in its block
/// run their backwards inside it; their parameter gradients go to the
/// outer call's sweep, as without an optimizer in the backward, so that
/// every gradient is summed in the same order.
pub(crate) fn nested<R>(f: impl FnOnce() -> R) -> R {
    deeper(Depth::Backward, f)
}

fn sink() -> Option<Arc<Mutex<dyn Sink>>> {
    SINK.with(|s| s.borrow().clone())
}

/// Hands the gradients of a region call's variables (at their positions in
/// `grads`) to the running [`OptimizerInBackward`], if there is one; those
/// it takes leave `grads`.
pub(crate) fn offer(
    region: &str,
    variables: &[(usize, Tensor)],
    grads: &mut [Option<Tensor>],
) -> Result<()> {
    let Some(sink) = sink().filter(|_| depth(Depth::Backward) == 0) else {
        return Ok(());
    };
    let mut sink = lock(&sink);
    for (i, v) in variables {
        if let Some(g) = grads.get_mut(*i).and_then(Option::take) {
            grads[*i] = sink.offer(region, v, g)?;
        }
    }
    Ok(())
}

/// Tells the running [`OptimizerInBackward`], if there is one, that a
/// region call has released its claim on the parameters `params`.
pub(crate) fn released(params: &[TensorId]) -> Result<()> {
    match sink() {
        Some(sink) => lock(&sink).released(params),
        None => Ok(()),
    }
}

/// Whether two gradients differ in any element.
fn differs(a: &Tensor, b: &Tensor) -> Result<bool> {
    Ok(a.ne(b)?.flatten_all()?.max(0)?.to_scalar::<u8>()? != 0)
}

/// One parameter with its own optimizer.
struct Param<O> {
    name: String,
    var: Var,
    optimizer: O,
    /// The gradient summed so far in this step's backward.
    grad: Option<Tensor>,
    /// The last region that handed over a gradient of it.
    region: Option<String>,
    /// It gets a gradient from code outside every region: updated after
    /// the backward, never in it.
    outside: bool,
    /// Updated in this step's backward.
    stepped: bool,
    /// A gradient reached it in this step.
    reached: bool,
}

impl<O: Optimizer> Param<O> {
    /// Its step of this training step, once: with its gradient, or with
    /// none (a layer the loss skipped), which leaves it as it is and counts
    /// the step, as one candle-nn optimizer over every parameter counts it
    /// (AdamW's bias correction reads the count).
    fn step(&mut self) -> Result<()> {
        let mut store = GradStore::default();
        if let Some(g) = self.grad.take() {
            store.insert(self.var.as_tensor(), g);
        }
        self.optimizer.step(&store)?;
        Ok(())
    }
}

struct State<O> {
    params: Vec<Param<O>>,
    by_id: HashMap<TensorId, usize>,
    /// A first step has found which parameters get gradients from outside
    /// every region.
    calibrated: bool,
    /// A region handed over a gradient in this step.
    offered: bool,
}

impl<O: Optimizer + Send> Sink for State<O> {
    fn offer(&mut self, region: &str, param: &Tensor, grad: Tensor) -> Result<Option<Tensor>> {
        let Some(&i) = self.by_id.get(&param.id()) else {
            return Ok(Some(grad));
        };
        let p = &mut self.params[i];
        if p.outside {
            return Ok(Some(grad));
        }
        // The first step hands every gradient on to candle, which sums
        // them, and keeps the regions' sum to compare (see
        // `backward_step`).
        self.offered = true;
        let handed_on = (!self.calibrated).then(|| grad.clone());
        p.grad = Some(match p.grad.take() {
            None => grad,
            Some(prev) => (prev + grad)?,
        });
        p.region = Some(region.to_string());
        Ok(handed_on)
    }

    fn released(&mut self, ids: &[TensorId]) -> Result<()> {
        if !self.calibrated {
            return Ok(());
        }
        for id in ids {
            let Some(&i) = self.by_id.get(id) else {
                continue;
            };
            let p = &mut self.params[i];
            if p.grad.is_some() && !is_pending(*id) {
                p.step()?;
                p.stepped = true;
            }
        }
        Ok(())
    }
}

/// An optimizer whose step runs inside the backward: each parameter is
/// updated as soon as the last region call reading it has finished its
/// backward, and its gradient is freed there, instead of every gradient
/// being held until `loss.backward()` returns. This is torchtune's
/// "optimizer in backward"; with full recomputation it lowers the peak of a
/// training step by most of the parameter gradients.
///
/// Each parameter gets its own optimizer `O` (any candle-nn
/// [`Optimizer`], built with `O::new(vec![var], config)`), so that
/// per-step state such as AdamW's step count stays right when parameters
/// are updated one by one. Every parameter's optimizer steps once per
/// `backward_step`, a parameter no gradient reached with none (it is left
/// as it is), so that each counts the steps as one candle-nn optimizer over
/// all of them does: after a step that skipped a layer (stochastic depth,
/// an expert no token chose), AdamW's bias correction is candle-nn's.
/// (PyTorch's AdamW counts a parameter's steps only when it has a
/// gradient.)
///
/// What it gives up, as torchtune does:
/// * **global-norm gradient clipping**, and anything else that needs every
///   gradient at once: no step ever sees them all;
/// * **gradient accumulation** over micro-batches: each backward updates
///   the parameters.
///
/// Parameters that also get a gradient from code outside every region (an
/// output head written as plain candle, say) are updated after the
/// backward, with their whole gradient, summed by candle. The first step
/// finds them: it runs as a plain backward (every gradient held to the
/// end, and the regions' gradients kept beside candle's sums to compare)
/// and updates every parameter after it; a parameter whose sum differs from
/// its regions' has a reader outside them. A parameter that starts to get
/// such a gradient later (or whose outside part was exactly zero in the
/// first step) is reported by [`RematError::ParameterOutsideRegions`],
/// after the step.
///
/// Code outside every region must not read a parameter's value without a
/// gradient path to it (`x.matmul(&w.detach())`): its backward runs after
/// the parameter may have been updated in place, and would read the new
/// value. Inside regions, a replay that reads an updated parameter is
/// [`RematError::ParameterChanged`].
///
/// A first step in which no region hands over a gradient (under
/// [`Plan::off`](crate::Plan::off)) updates everything after the backward
/// and leaves finding the outside readers to the next.
///
/// A backward that fails part of the way (a region's replay diverged, say)
/// returns the error with the parameters updated before the failure
/// updated and the others not: the step is not undone.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use candle_nn::{AdamW, ParamsAdamW};
/// use remat_runtime::{OptimizerInBackward, Region};
/// let w = Var::ones(3, DType::F32, &Device::Cpu)?;
/// let mut opt = OptimizerInBackward::<AdamW>::new(vec![w.clone()], ParamsAdamW::default())?;
/// for _ in 0..3 {
///     let loss = Region::new("r").run(&[w.as_tensor()], |ctx, ins| {
///         ctx.recompute("s", &[&ins[0]], |t| t[0].sqr()?.sum_all())
///     })?;
///     opt.backward_step(&loss)?;
/// }
/// assert_eq!(opt.stepped_in_backward(), 1); // from the second step on
/// assert!(w.to_vec1::<f32>()?[0] < 1.0);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub struct OptimizerInBackward<O: Optimizer> {
    state: Arc<Mutex<State<O>>>,
}

impl<O> OptimizerInBackward<O>
where
    O: Optimizer + Send + 'static,
    O::Config: Clone,
{
    /// One optimizer per variable, each built with `config`. Errors name a
    /// parameter by its position and shape; [`from_varmap`](Self::from_varmap)
    /// names it as the model does.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// use candle_nn::{ParamsAdamW, AdamW};
    /// let w = Var::zeros((2, 2), DType::F32, &Device::Cpu)?;
    /// let opt = remat_runtime::OptimizerInBackward::<AdamW>::new(vec![w], ParamsAdamW::default())?;
    /// assert_eq!(opt.learning_rate(), ParamsAdamW::default().lr);
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn new(vars: Vec<Var>, config: O::Config) -> Result<Self> {
        let named = vars
            .into_iter()
            .enumerate()
            .map(|(i, v)| (format!("#{i} {:?}", v.dims()), v));
        Self::build(named, config)
    }

    /// One optimizer per variable of `varmap`, named by its path in the
    /// map (`model.layers.0.mlp.up_proj.weight`) in errors.
    ///
    /// ```
    /// use candle_core::{DType, Device};
    /// use candle_nn::{AdamW, ParamsAdamW, VarBuilder, VarMap};
    /// let varmap = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    /// let _lin = candle_nn::linear(4, 2, vb.pp("head"))?;
    /// let opt = remat_runtime::OptimizerInBackward::<AdamW>::from_varmap(&varmap, ParamsAdamW::default())?;
    /// assert_eq!(opt.len(), 2); // head.weight, head.bias
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_varmap(varmap: &VarMap, config: O::Config) -> Result<Self> {
        let mut named: Vec<(String, Var)> = lock(varmap.data())
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Self::build(named, config)
    }

    fn build(named: impl IntoIterator<Item = (String, Var)>, config: O::Config) -> Result<Self> {
        let mut params = Vec::new();
        let mut by_id = HashMap::new();
        for (name, var) in named {
            if by_id.contains_key(&var.id()) {
                continue;
            }
            by_id.insert(var.id(), params.len());
            params.push(Param {
                name,
                optimizer: O::new(vec![var.clone()], config.clone())?,
                var,
                grad: None,
                region: None,
                outside: false,
                stepped: false,
                reached: false,
            });
        }
        let state = State {
            params,
            by_id,
            calibrated: false,
            offered: false,
        };
        Ok(OptimizerInBackward {
            state: Arc::new(Mutex::new(state)),
        })
    }

    /// `loss.backward()` and the optimizer step in one: each parameter
    /// that only regions read is updated inside the backward once its
    /// gradient is complete; the others after it.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        {
            let mut state = lock(&self.state);
            state.offered = false;
            for p in &mut state.params {
                p.grad = None;
                p.region = None;
                p.stepped = false;
                p.reached = false;
            }
        }
        let sink: Arc<Mutex<dyn Sink>> = self.state.clone();
        let previous = SINK.with(|s| s.borrow().clone());
        let grads = scoped(
            || SINK.with(|s| *s.borrow_mut() = Some(sink)),
            || SINK.with(|s| *s.borrow_mut() = previous),
            || super::backward(loss),
        );
        let mut state = lock(&self.state);
        let grads = match grads {
            Ok(grads) => grads,
            Err(e) => {
                for p in &mut state.params {
                    p.grad = None;
                }
                return Err(e);
            }
        };
        let calibrating = !state.calibrated;
        // A step in which no region handed over a gradient (under
        // `Plan::off`, say) tells nothing about who reads what: the next
        // one calibrates.
        let conclusive = state.offered;
        let mut late = None;
        for p in &mut state.params {
            let outside = grads.get(p.var.as_tensor());
            p.reached = p.stepped || p.grad.is_some() || outside.is_some();
            if p.stepped {
                if outside.is_some() {
                    // Updated without this part of its gradient: reported,
                    // and updated after the backward from the next step on.
                    p.outside = true;
                    late.get_or_insert_with(|| RematError::ParameterOutsideRegions {
                        parameter: p.name.clone(),
                        region: p.region.clone().unwrap_or_default(),
                    });
                }
                continue;
            }
            if calibrating {
                // candle summed every part: a sum that differs from the
                // regions' has a part from code outside every region.
                if conclusive {
                    p.outside = match (outside, &p.grad) {
                        (Some(all), Some(regions)) => differs(all, regions)?,
                        (Some(_), None) => true,
                        (None, _) => false,
                    };
                }
                p.grad = outside.cloned();
            } else if let Some(g) = outside {
                p.grad = Some(match p.grad.take() {
                    None => g.clone(),
                    Some(prev) => (prev + g)?,
                });
            }
            p.step()?;
        }
        state.calibrated |= conclusive;
        late.map_or(Ok(()), Err)
    }

    /// How many parameters the last [`backward_step`](Self::backward_step)
    /// updated inside the backward (the others were updated after it).
    pub fn stepped_in_backward(&self) -> usize {
        lock(&self.state)
            .params
            .iter()
            .filter(|p| p.stepped)
            .count()
    }

    /// The parameters no gradient reached in the last
    /// [`backward_step`](Self::backward_step) (so it did not update them),
    /// by name: what [`check_gradients`](crate::check_gradients) reports
    /// after a plain backward.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// use candle_nn::{AdamW, ParamsAdamW};
    /// use remat_runtime::{OptimizerInBackward, Region};
    /// let (w, unused) = (Var::ones(3, DType::F32, &Device::Cpu)?, Var::ones(2, DType::F32, &Device::Cpu)?);
    /// let mut opt = OptimizerInBackward::<AdamW>::new(vec![w.clone(), unused], ParamsAdamW::default())?;
    /// let loss = Region::new("r").run(&[w.as_tensor()], |ctx, ins| {
    ///     ctx.recompute("s", &[&ins[0]], |t| t[0].sqr()?.sum_all())
    /// })?;
    /// opt.backward_step(&loss)?;
    /// assert_eq!(opt.without_gradient(), ["#1 [2]"]);
    /// # Ok::<(), remat_runtime::RematError>(())
    /// ```
    pub fn without_gradient(&self) -> Vec<String> {
        lock(&self.state)
            .params
            .iter()
            .filter(|p| !p.reached)
            .map(|p| p.name.clone())
            .collect()
    }

    /// The number of parameters.
    pub fn len(&self) -> usize {
        lock(&self.state).params.len()
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The learning rate (every parameter's optimizer has the same).
    pub fn learning_rate(&self) -> f64 {
        lock(&self.state)
            .params
            .first()
            .map_or(0.0, |p| p.optimizer.learning_rate())
    }

    /// Sets the learning rate of every parameter's optimizer.
    pub fn set_learning_rate(&mut self, lr: f64) {
        for p in &mut lock(&self.state).params {
            p.optimizer.set_learning_rate(lr);
        }
    }
}
