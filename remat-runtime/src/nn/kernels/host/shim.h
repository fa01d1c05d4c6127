// What remat's kernels need of CUDA, on the host: each block's threads are
// POSIX threads meeting at a barrier for __syncthreads (and each warp's 32
// at one for __syncwarp and the shuffles), shared memory a static array
// (one block runs at a time), f16 as the compiler's _Float16, and WMMA's
// 16x16x16 tiles as every lane holding the whole tile (WMMA does not say
// which lane holds which element, so no kernel may depend on it), the
// products in f32. Built by the tests in ../tests.rs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <type_traits>
#include <pthread.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(n)
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
using std::max;
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

// Warps: 32 threads at their own barrier; a shuffle goes through a slot per
// lane, between two of its barriers.
extern pthread_barrier_t warp_barriers[32];
extern float shuffle_slots[32][32];
inline void __syncwarp(unsigned = 0xffffffffu) {
  pthread_barrier_wait(&warp_barriers[threadIdx.x / 32]);
}
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncwarp();
  shuffle_slots[w][lane] = v;
  __syncwarp();
  return shuffle_slots[w][lane ^ lane_mask];
}

struct __nv_bfloat16 {
  uint16_t bits;
};
inline float wmma_float(__half x) { return (float)x.x; }
inline float wmma_float(__nv_bfloat16 x) { return __uint_as_float(((uint32_t)x.bits) << 16); }
inline float wmma_float(float x) { return x; }

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
// Element (r, c): row r of A (or of C), or (k = r, n = c) of B.
template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
  float v[16][16];
};
template <typename Use, typename T, typename L>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, L> &f, const T *p, unsigned ld) {
  constexpr bool col = std::is_same<L, col_major>::value;
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++) f.v[r][c] = wmma_float(col ? p[c * ld + r] : p[r * ld + c]);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &f, const float *p, unsigned ld,
                             layout_t l) {
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++) f.v[r][c] = l == mem_row_major ? p[r * ld + c] : p[c * ld + r];
}
// One lane writes (the same values every lane holds).
inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f, unsigned ld,
                              layout_t l) {
  if (threadIdx.x % 32 != 0) return;
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++) (l == mem_row_major ? p[r * ld + c] : p[c * ld + r]) = f.v[r][c];
}
template <typename Use, typename T, typename L>
void fill_fragment(fragment<Use, 16, 16, 16, T, L> &f, float x) {
  for (auto &row : f.v)
    for (auto &e : row) e = x;
}
template <typename TA, typename LA, typename TB, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float> &d, const fragment<matrix_a, 16, 16, 16, TA, LA> &a,
              const fragment<matrix_b, 16, 16, 16, TB, LB> &b,
              const fragment<accumulator, 16, 16, 16, float> &c) {
  fragment<accumulator, 16, 16, 16, float> r;
  for (int i = 0; i < 16; i++)
    for (int n = 0; n < 16; n++) {
      float s = c.v[i][n];
      for (int k = 0; k < 16; k++) s += a.v[i][k] * b.v[k][n];
      r.v[i][n] = s;
    }
  d = r;
}
}  // namespace wmma
}  // namespace nvcuda
