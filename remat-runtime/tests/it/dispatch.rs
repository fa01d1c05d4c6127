//! How `rt::read(&x).arg()` hands a value to a statement, by its type:
//! values made of tensors through their tensors, other `Clone` values
//! cloned, `Result`s (a missing `?`) and values that are not `Clone`
//! standing for a value that is never rebuilt.

use candle_core::{DType, Device, Tensor};
use remat_runtime::__private::{
    read, Arg as _, Args, ByClone as _, ByTensors as _, FromResult as _, NotClone as _, Reach,
};

#[derive(Clone, PartialEq, Debug)]
struct Config(u8);

struct NotClone;

fn ones() -> Tensor {
    Tensor::ones(2, DType::F32, &Device::Cpu).unwrap()
}

#[test]
fn tensors_are_handed_over_and_plain_values_cloned() {
    let t = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
    let pair = (t.clone(), 3usize);
    let cfg = Config(7);
    let list = vec![t.clone(), t.clone()];
    let args = (
        read(&t).arg(),
        read(&pair).arg(),
        read(&cfg).arg(),
        read(&list).arg(),
    );
    let (tensors, n_values, _) = args.tensors();
    assert_eq!((tensors.len(), n_values), (4, 4));
    let fresh: Vec<Tensor> = (0..4).map(|_| ones()).collect();
    let ids: Vec<_> = fresh.iter().map(|t| t.id()).collect();
    let (t2, pair2, cfg2, list2) = args.values_from(&fresh, 4).unwrap();
    assert_eq!((t2.id(), pair2.0.id(), pair2.1), (ids[0], ids[1], 3));
    assert_eq!(cfg2, cfg);
    assert_eq!((list2[0].id(), list2[1].id()), (ids[2], ids[3]));
}

#[test]
fn reads_without_gradient_come_after_the_values() {
    let (a, b, c) = (ones(), ones(), ones());
    // `b` is read only for its shape: handed over last, not counted.
    let args = (
        read(&a).arg(),
        read(&b).arg().without_grad(),
        read(&c).arg(),
    );
    let (tensors, n_values, _) = args.tensors();
    assert_eq!(n_values, 2);
    let order: Vec<_> = tensors.iter().map(|t| t.id()).collect();
    assert_eq!(order, vec![a.id(), c.id(), b.id()]);
    let fresh: Vec<Tensor> = (0..3).map(|_| ones()).collect();
    let (a2, b2, c2) = args.values_from(&fresh, n_values).unwrap();
    assert_eq!(
        (a2.id(), c2.id(), b2.id()),
        (fresh[0].id(), fresh[1].id(), fresh[2].id())
    );
}

#[test]
fn a_value_read_in_part_marks_the_range_of_its_tensors() {
    let (a, b, c) = (ones(), ones(), ones());
    let parts = vec![ones(), ones(), ones()];
    let one = vec![ones()];
    // `parts` read as `parts[0]`: its three tensors, of which one reached
    // is enough; a value of one tensor read in part is read whole.
    let args = (
        read(&a).arg(),
        read(&b).arg().without_grad(),
        read(&parts).arg().partly(),
        read(&one).arg().partly(),
        read(&c).arg(),
    );
    let (tensors, n_values, in_part) = args.tensors();
    assert_eq!((tensors.len(), n_values), (7, 6));
    assert_eq!(in_part, vec![Reach::OneOf(1..4)]);
    let (_, _, parts2, one2, c2) = args.values_from(&tensors, n_values).unwrap();
    assert_eq!(
        (parts2[2].id(), one2[0].id(), c2.id()),
        (parts[2].id(), one[0].id(), c.id())
    );
}

#[test]
fn long_reads_nest() {
    let ts: Vec<Tensor> = (0..14).map(|_| ones()).collect();
    let args = (
        (
            read(&ts[0]).arg(),
            read(&ts[1]).arg(),
            read(&ts[2]).arg(),
            read(&ts[3]).arg(),
            read(&ts[4]).arg(),
            read(&ts[5]).arg(),
            read(&ts[6]).arg(),
            read(&ts[7]).arg(),
            read(&ts[8]).arg(),
            read(&ts[9]).arg(),
            read(&ts[10]).arg(),
            read(&ts[11]).arg(),
        ),
        (read(&ts[12]).arg(), read(&ts[13]).arg()),
    );
    let (tensors, n, _) = args.tensors();
    assert_eq!((tensors.len(), n), (14, 14));
    let (_, (_, last)) = args.values_from(&tensors, n).unwrap();
    assert_eq!(last.id(), ts[13].id());
}

#[test]
fn results_and_values_that_are_not_clone_carry_no_tensor_and_never_rebuild() {
    let r: candle_core::Result<Tensor> = Tensor::zeros(2, DType::F32, &Device::Cpu);
    // A `Result` stands for its `Ok` type (the reader type-checks as if the
    // missing `?` were there, which is reported where it is made).
    let args = (read(&r).arg(),);
    assert_eq!(args.tensors().0.len(), 0);
    let ok: remat_runtime::Result<(Tensor,)> = args.values_from(&[], 0);
    assert!(ok.is_err());
    // Not `Clone`: the macro's `Readable` check is the compile error
    // (ui-tests/.../params_without_clone); the level never rebuilds.
    let args = (read(&NotClone).arg(),);
    assert_eq!(args.tensors().0.len(), 0);
    assert!(args.values_from(&[], 0).is_err());
}

#[test]
fn a_value_read_on_a_branch_marks_the_range_of_its_tensors() {
    let (a, b) = (ones(), ones());
    let pair = (ones(), ones());
    // `b` and `pair` read on a branch (`if skip { (a + b)? } else { a }`):
    // none of their tensors need be reached, a value of one tensor too.
    let args = (
        read(&a).arg(),
        read(&b).arg().on_branch(),
        read(&pair).arg().on_branch(),
    );
    let (tensors, n_values, reach) = args.tensors();
    assert_eq!((tensors.len(), n_values), (4, 4));
    assert_eq!(reach, vec![Reach::NoneOf(1..2), Reach::NoneOf(2..4)]);
    let (_, b2, pair2) = args.values_from(&tensors, n_values).unwrap();
    assert_eq!((b2.id(), pair2.1.id()), (b.id(), pair.1.id()));
}
