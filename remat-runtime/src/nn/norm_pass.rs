//! Layer norm and RMS norm over the rows of a `(rows, C)` CPU tensor in one
//! pass each way: the forward gives the normalized rows and each row's mean
//! and `1 / std`, the backward the gradients of the rows, the gain and the
//! bias, without the `(rows, C)` temporaries of the composed ops (a centred
//! copy, its square, the normalized rows, their products with the
//! gradient). The same contract as `kernels/norm.cu` on CUDA.
//!
//! Every element is computed in f64 and rounded to its dtype (the
//! gradients of bf16/f16 rows and parameters to f32, the work dtype, then
//! by the caller to theirs); a row's
//! statistics are computed in f64 and kept in the norm's work dtype (f32
//! for bf16 and f16, the input's otherwise), and the rows are normalized
//! from the kept values, so that a recompute from them gives the forward's
//! bits. The gain's and bias's gradients sum blocks of rows in f64, the
//! blocks fixed by the shape (not by the threads), added in order: the
//! same bits on any machine.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Result, Tensor, WithDType};
use half::{bf16, f16};
use rayon::prelude::*;

/// The dtype a norm computes in: `f32` for bf16 and f16, whose 8 or 11
/// bits lose a row's statistics (as candle's kernels do), the input's
/// otherwise. The graph still keeps the input as it is; the row
/// statistics, one or two numbers per row, are kept in this dtype.
pub(super) fn work_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        other => other,
    }
}

/// Whether the rows of `x` `(rows, C)` can be normalized here: on the CPU,
/// a float dtype of 16 to 64 bits, `gain` (and `bias`) `(C)` of a float
/// dtype on the CPU.
pub(super) fn fit(x: &Tensor, gain: &Tensor, bias: Option<&Tensor>) -> bool {
    let float = |t: &Tensor| {
        matches!(
            t.dtype(),
            DType::F32 | DType::F64 | DType::BF16 | DType::F16
        )
    };
    let param = |p: &Tensor| p.device().is_cpu() && float(p) && p.dims() == [x.dims()[1]];
    x.device().is_cpu()
        && float(x)
        && x.rank() == 2
        && x.dims()[1] >= 1
        && param(gain)
        && bias.is_none_or(param)
}

/// The rows of `x` normalized (layer norm with a `bias`, RMS norm without),
/// times the gain, plus the bias, in `x`'s dtype; each row's mean (0 for
/// RMS) and `1 / std`, `(rows, 1)` in the work dtype.
pub(super) fn forward(
    x: &Tensor,
    gain: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let x = x.contiguous()?;
    let (rows, c) = x.dims2()?;
    let (g, b) = (f64s(gain)?, bias.map(f64s).transpose()?);
    let work = work_dtype(x.dtype());
    let (storage, layout) = x.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("remat nn: the norm's CPU pass on another device")
    };
    let (start, end) = layout
        .contiguous_offsets()
        .expect("a contiguous tensor has contiguous offsets");
    let rows_of = Rows { c, eps, work };
    let (g, b) = (g.as_slice(), b.as_deref());
    let (y, stats) = match cpu {
        CpuStorage::F32(d) => rows_of.normalize(&d[start..end], g, b)?,
        CpuStorage::F64(d) => rows_of.normalize(&d[start..end], g, b)?,
        CpuStorage::BF16(d) => rows_of.normalize(&d[start..end], g, b)?,
        CpuStorage::F16(d) => rows_of.normalize(&d[start..end], g, b)?,
        other => candle_core::bail!("remat nn: the norm's CPU pass over {:?}", other.dtype()),
    };
    let (mean, rstd): (Vec<f64>, Vec<f64>) = stats.into_iter().unzip();
    let column =
        |v: Vec<f64>| Tensor::from_vec(v, (rows, 1), &candle_core::Device::Cpu)?.to_dtype(work);
    Ok((y, column(mean)?, column(rstd)?))
}

