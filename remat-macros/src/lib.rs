//! The `remat!` macro (parse -> analyse -> generate) will live here. Until it
//! lands, blocks use `remat_runtime::Ctx` statements directly.
