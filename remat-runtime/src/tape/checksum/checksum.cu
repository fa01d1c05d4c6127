// The checksum kernels (see device.rs and mod.rs): the operations of
// element.rs and cpu.rs, in their order, so that the bits equal the CPU's.
// Every float operation is an explicit round-to-nearest intrinsic: nvcc
// would otherwise fuse a multiply and an add, which the CPU does not.
#include <stdint.h>
#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

#define LANES 256
#define ROWS 64
#define SPAN 32
#define CHUNK (LANES * ROWS)
#define PARTIAL 5
#define PHI 0x9E3779B9u

__device__ __forceinline__ uint32_t fmix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  return x ^ (x >> 16);
}

__device__ __forceinline__ uint32_t rotl(uint32_t x, int r) {
  return (x << r) | (x >> (32 - r));
}

// The hash terms of an element of one word.
__device__ __forceinline__ void mix1(uint32_t lo, uint32_t key, uint32_t &h0, uint32_t &h1) {
  uint32_t a = fmix(lo ^ key);
  h0 += a;
  h1 += a * (key | 1u);
}

// The hash terms of an element of two words.
__device__ __forceinline__ void mix2(uint32_t lo, uint32_t hi, uint32_t key, uint32_t &h0,
                                     uint32_t &h1) {
  uint32_t a = fmix(lo ^ key);
  uint32_t b = fmix(hi ^ rotl(key, 16));
  h0 += a + rotl(b, 11);
  h1 += a * (key | 1u) + b * (rotl(key, 16) | 1u);
}

// What each dtype contributes: its words to the hash, its value in the
// precision its spans are summed in (Acc: float up to 32 bits, else double).
template <typename T> struct El;
template <> struct El<float> {
  typedef float Acc;
  static __device__ __forceinline__ void hash(float x, uint32_t k, uint32_t &h0, uint32_t &h1) {
    mix1(__float_as_uint(x), k, h0, h1);
  }
  static __device__ __forceinline__ float value(float x) { return x; }
};
template <> struct El<__half> {
  typedef float Acc;
  static __device__ __forceinline__ void hash(__half x, uint32_t k, uint32_t &h0, uint32_t &h1) {
    mix1((uint32_t)__half_as_ushort(x), k, h0, h1);
  }
  static __device__ __forceinline__ float value(__half x) { return __half2float(x); }
};
// bf16 as its 16 bits: the value is the top half of an f32 (exact).
struct Bf16 {
  uint16_t bits;
};
template <> struct El<Bf16> {
  typedef float Acc;
  static __device__ __forceinline__ void hash(Bf16 x, uint32_t k, uint32_t &h0, uint32_t &h1) {
    mix1((uint32_t)x.bits, k, h0, h1);
  }
  static __device__ __forceinline__ float value(Bf16 x) {
    return __uint_as_float(((uint32_t)x.bits) << 16);
  }
};
template <> struct El<uint8_t> {
  typedef float Acc;
  static __device__ __forceinline__ void hash(uint8_t x, uint32_t k, uint32_t &h0, uint32_t &h1) {
    mix1((uint32_t)x, k, h0, h1);
  }
  static __device__ __forceinline__ float value(uint8_t x) { return __uint2float_rn(x); }
};
template <> struct El<uint32_t> {
  typedef float Acc;
  static __device__ __forceinline__ void hash(uint32_t x, uint32_t k, uint32_t &h0, uint32_t &h1) {
    mix1(x, k, h0, h1);
  }
  static __device__ __forceinline__ float value(uint32_t x) { return __uint2float_rn(x); }
};
template <> struct El<int16_t> {
  typedef float Acc;
  static __device__ __forceinline__ void hash(int16_t x, uint32_t k, uint32_t &h0, uint32_t &h1) {
    mix1((uint32_t)(uint16_t)x, k, h0, h1);
  }
  static __device__ __forceinline__ float value(int16_t x) { return __int2float_rn(x); }
};
template <> struct El<int32_t> {
  typedef float Acc;
  static __device__ __forceinline__ void hash(int32_t x, uint32_t k, uint32_t &h0, uint32_t &h1) {
    mix1((uint32_t)x, k, h0, h1);
  }
  static __device__ __forceinline__ float value(int32_t x) { return __int2float_rn(x); }
};
template <> struct El<double> {
  typedef double Acc;
  static __device__ __forceinline__ void hash(double x, uint32_t k, uint32_t &h0, uint32_t &h1) {
    uint64_t b = (uint64_t)__double_as_longlong(x);
    mix2((uint32_t)b, (uint32_t)(b >> 32), k, h0, h1);
  }
  static __device__ __forceinline__ double value(double x) { return x; }
};
template <> struct El<int64_t> {
  typedef double Acc;
  static __device__ __forceinline__ void hash(int64_t x, uint32_t k, uint32_t &h0, uint32_t &h1) {
    uint64_t b = (uint64_t)x;
    mix2((uint32_t)b, (uint32_t)(b >> 32), k, h0, h1);
  }
  static __device__ __forceinline__ double value(int64_t x) { return __ll2double_rn(x); }
};

