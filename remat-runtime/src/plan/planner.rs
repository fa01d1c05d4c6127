//! The memory-budget planner: which statements of a region to save so that a
//! call holds at most a byte budget while recomputing as little as possible.
//!
//! The cost model is exact for the runtime's tape layout (as the memory
//! report counts it):
//!
//! * a saved statement holds its own graph (`own`: every intermediate and its
//!   outputs), plus a leaf copy of each input that needs gradients, unless
//!   that input comes from a saved statement of the same run of consecutive
//!   saved statements (the runtime chains them into one graph: no copy);
//! * saved statements that read the same value share one leaf copy of it:
//!   it is paid once;
//! * a recomputed statement holds nothing and costs its forward time again
//!   in the backward.
//!
//! Because of the chaining and the shared copies the bytes are not additive,
//! so this is not a textbook knapsack. It is solved exactly by dynamic
//! programming over the statements in order, with the start of the current
//! saved run and the set of shared values already copied as state, and a
//! Pareto front of (bytes, recompute time) per state. (Past 64 values read
//! more than once, the further ones count as copied for each read: the plan
//! then holds less than predicted, never more.)

use std::collections::HashMap;

use candle_core::Tensor;

use crate::tape::bytes::own_bytes;
use crate::tape::Record;
use crate::Policy;

/// One statement as the planner sees it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Item {
    /// The statement's name.
    pub name: String,
    /// A policy the code fixed; the planner never changes it.
    pub forced: Option<Policy>,
    /// Time to recompute it.
    pub seconds: f64,
    /// Bytes of its own saved graph.
    pub own: usize,
    /// Inputs that need gradients.
    pub leaves: Vec<Leaf>,
}

/// An input that needs gradients: a saved statement holds a leaf copy of it
/// (shared with the other saved statements reading the same value) unless
/// it is chained to the producer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Leaf {
    /// The statement that produced the value; `None` for region inputs.
    pub producer: Option<usize>,
    /// Bytes of a copy.
    pub bytes: usize,
    /// Which value it is (the same index for the same value).
    pub value: usize,
}

impl Item {
    /// Whether the planner may save it: the code left it open or saved it.
    pub fn may_save(&self) -> bool {
        matches!(self.forced, None | Some(Policy::Save))
    }
}

/// The planner's view of the records of a call that saved every open
/// statement.
pub(crate) fn items(records: &[Record], params: &[Tensor], inputs: &[Tensor]) -> Vec<Item> {
    let own = own_bytes(records, params, inputs);
    let mut values: HashMap<candle_core::TensorId, usize> = HashMap::new();
    records
        .iter()
        .zip(own)
        .map(|(r, own)| {
            let profile = r.profile.as_deref().cloned().unwrap_or_default();
            if r.declared == Some(Policy::Offload) {
                // Holds nothing on the device and recomputes nothing; its
                // graph is its own, so it ends a saved run as a recomputed
                // statement does.
                return Item {
                    name: r.name.clone(),
                    forced: r.declared,
                    seconds: 0.0,
                    own: 0,
                    leaves: Vec::new(),
                };
            }
            Item {
                name: r.name.clone(),
                forced: r.declared,
                seconds: profile.seconds,
                own,
                leaves: profile
                    .sources
                    .iter()
                    .filter(|s| s.needs_grad)
                    .map(|s| {
                        let n = values.len();
                        Leaf {
                            producer: s.producer,
                            bytes: s.bytes,
                            value: *values.entry(s.value).or_insert(n),
                        }
                    })
                    .collect(),
            }
        })
        .collect()
}

/// Bytes the tape holds when the statements marked `true` are saved.
pub(crate) fn bytes(items: &[Item], save: &[bool]) -> usize {
    let mut total = 0;
    let mut run: Option<usize> = None;
    let mut copied = std::collections::HashSet::new();
    for (i, item) in items.iter().enumerate() {
        if !save[i] {
            run = None;
            continue;
        }
        let start = *run.get_or_insert(i);
        total += item.own;
        for leaf in copies(item, start, i) {
            if copied.insert(leaf.value) {
                total += leaf.bytes;
            }
        }
    }
    total
}

