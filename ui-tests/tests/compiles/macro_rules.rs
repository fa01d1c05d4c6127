//! Blocks written by `macro_rules!` templates: the return type as a `$ty`,
//! expressions as `$expr`, whole methods passed through `$($body:tt)*`,
//! and a template writing `&self` itself. Each runs and matches the same
//! code outside `remat!`.
#![deny(warnings)]

use candle_core::{DType, Device, Result, Tensor, Var};
use remat_runtime::remat;

macro_rules! layer {
    ($name:ident -> $ret:ty, $scale:expr, $shift:expr) => {
        remat! {
            fn $name(x: &Tensor, w: &Tensor) -> $ret {
                let h = (x.matmul(w)? * $scale)?;
                let h = (h.exp()? + $shift)?;
                let s = $shift;
                Ok((h * s)?)
            }
        }
    };
}
layer!(scaled -> Result<Tensor>, 0.5 + 0.25, 1.0 - 0.5);

#[derive(Clone)]
pub struct Gate {
    w: Tensor,
}

/// The whole method passed through, as `impl` blocks of models generated
/// by macros are.
macro_rules! method {
    ($($body:tt)*) => {
        remat! { $($body)* }
    };
}

impl Gate {
    method! {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let h = x.broadcast_mul(&self.w)?;
            let g = h.tanh()?;
            Ok(g.broadcast_mul(&self.w)?)
        }
    }
}

/// A template writing the receiver and the body itself.
macro_rules! gated_method {
    ($name:ident, $act:ident) => {
        impl Gate {
            remat! {
                fn $name(&self, x: &Tensor) -> Result<Tensor> {
                    let h = x.broadcast_mul(&self.w)?.$act()?;
                    Ok(h)
                }
            }
        }
    };
}
gated_method!(forward_sin, sin);

pub fn main() -> Result<()> {
    let dev = Device::Cpu;
    let x = Var::new(&[[0.1f64, -0.2], [0.3, 0.4]], &dev)?;
    let w = Var::new(&[[0.5f64, 0.1], [-0.3, 0.2]], &dev)?;
    let y = scaled(x.as_tensor(), w.as_tensor())?;
    let plain = (((x.matmul(&w)? * 0.75)?.exp()? + 0.5)? * 0.5)?;
    let (g, p) = (y.sum_all()?.backward()?, plain.sum_all()?.backward()?);
    for v in [&x, &w] {
        let d = (g.get(v).unwrap() - p.get(v).unwrap())?.abs()?.max_all()?;
        assert!(d.to_scalar::<f64>()? < 1e-12);
    }
    let gate = Gate {
        w: Tensor::new(&[0.5f64, -1.0], &dev)?,
    };
    let y = gate.forward(x.as_tensor())?;
    let plain = x.broadcast_mul(&gate.w)?.tanh()?.broadcast_mul(&gate.w)?;
    let d = (y - plain)?.abs()?.max_all()?.to_scalar::<f64>()?;
    assert!(d < 1e-12);
    let y = gate.forward_sin(x.as_tensor())?;
    let d = (y - x.broadcast_mul(&gate.w)?.sin()?)?.abs()?.max_all()?;
    assert!(d.to_scalar::<f64>()? < 1e-12);
    assert_eq!(DType::F64, x.dtype());
    Ok(())
}
