//! # remat-runtime
//!
//! Fine-grained activation checkpointing (rematerialization) for
//! [candle](https://github.com/huggingface/candle).
//!
//! A block of statements runs as a checkpointed [`Region`]: every statement
//! is recomputed during the backward unless it is marked [`Policy::Save`], in
//! which case its backward residuals are kept from the forward. A plain
//! `loss.backward()` returns a complete `GradStore` with the gradients of the
//! region inputs and of every parameter the block used, so candle-nn
//! optimizers work unchanged.
//!
//! ```
//! use candle_core::{DType, Device, Var};
//! use remat_runtime::Region;
//!
//! let dev = Device::Cpu;
//! let w = Var::randn(0f32, 0.1, (32, 32), &dev)?;
//! let x = Var::randn(0f32, 1.0, (4, 32), &dev)?;
//! let wt = w.as_tensor().clone();
//! let y = Region::new("block").run(&[x.as_tensor()], move |ctx, ins| {
//!     // kept from the forward: the matmul does not run again in backward
//!     let h = ctx.save("proj", &[&ins[0]], |t| t[0].matmul(&wt))?;
//!     // recomputed in backward
//!     let a = ctx.recompute("act", &[&h], |t| t[0].gelu_erf())?;
//!     ctx.recompute("res", &[&ins[0], &a], |t| &t[0] + &t[1])
//! })?;
//! let grads = y.sqr()?.mean_all()?.backward()?;
//! assert!(grads.get(&w).is_some());
//! # Ok::<(), remat_runtime::RematError>(())
//! ```
//!
//! The pieces, in the order one region call meets them:
//!
//! * [`remat!`](macro@remat), [`Region`] / [`Ctx`], [`checkpoint_sequential`],
//!   [`Checkpointed`]: blocks and their statements (`region.rs`, `ctx.rs`,
//!   `sequential.rs`, `checkpointed.rs`, the values they take and give in
//!   `values.rs`, what the macro's expansion calls in `private/`);
//! * [`Plan`] (`plan/`): the policy of every statement, chosen at run time
//!   (by annotation, by name, by a function, or a memory budget solved
//!   exactly per region);
//! * `tape/`: the forward records each statement on the region call's tape,
//!   and the one rule that counts the bytes a tape holds;
//! * `graph/`: the custom candle ops that attach the call to candle's graph
//!   (anchors, taps, seeds) and the leaves statements run on;
//! * `replay/`: the block's second run, which recomputes what was not
//!   saved and groups the statements into units;
//! * `backward/`: the region call between its forward and its backward,
//!   and the reverse sweep that candle's backward runs through the anchors;
//!   [`retain_tape`] and [`backward`];
//! * [`offload`]: [`Policy::Offload`], residuals in host memory between the
//!   forward and the backward on CUDA;
//! * [`random`]: random draws that replay identically (dropout: [`nn::dropout`]);
//! * [`inspect`]: [`MemoryReport`], [`Trace`](inspect::Trace), the counting
//!   allocator and device memory, [`check_gradients`];
//! * `ambient.rs`: the list of every piece of per-thread state, each kept
//!   by the module that owns it.
//!
//! `docs/architecture.md` walks one region call through these modules.
//!
//! How each value is made available during the replay follows torch_remat:
//! region inputs are kept; outputs and residuals of recomputed statements are
//! recomputed; residuals of saved statements are kept; outputs of saved
//! statements are ferried only when a recomputed statement reads them, and
//! are placeholders otherwise. See `docs/semantics.md`.

#![warn(missing_docs)]

mod ambient;
mod backward;
pub mod candle_nn;
mod checkpointed;
mod ctx;
mod error;
mod graph;
pub mod inspect;
pub mod nn;
pub mod offload;
pub mod plan;
mod policy;
mod private;
pub mod random;
mod region;
mod replay;
pub mod rules;
mod sequential;
mod storage;
mod tape;
mod values;

pub use backward::{backward, retain_tape, OptimizerInBackward};
pub use checkpointed::Checkpointed;
pub use ctx::{in_replay, Ctx};
pub use error::{Mismatch, RematError, Result, UserError};
pub use inspect::{check_gradients, MemoryReport};
pub use plan::{Plan, StatementInfo};
pub use policy::Policy;
pub use region::Region;
pub use sequential::checkpoint_sequential;
pub use tape::fingerprint::without_fingerprints;
pub use values::{Inputs, Outputs};

#[doc = include_str!("remat.md")]
pub use remat_macros::remat;

/// Derives [`Outputs`](trait@Outputs) for a struct of your own, so that
/// statements and blocks can return it and a block reading it from a field
/// checks its tensors ([`RematError::FieldChanged`]). Every field must be
/// `Outputs` itself (tensors, containers of them, plain values), or be
/// marked `#[outputs(plain)]`: kept whole as plain data (`Clone + Send +
/// Sync`), its tensors neither tracked through statements nor checked.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use remat_runtime::{remat, Outputs};
///
/// #[derive(Clone, Outputs)]
/// struct Hidden {
///     states: Tensor,
///     aux_loss: Tensor,
///     #[outputs(plain)]
///     note: &'static str,
/// }
///
/// remat! {
///     fn block(x: &Tensor) -> candle_core::Result<Hidden> {
///         let states = x.tanh()?;
///         let aux_loss = states.sqr()?.mean_all()?;
///         Ok(Hidden { states, aux_loss, note: "tanh" })
///     }
/// }
///
/// let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu)?;
/// let h = block(&x)?;
/// assert_eq!((h.states.dims(), h.note), (&[2, 3][..], "tanh"));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub use remat_macros::Outputs;

/// Support for the code `remat!` generates; not a public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::private::*;
}

#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// candle's core crate, as the runtime uses it.
pub use candle_core;

/// Locks `m`, recovering the data of a poisoned lock: every critical section
/// in the runtime leaves the data consistent before anything can panic.
pub(crate) fn lock<T: ?Sized>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