/// The inputs of statement `i` that need a leaf copy when its saved run
/// starts at `start` (those not chained to their producer).
fn copies(item: &Item, start: usize, i: usize) -> impl Iterator<Item = &Leaf> {
    item.leaves
        .iter()
        .filter(move |l| !l.producer.is_some_and(|p| p >= start && p < i))
}

/// The values read more than once whose copies a plan's state tracks, one
/// bit each of a `u64` (past them, a copy is assumed made).
const TRACKED_COPIES: usize = u64::BITS as usize;

/// The bit of each value read more than once (by several statements, or
/// twice by one), at most [`TRACKED_COPIES`]: the state of the copies made
/// so far.
fn shared_bits(items: &[Item]) -> HashMap<usize, u64> {
    let mut reads: HashMap<usize, usize> = HashMap::new();
    for leaf in items.iter().flat_map(|item| &item.leaves) {
        *reads.entry(leaf.value).or_default() += 1;
    }
    let mut shared: Vec<usize> = reads
        .into_iter()
        .filter(|&(_, n)| n > 1)
        .map(|(v, _)| v)
        .collect();
    shared.sort_unstable();
    shared
        .into_iter()
        .take(TRACKED_COPIES)
        .enumerate()
        .map(|(b, v)| (v, 1u64 << b))
        .collect()
}

/// The smallest assignment: only the statements the code saves.
pub(crate) fn forced_saves(items: &[Item]) -> Vec<bool> {
    items
        .iter()
        .map(|i| i.forced == Some(Policy::Save))
        .collect()
}

/// Seconds spent recomputing the statements marked `false`.
pub(crate) fn seconds(items: &[Item], save: &[bool]) -> f64 {
    items
        .iter()
        .zip(save)
        .filter(|(_, &s)| !s)
        .map(|(it, _)| it.seconds)
        .sum()
}

#[derive(Clone)]
struct Entry {
    bytes: usize,
    seconds: f64,
    save: Vec<bool>,
}

/// Keeps the entries no other entry beats in both bytes and seconds.
fn pareto(mut front: Vec<Entry>) -> Vec<Entry> {
    front.sort_by(|a, b| a.bytes.cmp(&b.bytes).then(a.seconds.total_cmp(&b.seconds)));
    let mut kept: Vec<Entry> = Vec::new();
    for e in front {
        if kept.last().is_none_or(|k| e.seconds < k.seconds) {
            kept.push(e);
        }
    }
    kept
}

/// The assignment (`true` = save) with the least recompute time among those
/// holding at most `budget` bytes; ties go to fewer bytes. When even the
/// smallest assignment the forced policies allow exceeds the budget, that
/// smallest one ([`least`]).
pub(crate) fn solve(items: &[Item], budget: usize) -> Vec<bool> {
    front(items, budget)
        .into_iter()
        .min_by(|a, b| a.seconds.total_cmp(&b.seconds).then(a.bytes.cmp(&b.bytes)))
        .map_or_else(|| least(items), |e| e.save)
}

/// The assignment the forced policies allow that holds the fewest bytes;
/// ties go to less recompute time. Not always the forced saves alone:
/// saving an open statement chained to a saved one spares the leaf copy of
/// what it gave.
pub(crate) fn least(items: &[Item]) -> Vec<bool> {
    front(items, usize::MAX)
        .into_iter()
        .min_by(|a, b| a.bytes.cmp(&b.bytes).then(a.seconds.total_cmp(&b.seconds)))
        .map_or_else(|| forced_saves(items), |e| e.save)
}

