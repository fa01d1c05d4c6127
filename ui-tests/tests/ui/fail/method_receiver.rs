use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

#[derive(Clone)]
struct Model {
    w: Var,
    steps: usize,
}

impl Model {
    remat! {
        fn block(&mut self, x: &Tensor) -> Result<Tensor> {
            let y = x.matmul(&self.w)?;
            self.steps += 1;
            Ok(y)
        }
    }
}

fn main() {}
