//! `#[derive(Outputs)]`: a struct of the user's own as a value of
//! statements and blocks, and as a field the replay check sees into. Each
//! field is split through its own `Outputs`; a field marked
//! `#[outputs(plain)]` is kept whole, as plain data, in the skeleton (a
//! config, an activation enum, a module whose tensors are parameters).
//!
//! The skeleton is a list of pairs, `(a, (b, (c, ())))`: any number of
//! fields, and no type of ours in the user's namespace.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Data, DeriveInput};

/// The `Outputs` impl of `input`, or the errors of what it cannot take.
pub(crate) fn outputs(input: TokenStream) -> TokenStream {
    let input: DeriveInput = match syn::parse2(input) {
        Ok(input) => input,
        Err(e) => return e.to_compile_error(),
    };
    let Data::Struct(data) = &input.data else {
        return syn::Error::new(
            input.ident.span(),
            "`#[derive(Outputs)]` takes a struct; for an enum, write `impl Outputs` by hand \
             (see `remat_runtime::Outputs`)",
        )
        .to_compile_error();
    };
    let mut errors: Option<syn::Error> = None;
    let mut fields = Vec::new();
    for (i, field) in data.fields.iter().enumerate() {
        match plain(field) {
            Ok(is_plain) => fields.push((i, field, is_plain)),
            Err(e) => match &mut errors {
                Some(all) => all.combine(e),
                None => errors = Some(e),
            },
        }
    }
    if let Some(e) = errors {
        return e.to_compile_error();
    }
    let rt = quote!(::remat_runtime);
    let member = |i: usize, f: &syn::Field| match &f.ident {
        Some(name) => quote!(#name),
        None => {
            let index = syn::Index::from(i);
            quote!(#index)
        }
    };
    let mut skeleton = quote!(());
    let mut split = quote!(());
    let mut join = Vec::new();
    let mut bounds = Vec::new();
    // Fields of a generic type get a bound; others are checked where they
    // are split and joined, and an error points at the field's type.
    let params: Vec<String> = input
        .generics
        .type_params()
        .map(|p| p.ident.to_string())
        .collect();
    let generic = |ty: &syn::Type| {
        quote!(#ty).into_iter().any(
            |t| matches!(&t, proc_macro2::TokenTree::Ident(i) if params.contains(&i.to_string())),
        )
    };
    // Built from the last field to the first: `(a, (b, ()))`.
    for (i, field, is_plain) in fields.iter().rev() {
        let ty = &field.ty;
        let m = member(*i, field);
        let span = ty.span();
        if *is_plain {
            if generic(ty) {
                bounds.push(quote_spanned!(span=> #ty: ::core::clone::Clone + ::core::marker::Send + ::core::marker::Sync + 'static));
            }
            skeleton = quote!((#ty, #skeleton));
            split = quote!((self.#m, #split));
        } else {
            if generic(ty) {
                bounds.push(quote_spanned!(span=> #ty: #rt::Outputs));
            }
            let outputs = quote_spanned!(span=> <#ty as #rt::Outputs>);
            let part = quote_spanned!(span=> <#ty as #rt::Outputs>::Skeleton);
            skeleton = quote!((#part, #skeleton));
            split = quote!((#outputs::split_into(self.#m, tensors), #split));
        }
    }
    // Joined from the first field to the last, in split's order.
    let mut path = quote!(skeleton);
    for (i, field, is_plain) in &fields {
        let ty = &field.ty;
        let m = member(*i, field);
        let value = if *is_plain {
            quote!(::core::clone::Clone::clone(&#path.0))
        } else {
            let outputs = quote_spanned!(ty.span()=> <#ty as #rt::Outputs>);
            quote!(#outputs::join(tensors, &#path.0)?)
        };
        join.push(quote!(#m: #value));
        path = quote!(#path.1);
    }
    let name = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let mut predicates: Vec<TokenStream> = where_clause
        .map(|w| w.predicates.iter().map(|p| quote!(#p)).collect())
        .unwrap_or_default();
    predicates.extend(bounds);
    let unused = fields
        .is_empty()
        .then(|| quote!(let _ = (tensors, skeleton);));
    if fields.is_empty() {
        // `()`: the body's `let _ = tensors;` gives it.
        split = TokenStream::new();
    }
    let no_tensors = fields
        .iter()
        .all(|(_, _, is_plain)| *is_plain)
        .then(|| quote!(let _ = tensors;));
    // Holds no tensor where every field holds none: `#[save]` of it is
    // refused as for other plain values.
    let plain_bounds = fields
        .iter()
        .filter(|(_, _, is_plain)| !is_plain)
        .map(|(_, f, _)| {
            let ty = &f.ty;
            quote!(for<'f> #rt::__private::PlainField<'f, #ty>: #rt::__private::Plain)
        });
    let (plain_generics, plain_predicates) = (impl_generics.clone(), predicates.clone());
    quote! {
        impl #plain_generics #rt::__private::Plain for #name #ty_generics
        where #(#plain_predicates,)* #(#plain_bounds,)* {}
        impl #impl_generics #rt::Outputs for #name #ty_generics where #(#predicates,)* {
            type Skeleton = #skeleton;
            fn split_into(self, tensors: &mut ::std::vec::Vec<#rt::candle_core::Tensor>) -> Self::Skeleton {
                #no_tensors
                #split
            }
            fn join(
                tensors: &mut dyn ::core::iter::Iterator<Item = #rt::candle_core::Tensor>,
                skeleton: &Self::Skeleton,
            ) -> #rt::Result<Self> {
                #unused
                ::core::result::Result::Ok(#name { #(#join,)* })
            }
        }
    }
}

/// Whether `field` is marked `#[outputs(plain)]`; an error for any other
/// `outputs` attribute.
fn plain(field: &syn::Field) -> syn::Result<bool> {
    let mut is_plain = false;
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("outputs")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("plain") {
                is_plain = true;
                Ok(())
            } else {
                Err(meta.error(
                    "unknown `outputs` option: `#[outputs(plain)]` keeps a field whole as plain data",
                ))
            }
        })?;
    }
    Ok(is_plain)
}
