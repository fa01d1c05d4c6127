//! What a statement keeps from the forward.

use std::fmt;

/// The checkpoint policy of one statement.
///
/// ```
/// use remat_runtime::Policy;
/// assert_eq!(Policy::default(), Policy::Recompute);
/// assert_eq!(Policy::Save.to_string(), "save");
/// assert_eq!(Policy::Offload.to_string(), "offload");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Policy {
    /// Keep the statement's backward residuals (its tracked sub-graph) from the
    /// forward; the statement does not run again during replay.
    Save,
    /// Keep nothing; run the statement again during replay. The default.
    #[default]
    Recompute,
    /// Keep the statement's backward residuals as [`Policy::Save`] does, but
    /// in host memory: on a CUDA device they are copied to the host when the
    /// region's forward ends and back to the device when the backward sweep
    /// reaches the statement. On a CPU device the residuals already live in
    /// host memory and the statement is kept exactly as a saved one
    /// (see [`crate::offload`]).
    Offload,
}

impl Policy {
    /// Whether the statement's residuals are kept from the forward (saved or
    /// offloaded) rather than recomputed.
    ///
    /// ```
    /// use remat_runtime::Policy;
    /// assert!(Policy::Offload.keeps_residuals());
    /// assert!(!Policy::Recompute.keeps_residuals());
    /// ```
    pub fn keeps_residuals(self) -> bool {
        matches!(self, Policy::Save | Policy::Offload)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Save => "save",
            Policy::Recompute => "recompute",
            Policy::Offload => "offload",
        })
    }
}
