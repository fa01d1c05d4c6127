//! Floats that leave candle's graph through the host and come back: which
//! names a statement reads as data (their values flow into its value), which
//! it hands to one of candle's constructors, and whether it reads a tensor
//! to the host (`to_vec2`, `to_scalar`). The analysis turns these into the
//! run-time check of `HostCut` (`ctx.host_data(..)` before a statement).

use proc_macro2::Ident;
use syn::punctuated::Punctuated;
use syn::visit::Visit;
use syn::{Expr, Member};

use crate::usage::{mentions, read_for_value};

/// candle's constructors of a tensor from host data: `Tensor::new(&data,
/// ..)`, `Tensor::from_vec(..)`, ...
const FROM_HOST: &[&str] = &["new", "from_vec", "from_slice", "from_iter", "full"];

/// candle's reads of a tensor's values to the host.
const TO_HOST: &[&str] = &["to_vec0", "to_vec1", "to_vec2", "to_vec3", "to_scalar"];

/// Comparisons, of tensors (`x.ge(t)?`, `x.cmp(t, op)?`) or of host values.
const COMPARISONS: &[&str] = &["cmp", "eq", "ne", "lt", "le", "gt", "ge"];

/// candle's ops whose value carries no gradient of what they read (its
/// backward gives none) besides [`COMPARISONS`]: arg-reductions, `detach`.
const NO_GRADIENT: &[&str] = &[
    "argmax",
    "argmin",
    "argmax_keepdim",
    "argmin_keepdim",
    "arg_sort_last_dim",
    "detach",
];

/// candle's ops whose value is computed from their receiver alone (a
/// dtype, a shape, a reduction): applied to a value that carries no
/// gradient, they give one that carries none.
const RECEIVER_ONLY: &[&str] = &[
    "to_dtype",
    "to_device",
    "affine",
    "abs",
    "neg",
    "sqr",
    "sqrt",
    "exp",
    "log",
    "powf",
    "sum_all",
    "sum",
    "sum_keepdim",
    "mean_all",
    "mean",
    "mean_keepdim",
    "max",
    "max_keepdim",
    "min",
    "min_keepdim",
    "flatten_all",
    "flatten",
    "flatten_from",
    "flatten_to",
    "squeeze",
    "unsqueeze",
    "reshape",
    "contiguous",
    "narrow",
    "index_select",
    "gather",
    "broadcast_as",
    "repeat",
    "i",
    "get",
    "t",
    "transpose",
    "permute",
    "clone",
    "copy",
];

/// Whether `expr` carries no gradient of what it reads: a chain of
/// receiver-only ops from a comparison, an arg-reduction or a `detach`
/// (`x.gt(0.0)?.to_dtype(DType::F64)?.sum_all()?`).
fn carries_no_gradient(expr: &Expr) -> bool {
    match expr {
        Expr::Try(t) => carries_no_gradient(&t.expr),
        Expr::Paren(p) => carries_no_gradient(&p.expr),
        Expr::MethodCall(m) => {
            let method = m.method.to_string();
            COMPARISONS.contains(&method.as_str())
                || NO_GRADIENT.contains(&method.as_str())
                || (RECEIVER_ONLY.contains(&method.as_str()) && carries_no_gradient(&m.receiver))
        }
        _ => false,
    }
}

/// Macros whose arguments are printed, formatted or asserted: no part of a
/// value (`println!("{w}")`, `assert!(w > 0.0)`, `tracing::info!(..)`).
const REPORTING: &[&str] = &[
    "print",
    "println",
    "eprint",
    "eprintln",
    "format",
    "format_args",
    "write",
    "writeln",
    "assert",
    "assert_eq",
    "assert_ne",
    "debug_assert",
    "debug_assert_eq",
    "debug_assert_ne",
    "panic",
    "unreachable",
    "todo",
    "unimplemented",
    "trace",
    "debug",
    "info",
    "warn",
    "error",
    "event",
    "bail",
    "ensure",
    "anyhow",
];

/// Methods whose value is a count, an order or a truth value, whatever they
/// are called on and with (`w.len()`, `a.total_cmp(&b)`, `x.ge(t)?`): what
/// they read gives no float to a value; [`COMPARISONS`] too.
const COUNTS_AND_TESTS: &[&str] = &[
    "len",
    "count",
    "position",
    "rposition",
    "is_empty",
    "partial_cmp",
    "total_cmp",
    "is_nan",
    "is_finite",
    "is_infinite",
    "is_sign_positive",
    "is_sign_negative",
    "contains",
];

