use std::cell::Cell;
use std::rc::Rc;

use candle_core::{Result, Tensor};
use remat_runtime::remat;

#[derive(Clone)]
pub struct Config {
    pub scale: Cell<f64>,
}

remat! {
    /// The region keeps its parameters until the backward, maybe on another
    /// thread: an `Rc` and a `Cell` cannot go there.
    fn block(x: &Tensor, shared: Rc<Tensor>, cfg: &Config) -> Result<Tensor> {
        let h = x.matmul(&shared)?;
        let y = (h * cfg.scale.get())?;
        Ok(y)
    }
}

fn main() {}
