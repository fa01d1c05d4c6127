//! Names, static dataflow and the semantic checks of a parsed block.
//!
use std::collections::HashMap;

use proc_macro2::{Span, TokenStream};
use syn::{Expr, Ident};

use crate::errors::Errors;
use crate::fields::{field_reads, FieldRead};
use crate::host::{
    into_tensors, read_as_data, reads_to_host, reads_to_host_without_gradient, HostValue, Place,
};
use crate::hygiene::context;
use crate::model::{AnnotationKind, Block, StmtKind};
use crate::plain::copies;
use crate::scopes::outer_view;
use crate::usage::{
    assigned, bound, locals, mentions, moved, read_for_value, read_in_part, read_on_branch,
    read_through_fields, single,
};

/// A binding a statement reads.
#[derive(Debug, Clone)]
pub(crate) struct Read {
    /// The name, spanned at its first mention in the statement.
    pub ident: Ident,
    /// A reference: a borrowed parameter (`&T`, `Option<&T>`), or an alias
    /// of one or of a binding (`let residual = xs;`, `let r = &h;`). The
    /// statement reads what it refers to and sees a reference again.
    pub borrowed: Option<Borrowed>,
    /// References taken of such a reference (`let xr = &x;` with `x: &T`:
    /// 1): the statement reads through them and sees them again.
    pub refs: usize,
    /// Declared `mut`: the statement may change it, and gives it back.
    pub mutable: bool,
    /// The statement reads it for its value, where a gradient can flow (not
    /// only its shape, dtype or device, nor only detached).
    pub for_value: bool,
    /// Read for its value only in part (`parts[0]`, `pair.0`): of its
    /// tensors, the statement's graph need reach one.
    pub in_part: bool,
    /// Read for its value only on some branches of the statement (`if skip
    /// { (h + x)? } else { h }`): its graph need not reach it.
    pub on_branch: bool,
    /// Bound by plain code (a closure, a guard), whose type may not be
    /// `Clone`: the read is checked where it is written.
    pub plain_code: bool,
    /// A binding a closure the statement calls borrows, whose name a later
    /// `let` took: read through the reference `source` made before that
    /// `let` (see `StatementAnalysis::keeps`).
    pub source: Option<Ident>,
}

/// What a reference binding refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Borrowed {
    /// The parameter of this index (or an alias of it): passed as it is.
    Param(usize),
    /// An owned binding, by `let r = &h;`: `&T` with `T` sized.
    Binding,
}

/// What the analysis found for one statement.
#[derive(Debug, Clone)]
pub(crate) struct StatementAnalysis {
    /// The record name (empty for items and forward-only statements).
    pub name: String,
    /// Save, Offload, Recompute or ForwardOnly; `None` for an unannotated
    /// statement, whose policy the region's plan decides at run time.
    pub kind: Option<AnnotationKind>,
    /// Plain code: a `let` run as it is in the forward and in the replay,
    /// outside any statement (a closure, a guard, a copy, a reference).
    pub plain: bool,
    /// The bindings it reads, in order of first use.
    pub reads: Vec<Read>,
    /// Owned bindings whose last reader this statement is, or that it
    /// moves: dropped after it (a later read of a moved binding is then
    /// rustc's "use of moved value", as without the macro).
    pub releases: Vec<Ident>,
    /// The `mut` bindings it reads and may change.
    pub changes: Vec<Ident>,
    /// Those of `changes` read again later: given back as outputs after its
    /// value.
    pub inouts: Vec<Ident>,
    /// The closures of the block it calls, defined again in its code
    /// (`let f = |t| t + &bias;`), in order: see `Binding::captures`.
    pub closures: Vec<TokenStream>,
    /// A closure only statements call: they define it (`closures`), so it
    /// is not defined where written.
    pub inlined: bool,
    /// `let g_shadowed = &g;` before it: bindings it shadows that closures
    /// called later borrow, kept under another name for them.
    pub keeps: Vec<(Ident, Ident)>,
    /// Plain values (or their fields) it reads as data that a host read
    /// may have computed, each with the statements it was computed from:
    /// if one of those read values that need gradients and the statement
    /// gives a float tensor, the gradient stops at the host
    /// ([`made_tensors`](Analyser::made_tensors)).
    pub host_data: Vec<HostValue>,
}

/// What the analysis found for a block: per statement, and for the tail.
pub(crate) struct Analysis {
    pub statements: Vec<StatementAnalysis>,
    pub tail_reads: Vec<Read>,
    /// The closures the tail calls (as [`StatementAnalysis::closures`]).
    pub tail_closures: Vec<TokenStream>,
    /// The tail is `Ok(x)` with `x` a binding of a statement: the block
    /// returns it as it is, with no statement of its own.
    pub tail_passthrough: Option<Ident>,
    /// What the tail turns into tensors from the host (as
    /// [`StatementAnalysis::host_data`]).
    pub tail_host_data: Vec<HostValue>,
    /// The parameters' fields the statements read in place, each once,
    /// with the name of the first statement that reads it.
    pub fields: Vec<(FieldRead, String)>,
}

/// A closure (borrowing what it mentions, or a `move` one).
fn is_closure(init: &Expr) -> bool {
    matches!(init, Expr::Closure(_))
}

