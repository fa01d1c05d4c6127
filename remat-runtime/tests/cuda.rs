//! The same checks on a CUDA device (only with `--features cuda`; run by
//! `scripts/gpu-check.sh` on a machine with an NVIDIA GPU). Tolerance 1e-4
//! relative: cuBLAS may pick other summation orders than the plain run.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use remat_runtime::inspect::device_memory_in_use;
use remat_runtime::{random, MemoryReport, Policy, Region};

fn cuda() -> Device {
    Device::new_cuda(0).expect("a CUDA device (this test needs a GPU)")
}

fn to(v: &Var, dev: &Device) -> Var {
    Var::from_tensor(&v.as_tensor().to_device(dev).unwrap()).unwrap()
}

#[test]
fn gpt_block_gradients_on_cuda_match_plain_candle_offload_included() {
    let dev = cuda();
    let gpt = Gpt::new(32, 4, 5, DType::F32);
    let x = to(&var(&[2, 8, 32], 6, 1.0, DType::F32), &dev);
    let mask = causal_mask(8, DType::F32).to_device(&dev).unwrap();
    let on_dev = gpt.to_device(&dev);
    let offload_some: PolicyFn = std::sync::Arc::new(|n| match n {
        "attn.qkv" | "mlp.fc" | "mlp.proj" | "heads" => Policy::Offload,
        _ => Policy::Recompute,
    });
    for policy in [
        all(Policy::Recompute),
        all(Policy::Save),
        saving(&["attn.qkv", "mlp.fc"]),
        all(Policy::Offload),
        offload_some,
    ] {
        let plain = on_dev
            .region("g", x.as_tensor(), &mask, policy.clone(), false)
            .unwrap();
        let g_ref = plain.sum_all().unwrap().backward().unwrap();
        let y = on_dev
            .region("g", x.as_tensor(), &mask, policy, true)
            .unwrap();
        assert_eq!(y.device().location(), dev.location());
        // Offloaded records sit on the host until the backward.
        for e in MemoryReport::capture()
            .entries
            .iter()
            .filter(|e| e.policy == Some(Policy::Offload))
        {
            assert_eq!(e.bytes, 0, "{} still on the device", e.statement);
            assert!(e.host_bytes > 0, "{} moved nothing", e.statement);
        }
        let g = y.sum_all().unwrap().backward().unwrap();
        for v in on_dev.vars().iter().chain([&x]) {
            let d = rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
            assert!(d <= 1e-4, "{d}");
        }
    }
}

#[test]
fn random_draws_are_the_same_on_cpu_and_cuda() {
    random::seed(9);
    let a = random::uniform((4, 4), &Device::Cpu).unwrap();
    random::seed(9);
    let b = random::uniform((4, 4), &cuda()).unwrap();
    assert_eq!(
        a.to_vec2::<f32>().unwrap(),
        b.to_device(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap()
    );
}

#[test]
fn full_recompute_holds_less_device_memory() {
    let dev = cuda();
    let x = to(&var(&[64, 1024], 7, 1.0, DType::F32), &dev);
    let w = to(&var(&[1024, 1024], 8, 0.03, DType::F32), &dev);
    let held = |enabled: bool| {
        let before = device_memory_in_use(&dev).unwrap().unwrap();
        let wt = w.as_tensor().clone();
        let y: Tensor = Region::new("r")
            .enabled(enabled)
            .run(&[x.as_tensor()], move |ctx, ins| {
                let mut h = ins[0].clone();
                for i in 0..8 {
                    h = ctx.recompute(&format!("l{i}"), &[&h], |t| t[0].matmul(&wt)?.tanh())?;
                }
                Ok(h)
            })
            .unwrap();
        let after = device_memory_in_use(&dev).unwrap().unwrap();
        drop(y);
        after.saturating_sub(before)
    };
    let (plain, remat) = (held(false), held(true));
    println!("device bytes held after forward: plain {plain}, full recompute {remat}");
    assert!(remat < plain);
}

#[test]
fn offload_holds_less_device_memory_than_save() {
    let dev = cuda();
    let x = to(&var(&[256, 1024], 7, 1.0, DType::F32), &dev);
    let w = to(&var(&[1024, 1024], 8, 0.03, DType::F32), &dev);
    let held = |policy: Policy| {
        let before = device_memory_in_use(&dev).unwrap().unwrap();
        let wt = w.as_tensor().clone();
        let y: Tensor = Region::new("r")
            .run(&[x.as_tensor()], move |ctx, ins| {
                let mut h = ins[0].clone();
                for i in 0..8 {
                    h = ctx.statement(&format!("l{i}"), policy, &[&h], |t| {
                        t[0].matmul(&wt)?.tanh()
                    })?;
                }
                Ok(h)
            })
            .unwrap();
        let after = device_memory_in_use(&dev).unwrap().unwrap();
        let host = MemoryReport::capture().total_host_bytes();
        let g = y.sum_all().unwrap().backward().unwrap();
        assert!(g.get(&w).is_some());
        (after.saturating_sub(before), host)
    };
    let (saved, _) = held(Policy::Save);
    let (offloaded, host) = held(Policy::Offload);
    println!(
        "device bytes held after forward: save {saved}, offload {offloaded} (+{host} on the host)"
    );
    // 8 statements x (leaf copy + matmul + tanh) of 1 MiB each are on the host.
    assert!(host >= 8 * 3 * 256 * 1024 * 4);
    assert!(offloaded < saved);
}

#[test]
fn the_pool_peak_sees_a_tensor_that_is_gone() {
    let dev = cuda();
    remat_runtime::inspect::reset_device_memory_peak(&dev).unwrap();
    let base = remat_runtime::inspect::device_memory_peak(&dev)
        .unwrap()
        .expect("an H100 has memory pools");
    let bytes = 64 << 20;
    let t = Tensor::zeros(bytes / 4, DType::F32, &dev).unwrap();
    drop(t);
    let peak = remat_runtime::inspect::device_memory_peak(&dev)
        .unwrap()
        .unwrap();
    println!("pool high-water: {base} -> {peak} bytes");
    assert!(peak - base >= bytes, "{base} -> {peak}");
    remat_runtime::inspect::reset_device_memory_peak(&dev).unwrap();
    let after = remat_runtime::inspect::device_memory_peak(&dev)
        .unwrap()
        .unwrap();
    assert!(after < peak);
}
