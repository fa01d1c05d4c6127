// A bias over the rows of a (rows, n) matrix, contiguous: added in place
// (the forward of a linear layer), and its gradient, the sum of the rows
// (in f32, in chunks of BIAS_CHUNK rows, summed over the chunks by the
// caller). One thread per feature, rows in order: neighbouring threads
// read neighbouring elements, and every sum runs in a fixed order.
#include "elements.cuh"

#define BIAS_CHUNK 64

// y[r][j] += b[j] (in f32, rounded once) for the rows of chunk blockIdx.y.
template <typename T>
__device__ void bias_add(int rows, int n, T *y, const T *b) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float bj = load(b[j]);
  int end = min((int)(blockIdx.y + 1) * BIAS_CHUNK, rows);
  for (int r = blockIdx.y * BIAS_CHUNK; r < end; r++) {
    T *at = y + (long long)r * n + j;
    *at = store<T>(load(*at) + bj);
  }
}

// sums[chunk][j] = the sum of x[r][j] over the rows of chunk blockIdx.y.
template <typename T>
__device__ void column_sums(int rows, int n, const T *x, float *sums) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float s = 0.f;
  int end = min((int)(blockIdx.y + 1) * BIAS_CHUNK, rows);
  for (int r = blockIdx.y * BIAS_CHUNK; r < end; r++) s += load(x[(long long)r * n + j]);
  sums[(long long)blockIdx.y * n + j] = s;
}

#define BIAS_KERNELS(T, NAME)                                                                    \
  extern "C" __global__ void bias_add_##NAME(int rows, int n, T *y, const T *b) {               \
    bias_add<T>(rows, n, y, b);                                                                  \
  }                                                                                              \
  extern "C" __global__ void column_sums_##NAME(int rows, int n, const T *x, float *sums) {      \
    column_sums<T>(rows, n, x, sums);                                                            \
  }

BIAS_KERNELS(float, f32)
BIAS_KERNELS(__half, f16)
BIAS_KERNELS(bf16_t, bf16)
