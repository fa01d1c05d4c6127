//! A matrix gradient summed over chunks of rows, in place where the device
//! allows it: `sum += factor aᵀ b`.

use candle_core::{DType, Device, Result, Storage, Tensor};
use gemm::Parallelism;

/// `Σ factor aᵀ b` over chunks of rows (`a` `(rows, m)`, `b` `(rows, n)`): a
/// weight's gradient summed over chunks of tokens, as
/// [`super::linear_cross_entropy`] sums its head's.
///
/// On the CPU, in `f32` and `f64`, the sum is one buffer that each chunk's
/// product is added into by the matrix product itself (gemm reading its
/// destination): no `(m, n)` tensor is made per chunk. Made with candle's
/// ops instead (a product, then a sum), each chunk would allocate two:
/// at a vocabulary of 151,936 and a width of 896, 1 GiB of fresh memory
/// per chunk, which the allocator takes from and gives back to the system
/// every time. Elsewhere (CUDA, other dtypes), candle's product and sum.
pub(super) enum ProductSum {
    /// On the CPU: row-major `(m, n)`.
    F32(Vec<f32>, usize, usize),
    /// On the CPU: row-major `(m, n)`.
    F64(Vec<f64>, usize, usize),
    /// On another device or in another dtype.
    Tensor(Tensor),
}

impl ProductSum {
    /// A sum of zeros, `(m, n)`.
    pub fn zeros(m: usize, n: usize, dtype: DType, device: &Device) -> Result<Self> {
        Ok(match (device, dtype) {
            (Device::Cpu, DType::F32) => ProductSum::F32(vec![0.0; m * n], m, n),
            (Device::Cpu, DType::F64) => ProductSum::F64(vec![0.0; m * n], m, n),
            _ => ProductSum::Tensor(Tensor::zeros((m, n), dtype, device)?),
        })
    }

    /// Adds `factor aᵀ b`: `a` `(rows, m)` and `b` `(rows, n)`, of the
    /// sum's dtype and device.
    pub fn add(&mut self, a: &Tensor, b: &Tensor, factor: f64) -> Result<()> {
        match self {
            ProductSum::F32(sum, m, n) => add_on_host(sum, *m, *n, a, b, factor as f32),
            ProductSum::F64(sum, m, n) => add_on_host(sum, *m, *n, a, b, factor),
            ProductSum::Tensor(sum) => {
                *sum = (&*sum + (a.t()?.matmul(b)? * factor)?)?;
                Ok(())
            }
        }
    }

    /// The sum as a tensor (the buffer itself, not a copy).
    pub fn into_tensor(self) -> Result<Tensor> {
        match self {
            ProductSum::F32(sum, m, n) => Tensor::from_vec(sum, (m, n), &Device::Cpu),
            ProductSum::F64(sum, m, n) => Tensor::from_vec(sum, (m, n), &Device::Cpu),
            ProductSum::Tensor(sum) => Ok(sum),
        }
    }
}

