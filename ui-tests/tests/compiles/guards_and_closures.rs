//! A tracing guard bound to `_enter` and a helper closure bound with `let`
//! run as plain code in the forward and the replay.
use candle_core::{DType, Device, Result, Tensor, Var};
use remat_runtime::remat;

#[derive(Clone)]
struct Layer {
    a: Var,
    b: Var,
    span: tracing_like::Span,
}

mod tracing_like {
    #[derive(Clone)]
    pub struct Span;
    pub struct Entered;
    impl Span {
        pub fn enter(&self) -> Entered {
            Entered
        }
    }
}

impl Layer {
    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let _enter = self.span.enter();
            let h = xs.matmul(&self.a)?;
            let f = |t: &Tensor| t.relu();
            let h = f(&h)?;
            let h = h.matmul(&self.b)?;
            Ok((h + xs)?)
        }
    }
}

pub fn main() -> Result<()> {
    let dev = Device::Cpu;
    let layer = Layer {
        a: Var::ones((4, 4), DType::F32, &dev)?,
        b: Var::ones((4, 4), DType::F32, &dev)?,
        span: tracing_like::Span,
    };
    let x = Var::ones((2, 4), DType::F32, &dev)?;
    let g = layer.forward(x.as_tensor())?.sum_all()?.backward()?;
    assert!(g.get(&layer.a).is_some() && g.get(&x).is_some());
    Ok(())
}
