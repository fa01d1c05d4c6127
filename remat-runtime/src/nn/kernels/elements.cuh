// Element types of remat's kernels: f32, f16 (__half) and bf16 (its
// 16 bits), read and written through f32.
#pragma once
#include <stdint.h>
#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <math.h>
#endif

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ float load(__half x) { return __half2float(x); }
struct bf16_t {
  uint16_t bits;
};
__device__ __forceinline__ float load(bf16_t x) {
  return __uint_as_float(((uint32_t)x.bits) << 16);
}
template <typename T> __device__ __forceinline__ T store(float x);
template <> __device__ __forceinline__ float store<float>(float x) { return x; }
template <> __device__ __forceinline__ __half store<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ bf16_t store<bf16_t>(float x) {
  uint32_t u = __float_as_uint(x);
  bf16_t r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = (uint16_t)((u >> 16) | 0x40u);  // NaN stays NaN
  } else {
    r.bits = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // to nearest even
  }
  return r;
}

