use candle_core::{Result, Tensor};
use remat_runtime::remat;

remat! {
    fn block(x: &Tensor) -> Result<Tensor> {
        #[forward_only] let norm = x.sqr()?.sum_all()?;
        let y = (x / norm.to_scalar::<f32>()? as f64)?;
        Ok(y)
    }
}

fn main() {}