/// Whether `ty` is an integer type or `bool`: a cast to it (`top as usize`)
/// gives no float.
fn integral(ty: &syn::Type) -> bool {
    const INTEGRAL: &[&str] = &[
        "u8", "u16", "u32", "u64", "u128", "usize", "i8", "i16", "i32", "i64", "i128", "isize",
        "bool",
    ];
    matches!(ty, syn::Type::Path(p)
        if p.path.get_ident().is_some_and(|i| INTEGRAL.contains(&i.to_string().as_str())))
}

/// Whether `call` is `constant(..)` (`remat_runtime::rules::constant`): the
/// user says its argument carries no gradient.
fn is_constant(call: &syn::ExprCall) -> bool {
    matches!(&*call.func, Expr::Path(f)
        if f.path.segments.last().is_some_and(|s| s.ident == "constant"))
}

/// A binding, or a field of it (`routed.0`, `r.weights`), read as data.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Place {
    pub name: String,
    pub fields: Vec<Member>,
}

/// A plain value a statement reads as data, checked before it runs
/// (`ctx.host_data(..)`): the binding, the fields read (none: the whole
/// value) and the statements it was computed from.
#[derive(Debug, Clone)]
pub(crate) struct HostValue {
    pub ident: Ident,
    pub fields: Vec<Member>,
    pub sources: Vec<String>,
}

impl HostValue {
    /// How the error names it: `weights`, `routed.1`, `r.weights`.
    pub(crate) fn label(&self) -> String {
        let mut label = self.ident.to_string();
        for field in &self.fields {
            label.push('.');
            label.push_str(&match field {
                Member::Named(name) => name.to_string(),
                Member::Unnamed(index) => index.index.to_string(),
            });
        }
        label
    }
}

/// The bindings `expr` reads as data, or the fields of them it reads
/// (`routed.1`, so that the check looks at that field's type): those read for their values
/// ([`read_for_value`]) in a place where their values can flow into the
/// statement's value. Not data: a condition (`if w > 0.5`, a `while`, a
/// match guard), the operands of a comparison or of `&&`/`||`, an index
/// (`v[i]`), a cast to an integer (`top as usize`), what a count or a test reads (`w.len()`, `a.total_cmp(&b)`,
/// `x.ge(t)?`), a printed or asserted argument (`println!`, `assert!`,
/// `tracing::info!`), and what `constant(..)` wraps.
pub(crate) fn read_as_data(expr: &Expr) -> Vec<Place> {
    /// The places found, and whether the visit is inside a macro's tokens
    /// (renamed there by `scopes.rs`, fields included: a macro's reads
    /// count whole).
    struct Collect(Vec<Place>, bool);
    impl Collect {
        fn push(&mut self, name: String, fields: Vec<Member>) {
            let fields = if self.1 { Vec::new() } else { fields };
            let place = Place { name, fields };
            if !self.0.contains(&place) {
                self.0.push(place);
            }
        }
    }
    impl<'ast> Visit<'ast> for Collect {
        fn visit_expr_path(&mut self, p: &'ast syn::ExprPath) {
            if p.qself.is_none() && p.path.segments.len() == 1 {
                self.push(p.path.segments[0].ident.to_string(), Vec::new());
            }
        }
        fn visit_expr_field(&mut self, f: &'ast syn::ExprField) {
            let mut fields = vec![f.member.clone()];
            let mut base = &*f.base;
            while let Expr::Field(inner) = base {
                fields.insert(0, inner.member.clone());
                base = &inner.base;
            }
            match base {
                Expr::Path(p) if p.qself.is_none() && p.path.segments.len() == 1 => {
                    self.push(p.path.segments[0].ident.to_string(), fields)
                }
                other => self.visit_expr(other),
            }
        }
        fn visit_expr_if(&mut self, e: &'ast syn::ExprIf) {
            if let Expr::Let(l) = &*e.cond {
                self.visit_expr(&l.expr);
            }
            self.visit_block(&e.then_branch);
            if let Some((_, other)) = &e.else_branch {
                self.visit_expr(other);
            }
        }
        fn visit_expr_while(&mut self, e: &'ast syn::ExprWhile) {
            if let Expr::Let(l) = &*e.cond {
                self.visit_expr(&l.expr);
            }
            self.visit_block(&e.body);
        }
        fn visit_arm(&mut self, arm: &'ast syn::Arm) {
            self.visit_expr(&arm.body);
        }
        fn visit_expr_binary(&mut self, b: &'ast syn::ExprBinary) {
            use syn::BinOp::*;
            if !matches!(
                b.op,
                Eq(_) | Ne(_) | Lt(_) | Le(_) | Gt(_) | Ge(_) | And(_) | Or(_)
            ) {
                syn::visit::visit_expr_binary(self, b);
            }
        }
        fn visit_expr_cast(&mut self, c: &'ast syn::ExprCast) {
            if !integral(&c.ty) {
                self.visit_expr(&c.expr);
            }
        }
        fn visit_expr_index(&mut self, i: &'ast syn::ExprIndex) {
            self.visit_expr(&i.expr);
        }
        fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
            let method = m.method.to_string();
            if !COUNTS_AND_TESTS.contains(&method.as_str())
                && !COMPARISONS.contains(&method.as_str())
            {
                syn::visit::visit_expr_method_call(self, m);
            }
        }
        fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
            if !is_constant(call) {
                syn::visit::visit_expr_call(self, call);
            }
        }
        fn visit_macro(&mut self, m: &'ast syn::Macro) {
            let name = m.path.segments.last().map(|s| s.ident.to_string());
            if name.is_some_and(|n| REPORTING.contains(&n.as_str())) {
                return;
            }
            let args = Punctuated::<Expr, syn::Token![,]>::parse_terminated;
            let outer = std::mem::replace(&mut self.1, true);
            match syn::parse::Parser::parse2(args, m.tokens.clone()) {
                Ok(args) => args.iter().for_each(|a| self.visit_expr(a)),
                Err(_) => {
                    let whole = Expr::Macro(syn::ExprMacro {
                        attrs: Vec::new(),
                        mac: m.clone(),
                    });
                    let names = mentions(&whole).into_iter();
                    names.for_each(|(n, _)| self.push(n, Vec::new()));
                }
            }
            self.1 = outer;
        }
    }
    let for_value = read_for_value(expr);
    let mut c = Collect(Vec::new(), false);
    c.visit_expr(expr);
    c.0.retain(|place| for_value.contains(&place.name));
    c.0
}

