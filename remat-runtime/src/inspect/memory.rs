//! What the live tapes hold, by region and statement name.

use std::cell::RefCell;
use std::fmt;
use std::sync::{Arc, Weak};

use candle_core::DType;

use crate::backward::{Call, TapeState};
use crate::tape::bytes::{Counter, Seen};
use crate::tape::Kept;
use crate::{lock, Policy};

thread_local! {
    /// Every region call made on this thread that may still hold a tape.
    static LIVE_CALLS: RefCell<Vec<Weak<Call>>> = const { RefCell::new(Vec::new()) };
}

/// Registers a region call made on this thread for [`MemoryReport::capture`].
pub(crate) fn register(call: &Arc<Call>) {
    LIVE_CALLS.with(|live| {
        let mut live = live.borrow_mut();
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(call));
    });
}

/// Forgets the calls on this thread's list that have ended, so that their
/// allocations go with them (a `Weak` keeps its `Arc`'s allocation). Called
/// when a call ends; does nothing while the list is borrowed or the thread
/// is ending.
pub(crate) fn forget_ended() {
    let _ = LIVE_CALLS.try_with(|live| {
        if let Ok(mut live) = live.try_borrow_mut() {
            live.retain(|w| w.strong_count() > 0);
        }
    });
}

/// One line of a [`MemoryReport`]: what one statement of one region call
/// holds.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct MemoryEntry {
    /// The region's name.
    pub region: String,
    /// Which call of the region, among the live calls with that name (0-based).
    pub call: usize,
    /// The statement's name, or `(inputs)` for the region inputs.
    pub statement: String,
    /// The statement's policy; `None` for the region inputs.
    pub policy: Option<Policy>,
    /// Bytes of the storages this record holds on its device that no
    /// earlier entry holds.
    pub bytes: usize,
    /// Bytes this record holds in host memory: the residuals of an offloaded
    /// statement between its region's forward and backward (see
    /// [`crate::offload`]); 0 for every other record.
    pub host_bytes: usize,
    /// Shapes of the record's outputs (of the inputs, for `(inputs)`).
    pub shapes: Vec<Vec<usize>>,
    /// Dtype of the first of them.
    pub dtype: Option<DType>,
}

/// Bytes held by the live tapes of this thread's regions, by region and
/// record name. Each storage is counted once, in the first entry that holds
/// it, even when several tensors (views, a leaf and its users) share it.
///
/// What a saved statement holds is its tracked sub-graph: the leaf copies of
/// its inputs that need gradients, every intermediate on a path to a leaf or
/// a parameter, and its outputs. Parameters are not counted. Tensors the
/// graph holds that lead to no gradient (a constant mask) are not seen.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::{MemoryReport, Region};
/// let x = Var::ones((4, 8), DType::F32, &Device::Cpu)?;
/// let y = Region::new("r").run(&[x.as_tensor()], |ctx, ins| {
///     let e = ctx.save("e", &[&ins[0]], |t| t[0].exp())?;
///     ctx.recompute("s", &[&e], |t| t[0].sum_all())
/// })?;
/// let report = MemoryReport::capture();
/// let e = report.entries.iter().find(|e| e.statement == "e").unwrap();
/// // the leaf copy of x and the output of exp: 2 x 32 floats
/// assert_eq!(e.bytes, 2 * 32 * 4);
/// drop(y);
/// assert!(MemoryReport::capture().entries.is_empty());
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryReport {
    /// One entry per record of every live tape, in call order.
    pub entries: Vec<MemoryEntry>,
}

