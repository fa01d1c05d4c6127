//! Names, static dataflow and the semantic checks of a parsed block.
//!
//! About 400 lines: the `Analyser` and the token helpers it alone uses
//! (`mentions`, `format_args`, `bound`, `single`) form one pass.

use std::collections::{HashMap, HashSet};

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::visit::Visit;
use syn::{Expr, Ident, Pat};

use crate::errors::Errors;
use crate::model::{AnnotationKind, Block, StmtKind};

/// A binding a statement reads.
#[derive(Debug, Clone)]
pub(crate) struct Read {
    pub ident: Ident,
    /// A `&T` parameter: the statement sees a reference to its own copy.
    pub by_ref: bool,
}

/// What the analysis found for one statement.
#[derive(Debug, Clone)]
pub(crate) struct StatementAnalysis {
    /// The record name (empty for items and forward-only statements).
    pub name: String,
    /// Save, Recompute or ForwardOnly; `None` for an unannotated statement,
    /// whose policy the region's plan decides at run time.
    pub kind: Option<AnnotationKind>,
    /// The bindings it reads, in order of first use.
    pub reads: Vec<Read>,
    /// Owned bindings whose last reader this statement is: dropped after it.
    pub releases: Vec<Ident>,
}

/// What the analysis found for a block: per statement, and for the tail.
pub(crate) struct Analysis {
    pub statements: Vec<StatementAnalysis>,
    pub tail_reads: Vec<Read>,
    /// The tail is `Ok(x)` with `x` a binding of a statement: the block
    /// returns it as it is, with no statement of its own.
    pub tail_passthrough: Option<Ident>,
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
    by_ref: bool,
    /// The statement that bound it; `None` for parameters.
    producer: Option<usize>,
    last_reader: Option<usize>,
}

/// Identifiers an expression mentions, in order, with the span of their first
/// use: paths of one segment, identifiers inside macro invocations, and
/// inline arguments of format strings (`"{x}"`).
fn mentions(expr: &Expr) -> Vec<(String, Span)> {
    struct Collect(Vec<(String, Span)>);
    impl Collect {
        fn add(&mut self, name: String, span: Span) {
            if !self.0.iter().any(|(n, _)| *n == name) {
                self.0.push((name, span));
            }
        }
        fn tokens(&mut self, ts: TokenStream) {
            for tt in ts {
                match tt {
                    TokenTree::Ident(i) => self.add(i.to_string(), i.span()),
                    TokenTree::Group(g) => self.tokens(g.stream()),
                    TokenTree::Literal(l) => {
                        if let Ok(s) = syn::parse2::<syn::LitStr>(l.to_token_stream()) {
                            for name in format_args(&s.value()) {
                                self.add(name, l.span());
                            }
                        }
                    }
                    TokenTree::Punct(_) => {}
                }
            }
        }
    }
    impl<'ast> Visit<'ast> for Collect {
        fn visit_expr_path(&mut self, p: &'ast syn::ExprPath) {
            if p.qself.is_none() && p.path.segments.len() == 1 {
                let seg = &p.path.segments[0];
                self.add(seg.ident.to_string(), seg.ident.span());
            }
            syn::visit::visit_expr_path(self, p);
        }
        fn visit_macro(&mut self, m: &'ast syn::Macro) {
            self.tokens(m.tokens.clone());
        }
    }
    let mut c = Collect(Vec::new());
    c.visit_expr(expr);
    c.0
}

/// Inline arguments of a format string: `{x}`, `{x:?}`, `{x:>8}`.
fn format_args(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(open) = rest.find('{') {
        rest = &rest[open + 1..];
        if rest.starts_with('{') {
            rest = &rest[1..];
            continue;
        }
        let end = rest.find(['}', ':']).unwrap_or(rest.len());
        let name = &rest[..end];
        if !name.is_empty()
            && name.chars().all(|c| c.is_alphanumeric() || c == '_')
            && !name.chars().next().is_some_and(|c| c.is_ascii_digit())
        {
            out.push(name.to_string());
        }
    }
    out
}

