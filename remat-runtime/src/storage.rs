//! Which storage a tensor uses and how far it reaches: the identity the
//! byte rule (`tape/bytes.rs`) counts by and offload moves by.

use candle_core::{Storage, Tensor};

/// Identity and byte size of the storage `t` uses, as far as `t` reaches.
pub(crate) fn storage_extent(t: &Tensor) -> (usize, usize) {
    let (storage, layout) = t.storage_and_layout();
    let key = std::ptr::from_ref::<Storage>(&storage) as usize;
    let dims = layout.dims();
    let elems = if dims.contains(&0) {
        0
    } else {
        layout.start_offset()
            + dims
                .iter()
                .zip(layout.stride())
                .map(|(d, s)| (d - 1) * s)
                .sum::<usize>()
            + 1
    };
    (key, elems * t.dtype().size_in_bytes())
}
