// What attention.cu needs of CUDA, on the host: each block's threads are
// POSIX threads meeting at a barrier for __syncthreads, shared memory a
// static array (one block runs at a time), f16 as the compiler's _Float16.
// Built by the tests in ../tests.rs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <pthread.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct float4 {
  float x, y, z, w;
};

struct Index {
  unsigned x, y, z;
};
extern thread_local Index threadIdx;
extern Index blockIdx, gridDim;
// The gelu kernel's blocks: 32 threads (attention.cu uses NT, not this).
constexpr Index blockDim = {32, 1, 1};
extern pthread_barrier_t block_barrier;
#define __syncthreads() pthread_barrier_wait(&block_barrier)
using std::min;

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
struct __half {
  _Float16 x;
};
inline float __half2float(__half h) { return (float)h.x; }
inline __half __float2half_rn(float x) { return __half{(_Float16)x}; }
