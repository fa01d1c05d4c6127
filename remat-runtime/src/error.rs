//! The error type of the runtime.

use std::sync::Arc;

/// Everything that can go wrong in a checkpointed region.
///
/// Every variant names the region and, where there is one, the statement
/// involved, and its message says what to do about it.
///
/// ```
/// use remat_runtime::RematError;
/// let e = RematError::TapeReleased {
///     region: "block".into(),
///     reason: "it was consumed by an earlier backward".into(),
/// };
/// assert!(e.to_string().contains("block"));
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RematError {
    /// A recomputed statement read the output of a `Save` statement whose value
    /// was not ferried to the replay (the replay only has a placeholder for it).
    #[error(
        "region `{region}`: recomputed statement `{statement}` reads `{producer}`, the output of a \
         saved statement, but only a placeholder of it exists during replay; pass that value to \
         `{statement}` as a statement input (so the forward keeps it on the tape), or make `{statement}` \
         a saved statement, or make `{producer}` a recomputed one"
    )]
    PlaceholderRead {
        /// The region's name.
        region: String,
        /// The statement that tried to read the placeholder.
        statement: String,
        /// The saved statement whose output was read.
        producer: String,
    },
    /// A value recomputed during replay differs in shape, dtype or device from
    /// what the forward produced: the block is not deterministic.
    #[error(
        "region `{region}`, statement `{statement}`: {mismatch}; a checkpointed block must run the \
         same computation twice (do not read mutable state, clocks or unseeded randomness inside \
         it){}",
        trace_suffix(.trace)
    )]
    ReplayMismatch {
        /// The region's name.
        region: String,
        /// The statement whose value differs.
        statement: String,
        /// What differs.
        mismatch: Box<Mismatch>,
        /// The forward's records and the replay's statements side by side, up
        /// to the first divergence (empty when not available).
        trace: String,
    },
    /// The replay ran a different sequence of statements than the forward.
    #[error(
        "region `{region}`: the replay ran {found} where the forward ran {expected}; a \
         checkpointed block must run the same statements in the same order every time{}",
        trace_suffix(.trace)
    )]
    ReplayDesync {
        /// The region's name.
        region: String,
        /// What the forward recorded at this position.
        expected: String,
        /// What the replay ran.
        found: String,
        /// The forward's records and the replay's statements side by side, up
        /// to the first divergence (empty when not available).
        trace: String,
    },
    /// A value a recomputed statement computed again in the replay differs
    /// from what it computed in the forward: its fingerprint, a checksum of
    /// every element and its position, does not match (bit for bit, or
    /// within the dtype's tolerance when `bitwise` is false).
    #[error(
        "region `{region}`, statement `{statement}`: output {output} differs between the forward \
         and the replay ({}; sum, sum of magnitudes and position-weighted sum: {forward:?} in the \
         forward, {replay:?} in the replay), so the gradients would be wrong; a recomputed \
         statement must compute the same values twice: draw random numbers with \
         `remat_runtime::random` (candle's `rand`, `randn`, `rand_like` and \
         `candle_nn::ops::dropout` draw anew in the replay), read no state that changes between \
         the forward and the backward (counters, clocks, tensors changed in place), and do not \
         change parameters between a forward and its backward",
        if *.bitwise { "compared bit for bit" } else { "compared within the dtype's tolerance" }
    )]
    ReplayDiverged {
        /// The region's name.
        region: String,
        /// The statement whose output differs.
        statement: String,
        /// Which of its outputs.
        output: usize,
        /// Sum, sum of magnitudes and position-weighted sum of the output
        /// in the forward.
        forward: [f64; 3],
        /// The same in the replay.
        replay: [f64; 3],
        /// Whether the replay was compared bit for bit (it ran the same
        /// kernels on the same bits and layouts) or within a tolerance.
        bitwise: bool,
    },
    /// A parameter the region used changed between the region's forward and
    /// its backward (its fingerprint, a checksum of every element, does not
    /// match bit for bit).
    #[error(
        "region `{region}`: parameter {index} (shape {shape:?}, first used by statement \
         `{statement}`) changed between the forward and the backward (its checksum over every \
         element differs): an optimizer step or `Var::set` ran before `backward()`, and the gradients would mix the old values (kept by \
         saved statements) with the new ones (read by the replay); run the backward before \
         changing parameters"
    )]
    ParameterChanged {
        /// The region's name.
        region: String,
        /// The first statement whose graph used the parameter.
        statement: String,
        /// Which parameter, in the order the block first used them.
        index: usize,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// [`OptimizerInBackward`](crate::OptimizerInBackward) updated a
    /// parameter inside the backward, from the gradients of the regions
    /// reading it, and the backward then also gave it a gradient from code
    /// outside every region: this step's update of it missed that part.
    /// From the next step on it is updated after the backward.
    #[error(
        "parameter `{parameter}` was updated inside the backward after region `{region}` handed \
         over its gradient, but code outside every region also gave it a gradient, which this \
         step's update missed; from the next step on it is updated after the backward. If the \
         model changed which code reads it, build the optimizer again after the change"
    )]
    ParameterOutsideRegions {
        /// The parameter: its path in the `VarMap`, or its position and shape.
        parameter: String,
        /// The last region that read it.
        region: String,
    },
    /// A block input the replay reads changed between the region's forward
    /// and its backward (its fingerprint, a checksum of every element, does
    /// not match bit for bit): a tensor changed in place (`slice_set`,
    /// `Var::set`) after the forward.
    #[error(
        "region `{region}`: {} of the block, read by statement `{statement}`, changed between \
         the forward and the backward (its checksum over every element differs); the replay \
         would recompute with the new values and the gradients would be wrong; do not change a \
         block's inputs in place before its backward (pass a copy)",
        input_label(name, *index, shape)
    )]
    InputChanged {
        /// The region's name.
        region: String,
        /// The first recomputed statement that reads the input.
        statement: String,
        /// Which input of the region, in order.
        index: usize,
        /// The parameter of the `remat!` block that holds it (`mask`;
        /// `self` for a tensor among a method's receiver's); `None` in the
        /// statement API, whose inputs have no names.
        name: Option<String>,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A tensor the block reads from a field of one of its parameters
    /// (`self.mask`, `p.cos`: neither a block input nor a parameter) changed
    /// between the region's forward and its backward (its fingerprint, a
    /// checksum of every element, does not match bit for bit): written in
    /// place (`slice_set`, a `Var::set` on a variable sharing its storage)
    /// after the forward. Saved statements' backward and the replay would
    /// read its new values.
    #[error(
        "region `{region}`: `{field}` (shape {shape:?}, read by statement `{statement}`) \
         changed between the forward and the backward (its checksum over every element \
         differs); the backward would read the new values and the gradients would be wrong; \
         do not write a tensor the block reads in place before its backward (give the field \
         a new tensor instead)"
    )]
    FieldChanged {
        /// The region's name.
        region: String,
        /// The first statement that reads the field.
        statement: String,
        /// The field, as the block writes it (`self.mask`).
        field: String,
        /// The tensor's shape.
        shape: Vec<usize>,
    },
    /// The replay finished without running statements the forward ran.
    #[error(
        "region `{region}`: {} not replayed: the replay returned before running {}; a \
         checkpointed block must run the same statements every time",
        list_statements(.statements),
        if .statements.len() == 1 { "it" } else { "them" }
    )]
    NotReplayed {
        /// The region's name.
        region: String,
        /// Every statement the replay did not reach, in order.
        statements: Vec<String>,
    },
    /// A region output was computed outside any statement from values that
    /// need gradients: nothing in the replay produces it, so its gradient
    /// would be lost. (A constant, which carries no gradient, may be
    /// returned from anywhere.)
    #[error(
        "region `{region}`: output {index} was computed outside any statement (a tensor op in \
         the block's body, not in a statement's closure) from values that need gradients, so \
         its gradient would be lost; compute it in a statement (`ctx.recompute(\"name\", &[..], \
         |t| ...)`)"
    )]
    OutputOutsideStatement {
        /// The region's name.
        region: String,
        /// Position of the tensor among the region's outputs.
        index: usize,
    },
    /// A recomputed statement read a value that needs gradients without
    /// declaring it as an input (a closure capture): the gradient through
    /// that value would be lost.
    #[error(
        "region `{region}`, statement `{statement}`: reads a value that needs gradients without \
         declaring it as an input (captured by its closure), so the gradient through it would be \
         lost; declare it as an input of `{statement}`"
    )]
    UndeclaredInput {
        /// The region's name.
        region: String,
        /// The statement that read the value.
        statement: String,
    },
    /// A statement read values that need gradients and none of its
    /// floating-point outputs carries one: an op without a backward
    /// (candle's fused ops) cut the gradient path, and every gradient
    /// through the statement would be missing without a word.
    #[error(
        "region `{region}`, statement `{statement}`: output {output} carries no gradient although \
         the statement read values that need gradients (and no other output of it carries one), \
         so every gradient through it would be missing; an op without a backward cut the path: candle's `candle_nn::ops::rms_norm`, \
         `layer_norm`, `softmax_last_dim`, `sdpa`, `rotary_emb::rope`/`rope_i`/`rope_thd` and \
         `RmsNorm`/`LayerNorm` on contiguous inputs have none: use `remat_runtime::candle_nn`'s \
         drop-ins (same names and signatures) or `remat_runtime::nn`'s ops; if the cut is \
         intended, end the statement with `.detach()`"
    )]
    GradientCut {
        /// The region's name.
        region: String,
        /// The statement whose output carries no gradient.
        statement: String,
        /// Which of its outputs.
        output: usize,
    },
    /// A statement read a value that needs gradients for its value, and the
    /// graph of its outputs does not reach that value (other inputs carry
    /// gradients through it): an op without a backward cut the path from
    /// this input (candle's `rope` on the queries and keys while the values
    /// flow), or its values left through the host (`to_vec2`, `to_scalar`)
    /// and came back as a constant (`Tensor::new`); its gradient would be
    /// missing without a word.
    #[error(
        "region `{region}`, statement `{statement}`: {} needs gradients \
         and is read for its value, but the statement's outputs do not depend on it through candle's graph, so \
         its gradient would be missing; an op without a backward cut the path (candle's \
         `candle_nn::ops::rms_norm`, `layer_norm`, `softmax_last_dim`, `sdpa`, \
         `rotary_emb::rope`/`rope_i`/`rope_thd`, `RmsNorm`/`LayerNorm` on contiguous inputs: \
         use `remat_runtime::candle_nn`'s drop-ins of the same names or `remat_runtime::nn`'s \
         ops), or its values went through the host (`to_vec*`, `to_scalar`) and came back as a \
         constant (`Tensor::new`): compute them with tensor ops instead; if the input is meant to \
         give no gradient (read for control flow, indices or logging), read it as `.detach()`",
        input_label(name, *input, shape)
    )]
    InputCut {
        /// The region's name.
        region: String,
        /// The statement that read the input.
        statement: String,
        /// Which of the statement's inputs (0-based, in the order the
        /// statement declares them; `remat!` declares the bindings a
        /// statement reads for their values first, in the order it first
        /// mentions them); the position among the tensors of those values.
        input: usize,
        /// The name the block reads it by (`q`; `self` for a tensor among
        /// the fields of a method's receiver), in a `remat!` block; `None`
        /// in the statement API, whose inputs have no names.
        name: Option<String>,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A statement made a floating-point tensor from floats that an earlier
    /// statement computed on the host from values that need gradients
    /// (`to_vec2`, `to_scalar`): through a constructor (`Tensor::new(&w,
    /// ..)`), as a scalar (`(h * w as f64)?`), in a loop or a helper
    /// function. What it made is a constant in those floats, so the
    /// gradient stops there without a word (a mixture of experts' routing
    /// weights read to the host, normalised and multiplied back in: its
    /// router gets none). Read the tensors detached in the source statement
    /// (`probs.detach().to_vec2()`), or wrap the data in
    /// [`rules::constant`](crate::rules::constant), where that is meant.
    #[error(
        "region `{region}`, statement `{statement}`: makes a tensor from `{value}`, but `{value}` \
         holds floats computed on the host from statement `{from}`, which read values that \
         need gradients: they reach the tensor as constants, so their gradient would stop \
         there; compute `{value}` with tensor ops to keep it (top-k routing: \
         `arg_sort_last_dim`, `gather`, `softmax`); if no gradient is meant to flow, read the \
         tensor in `{from}` detached (`probs.detach().to_vec2()`), or wrap the value in \
         `remat_runtime::rules::constant(..)` where the statement reads it"
    )]
    HostCut {
        /// The region's name.
        region: String,
        /// The statement that made the tensor.
        statement: String,
        /// The plain value it made it from.
        value: String,
        /// The statement that read values needing gradients, which `value`
        /// was computed from.
        from: String,
    },
    /// A backward reached a region whose tape was already released.
    #[error(
        "region `{region}`: the tape is gone ({reason}); to run backward more than once, wrap \
         every backward but the last in `remat_runtime::retain_tape(|| ...)`"
    )]
    TapeReleased {
        /// The region's name.
        region: String,
        /// Why the tape was released.
        reason: String,
    },
    /// Two statements of one region call used the same name.
    #[error(
        "region `{region}`: the statement name `{statement}` is used twice; names must be unique \
         within a region (give one of them another name)"
    )]
    DuplicateName {
        /// The region's name.
        region: String,
        /// The duplicated name.
        statement: String,
    },
    /// [`PeakPlan::for_peak`](crate::plan::PeakPlan::for_peak) was asked for
    /// a peak below that of every plan it measured, full recomputation
    /// included.
    #[error(
        "no plan keeps the step under {requested} bytes: the lowest peak measured is {lowest} \
         bytes; lower the batch or the sequence, or update the parameters in the backward \
         (`OptimizerInBackward`)"
    )]
    PeakUnreachable {
        /// The peak asked for.
        requested: usize,
        /// The lowest peak measured.
        lowest: usize,
    },
    /// [`checkpoint_sequential`](crate::checkpoint_sequential) was asked for
    /// no segments, or for more segments than it has blocks.
    #[error(
        "checkpoint_sequential `{name}`: {segments} segments for {blocks} blocks; use between 1 \
         and the number of blocks"
    )]
    SegmentCount {
        /// The name given to `checkpoint_sequential`.
        name: String,
        /// The segments asked for.
        segments: usize,
        /// The blocks given.
        blocks: usize,
    },
    /// A plan names statements (`Plan::save_only`, `Plan::save_and_offload_only`)
    /// that no statement has: none run under the plan, and none of a
    /// `remat!` block compiled into the program. A misspelt name would
    /// otherwise leave its statement recomputed, silently. Raised by the
    /// backward of the first region that ran under the plan, when every
    /// region of the forward has run.
    #[error(
        "region `{region}` ran under the plan `{plan}`, which names {names:?}: no statement has \
         such a name, neither one run under the plan nor one of a `remat!` block of the program \
         (the names a plan may use are {known:?}); correct the names, or name statements with \
         `#[save(name = \"...\")]`"
    )]
    UnknownStatement {
        /// The region whose backward found it.
        region: String,
        /// The plan's label.
        plan: String,
        /// The names no statement has.
        names: Vec<String>,
        /// The names a plan may use (of the statements run under the plan
        /// and of every `remat!` block of the program), sorted.
        known: Vec<String>,
    },
    /// A statement read a tensor that needs gradients but that the region does
    /// not know: its gradient would be lost.
    #[error(
        "region `{region}`, statement `{statement}`: input {index} needs gradients but is neither a \
         region input, a parameter (`Var`) nor a statement output; pass it to the region as an \
         input so that its gradient is not lost"
    )]
    ForeignTrackedInput {
        /// The region's name.
        region: String,
        /// The statement that read the tensor.
        statement: String,
        /// Position of the tensor among the statement inputs.
        index: usize,
    },
    /// A statement's graph reaches a tensor that an earlier region call
    /// returned, not through one of the block's tensors: it is held in a
    /// value whose type does not derive [`Outputs`](crate::Outputs) (a
    /// field of a plain struct, a `Vec` of them) or captured by a closure.
    /// candle would run that call's backward inside this region's, and a
    /// use of the tensor outside it would find that backward spent.
    #[error(
        "region `{region}`, statement `{statement}`: reads a tensor that region `{from}` returned, \
         but not as one of the block's tensors (it is held in a value whose type does not derive \
         `remat_runtime::Outputs`, or captured by a closure), so `{from}`'s backward would run \
         inside this region's, and a use of the tensor outside it would find that backward \
         spent; derive `Outputs` for the type holding it \
         (`#[derive(Clone, remat_runtime::Outputs)]`), or pass the tensor to the block as a \
         `&Tensor`"
    )]
    CapturedOutput {
        /// The region's name.
        region: String,
        /// The statement that read the tensor.
        statement: String,
        /// The region that returned it.
        from: String,
    },
    /// The number of region outputs differs between forward and replay.
    #[error(
        "region `{region}`: the replay returned {replay} outputs but the forward returned \
         {forward}; a checkpointed block must return the same structure every time"
    )]
    OutputCount {
        /// The region's name.
        region: String,
        /// Outputs in the forward.
        forward: usize,
        /// Outputs in the replay.
        replay: usize,
    },
    /// Parameters that should have been trained received no gradient.
    #[error(
        "{} parameter(s) received no gradient: {}; the loss does not depend on them through \
         differentiable ops. Common causes: a fused candle op without backward \
         (`candle_nn::LayerNorm`/`RmsNorm` on contiguous input, `ops::layer_norm`, \
         `ops::rms_norm`, `ops::softmax_last_dim`, `ops::sdpa`, \
         `rotary_emb::rope`/`rope_i`/`rope_thd`: use `remat_runtime::nn`'s `layer_norm`, \
         `rms_norm`, `softmax_last_dim`, `attention`, `rope`, `rope_i`, or candle's \
         `ops::layer_norm_slow`, `ops::rms_norm_slow`, `ops::softmax`), a `detach`, or a \
         parameter the model never uses",
        names.len(),
        names.join(", ")
    )]
    MissingGradients {
        /// The names of the parameters without a gradient.
        names: Vec<String>,
    },
    /// A statement's own code failed, or an op's backward failed in the
    /// region's backward (`statement` then lists the statements of the unit
    /// whose backward ran, comma-separated).
    #[error("region `{region}`, statement `{statement}`: {source}")]
    Statement {
        /// The region's name.
        region: String,
        /// The failing statement.
        statement: String,
        /// What went wrong.
        source: Arc<RematError>,
    },
    /// Moving the residuals of an offloaded statement between the device and
    /// the host failed (typically: out of memory on the side it goes to).
    #[error(
        "region `{region}`: copying the residuals of offloaded statement `{statement}` \
         {direction} failed: {source}; the region's tape is released. Free memory on that \
         side, or keep the statement on the device with #[save]"
    )]
    Offload {
        /// The region's name.
        region: String,
        /// The offloaded statement.
        statement: String,
        /// `to the host` or `back to the device`.
        direction: String,
        /// candle's error.
        source: std::sync::Arc<candle_core::Error>,
    },
    /// [`Profile::record`](crate::inspect::Profile::record) was called while
    /// another profile was being recorded.
    #[error(
        "a profile is already being recorded (by an enclosing `Profile::record` or another \
         thread): record one at a time"
    )]
    ProfileRunning,
    /// An error from candle outside of any statement.
    #[error("candle: {0}")]
    Candle(Arc<candle_core::Error>),
    /// An error of a `remat!` block's own error type (neither candle's nor
    /// this one: `return Err(MyError::EmptyBatch)` in a statement), carried
    /// through the runtime. The block gives it back as it was
    /// ([`crate::rules::BlockError`]); raised in a replay, the backward
    /// returns it here, its message its `Debug` form.
    #[error("{0}")]
    User(UserError),
}

