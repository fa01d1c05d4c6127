use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

struct Model {
    w: Var,
}

impl Model {
    remat! {
        fn block(&self, x: &Tensor) -> Result<Tensor> {
            let y = x.matmul(&self.w)?;
            Ok(y)
        }
    }
}

fn main() {}
