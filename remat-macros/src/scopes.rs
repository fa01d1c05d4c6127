//! Rust's scoping inside one statement: names a statement binds itself (in
//! a `let` of a nested block, an `if let`/`while let`/`let`-`else`
//! pattern, a `match` arm, a `for` pattern, a closure's parameters) shadow
//! the block's bindings of the same names from there to the end of their
//! scope.
//!
//! [`outer_view`] gives the copy of a statement's expression that the
//! analysis reads: every name the statement binds is renamed, with its
//! uses, to one no block binding can have, so that what is left under a
//! block binding's name is that binding. The generated code keeps the
//! user's expression as written.

use proc_macro2::{Group, Literal, Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::visit_mut::VisitMut;
use syn::{Expr, Pat};

use crate::usage::format_args;

/// `expr` with every name it binds itself renamed, with its uses.
pub(crate) fn outer_view(expr: &Expr) -> Expr {
    let mut copy = expr.clone();
    let mut r = Renamer {
        scopes: Vec::new(),
        fresh: 0,
    };
    r.visit_expr_mut(&mut copy);
    copy
}

struct Renamer {
    /// Innermost last, latest binding last: the original name, where it is
    /// bound (its syntax context: [`crate::hygiene`]), its name in the copy.
    scopes: Vec<Vec<(String, Span, String)>>,
    fresh: usize,
}

impl Renamer {
    /// The name in the copy of a mention of `name` at `span`, if the
    /// statement binds it itself.
    fn lookup(&self, name: &str, span: Span) -> Option<&String> {
        self.scopes.iter().rev().find_map(|s| {
            s.iter()
                .rev()
                .find(|(n, at, _)| n == name && crate::hygiene::same(*at, span))
                .map(|(_, _, fresh)| fresh)
        })
    }

    /// Binds the names of `pat` in the innermost scope, renaming them.
    fn bind(&mut self, pat: &mut Pat) {
        // Sub-patterns' expressions (range bounds, constants) are not
        // bindings; only identifiers are.
        struct Bind<'a>(&'a mut Renamer);
        impl VisitMut for Bind<'_> {
            fn visit_pat_ident_mut(&mut self, p: &mut syn::PatIdent) {
                let name = p.ident.to_string();
                // `None`, `Foo`: variants and constants are not bindings;
                // renaming them in the copy is harmless, as no block
                // binding shares their names.
                self.0.fresh += 1;
                let fresh = format!("{name}__inner{}", self.0.fresh);
                if let Some(scope) = self.0.scopes.last_mut() {
                    scope.push((name, p.ident.span(), fresh.clone()));
                }
                p.ident = crate::ident(&fresh, p.ident.span());
                if let Some((_, sub)) = &mut p.subpat {
                    self.visit_pat_mut(sub);
                }
            }
        }
        Bind(self).visit_pat_mut(pat);
    }

    fn scoped(&mut self, f: impl FnOnce(&mut Self)) {
        self.scopes.push(Vec::new());
        f(self);
        self.scopes.pop();
    }

    /// A format string's inline arguments (`"{h}"`) are uses too.
    fn rename_format_args(&self, l: Literal) -> Literal {
        let Ok(lit) = syn::parse2::<syn::LitStr>(l.to_token_stream()) else {
            return l;
        };
        let mut value = lit.value();
        let mut renamed = false;
        for name in format_args(&value) {
            if let Some(fresh) = self.lookup(&name, l.span()) {
                for end in ["}", ":"] {
                    value = value.replace(&format!("{{{name}{end}"), &format!("{{{fresh}{end}"));
                }
                renamed = true;
            }
        }
        match renamed {
            true => {
                let mut out = Literal::string(&value);
                out.set_span(l.span());
                out
            }
            false => l,
        }
    }

    fn rename_tokens(&self, ts: TokenStream) -> TokenStream {
        ts.into_iter()
            .map(|tt| match tt {
                TokenTree::Ident(i) => match self.lookup(&i.to_string(), i.span()) {
                    Some(fresh) => TokenTree::Ident(crate::ident(fresh, i.span())),
                    None => TokenTree::Ident(i),
                },
                TokenTree::Group(g) => {
                    let mut renamed = Group::new(g.delimiter(), self.rename_tokens(g.stream()));
                    renamed.set_span(g.span());
                    TokenTree::Group(renamed)
                }
                TokenTree::Literal(l) => TokenTree::Literal(self.rename_format_args(l)),
                other => other,
            })
            .collect()
    }
}

