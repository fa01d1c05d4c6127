//! The macro's dispatch between values made of tensors and plain values.
// The double borrows are the point: they select the impl.
#![allow(clippy::needless_borrow)]

use candle_core::{DType, Device, Tensor};
use remat_runtime::__private::{Probe, ViaPlain as _, ViaTensor as _};

#[derive(Clone, PartialEq, Debug)]
struct Config(u8);

#[test]
fn tensors_are_collected_and_plain_values_cloned() {
    let t = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
    let pair = (t.clone(), 3usize);
    let cfg = Config(7);
    let mut out = Vec::new();
    (&&Probe(&t)).__remat_collect(&mut out);
    (&&Probe(&pair)).__remat_collect(&mut out);
    (&&Probe(&cfg)).__remat_collect(&mut out);
    (&&Probe(&vec![t.clone(), t.clone()])).__remat_collect(&mut out);
    assert_eq!(out.len(), 4);
    let fresh: Vec<Tensor> = (0..4)
        .map(|_| Tensor::ones(2, DType::F32, &Device::Cpu).unwrap())
        .collect();
    let ids: Vec<_> = fresh.iter().map(|t| t.id()).collect();
    let mut it = fresh.into_iter();
    let t2 = (&&Probe(&t)).__remat_rebuild(&mut it).unwrap();
    let pair2 = (&&Probe(&pair)).__remat_rebuild(&mut it).unwrap();
    let cfg2 = (&&Probe(&cfg)).__remat_rebuild(&mut it).unwrap();
    assert_eq!((t2.id(), pair2.0.id(), pair2.1), (ids[0], ids[1], 3));
    assert_eq!(cfg2, cfg);
}
