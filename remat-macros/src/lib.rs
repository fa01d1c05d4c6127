//! The remat! macro (placeholder until the macro issue lands).
