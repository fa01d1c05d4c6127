//! `OptimizerInBackward`: parameters updated inside the backward end each
//! step bit for bit as candle-nn's `AdamW` leaves them after the backward
//! (whose gradients the other test files check against plain candle), on
//! a model with the cases that decide when a parameter
//! may be updated: a layer applied twice (shared weights), a region nested
//! in another that reads the same layer, an embedding tied to a head
//! written as plain candle (a gradient from outside every region).

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{AdamW, Embedding, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use remat_runtime::{nn, remat, OptimizerInBackward, Plan, RematError};

use crate::common::rel_diff;

#[derive(Clone)]
struct Block {
    up: Linear,
    down: Linear,
    ln: (Tensor, Tensor),
}

impl Block {
    fn new(vb: VarBuilder, d: usize) -> Result<Self> {
        Ok(Block {
            up: candle_nn::linear(d, 4 * d, vb.pp("up"))?,
            down: candle_nn::linear(4 * d, d, vb.pp("down"))?,
            ln: (
                vb.get_with_hints(d, "ln.weight", candle_nn::Init::Const(1.0))?,
                vb.get_with_hints(d, "ln.bias", candle_nn::Init::Const(0.0))?,
            ),
        })
    }

    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let h = nn::layer_norm(xs, &self.ln.0, &self.ln.1, 1e-5)?;
            let a = self.up.forward(&h)?.gelu()?;
            let y = (xs + self.down.forward(&a)?)?;
            Ok(y)
        }
    }
}

/// A region that runs the region of its `block` twice (nested regions)
/// and reads the block's weight itself.
#[derive(Clone)]
struct Twice {
    block: Block,
}

impl Twice {
    remat! {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let y = self.block.forward(xs)?;
            let z = self.block.forward(&y)?;
            let gate = z.broadcast_mul(&self.block.ln.0)?;
            Ok((gate + y)?)
        }
    }
}

#[derive(Clone)]
struct Model {
    wte: Embedding,
    blocks: Vec<Block>,
    twice: Twice,
}

impl Model {
    fn new(vb: VarBuilder) -> Result<Self> {
        let (vocab, d) = (11, 8);
        let wte = candle_nn::embedding(vocab, d, vb.pp("wte"))?;
        let blocks = (0..2)
            .map(|i| Block::new(vb.pp(format!("blocks.{i}")), d))
            .collect::<Result<Vec<_>>>()?;
        let twice = Twice {
            block: Block::new(vb.pp("twice"), d)?,
        };
        Ok(Model { wte, blocks, twice })
    }

    remat! {
        fn embed(&self, ids: &Tensor) -> Result<Tensor> {
            let x = self.wte.forward(ids)?;
            Ok(x)
        }
    }

    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.loss_skipping(ids, targets, None)
    }

    /// The loss with block `skipped` left out (stochastic depth).
    fn loss_skipping(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        skipped: Option<usize>,
    ) -> Result<Tensor> {
        let mut x = self.embed(ids)?;
        for (i, b) in self.blocks.iter().enumerate() {
            if skipped != Some(i) {
                x = b.forward(&x)?;
            }
        }
        x = self.twice.forward(&x)?;
        // The first block again: its weights serve two calls.
        x = self.blocks[0].forward(&x)?;
        // The head, tied to the embedding, as plain candle.
        let logits = x.broadcast_matmul(&self.wte.embeddings().t()?)?;
        candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &targets.flatten_all()?)
    }
}

/// A second map holding copies of `varmap`'s variables under the same
/// names: a model built from it starts from the same weights.
fn copy_of(varmap: &VarMap) -> VarMap {
    let copy = VarMap::new();
    {
        let src = varmap.data().lock().unwrap();
        let mut dst = copy.data().lock().unwrap();
        for (name, v) in src.iter() {
            let t = v.as_tensor().copy().unwrap();
            dst.insert(name.clone(), candle_core::Var::from_tensor(&t).unwrap());
        }
    }
    copy
}

