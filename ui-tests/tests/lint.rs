//! The expansion of `remat!` compiles without a single warning, rustc's or
//! clippy's (CI runs clippy with `-D warnings` over all targets, this file
//! included), like pin-project-lite's lint test.
#![deny(warnings, clippy::all)]

use candle_core::{DType, Device, Result, Tensor, Var};
use remat_runtime::remat;

#[derive(Clone)]
pub struct Params {
    pub w1: Var,
    pub w2: Var,
    pub n: usize,
}

/// `#[derive(Outputs)]` on a generic struct with a plain field, a tuple
/// struct, a unit struct and a struct of plain fields only.
#[derive(Clone, remat_runtime::Outputs)]
pub struct Hidden<T> {
    pub states: T,
    pub aux: Tensor,
    #[outputs(plain)]
    pub note: String,
}

#[derive(Clone, remat_runtime::Outputs)]
pub struct Wrapped(pub Tensor, pub usize);

#[derive(Clone, remat_runtime::Outputs)]
pub struct Marker;

#[derive(Clone, remat_runtime::Outputs)]
pub struct Config {
    #[outputs(plain)]
    pub name: String,
}

remat! {
    pub fn lint_derived(x: &Tensor) -> Result<Hidden<Wrapped>> {
        let h = x.exp()?;
        let aux = h.sum_all()?;
        let _marker = Marker;
        Ok(Hidden { states: Wrapped(h, 2), aux, note: Config { name: "exp".into() }.name })
    }
}

remat! {
    /// Every kind of statement: saved (kept and not), recomputed, plain
    /// values, tuples, forward-only, a pass-through tail.
    pub fn lint_block(x: &Tensor, p: &Params, mask: &Tensor) -> Result<Tensor> {
        let (rows, _cols) = x.dims2()?;
        #[save(name = "proj")] let h = x.matmul(&p.w1)?;
        let a = h.gelu_erf()?.broadcast_mul(mask)?;
        #[save] let o = a.matmul(&p.w2)?;
        #[forward_only] let _shape = o.shape().clone();
        #[recompute] let r = ((x + &o)? * (p.n + rows) as f64)?;
        #[save] let out = r.tanh()?;
        Ok(out)
    }

    pub(crate) fn lint_tail(x: Tensor) -> candle_core::Result<Tensor> {
        let y = x.exp()?;
        Ok((y * 2.0)?)
    }
}

#[test]
fn lint_blocks_run() -> Result<()> {
    let dev = Device::Cpu;
    let p = Params {
        w1: Var::ones((4, 8), DType::F32, &dev)?,
        w2: Var::ones((8, 4), DType::F32, &dev)?,
        n: 1,
    };
    let x = Var::ones((2, 4), DType::F32, &dev)?;
    let mask = Tensor::ones(8, DType::F32, &dev)?;
    let y = lint_block(x.as_tensor(), &p, &mask)?;
    let g = y.sum_all()?.backward()?;
    assert!(g.get(&p.w1).is_some() && g.get(&x).is_some());
    let d = lint_derived(x.as_tensor())?;
    assert_eq!((d.states.1, d.note.as_str()), (2, "exp"));
    assert!(d.aux.backward()?.get(&x).is_some());
    let z = lint_tail(x.as_tensor().clone())?;
    assert_eq!(z.dims(), &[2, 4]);
    Ok(())
}

/// Blocks that must compile, warning-free, and run: the forms a statement
/// may take, guards and closures, candle idioms, blocks written by
/// `macro_rules!` templates, a reference alias. They
/// are written as users write blocks, so clippy's style lints are theirs
/// to choose (rustc's warnings are denied).
#[allow(clippy::all)]
mod compiles {
    #[path = "../compiles/forms.rs"]
    mod forms;
    #[path = "../compiles/guards_and_closures.rs"]
    mod guards_and_closures;
    #[path = "../compiles/idioms.rs"]
    mod idioms;
    #[path = "../compiles/macro_rules.rs"]
    mod macro_rules;
    #[path = "../compiles/reference_alias.rs"]
    mod reference_alias;

    #[test]
    fn forms_run() -> candle_core::Result<()> {
        forms::main()
    }

    #[test]
    fn guards_and_closures_run() -> candle_core::Result<()> {
        guards_and_closures::main()
    }

    #[test]
    fn idioms_run() -> candle_core::Result<()> {
        idioms::main()
    }

    #[test]
    fn macro_rules_run() -> candle_core::Result<()> {
        macro_rules::main()
    }

    #[test]
    fn reference_alias_runs() -> candle_core::Result<()> {
        reference_alias::main()
    }
}
