//! No false alarms: a block may return constants (no gradient to lose),
//! whatever way it builds them.

use candle_core::{DType, Device, Result, Tensor, Var};
use remat_runtime::{backward, remat, Plan, Region, RematError};

use crate::common::{rel_diff, var};

remat! {
    fn exp_and_zeros(x: &Tensor) -> Result<(Tensor, Tensor)> {
        let y = x.exp()?;
        Ok((y, Tensor::zeros(3, x.dtype(), x.device())?))
    }
}

remat! {
    fn only_zeros(x: &Tensor) -> Result<Tensor> {
        let z = Tensor::zeros(x.shape(), x.dtype(), x.device())?;
        Ok(z)
    }
}

#[test]
fn a_block_may_return_constants() {
    for dtype in [DType::F32, DType::F64] {
        for plan in [Plan::recompute_all(), Plan::save_all(), Plan::off()] {
            let x = var(&[4, 5], 1, 1.0, dtype);
            let (y, z) = plan.scope(|| exp_and_zeros(x.as_tensor())).unwrap();
            assert_eq!(z.dims(), &[3]);
            let g = backward(&(y.sum_all().unwrap() + z.sum_all().unwrap()).unwrap()).unwrap();
            let expected = x.as_tensor().exp().unwrap();
            assert!(rel_diff(g.get(&x).unwrap(), &expected) < 1e-6, "{plan}");
            let z = plan.scope(|| only_zeros(x.as_tensor())).unwrap();
            assert_eq!(
                z.to_dtype(DType::F64)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap(),
                0.0
            );
        }
    }
}

#[test]
fn the_statement_api_may_return_constants_but_not_ops_on_tracked_values() {
    for dtype in [DType::F32, DType::F64] {
        let x = var(&[4, 5], 2, 1.0, dtype);
        // A constant beside a statement's output, on the region's first
        // forward (which looks at every value) and on later ones.
        for _ in 0..2 {
            let (y, z): (Tensor, Tensor) = Region::new("api")
                .run(&[x.as_tensor()], move |ctx, ins| {
                    let y = ctx.recompute("sq", &[&ins[0]], |t| t[0].sqr())?;
                    Ok((y, Tensor::ones(2, dtype, &Device::Cpu)?))
                })
                .unwrap();
            assert_eq!(
                z.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap(),
                vec![1.0, 1.0]
            );
            let g = backward(&(y.sum_all().unwrap() + z.sum_all().unwrap()).unwrap()).unwrap();
            let expected = (x.as_tensor() * 2.0).unwrap();
            assert!(rel_diff(g.get(&x).unwrap(), &expected) < 1e-12);
        }
        // An op on the input outside any statement loses its gradient: the
        // region's first forward sees it (its inputs are leaves there).
        let w = Var::ones(3, dtype, &Device::Cpu).unwrap();
        let e = Region::new("outside")
            .run(&[x.as_tensor()], |_ctx, ins| Ok(ins[0].exp()?))
            .unwrap_err();
        assert!(
            matches!(e, RematError::OutputOutsideStatement { index: 0, .. }),
            "{e:?}"
        );
        // So is an op on a parameter, on any forward.
        let wt = w.as_tensor().clone();
        for _ in 0..2 {
            let wt = wt.clone();
            let e = Region::new("outside.param")
                .run(&[x.as_tensor()], move |ctx, ins| {
                    let y = ctx.recompute("sq", &[&ins[0]], |t| t[0].sqr())?;
                    Ok((y, wt.exp()?))
                })
                .map(|_: (Tensor, Tensor)| ())
                .unwrap_err();
            assert!(
                matches!(e, RematError::OutputOutsideStatement { index: 1, .. }),
                "{e:?}"
            );
        }
    }
}

remat! {
    /// Saved statements whose outputs are views of the block's input.
    fn saved_views(x: &Tensor) -> Result<(bool, bool)> {
        #[save] let t = x.t()?;
        #[save] let n = x.narrow(1, 1, 2)?;
        let seen = (t.is_contiguous(), n.is_contiguous());
        Ok(seen)
    }
}