fn batch() -> (Tensor, Tensor) {
    let dev = Device::Cpu;
    let ids: Vec<u32> = (0..24).map(|i| (i * 7 + 3) % 11).collect();
    let targets: Vec<u32> = (0..24).map(|i| (i * 5 + 1) % 11).collect();
    (
        Tensor::from_vec(ids, (3, 8), &dev).unwrap(),
        Tensor::from_vec(targets, (3, 8), &dev).unwrap(),
    )
}

fn params() -> ParamsAdamW {
    ParamsAdamW {
        lr: 0.01,
        ..Default::default()
    }
}

/// Copies of the variables' values, by name.
fn sorted(varmap: &VarMap) -> Vec<(String, Tensor)> {
    let mut all: Vec<(String, Tensor)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

#[test]
fn every_parameter_ends_each_step_as_a_plain_optimizer_leaves_it() {
    for plan in [Plan::recompute_all(), Plan::save_all(), Plan::off()] {
        let reference_map = VarMap::new();
        let reference = Model::new(VarBuilder::from_varmap(
            &reference_map,
            DType::F32,
            &Device::Cpu,
        ))
        .unwrap();
        let map = copy_of(&reference_map);
        let model = Model::new(VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu)).unwrap();
        let mut plain = AdamW::new(reference_map.all_vars(), params()).unwrap();
        let mut opt = OptimizerInBackward::<AdamW>::from_varmap(&map, params()).unwrap();
        let (ids, targets) = batch();
        for step in 0..4 {
            let loss = plan.scope(|| reference.loss(&ids, &targets)).unwrap();
            plain.backward_step(&loss).unwrap();
            let loss = plan.scope(|| model.loss(&ids, &targets)).unwrap();
            opt.backward_step(&loss).unwrap();
            // The first step updates every parameter after the backward
            // (it finds the tied embedding's plain use); later ones update
            // all but the embedding inside it, except under `off`, where
            // no region runs.
            let expected = match (step, plan.is_off()) {
                (0, _) | (_, true) => 0,
                _ => opt.len() - 1,
            };
            assert_eq!(opt.stepped_in_backward(), expected, "{plan}, step {step}");
            assert!(opt.without_gradient().is_empty(), "{plan}, step {step}");
            for ((name, a), (_, b)) in sorted(&map).iter().zip(sorted(&reference_map)) {
                // The same gradients, summed in the same order (a
                // parameter's region gradients are added in the order the
                // regions' backwards run, as candle adds them), and the same
                // elementwise update: bit for bit.
                assert_eq!(rel_diff(a, &b), 0.0, "{plan}, step {step}, {name}");
            }
        }
    }
}

#[test]
fn a_parameter_a_step_skips_counts_the_step_as_a_plain_optimizer_does() {
    // Block 1 is left out of steps 1 and 2: its parameters get no gradient
    // there, and candle-nn's `AdamW` (one optimizer over every parameter)
    // counts those steps all the same, so block 1's bias correction at step
    // 3 uses t = 4; and so must each parameter's own optimizer.
    for plan in [Plan::recompute_all(), Plan::save_all(), Plan::off()] {
        let reference_map = VarMap::new();
        let vb = VarBuilder::from_varmap(&reference_map, DType::F64, &Device::Cpu);
        let reference = Model::new(vb).unwrap();
        let map = copy_of(&reference_map);
        let model = Model::new(VarBuilder::from_varmap(&map, DType::F64, &Device::Cpu)).unwrap();
        let mut plain = AdamW::new(reference_map.all_vars(), params()).unwrap();
        let mut opt = OptimizerInBackward::<AdamW>::from_varmap(&map, params()).unwrap();
        let (ids, targets) = batch();
        for step in 0..5 {
            let skipped = (step == 1 || step == 2).then_some(1);
            let loss = plan.scope(|| reference.loss_skipping(&ids, &targets, skipped));
            plain.backward_step(&loss.unwrap()).unwrap();
            let loss = plan.scope(|| model.loss_skipping(&ids, &targets, skipped));
            opt.backward_step(&loss.unwrap()).unwrap();
            let missing = opt.without_gradient();
            assert_eq!(
                missing.len(),
                if skipped.is_some() { 6 } else { 0 },
                "{missing:?}"
            );
            for ((name, a), (_, b)) in sorted(&map).iter().zip(sorted(&reference_map)) {
                assert_eq!(rel_diff(a, &b), 0.0, "{plan}, step {step}, {name}");
            }
        }
    }
}

