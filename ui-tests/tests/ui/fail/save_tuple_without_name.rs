use candle_core::{Result, Tensor};
use remat_runtime::remat;

remat! {
    fn block(x: &Tensor) -> Result<Tensor> {
        #[save] let (a, b) = (x.exp()?, x.sin()?);
        Ok((a + b)?)
    }
}

fn main() {}
