use candle_core::{Result, Tensor, Var};
use remat_runtime::remat;

remat! {
    fn block(x: &Tensor, w: &Var) -> Result<Tensor> {
        #[save(name = "a")] let a = x.matmul(w)?;
        #[save(name = "a")] let b = a.matmul(w)?;
        #[keep] let c = b.exp()?;
        #[save] let (d, e) = (c.sin()?, c.cos()?);
        for _ in 0..2 {
            #[recompute] let _f = d.exp()?;
        }
        Ok((d + e)?)
    }
}

fn main() {}