/// One block `block` of width 8 in its own map, an optimizer of the map
/// updating in the backward, and an input of ones.
fn one_block() -> (VarMap, Block, OptimizerInBackward<AdamW>, Tensor) {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let block = Block::new(vb.pp("block"), 8).unwrap();
    let opt = OptimizerInBackward::<AdamW>::from_varmap(&map, params()).unwrap();
    let x = Tensor::ones((2, 3, 8), DType::F32, &Device::Cpu).unwrap();
    (map, block, opt, x)
}

#[test]
fn a_parameter_read_outside_the_regions_after_the_first_step_is_reported() {
    let (_map, block, mut opt, x) = one_block();
    let step = |opt: &mut OptimizerInBackward<AdamW>, outside: bool| {
        let loss = Plan::recompute_all().scope(|| {
            let y = block.forward(&x)?.sqr()?.mean_all()?;
            if outside {
                // The same weight read by plain candle code.
                y + block.up.weight().sum_all()?
            } else {
                Ok(y)
            }
        })?;
        opt.backward_step(&loss)
    };
    step(&mut opt, false).unwrap();
    step(&mut opt, false).unwrap();
    assert_eq!(opt.stepped_in_backward(), 6);
    let err = step(&mut opt, true).unwrap_err();
    match &err {
        RematError::ParameterOutsideRegions { parameter, region } => {
            assert_eq!(parameter, "block.up.weight");
            assert_eq!(region, "Block::forward");
        }
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("after the backward"), "{err}");
    // From then on it is updated after the backward, with its whole
    // gradient.
    step(&mut opt, true).unwrap();
    assert_eq!(opt.stepped_in_backward(), 5);
}

#[test]
fn a_failed_backward_updates_nothing_after_it() {
    let (map, block, mut opt, x) = one_block();
    let loss = Plan::recompute_all()
        .scope(|| block.forward(&x)?.sum_keepdim(D::Minus1)?.mean_all())
        .unwrap();
    opt.backward_step(&loss).unwrap();
    let before = sorted(&map);
    // The tape was consumed: a second backward of the same loss fails.
    let err = opt.backward_step(&loss).unwrap_err();
    assert!(matches!(err, RematError::TapeReleased { .. }), "{err}");
    for ((name, a), (_, b)) in sorted(&map).iter().zip(before) {
        assert_eq!(rel_diff(a, &b), 0.0, "{name}");
    }
}

#[test]
fn a_first_step_without_regions_does_not_settle_what_is_updated_where() {
    let (_map, block, mut opt, x) = one_block();
    let mut stepped = Vec::new();
    for plan in [Plan::off(), Plan::recompute_all(), Plan::recompute_all()] {
        let loss = plan.scope(|| block.forward(&x)?.sqr()?.mean_all()).unwrap();
        opt.backward_step(&loss).unwrap();
        assert!(opt.without_gradient().is_empty());
        stepped.push(opt.stepped_in_backward());
    }
    // Plain candle: no region, every parameter after the backward; the
    // first step with regions finds who reads what; the next updates all
    // six inside the backward.
    assert_eq!(stepped, [0, 0, 6]);
}

