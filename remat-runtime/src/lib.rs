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
//!     let h = ctx.save("proj", &[&ins[0]], |t| Ok(t[0].matmul(&wt)?))?;
//!     // recomputed in backward
//!     let a = ctx.recompute("act", &[&h], |t| Ok(t[0].gelu_erf()?))?;
//!     ctx.recompute("res", &[&ins[0], &a], |t| Ok((&t[0] + &t[1])?))
//! })?;
//! let grads = y.sqr()?.mean_all()?.backward()?;
//! assert!(grads.get(&w).is_some());
//! # Ok::<(), remat_runtime::RematError>(())
//! ```
//!
//! The pieces:
//!
//! * [`remat!`](macro@remat) and [`Region`] / [`Ctx`]: blocks and their
//!   statements; [`checkpoint_sequential`] for a stack of blocks;
//! * [`Plan`]: policies chosen at run time (full, by name, a function, or a
//!   memory budget solved exactly per region);
//! * [`offload`]: [`Policy::Offload`], residuals in host memory between the
//!   forward and the backward on CUDA;
//! * [`random`]: dropout and random draws that replay identically;
//! * [`MemoryReport`], [`CountingAlloc`], [`device_memory_in_use`],
//!   [`device_memory_peak`], [`Trace`]: what the tapes hold and what ran;
//! * [`check_gradients`], [`retain_tape`], [`backward`]: training helpers.
//!
//! How each value is made available during the replay follows torch_remat:
//! region inputs are kept; outputs and residuals of recomputed statements are
//! recomputed; residuals of saved statements are kept; outputs of saved
//! statements are kept only when a recomputed statement reads them, and are
//! placeholders otherwise. See `docs/semantics.md`.

#![warn(missing_docs)]

mod counting;
mod ctx;
mod device_memory;
mod error;
mod forward;
mod grads;
mod inputs;
mod memory;
pub mod offload;
mod ops;
mod outputs;
mod plan;
mod planner;
mod policy;
mod private;
pub mod random;
mod region;
mod replay;
mod retain;
mod sequential;
mod state;
mod sweep;
mod tape;
mod trace;

pub use counting::CountingAlloc;
pub use ctx::Ctx;
pub use device_memory::{device_memory_in_use, device_memory_peak, reset_device_memory_peak};
pub use error::{Mismatch, RematError, Result};
pub use grads::check_gradients;
pub use inputs::Inputs;
pub use memory::{MemoryEntry, MemoryReport};
pub use outputs::Outputs;
pub use plan::{Plan, PlannedStatement, Solution, StatementInfo};
pub use policy::Policy;
pub use region::{checkpoint, Region};
pub use retain::{backward, retain_tape};
pub use sequential::checkpoint_sequential;
pub use trace::{Phase, Trace, TraceEvent};

#[doc = include_str!("remat.md")]
pub use remat_macros::remat;

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
