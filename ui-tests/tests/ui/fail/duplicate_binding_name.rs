use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

// A saved `let h` is named `h` (the first statement binding `h`); an
// explicit name cannot take it.
remat! {
    fn block(x: &Tensor, w: &Var) -> Result<Tensor> {
        #[save(name = "h")] let a = x.matmul(w)?;
        #[save] let h = a.matmul(w)?;
        Ok(h)
    }
}

fn main() {}