/// bf16 parameters updated in the backward from f32 master weights
/// (`OptimizerInBackward<MasterWeights<AdamW>>`) end each step bit for bit
/// as `MasterWeights<AdamW>` leaves them after the backward (at a learning
/// rate that moves most bf16 weights); at a fine-tuning learning rate the
/// masters move where a bf16 `AdamW` alone leaves the weights as they were.
#[test]
fn master_weights_update_in_the_backward_as_after_it() {
    use remat_runtime::candle_nn::MasterWeights;
    let bf16 =
        |map: &VarMap| Model::new(VarBuilder::from_varmap(map, DType::BF16, &Device::Cpu)).unwrap();
    for (lr, plan) in [
        (1e-2, Plan::recompute_all()),
        (1e-2, Plan::save_all()),
        (1e-4, Plan::recompute_all()),
    ] {
        let params = ParamsAdamW {
            lr,
            ..Default::default()
        };
        let reference_map = VarMap::new();
        let reference = bf16(&reference_map);
        let (map, alone_map) = (copy_of(&reference_map), copy_of(&reference_map));
        let (model, alone) = (bf16(&map), bf16(&alone_map));
        let before = sorted(&map);
        let mut after =
            MasterWeights::<AdamW>::new(reference_map.all_vars(), params.clone()).unwrap();
        let mut inside =
            OptimizerInBackward::<MasterWeights<AdamW>>::from_varmap(&map, params.clone()).unwrap();
        let mut bf16_only = AdamW::new(alone_map.all_vars(), params.clone()).unwrap();
        let (ids, targets) = batch();
        for step in 0..3 {
            let loss = plan.scope(|| reference.loss(&ids, &targets)).unwrap();
            after.backward_step(&loss).unwrap();
            let loss = plan.scope(|| model.loss(&ids, &targets)).unwrap();
            inside.backward_step(&loss).unwrap();
            let loss = plan.scope(|| alone.loss(&ids, &targets)).unwrap();
            bf16_only.backward_step(&loss).unwrap();
            if step > 0 {
                assert_eq!(inside.stepped_in_backward(), inside.len() - 1, "{plan}");
            }
            for ((name, a), (_, b)) in sorted(&map).iter().zip(sorted(&reference_map)) {
                assert_eq!(a.dtype(), DType::BF16);
                assert_eq!(rel_diff(a, &b), 0.0, "lr {lr}, {plan}, step {step}, {name}");
            }
        }
        let changed = |now: &VarMap| -> (usize, usize) {
            let mut counts = (0, 0);
            for ((_, a), (_, b)) in sorted(now).iter().zip(&before) {
                let ne = a.ne(b).unwrap().to_dtype(DType::F32).unwrap();
                counts.0 += ne.sum_all().unwrap().to_scalar::<f32>().unwrap() as usize;
                counts.1 += a.elem_count();
            }
            counts
        };
        if lr == 1e-2 {
            // Most bf16 weights moved: the comparison above means something.
            let (moved, all) = changed(&map);
            assert!(moved * 2 > all, "lr {lr}, {plan}: {moved} of {all} moved");
            continue;
        }
        // Three steps of 1e-4 moved the norms' gains (1.0, 2^-8 apart
        // below it in bf16) in their f32 masters, not yet in bf16, and a
        // bf16 AdamW alone loses them.
        let data = reference_map.data().lock().unwrap();
        for (name, start) in before.iter().filter(|(n, _)| n.ends_with("ln.weight")) {
            let master = after.master(&data[name]).unwrap().as_tensor();
            // AdamW moves each weight by at most about the learning rate a
            // step, less where its gradient changes sign between steps (the
            // model's weights are drawn anew each run: one gain moved 4.6e-5
            // in three steps once); every one moves, each by less than
            // bf16's half ulp at 1.0 (2^-9), so bf16 alone cannot keep it.
            let m = master.to_vec1::<f32>().unwrap();
            let moved = |w: f32| (1e-6..4e-4).contains(&(w - 1.0).abs());
            assert!(m.iter().all(|&w| moved(w)), "{plan}: {name} {m:?}");
            let stayed = &alone_map.data().lock().unwrap()[name];
            assert_eq!(rel_diff(stayed.as_tensor(), start), 0.0, "{plan}: {name}");
        }
    }
}
