//! Offloaded statements: residuals held in host memory between the forward
//! and the backward.
//!
//! A statement under [`Policy::Offload`](crate::Policy::Offload) runs in the
//! forward exactly as a saved one: on leaf copies of its inputs, keeping its
//! tracked graph. When the region's forward has ended, the runtime moves the
//! storages of that graph (the leaf copies, every intermediate and the
//! outputs) to host memory, in place: the graph's tensors keep their ids,
//! shapes and layouts, only their storage shrinks to one element on the
//! device. When the backward sweep reaches the statement, the storages are
//! copied back to the device and the statement's graph runs its backward as
//! a saved statement's does; if a recomputed statement reads one of its
//! outputs, the copy back happens earlier, when the replay reaches it.
//!
//! Candle keeps a statement's residuals inside its graph nodes, so moving
//! them is the only way to offload them: the storages are swapped with
//! candle's public in-place custom-op API.
//!
//! What is moved: every storage of the statement's graph that depends on one
//! of its leaf copies (so that it was created inside the statement and
//! nothing outside the tape holds it). Parameters, and tensors the graph
//! holds that lead to no gradient (a constant mask), stay where they are.
//! Tensors created inside an offloaded statement must not escape it except
//! through its outputs: until the backward, their memory is elsewhere.
//!
//! This module moves one statement's storages (`Offloaded`); the tape
//! picks the statements to move when the region's forward ends
//! (`Tape::swap_out` in `tape/mod.rs`).
//!
//! On a CPU device the residuals already live in host memory: an offloaded
//! statement is kept exactly as a saved one, unless [`swap_on_cpu`] asks
//! for the move anyway (the path a CUDA device takes, observable on a CPU).
//! On CUDA the copies go to page-locked (pinned) host memory and are queued
//! on the stream candle runs its kernels on: the host does not wait for
//! them, and stream order keeps them right with respect to the kernels
//! (see `offload/pinned.rs`). They do not overlap with compute: candle 0.11
//! runs everything on one stream and gives no handle to order its kernels
//! after a side stream's copies. Where pinned memory cannot be had, the copy
//! falls back to pageable memory, synchronously.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, Device, InplaceOp1, Layout, Shape, Tensor, TensorId};

use crate::ambient::{is_on, switched, Switch};
use crate::storage::storage_extent;
use crate::{lock, RematError, Result};

#[cfg(feature = "cuda")]
mod pinned;

/// Runs `f` with offloaded statements on CPU devices moving their residuals
/// out of the graph and back, as on a CUDA device, instead of keeping them
/// as saved statements. Host and device memory are the same on a CPU, so
/// this saves nothing; it shows (in [`MemoryReport`](crate::MemoryReport)'s
/// `host_bytes`) and tests what a GPU run does. Applies to region calls
/// whose forward runs on this thread inside `f`.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::{offload, MemoryReport, Region};
/// let x = Var::ones((4, 8), DType::F32, &Device::Cpu)?;
/// let y = offload::swap_on_cpu(|| {
///     Region::new("r").run(&[x.as_tensor()], |ctx, ins| {
///         let e = ctx.offload("e", &[&ins[0]], |t| t[0].exp())?;
///         ctx.recompute("s", &[&e], |t| t[0].sum_all())
///     })
/// })?;
/// let e = MemoryReport::capture().entries.into_iter().find(|e| e.statement == "e").unwrap();
/// // the leaf copy of x and the output of exp, moved to the host
/// assert_eq!((e.bytes, e.host_bytes), (0, 2 * 32 * 4));
/// let g = y.backward()?.get(&x).unwrap().to_vec2::<f32>()?;
/// assert_eq!(g[0][0], 1f32.exp());
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn swap_on_cpu<R>(f: impl FnOnce() -> R) -> R {
    switched(Switch::SwapOnCpu, f)
}

/// Whether an offloaded statement on `device` moves its residuals.
pub(crate) fn moves(device: &Device) -> bool {
    !device.is_cpu() || is_on(Switch::SwapOnCpu)
}

/// One storage of an offloaded graph.
struct Entry {
    /// A tensor of the graph on that storage, whose layout can be written.
    tensor: Tensor,
    /// The storage's identity, as [`storage_extent`] gives it.
    key: usize,
    /// Its size as the memory report counts it.
    bytes: usize,
    /// Its contents while they are on the host.
    host: Option<Host>,
}

