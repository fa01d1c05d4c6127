use candle_core::{DType, Device, Tensor};

use super::*;

fn words(t: &Tensor) -> Vec<f64> {
    of(t).unwrap().to_vec1::<f64>().unwrap()
}

/// The device algorithm, emulated on the CPU: its checksum and launches.
fn emulated(t: &Tensor) -> (Vec<f64>, usize) {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        panic!("a CPU tensor")
    };
    let (words, launches) = emulated::emulate(cpu, layout).unwrap();
    (words.to_vec(), launches)
}

/// The fingerprint `of_all` takes of `t` for `kind`.
fn taken(t: &Tensor, kind: Kind) -> Vec<f64> {
    of_all(&[Some(t)], kind).unwrap()[0]
        .to_vec1::<f64>()
        .unwrap()
}

fn ramp(n: usize) -> Tensor {
    Tensor::arange(0f32, n as f32, &Device::Cpu)
        .unwrap()
        .affine(0.37, -400.0)
        .unwrap()
        .sin()
        .unwrap()
}

#[test]
fn every_element_and_its_position_count() {
    let dev = Device::Cpu;
    let base: Vec<f32> = (0..300_000u64)
        .map(|i| ((i * 7919) % 1000) as f32 / 7.0)
        .collect();
    let t = Tensor::new(base.as_slice(), &dev).unwrap();
    let c = words(&t);
    // One element, one ulp.
    let mut one = base.clone();
    one[123_457] = f32::from_bits(one[123_457].to_bits() + 1);
    let d = words(&Tensor::new(one.as_slice(), &dev).unwrap());
    assert_ne!(c[0], d[0]);
    // Two elements swapped: the plain sums agree, the hashes and the
    // weighted sum do not.
    let mut swapped = base.clone();
    swapped.swap(10, 250_000);
    let s = words(&Tensor::new(swapped.as_slice(), &dev).unwrap());
    assert_eq!(c[1], s[1]);
    assert_ne!(c[0], s[0]);
    assert_ne!(c[3], s[3]);
    // The same elements give the same bits, however they are laid out.
    let m = t.reshape((600, 500)).unwrap();
    let tt = m.t().unwrap().contiguous().unwrap().t().unwrap();
    assert!(!tt.is_contiguous());
    assert_eq!(words(&m), words(&tt));
    assert_eq!(c, words(&t));
}

#[test]
fn every_dtype_and_views() {
    let dev = Device::Cpu;
    let x = Tensor::arange(0f64, 24.0, &dev)
        .unwrap()
        .reshape((2, 3, 4))
        .unwrap();
    for dtype in [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::U32,
        DType::I64,
        DType::U8,
        DType::I32,
        DType::I16,
    ] {
        let t = x.to_dtype(dtype).unwrap();
        let c = words(&t);
        assert_eq!(c[1], 276.0, "{dtype:?}");
        let narrow = t.narrow(2, 1, 2).unwrap();
        assert_eq!(
            words(&narrow),
            words(&narrow.contiguous().unwrap()),
            "{dtype:?}"
        );
        let changed = (t.to_dtype(DType::F64).unwrap() + 0.0)
            .unwrap()
            .slice_assign(
                &[0..1, 0..1, 0..1],
                &Tensor::ones((1, 1, 1), DType::F64, &dev).unwrap(),
            )
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        assert_ne!(words(&changed)[0], c[0], "{dtype:?}");
    }
    let empty = Tensor::zeros((0, 3), DType::F32, &dev).unwrap();
    assert_eq!(words(&empty), vec![0.0; WORDS]);
}

