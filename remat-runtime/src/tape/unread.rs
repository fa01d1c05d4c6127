//! Unread outputs: a recomputed statement's output that nothing in the
//! replay reads (a region's last statement, whose output only the sweep's
//! seed sees) need not be computed again when the op that gives it has a
//! backward that does not read it (`nn::gelu_mlp`, `nn::linear`: their
//! backwards read their inputs). PyTorch's checkpoint stops its
//! recomputation early for the same reason.
//!
//! The forward finds them and the replay applies them, through one
//! thread-local watch per running statement (every statement, in every
//! mode, so that an op call always counts in the statement that made it):
//!
//! * in the forward, every such op call says what it gave and the input
//!   its backward reads ([`op_output`]); when the statement's whole value
//!   is one op call's tensor as it is ([`sole_call`]: no other tensor and
//!   no plain data another op or the block could have computed from it),
//!   the record names the call, and the op's input is fingerprinted if
//!   the next statement is saved or none follows
//!   (`Recorder::pending_sole`); when
//!   the forward ends, the value is unread if the statement is the last
//!   recomputed one of the region (no later statement's code, nor block
//!   code feeding one, could have read it) and no later recomputed
//!   statement declares it;
//! * in the replay, a call whose value nothing reads gives NaN of the
//!   output's shape instead of computing it ([`uncomputed`]); the replay
//!   checks that it is again the statement's whole value, and compares the
//!   op's input with the forward's in place of the output.

use std::cell::RefCell;

use candle_core::{DType, Device, Shape, Tensor, TensorId};

use crate::ambient::scoped;

/// One op call of a running statement.
pub(crate) struct OpCall {
    /// The tensor it gave.
    pub output: TensorId,
    /// The input its backward reads (besides parameters).
    pub input: Tensor,
}

/// What the op calls of one running statement see.
struct Watch {
    /// The call to leave uncomputed (the replay's).
    skip: Option<usize>,
    calls: Vec<OpCall>,
}

thread_local! {
    /// One watch per running statement, the innermost last (a statement
    /// may run a region whose statements run inside it).
    static WATCHES: RefCell<Vec<Watch>> = const { RefCell::new(Vec::new()) };
}

/// Runs a statement's code with a watch on its op calls; `skip`: the call
/// to leave uncomputed (the replay's). Returns what the code returned and
/// its op calls, in order.
pub(crate) fn watch<R>(skip: Option<usize>, body: impl FnOnce() -> R) -> (R, Vec<OpCall>) {
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

/// For an op whose backward reads `input` and parameters, never its
/// output: runs `compute` with whether to leave the output uncomputed
/// (then it gives [`uncomputed`]), and tells the running statement's watch
/// what it gave. Outside a statement, or in a forward, the output is
/// computed.
pub(crate) fn op_output(
    input: &Tensor,
    compute: impl FnOnce(bool) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let skip = WATCHES.with(|w| {
        w.borrow()
            .last()
            .is_some_and(|w| w.skip == Some(w.calls.len()))
    });
    let t = compute(skip)?;
    WATCHES.with(|w| {
        if let Some(w) = w.borrow_mut().last_mut() {
            w.calls.push(OpCall {
                output: t.id(),
                input: input.clone(),
            });
        }
    });
    Ok(t)
}

/// The value of an output left uncomputed: NaN (zeros for integers) in
/// the output's shape, so that code reading it anyway computes NaN. Full
/// size: the op's node needs a storage of its shape.
pub(crate) fn uncomputed(
    shape: impl Into<Shape>,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    crate::graph::nan_scalar(dtype, device)?
        .broadcast_as(shape)?
        .contiguous()
}

/// The op call whose tensor is a statement's whole value: its only tensor
/// `outputs[0]`, with no plain data beside it (a skeleton `S` of no size).
/// Any other output, or plain data, could have been computed from the
/// tensor by means no graph shows (an integer op, `detach`, `to_scalar`).
pub(crate) fn sole_call<S>(calls: &[OpCall], outputs: &[Tensor]) -> Option<u16> {
    match outputs {
        [only] if std::mem::size_of::<S>() == 0 => {
            let c = calls.iter().position(|c| c.output == only.id())?;
            u16::try_from(c).ok()
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_counted_per_statement_and_only_the_one_named_is_skipped() {
        let dev = Device::Cpu;
        let x = Tensor::zeros(2, DType::F32, &dev).unwrap();
        let op = |v: f32| {
            op_output(&x, |skip| {
                if skip {
                    uncomputed(2, DType::F32, &dev)
                } else {
                    Tensor::new(&[v, v], &dev)
                }
            })
        };
        let ((a, b), calls) = watch(Some(1), || {
            let a = op(1.0).unwrap();
            let (inner, inner_calls) = watch(None, || op(3.0).unwrap());
            assert_eq!(inner_calls.len(), 1);
            assert_eq!(inner_calls[0].output, inner.id());
            assert_eq!(inner.to_vec1::<f32>().unwrap(), [3.0, 3.0]);
            (a, op(2.0).unwrap())
        });
        let seen: Vec<_> = calls.iter().map(|c| c.output).collect();
        assert_eq!(seen, vec![a.id(), b.id()]);
        assert_eq!(a.to_vec1::<f32>().unwrap(), [1.0, 1.0]);
        assert!(b.to_vec1::<f32>().unwrap().iter().all(|v| v.is_nan()));
        // Outside a statement: computed.
        assert_eq!(op(4.0).unwrap().to_vec1::<f32>().unwrap(), [4.0, 4.0]);
        // The whole value: one tensor, no plain data.
        let c = b.clone();
        assert_eq!(sole_call::<()>(&calls, std::slice::from_ref(&b)), Some(1));
        assert_eq!(sole_call::<()>(&calls, &[b, c]), None);
        assert_eq!(sole_call::<usize>(&calls, std::slice::from_ref(&a)), None);
    }
}
