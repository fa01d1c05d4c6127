//! Taps: the region outputs candle sees.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, Shape, Storage, Tensor, TensorId};

use super::{copy_compact, wrong_device};
use crate::backward::{Call, TapeState};

/// Attaches a region call's `outputs` to candle's graph: one tap per
/// output on the top of the anchor chain over `anchored` (constants stay as
/// they are); then moves what the call's offloaded statements hold to the
/// host, now that the taps have copied the outputs.
pub(crate) fn attach(
    call: &Arc<Call>,
    anchored: &[Tensor],
    outputs: Vec<Tensor>,
    constant: &[bool],
) -> crate::Result<Vec<Tensor>> {
    let top = super::anchor_chain(call, anchored)?;
    let number = CALLS.fetch_add(1, Ordering::Relaxed);
    let attached = outputs
        .into_iter()
        .enumerate()
        .map(|(index, t)| {
            if constant[index] {
                return Ok(t);
            }
            let tap = Tap {
                call: call.clone(),
                index,
                value: Mutex::new(Some(t)),
            };
            Ok(top.apply_op1(tap)?)
        })
        .collect::<crate::Result<Vec<Tensor>>>()?;
    let given: Vec<TensorId> = attached
        .iter()
        .zip(constant)
        .filter(|(_, &c)| !c)
        .map(|(t, _)| t.id())
        .collect();
    {
        let mut live = crate::lock(&OUTPUTS);
        for &id in &given {
            live.insert(id, (number, call.name.clone()));
        }
    }
    *crate::lock(&call.given) = given;
    if let TapeState::Live { tape, .. } = &mut *crate::lock(&call.tape) {
        tape.swap_out(&call.name)?;
    }
    Ok(attached)
}

/// A region output: copies the value the block computed in its forward,
/// hands the output's gradient to the region call in its backward.
/// The region outputs candle sees (taps' values) of live calls, each with
/// the number of the call that gave it (in the order calls attached their
/// outputs) and its region's name.
static OUTPUTS: LazyLock<Mutex<HashMap<TensorId, (u64, String)>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The number the next call attaching its outputs takes.
static CALLS: AtomicU64 = AtomicU64::new(0);

/// The number the next call attaching its outputs will take: a forward
/// starting now takes it, and so tells the outputs of calls before it
/// from those of regions nested in its statements ([`given_before`]).
pub(crate) fn calls_so_far() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// The region whose call, attached before call number `start`, gave `t`
/// as an output, if one did.
pub(crate) fn given_before(t: &Tensor, start: u64) -> Option<String> {
    match crate::lock(&OUTPUTS).get(&t.id()) {
        Some((number, region)) if *number < start => Some(region.clone()),
        _ => None,
    }
}

/// Forgets the outputs `given` of a call that ended.
pub(crate) fn forget(given: &[TensorId]) {
    if given.is_empty() {
        return;
    }
    let mut live = crate::lock(&OUTPUTS);
    for id in given {
        live.remove(id);
    }
}

pub(crate) struct Tap {
    pub call: Arc<Call>,
    pub index: usize,
    /// The output the block computed, taken by the tap's forward.
    pub value: Mutex<Option<Tensor>>,
}

impl Tap {
    fn with_value<R>(
        &self,
        f: impl FnOnce(&Storage, &Layout) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let value = self
            .value
            .lock()
            .map_err(|_| candle_core::Error::Msg("remat: poisoned tap".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("remat: tap evaluated twice".into()))?;
        let (storage, layout) = value.storage_and_layout();
        f(&storage, layout)
    }
}

impl CustomOp1 for Tap {
    fn name(&self) -> &'static str {
        "remat-tap"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.with_value(|s, l| match s {
            Storage::Cpu(s) => copy_compact(s, l),
            _ => Err(wrong_device("a region output")),
        })
    }
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        self.with_value(|s, l| match s {
            Storage::Cuda(s) => copy_compact(s, l),
            _ => Err(wrong_device("a region output")),
        })
    }
    fn bwd(&self, arg: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.call.set_output_grad(self.index, grad.clone());
        Ok(Some(arg.zeros_like()?))
    }
}