/// An error of a block's own type inside a [`RematError::User`]: its
/// `Debug` form, and the value, which the block takes back once.
///
/// ```
/// use remat_runtime::{rules::BlockError, RematError};
/// #[derive(Debug, PartialEq)]
/// struct Empty;
/// impl From<candle_core::Error> for Empty {
///     fn from(_: candle_core::Error) -> Self {
///         Empty
///     }
/// }
/// let e = Empty.into_remat();
/// assert!(matches!(&e, RematError::User(u) if u.to_string() == "Empty"));
/// assert_eq!(Empty::from_remat(e), Empty);
/// ```
#[derive(Clone)]
pub struct UserError {
    message: String,
    value: Arc<std::sync::Mutex<Option<Box<dyn std::any::Any + Send>>>>,
}

impl UserError {
    pub(crate) fn new(message: String, value: Box<dyn std::any::Any + Send>) -> Self {
        UserError {
            message,
            value: Arc::new(std::sync::Mutex::new(Some(value))),
        }
    }

    /// The value, if it is a `T` not taken yet.
    pub(crate) fn take<T: 'static>(&self) -> Option<T> {
        let mut slot = crate::lock(&self.value);
        match slot.take()?.downcast::<T>() {
            Ok(value) => Some(*value),
            Err(other) => {
                *slot = Some(other);
                None
            }
        }
    }
}