#[test]
fn saved_views_stay_views() {
    // The block sees the views its saved statements made, not copies.
    let x = var(&[4, 5], 3, 1.0, DType::F32);
    for plan in [Plan::declared(), Plan::save_all()] {
        let seen = plan.scope(|| saved_views(x.as_tensor())).unwrap();
        assert_eq!(seen, (false, false), "{plan}");
    }
    // The statement API, after the region's first forward (which hands the
    // block copies of every value that needs gradients, to look for
    // undeclared reads): views.
    for call in 0..2 {
        let y: (Tensor, Tensor) = Region::new("views")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let t = ctx.save("t", &[&ins[0]], |t| t[0].t())?;
                let n = ctx.save("n", &[&ins[0]], |t| t[0].narrow(1, 1, 2))?;
                if !ctx.is_replay() {
                    let copies = call == 0;
                    assert_eq!((t.is_contiguous(), n.is_contiguous()), (copies, copies));
                }
                let a = ctx.recompute("a", &[&t], |t| t[0].exp())?;
                let b = ctx.recompute("b", &[&n], |t| t[0].sqr())?;
                Ok((a, b))
            })
            .unwrap();
        let g = backward(&(y.0.sum_all().unwrap() + y.1.sum_all().unwrap()).unwrap()).unwrap();
        let plain = (x.as_tensor().t().unwrap().exp().unwrap().sum_all().unwrap()
            + x.as_tensor()
                .narrow(1, 1, 2)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap())
        .unwrap();
        let pg = plain.backward().unwrap();
        assert!(rel_diff(g.get(&x).unwrap(), pg.get(&x).unwrap()) < 1e-6);
    }
}

remat! {
    /// A ramp and a causal mask built from the input's metadata only, read
    /// by the statements around them.
    fn ramp_and_mask(x: &Tensor) -> Result<Tensor> {
        let t = x.dim(1)?;
        let ramp = Tensor::arange(0u32, t as u32, x.device())?.to_dtype(x.dtype())?;
        let mask = Tensor::tril2(t, x.dtype(), x.device())?;
        let h = x.broadcast_add(&ramp)?;
        let m = h.matmul(&mask)?;
        let y = (m * &h)?;
        Ok(y)
    }
}

#[test]
fn constants_from_an_inputs_metadata_under_every_plan() {
    let names = ["t", "ramp", "mask", "h", "m", "y"];
    for dtype in [DType::F32, DType::F64] {
        let x = var(&[3, 4], 4, 1.0, dtype);
        let plain = {
            let t = 4usize;
            let ramp = Tensor::arange(0u32, t as u32, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let mask = Tensor::tril2(t, dtype, &Device::Cpu).unwrap();
            let h = x.as_tensor().broadcast_add(&ramp).unwrap();
            let y = (h.matmul(&mask).unwrap() * &h).unwrap();
            let g = backward(&y.sum_all().unwrap()).unwrap();
            (y.detach(), g.get(&x).unwrap().clone())
        };
        let mut plans = vec![Plan::declared(), Plan::save_all(), Plan::recompute_all()];
        plans.extend(names.iter().map(|n| Plan::save_only([*n])));
        plans.push(Plan::save_only(["ramp", "mask"]));
        plans.push(Plan::save_only(["ramp", "m"]));
        for plan in plans {
            let y = plan.scope(|| ramp_and_mask(x.as_tensor())).unwrap();
            assert!(rel_diff(&y, &plain.0) < 1e-12, "{plan}");
            let g = backward(&y.sum_all().unwrap())
                .unwrap_or_else(|e| panic!("{plan} ({dtype:?}): {e}"));
            assert!(rel_diff(g.get(&x).unwrap(), &plain.1) < 1e-6, "{plan}");
        }
    }
}
