//! The replay trace and the side-by-side view of a replay error, pinned
//! as text (insta snapshots in `tests/snapshots/`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::*;
use candle_core::{DType, Result, Tensor, Var};
use remat_runtime::inspect::Trace;
use remat_runtime::{remat, Plan, Region, RematError};

#[derive(Clone)]
pub struct P {
    w1: Var,
    w2: Var,
}

remat! {
    fn mlp(x: &Tensor, p: &P) -> Result<Tensor> {
        #[save(name = "fc1")] let h = x.matmul(&p.w1)?;
        let g = h.gelu_erf()?;
        let o = g.matmul(&p.w2)?;
        #[recompute] let y = (x + o)?;
        Ok(y)
    }
}

#[test]
fn trace_of_forward_and_replay() {
    let x = var(&[4, 8], 1, 1.0, DType::F32);
    let p = P {
        w1: var(&[8, 16], 2, 0.3, DType::F32),
        w2: var(&[16, 8], 3, 0.3, DType::F32),
    };
    let (grads, trace) = Trace::record(|| {
        let y = Plan::save_only(["o"]).scope(|| mlp(x.as_tensor(), &p))?;
        let y = mlp(&y, &p)?;
        y.sum_all()?.backward()
    });
    assert!(grads.unwrap().get(&p.w1).is_some());
    insta::assert_snapshot!(trace.to_string());
}

#[test]
fn a_replay_error_shows_both_runs_side_by_side() {
    let x = var(&[2, 3], 4, 1.0, DType::F32);
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let y = Region::new("blk")
        .run(&[x.as_tensor()], move |ctx, ins| {
            let a = ctx.save("a", &[&ins[0]], |t| t[0].exp())?;
            let b = ctx.open("b", &[&a], |t| t[0].tanh())?;
            // The replay (second call) runs another statement here.
            let name = if c.fetch_add(1, Ordering::SeqCst) == 0 {
                "c"
            } else {
                "other"
            };
            let c = ctx.recompute(name, &[&b], |t| t[0].sqr())?;
            ctx.recompute("d", &[&c], |t| t[0].sum_all())
        })
        .unwrap();
    let e = remat_runtime::backward(&y).unwrap_err();
    assert!(matches!(&e, RematError::ReplayDesync { .. }));
    insta::assert_snapshot!(e.to_string());
}