/// A storage's contents on the host.
enum Host {
    /// In ordinary memory (a CPU storage moved out, or a CUDA copy where no
    /// pinned memory could be had).
    Cpu(CpuStorage),
    /// In page-locked memory, copied by the device.
    #[cfg(feature = "cuda")]
    Pinned(pinned::Pinned),
}

/// The residuals of one offloaded statement.
pub(crate) struct Offloaded {
    region: String,
    statement: String,
    entries: Mutex<Vec<Entry>>,
    /// Pinned buffers whose copy back is queued: freed with these, once
    /// the unit's backward has been queued behind the copy.
    retired: Mutex<Vec<Host>>,
}

/// The nodes of a saved statement's graph (its tracked outputs `outs`) that
/// depend on one of its leaf copies `leaves`.
fn private_nodes(leaves: &[Option<Tensor>], outs: &[Tensor]) -> Vec<Tensor> {
    let leaves: HashSet<TensorId> = leaves.iter().flatten().map(|t| t.id()).collect();
    let mut seen = HashSet::new();
    let mut nodes = Vec::new();
    for out in outs.iter().filter(|t| t.track_op()) {
        for node in out.sorted_nodes() {
            if seen.insert(node.id()) {
                nodes.push(node.clone());
            }
        }
    }
    nodes
        .into_iter()
        .filter(|n| {
            leaves.contains(&n.id()) || n.sorted_nodes().iter().any(|a| leaves.contains(&a.id()))
        })
        .collect()
}

impl Offloaded {
    /// Moves the private storages of the graph of a saved statement (its
    /// leaf copies `leaves`, its tracked outputs `outs`) to host memory,
    /// except those in `keep` (parameters). `None` when there is nothing to
    /// move.
    pub(crate) fn swap_out(
        region: &str,
        statement: &str,
        leaves: &[Option<Tensor>],
        outs: &[Tensor],
        keep: &HashSet<usize>,
    ) -> Result<Option<Offloaded>> {
        let mut by_storage: HashMap<usize, Entry> = HashMap::new();
        let mut order = Vec::new();
        for node in private_nodes(leaves, outs) {
            let (key, bytes) = storage_extent(&node);
            if keep.contains(&key) {
                continue;
            }
            let writable = !node.layout().has_internal_overlap();
            match by_storage.get_mut(&key) {
                Some(e) => {
                    e.bytes = e.bytes.max(bytes);
                    if writable && e.tensor.layout().has_internal_overlap() {
                        e.tensor = node;
                    }
                }
                None => {
                    order.push(key);
                    by_storage.insert(
                        key,
                        Entry {
                            tensor: node,
                            key,
                            bytes,
                            host: None,
                        },
                    );
                }
            }
        }
        let offloaded = Offloaded {
            region: region.to_string(),
            statement: statement.to_string(),
            entries: Mutex::new(Vec::new()),
            retired: Mutex::new(Vec::new()),
        };
        let mut entries = Vec::new();
        for key in order {
            let Some(mut entry) = by_storage.remove(&key) else {
                continue;
            };
            // Only broadcast views reach this storage: it cannot be written
            // through them, so it stays on the device.
            if entry.tensor.layout().has_internal_overlap() {
                continue;
            }
            let op = SwapOut::default();
            entry
                .tensor
                .inplace_op1(&op)
                .map_err(|e| offloaded.error("to the host", e))?;
            entry.host = lock(&op.host).take();
            entries.push(entry);
        }
        if entries.is_empty() {
            return Ok(None);
        }
        *lock(&offloaded.entries) = entries;
        Ok(Some(offloaded))
    }

    fn error(&self, direction: &str, source: candle_core::Error) -> RematError {
        RematError::Offload {
            region: self.region.clone(),
            statement: self.statement.clone(),
            direction: direction.to_string(),
            source: std::sync::Arc::new(source),
        }
    }

    /// Copies the residuals back to the device; a no-op once they are there.
    pub(crate) fn restore(&self) -> Result<()> {
        let mut entries = lock(&self.entries);
        for entry in entries.iter_mut() {
            let Some(host) = entry.host.take() else {
                continue;
            };
            let op = SwapIn {
                host: Mutex::new(Some(host)),
            };
            entry
                .tensor
                .inplace_op1(&op)
                .map_err(|e| self.error("back to the device", e))?;
            // A pinned buffer stays until its queued copy is behind us.
            let left = lock(&op.host).take();
            if let Some(left) = left {
                lock(&self.retired).push(left);
            }
        }
        Ok(())
    }

