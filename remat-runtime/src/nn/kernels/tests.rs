//! The attention kernels' source, run on host threads, against
//! [`crate::nn::attention`] in f64.

use candle_core::{DType, Device, Tensor, Var};

use super::Shape;

/// One case: sizes, masking, and whether q, k, v are views of one packed
/// `(B, T, 3, H, D)` projection.
struct Case {
    b: usize,
    h: usize,
    hkv: usize,
    t: usize,
    s: usize,
    d: usize,
    dv: usize,
    causal: bool,
    /// The mask's shape (broadcast to `(B, H, T, S)`), if any.
    mask: Option<[usize; 4]>,
    packed: bool,
    /// The queries' values times this: sharper softmaxes, whose running
    /// maximum moves further from tile to tile.
    sharp: f64,
}

/// Deterministic values in [-2, 2).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
        })
        .collect()
}

/// `v` rounded to `dtype` and back to f64.
fn rounded(v: &[f64], dims: &[usize], dtype: DType) -> Tensor {
    Tensor::from_slice(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap();
    let s = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
    // Relative to the largest value, or to 1e-3 where all are 0 (one
    // visible key: the softmax's gradient vanishes, and the tensor cores'
    // dO . V^T and the lanes' dO . O cancel only to their rounding).
    d.to_scalar::<f64>().unwrap() / s.to_scalar::<f64>().unwrap().max(1e-3)
}

/// Runs the host build of the kernels (`attention_tc.cu`'s if
/// `tensor_cores`) over `c` in `dtype` and compares the output and the
/// three gradients with the composed op in f64.
fn check(
    exe: &std::path::Path,
    dir: &std::path::Path,
    c: &Case,
    (dtype, tensor_cores): (DType, bool),
    tol: f64,
    seed: u64,
) {
    let Case {
        b,
        h,
        hkv,
        t,
        s,
        d,
        dv,
        causal,
        ..
    } = *c;
    let cpu = Device::Cpu;
    // Inputs, rounded to the dtype; q, k, v as the layout under test.
    let (q, k, v, data_qkv) = if c.packed {
        assert_eq!((h, d), (hkv, dv));
        let p = rounded(&values(b * t * 3 * h * d, seed), &[b, t, 3, h, d], dtype);
        let part = |i| {
            p.narrow(2, i, 1)
                .unwrap()
                .squeeze(2)
                .unwrap()
                .transpose(1, 2)
                .unwrap()
        };
        (part(0), part(1), part(2), p.flatten_all().unwrap())
    } else {
        let q: Vec<f64> = values(b * h * t * d, seed)
            .iter()
            .map(|x| x * c.sharp)
            .collect();
        let q = rounded(&q, &[b, h, t, d], dtype);
        let k = rounded(&values(b * hkv * s * d, seed + 1), &[b, hkv, s, d], dtype);
        let v = rounded(&values(b * hkv * s * dv, seed + 2), &[b, hkv, s, dv], dtype);
        let all = Tensor::cat(
            &[
                q.flatten_all().unwrap(),
                k.flatten_all().unwrap(),
                v.flatten_all().unwrap(),
            ],
            0,
        )
        .unwrap();
        (q, k, v, all)
    };
    let mask = c.mask.map(|dims| {
        let n: usize = dims.iter().product();
        let mut m: Vec<f64> = values(n, seed + 3).iter().map(|x| x / 2.0).collect();
        // Keys hidden by -inf, by a huge finite value, and (when the mask has
        // rows) a whole row hidden.
        for (i, x) in m.iter_mut().enumerate() {
            if i % 7 == 3 {
                *x = f64::NEG_INFINITY;
            } else if i % 11 == 5 {
                *x = -1e9;
            }
        }
        if dims[2] > 2 {
            let row = 2 * dims[3];
            m[row..row + dims[3]].fill(f64::NEG_INFINITY);
        }
        rounded(&m, &dims, dtype)
    });
    let dout = rounded(&values(b * t * h * dv, seed + 4), &[b, t, h, dv], dtype);

    // The reference: the composed op in f64 and its gradients.
    let (qv, kv, vv) = (
        Var::from_tensor(&q.contiguous().unwrap()).unwrap(),
        Var::from_tensor(&k.contiguous().unwrap()).unwrap(),
        Var::from_tensor(&v.contiguous().unwrap()).unwrap(),
    );
    let y = crate::nn::attention(
        qv.as_tensor(),
        kv.as_tensor(),
        vv.as_tensor(),
        causal,
        mask.as_ref(),
    )
    .unwrap();
    let loss = (&y * dout.transpose(1, 2).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    let g = loss.backward().unwrap();
    let reference = [
        y.transpose(1, 2).unwrap().contiguous().unwrap(),
        g.get(&qv).unwrap().clone(),
        g.get(&kv).unwrap().clone(),
        g.get(&vv).unwrap().clone(),
    ];

    // The case file (see host/main.cpp).
    let scale = 1.0 / (d as f64).sqrt();
    let shape = Shape::new(
        &q,
        &k,
        &v,
        mask.as_ref()
            .map(|m| {
                let mut m = m.clone();
                while m.rank() < 4 {
                    m = m.unsqueeze(0).unwrap();
                }
                m
            })
            .as_ref(),
        causal,
        scale,
    )
    .unwrap()
    .with_output(&dout, &dout);
    let n_qkv = data_qkv.elem_count();
    let (oq, ok, ov) = if c.packed {
        (0, h * d, 2 * h * d)
    } else {
        (0, b * h * t * d, b * h * t * d + b * hkv * s * d)
    };
    let mask_flat = mask.as_ref().map(|m| m.flatten_all().unwrap());
    let om = n_qkv;
    let od = om + mask_flat.as_ref().map_or(0, |m| m.elem_count());
    let mut parts = vec![data_qkv];
    parts.extend(mask_flat);
    parts.push(dout.flatten_all().unwrap());
    let data = Tensor::cat(&parts, 0).unwrap().to_dtype(dtype).unwrap();
    let code: i64 = match (dtype, tensor_cores) {
        (DType::F32, false) => 0,
        (DType::F16, false) => 1,
        (DType::BF16, false) => 2,
        (DType::F16, true) => 3,
        (DType::BF16, true) => 4,
        _ => unreachable!(),
    };
    let dm: i64 = if d.max(dv) <= 64 { 64 } else { 128 };
    let mut bytes = Vec::new();
    let mut put = |x: i64| bytes.extend_from_slice(&x.to_le_bytes());
    for x in [code, dm, b as i64] {
        put(x);
    }
    for x in [
        shape.h,
        shape.hkv,
        shape.t,
        shape.s,
        shape.d,
        shape.dv,
        shape.causal,
        shape.has_mask,
    ] {
        put(x.into());
    }
    let mut strides = Vec::new();
    for a in [
        &shape.q[..],
        &shape.k,
        &shape.v,
        &shape.mask,
        &shape.out,
        &shape.dout,
    ] {
        strides.extend_from_slice(a);
    }
    bytes.extend_from_slice(&scale.to_le_bytes());
    let mut put = |x: i64| bytes.extend_from_slice(&x.to_le_bytes());
    for x in strides {
        put(x);
    }
    for x in [oq, ok, ov, om, 0, od, data.elem_count()] {
        put(x as i64);
    }
    match dtype {
        DType::F32 => data
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes())),
        DType::F16 => data
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes())),
        _ => data
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes())),
    }
    let (input, output) = (
        dir.join(format!("case{seed}.in")),
        dir.join(format!("case{seed}.out")),
    );
    std::fs::write(&input, bytes).unwrap();
    let status = std::process::Command::new(exe)
        .arg(&input)
        .arg(&output)
        .status()
        .unwrap();
    assert!(
        status.success(),
        "the host kernels failed on case {seed}: {status}"
    );

    // The results, in the order main.cpp writes them.
    let raw = std::fs::read(&output).unwrap();
    let size = dtype.size_in_bytes();
    let mut at = 0;
    let mut take = |n: usize, dt: DType, dims: &[usize]| {
        let bytes = &raw[at..at + n * dt.size_in_bytes()];
        at += n * dt.size_in_bytes();
        Tensor::from_raw_buffer(bytes, dt, dims, &cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
    };
    let out = take(b * t * h * dv, dtype, &[b, t, h, dv]);
    let stats = take(2 * b * h * t, DType::F32, &[2, b, h, t]);
    let dq = take(b * h * t * d, dtype, &[b, h, t, d]);
    let dk = take(b * hkv * s * d, dtype, &[b, hkv, s, d]);
    let dvv = take(b * hkv * s * dv, dtype, &[b, hkv, s, dv]);
    assert_eq!(at, raw.len(), "{size}");
    assert!(stats
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
        .iter()
        .all(|x| x.is_finite()));
    for (name, got, want) in [
        ("out", &out, &reference[0]),
        ("dq", &dq, &reference[1]),
        ("dk", &dk, &reference[2]),
        ("dv", &dvv, &reference[3]),
    ] {
        let r = rel(got, want);
        assert!(
            r <= tol,
            "case {seed} ({dtype:?}): {name} differs by {r:e} relative (tolerance {tol:e})"
        );
    }
}

