use candle_core::{Result, Tensor};
use remat_runtime::remat;

// A statement whose value is not of its binding's type is reported at the
// statement's code, as rustc reports it without the macro.
remat! {
    fn block(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let h = x.matmul(w)?;
        let g: Tensor = h.dims2()?;
        let k: f32 = h.sum_all()?.to_scalar::<f64>()?;
        Ok(((h * k as f64)? + g)?)
    }
}

fn main() {}
