use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

remat! {
    fn block(x: &Tensor, w: &Var) -> Result<Tensor> {
        #[save] let h = x.matmul(w)?;
        // The names of saved and offloaded statements share one namespace.
        #[offload(name = "h")] let g = h.tanh()?;
        // One policy per statement.
        #[offload]
        #[save]
        let a = g.exp()?;
        // A destructuring pattern needs an explicit name.
        #[offload] let (b, c) = (a.sin()?, a.cos()?);
        // A plausible misspelling.
        #[offloaded] let d = (b + c)?;
        Ok(d)
    }
}

fn main() {}
