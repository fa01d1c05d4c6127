//! Seeing what checkpointing does: what the tapes hold, what ran, how much
//! memory a step takes, and which parameters got no gradient.
//!
//! * [`MemoryReport`]: the bytes every live tape holds, by region and
//!   statement (also at the crate root: it is how a plan is chosen);
//! * [`Trace`]: every statement of the forward and the replay;
//! * [`CountingAlloc`]: exact live and peak bytes on the CPU;
//! * [`device_memory_in_use`], [`device_memory_peak`]: the same on CUDA;
//! * [`checksum`]: the checksum the replay check compares, and
//!   [`checksum_kernels`], its kernels on CUDA; [`checksums`] and
//!   [`checksum_batches`]: several values at once;
//! * [`Profile`]: where a step's time goes, by `nn` op and phase;
//! * [`check_gradients`]: parameters that silently got no gradient (also at
//!   the crate root: it belongs in every training loop).

mod checksum;
mod counting;
pub(crate) mod device_memory;
mod gradients;
pub(crate) mod memory;
pub(crate) mod profile;
pub(crate) mod trace;

pub use checksum::{checksum, checksum_batches, checksum_kernels, checksums};
pub use counting::CountingAlloc;
pub use device_memory::{device_memory_in_use, device_memory_peak, reset_device_memory_peak};
pub use gradients::check_gradients;
pub use memory::{MemoryEntry, MemoryReport};
pub use profile::{Profile, ProfileRow};
pub use trace::{Phase, Trace, TraceEvent};