__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float weight(uint32_t k, float) {
  return __fmul_rn(__uint2float_rn(k >> 8), 1.0f / 16777216.0f);
}
__device__ __forceinline__ double weight(uint32_t k, double) {
  return __dmul_rn(__uint2double_rn(k >> 8), 1.0 / 16777216.0);
}
__device__ __forceinline__ float magnitude(float x) { return fabsf(x); }
__device__ __forceinline__ double magnitude(double x) { return fabs(x); }
__device__ __forceinline__ double widen(float x) { return (double)x; }
__device__ __forceinline__ double widen(double x) { return x; }

// The storage offset of position p of a strided view: info holds the
// dims, then the strides (candle's layout parameters).
__device__ __forceinline__ size_t strided_offset(size_t p, size_t num_dims, const size_t *info) {
  const size_t *dims = info;
  const size_t *strides = info + num_dims;
  size_t offset = 0;
  for (size_t i = 0; i < num_dims; i++) {
    size_t d = num_dims - 1 - i;
    offset += (p % dims[d]) * strides[d];
    p /= dims[d];
  }
  return offset;
}

// The block's lanes added pairwise (lane t takes lane t + s for s = LANES/2,
// ..., 1); thread 0 gets the block's numbers.
struct Lane {
  uint32_t h0, h1;
  double sum, mag, w;
};

__device__ __forceinline__ Lane block_tree(Lane lane) {
  __shared__ uint32_t s_h0[LANES], s_h1[LANES];
  __shared__ double s_sum[LANES], s_mag[LANES], s_w[LANES];
  const unsigned t = threadIdx.x;
  s_h0[t] = lane.h0;
  s_h1[t] = lane.h1;
  s_sum[t] = lane.sum;
  s_mag[t] = lane.mag;
  s_w[t] = lane.w;
  __syncthreads();
  for (unsigned s = LANES / 2; s > 0; s >>= 1) {
    if (t < s) {
      s_h0[t] += s_h0[t + s];
      s_h1[t] += s_h1[t + s];
      s_sum[t] = __dadd_rn(s_sum[t], s_sum[t + s]);
      s_mag[t] = __dadd_rn(s_mag[t], s_mag[t + s]);
      s_w[t] = __dadd_rn(s_w[t], s_w[t + s]);
    }
    __syncthreads();
  }
  Lane total = {s_h0[0], s_h1[0], s_sum[0], s_mag[0], s_w[0]};
  return total;
}

// One span of a lane: SPAN positions p0, p0 + LANES, ..., those below n,
// summed in the element's precision, then added to the lane in f64.
template <typename T, bool CHECKED>
__device__ __forceinline__ void span(Lane &lane, size_t p0, const size_t n, const size_t num_dims,
                                     const size_t *info, const T *src) {
  typedef typename El<T>::Acc Acc;
  Acc s = 0, a = 0, ws = 0;
#pragma unroll 8
  for (int r = 0; r < SPAN; r++) {
    size_t p = p0 + (size_t)r * LANES;
    if (CHECKED && p >= n) break;
    size_t offset = info == nullptr ? p : strided_offset(p, num_dims, info);
    T x = src[offset];
    uint32_t k = (uint32_t)p * PHI;
    El<T>::hash(x, k, lane.h0, lane.h1);
    Acc v = El<T>::value(x);
    s = add(s, v);
    a = add(a, magnitude(v));
    ws = add(ws, mul(v, weight(k, (Acc)0)));
  }
  lane.sum = __dadd_rn(lane.sum, widen(s));
  lane.mag = __dadd_rn(lane.mag, widen(a));
  lane.w = __dadd_rn(lane.w, widen(ws));
}

// Chunk c of a value, one thread per lane; writes the chunk's PARTIAL
// numbers at out + c * PARTIAL: h0, h1, sum, sum of magnitudes, weighted
// sum. A whole chunk reads without bounds checks.
template <typename T>
__device__ void partials(const size_t c, const size_t n, const size_t num_dims, const size_t *info,
                         const T *src, double *out) {
  const size_t first = c * CHUNK + threadIdx.x;
  Lane lane = {0, 0, 0.0, 0.0, 0.0};
  const bool whole = (c + 1) * CHUNK <= n;
  for (int sp = 0; sp < ROWS / SPAN; sp++) {
    size_t p0 = first + (size_t)sp * SPAN * LANES;
    if (whole) {
      span<T, false>(lane, p0, n, num_dims, info, src);
    } else {
      span<T, true>(lane, p0, n, num_dims, info, src);
    }
  }
  Lane total = block_tree(lane);
  if (threadIdx.x == 0) {
    double *o = out + c * PARTIAL;
    o[0] = (double)total.h0;
    o[1] = (double)total.h1;
    o[2] = total.sum;
    o[3] = total.mag;
    o[4] = total.w;
  }
}

