//! Plans that decide call by call: the k-th call of a region in a step
//! saves its own set of statements. Calls are counted from the plan's
//! [`scope`](super::Plan::scope): a step is one scope.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use super::StatementInfo;
use crate::ambient::{deeper, depth, Depth};
use crate::{lock, Policy};

/// Runs a region's replay: the regions nested in its block run again, and
/// are not calls of the step (the forward counted them).
pub(crate) fn replaying<R>(f: impl FnOnce() -> R) -> R {
    deeper(Depth::Replay, f)
}

/// Whether a region's replay is running on this thread.
pub(crate) fn in_replay() -> bool {
    depth(Depth::Replay) > 0
}

/// One call of a region in a step: the region's name and which of its
/// calls (0 for the first).
pub(crate) type CallId = (String, usize);

#[derive(Default)]
struct Seen {
    /// How many times each (region, statement) ran in this step.
    statements: HashMap<(String, String), usize>,
    /// How many calls of each region started in this step.
    calls: HashMap<String, usize>,
    /// Those calls, in the order they started.
    order: Vec<CallId>,
}

pub(super) struct PerCall {
    /// The open statements each call saves; the others are recomputed.
    save: HashMap<CallId, HashSet<String>>,
    seen: Mutex<Seen>,
}

impl PerCall {
    pub fn new(save: HashMap<CallId, HashSet<String>>) -> Self {
        PerCall {
            save,
            seen: Mutex::new(Seen::default()),
        }
    }

    /// A new step: calls are counted from zero again.
    pub fn reset(&self) {
        *lock(&self.seen) = Seen::default();
    }

    pub fn policy(&self, s: &StatementInfo) -> Policy {
        if in_replay() {
            // A region nested in a replayed block: not a call of the step.
            return s.declared.unwrap_or(Policy::Recompute);
        }
        let mut seen = lock(&self.seen);
        let key = (s.region.to_string(), s.name.to_string());
        let k = seen.statements.entry(key).or_insert(0);
        let call = *k;
        *k += 1;
        // Names are unique within a call: the k-th run of a statement is in
        // the k-th call of its region.
        let calls = seen.calls.entry(s.region.to_string()).or_insert(0);
        if call == *calls {
            *calls += 1;
            seen.order.push((s.region.to_string(), call));
        }
        let saved = self
            .save
            .get(&(s.region.to_string(), call))
            .is_some_and(|names| names.contains(s.name));
        s.declared.unwrap_or(if saved {
            Policy::Save
        } else {
            Policy::Recompute
        })
    }

    /// The calls of the current step so far, in the order they started.
    pub fn calls(&self) -> Vec<CallId> {
        lock(&self.seen).order.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info<'a>(region: &'a str, name: &'a str) -> StatementInfo<'a> {
        StatementInfo {
            region,
            name,
            declared: None,
        }
    }

    #[test]
    fn the_kth_call_of_a_region_follows_its_own_set() {
        let save = HashMap::from([(("block".to_string(), 1), HashSet::from(["fc".to_string()]))]);
        let plan = PerCall::new(save);
        for _ in 0..2 {
            plan.reset();
            let mut got = Vec::new();
            for _ in 0..3 {
                for name in ["qkv", "fc"] {
                    got.push(plan.policy(&info("block", name)));
                }
                got.push(plan.policy(&info("head", "logits")));
            }
            let (r, s) = (Policy::Recompute, Policy::Save);
            assert_eq!(got, [r, r, r, r, s, r, r, r, r]);
            let calls: Vec<CallId> = plan.calls();
            assert_eq!(calls.len(), 6);
            assert_eq!(calls[2], ("block".to_string(), 1));
        }
    }

    #[test]
    fn regions_run_again_by_a_replay_are_not_calls() {
        let save = HashMap::from([(("inner".to_string(), 1), HashSet::from(["fc".to_string()]))]);
        let plan = PerCall::new(save);
        let first = plan.policy(&info("inner", "fc"));
        // The replay of the block that called it runs it again.
        let again = replaying(|| plan.policy(&info("inner", "fc")));
        // The second call of the step is the one that saves.
        let second = plan.policy(&info("inner", "fc"));
        assert_eq!(
            (first, again, second),
            (Policy::Recompute, Policy::Recompute, Policy::Save)
        );
        assert_eq!(plan.calls().len(), 2);
    }
}