/// `sum += factor aᵀ b` with one gemm call, `sum` row-major `(m, n)`.
fn add_on_host<T>(
    sum: &mut [T],
    m: usize,
    n: usize,
    a: &Tensor,
    b: &Tensor,
    factor: T,
) -> Result<()>
where
    T: HostFloat,
{
    let rows = a.dim(0)?;
    if a.dims() != [rows, m] || b.dims() != [rows, n] {
        candle_core::bail!(
            "remat nn: a product sum of shape ({m}, {n}) cannot add aᵀ b for a {:?} and b {:?}",
            a.dims(),
            b.dims()
        );
    }
    if rows == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let (a_storage, a_layout) = a.storage_and_layout();
    let (b_storage, b_layout) = b.storage_and_layout();
    let (Storage::Cpu(a_cpu), Storage::Cpu(b_cpu)) = (&*a_storage, &*b_storage) else {
        candle_core::bail!(
            "remat nn: a product sum on the CPU was given tensors on another device"
        );
    };
    let (a_start, a_end) = a_layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("remat nn: a is not contiguous".into()))?;
    let (b_start, b_end) = b_layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("remat nn: b is not contiguous".into()))?;
    let a = &T::cpu_storage_as_slice(a_cpu)?[a_start..a_end];
    let b = &T::cpu_storage_as_slice(b_cpu)?[b_start..b_end];
    if a.len() != rows * m || b.len() != rows * n || sum.len() != m * n {
        candle_core::bail!("remat nn: a product sum's operands do not have their shapes' lengths");
    }
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: gemm reads `m x rows` elements of its left operand, `rows x
    // n` of its right one and reads and writes `m x n` of its destination,
    // at the strides given. The destination is `sum`, a mutable slice of
    // exactly `m * n` elements (checked above), row-major: element (i, j)
    // at `i * n + j` (row stride n, column stride 1). The left operand is
    // `aᵀ`, its element (i, p) being `a`'s (p, i) at `p * m + i` (row
    // stride 1, column stride m), inside `a`'s `rows * m` elements. The
    // right operand is `b`, element (p, j) at `p * n + j`, inside its
    // `rows * n`. `a` and `b` are slices of tensor storages whose read
    // guards live across the call, so they stay valid and unchanged;
    // `sum` is borrowed mutably here, so it aliases neither. `T` is `f32`
    // or `f64`, which gemm supports.
    unsafe {
        gemm::gemm(
            m,
            n,
            rows,
            sum.as_mut_ptr(),
            1,
            n as isize,
            true,
            a.as_ptr(),
            m as isize,
            1,
            b.as_ptr(),
            1,
            n as isize,
            T::ONE,
            factor,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

/// The dtypes of [`ProductSum`]'s host buffers.
trait HostFloat: candle_core::WithDType {
    const ONE: Self;
}

impl HostFloat for f32 {
    const ONE: Self = 1.0;
}

impl HostFloat for f64 {
    const ONE: Self = 1.0;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Σ aᵀ b` over chunks by hand, in f64.
    fn by_hand(chunks: &[(Tensor, Tensor)], m: usize, n: usize) -> Vec<f64> {
        let mut sum = vec![0f64; m * n];
        for (a, b) in chunks {
            let a = a.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
            let b = b.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
            for (ra, rb) in a.iter().zip(&b) {
                for i in 0..m {
                    for j in 0..n {
                        sum[i * n + j] += ra[i] * rb[j];
                    }
                }
            }
        }
        sum
    }

    fn values(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// The host buffer (gemm reading its destination) and candle's product
    /// and sum (the path of other devices, run here on the CPU) give the
    /// sum by hand, over chunks of several sizes (one empty), from views
    /// (a transposed `a`, a narrowed `b`).
    #[test]
    fn both_paths_sum_the_products_of_every_chunk() {
        let dev = Device::Cpu;
        let (m, n) = (37, 19);
        for dtype in [DType::F32, DType::F64] {
            let chunks: Vec<(Tensor, Tensor)> = [5usize, 0, 64, 1]
                .iter()
                .enumerate()
                .map(|(s, &rows)| {
                    let a = Tensor::randn(0f32, 1.0, (m, rows), &dev)
                        .unwrap()
                        .t()
                        .unwrap();
                    let b = Tensor::randn(0f32, 1.0, (rows, n + 3), &dev)
                        .unwrap()
                        .narrow(1, s % 3, n)
                        .unwrap();
                    (a.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap())
                })
                .collect();
            let want = by_hand(&chunks, m, n);
            let host = ProductSum::zeros(m, n, dtype, &dev).unwrap();
            assert!(matches!(host, ProductSum::F32(..) | ProductSum::F64(..)));
            let device = ProductSum::Tensor(Tensor::zeros((m, n), dtype, &dev).unwrap());
            for mut sum in [host, device] {
                for (a, b) in &chunks {
                    sum.add(a, b, 0.75).unwrap();
                }
                let got: Vec<f64> = values(&sum.into_tensor().unwrap())
                    .iter()
                    .map(|x| x / 0.75)
                    .collect();
                let scale = want.iter().fold(0f64, |x, y| x.max(y.abs()));
                let err = got
                    .iter()
                    .zip(&want)
                    .fold(0f64, |e, (g, w)| e.max((g - w).abs() / scale));
                // f32: 70 products of unit normals per element, each
                // rounded once or twice: well under 1e-6 of the largest.
                let tol = if dtype == DType::F32 { 1e-6 } else { 1e-14 };
                assert!(err <= tol, "{dtype:?}: {err:e}");
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_an_error() {
        let dev = Device::Cpu;
        let mut sum = ProductSum::zeros(3, 2, DType::F32, &dev).unwrap();
        let a = Tensor::zeros((4, 3), DType::F32, &dev).unwrap();
        let b = Tensor::zeros((5, 2), DType::F32, &dev).unwrap();
        assert!(sum.add(&a, &b, 1.0).is_err());
    }
}