#define PARTIALS(NAME, T)                                                                          \
  extern "C" __global__ void checksum_partials_##NAME(const size_t n, const size_t num_dims,       \
                                                      const size_t *info, const T *src,            \
                                                      double *out) {                               \
    partials<T>(blockIdx.x, n, num_dims, info, src, out);                                          \
  }

PARTIALS(f32, float)
PARTIALS(f16, __half)
PARTIALS(bf16, Bf16)
PARTIALS(f64, double)
PARTIALS(u8, uint8_t)
PARTIALS(u32, uint32_t)
PARTIALS(i16, int16_t)
PARTIALS(i32, int32_t)
PARTIALS(i64, int64_t)

// One block: thread t adds chunks t, t + LANES, ... in order, then the
// block's tree; writes the checksum's four numbers.
__device__ void combine(const size_t chunks, const double *partials, double *out) {
  Lane lane = {0, 0, 0.0, 0.0, 0.0};
  for (size_t c = threadIdx.x; c < chunks; c += LANES) {
    const double *p = partials + c * PARTIAL;
    lane.h0 += (uint32_t)p[0];
    lane.h1 += (uint32_t)p[1];
    lane.sum = __dadd_rn(lane.sum, p[2]);
    lane.mag = __dadd_rn(lane.mag, p[3]);
    lane.w = __dadd_rn(lane.w, p[4]);
  }
  Lane total = block_tree(lane);
  if (threadIdx.x == 0) {
    uint64_t hash = (uint64_t)total.h0 | ((uint64_t)(total.h1 & 0x1fffffu) << 32);
    out[0] = __ull2double_rn(hash);
    out[1] = total.sum;
    out[2] = total.mag;
    out[3] = total.w;
  }
}

extern "C" __global__ void checksum_combine(const size_t chunks, const double *partials,
                                            double *out) {
  combine(chunks, partials, out);
}

// Checksums of several values in two launches (see device.rs, `Batch`):
// the values travel in the kernel's parameters, so nothing is copied to
// the device first. A value of no elements (an empty one, or one the
// replay does not compare) gets four zeros, as the CPU gives it.
#define BATCH 16
#define MAX_DIMS 6
#define WORDS 4

struct Value {
  const void *src;           // the view's first element
  size_t n;                  // elements
  size_t first_chunk;        // its first chunk among the launch's
  size_t slot;               // where its checksum goes, in checksums
  size_t num_dims;           // 0: contiguous
  size_t info[2 * MAX_DIMS]; // dims, then strides (num_dims of each)
};

struct Batch {
  size_t count;
  Value values[BATCH];
};

// The launch's parameter read in place, not copied to each thread's local
// memory for an index known only at run time (sm_70 and later).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
#define PARAMETER __grid_constant__ const
#else
#define PARAMETER const
#endif

// One block per chunk of every value: block g finds the value its chunk
// belongs to (values in order of first_chunk; an empty value has none) and
// computes the chunk as `checksum_partials` does.
template <typename T> __device__ void batch_partials(const Batch &b, double *out) {
  const size_t g = blockIdx.x;
  size_t i = 0;
  while (i + 1 < b.count && b.values[i + 1].first_chunk <= g) i++;
  const Value &v = b.values[i];
  __shared__ size_t info[2 * MAX_DIMS];
  if (threadIdx.x < 2 * v.num_dims) info[threadIdx.x] = v.info[threadIdx.x];
  __syncthreads();
  partials<T>(g - v.first_chunk, v.n, v.num_dims, v.num_dims ? info : nullptr,
              static_cast<const T *>(v.src), out + v.first_chunk * PARTIAL);
}

#define BATCH_PARTIALS(NAME, T)                                                                    \
  extern "C" __global__ void checksum_batch_partials_##NAME(PARAMETER Batch b, double *out) {      \
    batch_partials<T>(b, out);                                                                     \
  }

BATCH_PARTIALS(f32, float)
BATCH_PARTIALS(f16, __half)
BATCH_PARTIALS(bf16, Bf16)
BATCH_PARTIALS(f64, double)
BATCH_PARTIALS(u8, uint8_t)
BATCH_PARTIALS(u32, uint32_t)
BATCH_PARTIALS(i16, int16_t)
BATCH_PARTIALS(i32, int32_t)
BATCH_PARTIALS(i64, int64_t)

// One block per value: its chunks combined as `checksum_combine` does,
// written to its slot.
extern "C" __global__ void checksum_batch_combine(PARAMETER Batch b, const double *partials,
                                                  double *out) {
  const Value &v = b.values[blockIdx.x];
  double *o = out + v.slot * WORDS;
  if (v.n == 0) {
    if (threadIdx.x < WORDS) o[threadIdx.x] = 0.0;
    return;
  }
  combine((v.n + CHUNK - 1) / CHUNK, partials + v.first_chunk * PARTIAL, o);
}
