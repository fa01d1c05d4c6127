use candle_core::{Result, Tensor};
use remat_runtime::remat;

// A closure borrowing a binding that a later `let` shadows before the
// closure is called: a statement calling it would define it again with the
// later value.
remat! {
    fn block(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let g = x.matmul(w)?;
        let f = |t: &Tensor| t * &g;
        let g = g.exp()?;
        let y = (f(x)? + &g)?;
        Ok(y)
    }
}

fn main() {}
