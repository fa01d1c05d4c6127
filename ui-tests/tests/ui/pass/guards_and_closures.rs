//! A tracing guard bound to `_enter` and a helper closure bound with `let`
//! run as plain code in the forward and the replay.
use candle_core::{Result, Tensor, Var};
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

fn main() {}
