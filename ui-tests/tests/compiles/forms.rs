//! Every supported form of a remat! block, compiled, run, and checked
//! against plain candle where it computes something.
#![deny(warnings)]

use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use remat_runtime::remat;

#[derive(Clone)]
pub struct Config {
    pub scale: f64,
}

remat! {
    /// Generic over a parameter type, with lifetimes and visibility.
    pub(crate) fn generic<'a, P: AsRef<Tensor> + Clone + Send + Sync + 'static>(
        x: &'a Tensor,
        p: &P,
    ) -> Result<Tensor> {
        #[save] let y = x.matmul(p.as_ref())?;
        Ok(y)
    }

    /// Tuple bindings, plain values, shapes, `?` everywhere, by-value and
    /// `mut` parameters, a `Vec<Tensor>` binding, an inner item, a
    /// forward-only statement.
    pub fn forms(x: Tensor, n: usize, cfg: &Config, w: &Var) -> candle_core::Result<Tensor> {
        fn double(t: &Tensor) -> Result<Tensor> {
            t * 2.0
        }
        let (rows, cols) = x.dims2()?;
        let shape: Shape = (rows, cols).into();
        #[save(name = "pair")] let (a, b) = (x.matmul(w)?, double(&x)?);
        let parts: Vec<Tensor> = vec![a.clone(), b.clone()];
        #[recompute(name = "sum")] let s = (&parts[0] + &parts[1])?.reshape(shape)?;
        #[forward_only] println!("{} rows, scale {}", rows, cfg.scale);
        let k = (n + cols) as f64 * cfg.scale;
        Ok((s * k)?)
    }

    /// Offloaded statements, named by their binding or explicitly.
    fn offloaded(x: &Tensor, w: &Var) -> Result<Tensor> {
        #[offload] let h = x.matmul(w)?;
        let g = h.tanh()?;
        #[offload(name = "out")] let (o, _n) = (g.matmul(w)?, g.dim(0)?);
        Ok(o)
    }
}

pub fn main() -> Result<()> {
    let dev = Device::Cpu;
    let x = Var::ones((2, 3), DType::F32, &dev)?;
    let w = Var::ones((3, 3), DType::F32, &dev)?;
    let y = generic(x.as_tensor(), &w.as_tensor().clone())?;
    let g = y.sum_all()?.backward()?;
    assert_eq!(g.get(&w).unwrap().to_vec2::<f32>()?, vec![vec![2.0; 3]; 3]);

    let cfg = Config { scale: 0.5 };
    let y = forms(x.as_tensor().clone(), 1, &cfg, &w)?;
    // s = x w + 2x = 3 + 2 = 5 everywhere; k = (1 + 3) * 0.5 = 2
    assert_eq!(y.to_vec2::<f32>()?, vec![vec![10.0; 3]; 2]);
    let g = y.sum_all()?.backward()?;
    // dy/dx = k * (sum_j w_ij + 2) = 2 * 5 = 10
    assert_eq!(g.get(&x).unwrap().to_vec2::<f32>()?, vec![vec![10.0; 3]; 2]);

    // o = tanh(x w) w with x, w all ones: tanh(3) * 3 everywhere.
    let y = offloaded(x.as_tensor(), &w)?;
    assert_eq!(y.to_vec2::<f32>()?, vec![vec![3.0f32.tanh() * 3.0; 3]; 2]);
    let g = y.sum_all()?.backward()?;
    // d/dx_ij sum(tanh(x w) w) = sum_k w_jk (1 - tanh(3)^2) * 3 = 9 (1 - tanh(3)^2)
    let want = 9.0 * (1.0 - 3.0f32.tanh().powi(2));
    let got = g.get(&x).unwrap().to_vec2::<f32>()?;
    assert!(got
        .iter()
        .flatten()
        .all(|v| (v - want).abs() <= 1e-5 * want));
    Ok(())
}
