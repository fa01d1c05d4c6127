use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

remat! {
    fn block(x: &Tensor, w: &Var) -> Result<Tensor> {
        let f = |t: &Tensor| -> Result<Tensor> {
            #[save] let y = t.matmul(w)?;
            Ok(y)
        };
        let y = f(x)?;
        Ok(y)
    }
}

fn main() {}