/// `attention.cu` compiled by g++ with `host/shim.h` (each block's threads
/// as POSIX threads at a barrier, f16 as `_Float16`) and run over cases of
/// every kind the kernels take: packed strided views, grouped-query heads,
/// more keys than queries, causal and additive masks (broadcast, `-inf`,
/// huge finite, a fully masked row), head sizes past 64 (the 128
/// instance), one query and one key; f32 against the composed op in f64
/// (f32 rounding: `<= 1e-5` relative to the largest value), f16 and bf16
/// (their inputs' rounding, the kernels' f32 arithmetic, their outputs'
/// rounding: `<= 1e-2`). What a GPU must still show is nvcc's code and the
/// launches (tests/cuda.rs).
#[test]
fn the_attention_kernels_on_host_threads_match_f64() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/nn/kernels");
    let dir = std::env::temp_dir().join(format!("remat-attention-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("kernels");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let built = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-pthread", "-include"])
        .arg(here.join("host/shim.h"))
        .arg(here.join("host/main.cpp"))
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("this test needs a C++ compiler ({cxx}): {e}"));
    assert!(built.success(), "{cxx} failed on attention.cu");
    let case = |b, h, hkv, t, s, d, dv, causal, mask, packed| Case {
        b,
        h,
        hkv,
        t,
        s,
        d,
        dv,
        causal,
        mask,
        packed,
        sharp: 1.0,
    };
    let cases = [
        case(2, 3, 3, 70, 70, 16, 16, true, None, true),
        case(2, 4, 2, 37, 37, 8, 8, false, Some([2, 1, 37, 37]), false),
        case(1, 2, 2, 33, 50, 24, 8, true, Some([1, 2, 33, 50]), false),
        case(2, 3, 1, 5, 129, 100, 64, false, Some([1, 1, 1, 129]), false),
        case(1, 2, 1, 65, 65, 72, 72, true, None, false),
        case(1, 1, 1, 1, 1, 16, 16, true, None, false),
    ];
    for (i, c) in cases.iter().enumerate() {
        check(&exe, &dir, c, (DType::F32, false), 1e-5, i as u64);
    }
    for (i, dtype) in [(10, DType::F16), (20, DType::BF16)] {
        check(&exe, &dir, &cases[0], (dtype, false), 1e-2, i);
        check(&exe, &dir, &cases[2], (dtype, false), 1e-2, i + 1);
    }
    // The tensor-core kernels, every case: their probabilities and score
    // gradients are rounded to the dtype before their products as well.
    let sharp = Case {
        sharp: 6.0,
        ..case(1, 2, 1, 150, 150, 32, 32, false, None, false)
    };
    for (i, c) in cases.iter().chain([&sharp]).enumerate() {
        check(&exe, &dir, c, (DType::F16, true), 1e-2, 30 + i as u64);
        check(&exe, &dir, c, (DType::BF16, true), 2e-2, 40 + i as u64);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `gelu.cu` on the host (shim.h) against the CPU's one-pass backward in
/// f64: f32 within 1e-6 relative to the largest value (f32 arithmetic);
/// f16 and bf16 within their rounding of the result (1e-2). A grid of
/// fewer threads than elements, so the grid-stride loop is run.
#[test]
fn the_gelu_kernel_on_the_host_matches_f64() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/nn/kernels");
    let dir = std::env::temp_dir().join(format!("remat-gelu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("gelu");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let built = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-pthread", "-include"])
        .arg(here.join("host/shim.h"))
        .arg(here.join("host/gelu.cpp"))
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("this test needs a C++ compiler ({cxx}): {e}"));
    assert!(built.success(), "{cxx} failed on gelu.cu");
    let n = 1000;
    // Values from -8 to 8, past where tanh saturates, and 0.
    let x: Vec<f64> = (0..n).map(|i| (i as f64 - 500.0) / 62.5).collect();
    let dy = values(n, 7);
    for (code, dtype, tol) in [
        (0u64, DType::F32, 1e-6),
        (1, DType::F16, 1e-2),
        (2, DType::BF16, 1e-2),
    ] {
        let (xt, gt) = (rounded(&x, &[n], dtype), rounded(&dy, &[n], dtype));
        let want = crate::nn::gelu::backward(&xt, &gt).unwrap();
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&(n as u64).to_le_bytes());
        bytes.extend_from_slice(&code.to_le_bytes());
        bytes.extend(
            Tensor::cat(&[&xt, &gt], 0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
                .iter()
                .flat_map(|&v| match dtype {
                    DType::F32 => (v as f32).to_le_bytes().to_vec(),
                    DType::F16 => half::f16::from_f64(v).to_le_bytes().to_vec(),
                    _ => half::bf16::from_f64(v).to_le_bytes().to_vec(),
                }),
        );
        let (input, output) = (
            dir.join(format!("g{code}.in")),
            dir.join(format!("g{code}.out")),
        );
        std::fs::write(&input, bytes).unwrap();
        let status = std::process::Command::new(&exe)
            .arg(&input)
            .arg(&output)
            .status()
            .unwrap();
        assert!(status.success(), "the host gelu kernel failed: {status}");
        let raw = std::fs::read(&output).unwrap();
        let got = Tensor::from_raw_buffer(&raw, dtype, &[n], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let r = rel(&got, &want);
        assert!(r <= tol, "{dtype:?}: {r:e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `norm.cu` on host threads (shim.h, a warp per block) against the norm
/// computed here in f64 from the same rounded inputs: layer and RMS norm,
/// rows past one column chunk (64) and a partial chunk, feature counts
/// that are not a multiple of the warp, rows far from 0 (the mean
/// cancels). f32 within 1e-5 relative to the largest value (f32
/// arithmetic over up to 300 features); f16 and bf16 outputs within their
/// rounding (1e-2), their f32 gradients within 1e-4 (the inputs are the
/// rounded ones, so only f32 arithmetic differs).
#[test]
fn the_norm_kernels_on_host_threads_match_f64() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/nn/kernels");
    let dir = std::env::temp_dir().join(format!("remat-norm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("norm");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let built = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-pthread", "-include"])
        .arg(here.join("host/shim.h"))
        .arg(here.join("host/norm.cpp"))
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("this test needs a C++ compiler ({cxx}): {e}"));
    assert!(built.success(), "{cxx} failed on norm.cu");
    let cpu = Device::Cpu;
    let mut seed = 100;
    for (rows, c, offset) in [(70, 33, 0.0), (3, 300, 50.0), (129, 5, 0.0)] {
        for layer in [true, false] {
            for (code, dtype) in [(0i64, DType::F32), (1, DType::F16), (2, DType::BF16)] {
                seed += 1;
                let n = rows * c;
                let shift = |v: Vec<f64>| v.into_iter().map(|x| x + offset).collect::<Vec<_>>();
                let x = rounded(&shift(values(n, seed)), &[rows, c], dtype);
                let g = rounded(&values(c, seed + 1), &[c], dtype);
                let b = rounded(&values(c, seed + 2), &[c], dtype);
                let dy = rounded(&values(n, seed + 3), &[rows, c], dtype);
                let eps = 1e-5;
                // The reference, by hand in f64.
                let (xs, gs, bs, dys) = (
                    x.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
                    g.to_vec1::<f64>().unwrap(),
                    b.to_vec1::<f64>().unwrap(),
                    dy.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
                );
                let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
                let (mut dg, mut db) = (vec![0.0; c], vec![0.0; c]);
                for r in 0..rows {
                    let row = &xs[r * c..(r + 1) * c];
                    let mu = if layer {
                        row.iter().sum::<f64>() / c as f64
                    } else {
                        0.0
                    };
                    let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / c as f64;
                    let rs = 1.0 / (var + eps).sqrt();
                    let xh: Vec<f64> = row.iter().map(|v| (v - mu) * rs).collect();
                    let d = &dys[r * c..(r + 1) * c];
                    let dxh: Vec<f64> = (0..c).map(|j| d[j] * gs[j]).collect();
                    let proj = (0..c).map(|j| dxh[j] * xh[j]).sum::<f64>() / c as f64;
                    let mean_dxh = if layer {
                        dxh.iter().sum::<f64>() / c as f64
                    } else {
                        0.0
                    };
                    for j in 0..c {
                        y[r * c + j] = xh[j] * gs[j] + if layer { bs[j] } else { 0.0 };
                        dx[r * c + j] = rs * (dxh[j] - xh[j] * proj - mean_dxh);
                        dg[j] += d[j] * xh[j];
                        db[j] += d[j];
                    }
                }
                let mut bytes = Vec::new();
                for v in [rows as i64, c as i64, code, layer as i64] {
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
                bytes.extend_from_slice(&eps.to_le_bytes());
                let all = Tensor::cat(
                    &[x.flatten_all().unwrap(), g, b, dy.flatten_all().unwrap()],
                    0,
                )
                .unwrap();
                for v in all.to_vec1::<f64>().unwrap() {
                    match dtype {
                        DType::F32 => bytes.extend_from_slice(&(v as f32).to_le_bytes()),
                        DType::F16 => {
                            bytes.extend_from_slice(&half::f16::from_f64(v).to_le_bytes())
                        }
                        _ => bytes.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
                    }
                }
                let (input, output) = (
                    dir.join(format!("n{seed}.in")),
                    dir.join(format!("n{seed}.out")),
                );
                std::fs::write(&input, bytes).unwrap();
                let status = std::process::Command::new(&exe)
                    .arg(&input)
                    .arg(&output)
                    .status()
                    .unwrap();
                assert!(status.success(), "the host norm kernels failed: {status}");
                let raw = std::fs::read(&output).unwrap();
                let chunks = rows.div_ceil(64);
                let mut at = 0;
                let mut take = |len: usize, dt: DType| {
                    let size = len * dt.size_in_bytes();
                    let t = Tensor::from_raw_buffer(&raw[at..at + size], dt, &[len], &cpu)
                        .unwrap()
                        .to_dtype(DType::F64)
                        .unwrap();
                    at += size;
                    t
                };
                let got_y = take(n, dtype);
                let (_mean, _rstd) = (take(rows, DType::F32), take(rows, DType::F32));
                let got_dx = take(n, DType::F32);
                let sum_chunks = |t: Tensor| t.reshape((chunks, c)).unwrap().sum(0).unwrap();
                let got_dg = sum_chunks(take(chunks * c, DType::F32));
                let got_db = sum_chunks(take(chunks * c, DType::F32));
                assert_eq!(at, raw.len());
                let want = |v: &[f64]| Tensor::from_slice(v, v.len(), &cpu).unwrap();
                let ytol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                let gtol = if dtype == DType::F32 { 1e-5 } else { 1e-4 };
                let mut checks = vec![
                    ("y", got_y, want(&y), ytol),
                    ("dx", got_dx, want(&dx), gtol),
                    ("dgain", got_dg, want(&dg), gtol),
                ];
                if layer {
                    checks.push(("dbias", got_db, want(&db), gtol));
                }
                for (name, got, want, tol) in checks {
                    let r = rel(&got, &want);
                    assert!(
                        r <= tol,
                        "{rows}x{c} layer {layer} {dtype:?}: {name} differs by {r:e} (tolerance {tol:e})"
                    );
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `bias.cu` on the host (shim.h) against f64 by hand: `y + b` within the
/// dtype's rounding of the result (one rounding of an exact f32 sum: half
/// an ulp, `<= 2^-8` relative for bf16), the column sums (f32, 64 rows a
/// chunk, the chunks added here) within f32's rounding over 64 terms
/// (`1e-5` relative to the largest sum); rows past one chunk and a partial
/// one, features past one block of 32 and not a multiple of it.
#[test]
fn the_bias_kernels_on_the_host_match_f64() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/nn/kernels");
    let dir = std::env::temp_dir().join(format!("remat-bias-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("bias");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let built = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-pthread", "-include"])
        .arg(here.join("host/shim.h"))
        .arg(here.join("host/bias.cpp"))
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("this test needs a C++ compiler ({cxx}): {e}"));
    assert!(built.success(), "{cxx} failed on bias.cu");
    let cpu = Device::Cpu;
    for (rows, n) in [(150, 45), (3, 7), (64, 32)] {
        for (code, dtype, tol) in [
            (0i64, DType::F32, 1e-6),
            (1, DType::F16, 1e-3),
            (2, DType::BF16, 4e-3),
        ] {
            let y = rounded(&values(rows * n, 7 + code as u64), &[rows, n], dtype);
            let b = rounded(&values(n, 9), &[n], dtype);
            let mut bytes = Vec::new();
            for v in [rows as i64, n as i64, code] {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
            let all = Tensor::cat(&[y.flatten_all().unwrap(), b.clone()], 0).unwrap();
            for v in all.to_vec1::<f64>().unwrap() {
                match dtype {
                    DType::F32 => bytes.extend_from_slice(&(v as f32).to_le_bytes()),
                    DType::F16 => bytes.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
                    _ => bytes.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
                }
            }
            let (input, output) = (
                dir.join(format!("b{rows}{code}.in")),
                dir.join(format!("b{rows}{code}.out")),
            );
            std::fs::write(&input, bytes).unwrap();
            let status = std::process::Command::new(&exe)
                .arg(&input)
                .arg(&output)
                .status()
                .unwrap();
            assert!(status.success(), "the host bias kernels failed: {status}");
            let raw = std::fs::read(&output).unwrap();
            let size = rows * n * dtype.size_in_bytes();
            let got_y = Tensor::from_raw_buffer(&raw[..size], dtype, &[rows, n], &cpu)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap();
            let chunks = rows.div_ceil(64);
            let got_sums = Tensor::from_raw_buffer(&raw[size..], DType::F32, &[chunks, n], &cpu)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .sum(0)
                .unwrap();
            let want_y = y.broadcast_add(&b).unwrap();
            let want_sums = y.sum(0).unwrap();
            let r = rel(&got_y, &want_y);
            assert!(r <= tol, "{rows}x{n} {dtype:?}: y + b differs by {r:e}");
            let r = rel(&got_sums, &want_sums);
            assert!(
                r <= 1e-5,
                "{rows}x{n} {dtype:?}: the column sums differ by {r:e}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
