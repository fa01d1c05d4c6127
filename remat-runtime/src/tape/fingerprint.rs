//! Fingerprints: a small, evenly spaced sample of a value, taken in the
//! forward and compared in the replay. A replay that computes other values
//! than its forward (a random op outside [`crate::random`], a parameter
//! changed between the forward and the backward) is then an error that
//! names the statement, instead of wrong gradients.
//!
//! Two kinds, both computed on the value's device, so that taking one never
//! waits for the device; a region's are compared once per replay, in one
//! transfer to the host:
//!
//! * a recomputed statement's output: `[sum, sum of magnitudes]` of up to
//!   [`VALUE_SAMPLE`] evenly spaced elements. It matches when both differ
//!   by at most `tol` times the sum of magnitudes, `tol` set by the dtype
//!   ([`tolerance`]). The same kernels on the same data agree bit for bit,
//!   but a replay may see a value as a contiguous leaf copy where the
//!   forward saw a strided view (a reduction then sums in another order),
//!   and CUDA kernels with atomics sum in no fixed order: the tolerance
//!   is 100 times that noise or more. Dropout with p = 0.1 moves these sums
//!   by about 2 %; a parameter update of 1e-3 (relative) by about 1e-3;
//! * a parameter: the same two sums, compared exactly: nothing recomputes a
//!   parameter, and the same kernel summing the same data gives the same
//!   bits, while an update changes every element.
//!
//! The replay collects its own in [`Checks`] and compares them with the
//! forward's when it ends ([`Checks::compare`]).
//!
//! A region's fingerprints are kept in one tensor on its tape (8 bytes per
//! parameter and per recomputed output), not one per statement.

use candle_core::{DType, Tensor};

use crate::ambient::{scoped, FINGERPRINTS_OFF};
use crate::{RematError, Result};

/// Elements of a recomputed output summed into its fingerprint.
pub(crate) const VALUE_SAMPLE: usize = 256;

/// Whether forwards on this thread take fingerprints.
pub(crate) fn enabled() -> bool {
    !FINGERPRINTS_OFF.with(|off| off.get())
}

/// Runs `f` with the replay check by fingerprints off for the region calls
/// whose forward runs in it: their replays are not compared with their
/// forwards. The check costs two sums over a sample of 256 elements per
/// output of a recomputed statement, in the forward and in the replay, and
/// the same per parameter; turn it off only when a
/// measurement says it matters.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::{without_fingerprints, Region};
/// let x = Var::ones(4, DType::F32, &Device::Cpu)?;
/// let y = without_fingerprints(|| {
///     Region::new("r").run(&[x.as_tensor()], |ctx, ins| {
///         ctx.recompute("e", &[&ins[0]], |t| t[0].exp()?.sum_all())
///     })
/// })?;
/// let g = y.backward()?;
/// assert_eq!(g.get(&x).unwrap().to_vec1::<f32>()?, vec![1f32.exp(); 4]);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn without_fingerprints<R>(f: impl FnOnce() -> R) -> R {
    let before = FINGERPRINTS_OFF.with(|off| off.get());
    scoped(
        || FINGERPRINTS_OFF.with(|off| off.set(true)),
        || FINGERPRINTS_OFF.with(|off| off.set(before)),
        f,
    )
}

/// Up to `n` elements of `t`, evenly spaced in its row-major order, as a
/// 1-D `f32` tensor with a storage of its own.
fn sample(t: &Tensor, n: usize) -> Result<Tensor> {
    let flat = t.detach().flatten_all()?;
    let elems = flat.elem_count();
    let sample = if elems > n {
        let stride = elems / n;
        flat.narrow(0, 0, n * stride)?
            .reshape((n, stride))?
            .narrow(1, 0, 1)?
            .squeeze(1)?
    } else {
        flat
    };
    // A new storage of the sample's size in any case: the fingerprint must
    // not hold the value's storage (`Tensor::copy` would clone all of it).
    Ok(sample.to_dtype(DType::F32)?.affine(1.0, 0.0)?)
}

/// The fingerprint of a value (a recomputed output or a parameter):
/// `[sum, sum of magnitudes]` of its sample, on its device.
pub(crate) fn of(t: &Tensor) -> Result<Tensor> {
    let s = sample(t, VALUE_SAMPLE)?;
    Ok(Tensor::stack(&[s.sum_all()?, s.abs()?.sum_all()?], 0)?)
}

