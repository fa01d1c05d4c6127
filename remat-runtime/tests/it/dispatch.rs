//! The macro's dispatch between values made of tensors, plain values,
//! `Result`s and values a statement cannot read.
// The borrows are the point: they select the level.
#![allow(clippy::needless_borrow)]

use candle_core::{DType, Device, Tensor};
use remat_runtime::__private::{
    Probe, Unreadable as _, ViaClone as _, ViaResult as _, ViaTensor as _,
};
use remat_runtime::rules::Readable;

#[derive(Clone, PartialEq, Debug)]
struct Config(u8);

struct NotClone;

#[test]
fn tensors_are_collected_and_plain_values_cloned() {
    let t = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
    let pair = (t.clone(), 3usize);
    let cfg = Config(7);
    let mut out = Vec::new();
    let _: &dyn Readable = (&&&&Probe(&t)).tensors(&mut out);
    let _: &dyn Readable = (&&&&Probe(&pair)).tensors(&mut out);
    let _: &dyn Readable = (&&&&Probe(&cfg)).tensors(&mut out);
    let _: &dyn Readable = (&&&&Probe(&vec![t.clone(), t.clone()])).tensors(&mut out);
    assert_eq!(out.len(), 4);
    let fresh: Vec<Tensor> = (0..4)
        .map(|_| Tensor::ones(2, DType::F32, &Device::Cpu).unwrap())
        .collect();
    let ids: Vec<_> = fresh.iter().map(|t| t.id()).collect();
    let mut it = fresh.into_iter();
    let t2 = (&&&&Probe(&t)).rebuild(&mut it).unwrap();
    let pair2 = (&&&&Probe(&pair)).rebuild(&mut it).unwrap();
    let cfg2 = (&&&&Probe(&cfg)).rebuild(&mut it).unwrap();
    assert_eq!((t2.id(), pair2.0.id(), pair2.1), (ids[0], ids[1], 3));
    assert_eq!(cfg2, cfg);
}

#[test]
fn results_and_unreadable_values_carry_no_tensor_and_never_rebuild() {
    let mut out = Vec::new();
    let r: candle_core::Result<Tensor> = Tensor::zeros(2, DType::F32, &Device::Cpu);
    let _: &dyn Readable = (&&&&Probe(&r)).tensors(&mut out);
    // Level 4 hands the value back: the macro's cast of it to
    // `&dyn Readable` is the compile error (ui-tests/.../params_without_clone).
    let back: &NotClone = (&&&&Probe(&NotClone)).tensors(&mut out);
    assert!(std::ptr::eq(back, back));
    assert!(out.is_empty());
    let mut none = std::iter::empty();
    // A `Result` rebuilds as its `Ok` type (the reader type-checks as if the
    // missing `?` were there), and never gives a value.
    let ok: remat_runtime::Result<Tensor> = (&&&&Probe(&r)).rebuild(&mut none);
    assert!(ok.is_err());
    assert!((&&&&Probe(&NotClone)).rebuild(&mut none).is_err());
}