/// The assignments no other beats in both bytes and recompute time, among
/// those holding at most `budget` bytes.
fn front(items: &[Item], budget: usize) -> Vec<Entry> {
    // State: where the run of saved statements ending at the current
    // statement starts (`None`: the current statement is recomputed).
    let bits = shared_bits(items);
    let mut states: HashMap<(Option<usize>, u64), Vec<Entry>> = HashMap::new();
    states.insert(
        (None, 0),
        vec![Entry {
            bytes: 0,
            seconds: 0.0,
            save: Vec::new(),
        }],
    );
    for (i, item) in items.iter().enumerate() {
        let mut next: HashMap<(Option<usize>, u64), Vec<Entry>> = HashMap::new();
        for (&(run, mask), front) in &states {
            for e in front {
                if item.forced != Some(Policy::Save) {
                    let mut r = e.clone();
                    r.seconds += item.seconds;
                    r.save.push(false);
                    next.entry((None, mask)).or_default().push(r);
                }
                if item.may_save() {
                    let start = run.unwrap_or(i);
                    let mut s = e.clone();
                    let mut m = mask;
                    s.bytes += item.own;
                    for leaf in copies(item, start, i) {
                        match bits.get(&leaf.value) {
                            Some(&bit) if m & bit != 0 => {}
                            Some(&bit) => {
                                m |= bit;
                                s.bytes += leaf.bytes;
                            }
                            // Read once in the whole region.
                            None => s.bytes += leaf.bytes,
                        }
                    }
                    s.save.push(true);
                    if s.bytes <= budget {
                        next.entry((Some(start), m)).or_default().push(s);
                    }
                }
            }
        }
        states = next
            .into_iter()
            .map(|(k, v)| (k, pareto(v)))
            .filter(|(_, v)| !v.is_empty())
            .collect();
    }
    states.into_values().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every assignment the forced policies allow.
    fn brute_force(items: &[Item], budget: usize) -> Option<(f64, usize)> {
        let n = items.len();
        let mut best: Option<(f64, usize)> = None;
        for mask in 0u32..(1 << n) {
            let save: Vec<bool> = (0..n).map(|i| mask >> i & 1 == 1).collect();
            let allowed = items.iter().zip(&save).all(|(it, &s)| match it.forced {
                Some(Policy::Save) => s,
                Some(Policy::Recompute | Policy::Offload) => !s,
                None => true,
            });
            let b = bytes(items, &save);
            if !allowed || b > budget {
                continue;
            }
            let t = seconds(items, &save);
            if best.is_none_or(|(bt, bb)| t < bt || (t == bt && b < bb)) {
                best = Some((t, b));
            }
        }
        best
    }

    struct Lcg(u64);
    impl Lcg {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }
    }

    /// A random block: integer costs (so that sums are exact), inputs from
    /// earlier statements or from the region.
    fn random_block(rng: &mut Lcg, n: usize) -> Vec<Item> {
        (0..n)
            .map(|i| {
                // Value `p` is statement p's output; values n and n + 1 are
                // region inputs. Its size depends on the value only.
                let leaves = (0..rng.below(3))
                    .map(|_| {
                        let p = rng.below(i as u64 + 3) as usize;
                        let (producer, value) = if p < i {
                            (Some(p), p)
                        } else {
                            (None, n + p % 2)
                        };
                        Leaf {
                            producer,
                            bytes: 1 + value * 37 % 50,
                            value,
                        }
                    })
                    .collect();
                let forced = match rng.below(10) {
                    0 => Some(Policy::Save),
                    1 => Some(Policy::Recompute),
                    2 => Some(Policy::Offload),
                    _ => None,
                };
                Item {
                    name: format!("s{i}"),
                    forced,
                    seconds: rng.below(20) as f64,
                    own: rng.below(100) as usize,
                    leaves,
                }
            })
            .collect()
    }

    #[test]
    fn dynamic_program_equals_brute_force_up_to_16_statements() {
        let mut rng = Lcg(7);
        let mut cases = 0;
        for n in 1..=16 {
            let trials = if n <= 12 { 40 } else { 6 };
            for _ in 0..trials {
                let items = random_block(&mut rng, n);
                let all = vec![true; n];
                let total = bytes(&items, &all);
                for budget in [0, total / 4, total / 2, 3 * total / 4, total] {
                    let save = solve(&items, budget);
                    let got = (seconds(&items, &save), bytes(&items, &save));
                    let forced_ok = items.iter().zip(&save).all(|(it, &s)| match it.forced {
                        Some(Policy::Save) => s,
                        Some(Policy::Recompute | Policy::Offload) => !s,
                        None => true,
                    });
                    assert!(forced_ok, "forced policies changed: {items:?} {save:?}");
                    match brute_force(&items, budget) {
                        Some(best) => assert_eq!(got, best, "n {n} budget {budget}: {items:?}"),
                        // Infeasible: the planner falls back to the least.
                        None => assert!(got.1 > budget),
                    }
                    cases += 1;
                }
                // The least bytes any allowed assignment holds.
                let least_bytes = bytes(&items, &least(&items));
                let fewest = (0u32..1 << n)
                    .map(|mask| (0..n).map(|i| mask >> i & 1 == 1).collect::<Vec<bool>>())
                    .filter(|save| {
                        items.iter().zip(save).all(|(it, &s)| match it.forced {
                            Some(Policy::Save) => s,
                            Some(Policy::Recompute | Policy::Offload) => !s,
                            None => true,
                        })
                    })
                    .map(|save| bytes(&items, &save))
                    .min()
                    .unwrap();
                assert_eq!(least_bytes, fewest, "n {n}: {items:?}");
            }
        }
        assert!(cases > 2000);
    }

    #[test]
    fn chained_saves_share_their_graph() {
        // b reads a; saving both needs no leaf copy of a's output in b.
        let item = |name: &str, own, leaves| Item {
            name: name.into(),
            forced: None,
            seconds: 1.0,
            own,
            leaves,
        };
        let leaf = |producer, bytes, value| Leaf {
            producer,
            bytes,
            value,
        };
        let items = vec![
            item("a", 10, vec![leaf(None, 4, 0)]),
            item("b", 20, vec![leaf(Some(0), 10, 1)]),
        ];
        assert_eq!(bytes(&items, &[true, false]), 14);
        assert_eq!(bytes(&items, &[false, true]), 30);
        assert_eq!(bytes(&items, &[true, true]), 34);
        // With 30 bytes, saving b alone beats saving a alone only on ties:
        // both recompute one statement; a holds fewer bytes.
        assert_eq!(solve(&items, 30), vec![true, false]);
        assert_eq!(solve(&items, 34), vec![true, true]);
        assert_eq!(solve(&items, 0), vec![false, false]);
    }
}

#[cfg(test)]
mod shared {
    use super::*;

    #[test]
    fn statements_reading_one_value_share_its_copy() {
        // q, k and v read the norm's output `h` (a region input here): one
        // copy of it, not three.
        let h = Leaf {
            producer: None,
            bytes: 8,
            value: 0,
        };
        let item = |name: &str| Item {
            name: name.into(),
            forced: None,
            seconds: 1.0,
            own: 10,
            leaves: vec![h],
        };
        let items = vec![item("q"), item("k"), item("v")];
        assert_eq!(bytes(&items, &[true, false, false]), 18);
        assert_eq!(bytes(&items, &[true, false, true]), 28);
        assert_eq!(bytes(&items, &[true, true, true]), 38);
        assert_eq!(solve(&items, 38), vec![true, true, true]);
        // Two of the three fit in 37 bytes (28: the copy is paid once).
        let two = solve(&items, 37);
        assert_eq!(
            (two.iter().filter(|&&s| s).count(), bytes(&items, &two)),
            (2, 28)
        );
    }
}
