//! What a statement keeps from the forward.

use std::fmt;

/// The checkpoint policy of one statement.
///
/// ```
/// use remat_runtime::Policy;
/// assert_eq!(Policy::default(), Policy::Recompute);
/// assert_eq!(Policy::Save.to_string(), "save");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Policy {
    /// Keep the statement's backward residuals (its tracked sub-graph) from the
    /// forward; the statement does not run again during replay.
    Save,
    /// Keep nothing; run the statement again during replay. The default.
    #[default]
    Recompute,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Save => "save",
            Policy::Recompute => "recompute",
        })
    }
}
