//! Fingerprints: a checksum of every element of a value (and of its
//! position), taken in the forward and compared in the replay. A replay
//! that computes other values than its forward (a random op outside
//! [`crate::random`], a parameter or a block input changed between the
//! forward and the backward, state read from outside the block) is then an
//! error that names the statement, instead of wrong gradients.
//!
//! What is fingerprinted, each on its device ([`checksum`](super::checksum)),
//! all of a region compared once per replay in one transfer to the host:
//!
//! * every parameter the block used, at the end of the forward: compared
//!   bit for bit (nothing recomputes a parameter);
//! * every block input the replay reads (a mask, a bias table): bit for
//!   bit too;
//! * every tensor a `remat!` block reads from its parameters' fields that
//!   is neither an input nor a parameter ([`FieldRead`]): bit for bit;
//! * every output of a recomputed statement: bit for bit when the replay
//!   runs the same kernels on the same bits with the same layouts (on the
//!   CPU, when every input of the statement is bitwise the forward's and
//!   laid out as in the forward), otherwise within a tolerance set by the
//!   dtype ([`tolerance`]): a replay may read a value through a contiguous
//!   leaf copy where the forward read a strided view (a reduction then sums
//!   in another order), and some CUDA kernels sum in no fixed order.
//!
//! A region's fingerprints are kept in one tensor on its tape (32 bytes per
//! parameter, read input and recomputed output), not one per statement.

use candle_core::{DType, Tensor};

use super::checksum::{Kind, MAGNITUDES, SUM, WEIGHTED};
use crate::ambient::{is_on, switched, Switch};
use crate::{RematError, Result};

/// Whether forwards on this thread take fingerprints.
pub(crate) fn enabled() -> bool {
    !is_on(Switch::NoFingerprints)
}

/// Runs `f` with the replay check by fingerprints off for the region calls
/// whose forward runs in it: their replays are not compared with their
/// forwards. The check reads every element of every parameter, block input
/// the replay reads and recomputed output once in the forward and once in
/// the replay (see `docs/performance.md` for what that costs); turn it off
/// only when a measurement says it matters.
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
    switched(Switch::NoFingerprints, f)
}

/// The fingerprints of `values` (`None`: one not compared, four zeros), in
/// order, as tensors to join, to be compared as `kind` says: see
/// [`super::checksum::of_all`].
pub(crate) fn of_all(values: &[Option<&Tensor>], kind: Kind) -> Result<Vec<Tensor>> {
    let _profile = crate::inspect::profile::op("replay check");
    #[cfg(test)]
    counts::COUNTS.with(|c| {
        let taken = values.iter().flatten().count();
        c.set((c.get().0 + taken, c.get().1))
    });
    super::checksum::of_all(values, kind)
}

/// What the check costs, counted in tests: checksums taken (two kernels
/// each on a GPU) and reads of fingerprints to the host (each a wait on
/// the device).
#[cfg(test)]
pub(crate) mod counts {
    thread_local! {
        pub(crate) static COUNTS: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) };
    }

    /// (checksums, reads of fingerprints to the host) on this thread so far.
    pub(crate) fn now() -> (usize, usize) {
        COUNTS.with(|c| c.get())
    }
}

/// A tensor a block reads from a field of one of its parameters
/// (`&self.mask`, `p.cos.narrow(..)`): neither a block input nor a
/// parameter, and so fingerprinted on its own, to see a change in place
/// between the forward and the backward ([`RematError::FieldChanged`]).
#[derive(Debug, Clone)]
pub(crate) struct FieldRead {
    /// The tensor.
    pub tensor: Tensor,
    /// The field as the block writes it (`self.mask`).
    pub field: &'static str,
    /// The first statement that reads it.
    pub statement: &'static str,
}

