//! The integration tests that share one process: everything that needs
//! neither its own global allocator (`memory.rs`, `sequential.rs`) nor a
//! feature (`cuda.rs`). One binary links candle once.

#[path = "../common/mod.rs"]
mod common;

mod as_is;
mod attention_masks;
mod cancelling_replays;
mod corpus;
mod derived;
mod dispatch;
mod dropin;
mod empty_batches;
mod errors;
mod false_alarms;
mod features;
mod finite_differences;
mod grad_equality;
mod gradient_cuts;
mod gradient_presence;
mod heldout;
mod host_cuts;
mod input_cuts;
mod linear_loss;
mod macro_blocks;
mod memory_report;
mod methods;
mod misuse;
mod model_families;
mod nn;
mod offload;
mod optimizer_in_backward;
mod plans;
mod properties;
mod random;
mod replay_check;
mod scoping;
mod trace;
mod unread_outputs;
