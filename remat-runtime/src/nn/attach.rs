//! A forward computed outside candle's graph, handed to a `CustomOp` node.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, Result, Shape, Storage, Tensor};

/// The output of an op's forward, computed outside the graph, taken once
/// by the node's forward (and released there).
pub(crate) struct Computed(Mutex<Option<Tensor>>);

impl Computed {
    pub fn new(t: Tensor) -> Self {
        Computed(Mutex::new(Some(t)))
    }

    fn take(&self) -> Result<Tensor> {
        let _profile = crate::inspect::profile::op("(inside an op) output copy");
        let t = crate::lock(&self.0).take();
        let t = t.ok_or_else(|| candle_core::Error::Msg("remat nn: forward taken twice".into()))?;
        // A fresh, contiguous storage starting at 0 (what `try_clone` copies).
        if t.is_contiguous() && t.layout().start_offset() == 0 {
            Ok(t)
        } else {
            t.copy()
        }
    }

    /// The output as the node's CPU storage.
    pub fn cpu(&self) -> Result<(CpuStorage, Shape)> {
        let t = self.take()?;
        let (s, l) = t.storage_and_layout();
        match &*s {
            Storage::Cpu(c) => Ok((c.try_clone(l)?, t.shape().clone())),
            _ => Err(candle_core::Error::Msg(
                "remat nn: expected a CPU tensor".into(),
            )),
        }
    }

    /// The output as the node's CUDA storage.
    pub fn cuda(&self) -> Result<(CudaStorage, Shape)> {
        let t = self.take()?;
        let (s, l) = t.storage_and_layout();
        match &*s {
            #[cfg(feature = "cuda")]
            Storage::Cuda(c) => Ok((c.try_clone(l)?, t.shape().clone())),
            _ => {
                let _ = l;
                Err(candle_core::Error::Msg(
                    "remat nn: expected a CUDA tensor".into(),
                ))
            }
        }
    }
}

/// The `name`, `cpu_fwd` and `cuda_fwd` of a `CustomOp1/2/3` whose output
/// is its field `out` (a [`Computed`]), for 1, 2 or 3 inputs.
macro_rules! forward_computed {
    ($name:literal, $($s:ident $l:ident),+) => {
        fn name(&self) -> &'static str {
            $name
        }
        #[allow(unused_variables)]
        fn cpu_fwd(
            &self,
            $($s: &candle_core::CpuStorage, $l: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            self.out.cpu()
        }
        #[allow(unused_variables)]
        fn cuda_fwd(
            &self,
            $($s: &candle_core::CudaStorage, $l: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            self.out.cuda()
        }
    };
}
pub(crate) use forward_computed;
