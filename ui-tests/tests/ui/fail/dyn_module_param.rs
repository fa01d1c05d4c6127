use candle_core::{Module, Result, Tensor};
use remat_runtime::remat;

remat! {
    fn apply(x: &Tensor, layer: &dyn Module, extra: Option<&impl Module>) -> Result<Tensor> {
        let h = layer.forward(x)?;
        let h = match extra {
            Some(m) => m.forward(&h)?,
            None => h,
        };
        Ok(h.tanh()?)
    }
}

fn main() {}
