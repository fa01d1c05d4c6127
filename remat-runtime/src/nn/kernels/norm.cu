// The norm in front of a fused op (prenorm.rs), forward and backward, in
// f32 whatever the element type: layer norm (`layer` 1: centered, gain and
// bias) or RMS norm (0: gain only) over rows of `c` contiguous features.
//
//   forward:  y = (x - mean) * rstd * gain (+ bias), and each row's mean (0
//             for RMS) and rstd = 1 / sqrt(var + eps) (var: the mean
//             square for RMS); one warp per row.
//   dx:       xhat = (x - mean) * rstd, dxhat = dy * gain,
//             dx = rstd * (dxhat - xhat * mean(dxhat * xhat) - mean(dxhat))
//             (the last term for layer norm only), f32; one warp per row.
//   columns:  per chunk of NORM_CHUNK rows, the sums of dy * xhat (the
//             gain's gradient) and of dy (the bias's), one thread per
//             feature, rows in order: summed over the chunks by the caller.
// Every sum runs in a fixed order: the same inputs give the same bits.
#include "elements.cuh"

#define NORM_CHUNK 64

// The sum of v over the warp's 32 lanes, in a fixed butterfly order.
__device__ __forceinline__ float warp_sum(float v) {
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

template <typename T>
__device__ void norm_forward(int rows, int c, const T *x, const T *gain, const T *bias, float eps,
                             int layer, T *y, float *mean, float *rstd) {
  int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;  // the whole warp
  const T *xr = x + (long long)row * c;
  float mu = 0.f;
  if (layer) {
    float s = 0.f;
    for (int j = lane; j < c; j += 32) s += load(xr[j]);
    mu = warp_sum(s) / c;
  }
  float v = 0.f;
  for (int j = lane; j < c; j += 32) {
    float d = load(xr[j]) - mu;
    v += d * d;
  }
  float r = 1.f / sqrtf(warp_sum(v) / c + eps);
  T *yr = y + (long long)row * c;
  for (int j = lane; j < c; j += 32) {
    float o = (load(xr[j]) - mu) * r * load(gain[j]);
    yr[j] = store<T>(layer ? o + load(bias[j]) : o);
  }
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = r;
  }
}

template <typename T>
__device__ void norm_backward_dx(int rows, int c, const T *x, const T *gain, const T *dy,
                                 const float *mean, const float *rstd, int layer, float *dx) {
  int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T *xr = x + (long long)row * c, *gr = dy + (long long)row * c;
  float mu = mean[row], r = rstd[row], proj = 0.f, sum = 0.f;
  for (int j = lane; j < c; j += 32) {
    float dxh = load(gr[j]) * load(gain[j]);
    proj += dxh * (load(xr[j]) - mu) * r;
    sum += dxh;
  }
  proj = warp_sum(proj) / c;
  sum = layer ? warp_sum(sum) / c : 0.f;
  float *out = dx + (long long)row * c;
  for (int j = lane; j < c; j += 32) {
    float xh = (load(xr[j]) - mu) * r;
    out[j] = r * (load(gr[j]) * load(gain[j]) - xh * proj - sum);
  }
}

template <typename T>
__device__ void norm_backward_columns(int rows, int c, const T *x, const T *dy, const float *mean,
                                      const float *rstd, float *dgain, float *dbias) {
  int j = blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y;
  if (j >= c) return;
  float g = 0.f, b = 0.f;
  int end = min((chunk + 1) * NORM_CHUNK, rows);
  for (int i = chunk * NORM_CHUNK; i < end; i++) {
    float d = load(dy[(long long)i * c + j]);
    g += d * (load(x[(long long)i * c + j]) - mean[i]) * rstd[i];
    b += d;
  }
  dgain[(long long)chunk * c + j] = g;
  dbias[(long long)chunk * c + j] = b;
}

#define NORM_KERNELS(T, NAME)                                                                    \
  extern "C" __global__ void norm_forward_##NAME(int rows, int c, const T *x, const T *gain,     \
                                                 const T *bias, float eps, int layer, T *y,      \
                                                 float *mean, float *rstd) {                     \
    norm_forward<T>(rows, c, x, gain, bias, eps, layer, y, mean, rstd);                          \
  }                                                                                              \
  extern "C" __global__ void norm_backward_dx_##NAME(int rows, int c, const T *x, const T *gain, \
                                                     const T *dy, const float *mean,             \
                                                     const float *rstd, int layer, float *dx) {  \
    norm_backward_dx<T>(rows, c, x, gain, dy, mean, rstd, layer, dx);                            \
  }                                                                                              \
  extern "C" __global__ void norm_backward_columns_##NAME(                                       \
      int rows, int c, const T *x, const T *dy, const float *mean, const float *rstd,            \
      float *dgain, float *dbias) {                                                              \
    norm_backward_columns<T>(rows, c, x, dy, mean, rstd, dgain, dbias);                          \
  }

NORM_KERNELS(float, f32)
NORM_KERNELS(__half, f16)
NORM_KERNELS(bf16_t, bf16)
