use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

pub struct Params {
    pub w: Var,
}

remat! {
    fn block(x: &Tensor, p: &Params) -> Result<Tensor> {
        let h = x.matmul(&p.w)?;
        Ok(h.tanh()?)
    }
}

fn main() {}