/// The names a statement reads only in part, with the closures it calls
/// (`called`, whose reads for their values and in part are in `closures`):
/// a name is read in part where every read of it, the statement's own
/// (`own`, `own_part`) and each closure's, is (`ws[i]` in a closure).
fn in_part_with(
    own: &[String],
    own_part: &[String],
    called: &[usize],
    closures: (&[Vec<String>], &[Vec<String>]),
) -> Vec<String> {
    let (for_value, in_part) = closures;
    let in_part_everywhere = |name: &String| {
        (!own.contains(name) || own_part.contains(name))
            && called
                .iter()
                .all(|&c| !for_value[c].contains(name) || in_part[c].contains(name))
    };
    let mut out: Vec<String> = own_part.to_vec();
    for &c in called {
        for name in &in_part[c] {
            if !out.contains(name) && in_part_everywhere(name) {
                out.push(name.clone());
            }
        }
    }
    out.retain(|name| in_part_everywhere(name));
    out
}

/// The names a statement reads only through the values built of them it
/// reads (see [`crate::plain::built_lets`]), which it may use some of the
/// fields of only (`LinearCrossEntropy { bias: None, ..o }`), or through
/// closures it calls only on some branches (`if a { mix(&h)? } else { h }`):
/// its graph need not reach them, as if read on a branch. `called`: the
/// values and closures it reads, each with whether it reads it on some
/// branches only; `own` and `own_branch`: the names it reads for their
/// values itself, and those of them it reads on some branches only.
fn through_unsure(
    own: &[String],
    own_branch: &[String],
    called: &[(usize, bool)],
    for_value: &[Vec<String>],
    built: &[bool],
) -> Vec<String> {
    let unsure = |c: usize, branch: bool| built[c] || branch;
    let sure = |name: &String| {
        (own.contains(name) && !own_branch.contains(name))
            || called
                .iter()
                .any(|&(c, branch)| !unsure(c, branch) && for_value[c].contains(name))
    };
    let mut out: Vec<String> = Vec::new();
    for &(c, branch) in called {
        if !unsure(c, branch) {
            continue;
        }
        for name in &for_value[c] {
            if !sure(name) && !out.contains(name) {
                out.push(name.clone());
            }
        }
    }
    out
}

/// `Ok(x)` with `x` bound by a statement of the block.
fn passthrough(tail: &Expr, reads: &[usize], bindings: &[Binding]) -> Option<Ident> {
    let Expr::Call(call) = tail else { return None };
    let Expr::Path(f) = &*call.func else {
        return None;
    };
    if !f.path.is_ident("Ok") || call.args.len() != 1 {
        return None;
    }
    let Expr::Path(arg) = &call.args[0] else {
        return None;
    };
    let ident = arg.path.get_ident()?;
    reads
        .iter()
        .map(|&b| &bindings[b])
        .find(|b| b.ident == *ident && b.producer.is_some())
        .map(|b| b.ident.clone())
}

struct Binding {
    ident: Ident,
    /// A reference: see [`Read::borrowed`].
    borrowed: Option<Borrowed>,
    /// See [`Read::refs`].
    refs: usize,
    /// The bindings that live as long as it: the one a `let r = &h;` alias
    /// refers to, those a closure borrows.
    refers_to: Vec<usize>,
    /// A closure (`let f = |t| t + &bias;`, a `move` one, one changing what
    /// it borrows): its statement and what it reads. A statement calling
    /// it defines it again in its own code, over its own copies of those
    /// (given back where the closure changes them), so that the replay
    /// computes with them and their gradients flow.
    captures: Option<(usize, Vec<(usize, Span)>)>,
    mutable: bool,
    /// The `mut` binding this one gives back unchanged in name (a statement
    /// reading a `mut` binding gives it back as a new binding).
    continues: Option<usize>,
    /// The statement that bound it; `None` for parameters.
    producer: Option<usize>,
    last_reader: Option<usize>,
    /// The statement that moved it, if any, and where.
    moved_by: Option<(usize, Span)>,
}

/// Analyses `block`: dataflow, names and releases, with the semantic errors
/// pushed to `errors`.
pub(crate) fn analyse(block: &Block, errors: &mut Errors) -> Analysis {
    let mut a = Analyser::new(block, errors);
    let reads = a.dataflow();
    let names = a.names(&reads);
    a.finish(reads, names)
}

/// The state of one block's analysis.
struct Analyser<'a> {
    block: &'a Block,
    errors: &'a mut Errors,
    /// Every binding: the parameters, then each statement's, in order.
    bindings: Vec<Binding>,
    /// The binding each name refers to at the current statement, whatever
    /// expansion wrote it.
    current: HashMap<String, usize>,
    /// The same for each name and syntax context ([`crate::hygiene`]): a
    /// `macro_rules!` template's `h` and its caller's `h` are two bindings.
    in_context: HashMap<(String, u32), usize>,
    /// Each statement's annotation (the user's).
    kinds: Vec<Option<AnnotationKind>>,
    /// Whether each statement is plain code: what parsing found, and
    /// references the analysis finds.
    plain: Vec<bool>,
    /// Per statement: a `let` of a value built of others
    /// ([`crate::plain::built_lets`]), defined again where it is read.
    built: Vec<bool>,
    /// The closure statements the statement being resolved calls.
    called: Vec<usize>,
}