/// How `expr` reads tensors' values to the host (`to_vec2`, `to_scalar`,
/// ...): whether it does, and whether one of the values it reads carries a
/// gradient (`x.gt(0.0)?.sum_all()?.to_scalar()`, a count from a
/// comparison, carries none).
fn host_reads(expr: &Expr) -> (bool, bool) {
    struct Find(bool, bool);
    impl<'ast> Visit<'ast> for Find {
        fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
            if TO_HOST.contains(&m.method.to_string().as_str()) {
                self.0 = true;
                self.1 |= !carries_no_gradient(&m.receiver);
            }
            syn::visit::visit_expr_method_call(self, m);
        }
    }
    let mut f = Find(false, false);
    f.visit_expr(expr);
    (f.0, f.1)
}

/// Whether `expr` reads to the host a value that carries a gradient: a
/// statement that may be a host read.
pub(crate) fn reads_to_host(expr: &Expr) -> bool {
    host_reads(expr).1
}

/// Whether every value `expr` reads to the host carries no gradient (and
/// it reads one): its statement is no host read, wherever its floats go.
pub(crate) fn reads_to_host_without_gradient(expr: &Expr) -> bool {
    host_reads(expr) == (true, false)
}

/// The names `expr` mentions inside the arguments of a call of one of
/// candle's constructors of a tensor from host data ([`FROM_HOST`] on a
/// path ending in `Tensor::`), but not inside `constant(..)`: the plain
/// values it turns into a tensor.
pub(crate) fn into_tensors(expr: &Expr) -> Vec<String> {
    struct Collect(Vec<String>);
    impl<'ast> Visit<'ast> for Collect {
        fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
            if let Expr::Path(f) = &*call.func {
                let segments: Vec<String> = f
                    .path
                    .segments
                    .iter()
                    .map(|s| s.ident.to_string())
                    .collect();
                let constructor = matches!(segments.as_slice(),
                    [.., ty, ctor] if ty == "Tensor" && FROM_HOST.contains(&ctor.as_str()));
                if constructor {
                    for arg in &call.args {
                        let meant = constants(arg);
                        for (name, _) in mentions(arg) {
                            if !self.0.contains(&name) && !meant.contains(&name) {
                                self.0.push(name);
                            }
                        }
                    }
                }
            }
            syn::visit::visit_expr_call(self, call);
        }
    }
    /// The names mentioned inside `constant(..)` calls.
    fn constants(expr: &Expr) -> Vec<String> {
        struct Meant(Vec<String>);
        impl<'ast> Visit<'ast> for Meant {
            fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
                if is_constant(call) {
                    for arg in &call.args {
                        self.0.extend(mentions(arg).into_iter().map(|(n, _)| n));
                    }
                } else {
                    syn::visit::visit_expr_call(self, call);
                }
            }
        }
        let mut m = Meant(Vec::new());
        m.visit_expr(expr);
        m.0
    }
    let mut c = Collect(Vec::new());
    c.visit_expr(expr);
    c.0
}