/// The gradients of `x` `(rows, C)`, of the gain and of the bias (`(C)`;
/// zeros for RMS), in the work dtype, for the gradient `dy` of
/// [`forward`]'s output, from the rows' kept `mean` and `rstd`.
pub(super) fn backward(
    x: &Tensor,
    gain: &Tensor,
    dy: &Tensor,
    (mean, rstd): (&Tensor, &Tensor),
    layer: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let x = x.contiguous()?;
    let (rows, c) = x.dims2()?;
    let work = work_dtype(x.dtype());
    // dy in x's dtype, or in the work dtype (a caller's f32 gradient of
    // bf16 rows, or any other dtype converted to it).
    let dy = if dy.dtype() == x.dtype() || dy.dtype() == work {
        dy.contiguous()?
    } else {
        dy.to_dtype(work)?
    };
    let g = f64s(gain)?;
    let (mean, rstd) = (f64s(&mean.flatten_all()?)?, f64s(&rstd.flatten_all()?)?);
    let stats: Vec<(f64, f64)> = mean
        .iter()
        .zip(&rstd)
        .map(|(&m, &r)| (if layer { m } else { 0.0 }, r))
        .collect();
    let pass = Pass {
        c,
        layer,
        g: &g,
        stats: &stats,
    };
    let (xs, xl) = x.storage_and_layout();
    let (ds, dl) = dy.storage_and_layout();
    let (candle_core::Storage::Cpu(xs), candle_core::Storage::Cpu(ds)) = (&*xs, &*ds) else {
        candle_core::bail!("remat nn: the norm's CPU pass on another device")
    };
    let ((x0, x1), (d0, d1)) = (
        xl.contiguous_offsets().expect("contiguous"),
        dl.contiguous_offsets().expect("contiguous"),
    );
    let (x, d) = (x0..x1, d0..d1);
    let (dx, dg, db) = match (xs, ds) {
        (CpuStorage::F32(xs), CpuStorage::F32(ds)) => {
            pass.grads::<f32, f32, f32>(&xs[x], &ds[d])?
        }
        (CpuStorage::F64(xs), CpuStorage::F64(ds)) => {
            pass.grads::<f64, f64, f64>(&xs[x], &ds[d])?
        }
        (CpuStorage::BF16(xs), CpuStorage::BF16(ds)) => {
            pass.grads::<bf16, bf16, f32>(&xs[x], &ds[d])?
        }
        (CpuStorage::BF16(xs), CpuStorage::F32(ds)) => {
            pass.grads::<bf16, f32, f32>(&xs[x], &ds[d])?
        }
        (CpuStorage::F16(xs), CpuStorage::F16(ds)) => {
            pass.grads::<f16, f16, f32>(&xs[x], &ds[d])?
        }
        (CpuStorage::F16(xs), CpuStorage::F32(ds)) => {
            pass.grads::<f16, f32, f32>(&xs[x], &ds[d])?
        }
        (x, d) => candle_core::bail!(
            "remat nn: the norm's CPU backward over {:?} rows and a {:?} gradient",
            x.dtype(),
            d.dtype()
        ),
    };
    let dev = candle_core::Device::Cpu;
    Ok((
        dx.reshape((rows, c))?,
        Tensor::from_vec(dg, c, &dev)?.to_dtype(work)?,
        Tensor::from_vec(db, c, &dev)?.to_dtype(work)?,
    ))
}