/// The identifiers a pattern binds.
pub(crate) fn bound(pat: &Pat) -> Vec<Ident> {
    struct Collect(Vec<Ident>);
    impl<'ast> Visit<'ast> for Collect {
        fn visit_pat_ident(&mut self, p: &'ast syn::PatIdent) {
            self.0.push(p.ident.clone());
            syn::visit::visit_pat_ident(self, p);
        }
    }
    let mut c = Collect(Vec::new());
    c.visit_pat(pat);
    c.0
}

/// The single identifier a pattern binds (`x`, `mut x`, `x: T`), if it is one.
fn single(pat: &Pat) -> Option<&Ident> {
    match pat {
        Pat::Ident(p) if p.subpat.is_none() => Some(&p.ident),
        Pat::Type(t) => single(&t.pat),
        _ => None,
    }
}

/// Analyses `block`: dataflow, names and releases, with the semantic errors
/// pushed to `errors`.
pub(crate) fn analyse(block: &Block, errors: &mut Errors) -> Analysis {
    let mut a = Analyser::new(block, errors);
    let reads = a.dataflow();
    let names = a.names();
    a.finish(reads, names)
}

/// The state of one block's analysis.
struct Analyser<'a> {
    block: &'a Block,
    errors: &'a mut Errors,
    /// Every binding: the parameters, then each statement's, in order.
    bindings: Vec<Binding>,
    /// The binding each name refers to at the current statement.
    current: HashMap<String, usize>,
    /// Each statement's annotation.
    kinds: Vec<Option<AnnotationKind>>,
}

/// Which bindings each statement reads, and which the tail reads.
struct Reads {
    statements: Vec<Vec<usize>>,
    tail: Vec<usize>,
}

impl<'a> Analyser<'a> {
    fn new(block: &'a Block, errors: &'a mut Errors) -> Self {
        let bindings: Vec<Binding> = block
            .params
            .iter()
            .map(|p| Binding {
                ident: p.ident.clone(),
                by_ref: p.by_ref,
                producer: None,
                last_reader: None,
            })
            .collect();
        let current = bindings
            .iter()
            .enumerate()
            .map(|(i, b)| (b.ident.to_string(), i))
            .collect();
        let kinds = block
            .statements
            .iter()
            .map(|s| s.annotation.as_ref().map(|a| a.kind))
            .collect();
        Analyser {
            block,
            errors,
            bindings,
            current,
            kinds,
        }
    }

    /// Dataflow: who reads which binding, statement by statement, and the
    /// tail.
    fn dataflow(&mut self) -> Reads {
        let block = self.block;
        let mut statements = Vec::new();
        for (i, stmt) in block.statements.iter().enumerate() {
            let forward_only = self.kinds[i] == Some(AnnotationKind::ForwardOnly);
            match &stmt.kind {
                StmtKind::Let { pat, init } => {
                    statements.push(self.resolve(init, i, forward_only));
                    for ident in bound(pat) {
                        self.current.insert(ident.to_string(), self.bindings.len());
                        self.bindings.push(Binding {
                            ident,
                            by_ref: false,
                            producer: Some(i),
                            last_reader: None,
                        });
                    }
                }
                StmtKind::Expr(e) => statements.push(self.resolve(e, i, forward_only)),
                StmtKind::Item(_) => statements.push(Vec::new()),
            }
        }
        let n = block.statements.len();
        let tail = match &block.tail {
            Some(t) => self.resolve(t, n, false),
            None => Vec::new(),
        };
        Reads { statements, tail }
    }

