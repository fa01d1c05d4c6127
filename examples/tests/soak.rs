//! Soak, short: 150 steps of a small GPT per policy; after a warm-up the
//! bytes live after each step (exact, from a counting allocator) never
//! exceed what they were after step 20. `cargo run --release -p examples
//! --bin soak` runs 1000 steps and plots them (docs/soak/).

use examples::data::{default_text, Corpus};
use examples::gpt::Checkpointing;
use examples::soak::{soak, Shape};
use remat_runtime::inspect::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

#[test]
fn live_bytes_do_not_grow_over_training_steps() {
    let corpus = Corpus::new(&default_text());
    let shape = Shape {
        layers: 2,
        d_model: 16,
        heads: 2,
        seq: 8,
        batch: 4,
    };
    for policy in [
        Checkpointing::None,
        Checkpointing::Full,
        Checkpointing::Selective,
        Checkpointing::SaveAll,
        Checkpointing::Budget(0.5),
    ] {
        let live = soak(&corpus, shape, policy, 150, &ALLOC).unwrap();
        let reference = live[19];
        let max = *live[20..].iter().max().unwrap();
        println!("{policy}: after step 20 {reference}, max after {max}");
        assert!(max <= reference, "{policy}: {max} > {reference}");
    }
    // Offloaded statements whose residuals move out of the graph and back
    // every step (the GPU path, forced on this CPU).
    let live = remat_runtime::offload::swap_on_cpu(|| {
        soak(&corpus, shape, Checkpointing::Offload, 150, &ALLOC).unwrap()
    });
    let (reference, max) = (live[19], *live[20..].iter().max().unwrap());
    println!("offload (moved): after step 20 {reference}, max after {max}");
    assert!(max <= reference, "offload (moved): {max} > {reference}");
}