/// A tensor's elements as f64 (a gain, a bias, a row statistic: `C` or
/// `rows` of them).
fn f64s(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// `v` as the work dtype keeps it.
fn kept(v: f64, work: DType) -> f64 {
    match work {
        DType::F32 => v as f32 as f64,
        _ => v,
    }
}

/// The forward over rows of `c` elements.
struct Rows {
    c: usize,
    eps: f64,
    work: DType,
}

impl Rows {
    /// The rows normalized, `(rows, C)`, and each row's (mean, rstd) as
    /// kept (mean 0 without a bias: RMS).
    fn normalize<T: WithDType>(
        &self,
        x: &[T],
        g: &[f64],
        b: Option<&[f64]>,
    ) -> Result<(Tensor, Vec<(f64, f64)>)> {
        let c = self.c;
        let n = c as f64;
        let mut y = vec![T::zero(); x.len()];
        let mut stats = vec![(0.0, 0.0); x.len() / c];
        let block = TASK_ROWS * c;
        y.par_chunks_mut(block)
            .zip(x.par_chunks(block))
            .zip(stats.par_chunks_mut(TASK_ROWS))
            .for_each(|((y, x), stats)| {
                let mut row64 = vec![0.0; c];
                for ((out, row), stat) in y.chunks_mut(c).zip(x.chunks(c)).zip(stats) {
                    for (r, v) in row64.iter_mut().zip(row) {
                        *r = v.to_f64();
                    }
                    let (mean, square) = match b {
                        Some(_) => {
                            let mean = sum(&row64, |v| v) / n;
                            (mean, sum(&row64, |v| (v - mean) * (v - mean)) / n)
                        }
                        None => (0.0, sum(&row64, |v| v * v) / n),
                    };
                    let (mean, rstd) = (
                        kept(mean, self.work),
                        kept(1.0 / (square + self.eps).sqrt(), self.work),
                    );
                    *stat = (mean, rstd);
                    match b {
                        Some(b) => {
                            for (((o, &v), &g), &b) in out.iter_mut().zip(&row64).zip(g).zip(b) {
                                *o = T::from_f64((v - mean) * rstd * g + b);
                            }
                        }
                        None => {
                            for ((o, &v), &g) in out.iter_mut().zip(&row64).zip(g) {
                                *o = T::from_f64(v * rstd * g);
                            }
                        }
                    }
                }
            });
        let rows = stats.len();
        Ok((
            Tensor::from_vec(y, (rows, c), &candle_core::Device::Cpu)?,
            stats,
        ))
    }
}

/// Rows a task of the forward takes.
const TASK_ROWS: usize = 16;

/// `Σ f(v)` over `xs` in eight independent sums (so that the compiler
/// vectorises them), added in a fixed order: the same bits on any machine.
#[inline(always)]
fn sum(xs: &[f64], f: impl Fn(f64) -> f64) -> f64 {
    let mut acc = [0.0; 8];
    let mut chunks = xs.chunks_exact(8);
    for chunk in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a += f(v);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| f(v)).sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// The backward over rows of `c` elements.
struct Pass<'a> {
    c: usize,
    layer: bool,
    g: &'a [f64],
    /// Per row: (mean, rstd) as kept (mean 0 for RMS).
    stats: &'a [(f64, f64)],
}

/// `Σ a_i b_i` in eight independent sums, added in a fixed order.
#[inline(always)]
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0; 8];
    let (mut ca, mut cb) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Rows per block of the gain's and bias's gradient sums: the blocks are
/// summed in order, so their number is fixed by the shape alone.
fn block_rows(rows: usize) -> usize {
    rows.div_ceil(32).max(16)
}

