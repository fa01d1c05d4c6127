//! Snapshots of the generated code, formatted with prettyplease. Each is
//! reviewed as code we would sign; `cargo insta review` after a change.

use proc_macro2::TokenStream;
use quote::quote;

fn pretty(input: TokenStream) -> String {
    let out = crate::expand(input);
    let file: syn::File = syn::parse2(out).expect("the expansion parses as items");
    prettyplease::unparse(&file)
}

/// The README's example: the snapshot docs/guide.md shows as "what your
/// block becomes" (checked here), within the size the guide promises: at
/// most about ten lines per statement plus twenty.
#[test]
fn readme_example() {
    let expanded = pretty(quote! {
        fn mlp(x: &Tensor, p: &Mlp) -> Result<Tensor> {
            #[save] let h = x.matmul(&p.w1)?;      // kept from the forward
            let g = h.gelu_erf()?;                  // recomputed in the backward
            #[save(name = "proj")] let o = g.matmul(&p.w2)?;
            Ok((x + o)?)
        }
    });
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/guide.md"))
        .expect("docs/guide.md");
    assert!(
        guide.contains(&expanded),
        "docs/guide.md does not show the README example's expansion:\n{expanded}"
    );
    let statements = 4;
    assert!(expanded.lines().count() <= 10 * statements + 20);
    insta::assert_snapshot!(expanded);
}

#[test]
fn gpt2_block() {
    insta::assert_snapshot!(pretty(quote! {
        /// GPT-2 block
        pub fn block(x: &Tensor, p: &BlockParams, mask: &Tensor) -> Result<Tensor> {
            let h = layer_norm(x, &p.ln1)?;
            #[save(name = "attn.qkv")] let qkv = p.c_attn.forward(&h)?;
            let (q, k, v) = split_heads(&qkv, p.n_head)?;
            #[save] let y = attention(&q, &k, &v, mask)?;
            let x = (x + p.c_proj.forward(&y)?)?;
            let h = layer_norm(&x, &p.ln2)?;
            #[recompute] let f = p.c_fc.forward(&h)?.gelu()?;
            #[save] let o = p.mlp_proj.forward(&f)?;
            Ok((x + o)?)
        }
    }));
}

#[test]
fn all_recompute() {
    insta::assert_snapshot!(pretty(quote! {
        fn mlp(x: &Tensor, w1: &Var, w2: &Var) -> Result<Tensor> {
            let h = x.matmul(w1)?.gelu()?;
            let y = h.matmul(w2)?;
            Ok(y)
        }
    }));
}

#[test]
fn saved_output_ferried_to_a_recomputed_statement() {
    // `a` is saved and read by `b`, left to the plan: whether `a`'s output
    // stays on the tape for the replay is decided at run time (kept when `b`
    // is recomputed under the plan); the expansion is a plain `save`.
    insta::assert_snapshot!(pretty(quote! {
        pub(crate) fn ferry(x: &Tensor, w: &Var) -> Result<Tensor> {
            #[save] let a = x.matmul(w)?;
            let b = a.tanh()?;
            #[save] let c = b.matmul(w)?;
            #[save] let d = c.exp()?;
            Ok(d)
        }
    }));
}

#[test]
fn early_drops_and_forward_only() {
    // `wide` is dropped right after its last reader `narrow`; `n` (a plain
    // usize) is read by the tail; the log line runs in the forward only.
    insta::assert_snapshot!(pretty(quote! {
        fn drops(x: Tensor, scale: f64) -> candle_core::Result<Tensor> {
            let wide = x.repeat((1, 8))?;
            let n = wide.dim(1)?;
            let narrow = (wide.narrow(1, 0, 4)? * scale)?;
            #[forward_only] println!("narrow: {:?}", narrow.shape());
            Ok((narrow / n as f64)?)
        }
    }));
}

#[test]
fn offloaded_statements() {
    // `#[offload]` expands like `#[save]`, to the runtime's `offload`; the
    // names follow the same rules.
    insta::assert_snapshot!(pretty(quote! {
        pub fn mlp(x: &Tensor, w1: &Var, w2: &Var) -> Result<Tensor> {
            #[offload] let h = x.matmul(w1)?;
            let g = h.gelu()?;
            #[offload(name = "mlp.out")] let o = g.matmul(w2)?;
            Ok((x + o)?)
        }
    }));
}

