use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

remat! {
    fn block(x: &Tensor, w: &Var) -> Result<Tensor> {
        #[save(name = "proj")] let a = x.matmul(w)?;
        #[save(name = "proj")] let b = a.matmul(w)?;
        Ok(b)
    }
}

fn main() {}
