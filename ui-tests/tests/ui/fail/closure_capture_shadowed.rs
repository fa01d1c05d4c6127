use candle_core::{Result, Tensor};
use remat_runtime::remat;

// A closure borrowing a binding that a later `let` shadows before the
// closure is called, by a statement that reads the later binding too: the
// statement defines the closure again, and inside it one name cannot mean
// both. (Without the read of the later `g`, it compiles.)
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