    /// The bindings `expr`, read by statement `reader` (the tail's index is
    /// the number of statements), mentions; refuses reads of forward-only
    /// bindings from statements that replay.
    fn resolve(&mut self, expr: &Expr, reader: usize, forward_only: bool) -> Vec<usize> {
        let mut out = Vec::new();
        for (name, span) in mentions(expr) {
            let Some(&b) = self.current.get(&name) else {
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
            self.bindings[b].last_reader = Some(reader);
            out.push(b);
        }
        out
    }

    /// Names: explicit ones first (checked for duplicates), then the rest
    /// from their bindings, made unique.
    fn names(&mut self) -> Vec<String> {
        let block = self.block;
        let n = block.statements.len();
        let mut names = vec![String::new(); n];
        let mut first_use: HashMap<String, Span> = HashMap::new();
        for (i, stmt) in block.statements.iter().enumerate() {
            let Some((name, span)) = self.explicit_name(stmt) else {
                continue;
            };
            if let Some(first) = first_use.get(&name) {
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
            first_use.insert(name.clone(), span);
            names[i] = name;
        }
        let mut used: HashSet<String> = first_use.into_keys().collect();
        let mut fresh = |base: String| -> String {
            let mut name = base.clone();
            let mut k = 2;
            while used.contains(&name) {
                name = format!("{base}#{k}");
                k += 1;
            }
            used.insert(name.clone());
            name
        };
        for (i, stmt) in block.statements.iter().enumerate() {
            if !names[i].is_empty() || self.kinds[i] == Some(AnnotationKind::ForwardOnly) {
                continue;
            }
            names[i] = match &stmt.kind {
                StmtKind::Let { pat, .. } => fresh(match single(pat) {
                    Some(ident) => ident.to_string(),
                    None => {
                        let idents: Vec<String> =
                            bound(pat).iter().map(|i| i.to_string()).collect();
                        format!("({})", idents.join(", "))
                    }
                }),
                StmtKind::Expr(_) => fresh(format!("(statement {})", i + 1)),
                StmtKind::Item(_) => String::new(),
            };
        }
        names
    }

    /// The name a statement's annotation gives it: `name = "..."`, or the
    /// binding of a saved or offloaded `let`.
    fn explicit_name(&mut self, stmt: &crate::model::Statement) -> Option<(String, Span)> {
        let a = stmt.annotation.as_ref()?;
        match (&a.name, &stmt.kind) {
            (Some(lit), _) => Some((lit.value(), lit.span())),
            (None, StmtKind::Let { pat, .. })
                if matches!(a.kind, AnnotationKind::Save | AnnotationKind::Offload) =>
            {
                match single(pat) {
                    Some(ident) => Some((ident.to_string(), ident.span())),
                    None => {
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
                }
            }
            _ => None,
        }
    }

    /// The analysis: reads, names, and the owned bindings each statement
    /// releases (dropped after their last reader; the tail's are dropped with
    /// the block anyway). Which saved outputs are ferried to the replay is
    /// decided at run time, where the plan is known.
    fn finish(self, reads: Reads, mut names: Vec<String>) -> Analysis {
        let block = self.block;
        let n = block.statements.len();
        let mut releases: Vec<Vec<Ident>> = vec![Vec::new(); n];
        for b in &self.bindings {
            if let Some(r) = b.last_reader {
                if r < n && !b.by_ref {
                    releases[r].push(b.ident.clone());
                }
            }
        }
        let to_reads = |ids: &[usize]| -> Vec<Read> {
            ids.iter()
                .map(|&b| Read {
                    ident: self.bindings[b].ident.clone(),
                    by_ref: self.bindings[b].by_ref,
                })
                .collect()
        };
        let tail_passthrough = block
            .tail
            .as_ref()
            .and_then(|t| passthrough(t, &reads.tail, &self.bindings));
        let statements = (0..n)
            .map(|i| StatementAnalysis {
                name: std::mem::take(&mut names[i]),
                kind: self.kinds[i],
                reads: to_reads(&reads.statements[i]),
                releases: std::mem::take(&mut releases[i]),
            })
            .collect();
        Analysis {
            statements,
            tail_reads: to_reads(&reads.tail),
            tail_passthrough,
        }
    }
}
