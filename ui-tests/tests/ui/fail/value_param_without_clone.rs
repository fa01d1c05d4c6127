use candle_core::{Result, Tensor};
use remat_runtime::remat;

/// A cache passed by value, not `Clone`.
pub struct Cache {
    pub scale: f64,
}

remat! {
    fn block(x: &Tensor, cache: Cache) -> Result<Tensor> {
        let h = (x * cache.scale)?;
        Ok(h.tanh()?)
    }
}

fn main() {}
