use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

remat! {
    fn block(x: &Tensor, w: &Var) -> Result<Tensor> {
        let h = x.matmul(w)?;
        let a = (h + 1.0)?;
        let b = h.exp()?;
        Ok((a + b)?)
    }
}

fn main() {}