impl VisitMut for Renamer {
    fn visit_expr_path_mut(&mut self, p: &mut syn::ExprPath) {
        if p.qself.is_none() && p.path.segments.len() == 1 {
            let seg = &mut p.path.segments[0];
            if let Some(fresh) = self.lookup(&seg.ident.to_string(), seg.ident.span()) {
                seg.ident = crate::ident(fresh, seg.ident.span());
            }
        }
        syn::visit_mut::visit_expr_path_mut(self, p);
    }

    fn visit_macro_mut(&mut self, m: &mut syn::Macro) {
        m.tokens = self.rename_tokens(std::mem::take(&mut m.tokens));
    }

    fn visit_block_mut(&mut self, b: &mut syn::Block) {
        self.scoped(|r| {
            for s in &mut b.stmts {
                r.visit_stmt_mut(s);
            }
        });
    }

    fn visit_local_mut(&mut self, l: &mut syn::Local) {
        // The value (and a `let`-`else`'s `else`) before the names exist.
        if let Some(init) = &mut l.init {
            self.visit_expr_mut(&mut init.expr);
            if let Some((_, e)) = &mut init.diverge {
                self.visit_expr_mut(e);
            }
        }
        self.bind(&mut l.pat);
    }

    fn visit_expr_let_mut(&mut self, l: &mut syn::ExprLet) {
        // In an `if`/`while` condition: the names are bound in the scope the
        // condition opened, for later conditions and the body.
        self.visit_expr_mut(&mut l.expr);
        self.bind(&mut l.pat);
    }

    fn visit_expr_if_mut(&mut self, i: &mut syn::ExprIf) {
        self.scoped(|r| {
            r.visit_expr_mut(&mut i.cond);
            r.visit_block_mut(&mut i.then_branch);
        });
        if let Some((_, e)) = &mut i.else_branch {
            self.visit_expr_mut(e);
        }
    }

    fn visit_expr_while_mut(&mut self, w: &mut syn::ExprWhile) {
        self.scoped(|r| {
            r.visit_expr_mut(&mut w.cond);
            r.visit_block_mut(&mut w.body);
        });
    }

    fn visit_expr_for_loop_mut(&mut self, f: &mut syn::ExprForLoop) {
        self.visit_expr_mut(&mut f.expr);
        self.scoped(|r| {
            r.bind(&mut f.pat);
            r.visit_block_mut(&mut f.body);
        });
    }

    fn visit_arm_mut(&mut self, a: &mut syn::Arm) {
        self.scoped(|r| {
            r.bind(&mut a.pat);
            if let Some((_, g)) = &mut a.guard {
                r.visit_expr_mut(g);
            }
            r.visit_expr_mut(&mut a.body);
        });
    }