/// A value read in part (`parts[0]`, `pair.0`) is handed over `.partly()`:
/// one of its tensors reached is enough.
#[test]
fn values_read_in_part() {
    insta::assert_snapshot!(pretty(quote! {
        fn heads(x: &Tensor, w: &Var) -> Result<Tensor> {
            let parts = x.matmul(w)?.chunk(2, 1)?;
            let q = parts[0].tanh()?;
            Ok((q + &parts[1])?)
        }
    }));
}

/// Benchmark, not a test: expansion time of a 30-statement block.
/// `cargo test -p remat-macros --release -- --ignored --nocapture expand_speed`
#[test]
#[ignore]
fn expand_speed() {
    let mut body = TokenStream::new();
    for i in 0..30usize {
        let prev = quote::format_ident!("h{}", i);
        let next = quote::format_ident!("h{}", i + 1);
        body.extend(match i % 3 {
            0 => quote! { #[save] let #next = #prev.matmul(w)?; },
            1 => quote! { let #next = (#prev.gelu()? + x)?; },
            _ => quote! { #[recompute] let #next = #prev.broadcast_mul(mask)?; },
        });
    }
    let input = quote! {
        pub fn deep(h0: &Tensor, x: &Tensor, w: &Var, mask: &Tensor) -> Result<Tensor> {
            #body
            Ok(h30)
        }
    };
    let runs = 200;
    let start = std::time::Instant::now();
    let mut bytes = 0;
    for _ in 0..runs {
        bytes += crate::expand(input.clone()).to_string().len();
    }
    let per = start.elapsed() / runs;
    println!(
        "expand 30 statements: {per:?} per expansion ({} bytes of output)",
        bytes / runs as usize
    );
}

#[test]
fn borrowed_parameters_and_mut_bindings() {
    // A slice and an optional mask are kept as owned copies (`to_owned`)
    // and seen as `&[Linear]` and `Option<&Tensor>` again; the loop updates
    // the `mut` binding `h` and gives it back as its statement's output;
    // `None => h` moves `h`, dropped there.
    insta::assert_snapshot!(pretty(quote! {
        pub fn layers(x: &Tensor, layers: &[Linear], mask: Option<&Tensor>) -> Result<Tensor> {
            let mut h = x.clone();
            for l in layers {
                h = h.matmul(&l.w)?;
            }
            let h = match mask {
                Some(m) => h.broadcast_mul(m)?,
                None => h,
            };
            Ok(h.tanh()?)
        }
    }));
}

#[test]
fn method_with_self() {
    // A layer's forward: `self` is a borrowed parameter (the region keeps a
    // clone of `Self`), named after its type at run time.
    insta::assert_snapshot!(pretty(quote! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let h = self.norm.forward(xs)?;
            #[save] let y = self.proj.forward(&h)?;
            Ok((xs + y)?)
        }
    }));
}

/// Floats read to the host and made a tensor again: each statement that
/// reads them as data is checked (`ctx.host_data`, with the statements they
/// came from): the helper `route` could make a tensor of them, the
/// constructor does; the error comes if the statement gives a float tensor.
/// The indices (`top`) are checked too, and pass as integers at run time.
#[test]
fn host_data_made_a_tensor() {
    insta::assert_snapshot!(pretty(quote! {
        fn moe(x: &Tensor, router: &Tensor, expert: &Tensor) -> Result<Tensor> {
            let probs = softmax(&x.matmul(router)?, D::Minus1)?;
            let routing = probs.to_vec2::<f32>()?;
            let (top, weights) = route(&routing, 2);
            let w = Tensor::new(weights.as_slice(), x.device())?;
            let picked = x.index_select(&Tensor::new(top.as_slice(), x.device())?, 0)?;
            Ok(picked.matmul(expert)?.broadcast_mul(&w)?)
        }
    }));
}