/// The kernels' code, run thread by thread, gives the CPU path's bits for
/// every dtype, layout and size around the chunk's and the span's edges:
/// what a GPU test then checks of the kernels themselves.
#[test]
fn the_device_algorithm_gives_the_cpu_bits() {
    let sizes = [
        1,
        7,
        LANES - 1,
        LANES * SPAN + 3,
        CHUNK - 1,
        CHUNK,
        CHUNK + 1,
        2 * CHUNK + LANES * 5 + 17,
        // More chunks than the combine kernel has lanes.
        (LANES + 3) * CHUNK + 5,
    ];
    for n in sizes {
        let base = ramp(n);
        for dtype in [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::F64,
            DType::U8,
            DType::U32,
            DType::I16,
            DType::I32,
            DType::I64,
            DType::F8E4M3,
        ] {
            let t = match dtype {
                DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::F8E4M3 => {
                    base.affine(1000.0, 0.0).unwrap().to_dtype(dtype).unwrap()
                }
                // Integers over their range: negatives wrap in the hash.
                _ => base.affine(100.0, 110.0).unwrap().to_dtype(dtype).unwrap(),
            };
            let (device, launches) = emulated(&t);
            assert_eq!(device, words(&t), "{dtype:?}, {n} elements");
            assert_eq!(launches, 2, "{dtype:?}, {n} elements");
        }
    }
    // Views read in place: transposed, narrowed, broadcast, offset.
    let rows = 3 * CHUNK / 256;
    let m = ramp(3 * CHUNK / 2).reshape((rows, 128)).unwrap();
    let views = [
        m.t().unwrap(),
        m.narrow(1, 5, 100).unwrap(),
        m.narrow(0, 1, rows - 9).unwrap(),
        m.narrow(0, 3, 1).unwrap().broadcast_as((4, 128)).unwrap(),
        m.reshape((2, rows / 2, 128))
            .unwrap()
            .permute((2, 0, 1))
            .unwrap(),
    ];
    for v in views {
        let (device, launches) = emulated(&v);
        assert_eq!(device, words(&v), "{:?} {:?}", v.dims(), v.stride());
        assert_eq!(device, words(&v.contiguous().unwrap()));
        assert_eq!(launches, 2);
    }
    // Nothing to sum, nothing launched.
    let empty = Tensor::zeros((4, 0), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(emulated(&empty), (vec![0.0; WORDS], 0));
}

/// The device algorithm sees every change the CPU's does: one ulp of one
/// element, and a swap of two equal-magnitude elements.
#[test]
fn the_device_algorithm_sees_an_ulp_and_a_swap() {
    let n = 2 * CHUNK + 1000;
    let base: Vec<f32> = ramp(n).to_vec1().unwrap();
    let of = |v: &[f32]| emulated(&Tensor::new(v, &Device::Cpu).unwrap()).0;
    let c = of(&base);
    for at in [0, 1, LANES, CHUNK - 1, CHUNK, n - 1] {
        let mut one = base.clone();
        one[at] = f32::from_bits(one[at].to_bits() ^ 1);
        assert_ne!(of(&one)[0], c[0], "an ulp at {at}");
    }
    let mut swapped = base.clone();
    swapped.swap(3, CHUNK + 7);
    let s = of(&swapped);
    assert_ne!(s[0], c[0]);
    assert_ne!(s[3], c[3]);
}

#[test]
fn the_composed_path_computes_the_same_sums() {
    // The path other devices take without the kernels, run on the CPU:
    // candle's kernels for the three sums, no hash.
    let t = ramp(3000).reshape((30, 100)).unwrap();
    for view in [t.clone(), t.t().unwrap()] {
        let cpu = words(&view);
        let device = composed::of(&view).unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(device.len(), WORDS);
        assert_eq!(device[0], 0.0);
        for k in 1..WORDS {
            // The CPU sums spans of 32 elements in f32 first.
            let scale = cpu[2].abs().max(1.0);
            assert!(
                (cpu[k] - device[k]).abs() <= 1e-6 * scale,
                "{k}: {cpu:?} {device:?}"
            );
        }
    }
}

/// A value compared only bit for bit gets the digest of its bytes: any
/// element changed by one ulp, two elements swapped (in one chunk of the
/// digest or two), one element moved by a row, in every dtype, change it;
/// a strided view and its contiguous copy have one digest, whatever the
/// chunks; and it is not the checksum (whose sums it leaves out).
#[test]
fn a_value_compared_bit_for_bit_gets_a_digest_that_sees_every_change() {
    let dev = Device::Cpu;
    // 300,000 elements: several 256 KiB chunks in every dtype but u8.
    let (rows, cols) = (600usize, 500usize);
    let base = ramp(rows * cols);
    for dtype in [
        DType::F32,
        DType::F64,
        DType::BF16,
        DType::F16,
        DType::U8,
        DType::U32,
        DType::I64,
    ] {
        let values = base
            .affine(100.0, 128.0)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let t = Tensor::new(values.as_slice(), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let d = taken(&t, Kind::Bits);
        assert_eq!(&d[1..], &[0.0; WORDS - 1], "{dtype:?}: no sums");
        assert_ne!(d, taken(&t, Kind::Sums), "{dtype:?}");
        assert_eq!(d[0], d[0].trunc());
        assert!(d[0] < (1u64 << 53) as f64);
        // The same elements laid out as a transposed view: one digest.
        let m = t.reshape((rows, cols)).unwrap();
        let view = m.t().unwrap().contiguous().unwrap().t().unwrap();
        assert!(!view.is_contiguous());
        assert_eq!(taken(&m, Kind::Bits), d, "{dtype:?}: a view");
        // A narrowed view and its copy.
        let part = m.narrow(1, 7, 301).unwrap();
        assert_eq!(
            taken(&part, Kind::Bits),
            taken(&part.contiguous().unwrap(), Kind::Bits),
            "{dtype:?}: a narrowed view"
        );
        let changed = |edit: &dyn Fn(&mut Vec<f64>)| {
            let mut v = values.clone();
            edit(&mut v);
            let t = Tensor::from_vec(v, rows * cols, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            taken(&t, Kind::Bits)
        };
        // Unchanged values rebuilt: the same digest.
        assert_eq!(changed(&|_| {}), d, "{dtype:?}");
        let step = |v: f64| match dtype {
            DType::F32 => f32::from_bits((v as f32).to_bits() + 1) as f64,
            DType::F64 => f64::from_bits(v.to_bits() + 1),
            DType::BF16 => half::bf16::from_bits(half::bf16::from_f64(v).to_bits() + 1).to_f64(),
            DType::F16 => half::f16::from_bits(half::f16::from_f64(v).to_bits() + 1).to_f64(),
            _ => v + 1.0,
        };
        for at in [0, 1, 65_535, 65_536, 123_457, rows * cols - 1] {
            assert_ne!(
                changed(&|v| v[at] = step(v[at])),
                d,
                "{dtype:?}: one step at {at}"
            );
        }
        let (a, b) = (10, 11);
        assert_ne!(values[a], values[b]);
        assert_ne!(changed(&|v| v.swap(a, b)), d, "{dtype:?}: a swap");
        let far = (0..rows * cols)
            .rev()
            .find(|&k| values[k] != values[a])
            .unwrap();
        assert_ne!(changed(&|v| v.swap(a, far)), d, "{dtype:?}: a far swap");
        assert_ne!(
            changed(&|v| v.rotate_left(cols)),
            d,
            "{dtype:?}: rows shifted"
        );
    }
    // Nothing to hash: a digest all the same.
    let empty = Tensor::zeros((0, 3), DType::F32, &dev).unwrap();
    assert_eq!(taken(&empty, Kind::Bits)[1..], [0.0; WORDS - 1]);
}

/// A recomputed output's fingerprint on the CPU (`summed`): its hash is
/// the digest's; its sums are those of the definition, computed here in
/// `f64` from the formula (within the rounding of spans summed in the
/// element's precision); a strided view and its copy have the same four
/// numbers; one ulp anywhere changes the hash, a swap the hash and the
/// weighted sum; and rounding noise on every element is within the
/// dtype's tolerance while no longer bitwise.
#[test]
fn a_recomputed_output_on_the_cpu_gets_the_digest_and_sums_that_see_every_change() {
    use crate::tape::fingerprint::{matches, tolerance, Compare};
    let dev = Device::Cpu;
    // Several 256 KiB chunks and a partial block and row at the end.
    let (rows, cols) = (613usize, 509usize);
    let n = rows * cols;
    let base = Tensor::randn(0f32, 1.0, n, &dev)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    let weight = |p: usize| {
        let w = |key: u32| f64::from(key >> 8);
        let inner = w(((p % 4096) as u32 + 1).wrapping_mul(0x9E37_79B9)) / 16_777_216.0;
        let block = 0.5 + w(((p / 4096) as u32 + 1).wrapping_mul(0x85eb_ca6b)) / 33_554_432.0;
        inner * block
    };
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64] {
        let scaled = if dtype == DType::I64 {
            base.affine(1000.0, 0.0).unwrap().round().unwrap()
        } else {
            base.affine(3.0, 0.5).unwrap()
        };
        let t = scaled.to_dtype(dtype).unwrap();
        let values = t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
        let f = taken(&t, Kind::Sums);
        assert_eq!(
            f[0],
            taken(&t, Kind::Bits)[0],
            "{dtype:?}: the digest's hash"
        );
        let magnitudes: f64 = values.iter().map(|v| v.abs()).sum();
        let exact = [
            values.iter().sum::<f64>(),
            magnitudes,
            values.iter().enumerate().map(|(p, v)| v * weight(p)).sum(),
        ];
        let rounding = if matches!(dtype, DType::F64 | DType::I64) {
            1e-12
        } else {
            1e-6
        };
        for (i, e) in exact.iter().enumerate() {
            assert!(
                (f[1 + i] - e).abs() <= rounding * magnitudes,
                "{dtype:?}: sum {i}: {} vs {e}",
                f[1 + i]
            );
        }
        let m = t.reshape((rows, cols)).unwrap();
        let view = m.t().unwrap().contiguous().unwrap().t().unwrap();
        assert_eq!(taken(&view, Kind::Sums), f, "{dtype:?}: a view");
        let rebuilt = |v: Vec<f64>| {
            let t = Tensor::from_vec(v, n, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            taken(&t, Kind::Sums)
        };
        assert_eq!(rebuilt(values.clone()), f, "{dtype:?}: rebuilt");
        let step = |v: f64| match dtype {
            DType::F32 => f32::from_bits((v as f32).to_bits() + 1) as f64,
            DType::F64 => f64::from_bits(v.to_bits() + 1),
            DType::BF16 => half::bf16::from_bits(half::bf16::from_f64(v).to_bits() + 1).to_f64(),
            DType::F16 => half::f16::from_bits(half::f16::from_f64(v).to_bits() + 1).to_f64(),
            _ => v + 1.0,
        };
        for at in [0, 4095, 4096, 65_536, 131_071, n - 1] {
            let mut v = values.clone();
            v[at] = step(v[at]);
            assert_ne!(rebuilt(v)[0], f[0], "{dtype:?}: one step at {at}");
        }
        for (a, b) in [(10, 11), (5, 4096 + 5), (7, n - 2)] {
            assert_ne!(values[a], values[b]);
            let mut v = values.clone();
            v.swap(a, b);
            let swapped = rebuilt(v);
            assert_ne!(swapped[0], f[0], "{dtype:?}: swap {a} {b}");
            assert_ne!(swapped[3], f[3], "{dtype:?}: swap {a} {b}, weighted");
        }
        if dtype != DType::I64 {
            // Every element one ulp up or down: a legitimate replay's noise.
            let noisy: Vec<f64> = values
                .iter()
                .enumerate()
                .map(|(p, &v)| if p % 3 == 0 { step(v) } else { v })
                .collect();
            let r = rebuilt(noisy);
            assert!(!matches(&f, &r, Compare::Bitwise), "{dtype:?}");
            assert!(
                matches(&f, &r, Compare::Within(tolerance(dtype))),
                "{dtype:?}"
            );
        }
    }
    let empty = Tensor::zeros((0, 3), DType::F32, &dev).unwrap();
    assert_eq!(taken(&empty, Kind::Sums)[1..], [0.0; WORDS - 1]);
}

/// Values taken together (every chunk of every value a job for any core)
/// get each the fingerprint it gets alone, in order, for both kinds: a
/// parameter-like list of small and multi-chunk values, a strided view, an
/// empty value, a value not compared, integer and half dtypes, and an
/// 8-bit float (no bytes to hash: the checksum, whatever the kind).
#[test]
fn values_taken_together_get_each_its_own_fingerprint() {
    let dev = Device::Cpu;
    let m = ramp(3 * CHUNK).reshape((3 * CHUNK / 128, 128)).unwrap();
    let values = [
        ramp(256),
        m.clone(),
        m.t().unwrap(),
        Tensor::zeros((0, 4), DType::F16, &dev).unwrap(),
        m.to_dtype(DType::BF16).unwrap().narrow(1, 3, 50).unwrap(),
        m.affine(3.0, 7.0).unwrap().to_dtype(DType::U32).unwrap(),
        ramp(3).to_dtype(DType::F64).unwrap(),
        ramp(1000).to_dtype(DType::F8E4M3).unwrap(),
    ];
    for kind in [Kind::Bits, Kind::Sums] {
        let mut asked: Vec<Option<&Tensor>> = values.iter().map(Some).collect();
        asked.insert(3, None);
        let all = of_all(&asked, kind).unwrap()[0].to_vec1::<f64>().unwrap();
        assert_eq!(all.len(), asked.len() * WORDS);
        for (k, v) in asked.iter().enumerate() {
            let alone = v.map_or(vec![0.0; WORDS], |t| taken(t, kind));
            assert_eq!(
                &all[k * WORDS..][..WORDS],
                alone.as_slice(),
                "{kind:?}, value {k}"
            );
        }
        let f8 = taken(&values[7], kind);
        assert_eq!(
            f8,
            words(&values[7]),
            "{kind:?}: an 8-bit float gets the checksum"
        );
        // Alone, a small value is taken on this thread, a large one on
        // every core: the same as with others.
        assert_ne!(taken(&values[0], kind), taken(&values[6], kind));
    }
}

/// `cargo test -p remat-runtime --release -- --ignored checksum_speed
/// --nocapture`: nanoseconds per element of the checksum, of the digest of
/// a value compared bit for bit, and of candle's `sum_all` on the same
/// tensor.
#[test]
#[ignore]
fn checksum_speed() {
    let t = Tensor::randn(0f32, 1.0, (4 << 20,), &Device::Cpu).unwrap();
    let _ = of(&t).unwrap();
    let start = std::time::Instant::now();
    for _ in 0..20 {
        let _ = of(&t).unwrap();
    }
    let ns = start.elapsed().as_nanos() as f64 / 20.0 / (4 << 20) as f64;
    let start = std::time::Instant::now();
    for _ in 0..20 {
        let _ = t.sum_all().unwrap();
    }
    let sum = start.elapsed().as_nanos() as f64 / 20.0 / (4 << 20) as f64;
    let _ = of_all(&[Some(&t)], Kind::Bits).unwrap();
    let start = std::time::Instant::now();
    for _ in 0..20 {
        let _ = of_all(&[Some(&t)], Kind::Bits).unwrap();
    }
    let digest = start.elapsed().as_nanos() as f64 / 20.0 / (4 << 20) as f64;
    let _ = of_all(&[Some(&t)], Kind::Sums).unwrap();
    let start = std::time::Instant::now();
    for _ in 0..20 {
        let _ = of_all(&[Some(&t)], Kind::Sums).unwrap();
    }
    let summed = start.elapsed().as_nanos() as f64 / 20.0 / (4 << 20) as f64;
    println!(
        "checksum {ns:.3} ns/element; digest {digest:.3}; digest and sums {summed:.3}; candle sum_all {sum:.3}"
    );
    // The cost of one call, on a bias-sized value.
    let small = Tensor::randn(0f32, 1.0, (256,), &Device::Cpu).unwrap();
    let start = std::time::Instant::now();
    for _ in 0..10_000 {
        let _ = of(&small).unwrap();
    }
    let call = start.elapsed().as_nanos() as f64 / 10_000.0;
    println!("checksum of 256 elements: {:.1} us per call", call / 1e3);
}

/// The kernels' source itself (`checksum.cu`), compiled for the host by
/// g++ with `host/shim.h` (each block's threads as POSIX threads at a
/// barrier, every intrinsic the operation it names, no fused multiply-add)
/// and run over values written to files: it gives the CPU path's bits for
/// every dtype, view and size around a chunk's edges. What remains for a
/// GPU to show is nvcc's code and the launches (tests/cuda.rs).
#[test]
fn the_kernel_source_on_host_threads_gives_the_cpu_bits() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/tape/checksum");
    let dir = std::env::temp_dir().join(format!("remat-checksum-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("kernels");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let built = std::process::Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O1",
            "-ffp-contract=off",
            "-pthread",
            "-include",
        ])
        .arg(here.join("host/shim.h"))
        .arg(here.join("host/main.cpp"))
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("this test needs a C++ compiler ({cxx}): {e}"));
    assert!(built.success(), "{cxx} failed on checksum.cu");

    let m = ramp(3 * CHUNK / 2).affine(50.0, 0.0).unwrap();
    let mut values: Vec<Tensor> = Vec::new();
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::U8,
        DType::U32,
        DType::I16,
        DType::I32,
        DType::I64,
    ] {
        let t = match dtype.is_float() {
            true => m.to_dtype(dtype).unwrap(),
            false => m.affine(2.0, 101.0).unwrap().to_dtype(dtype).unwrap(),
        };
        let grid = t.reshape((3 * CHUNK / 256, 128)).unwrap();
        values.extend([
            t.narrow(0, 0, 1).unwrap(),
            t.narrow(0, 5, LANES * SPAN + 3).unwrap(),
            t.narrow(0, 0, CHUNK).unwrap(),
            t.clone(),
            grid.t().unwrap(),
            grid.narrow(1, 5, 100).unwrap(),
            grid.narrow(0, 3, 1)
                .unwrap()
                .broadcast_as((4, 128))
                .unwrap(),
        ]);
    }
    // More chunks than the combine kernel has lanes.
    values.push(ramp((LANES + 3) * CHUNK + 5));
    // Subnormal, infinite and NaN halves and floats.
    let special = Tensor::new(
        &[1e-6f32, -3e-8, f32::INFINITY, f32::NAN, -0.0, 65504.0],
        &Device::Cpu,
    )
    .unwrap();
    values.extend([
        special.clone(),
        special.to_dtype(DType::F16).unwrap(),
        special.to_dtype(DType::BF16).unwrap(),
    ]);

    let mut files = Vec::new();
    for (i, t) in values.iter().enumerate() {
        let path = dir.join(format!("{i}.bin"));
        std::fs::write(&path, value_file(t)).unwrap();
        files.push(path);
    }
    let lines = lines_of(std::process::Command::new(&exe).args(&files));
    assert_eq!(lines.len(), values.len());
    for (t, line) in values.iter().zip(&lines) {
        assert_eq!(
            line,
            &hex(&words(t)),
            "{:?} {:?} {:?}",
            t.dtype(),
            t.dims(),
            t.stride()
        );
    }

    // The batch kernels over the same values, with values not compared
    // among them, each launch's parameter packed by the launcher's own
    // `launches` and `Batch::pack` (addresses: offsets into one blob of the
    // storages' bytes): each member gives the CPU's bits.
    let mut asked: Vec<Option<&Tensor>> = values.iter().map(Some).collect();
    asked.insert(3, None);
    asked.insert(40, None);
    asked.push(None);
    let mut blob: Vec<u8> = Vec::new();
    let mut placed = Vec::new();
    for v in &asked {
        placed.push(v.map(|t| {
            while blob.len() % 16 != 0 {
                blob.push(0);
            }
            let at = blob.len() + t.layout().start_offset() * t.dtype().size_in_bytes();
            blob.extend(storage_bytes(t));
            (at as u64, t.layout())
        }));
    }
    std::fs::write(dir.join("blob.bin"), &blob).unwrap();
    let dtypes: Vec<Option<DType>> = asked.iter().map(|v| v.map(|t| t.dtype())).collect();
    let mut seen = 0;
    for (l, launch) in device::launches(&dtypes).iter().enumerate() {
        let (batch, _) = device::Batch::pack(launch, &placed);
        let parameter = dir.join(format!("launch-{l}.bin"));
        std::fs::write(&parameter, batch.to_bytes()).unwrap();
        let kind = launch.dtype.and_then(device::kernel_name).unwrap_or("f32");
        let lines = lines_of(
            std::process::Command::new(&exe)
                .arg("--packed")
                .arg(kind)
                .arg(&parameter)
                .arg(dir.join("blob.bin")),
        );
        assert_eq!(lines.len(), launch.members.len());
        for (&i, line) in launch.members.iter().zip(&lines) {
            let cpu = asked[i].map_or(vec![0.0; WORDS], words);
            assert_eq!(line, &hex(&cpu), "batch member {i}");
            seen += 1;
        }
    }
    assert_eq!(seen, asked.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The lines `host/main.cpp` prints, one checksum each.
fn lines_of(command: &mut std::process::Command) -> Vec<String> {
    let out = command.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

/// A checksum as `host/main.cpp` prints it: four words' bits in hex.
fn hex(words: &[f64]) -> String {
    let words: Vec<String> = words
        .iter()
        .map(|w| format!("{:016x}", w.to_bits()))
        .collect();
    words.join(" ")
}

/// A CPU tensor's whole storage, little-endian.
fn storage_bytes(t: &Tensor) -> Vec<u8> {
    let (storage, _) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        unreachable!()
    };
    macro_rules! le {
        ($d:expr) => {
            $d.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()
        };
    }
    use candle_core::CpuStorage as S;
    match cpu {
        S::F32(d) => le!(d),
        S::F16(d) => le!(d),
        S::BF16(d) => le!(d),
        S::F64(d) => le!(d),
        S::U8(d) => d.clone(),
        S::U32(d) => le!(d),
        S::I16(d) => le!(d),
        S::I32(d) => le!(d),
        S::I64(d) => le!(d),
        _ => unreachable!(),
    }
}

/// A value as `host/main.cpp` reads it: the kernel's dtype name, n, dims
/// and strides (none for a contiguous value, as candle launches it), start
/// offset, the storage's bytes.
fn value_file(t: &Tensor) -> Vec<u8> {
    let word = |f: &mut Vec<u8>, x: usize| f.extend((x as u64).to_le_bytes());
    let mut f = Vec::new();
    let mut padded = [0u8; 8];
    let name = device::kernel_name(t.dtype()).unwrap();
    padded[..name.len()].copy_from_slice(name.as_bytes());
    f.extend(padded);
    let layout = t.layout();
    word(&mut f, layout.shape().elem_count());
    let strided = !layout.is_contiguous();
    word(&mut f, if strided { layout.dims().len() } else { 0 });
    if strided {
        layout
            .dims()
            .iter()
            .chain(layout.stride())
            .for_each(|&x| word(&mut f, x));
    }
    word(&mut f, layout.start_offset());
    let bytes = storage_bytes(t);
    word(&mut f, bytes.len());
    f.extend(bytes);
    f
}

#[test]
fn launches_take_a_dtype_at_a_time_sixteen_values_at_most() {
    use device::{launches, BATCH};
    let mut dtypes = vec![Some(DType::F32), None, Some(DType::BF16)];
    dtypes.extend(std::iter::repeat_n(Some(DType::F32), 20));
    dtypes.push(None);
    let l = launches(&dtypes);
    assert_eq!(l.len(), 3);
    assert_eq!(l[0].dtype, Some(DType::F32));
    assert_eq!(l[0].members.len(), BATCH);
    assert_eq!(&l[0].members[..3], &[0, 3, 4]);
    assert_eq!(l[1].dtype, Some(DType::F32));
    assert_eq!(l[1].members, vec![18, 19, 20, 21, 22, 1, 23]);
    assert_eq!(l[2].dtype, Some(DType::BF16));
    assert_eq!(l[2].members, vec![2]);
    // Every value in exactly one launch.
    let mut all: Vec<usize> = l.iter().flat_map(|l| l.members.clone()).collect();
    all.sort();
    assert_eq!(all, (0..dtypes.len()).collect::<Vec<_>>());
    // Only values not compared: one launch of its own.
    let only = launches(&[None, None]);
    assert_eq!(
        only,
        vec![device::Launch {
            dtype: None,
            members: vec![0, 1]
        }]
    );
    assert!(launches(&[]).is_empty());
}

#[test]
fn of_all_gives_each_values_checksum_in_order() {
    let dev = Device::Cpu;
    let m = ramp(3 * CHUNK).reshape((3 * CHUNK / 128, 128)).unwrap();
    let values = [
        m.clone(),
        m.t().unwrap(),
        m.to_dtype(DType::BF16).unwrap().narrow(1, 3, 50).unwrap(),
        Tensor::zeros((0, 4), DType::F16, &dev).unwrap(),
        m.to_dtype(DType::F64).unwrap(),
        m.affine(3.0, 7.0).unwrap().to_dtype(DType::U32).unwrap(),
    ];
    let mut asked: Vec<Option<&Tensor>> = values.iter().map(Some).collect();
    asked.insert(2, None);
    let parts = of_all(&asked, Kind::Checksum).unwrap();
    assert_eq!(parts.len(), 1);
    let all = parts[0].to_vec1::<f64>().unwrap();
    assert_eq!(all.len(), asked.len() * WORDS);
    for (k, v) in asked.iter().enumerate() {
        let expected = v.map_or(vec![0.0; WORDS], words);
        let got = &all[k * WORDS..][..WORDS];
        assert_eq!(
            got.iter().map(|w| w.to_bits()).collect::<Vec<_>>(),
            expected.iter().map(|w| w.to_bits()).collect::<Vec<_>>(),
            "value {k}"
        );
    }
    assert!(of_all(&[], Kind::Checksum).unwrap().is_empty());
}
