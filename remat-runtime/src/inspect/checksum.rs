//! The checksum the replay check compares, and the switch of its CUDA
//! kernels.

use candle_core::Tensor;

use crate::Result;

/// The checksum of every element of `t` and of its position, computed on
/// `t`'s device: what the replay check compares between a forward and its
/// replay (see `docs/semantics.md`). `[hash, sum, sum of magnitudes,
/// position-weighted sum]`: the hash changes with any one element's bits
/// for elements of up to 32 bits, and misses any other change with
/// probability about 2^-53 (a 53-bit hash of every element's bits and
/// position, exact in an `f64`); the sums are accumulated in `f64`. The same elements give the
/// same four numbers however they are laid out, and on the CPU and a GPU
/// alike when [`checksum_kernels`] is on; on CUDA without them, the hash is
/// `0` and the sums are candle's.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use remat_runtime::inspect::checksum;
/// let t = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let c = checksum(&t)?;
/// assert_eq!((c[1], c[2]), (10.0, 10.0));
/// assert_eq!(checksum(&t.t()?.contiguous()?.t()?)?, c);
/// assert_ne!(checksum(&t.affine(1.0, 1e-6)?)?[0], c[0]);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn checksum(t: &Tensor) -> Result<[f64; 4]> {
    let words = crate::tape::checksum::of(t)?.to_vec1::<f64>()?;
    let mut out = [0.0; 4];
    out.copy_from_slice(&words);
    Ok(out)
}

/// The checksums of several tensors, as [`checksum`] gives each, taken
/// together: on the CPU one pass each and no tensor per value; on CUDA with
/// [`checksum_batches`] on, two launches per dtype and 16 tensors, and one
/// read of them all to the host. Tensors on several devices are each
/// checksummed on their own.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use remat_runtime::inspect::{checksum, checksums};
/// let a = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let b = Tensor::arange(0u32, 5, &Device::Cpu)?;
/// let both = checksums(&[&a, &a.t()?, &b])?;
/// assert_eq!(both, vec![checksum(&a)?, checksum(&a.t()?)?, checksum(&b)?]);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn checksums(tensors: &[&Tensor]) -> Result<Vec<[f64; 4]>> {
    let values: Vec<Option<&Tensor>> = tensors.iter().map(|&t| Some(t)).collect();
    let parts = crate::tape::checksum::of_all(&values, crate::tape::checksum::Kind::Checksum)?;
    if parts.is_empty() {
        return Ok(Vec::new());
    }
    let words = crate::tape::fingerprint::join(&parts)?.to_vec1::<f64>()?;
    Ok(words
        .chunks(4)
        .map(|w| {
            let mut out = [0.0; 4];
            out.copy_from_slice(w);
            out
        })
        .collect())
}

/// Whether checksums of CUDA tensors run on remat's own kernels (the
/// default): one pass over each value where it lies, the bits of the CPU's
/// checksum, with the hash. Off, they compose a dozen of candle's kernels
/// per value, without the hash (ten times slower on an H100); the
/// environment variable `REMAT_CHECKSUM_KERNELS=0` (or `1`) sets it until this is called.
/// Switch between steps, not between a forward and its backward (the
/// replay would compare the two algorithms' numbers). No effect on the
/// CPU, which always runs the same algorithm on its own.
///
/// ```
/// remat_runtime::inspect::checksum_kernels(true);
/// remat_runtime::inspect::checksum_kernels(false);
/// ```
pub fn checksum_kernels(on: bool) {
    crate::tape::checksum::use_kernels(on);
}

/// Whether the replay check (and [`checksums`]) takes the checksums of
/// several CUDA values at once (off by default: these kernels have not yet
/// run on a GPU). On, the values a region checks together (its parameters
/// and the inputs its replay reads; a statement's outputs) are checksummed
/// by two launches per dtype and 16 values, where one at a time takes two
/// launches and two allocations each, and one more copy each to join them.
/// The same bits either way; the environment variable
/// `REMAT_CHECKSUM_BATCHES=1` (or `0`) sets it until this is called. Needs
/// [`checksum_kernels`] on; no effect on the CPU, whose checksums of a
/// region are always taken together.
///
/// ```
/// remat_runtime::inspect::checksum_batches(true);
/// remat_runtime::inspect::checksum_batches(false);
/// ```
pub fn checksum_batches(on: bool) {
    crate::tape::checksum::use_batches(on);
}
