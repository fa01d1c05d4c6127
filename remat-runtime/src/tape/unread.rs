//! Unread outputs: a recomputed statement's output that nothing in the
//! replay reads (a region's last statement, whose output only the sweep's
//! seed sees) need not be computed again when the op that gives it has a
//! backward that does not read it (`nn::gelu_mlp`, `nn::linear`: their
//! backwards read their inputs). PyTorch's checkpoint stops its
//! recomputation early for the same reason.
//!
//! The forward finds them and the replay applies them, through one
//! thread-local watch per running statement:
//!
//! * in the forward, every such op call of a recomputed statement says what
//!   it gave ([`op_output`]); the recorder keeps the calls whose tensor is
//!   an output of the statement that no other op of the statement read
//!   ([`unread_calls`]), and, when the forward ends, those whose output no
//!   later recomputed statement reads;
//! * in the replay, those calls give a NaN tensor of the output's shape
//!   instead of computing it (a placeholder, like a saved output the
//!   replay does not read), and the replay checks that each is the output
//!   the forward said, and leaves it out of the fingerprint check.

use std::cell::RefCell;

use candle_core::{DType, Device, Shape, Tensor, TensorId};

use crate::ambient::scoped;

/// What the op calls of one running statement see.
struct Watch {
    /// Bit `c`: leave call `c` uncomputed (the replay's); 0 in the forward.
    skip: u32,
    /// The op calls so far, each with the tensor it gave and whether it
    /// was left uncomputed.
    calls: Vec<(TensorId, bool)>,
}

thread_local! {
    /// One watch per running statement, the innermost last (a statement
    /// may run a region whose statements run inside it).
    static WATCHES: RefCell<Vec<Watch>> = const { RefCell::new(Vec::new()) };
}

/// Runs a statement's code with a watch on its op calls; bit `c` of
/// `skip`: leave call `c` uncomputed (the replay's). Returns what the code
/// returned and, per op call, the tensor it gave and whether it was left
/// uncomputed.
pub(crate) fn watch<R>(skip: u32, body: impl FnOnce() -> R) -> (R, Vec<(TensorId, bool)>) {
    let watch = Watch {
        skip,
        calls: Vec::new(),
    };
    let mut calls = Vec::new();
    let out = scoped(
        || WATCHES.with(|w| w.borrow_mut().push(watch)),
        || {
            if let Some(w) = WATCHES.with(|w| w.borrow_mut().pop()) {
                calls = w.calls;
            }
        },
        body,
    );
    (out, calls)
}

/// For an op whose backward does not read its output: runs `compute` with
/// whether to leave the output uncomputed (then it gives [`uncomputed`]),
/// and tells the running statement's watch what it gave. Outside a
/// statement, or in a forward, the output is computed.
pub(crate) fn op_output(
    compute: impl FnOnce(bool) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let skip = WATCHES.with(|w| {
        w.borrow()
            .last()
            .is_some_and(|w| w.calls.len() < 32 && w.skip & (1 << w.calls.len()) != 0)
    });
    let t = compute(skip)?;
    WATCHES.with(|w| {
        if let Some(w) = w.borrow_mut().last_mut() {
            w.calls.push((t.id(), skip));
        }
    });
    Ok(t)
}

/// The value of an output left uncomputed: NaN (zeros for integers) in
/// the output's shape, so that code reading it anyway computes NaN.
pub(crate) fn uncomputed(
    shape: impl Into<Shape>,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let scalar = if dtype.is_float() {
        Tensor::new(f64::NAN, device)?.to_dtype(dtype)?
    } else {
        Tensor::zeros((), dtype, device)?
    };
    scalar.broadcast_as(shape)?.contiguous()
}

/// The op calls of a forward's statement whose tensor is one of its
/// `outputs` (still attached to the statement's graph) and read by no other
/// op of the statement: `(call, output)`. A call whose tensor carries no
/// graph is left out: nothing would show a read of it.
pub(crate) fn unread_calls(calls: &[(TensorId, bool)], outputs: &[Tensor]) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    for (call, (id, _)) in calls.iter().enumerate() {
        let Some(j) = outputs.iter().position(|t| t.id() == *id) else {
            continue;
        };
        if !outputs[j].track_op() {
            continue;
        }
        let read = outputs
            .iter()
            .filter(|t| t.id() != *id && t.track_op())
            .any(|t| t.sorted_nodes().iter().any(|n| n.id() == *id));
        if !read {
            found.push((call, j));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use candle_core::Var;

    use super::*;

    #[test]
    fn calls_are_counted_per_statement_and_only_the_listed_skip() {
        let dev = Device::Cpu;
        let op = |v: f32| {
            op_output(|skip| {
                if skip {
                    uncomputed(2, DType::F32, &dev)
                } else {
                    Tensor::new(&[v, v], &dev)
                }
            })
        };
        let ((a, b), calls) = watch(0b10, || {
            let a = op(1.0).unwrap();
            let (inner, inner_calls) = watch(0, || op(3.0).unwrap());
            assert_eq!(inner_calls, vec![(inner.id(), false)]);
            (a, op(2.0).unwrap())
        });
        assert_eq!(calls, vec![(a.id(), false), (b.id(), true)]);
        assert_eq!(a.to_vec1::<f32>().unwrap(), [1.0, 1.0]);
        assert!(b.to_vec1::<f32>().unwrap().iter().all(|v| v.is_nan()));
        // Outside a statement: computed.
        assert_eq!(op(4.0).unwrap().to_vec1::<f32>().unwrap(), [4.0, 4.0]);
    }

    #[test]
    fn an_output_another_op_read_is_not_unread() {
        let w = Var::ones(2, DType::F32, &Device::Cpu).unwrap();
        let y = (w.as_tensor() * 2.0).unwrap();
        let z = y.exp().unwrap();
        let calls = [(y.id(), false)];
        assert_eq!(unread_calls(&calls, std::slice::from_ref(&y)), vec![(0, 0)]);
        assert_eq!(unread_calls(&calls, &[z.clone(), y.clone()]), vec![]);
        // Untracked: nothing would show a read.
        let c = Tensor::ones(2, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(unread_calls(&[(c.id(), false)], &[c]), vec![]);
    }
}