impl std::fmt::Display for UserError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::fmt::Debug for UserError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<candle_core::Error> for RematError {
    fn from(e: candle_core::Error) -> Self {
        RematError::Candle(Arc::new(e))
    }
}

impl From<RematError> for candle_core::Error {
    /// Wraps the error so that `?` works in functions returning
    /// `candle_core::Result`; the message is kept.
    fn from(e: RematError) -> Self {
        match e {
            RematError::Candle(inner) => match std::sync::Arc::try_unwrap(inner) {
                Ok(inner) => inner,
                Err(shared) => candle_core::Error::wrap(RematError::Candle(shared)),
            },
            other => candle_core::Error::wrap(other),
        }
    }
}

impl RematError {
    /// The innermost error: follows [`RematError::Statement`] wrappers down to
    /// the error that caused them.
    ///
    /// ```
    /// use remat_runtime::RematError;
    /// let inner = RematError::DuplicateName { region: "r".into(), statement: "a".into() };
    /// let e = RematError::Statement {
    ///     region: "outer".into(),
    ///     statement: "s".into(),
    ///     source: std::sync::Arc::new(inner),
    /// };
    /// assert!(matches!(e.root(), RematError::DuplicateName { .. }));
    /// ```
    pub fn root(&self) -> &RematError {
        match self {
            RematError::Statement { source, .. } => source.root(),
            other => other,
        }
    }