/// The relative tolerance of a recomputed output's fingerprint, by its
/// dtype (outputs are summed as `f32`).
pub(crate) fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F64 => 1e-6,
        DType::F32 => 1e-5,
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
        // Integers and 8-bit floats: equal, or off by rounding.
        _ => 1e-5,
    }
}

/// Whether the replay's `[sum, sum of magnitudes]` matches the forward's.
pub(crate) fn values_match(forward: [f32; 2], replay: [f32; 2], tol: f32) -> bool {
    let scale = tol * forward[1].abs().max(replay[1].abs());
    let close = |a: f32, b: f32| a == b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= scale;
    close(forward[0], replay[0]) && close(forward[1], replay[1])
}

/// What a fingerprint is of, for the error that names it.
pub(crate) enum Subject {
    Output {
        statement: String,
        output: usize,
        tolerance: f32,
    },
    Parameter {
        index: usize,
        shape: Vec<usize>,
    },
}

/// The replay's fingerprints, to compare with the forward's when the replay
/// ends.
pub(crate) struct Checks {
    /// The forward's, one after the other.
    pub forward: Tensor,
    /// The replay's, in the same order, each with what it is of.
    pub replay: Vec<(Subject, Tensor)>,
}

impl Checks {
    /// Compares the forward's fingerprints with the replay's, in one
    /// transfer to the host for the whole region (no wait on the device
    /// per statement).
    pub fn compare(self, region: &str) -> Result<()> {
        let Checks {
            forward,
            replay: parts,
        } = self;
        let replay: Vec<&Tensor> = parts.iter().map(|(_, t)| t).collect();
        if replay.is_empty() {
            return Ok(());
        }
        let replay = Tensor::cat(&replay, 0)?;
        if replay.elem_count() != forward.elem_count() {
            // The replay ran other statements: an error said so already, unless
            // the tape was taken under another plan.
            return Err(RematError::desync(
                region,
                format!("{} fingerprinted numbers", forward.elem_count()),
                format!("{}", replay.elem_count()),
            ));
        }
        let both = Tensor::stack(&[&forward, &replay], 0)?.to_vec2::<f32>()?;
        let (forward, replay) = (&both[0], &both[1]);
        let mut start = 0;
        for (subject, t) in parts {
            let end = start + t.elem_count();
            let (f, r) = (&forward[start..end], &replay[start..end]);
            start = end;
            match subject {
                Subject::Output {
                    statement,
                    output,
                    tolerance,
                } => {
                    if !values_match([f[0], f[1]], [r[0], r[1]], tolerance) {
                        return Err(RematError::ReplayDiverged {
                            region: region.to_string(),
                            statement,
                            output,
                            forward: [f[0], f[1]],
                            replay: [r[0], r[1]],
                        });
                    }
                }
                Subject::Parameter { index, shape } => {
                    if !values_match([f[0], f[1]], [r[0], r[1]], 0.0) {
                        return Err(RematError::ParameterChanged {
                            region: region.to_string(),
                            index,
                            shape,
                            forward: [f[0], f[1]],
                            replay: [r[0], r[1]],
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn a_sample_is_evenly_spaced_and_owns_its_storage() {
        let t = Tensor::arange(0f32, 1280.0, &Device::Cpu)
            .unwrap()
            .reshape((10, 128))
            .unwrap();
        let s = sample(&t, VALUE_SAMPLE).unwrap();
        assert_eq!(&s.to_vec1::<f32>().unwrap()[..3], &[0.0, 5.0, 10.0]);
        let (storage, _) = s.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cpu(s) => {
                assert_eq!(s.as_slice::<f32>().unwrap().len(), VALUE_SAMPLE)
            }
            _ => unreachable!("a CPU tensor"),
        }
        let small = Tensor::new(&[1.5f64, -2.0], &Device::Cpu).unwrap();
        assert_eq!(
            of(&small).unwrap().to_vec1::<f32>().unwrap(),
            vec![-0.5, 3.5]
        );
    }

    #[test]
    fn noise_matches_and_changes_do_not() {
        let f = [0.5f32, 300.0];
        assert!(values_match(f, [0.5 + 1e-4, 300.0 - 1e-4], 1e-5));
        assert!(!values_match(f, [0.5 + 0.1, 300.0], 1e-5));
        assert!(!values_match(f, [0.5, 306.0], 1e-5));
        assert!(values_match([f32::NAN, 1.0], [f32::NAN, 1.0], 1e-5));
        // Parameters are compared exactly.
        assert!(values_match([1.0, 2.0], [1.0, 2.0], 0.0));
        assert!(!values_match([1.0, 2.0], [1.0, 2.0 + 2.5e-7], 0.0));
    }
}