impl Pass<'_> {
    /// `dx` in `W` (flat), the gain's and the bias's gradients.
    fn grads<T: WithDType, U: WithDType, W: WithDType>(
        &self,
        x: &[T],
        dy: &[U],
    ) -> Result<(Tensor, Vec<f64>, Vec<f64>)> {
        let c = self.c;
        let rows = self.stats.len();
        let block = block_rows(rows) * c;
        let mut dx = vec![W::zero(); x.len()];
        let partial: Vec<(Vec<f64>, Vec<f64>)> = dx
            .par_chunks_mut(block)
            .zip(x.par_chunks(block))
            .zip(dy.par_chunks(block))
            .zip(self.stats.par_chunks(block / c))
            .map(|(((dx, x), dy), stats)| {
                let (mut dg, mut db) = (vec![0.0; c], vec![0.0; c]);
                let (mut xh, mut d, mut dxh) = (vec![0.0; c], vec![0.0; c], vec![0.0; c]);
                for (((dx, x), dy), &(mean, rstd)) in dx
                    .chunks_mut(c)
                    .zip(x.chunks(c))
                    .zip(dy.chunks(c))
                    .zip(stats)
                {
                    for ((((xh, d), dxh), (x, dy)), &g) in xh
                        .iter_mut()
                        .zip(d.iter_mut())
                        .zip(dxh.iter_mut())
                        .zip(x.iter().zip(dy))
                        .zip(self.g)
                    {
                        *xh = (x.to_f64() - mean) * rstd;
                        *d = dy.to_f64();
                        *dxh = *d * g;
                    }
                    let n = c as f64;
                    let proj = dot(&dxh, &xh) / n;
                    let dm = if self.layer {
                        sum(&dxh, |v| v) / n
                    } else {
                        0.0
                    };
                    for ((dx, &dxh), &xh) in dx.iter_mut().zip(&dxh).zip(&xh) {
                        *dx = W::from_f64((dxh - xh * proj - dm) * rstd);
                    }
                    for (((dg, db), &d), &xh) in dg.iter_mut().zip(db.iter_mut()).zip(&d).zip(&xh) {
                        *dg += d * xh;
                        *db += d;
                    }
                }
                (dg, db)
            })
            .collect();
        let (mut dg, mut db) = (vec![0.0; c], vec![0.0; c]);
        for (g, b) in &partial {
            for i in 0..c {
                dg[i] += g[i];
                db[i] += b[i];
            }
        }
        if !self.layer {
            db.iter_mut().for_each(|v| *v = 0.0);
        }
        let n = dx.len();
        Ok((Tensor::from_vec(dx, n, &candle_core::Device::Cpu)?, dg, db))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The pass against the composed norm written out in f64, for layer
    /// and RMS norm, in every dtype, over rows that cancel (a large mean,
    /// a small spread): outputs, statistics, and the three gradients.
    #[test]
    fn one_pass_norms_match_the_composed_norm_in_f64() {
        let dev = Device::Cpu;
        let (rows, c) = (70, 48);
        let lcg = |n: usize, seed: u64| -> Vec<f64> {
            let mut s = seed;
            (0..n)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
                })
                .collect()
        };
        let xs: Vec<f64> = lcg(rows * c, 1).iter().map(|v| 50.0 + v).collect();
        let (gs, bs, dys) = (lcg(c, 2), lcg(c, 3), lcg(rows * c, 4));
        for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
            for layer in [true, false] {
                let t = |v: &[f64], shape: &[usize]| {
                    Tensor::from_vec(v.to_vec(), shape, &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                let (x, g, b, dy) = (
                    t(&xs, &[rows, c]),
                    t(&gs, &[c]),
                    t(&bs, &[c]),
                    t(&dys, &[rows, c]),
                );
                let bias = layer.then_some(&b);
                let (y, mean, rstd) = forward(&x, &g, bias, 1e-5).unwrap();
                let (dx, dg, db) = backward(&x, &g, &dy, (&mean, &rstd), layer).unwrap();
                // The reference, in f64 on the same (rounded) values.
                let f = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
                let (x64, g64, b64, dy64) = (f(&x), f(&g), f(&b), f(&dy));
                let m = if layer {
                    x64.mean_keepdim(1).unwrap()
                } else {
                    x64.zeros_like().unwrap().narrow(1, 0, 1).unwrap()
                };
                let centred = x64.broadcast_sub(&m).unwrap();
                let r = (centred.sqr().unwrap().mean_keepdim(1).unwrap() + 1e-5)
                    .unwrap()
                    .sqrt()
                    .unwrap()
                    .recip()
                    .unwrap();
                let xhat = centred.broadcast_mul(&r).unwrap();
                let mut y64 = xhat.broadcast_mul(&g64).unwrap();
                if layer {
                    y64 = y64.broadcast_add(&b64).unwrap();
                }
                let dxhat = dy64.broadcast_mul(&g64).unwrap();
                let proj = (&dxhat * &xhat).unwrap().mean_keepdim(1).unwrap();
                let mut dx64 = (&dxhat - xhat.broadcast_mul(&proj).unwrap()).unwrap();
                if layer {
                    dx64 = dx64.broadcast_sub(&dxhat.mean_keepdim(1).unwrap()).unwrap();
                }
                let dx64 = dx64.broadcast_mul(&r).unwrap();
                let dg64 = (&dy64 * &xhat).unwrap().sum(0).unwrap();
                let db64 = dy64.sum(0).unwrap();
                let rel = |a: &Tensor, b: &Tensor| {
                    let d = (f(a) - b)
                        .unwrap()
                        .abs()
                        .unwrap()
                        .max_all()
                        .unwrap()
                        .to_scalar::<f64>()
                        .unwrap();
                    d / b
                        .abs()
                        .unwrap()
                        .max_all()
                        .unwrap()
                        .to_scalar::<f64>()
                        .unwrap()
                        .max(1e-300)
                };
                // Rounding the output once, and the statistics kept in
                // the work dtype (f32 for half types): a few units in the
                // last place of the dtype.
                let tol = match dtype {
                    DType::F64 => 1e-12,
                    DType::F32 => 1e-5,
                    DType::F16 => 2e-3,
                    _ => 1e-2,
                };
                let what = format!("{dtype:?}, layer {layer}");
                assert_eq!(y.dtype(), dtype, "{what}");
                assert!(rel(&y, &y64) < tol, "{what}: y {}", rel(&y, &y64));
                assert!(rel(&rstd, &r) < tol.max(1e-6), "{what}: rstd");
                assert!(rel(&dx, &dx64) < tol, "{what}: dx {}", rel(&dx, &dx64));
                assert!(rel(&dg, &dg64) < tol, "{what}: dg {}", rel(&dg, &dg64));
                if layer {
                    assert!(rel(&db, &db64) < tol, "{what}: db {}", rel(&db, &db64));
                }
                assert_eq!(dx.dtype(), work_dtype(dtype), "{what}");
                // A recompute from the kept statistics gives the forward's bits.
                let (again, _, _) = forward(&x, &g, bias, 1e-5).unwrap();
                assert_eq!(
                    f(&again).to_vec2::<f64>().unwrap(),
                    f(&y).to_vec2::<f64>().unwrap(),
                    "{what}"
                );
            }
        }
    }

    /// `cargo test -p remat-runtime --release --lib -- --ignored
    /// norm_pass_speed --nocapture`: milliseconds of the one pass and of
    /// the composed norm (forward, backward), f32 layer norm.
    #[test]
    #[ignore]
    fn norm_pass_speed() {
        use super::super::norm::{norm_grads, normalize, scale_shift, sum_rows};
        let dev = Device::Cpu;
        for (rows, c) in [(1024, 256), (8192, 768)] {
            let x = Tensor::randn(0f32, 1.0, (rows, c), &dev).unwrap();
            let dy = Tensor::randn(0f32, 1.0, (rows, c), &dev).unwrap();
            let g = Tensor::randn(0f32, 1.0, c, &dev).unwrap();
            let b = Tensor::randn(0f32, 1.0, c, &dev).unwrap();
            let time = |f: &dyn Fn()| {
                f();
                let start = std::time::Instant::now();
                for _ in 0..20 {
                    f();
                }
                start.elapsed().as_secs_f64() * 1e3 / 20.0
            };
            let (_, mean, rstd) = forward(&x, &g, Some(&b), 1e-5).unwrap();
            let pass_f = time(&|| drop(forward(&x, &g, Some(&b), 1e-5).unwrap()));
            let pass_b = time(&|| drop(backward(&x, &g, &dy, (&mean, &rstd), true).unwrap()));
            let comp_f = time(&|| {
                let (xhat, _, _) = normalize(&x, 1e-5).unwrap();
                drop(scale_shift(&xhat, &g, &b).unwrap());
            });
            let comp_b = time(&|| {
                let xhat = x
                    .broadcast_sub(&mean)
                    .unwrap()
                    .broadcast_mul(&rstd)
                    .unwrap();
                drop(norm_grads(&xhat, &rstd, &g, &dy, true).unwrap());
                drop(sum_rows(&dy).unwrap());
            });
            println!(
                "({rows}, {c}): one pass {pass_f:.3} / {pass_b:.3} ms, composed {comp_f:.3} / {comp_b:.3} ms (forward / backward)"
            );
        }
    }
}