impl MemoryReport {
    /// The report of every live region call made on this thread.
    ///
    /// ```
    /// assert_eq!(remat_runtime::MemoryReport::capture().total_bytes(), 0);
    /// ```
    pub fn capture() -> Self {
        let live: Vec<Arc<Call>> =
            LIVE_CALLS.with(|live| live.borrow().iter().filter_map(Weak::upgrade).collect());
        let mut seen = Seen::default();
        let mut entries = Vec::new();
        let mut calls: Vec<(String, usize)> = Vec::new();
        for live_call in live {
            let state = lock(&live_call.tape);
            let TapeState::Live { tape, .. } = &*state else {
                continue;
            };
            let call = match calls.iter_mut().find(|(n, _)| *n == live_call.name) {
                Some((_, c)) => {
                    *c += 1;
                    *c
                }
                None => {
                    calls.push((live_call.name.clone(), 0));
                    0
                }
            };
            // Parameters, and views of them (a broadcast bias), are not tape
            // memory: mark their storages as seen.
            for p in &tape.params {
                seen.exclude(p);
            }
            let mut counter = Counter::new(&mut seen);
            let entry =
                |statement: &str, policy, bytes, host_bytes, shapes: Vec<Vec<usize>>, dtype| {
                    MemoryEntry {
                        region: live_call.name.clone(),
                        call,
                        statement: statement.to_string(),
                        policy,
                        bytes,
                        host_bytes,
                        shapes,
                        dtype,
                    }
                };
            let bytes = tape
                .inputs
                .iter()
                .filter_map(Kept::tensor)
                .map(|t| counter.count(t, false))
                .sum();
            let shapes = tape
                .input_metas
                .iter()
                .map(|m| m.shape.dims().to_vec())
                .collect();
            let dtype = tape.input_metas.first().map(|m| m.dtype);
            entries.push(entry("(inputs)", None, bytes, 0, shapes, dtype));
            for record in &tape.records {
                let bytes = record
                    .saved
                    .as_ref()
                    .map_or(0, |saved| counter.saved(saved));
                let host_bytes = record
                    .saved
                    .as_ref()
                    .and_then(|saved| saved.offloaded.as_ref())
                    .map_or(0, |offloaded| {
                        offloaded.on_host().iter().map(|(_, b)| b).sum()
                    });
                let shapes = record
                    .outputs
                    .iter()
                    .map(|m| m.shape.dims().to_vec())
                    .collect();
                let dtype = record.outputs.first().map(|m| m.dtype);
                entries.push(entry(
                    &record.name,
                    Some(record.policy),
                    bytes,
                    host_bytes,
                    shapes,
                    dtype,
                ));
            }
        }
        MemoryReport { entries }
    }

    /// The sum of the entries' host bytes (offloaded residuals).
    ///
    /// ```
    /// assert_eq!(remat_runtime::MemoryReport::default().total_host_bytes(), 0);
    /// ```
    pub fn total_host_bytes(&self) -> usize {
        self.entries.iter().map(|e| e.host_bytes).sum()
    }

    /// The sum of the entries' bytes.
    ///
    /// ```
    /// assert_eq!(remat_runtime::MemoryReport::default().total_bytes(), 0);
    /// ```
    pub fn total_bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }
}

impl fmt::Display for MemoryReport {
    /// One line per entry and a total; a `host` column appears when some
    /// record holds offloaded residuals.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = self.total_host_bytes() > 0;
        let host_column = |v: &dyn fmt::Display| {
            if host {
                format!(" {v:>12}")
            } else {
                String::new()
            }
        };
        writeln!(
            f,
            "{:<24} {:<20} {:<10} {:>12}{}  shapes",
            "region",
            "statement",
            "policy",
            "bytes",
            host_column(&"host")
        )?;
        for e in &self.entries {
            let policy = e.policy.map_or("-".to_string(), |p| p.to_string());
            let region = format!("{}#{}", e.region, e.call);
            let shapes = e
                .shapes
                .iter()
                .map(|s| format!("{s:?}"))
                .collect::<Vec<_>>()
                .join(" ");
            writeln!(
                f,
                "{region:<24} {:<20} {policy:<10} {:>12}{}  {shapes}",
                e.statement,
                e.bytes,
                host_column(&e.host_bytes)
            )?;
        }
        write!(
            f,
            "{:<24} {:<20} {:<10} {:>12}{}",
            "total",
            "",
            "",
            self.total_bytes(),
            host_column(&self.total_host_bytes())
        )
    }
}
