use candle_core::Tensor;
use remat_runtime::Outputs;

/// An enum: refused, with the way forward.
#[derive(Clone, Outputs)]
enum Kind {
    Dense(Tensor),
    Sparse,
}

/// An option `outputs` does not know.
#[derive(Clone, Outputs)]
struct Unknown {
    states: Tensor,
    #[outputs(skip)]
    note: String,
}

#[derive(Clone)]
struct Linear {
    weight: Tensor,
}

/// A field that is neither `Outputs` nor marked plain.
#[derive(Clone, Outputs)]
struct WithModule {
    states: Tensor,
    proj: Linear,
}

fn main() {}