    fn visit_expr_closure_mut(&mut self, c: &mut syn::ExprClosure) {
        self.scoped(|r| {
            for p in &mut c.inputs {
                r.bind(p);
            }
            r.visit_expr_mut(&mut c.body);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::mentions;

    /// The block-level names `src` mentions, as the analysis sees them.
    fn outer(src: &str) -> Vec<String> {
        let e: Expr = syn::parse_str(src).unwrap_or_else(|e| panic!("{src}: {e}"));
        let mut names: Vec<String> = mentions(&outer_view(&e))
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| !n.contains("__inner") && n.chars().next().unwrap().is_lowercase())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn names_bound_inside_a_statement_shadow_the_blocks() {
        let cases: &[(&str, &[&str])] = &[
            (
                "if let Some((attn, ln)) = &cross { x = attn.f(&ln.g(&x)?)?; }",
                &["cross", "x"],
            ),
            ("{ let y = attn.f()?; let attn = y; attn }", &["attn"]),
            ("{ let attn = attn.f()?; attn }", &["attn"]),
            ("match m { Some(h) => h + w, None => w }", &["m", "w"]),
            (
                "for (i, h) in hs.iter().enumerate() { acc = acc + h * i; }",
                &["acc", "hs"],
            ),
            ("hs.iter().map(|h| h.exp()).collect::<Vec<_>>()", &["hs"]),
            ("hs.iter().map(|x| x + y).sum()", &["hs", "y"]),
            ("{ let Some(h) = opt else { return z; }; h }", &["opt", "z"]),
            (
                "while let Some(h) = it.next() { total = total + h; }",
                &["it", "total"],
            ),
            ("if let Some(h) = a { h } else { h }", &["a", "h"]),
            ("{ { let h = 1; } h }", &["h"]),
            ("{ let h = 1; println!(\"{}\", h); g }", &["g"]),
            ("{ let h = 1; format!(\"{h} {h:?} {g}\") }", &["g"]),
            ("{ println!(\"{}\", h); let h = 2; h }", &["h"]),
            (
                "if let Some(x) = a && let Some(y) = x.f() { y } else { b }",
                &["a", "b"],
            ),
        ];
        for (src, expected) in cases {
            let expected: Vec<String> = expected.iter().map(|s| s.to_string()).collect();
            assert_eq!(outer(src), expected, "{src}");
        }
    }

    /// A random expression over the names `a`, `b`, `c` built from every
    /// construct that binds names, with the block-level names it reads
    /// computed by construction (what Rust's scoping says).
    struct Gen(u64);

    impl Gen {
        fn next(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }

        fn name(&mut self) -> &'static str {
            ["a", "b", "c"][self.next(3) as usize]
        }

        /// `(source, block-level names read)`.
        fn expr(&mut self, depth: u32, bound: &[&'static str]) -> (String, Vec<&'static str>) {
            let pick = if depth == 0 { 0 } else { self.next(10) };
            let sub = |g: &mut Gen, extra: Option<&'static str>| {
                let mut b = bound.to_vec();
                b.extend(extra);
                g.expr(depth - 1, &b)
            };
            match pick {
                0 | 1 => {
                    let n = self.name();
                    let outer = if bound.contains(&n) { vec![] } else { vec![n] };
                    (n.to_string(), outer)
                }
                2 => {
                    let n = self.name();
                    let (e1, r1) = sub(self, None);
                    let (e2, r2) = sub(self, Some(n));
                    (format!("{{ let {n} = ({e1}); {e2} }}"), [r1, r2].concat())
                }
                3 => {
                    let n = self.name();
                    let (e1, r1) = sub(self, None);
                    let (e2, r2) = sub(self, Some(n));
                    let (e3, r3) = sub(self, None);
                    (
                        format!("if let Some({n}) = ({e1}) {{ {e2} }} else {{ {e3} }}"),
                        [r1, r2, r3].concat(),
                    )
                }
                4 => {
                    let n = self.name();
                    let (e1, r1) = sub(self, None);
                    let (e2, r2) = sub(self, Some(n));
                    let (e3, r3) = sub(self, None);
                    (
                        format!("match ({e1}) {{ Some({n}) => {e2}, None => {e3} }}"),
                        [r1, r2, r3].concat(),
                    )
                }
                5 => {
                    let n = self.name();
                    let (e1, r1) = sub(self, None);
                    let (e2, r2) = sub(self, Some(n));
                    let (e3, r3) = sub(self, None);
                    (
                        format!("{{ for {n} in ({e1}) {{ {e2}; }} {e3} }}"),
                        [r1, r2, r3].concat(),
                    )
                }
                6 => {
                    let n = self.name();
                    let (e1, r1) = sub(self, None);
                    let (e2, r2) = sub(self, Some(n));
                    (format!("(|{n}| {e2})({e1})"), [r1, r2].concat())
                }
                7 => {
                    let n = self.name();
                    let (e1, r1) = sub(self, None);
                    let (e2, r2) = sub(self, Some(n));
                    let (e3, r3) = sub(self, None);
                    (
                        format!("{{ let Some({n}) = ({e1}) else {{ return {e3}; }}; {e2} }}"),
                        [r1, r2, r3].concat(),
                    )
                }
                8 => {
                    // A macro's arguments: names only (a macro's tokens are
                    // not parsed, so nothing in them binds).
                    let (n1, n2) = (self.name(), self.name());
                    let outer = [n1, n2]
                        .into_iter()
                        .filter(|n| !bound.contains(n))
                        .collect();
                    (format!("m!({n1}, {n2} + 1)"), outer)
                }
                _ => {
                    let (e1, r1) = sub(self, None);
                    let (e2, r2) = sub(self, None);
                    (format!("({e1}).f({e2})"), [r1, r2].concat())
                }
            }
        }
    }

    proptest::proptest! {
        /// For generated expressions of nested scopes and shadowed names,
        /// the analysis sees exactly the block-level names Rust's scoping
        /// says the expression reads.
        #[test]
        fn the_analysis_follows_rusts_scoping(seed: u64) {
            let mut g = Gen(seed);
            let (src, reads) = g.expr(5, &[]);
            let mut expected: Vec<String> = reads.iter().map(|s| s.to_string()).collect();
            expected.sort();
            expected.dedup();
            proptest::prop_assert_eq!(outer(&src), expected, "{}", src);
        }
    }
}
