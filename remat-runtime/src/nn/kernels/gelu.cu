// The backward of the tanh GELU in one pass: out = dy * gelu'(x), computed
// in f32, for contiguous x and dy of n elements.
#include "elements.cuh"

#define GELU_C 0.7978845608028654
#define GELU_A 0.044715

template <typename T, typename F>
__device__ void gelu_backward(size_t n, const T *x, const T *dy, T *out) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    F v = (F)load(x[i]);
    F t = tanh((F)GELU_C * (v + (F)GELU_A * v * v * v));
    F d = (F)0.5 * ((F)1 + t) +
          (F)0.5 * v * ((F)1 - t * t) * (F)GELU_C * ((F)1 + (F)3 * (F)GELU_A * v * v);
    out[i] = store<T>(d * (F)load(dy[i]));
  }
}

extern "C" __global__ void gelu_backward_f32(size_t n, const float *x, const float *dy, float *out) {
  gelu_backward<float, float>(n, x, dy, out);
}
extern "C" __global__ void gelu_backward_f16(size_t n, const __half *x, const __half *dy, __half *out) {
  gelu_backward<__half, float>(n, x, dy, out);
}
extern "C" __global__ void gelu_backward_bf16(size_t n, const bf16_t *x, const bf16_t *dy, bf16_t *out) {
  gelu_backward<bf16_t, float>(n, x, dy, out);
}
