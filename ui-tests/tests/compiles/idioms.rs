//! What candle code commonly writes, accepted unchanged: `mut` bindings
//! updated by a loop or an assignment, slices of layers, optional masks,
//! statement closures returning candle's `Result`. Gradients against the
//! same code without the macro are in remat-runtime/tests/it/macro_blocks.rs.
#![deny(warnings)]

use candle_core::{DType, Device, Result, Tensor, Var};
use remat_runtime::{remat, Region};

#[derive(Clone)]
pub struct Linear {
    pub w: Var,
}

#[derive(Clone)]
pub struct Params {
    pub ws: Vec<Var>,
}

remat! {
    /// An accumulation loop over a `mut` binding: one statement whose
    /// output is `h`.
    pub fn accumulate(x: &Tensor, p: &Params) -> Result<Tensor> {
        let mut h = x.clone();
        for w in &p.ws {
            h = h.matmul(w)?.tanh()?;
        }
        h = (h * 2.0)?;
        Ok(h)
    }

    /// A slice of layers and an optional mask, as candle-transformers
    /// writes them.
    pub fn layers(x: &Tensor, layers: &[Linear], mask: Option<&Tensor>) -> Result<Tensor> {
        let mut h = x.clone();
        for l in layers {
            h = h.matmul(&l.w)?;
        }
        let h = match mask {
            Some(m) => h.broadcast_mul(m)?,
            None => h,
        };
        Ok(h.tanh()?)
    }

    /// Outputs collected into a `mut` vector with `push`.
    pub fn collect(x: &Tensor, layers: &[Linear]) -> Result<Tensor> {
        let mut outs: Vec<Tensor> = Vec::new();
        for l in layers {
            outs.push(x.matmul(&l.w)?);
        }
        let n = outs.len();
        Ok((Tensor::cat(&outs, 1)? / n as f64)?)
    }
}

pub fn main() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::ones((2, 3), DType::F32, &dev)?;
    let p = Params {
        ws: vec![
            Var::ones((3, 3), DType::F32, &dev)?,
            Var::ones((3, 3), DType::F32, &dev)?,
        ],
    };
    assert_eq!(accumulate(&x, &p)?.dims(), &[2, 3]);
    let ls = vec![Linear {
        w: Var::ones((3, 3), DType::F32, &dev)?,
    }];
    let mask = Tensor::ones(3, DType::F32, &dev)?;
    assert_eq!(layers(&x, &ls, Some(&mask))?.dims(), &[2, 3]);
    assert_eq!(layers(&x, &ls, None)?.dims(), &[2, 3]);
    assert_eq!(collect(&x, &ls)?.dims(), &[2, 3]);
    // A statement closure returns candle's `Result` directly.
    let y = Region::new("r").run(&[&x], |ctx, ins| ctx.open("e", &[&ins[0]], |t| t[0].exp()))?;
    assert_eq!(y.dims(), &[2, 3]);
    Ok(())
}
