// What checksum.cu needs of CUDA, on the host: each block's threads are
// POSIX threads meeting at a barrier for __syncthreads, shared memory a
// static array (one block runs at a time), and every intrinsic the
// round-to-nearest operation it names, kept unfused (-ffp-contract=off).
// Built by the test `the_kernel_source_on_host_threads_gives_the_cpu_bits`.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <pthread.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct Index {
  unsigned x;
};
extern thread_local Index threadIdx;
extern Index blockIdx;
extern pthread_barrier_t block_barrier;
#define __syncthreads() pthread_barrier_wait(&block_barrier)

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
inline long long __double_as_longlong(double x) {
  long long u;
  std::memcpy(&u, &x, 8);
  return u;
}
inline float __uint2float_rn(unsigned x) { return (float)x; }
inline float __int2float_rn(int x) { return (float)x; }
inline double __uint2double_rn(unsigned x) { return (double)x; }
inline double __ll2double_rn(long long x) { return (double)x; }
inline double __ull2double_rn(unsigned long long x) { return (double)x; }

struct __half {
  uint16_t bits;
};
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
// IEEE binary16 to binary32, exact.
inline float __half2float(__half h) {
  uint32_t sign = (uint32_t)(h.bits >> 15) << 31;
  uint32_t exp = (h.bits >> 10) & 0x1f;
  uint32_t man = h.bits & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {
      // Subnormal: normalise.
      int e = -1;
      do {
        man <<= 1;
        e++;
      } while ((man & 0x400) == 0);
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return __uint_as_float(bits);
}
