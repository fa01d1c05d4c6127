use candle_core::{Result, Tensor, Var};
use remat_runtime::{remat, Outputs};

#[derive(Clone, Outputs)]
struct Sizes {
    rows: usize,
    cols: Vec<usize>,
}

#[derive(Clone, Outputs)]
struct Pair<T> {
    left: T,
    right: T,
}

remat! {
    fn block(x: &Tensor, w: &Var) -> Result<Tensor> {
        #[save] let n = x.dim(0)?;
        #[save] let rows = x.to_vec2::<f32>()?;
        #[save] let sizes = Sizes { rows: x.dim(0)?, cols: vec![x.dim(1)?] };
        #[save] let counts = Pair { left: n, right: rows.len() };
        #[save] let both = Pair { left: x.exp()?, right: x.sin()? };
        let k = (n + rows.len() + sizes.rows + sizes.cols[0] + counts.left) as f64;
        let h = ((x.matmul(w)? * k)? + both.left + both.right)?;
        Ok(h)
    }
}

fn main() {}