    /// Storages currently on the host: (identity, bytes).
    pub(crate) fn on_host(&self) -> Vec<(usize, usize)> {
        lock(&self.entries)
            .iter()
            .filter(|e| e.host.is_some())
            .map(|e| (e.key, e.bytes))
            .collect()
    }
}

/// Replaces a storage by a one-element one, keeping its contents on the host.
#[derive(Default)]
struct SwapOut {
    host: Mutex<Option<Host>>,
}

/// A one-element storage of `s`'s dtype on `s`'s device.
fn tiny<S>(s: &S) -> candle_core::Result<S>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    s.device().zeros_impl(&Shape::from(()), s.dtype())
}

impl InplaceOp1 for SwapOut {
    fn name(&self) -> &'static str {
        "remat-offload"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        // Host memory already: move the contents, no copy.
        let full = std::mem::replace(s, tiny(s)?);
        *lock(&self.host) = Some(Host::Cpu(full));
        Ok(())
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, _: &Layout) -> candle_core::Result<()> {
        #[cfg(feature = "cuda")]
        let host = match pinned::copy_out(s) {
            Ok(pinned) => Host::Pinned(pinned),
            Err(_) => Host::Cpu(s.to_cpu_storage()?),
        };
        #[cfg(not(feature = "cuda"))]
        let host = Host::Cpu(s.to_cpu_storage()?);
        // The device buffer is freed here, stream-ordered after the copy.
        *s = tiny(s)?;
        *lock(&self.host) = Some(host);
        Ok(())
    }
}

/// Puts a storage's contents back from the host.
struct SwapIn {
    /// Taken when moved into the storage; a pinned buffer, copied from,
    /// stays for the caller to keep until its copy has run.
    host: Mutex<Option<Host>>,
}

impl SwapIn {
    /// The host contents in ordinary memory, checked against the storage
    /// they go back into.
    fn take_cpu(&self, dtype: candle_core::DType) -> candle_core::Result<CpuStorage> {
        let fail = |msg: String| Err(candle_core::Error::Msg(msg));
        match lock(&self.host).take() {
            Some(Host::Cpu(host)) if host.dtype() == dtype => Ok(host),
            Some(Host::Cpu(host)) => fail(format!(
                "remat: the host copy is {:?} but the storage is {dtype:?}",
                host.dtype()
            )),
            #[cfg(feature = "cuda")]
            Some(Host::Pinned(_)) => {
                fail("remat: a pinned copy cannot go back into a CPU storage".into())
            }
            None => fail("remat: offloaded storage restored twice".into()),
        }
    }
}

impl InplaceOp1 for SwapIn {
    fn name(&self) -> &'static str {
        "remat-restore"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        *s = self.take_cpu(s.dtype())?;
        Ok(())
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, _: &Layout) -> candle_core::Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(Host::Pinned(pinned)) = &*lock(&self.host) {
            return pinned::copy_back(s, pinned);
        }
        *s = s
            .device()
            .storage_from_cpu_storage_owned(self.take_cpu(s.dtype())?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// A restore that fails (here: a host copy of the wrong dtype, the
    /// check that guards the copy back) is an `Offload` error naming the
    /// region and the statement, and the storage stays as it was.
    #[test]
    fn a_failed_restore_names_the_region_and_the_statement() {
        let t = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        let entry = Entry {
            tensor: t.clone(),
            key: storage_extent(&t).0,
            bytes: 16,
            host: Some(Host::Cpu(CpuStorage::F64(vec![0.0; 4]))),
        };
        let offloaded = Offloaded {
            region: "blk".into(),
            statement: "h".into(),
            entries: Mutex::new(vec![entry]),
            retired: Mutex::new(Vec::new()),
        };
        let e = offloaded.restore().unwrap_err();
        assert!(matches!(&e, RematError::Offload { region, statement, .. }
            if region == "blk" && statement == "h"));
        let text = e.to_string();
        assert!(
            text.starts_with(
                "region `blk`: copying the residuals of offloaded statement `h` back to the \
                 device failed: remat: the host copy is F64 but the storage is F32"
            ),
            "{text}"
        );
        assert!(text.contains("#[save]"), "{text}");
        assert_eq!(t.to_vec1::<f32>().unwrap(), vec![0.0; 4]);
    }
}
