//! Randomness that replays: counter-based draws keyed by the region call and
//! the statement's name.
//!
//! candle cannot seed its CPU generator, and a replay skips saved statements,
//! so "restore the generator's state and run again" (PyTorch's
//! `preserve_rng_state`) cannot work. Instead every draw made inside a
//! statement is a pure function of (the region call's seed, the statement's
//! name, the draw's index within the statement, the element's index): the
//! replay of a recomputed statement draws exactly what its forward drew,
//! whichever other statements were saved or recomputed, and the same code
//! run without checkpointing draws the same values too.

use std::cell::{Cell, RefCell};

use candle_core::{DType, Device, Shape, Tensor};

use crate::ambient::scoped;
use crate::Result;

thread_local! {
    /// The base seed of draws made outside any statement.
    static RANDOM_BASE: Cell<u64> = const { Cell::new(0x05EE_D0F4_E3A7) };
    /// How many draws outside any statement were made since the last seed.
    static RANDOM_OUTSIDE: Cell<u64> = const { Cell::new(0) };
    /// The random stream of each statement running; draws use the last.
    static RANDOM_STREAMS: RefCell<Vec<Stream>> = const { RefCell::new(Vec::new()) };
}

/// The draws of one running statement: its key and how many it drew.
pub(crate) struct Stream {
    key: u64,
    draws: u64,
}

/// SplitMix64's finaliser: a bijective 64-bit mix.
fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn mix(a: u64, b: u64) -> u64 {
    splitmix(a ^ splitmix(b))
}

/// FNV-1a: a stable hash of a statement name.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Sets this thread's seed and restarts its sequence of region calls: the
/// same seed and the same sequence of calls draw the same values.
///
/// ```
/// use candle_core::Device;
/// use remat_runtime::random;
/// random::seed(7);
/// let a = random::uniform(4, &Device::Cpu)?.to_vec1::<f32>()?;
/// random::seed(7);
/// let b = random::uniform(4, &Device::Cpu)?.to_vec1::<f32>()?;
/// assert_eq!(a, b);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn seed(seed: u64) {
    RANDOM_BASE.with(|b| b.set(seed));
    RANDOM_OUTSIDE.with(|c| c.set(0));
}

/// The next key of the innermost running statement, or of the thread when
/// no statement runs.
fn next_key() -> u64 {
    RANDOM_STREAMS.with(|s| match s.borrow_mut().last_mut() {
        Some(stream) => {
            stream.draws += 1;
            mix(stream.key, stream.draws)
        }
        None => {
            let n = RANDOM_OUTSIDE.with(|c| {
                let n = c.get();
                c.set(n + 1);
                n
            });
            mix(RANDOM_BASE.with(Cell::get), n)
        }
    })
}

/// The seed of a new region call. A call made inside a statement (a nested
/// region) takes it from that statement's stream, so that the outer replay
/// calls it with the same seed again.
pub(crate) fn call_seed() -> u64 {
    next_key()
}

/// Runs `f` as statement `name` of the region call seeded `seed`: draws in
/// it come from the statement's own stream.
pub(crate) fn in_statement<R>(seed: u64, name: &str, f: impl FnOnce() -> R) -> R {
    let stream = Stream {
        key: mix(seed, name_hash(name)),
        draws: 0,
    };
    scoped(
        || RANDOM_STREAMS.with(|s| s.borrow_mut().push(stream)),
        || {
            RANDOM_STREAMS.with(|s| {
                s.borrow_mut().pop();
            })
        },
        f,
    )
}

/// Uniform `f32` values in `[0, 1)` of shape `shape` on `device`, drawn from
/// the running statement's stream (or the thread's, outside statements).
/// Values are computed on the host from a counter-based generator and copied
/// to the device: identical on every device.
///
/// ```
/// use candle_core::Device;
/// let u = remat_runtime::random::uniform((2, 3), &Device::Cpu)?;
/// assert_eq!(u.dims(), &[2, 3]);
/// assert!(u.to_vec2::<f32>()?.iter().flatten().all(|&v| (0.0..1.0).contains(&v)));
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn uniform(shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
    Ok(uniform_keyed(next_key(), &shape.into(), device)?)
}

/// The next draw's key: [`uniform`]'s values are a function of it.
pub(crate) fn draw_key() -> u64 {
    next_key()
}

/// The uniform values of the draw keyed `key`.
pub(crate) fn uniform_keyed(
    key: u64,
    shape: &Shape,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let values: Vec<f32> = (0..shape.elem_count() as u64)
        .map(|i| (mix(key, i) >> 40) as f32 / (1u64 << 24) as f32)
        .collect();
    Tensor::from_vec(values, shape.clone(), &Device::Cpu)?.to_device(device)
}

/// Uniform values of `dtype` (a float type) in `[lo, hi)`; see [`uniform`].
///
/// ```
/// use candle_core::{DType, Device};
/// let t = remat_runtime::random::uniform_range(8, -1.0, 1.0, DType::F64, &Device::Cpu)?;
/// assert_eq!(t.dtype(), DType::F64);
/// # Ok::<(), remat_runtime::RematError>(())
/// ```
pub fn uniform_range(
    shape: impl Into<Shape>,
    lo: f64,
    hi: f64,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let u = uniform(shape, device)?.to_dtype(dtype)?;
    Ok(((u * (hi - lo))? + lo)?)
}