/// The forward's fingerprints of a region call, and what each is of.
#[derive(Clone)]
pub(crate) struct Forward {
    /// One after the other: the parameters' (at the end of the forward),
    /// the read inputs', the fields', then every output of every recomputed statement,
    /// in order, each followed by its op's input where the forward took
    /// it (`Record::sole_fingerprinted`).
    pub sums: Tensor,
    /// Per parameter: the record of the first statement that used it
    /// (`u32::MAX`: none, a parameter returned as a region output).
    pub params: Vec<u32>,
    /// The region inputs the replay reads: index, the record of the
    /// first recomputed statement that reads it, and its name.
    pub inputs: Vec<(u32, u32, Option<&'static str>)>,
    /// The tensors the block read from fields, each once: neither inputs
    /// nor parameters, and carrying no gradient.
    pub fields: Vec<FieldRead>,
}

impl Forward {
    /// The fingerprints of a region call whose forward used `params` and
    /// took `outputs` (its recomputed outputs'): the parameters' and the
    /// read inputs' are taken now, at the end of the forward. `inputs_read`:
    /// per region input, the first record that reads it in the backward;
    /// `param_statements`: per parameter, the first record that used it;
    /// `names`: the inputs' names, where the block gave them.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        params: &[Tensor],
        inputs: &[Tensor],
        detached: &[Tensor],
        inputs_read: Vec<Option<u32>>,
        mut param_statements: Vec<u32>,
        fields: &[FieldRead],
        names: &[Option<&'static str>],
        outputs: Vec<Tensor>,
    ) -> Result<Self> {
        // An input that is also a parameter (a `Var` passed in) is
        // fingerprinted once, as the parameter.
        let checked = |&(i, r): &(usize, &Option<u32>)| {
            r.is_some() && !params.iter().any(|p| p.id() == inputs[i].id())
        };
        // Held as long as the tape: no spare capacity.
        let mut read = Vec::with_capacity(inputs_read.iter().enumerate().filter(checked).count());
        read.extend(
            inputs_read
                .iter()
                .enumerate()
                .filter(checked)
                .filter_map(|(i, r)| Some((i as u32, (*r)?, names.get(i).copied().flatten()))),
        );
        // A field's tensor that is an input or a parameter is checked as
        // such; one that carries a gradient is a parameter's view (or an
        // error the statement reading it reported).
        let mut seen: std::collections::HashSet<_> =
            params.iter().chain(inputs).map(|t| t.id()).collect();
        let fields: Vec<FieldRead> = fields
            .iter()
            .filter(|f| {
                f.tensor.elem_count() > 0 && !f.tensor.track_op() && seen.insert(f.tensor.id())
            })
            .cloned()
            .collect();
        // Parameters first, then the inputs the replay reads, the fields,
        // then the recomputed outputs: one tensor.
        let taken: Vec<Option<&Tensor>> = params
            .iter()
            .chain(read.iter().map(|&(i, _, _)| &detached[i as usize]))
            .chain(fields.iter().map(|f| &f.tensor))
            .map(Some)
            .collect();
        let mut all = of_all(&taken, Kind::Bits)?;
        all.extend(outputs);
        // A parameter returned as a region output was used by no statement.
        param_statements.resize(params.len(), u32::MAX);
        Ok(Forward {
            sums: join(&all)?,
            params: param_statements,
            inputs: read,
            fields,
        })
    }
}

/// Fingerprints as one tensor, on the device of the first (a block may use
/// several devices).
pub(crate) fn join(parts: &[Tensor]) -> Result<Tensor> {
    let Some(first) = parts.first() else {
        return Ok(Tensor::zeros(0, DType::F64, &candle_core::Device::Cpu)?);
    };
    let on_one: Vec<Tensor> = parts
        .iter()
        .map(|t| t.to_device(first.device()))
        .collect::<candle_core::Result<_>>()?;
    Ok(Tensor::cat(&on_one, 0)?)
}

/// A key of the layouts (shape, strides, dtype, device) of the values a
/// statement runs on: the replay of a statement whose inputs have the
/// forward's bits and key runs the same kernels in the same memory order.
/// Not the offset: candle's kernels start at it, whatever it is.
pub(crate) fn layouts<'a>(args: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for t in args {
        let l = t.layout();
        (l.dims(), l.stride(), t.dtype().as_str()).hash(&mut h);
        t.device().location().hash(&mut h);
    }
    h.finish()
}

/// The relative tolerance of a recomputed output whose replay is not
/// bitwise the forward's, by its dtype: a bound on how far a legitimate
/// replay (the same math, summed in another order) moves the sums, relative
/// to the sum of magnitudes. A reordered reduction moves each element by a
/// few units in the last place of the values it sums; the bounds are 100
/// times that or more. Dropout with p = 0.1 moves the sums by about 2 %, a
/// parameter update of 1e-3 (relative) by about 1e-3.
pub(crate) fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-9,
        DType::F32 => 1e-5,
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
        // Integers: equal; 8-bit floats: rounding.
        _ => 1e-2,
    }
}

