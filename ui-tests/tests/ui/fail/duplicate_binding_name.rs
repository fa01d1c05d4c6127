use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

remat! {
    fn block(x: &Tensor, w: &Var) -> Result<Tensor> {
        #[save] let h = x.matmul(w)?;
        #[save] let h = h.matmul(w)?;
        Ok(h)
    }
}

fn main() {}
