use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

remat! {
    fn block(x: &Tensor, w: &Var, wide: bool) -> Result<Tensor> {
        let y = if wide {
            #[save] let y = x.matmul(w)?;
            y
        } else {
            x.clone()
        };
        Ok(y)
    }
}

fn main() {}
