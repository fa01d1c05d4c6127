//! The region of a block ([`region`]) and the context its statements run in
//! ([`Block`]), which fixes the error type of the block's statements to the
//! block's own.

use super::args::{Args, Split};
use crate::{Ctx, Outputs, Policy, Region, RematError, Result};

/// The policy a statement of a block declares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Declared {
    /// None: an open statement, the plan decides ([`Ctx::open`]).
    Open,
    /// `#[save]`.
    Save,
    /// `#[offload]`.
    Offload,
    /// `#[recompute]`.
    Recompute,
}

impl Declared {
    pub(crate) fn policy(self) -> Option<Policy> {
        match self {
            Declared::Open => None,
            Declared::Save => Some(Policy::Save),
            Declared::Offload => Some(Policy::Offload),
            Declared::Recompute => Some(Policy::Recompute),
        }
    }
}

/// The region of a block whose function returns `R` (a `Result`): its
/// statements fail with `R`'s error type.
/// `errors`: how its error type and the runtime's convert
/// (`rt::BlockError::errors()`, checked where the block's result is
/// written).
pub fn region<R: ResultError>(name: impl Into<String>, errors: Errors<R::Error>) -> BlockRegion<R> {
    BlockRegion {
        region: Region::new(name).declaring_all_reads(),
        errors,
    }
}

/// How a block's error type `E` and [`RematError`] convert
/// ([`crate::rules::BlockError`]).
pub struct Errors<E> {
    pub(crate) into_remat: fn(E) -> RematError,
    pub(crate) from_remat: fn(RematError) -> E,
}

/// See [`region`].
pub struct BlockRegion<R: ResultError> {
    region: Region,
    errors: Errors<R::Error>,
}

impl<R: ResultError> BlockRegion<R> {
    /// The region checks the tensors of `fields` (the parameters' fields
    /// the block reads in place) for changes between its forward and its
    /// backward.
    pub fn fields<F: Args>(mut self, fields: F) -> Self {
        let mut split = Split::default();
        fields.push(&mut split);
        self.region = self.region.with_fields(split.fields);
        self
    }

    /// Runs `body` on `args` (the block's parameters, named `names`, of
    /// which the region keeps its own copy) as a region: once now, and once
    /// more at the start of its backward.
    pub fn run<A, O>(
        self,
        names: &'static [&'static str],
        args: A,
        body: impl Fn(&mut Block<'_, R::Error>, A::Values) -> Result<O> + Send + Sync + 'static,
    ) -> std::result::Result<O, R::Error>
    where
        A: Args + Send + Sync + 'static,
        O: Outputs,
        R::Error: 'static,
    {
        let (inputs, names) = args.named_tensors(names);
        let into_remat = self.errors.into_remat;
        let region = self.region.with_input_names(names);
        let result = region.run(inputs, move |ctx, tensors| {
            let values = args.values_from(tensors, tensors.len())?;
            body(
                &mut Block {
                    ctx,
                    host_cut: None,
                    into_remat,
                },
                values,
            )
        });
        result.map_err(self.errors.from_remat)
    }
}

/// The context a block's statements run in: the region's [`Ctx`], and the
/// block's error type `E`.
pub struct Block<'a, E> {
    pub(crate) ctx: &'a mut Ctx,
    /// A cut [`Block::host_data`] found in what the named statement reads:
    /// raised if the statement gives a floating-point tensor.
    host_cut: Option<(String, RematError)>,
    /// The block's error type as the runtime carries it.
    into_remat: fn(E) -> RematError,
}