/// Which bindings each statement reads (with the span of the first
/// mention), and which the tail reads.
struct Reads {
    statements: Vec<Vec<(usize, Span)>>,
    /// Per statement, the `mut` bindings it may change (their new
    /// bindings).
    inouts: Vec<Vec<usize>>,
    /// Per statement, then the tail: the names it reads for their values.
    for_value: Vec<Vec<String>>,
    /// Per statement, then the tail: those of them it reads only in part
    /// ([`read_in_part`]).
    in_part: Vec<Vec<String>>,
    /// Per statement, then the tail: those it reads only through fields and
    /// parts ([`read_through_fields`]).
    in_fields: Vec<Vec<String>>,
    /// Per statement, then the tail: those it reads only on some branches
    /// ([`read_on_branch`]).
    on_branch: Vec<Vec<String>>,
    /// Per statement, then the tail: the names it turns into tensors
    /// ([`into_tensors`]).
    into_tensors: Vec<Vec<String>>,
    /// Per statement, then the tail: the bindings (or their fields) whose
    /// values flow into its value ([`read_as_data`]).
    data: Vec<Vec<Place>>,
    /// Per statement: it reads a tensor to the host ([`reads_to_host`]).
    to_host: Vec<bool>,
    /// Per statement: what it reads to the host carries no gradient
    /// ([`reads_to_host_without_gradient`]): it is no host read.
    no_gradient: Vec<bool>,
    /// Per statement, then the tail: the parameters' fields it reads in
    /// place ([`field_reads`]).
    fields: Vec<Vec<FieldRead>>,
    tail: Vec<(usize, Span)>,
    /// Per statement, then the tail: the closure statements it calls.
    closures: Vec<Vec<usize>>,
}