/// How a recomputed output is compared with its forward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Compare {
    /// Bit for bit: the replay ran the same kernels on the same bits.
    Bitwise,
    /// The sums within this fraction of the sum of magnitudes.
    Within(f64),
    /// Not compared: an output the replay left uncomputed because nothing
    /// reads it ([`unread`](super::unread)); its fingerprint is four zeros.
    Unread,
}

/// Whether two fingerprints (see [`super::checksum`]) match under `how`.
pub(crate) fn matches(forward: &[f64], replay: &[f64], how: Compare) -> bool {
    let same = |a: f64, b: f64| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    match how {
        Compare::Unread => true,
        Compare::Bitwise => forward.iter().zip(replay).all(|(&a, &b)| same(a, b)),
        Compare::Within(tol) => {
            let scale = tol * forward[MAGNITUDES].abs().max(replay[MAGNITUDES].abs());
            // An infinite sum of magnitudes leaves no tolerance: the sums
            // must then be equal.
            let close = |a: f64, b: f64| {
                same(a, b) || a == b || (scale.is_finite() && (a - b).abs() <= scale)
            };
            [SUM, MAGNITUDES, WEIGHTED]
                .iter()
                .all(|&i| close(forward[i], replay[i]))
        }
    }
}

/// What a fingerprint is of, for the error that names it.
pub(crate) enum Subject {
    Output {
        statement: String,
        output: usize,
        compare: Compare,
    },
    Parameter {
        index: usize,
        shape: Vec<usize>,
        statement: String,
    },
    Input {
        index: usize,
        name: Option<&'static str>,
        shape: Vec<usize>,
        statement: String,
    },
    Field {
        field: &'static str,
        shape: Vec<usize>,
        statement: &'static str,
    },
}

/// The sums a checksum reports in errors: sum, sum of magnitudes,
/// position-weighted sum.
fn reported(f: &[f64]) -> [f64; 3] {
    [f[SUM], f[MAGNITUDES], f[WEIGHTED]]
}

/// The replay's fingerprints, to compare with the forward's when the replay
/// ends.
pub(crate) struct Checks {
    /// The forward's, one after the other.
    pub forward: Tensor,
    /// What each of the replay's is of, in order.
    pub subjects: Vec<Subject>,
    /// The replay's, in the same order, one or several per tensor.
    pub replay: Vec<Tensor>,
}