impl<E> Block<'_, E> {
    /// Whether this run is the replay (a `#[forward_only]` statement runs
    /// only when it is not).
    pub fn is_replay(&self) -> bool {
        self.ctx.is_replay()
    }

    /// Checks that statement `statement`, which reads the plain value
    /// `value` (`data`) as data, makes no floating-point tensor from floats
    /// computed on the host from values that need gradients: `sources` are
    /// the statements `value` was computed from. Called before the
    /// statement; its cut, if any, is raised once the statement has given a
    /// floating-point tensor (a statement that only computes on the host,
    /// or makes integer indices, passes). See `Ctx::host_cut`.
    pub fn host_data<T: ?Sized>(
        &mut self,
        statement: &str,
        value: &str,
        data: &T,
        sources: &[&str],
    ) {
        if self.host_cut.as_ref().is_some_and(|(s, _)| s == statement) {
            return;
        }
        let cut = self
            .ctx
            .host_cut(statement, value, holds_floats(data), sources);
        self.host_cut = cut.map(|cut| (statement.to_string(), cut));
    }

    /// Runs a statement: see [`crate::rules::StatementValue`].
    pub(crate) fn statement<A: Args, O: Outputs>(
        &mut self,
        name: &str,
        reads: &[&str],
        declared: Declared,
        args: A,
        f: impl FnOnce(A::Values) -> std::result::Result<O, E>,
    ) -> Result<O> {
        let (inputs, n_values, reach) = args.tensors();
        let cut = self.host_cut.take().filter(|(s, _)| s == name);
        // Whether the statement made a float tensor: one of its outputs
        // that is not one of its inputs handed back as it was (a `mut`
        // binding it read but did not change).
        let made_floats = std::cell::Cell::new(false);
        let out = self.ctx.run(
            name,
            declared.policy(),
            inputs,
            (n_values, &reach),
            |tensors| {
                let out = f(args.values_from(tensors, n_values)?).map_err(self.into_remat)?;
                if cut.is_none() {
                    return Ok(out);
                }
                let mut outputs = Vec::new();
                let skeleton = out.split_into(&mut outputs);
                made_floats.set(outputs.iter().any(|t| {
                    t.dtype().is_float() && !tensors.iter().any(|input| input.id() == t.id())
                }));
                O::join(&mut outputs.into_iter(), &skeleton)
            },
        );
        let out = out.map_err(|e| name_input(e, (self.ctx.region(), name), reads, &args))?;
        match cut {
            Some((_, cut)) if made_floats.get() => Err(cut),
            _ => Ok(out),
        }
    }
}

/// An [`RematError::InputCut`] of statement `statement` of region
/// `in_region` with the name the
/// block reads the input by (`reads`: the names of the values `args` reads
/// for their values, in order).
fn name_input<A: Args>(
    e: RematError,
    (in_region, statement): (&str, &str),
    reads: &[&str],
    args: &A,
) -> RematError {
    match e {
        RematError::InputCut {
            region,
            statement: s,
            input,
            name: None,
            shape,
        } if s == statement && region == in_region => {
            let name = args
                .value_of(input)
                .and_then(|v| reads.get(v))
                .map(|n| n.to_string());
            RematError::InputCut {
                region,
                statement: s,
                input,
                name,
                shape,
            }
        }
        e => e,
    }
}

/// Whether a value of `data`'s type can hold floating-point numbers (its
/// type names `f32`, `f64`, `f16` or `bf16`: `Vec<Vec<f32>>`, `(usize,
/// f32)`; not `Vec<u32>`).
fn holds_floats<T: ?Sized>(_: &T) -> bool {
    std::any::type_name::<T>()
        .split(|c: char| !c.is_alphanumeric() && c != '_')
        .any(|word| matches!(word, "f32" | "f64" | "f16" | "bf16"))
}

/// The name of a method's region: `Type::method`, the type without its
/// module path (`DecoderLayer::forward`, `Block<f32>::forward`).
pub fn method_region<T: ?Sized>(method: &str) -> String {
    let full = std::any::type_name::<T>();
    let (path, generics) = full.split_at(full.find('<').unwrap_or(full.len()));
    let ty = path.rsplit("::").next().unwrap_or(path);
    format!("{ty}{generics}::{method}")
}

/// The error type of a block's function (`candle_core::Error` for
/// `candle_core::Result<T>`): its statements fail with it.
pub type ErrorOf<R> = <R as ResultError>::Error;

/// See [`ErrorOf`].
pub trait ResultError {
    /// The error type.
    type Error;
}

impl<T, E> ResultError for std::result::Result<T, E> {
    type Error = E;
}
