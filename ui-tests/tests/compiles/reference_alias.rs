//! References as model files write them: `let residual = xs;` with `xs` a
//! borrowed parameter, `let r = &h;`, a tensor's device and dtype, a copy
//! of a layer into a `mut` binding. Each is plain code, and what refers to
//! a tensor is read as the tensor.
#![deny(warnings)]

use candle_core::{DType, Device, Result, Tensor, Var};
use remat_runtime::remat;

#[derive(Clone)]
pub struct Proj {
    pub w: Var,
    pub calls: usize,
}

impl Proj {
    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.calls += 1;
        x.matmul(&self.w)
    }
}

remat! {
    fn block(xs: &Tensor, proj: &Proj) -> Result<Tensor> {
        let residual = xs;
        let device = xs.device();
        let dtype = xs.dtype();
        let mut proj = proj.clone();
        #[save] let h = proj.forward(xs)?;
        let r = &h;
        let scale = Tensor::new(0.5f32, device)?.to_dtype(dtype)?;
        let g = proj.forward(r)?.broadcast_mul(&scale)?;
        Ok((g + residual)?)
    }
}

pub fn main() -> Result<()> {
    let dev = Device::Cpu;
    let proj = Proj {
        w: Var::ones((3, 3), DType::F32, &dev)?,
        calls: 0,
    };
    let x = Var::ones((2, 3), DType::F32, &dev)?;
    let y = block(x.as_tensor(), &proj)?;
    let g = y.sum_all()?.backward()?;
    assert!(g.get(&proj.w).is_some() && g.get(&x).is_some());
    Ok(())
}