impl Checks {
    /// Takes the replay's fingerprints of `values` (`None`: not compared),
    /// each with what it is of, all parameters and inputs or all outputs
    /// (`kind` as the forward took them).
    pub fn take(&mut self, values: Vec<(Subject, Option<&Tensor>)>, kind: Kind) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let (subjects, tensors): (Vec<Subject>, Vec<Option<&Tensor>>) = values.into_iter().unzip();
        self.replay.extend(of_all(&tensors, kind)?);
        self.subjects.extend(subjects);
        Ok(())
    }

    /// Compares the forward's fingerprints with the replay's, in one
    /// transfer to the host for the whole region (no wait on the device
    /// per statement). The first mismatch in order is reported:
    /// parameters, then inputs, then outputs, so that a cause is named
    /// before its effects.
    pub fn compare(self, region: &str) -> Result<()> {
        let _profile =
            crate::inspect::profile::scope("replay check", crate::inspect::Phase::Replay);
        let Checks {
            forward,
            subjects,
            replay,
        } = self;
        if subjects.is_empty() {
            return Ok(());
        }
        let replay = join(&replay)?.to_device(forward.device())?;
        if replay.elem_count() != forward.elem_count() {
            // The replay ran other statements: an error said so already, unless
            // the tape was taken under another plan.
            return Err(RematError::desync(
                region,
                format!("{} fingerprinted numbers", forward.elem_count()),
                format!("{}", replay.elem_count()),
            ));
        }
        // The one read to the host, after the whole replay.
        #[cfg(test)]
        counts::COUNTS.with(|c| c.set((c.get().0, c.get().1 + 1)));
        let both = Tensor::stack(&[&forward, &replay], 0)?.to_vec2::<f64>()?;
        let words = super::checksum::WORDS;
        for (k, subject) in subjects.into_iter().enumerate() {
            let (f, r) = (
                &both[0][k * words..][..words],
                &both[1][k * words..][..words],
            );
            let region = region.to_string();
            match subject {
                Subject::Output {
                    statement,
                    output,
                    compare,
                } => {
                    if !matches(f, r, compare) {
                        return Err(RematError::ReplayDiverged {
                            region,
                            statement,
                            output,
                            forward: reported(f),
                            replay: reported(r),
                            bitwise: compare == Compare::Bitwise,
                        });
                    }
                }
                Subject::Parameter {
                    index,
                    shape,
                    statement,
                } => {
                    if !matches(f, r, Compare::Bitwise) {
                        return Err(RematError::ParameterChanged {
                            region,
                            statement,
                            index,
                            shape,
                        });
                    }
                }
                Subject::Input {
                    index,
                    name,
                    shape,
                    statement,
                } => {
                    if !matches(f, r, Compare::Bitwise) {
                        return Err(RematError::InputChanged {
                            region,
                            statement,
                            index,
                            name: name.map(str::to_string),
                            shape,
                        });
                    }
                }
                Subject::Field {
                    field,
                    shape,
                    statement,
                } => {
                    if !matches(f, r, Compare::Bitwise) {
                        return Err(RematError::FieldChanged {
                            region,
                            statement: statement.to_string(),
                            field: field.to_string(),
                            shape,
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
    use crate::Region;
    use candle_core::{Device, Var};

    /// A region call's check: one checksum per parameter, read input and
    /// recomputed output in the forward and again in the replay, and one
    /// read to the host, after the replay; none in the forward.
    #[test]
    fn one_host_read_per_replay_one_checksum_per_value() {
        let dev = Device::Cpu;
        let w = Var::randn(0f32, 0.1, (16, 16), &dev).unwrap();
        let b = Var::randn(0f32, 0.1, 16, &dev).unwrap();
        let x = Var::randn(0f32, 1.0, (4, 16), &dev).unwrap();
        let (wt, bt) = (w.as_tensor().clone(), b.as_tensor().clone());
        let layers = 6;
        // The first call of a region (which looks for undeclared reads)
        // and a later one alike.
        let call = || {
            let (wt, bt) = (wt.clone(), bt.clone());
            Region::new("r")
                .run(&[x.as_tensor()], move |ctx, ins| {
                    let mut h = ins[0].clone();
                    for i in 0..layers {
                        h = ctx.recompute(&format!("l{i}"), &[&h], |t| {
                            t[0].matmul(&wt)?.broadcast_add(&bt)?.tanh()
                        })?;
                    }
                    Ok(h)
                })
                .unwrap()
        };
        let start = counts::now();
        let y = call();
        let forward = counts::now();
        // Two parameters, the input `l0` reads, six outputs.
        let values = 2 + 1 + layers;
        assert_eq!((forward.0 - start.0, forward.1 - start.1), (values, 0));
        let g = y.sum_all().unwrap().backward().unwrap();
        assert!(g.get(&w).is_some());
        let backward = counts::now();
        assert_eq!(
            (backward.0 - forward.0, backward.1 - forward.1),
            (values, 1)
        );
        let again = call();
        again.sum_all().unwrap().backward().unwrap();
        let end = counts::now();
        assert_eq!((end.0 - backward.0, end.1 - backward.1), (2 * values, 1));
    }

    /// A statement whose value is one `nn` op's output has that op's input
    /// fingerprinted only where the replay may leave the value
    /// uncomputed: before a saved statement or at the end of the forward,
    /// not before a recomputed one (whose replay computes the value and
    /// compares it); the replay takes the same, and an input computed
    /// otherwise in the replay is still caught where it is compared.
    #[test]
    fn an_ops_input_is_fingerprinted_only_where_its_output_may_go_uncomputed() {
        let dev = Device::Cpu;
        let w = Var::randn(0f32, 0.3, (8, 8), &dev).unwrap();
        let x = Var::randn(0f32, 1.0, (4, 8), &dev).unwrap();
        // Five linear statements, those in `saved` saved; the scale is 1 in
        // the forward and `replay_scale` in the replay. The last linear's
        // output is the region's output.
        let call = |saved: Vec<usize>, replay_scale: f64| {
            let wt = w.as_tensor().clone();
            let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            Region::new("r")
                .run(&[x.as_tensor()], move |ctx, ins| {
                    let scale = match runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
                        0 => 1.0,
                        _ => replay_scale,
                    };
                    let mut h = ins[0].clone();
                    for i in 0..5 {
                        let wt = wt.clone();
                        let f = move |t: &[Tensor]| crate::nn::linear(&(&t[0] * scale)?, &wt, None);
                        h = match saved.contains(&i) {
                            true => ctx.save(&format!("l{i}"), &[&h], f)?,
                            false => ctx.recompute(&format!("l{i}"), &[&h], f)?,
                        };
                    }
                    Ok(h)
                })
                .unwrap()
        };
        // (saved statements, ops' inputs taken): checksums in the forward
        // are the parameter, the input, each recomputed output and those.
        for (saved, sole_inputs) in [
            // All recomputed: only the last one's op input.
            (vec![], 1),
            // l1 saved: l0's op input (before a saved statement) and l4's.
            (vec![1], 2),
            // The last one saved: l3's (before it); l4 has none taken.
            (vec![4], 1),
            (vec![1, 3], 3),
        ] {
            let taken = 1 + 1 + (5 - saved.len()) + sole_inputs;
            let start = counts::now();
            let y = call(saved.clone(), 1.0);
            let forward = counts::now();
            assert_eq!(forward.0 - start.0, taken, "{saved:?}");
            let g = y.sum_all().unwrap().backward().unwrap();
            assert!(g.get(&w).is_some());
            // The replay leaves the last recomputed statement's output
            // uncomputed (nothing in it reads the value): one fewer.
            assert_eq!(
                counts::now().0 - forward.0,
                taken - 1,
                "{saved:?}: the replay"
            );
        }
        // The scale changes between the forward and the replay: caught in
        // every arrangement, at the first recomputed statement.
        for saved in [vec![], vec![1], vec![4], vec![0, 1, 2, 3]] {
            let first = (0..5).find(|i| !saved.contains(i)).unwrap();
            let y = call(saved.clone(), 3.0);
            // Through candle's backward: the error is `ReplayDiverged`'s text.
            let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
            let diverged = format!("statement `l{first}`: output 0 differs between the forward");
            assert!(e.contains(&diverged), "{saved:?}: {e}");
        }
    }

    /// A recomputed statement that fails after an `nn` op's statement, its
    /// error ignored by the block, leaves that op's input pending: the op's
    /// statement is then the last recomputed one, its value left
    /// uncomputed in the replay, and its input still compared.
    #[test]
    fn a_failed_statement_the_block_ignores_leaves_the_ops_input_checked() {
        let dev = Device::Cpu;
        let w = Var::randn(0f32, 0.3, (8, 8), &dev).unwrap();
        let x = Var::randn(0f32, 1.0, (4, 8), &dev).unwrap();
        let wt = w.as_tensor().clone();
        let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let y = Region::new("r")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let scale = match runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
                    0 => 1.0,
                    _ => 3.0,
                };
                let wt = wt.clone();
                let a = ctx.recompute("a", &[&ins[0]], move |t| {
                    crate::nn::linear(&(&t[0] * scale)?, &wt, None)
                })?;
                let _ = ctx.recompute("b", &[&ins[0]], |_| {
                    Err::<Tensor, _>(candle_core::Error::Msg("refused".into()))
                });
                Ok(a)
            })
            .unwrap();
        let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
        assert!(e.contains("statement `a`: output 0 differs"), "{e}");
    }

    #[test]
    fn noise_matches_within_and_changes_do_not() {
        let f = [1.0, 0.5, 300.0, 100.0];
        let noisy = [7.0, 0.5 + 1e-4, 300.0 - 1e-4, 100.0 + 1e-4];
        assert!(matches(&f, &noisy, Compare::Within(1e-5)));
        assert!(!matches(&f, &noisy, Compare::Bitwise));
        assert!(!matches(
            &f,
            &[1.0, 0.6, 300.0, 100.0],
            Compare::Within(1e-5)
        ));
        assert!(!matches(
            &f,
            &[1.0, 0.5, 300.0, 100.1],
            Compare::Within(1e-5)
        ));
        assert!(matches(&f, &f, Compare::Bitwise));
        let nan = [0.0, f64::NAN, f64::NAN, f64::NAN];
        assert!(matches(&nan, &nan, Compare::Within(1e-5)));
        assert!(matches(&nan, &nan, Compare::Bitwise));
        // Overflowed magnitudes: no tolerance, a finite sum becoming
        // infinite is a change.
        let inf = [0.0, 1.0, f64::INFINITY, 2.0];
        assert!(matches(&inf, &inf, Compare::Within(1e-5)));
        assert!(!matches(
            &inf,
            &[0.0, f64::INFINITY, f64::INFINITY, 2.0],
            Compare::Within(1e-5)
        ));
        assert!(!matches(
            &inf,
            &[0.0, 1.0, f64::INFINITY, 3.0],
            Compare::Within(1e-5)
        ));
        // The hash off: bitwise refuses.
        assert!(!matches(&f, &[3.0, 0.5, 300.0, 100.0], Compare::Bitwise));
    }
}