impl<'a> Analyser<'a> {
    fn new(block: &'a Block, errors: &'a mut Errors) -> Self {
        let bindings: Vec<Binding> = block
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| Binding {
                ident: p.ident.clone(),
                borrowed: p.borrowed().then_some(Borrowed::Param(i)),
                refs: 0,
                refers_to: Vec::new(),
                captures: None,
                mutable: p.mutable,
                continues: None,
                producer: None,
                last_reader: None,
                moved_by: None,
            })
            .collect();
        let current = bindings
            .iter()
            .enumerate()
            .map(|(i, b)| (b.ident.to_string(), i))
            .collect();
        let in_context = bindings
            .iter()
            .enumerate()
            .filter_map(|(i, b)| Some(((b.ident.to_string(), context(b.ident.span())?), i)))
            .collect();
        let kinds = block
            .statements
            .iter()
            .map(|s| s.annotation.as_ref().map(|a| a.kind))
            .collect();
        let built = crate::plain::built_lets(block);
        let plain = block
            .statements
            .iter()
            .zip(&built)
            .map(|(s, &b)| crate::plain::plain(s, b))
            .collect();
        Analyser {
            block,
            errors,
            bindings,
            current,
            in_context,
            kinds,
            plain,
            built,
            called: Vec::new(),
        }
    }

    /// Dataflow: who reads which binding, statement by statement, and the
    /// tail; which bindings each statement moves and gives back.
    fn dataflow(&mut self) -> Reads {
        let block = self.block;
        let mut statements = Vec::new();
        let mut inouts = Vec::new();
        let mut for_value = Vec::new();
        let mut in_part = Vec::new();
        let mut in_fields = Vec::new();
        let mut on_branch = Vec::new();
        let mut into = Vec::new();
        let mut data = Vec::new();
        let mut to_host = Vec::new();
        let mut no_gradient = Vec::new();
        let mut fields = Vec::new();
        let mut closures = Vec::new();
        for (i, stmt) in block.statements.iter().enumerate() {
            let forward_only = self.kinds[i] == Some(AnnotationKind::ForwardOnly);
            let (expr, pat) = match &stmt.kind {
                StmtKind::Let { pat, init } => (init, Some(pat)),
                StmtKind::Expr(e) => (e, None),
                StmtKind::Item(_) => {
                    statements.push(Vec::new());
                    inouts.push(Vec::new());
                    for_value.push(Vec::new());
                    in_part.push(Vec::new());
                    in_fields.push(Vec::new());
                    on_branch.push(Vec::new());
                    into.push(Vec::new());
                    data.push(Vec::new());
                    to_host.push(false);
                    no_gradient.push(false);
                    fields.push(Vec::new());
                    closures.push(Vec::new());
                    continue;
                }
            };
            // What the statement binds itself shadows the block's bindings.
            let expr = &outer_view(expr);
            for_value.push(read_for_value(expr));
            in_part.push(read_in_part(expr));
            in_fields.push(read_through_fields(expr));
            on_branch.push(read_on_branch(expr));
            into.push(into_tensors(expr));
            data.push(read_as_data(expr));
            to_host.push(reads_to_host(expr));
            no_gradient.push(reads_to_host_without_gradient(expr));
            fields.push(self.field_reads(expr));
            let alias = match pat {
                Some(p) if self.kinds[i].is_none() => single(p).and(self.alias(expr)),
                _ => None,
            };
            if alias.is_some() {
                // Plain code: a reference is not a statement's value.
                self.plain[i] = true;
            }
            let assigned = assigned(expr);
            self.check_assignments(expr, &assigned);
            let reads = self.resolve(expr, i, forward_only);
            let called = std::mem::take(&mut self.called);
            in_part[i] = in_part_with(&for_value[i], &in_part[i], &called, (&for_value, &in_part));
            let branches = self.on_branches(&called, &on_branch[i]);
            let unsure = through_unsure(
                &for_value[i],
                &on_branch[i],
                &branches,
                &for_value,
                &self.built,
            );
            on_branch[i].extend(unsure);
            for &c in &called {
                let (f, d, t) = (for_value[c].clone(), data[c].clone(), into[c].clone());
                for_value[i].extend(f);
                data[i].extend(d);
                into[i].extend(t);
                to_host[i] |= to_host[c];
                no_gradient[i] &= !to_host[c];
            }
            closures.push(called);
            let mut given = Vec::new();
            // A closure changes none of the bindings it mentions where it is
            // written: it gives none back (a statement calling it does).
            let closure = self.plain[i]
                && (is_closure(expr) || self.built[i])
                && pat.and_then(single).is_some();
            if !forward_only {
                let moved = self.moves(expr, i);
                let rebound: Vec<String> = pat
                    .map(|p| bound(p).iter().map(|(i, _)| i.to_string()).collect())
                    .unwrap_or_default();
                // A `mut` binding it reads is given back as a new binding,
                // unless the statement moved it away (and did not assign it
                // again), binds the name anew, or only reads its shape,
                // dtype or device (`xs.dtype()`, `xs.dims()`: no method
                // of those changes it, and a value given back from such a
                // read would carry no gradient).
                for &(b, _) in &reads {
                    let name = self.bindings[b].ident.to_string();
                    let is_assigned = assigned.iter().any(|(n, _)| *n == name);
                    let metadata_only = !for_value[i].contains(&name) && !is_assigned;
                    if self.bindings[b].mutable
                        && !closure
                        && !metadata_only
                        && (!moved.contains(&b) || is_assigned)
                        && !rebound.contains(&name)
                    {
                        let ident = self.bindings[b].ident.clone();
                        self.bind(ident, true, i);
                        let new = self.bindings.len() - 1;
                        self.bindings[new].continues = Some(b);
                        given.push(new);
                    }
                }
            }
            if let Some(pat) = pat {
                for (ident, mutable) in bound(pat) {
                    self.bind(ident, mutable, i);
                }
                // `alias` and closures bind one name: the last binding.
                let b = self.bindings.len().saturating_sub(1);
                if let Some((borrowed, refs, refers_to)) = alias {
                    self.bindings[b].borrowed = Some(borrowed);
                    self.bindings[b].refs = refs;
                    self.bindings[b].refers_to = refers_to;
                } else if closure {
                    // A closure borrowing bindings: they live as long as it.
                    let mut held = Vec::new();
                    for &(r, _) in &reads {
                        if self.bindings[r].borrowed.is_none() {
                            held.push(r);
                        }
                        held.extend(self.bindings[r].refers_to.iter().copied());
                    }
                    self.bindings[b].refers_to = held;
                    // What it moves (`|t| (t * g.exp()?)? * k` moves the
                    // `f64` `k`) each calling statement moves from its own
                    // copy: not moved where the closure is written. (A
                    // closure left to plain code there moves it: a later
                    // statement reading a value that is not `Copy` is then
                    // rustc's E0382, not a gradient lost through the
                    // forward's value.)
                    for &(r, _) in &reads {
                        if self.bindings[r].moved_by.is_some_and(|(m, _)| m == i) {
                            self.bindings[r].moved_by = None;
                        }
                    }
                    self.bindings[b].captures = Some((i, reads.clone()));
                }
            }
            statements.push(reads);
            inouts.push(given);
        }
        let n = block.statements.len();
        let tail = match &block.tail {
            Some(t) => {
                let t = &outer_view(t);
                self.check_assignments(t, &assigned(t));
                for_value.push(read_for_value(t));
                in_part.push(read_in_part(t));
                in_fields.push(read_through_fields(t));
                on_branch.push(read_on_branch(t));
                into.push(into_tensors(t));
                data.push(read_as_data(t));
                fields.push(self.field_reads(t));
                let reads = self.resolve(t, n, false);
                let called = std::mem::take(&mut self.called);
                in_part[n] =
                    in_part_with(&for_value[n], &in_part[n], &called, (&for_value, &in_part));
                let branches = self.on_branches(&called, &on_branch[n]);
                let unsure = through_unsure(
                    &for_value[n],
                    &on_branch[n],
                    &branches,
                    &for_value,
                    &self.built,
                );
                on_branch[n].extend(unsure);
                for &c in &called {
                    let (f, d, t) = (for_value[c].clone(), data[c].clone(), into[c].clone());
                    for_value[n].extend(f);
                    data[n].extend(d);
                    into[n].extend(t);
                }
                closures.push(called);
                reads
            }
            None => Vec::new(),
        };
        Reads {
            statements,
            inouts,
            for_value,
            in_part,
            in_fields,
            on_branch,
            into_tensors: into,
            data,
            to_host,
            no_gradient,
            fields,
            tail,
            closures,
        }
    }

    /// The fields of parameters `expr` reads in place (a parameter the
    /// block has not bound the name of again).
    fn field_reads(&self, expr: &Expr) -> Vec<FieldRead> {
        let is_param = |i: &Ident| {
            self.lookup(&i.to_string(), i.span())
                .is_some_and(|b| self.bindings[b].producer.is_none())
        };
        field_reads(expr, is_param, self.block.receiver.as_ref())
    }

    /// `let a = b;` with `b` a reference (a borrowed parameter, or an alias
    /// of one), or `let r = &h;` with `h` a binding: what the new binding
    /// refers to, the references taken of a reference on the way (`let xr =
    /// &x;` with `x: &T`), and the bindings that must outlive it.
    fn alias(&self, init: &Expr) -> Option<(Borrowed, usize, Vec<usize>)> {
        let (reference, target) = match init {
            Expr::Reference(r) if r.mutability.is_none() => (true, &*r.expr),
            e => (false, e),
        };
        let Expr::Path(p) = target else { return None };
        let ident = p.path.get_ident().filter(|_| p.qself.is_none())?;
        let b = self.lookup(&ident.to_string(), ident.span())?;
        match (self.bindings[b].borrowed, reference) {
            (Some(borrowed), _) => Some((
                borrowed,
                self.bindings[b].refs + usize::from(reference),
                self.bindings[b].refers_to.clone(),
            )),
            (None, true) => Some((Borrowed::Binding, 0, vec![b])),
            (None, false) => None,
        }
    }

    /// The binding `name`, mentioned at `span`, refers to: the one of its
    /// syntax context, else the latest of any (a name a proc macro wrote at
    /// its call site resolves as the caller's).
    fn lookup(&self, name: &str, span: Span) -> Option<usize> {
        context(span)
            .and_then(|c| self.in_context.get(&(name.to_string(), c)))
            .or_else(|| self.current.get(name))
            .copied()
    }

    /// A new binding of `ident` by statement `producer`.
    fn bind(&mut self, ident: Ident, mutable: bool, producer: usize) {
        self.current.insert(ident.to_string(), self.bindings.len());
        if let Some(c) = context(ident.span()) {
            self.in_context
                .insert((ident.to_string(), c), self.bindings.len());
        }
        self.bindings.push(Binding {
            ident,
            borrowed: None,
            refs: 0,
            refers_to: Vec::new(),
            captures: None,
            mutable,
            continues: None,
            producer: Some(producer),
            last_reader: None,
            moved_by: None,
        });
    }

    /// Records the owned bindings statement `i` moves, and returns them.
    fn moves(&mut self, expr: &Expr, i: usize) -> Vec<usize> {
        let mut out = Vec::new();
        for (name, span) in moved(expr) {
            if let Some(b) = self.lookup(&name, span) {
                let binding = &mut self.bindings[b];
                if binding.borrowed.is_none() && binding.moved_by.is_none() {
                    binding.moved_by = Some((i, span));
                    out.push(b);
                }
            }
        }
        out
    }

    /// Refuses the assignments of `expr` (`assigned`) to bindings of the
    /// block not declared `mut`.
    fn check_assignments(&mut self, expr: &Expr, assigned: &[(String, Span)]) {
        let local = locals(expr);
        for (name, span) in assigned {
            let Some(b) = self.lookup(name, *span) else {
                continue;
            };
            if !self.bindings[b].mutable && !local.contains(name) {
                self.errors.push(
                    *span,
                    format!(
                        "cannot assign to `{name}`, which is not declared `mut`: write \
                         `let mut {name} = ...` where it is bound"
                    ),
                );
            }
        }
    }

    /// The bindings `expr`, read by statement `reader` (the tail's index is
    /// the number of statements), mentions; refuses reads of forward-only
    /// bindings from statements that replay.
    fn resolve(&mut self, expr: &Expr, reader: usize, forward_only: bool) -> Vec<(usize, Span)> {
        let mut out = Vec::new();
        for (name, span) in mentions(expr) {
            let Some(b) = self.lookup(&name, span) else {
                continue;
            };
            if let Some(p) = self.bindings[b].producer {
                if self.kinds[p] == Some(AnnotationKind::ForwardOnly) && !forward_only {
                    self.errors.push(
                        span,
                        format!(
                            "`{name}` is bound by a #[forward_only] statement, which does not run \
                             in the replay, so `{name}` would not exist there; compute it in a \
                             statement that replays, or read it only from #[forward_only] \
                             statements"
                        ),
                    );
                }
            }
            self.read(b, span, reader, &mut out);
        }
        // Two bindings of one name: a closure the statement calls borrows
        // one that a later `let` shadowed, and the statement reads the
        // later one; inside the statement one name cannot mean both.
        for (k, &(b, here)) in out.iter().enumerate() {
            let ident = &self.bindings[b].ident;
            let twin = out[..k].iter().any(|&(o, _)| {
                let other = &self.bindings[o].ident;
                o != b && other == ident && crate::hygiene::same(other.span(), ident.span())
            });
            if twin {
                self.errors.push(
                    here,
                    format!(
                        "this statement calls a closure that borrows a `{ident}` which a later \
                         `let {ident}` shadows, and reads that later `{ident}` too; a statement \
                         calling a closure defines it again with what its names mean there, so \
                         rename the later `{ident}`"
                    ),
                );
                break;
            }
        }
        out
    }

    /// Each closure or built value of `called` (by the statement defining
    /// it), with whether the statement mentions its name on some branches
    /// only (`branch`: the names it reads so).
    fn on_branches(&self, called: &[usize], branch: &[String]) -> Vec<(usize, bool)> {
        called
            .iter()
            .map(|&c| {
                let named = self.bindings.iter().any(|b| {
                    b.captures.as_ref().is_some_and(|(d, _)| *d == c)
                        && branch.contains(&b.ident.to_string())
                });
                (c, named)
            })
            .collect()
    }

    /// Binding `b`, mentioned at `span`, read by statement `reader`: a
    /// closure with `captures`, called by a statement, is read as what it
    /// captures (the statement defines it again).
    fn read(&mut self, b: usize, span: Span, reader: usize, out: &mut Vec<(usize, Span)>) {
        let statement = reader >= self.plain.len() || !self.plain[reader];
        // What the closure borrows, if still visible under its names here:
        // the binding each name finds, or one a statement gave back from it
        // (a `mut` binding a closure borrows cannot be assigned while the
        // closure lives). The statement reads those.
        let captures = self.bindings[b].captures.clone().and_then(|(c, captures)| {
            let here: Option<Vec<(usize, Span)>> = captures
                .iter()
                .map(|&(r, at)| {
                    let here = self.lookup(&self.bindings[r].ident.to_string(), at)?;
                    let mut found = Some(here);
                    while let Some(f) = found.filter(|&f| f != r) {
                        found = self.bindings[f].continues;
                    }
                    if found == Some(r) {
                        return Some((here, at));
                    }
                    // A later `let` took the name: the statement reads the
                    // binding itself, through a reference made before that
                    // `let` (an owned binding that is not `mut`, or a
                    // borrowed parameter; shadowed, it lives to the block's
                    // end).
                    let kept = &self.bindings[r];
                    let owned = kept.borrowed.is_none() && !kept.mutable && kept.producer.is_some();
                    let param = matches!(kept.borrowed, Some(Borrowed::Param(_)))
                        && kept.refs == 0
                        && !kept.mutable;
                    (owned || param).then_some((r, at))
                })
                .collect();
            if here.is_none() && statement {
                // A later `let` of a name the closure borrows: defined
                // again here, the closure would read the later value.
                let shadowed = captures.iter().find(|&&(r, at)| {
                    self.lookup(&self.bindings[r].ident.to_string(), at) != Some(r)
                });
                if let Some(&(r, _)) = shadowed {
                    let (closure, name) = (&self.bindings[b].ident, &self.bindings[r].ident);
                    self.errors.push(
                        span,
                        format!(
                            "the closure `{closure}` borrows `{name}`, which a later `let {name}` \
                             shadows before this call; a statement calling a closure defines it \
                             again with what its names mean at the call, so rename the later \
                             `{name}` (or call `{closure}` before it)"
                        ),
                    );
                }
            }
            here.map(|here| (c, here))
        });
        if let (Some((c, captures)), true) = (captures, statement) {
            if !self.called.contains(&c) {
                self.called.push(c);
                self.called.sort_unstable();
            }
            for (r, at) in captures {
                self.read(r, at, reader, out);
            }
            return;
        }
        self.bindings[b].last_reader = Some(reader);
        for target in self.bindings[b].refers_to.clone() {
            self.bindings[target].last_reader = Some(reader);
        }
        if !out.iter().any(|&(r, _)| r == b) {
            out.push((b, span));
        }
    }

    /// Names: explicit ones (`name = "..."`, checked for duplicates), and
    /// for every other statement its binding's name, numbered by its place
    /// among the statements of the block that bind that name (`h`, `h#2`,
    /// ...), whatever their annotations: annotating or naming one statement
    /// never renames another. A generated name that an explicit one already
    /// took is an error at the explicit one.
    fn names(&mut self, reads: &Reads) -> Vec<String> {
        let block = self.block;
        let n = block.statements.len();
        let mut names = vec![String::new(); n];
        let mut explicit: HashMap<String, Span> = HashMap::new();
        for (i, stmt) in block.statements.iter().enumerate() {
            let Some((name, span)) = self.explicit_name(stmt) else {
                continue;
            };
            if let Some(first) = explicit.get(&name) {
                self.errors.push(
                    span,
                    format!(
                        "duplicate statement name `{name}`: names must be unique within a block"
                    ),
                );
                self.errors
                    .push(*first, format!("`{name}` is first used here"));
                continue;
            }
            explicit.insert(name.clone(), span);
            names[i] = name;
        }
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, stmt) in block.statements.iter().enumerate() {
            let base = match &stmt.kind {
                StmtKind::Let { pat, .. } => match single(pat) {
                    Some(ident) => ident.to_string(),
                    None => {
                        let idents: Vec<String> =
                            bound(pat).iter().map(|(i, _)| i.to_string()).collect();
                        format!("({})", idents.join(", "))
                    }
                },
                // Named after the `mut` bindings it gives back, if any.
                StmtKind::Expr(_) => {
                    let given: Vec<String> = reads.inouts[i]
                        .iter()
                        .map(|&b| self.bindings[b].ident.to_string())
                        .collect();
                    match given.len() {
                        0 => format!("(statement {})", i + 1),
                        1 => given[0].clone(),
                        _ => format!("({})", given.join(", ")),
                    }
                }
                StmtKind::Item(_) => continue,
            };
            let k = seen.entry(base.clone()).or_default();
            *k += 1;
            if !names[i].is_empty()
                || self.plain[i]
                || self.kinds[i] == Some(AnnotationKind::ForwardOnly)
            {
                continue;
            }
            let name = if *k == 1 { base } else { format!("{base}#{k}") };
            if let Some(&span) = explicit.get(&name) {
                self.errors.push(
                    span,
                    format!(
                        "the statement name `{name}` is also the name of another statement \
                         (binding `{}`): choose another name",
                        name.split('#').next().unwrap_or(&name)
                    ),
                );
            }
            names[i] = name;
        }
        names
    }

    /// The name a statement's annotation gives it: its `name = "..."`. (A
    /// saved or offloaded destructuring `let` needs one.)
    fn explicit_name(&mut self, stmt: &crate::model::Statement) -> Option<(String, Span)> {
        let a = stmt.annotation.as_ref()?;
        match (&a.name, &stmt.kind) {
            (Some(lit), _) => Some((lit.value(), lit.span())),
            (None, StmtKind::Let { pat, .. })
                if matches!(a.kind, AnnotationKind::Save | AnnotationKind::Offload)
                    && single(pat).is_none() =>
            {
                let attr = a.kind.attr();
                let bare = attr.trim_end_matches(']');
                self.errors.push_spanned(
                    pat,
                    format!(
                        "{attr} on a destructuring pattern needs an explicit name: \
                         `{bare}(name = \"...\")]`"
                    ),
                );
                None
            }
            _ => None,
        }
    }

    /// The plain values statement `i` (the tail: `n`) may make a tensor
    /// from, each with the names of the statements it was computed from
    /// ([`host_sources`]): the values it reads as data that a statement
    /// reading a tensor to the host computed, and those it hands to a
    /// constructor (`Tensor::new`) that any statement computed. The run
    /// time tells which hold floats and which statements were host reads.
    fn made_tensors(&self, reads: &Reads, names: &[String], i: usize) -> Vec<HostValue> {
        let (Some(data), Some(into)) = (reads.data.get(i), reads.into_tensors.get(i)) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for &(b, span) in reads.statements.get(i).unwrap_or(&reads.tail) {
            let name = self.bindings[b].ident.to_string();
            let places: Vec<&Place> = data.iter().filter(|p| p.name == name).collect();
            if places.is_empty() {
                continue;
            }
            let (sources, to_host) = self.host_sources(reads, names, b);
            if !(to_host || into.contains(&name) && !sources.is_empty()) {
                continue;
            }
            // The whole value if the statement reads it whole, else each
            // field it reads.
            let whole = places.iter().any(|p| p.fields.is_empty());
            let fields = match whole {
                true => vec![Vec::new()],
                false => places.iter().map(|p| p.fields.clone()).collect(),
            };
            out.extend(fields.into_iter().map(|fields| HostValue {
                ident: crate::ident(&name, span),
                fields,
                sources: sources.clone(),
            }));
        }
        out
    }

    /// The statements binding `b` was computed from: its producer and,
    /// through the bindings each reads as data, theirs (not through a read
    /// of a shape, `x.dim(1)? as f32`, a condition or a count, nor through
    /// what a statement hands to a constructor: that statement checks it
    /// itself); and whether one of them reads a tensor to the host.
    fn host_sources(&self, reads: &Reads, names: &[String], b: usize) -> (Vec<String>, bool) {
        let mut out = Vec::new();
        let mut to_host = false;
        let mut seen = Vec::new();
        let mut todo: Vec<usize> = self.bindings[b].producer.into_iter().collect();
        while let Some(p) = todo.pop() {
            if seen.contains(&p) {
                continue;
            }
            seen.push(p);
            to_host |= reads.to_host[p];
            if !names[p].is_empty() && !reads.no_gradient[p] {
                out.push(names[p].clone());
            }
            for &(r, _) in &reads.statements[p] {
                let binding = &self.bindings[r];
                let name = binding.ident.to_string();
                let made = reads.into_tensors[p].contains(&name);
                if !made && reads.data[p].iter().any(|place| place.name == name) {
                    todo.extend(binding.producer);
                }
            }
        }
        (out, to_host)
    }

    /// The analysis: reads, names, and the owned bindings each statement
    /// releases (dropped after their last reader; the tail's are dropped with
    /// the block anyway). Which saved outputs are ferried to the replay is
    /// decided at run time, where the plan is known.
    fn finish(self, reads: Reads, mut names: Vec<String>) -> Analysis {
        let block = self.block;
        let n = block.statements.len();
        let mut releases: Vec<Vec<Ident>> = vec![Vec::new(); n];
        // What borrows others (a closure) is dropped before them, the latest
        // first; then the rest in order.
        let mut order: Vec<usize> = (0..self.bindings.len()).collect();
        order.sort_by_key(|&b| match self.bindings[b].refers_to.is_empty() {
            true => (1, b),
            false => (0, usize::MAX - b),
        });
        // Whether a binding of the same name is made after `b` and before
        // statement `r`: `b` can no longer be named there (`let r = &h; let
        // h = h.exp()?; let y = (r + &h)?;` keeps the first `h` alive until
        // `y`), and is dropped with the block.
        let shadowed = |b: &Binding, r: usize| {
            let after = b.producer.map_or(0, |p| p + 1);
            self.bindings.iter().any(|o| {
                o.producer.is_some_and(|q| q >= after && q < r)
                    && o.ident == b.ident
                    && crate::hygiene::same(o.ident.span(), b.ident.span())
            })
        };
        for b in order.into_iter().map(|b| &self.bindings[b]) {
            if b.borrowed.is_some() {
                continue;
            }
            let release = match (b.moved_by, b.last_reader) {
                (Some((m, span)), _) => Some((m, crate::ident(&b.ident.to_string(), span))),
                (None, r) => r.map(|r| (r, b.ident.clone())),
            };
            if let Some((r, ident)) = release.filter(|&(r, _)| r < n && !shadowed(b, r)) {
                releases[r].push(ident);
            }
        }
        // Bindings read after a later `let` took their name (what a closure
        // the reader calls borrows): each kept under another name by a
        // reference made before the first such `let`.
        let first_shadow = |b: &Binding, r: usize| {
            let after = b.producer.map_or(0, |p| p + 1);
            self.bindings
                .iter()
                .filter_map(|o| o.producer.filter(|&q| q >= after && q < r).map(|q| (q, o)))
                .filter(|(_, o)| {
                    o.ident == b.ident && crate::hygiene::same(o.ident.span(), b.ident.span())
                })
                .map(|(q, _)| q)
                .min()
        };
        let kept_name =
            |b: &Binding| Ident::new(&format!("{}_shadowed", b.ident), Span::mixed_site());
        let mut keeps: Vec<Vec<(Ident, Ident)>> = vec![Vec::new(); n];
        for (i, ids) in reads.statements.iter().chain([&reads.tail]).enumerate() {
            for &(b, _) in ids {
                let binding = &self.bindings[b];
                if let Some(j) = first_shadow(binding, i) {
                    let keep = (kept_name(binding), binding.ident.clone());
                    if !keeps[j].iter().any(|(k, _)| *k == keep.0) {
                        keeps[j].push(keep);
                    }
                }
            }
        }
        let defined = |called: &[usize]| -> Vec<TokenStream> {
            called
                .iter()
                .filter_map(|&c| match &block.statements[c].kind {
                    StmtKind::Let { pat, init } => Some(quote::quote! { let #pat = #init; }),
                    _ => None,
                })
                .collect()
        };
        let to_reads = |ids: &[(usize, Span)], i: usize| -> Vec<Read> {
            let for_value = reads.for_value.get(i);
            let in_part = reads.in_part.get(i);
            let in_fields = reads.in_fields.get(i);
            let on_branch = reads.on_branch.get(i);
            ids.iter()
                .map(|&(b, span)| {
                    let binding = &self.bindings[b];
                    let name = binding.ident.to_string();
                    Read {
                        ident: crate::ident(&name, span),
                        borrowed: binding.borrowed,
                        refs: binding.refs,
                        mutable: binding.mutable,
                        for_value: for_value.is_none_or(|v| v.contains(&name)),
                        // A value read through its fields (a struct of the
                        // user's own that derives `Outputs`) is read in
                        // part.
                        in_part: in_part.is_some_and(|v| v.contains(&name))
                            || in_fields.is_some_and(|v| v.contains(&name)),
                        on_branch: on_branch.is_some_and(|v| v.contains(&name)),
                        plain_code: binding.borrowed.is_none()
                            && binding.producer.is_some_and(|p| {
                                self.plain[p] && !copies(&self.block.statements[p].kind)
                            }),
                        source: first_shadow(binding, i).map(|_| kept_name(binding)),
                    }
                })
                .collect()
        };
        let tail_reads: Vec<usize> = reads.tail.iter().map(|&(b, _)| b).collect();
        let tail_passthrough = block
            .tail
            .as_ref()
            .and_then(|t| passthrough(t, &tail_reads, &self.bindings));
        let mut made: Vec<_> = (0..=n)
            .map(|i| self.made_tensors(&reads, &names, i))
            .collect();
        let tail_host_data = made.pop().unwrap_or_default();
        let statements: Vec<StatementAnalysis> = (0..n)
            .map(|i| StatementAnalysis {
                name: std::mem::take(&mut names[i]),
                kind: self.kinds[i],
                plain: self.plain[i],
                changes: reads.inouts[i]
                    .iter()
                    .map(|&b| self.bindings[b].ident.clone())
                    .collect(),
                // Given back only if read again.
                inouts: reads.inouts[i]
                    .iter()
                    .filter(|&&b| self.bindings[b].last_reader.is_some())
                    .map(|&b| self.bindings[b].ident.clone())
                    .collect(),
                reads: to_reads(&reads.statements[i], i),
                releases: std::mem::take(&mut releases[i]),
                host_data: std::mem::take(&mut made[i]),
                closures: defined(&reads.closures[i]),
                inlined: self.bindings.iter().any(|b| {
                    b.producer == Some(i)
                        && b.captures.is_some()
                        && b.last_reader.is_none()
                        && b.moved_by.is_none()
                }),
                keeps: std::mem::take(&mut keeps[i]),
            })
            .collect();
        // Statements that run in the replay, plain code (a copy of a field,
        // `let m = self.mask.clone();`, read by saved statements as it is),
        // and the tail unless the block returns a binding as it is.
        let mut fields: Vec<(FieldRead, String)> = Vec::new();
        for (i, read) in reads.fields.into_iter().enumerate() {
            let name = match statements.get(i) {
                Some(s) if s.plain => match &block.statements[i].kind {
                    StmtKind::Let { pat, .. } => match crate::usage::single(pat) {
                        Some(ident) => ident.to_string(),
                        None => format!("(statement {})", i + 1),
                    },
                    _ => format!("(statement {})", i + 1),
                },
                Some(s) if s.name.is_empty() => continue,
                Some(s) => s.name.clone(),
                None if tail_passthrough.is_some() => continue,
                None => "(return)".to_string(),
            };
            for f in read {
                if !fields.iter().any(|(g, _)| g.label == f.label) {
                    fields.push((f, name.clone()));
                }
            }
        }
        Analysis {
            statements,
            tail_reads: to_reads(&reads.tail, n),
            tail_closures: reads
                .closures
                .get(n)
                .map(|c| defined(c))
                .unwrap_or_default(),
            tail_passthrough,
            tail_host_data,
            fields,
        }
    }
}