    /// The replay ran `found` where the forward ran `expected`.
    pub(crate) fn desync(
        region: &str,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> Self {
        RematError::ReplayDesync {
            region: region.to_string(),
            expected: expected.into(),
            found: found.into(),
            trace: String::new(),
        }
    }

    /// A value of `statement` differs between the forward and the replay.
    pub(crate) fn mismatch(region: &str, statement: &str, mismatch: Mismatch) -> Self {
        RematError::ReplayMismatch {
            region: region.to_string(),
            statement: statement.to_string(),
            mismatch: Box::new(mismatch),
            trace: String::new(),
        }
    }

    /// Attaches the side-by-side trace to a replay error.
    pub(crate) fn with_trace(mut self, text: String) -> Self {
        if let RematError::ReplayMismatch { trace, .. } | RematError::ReplayDesync { trace, .. } =
            &mut self
        {
            *trace = text;
        }
        self
    }

    /// Wraps an error raised by the code of `statement`.
    pub(crate) fn in_statement(self, region: &str, statement: &str) -> Self {
        RematError::Statement {
            region: region.to_string(),
            statement: statement.to_string(),
            source: Arc::new(self),
        }
    }
}

/// An input as an error names it: `` `q` (input 1, shape [2, 3]) `` where
/// the block names it, else `input 1 (shape [2, 3])`.
fn input_label(name: &Option<String>, input: usize, shape: &[usize]) -> String {
    match name {
        Some(name) => format!("`{name}` (input {input}, shape {shape:?})"),
        None => format!("input {input} (shape {shape:?})"),
    }
}

/// `statement `a`` or `statements `a`, `b``.
fn list_statements(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match quoted.len() {
        1 => format!("statement {} was", quoted[0]),
        _ => format!("statements {} were", quoted.join(", ")),
    }
}

/// The trace of a replay error on lines of its own, if there is one.
fn trace_suffix(trace: &str) -> String {
    if trace.is_empty() {
        String::new()
    } else {
        format!("\n{trace}")
    }
}

/// What differs between the forward and the replay of a value.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use candle_core::{DType, Device, Var};
/// use remat_runtime::{Region, RematError};
/// let x = Var::ones(2, DType::F32, &Device::Cpu)?;
/// let calls = AtomicUsize::new(0);
/// let y = Region::new("r").run(&[x.as_tensor()], move |ctx, ins| {
///     // wider in the replay than in the forward: not the same computation
///     let n = 2 + calls.fetch_add(1, Ordering::SeqCst);
///     ctx.recompute("widen", &[&ins[0]], move |t| t[0].repeat(n))
/// })?;
/// let e = remat_runtime::backward(&y.sum_all()?).unwrap_err();
/// let RematError::ReplayMismatch { mismatch, .. } = e else { panic!("{e}") };
/// assert_eq!(mismatch.value, "output 0");
/// assert_eq!(mismatch.to_string(), "shape of output 0 is [6] in the replay but was [4] in the forward");
/// # Ok::<(), RematError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
#[error("{what} of {value} is {replay} in the replay but was {forward} in the forward")]
pub struct Mismatch {
    /// Which value: `input 0`, `output 1`, ...
    pub value: String,
    /// `shape`, `dtype` or `device`.
    pub what: &'static str,
    /// What the forward saw.
    pub forward: String,
    /// What the replay saw.
    pub replay: String,
}

/// The result type of the runtime.
pub type Result<T, E = RematError> = std::result::Result<T, E>;
