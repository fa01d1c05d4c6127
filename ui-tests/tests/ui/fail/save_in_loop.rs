use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

remat! {
    fn block(x: &Tensor, w: &Var) -> Result<Tensor> {
        let mut h = x.clone();
        for _ in 0..3 {
            #[save] let next = h.matmul(w)?;
            h = next;
        }
        Ok(h)
    }
}

fn main() {}
