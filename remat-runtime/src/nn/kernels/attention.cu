// Fused attention, forward and backward, in the manner of FlashAttention-2
// (see kernels.rs): no (T, S) tensor is ever written, scores and
// probabilities live in registers, tiles of keys/values (forward, dq) or of
// queries and output gradients (dk, dv) in shared memory, statistics and
// sums in f32 whatever the element type.
//
// One thread per query row (forward, dq) or per key row (dk, dv), NT
// threads per block; the row vectors (up to DM features) in registers.
//
// Layouts (element strides; the last dimension has stride 1):
//   q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv): any strides;
//   mask: (B, H, T, S) strides, 0 where it broadcasts, added to the scores;
//   out, dout: (B, T, H, Dv) strides; the forward writes out contiguous;
//   stats: f32 (2, B, H, T): each row's maximum score (0 where every key is
//   masked) then 1 / sum of exponentials (0 there);
//   delta: f32 (B, H, T), dout . out per row (written by the dq kernel);
//   dq (B, H, T, D), dk (B, Hkv, S, D), dv (B, Hkv, S, Dv): where the
//   Shape's dq_*, dk_*, dv_* say (contiguous, or one packed (B, T, 3, H, D)).
// Causal masking hides key j from query i when j > i + S - T.

#define NT 64
#define KT 32

#include "attention.cuh"

// `reg . sh` of a row in registers and a row in shared memory (16-byte
// aligned): four-wide shared loads, four independent sums.
template <int DM> __device__ __forceinline__ float dot_shared(const float *reg, const float *sh) {
  const float4 *s4 = reinterpret_cast<const float4 *>(sh);
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
  for (int c = 0; c < DM / 4; c++) {
    float4 v = s4[c];
    a0 += reg[4 * c] * v.x;
    a1 += reg[4 * c + 1] * v.y;
    a2 += reg[4 * c + 2] * v.z;
    a3 += reg[4 * c + 3] * v.w;
  }
  return (a0 + a1) + (a2 + a3);
}

// acc += a * sh, for a row in shared memory (16-byte aligned).
template <int DM> __device__ __forceinline__ void axpy_shared(float *acc, float a, const float *sh) {
  const float4 *s4 = reinterpret_cast<const float4 *>(sh);
#pragma unroll
  for (int c = 0; c < DM / 4; c++) {
    float4 v = s4[c];
    acc[4 * c] += a * v.x;
    acc[4 * c + 1] += a * v.y;
    acc[4 * c + 2] += a * v.z;
    acc[4 * c + 3] += a * v.w;
  }
}

// The score of the row in registers against the row in shared memory (a
// query and a key, either way; features 0..DM, zero past d), scaled and
// masked.
template <typename T, int DM>
__device__ __forceinline__ float score(const float *reg, const float *sh, const Shape &p,
                                       const T *mask, int b, int h, int i, int j) {
  float s = dot_shared<DM>(reg, sh) * p.scale;
  if (p.has_mask) s += load(mask[b * p.m_b + h * p.m_h + i * p.m_t + j * p.m_s]);
  return s;
}

template <typename T, int DM>
__device__ void attention_forward(const T *q, const T *k, const T *v, const T *mask, T *out,
                                  float *stats, Shape p) {
  __shared__ __align__(16) float ks[KT][DM];
  __shared__ __align__(16) float vs[KT][DM];
  int b = blockIdx.z, h = blockIdx.y, i = blockIdx.x * NT + threadIdx.x;
  int hk = h / (p.h / p.hkv);
  bool row = i < p.t;
  float qr[DM], acc[DM];
#pragma unroll
  for (int c = 0; c < DM; c++) {
    qr[c] = (row && c < p.d) ? load(q[b * p.q_b + h * p.q_h + i * p.q_t + c]) : 0.f;
    acc[c] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  int last = min((int)(blockIdx.x + 1) * NT, p.t) - 1;
  int block_keys = keys_for(p, last);
  int mine = row ? keys_for(p, i) : 0;
  for (int j0 = 0; j0 < block_keys; j0 += KT) {
    for (int e = threadIdx.x; e < KT * DM; e += NT) {
      int r = e / DM, c = e % DM, j = j0 + r;
      ks[r][c] = (j < p.s && c < p.d) ? load(k[b * p.k_b + hk * p.k_h + j * p.k_s + c]) : 0.f;
      vs[r][c] = (j < p.s && c < p.dv) ? load(v[b * p.v_b + hk * p.v_h + j * p.v_s + c]) : 0.f;
    }
    __syncthreads();
    int n = min(KT, mine - j0);
    for (int r = 0; r < n; r++) {
      float s = score<T, DM>(qr, ks[r], p, mask, b, h, i, j0 + r);
      if (s > m) {
        // A new maximum: rescale what was summed (exp(-inf) = 0 at first).
        float c = expf(m - s);
        l *= c;
#pragma unroll
        for (int f = 0; f < DM; f++) acc[f] *= c;
        m = s;
      }
      if (m == -INFINITY) continue;  // every key so far masked
      float e = expf(s - m);
      l += e;
      axpy_shared<DM>(acc, e, vs[r]);
    }
    __syncthreads();
  }
  if (!row) return;
  float inv = l > 0.f ? 1.f / l : 0.f;
  if (m == -INFINITY) m = 0.f;
  T *o = out + (((long long)b * p.t + i) * p.h + h) * p.dv;
#pragma unroll
  for (int c = 0; c < DM; c++)
    if (c < p.dv) o[c] = store<T>(acc[c] * inv);
  long long bht = (long long)gridDim.z * p.h * p.t;
  long long at = ((long long)b * p.h + h) * p.t + i;
  stats[at] = m;
  stats[bht + at] = inv;
}

// dq, and delta = dout . out per row.
template <typename T, int DM>
__device__ void attention_backward_dq(const T *q, const T *k, const T *v, const T *mask,
                                      const T *out, const T *dout, const float *stats, T *dq,
                                      float *delta, Shape p) {
  __shared__ __align__(16) float ks[KT][DM];
  __shared__ __align__(16) float vs[KT][DM];
  int b = blockIdx.z, h = blockIdx.y, i = blockIdx.x * NT + threadIdx.x;
  int hk = h / (p.h / p.hkv);
  bool row = i < p.t;
  float qr[DM], gr[DM], acc[DM];
  // delta = dout . out, summed as dot_shared sums dout . v: with one
  // visible key (out = v) the two cancel exactly and dq is 0.
  float d4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int c = 0; c < DM; c++) {
    qr[c] = (row && c < p.d) ? load(q[b * p.q_b + h * p.q_h + i * p.q_t + c]) : 0.f;
    float g = (row && c < p.dv) ? load(dout[b * p.g_b + i * p.g_t + h * p.g_h + c]) : 0.f;
    float o = (row && c < p.dv) ? load(out[b * p.o_b + i * p.o_t + h * p.o_h + c]) : 0.f;
    gr[c] = g;
    d4[c % 4] += g * o;
    acc[c] = 0.f;
  }
  float di = (d4[0] + d4[1]) + (d4[2] + d4[3]);
  long long bht = (long long)gridDim.z * p.h * p.t;
  long long at = ((long long)b * p.h + h) * p.t + i;
  float m = row ? stats[at] : 0.f, inv = row ? stats[bht + at] : 0.f;
  int last = min((int)(blockIdx.x + 1) * NT, p.t) - 1;
  int block_keys = keys_for(p, last);
  int mine = (row && inv != 0.f) ? keys_for(p, i) : 0;
  for (int j0 = 0; j0 < block_keys; j0 += KT) {
    for (int e = threadIdx.x; e < KT * DM; e += NT) {
      int r = e / DM, c = e % DM, j = j0 + r;
      ks[r][c] = (j < p.s && c < p.d) ? load(k[b * p.k_b + hk * p.k_h + j * p.k_s + c]) : 0.f;
      vs[r][c] = (j < p.s && c < p.dv) ? load(v[b * p.v_b + hk * p.v_h + j * p.v_s + c]) : 0.f;
    }
    __syncthreads();
    int n = min(KT, mine - j0);
    for (int r = 0; r < n; r++) {
      float s = score<T, DM>(qr, ks[r], p, mask, b, h, i, j0 + r);
      float pr = expf(s - m) * inv;
      float dp = dot_shared<DM>(gr, vs[r]);
      float ds = pr * (dp - di);
      axpy_shared<DM>(acc, ds, ks[r]);
    }
    __syncthreads();
  }
  if (!row) return;
  T *o = dq + p.dq_o + b * p.dq_b + h * p.dq_h + i * p.dq_t;
#pragma unroll
  for (int c = 0; c < DM; c++)
    if (c < p.d) o[c] = store<T>(acc[c] * p.scale);
  delta[at] = di;
}

// dk (DK) or dv (!DK) of key row j of key/value head hk, summed over the
// query heads that read it.
template <typename T, int DM, bool DK>
__device__ void attention_backward_dkv(const T *q, const T *k, const T *v, const T *mask,
                                       const T *dout, const float *stats, const float *delta,
                                       T *grad, Shape p) {
  __shared__ __align__(16) float qs[KT][DM];
  __shared__ __align__(16) float gs[KT][DM];
  __shared__ float ms[KT], invs[KT], ds_[KT];
  int b = blockIdx.z, hk = blockIdx.y, j = blockIdx.x * NT + threadIdx.x;
  int group = p.h / p.hkv;
  bool row = j < p.s;
  float kr[DM], vr[DM], acc[DM];
#pragma unroll
  for (int c = 0; c < DM; c++) {
    kr[c] = (row && c < p.d) ? load(k[b * p.k_b + hk * p.k_h + j * p.k_s + c]) : 0.f;
    vr[c] = (DK && row && c < p.dv) ? load(v[b * p.v_b + hk * p.v_h + j * p.v_s + c]) : 0.f;
    acc[c] = 0.f;
  }
  long long bht = (long long)gridDim.z * p.h * p.t;
  // The first query that sees the block's first key.
  int first = 0;
  if (p.causal) {
    int f = (int)(blockIdx.x * NT) - (p.s - p.t);
    first = f > 0 ? (f / KT) * KT : 0;
  }
  // The first query that sees key j.
  int from = p.causal ? j - (p.s - p.t) : 0;
  for (int h = hk * group; h < (hk + 1) * group; h++) {
    for (int i0 = first; i0 < p.t; i0 += KT) {
      for (int e = threadIdx.x; e < KT * DM; e += NT) {
        int r = e / DM, c = e % DM, i = i0 + r;
        qs[r][c] = (i < p.t && c < p.d) ? load(q[b * p.q_b + h * p.q_h + i * p.q_t + c]) : 0.f;
        gs[r][c] =
            (i < p.t && c < p.dv) ? load(dout[b * p.g_b + i * p.g_t + h * p.g_h + c]) : 0.f;
      }
      for (int r = threadIdx.x; r < KT; r += NT) {
        int i = i0 + r;
        long long at = ((long long)b * p.h + h) * p.t + i;
        ms[r] = i < p.t ? stats[at] : 0.f;
        invs[r] = i < p.t ? stats[bht + at] : 0.f;
        ds_[r] = (DK && i < p.t) ? delta[at] : 0.f;
      }
      __syncthreads();
      if (row) {
        for (int r = 0; r < KT; r++) {
          int i = i0 + r;
          if (i >= p.t) break;
          if (i < from || invs[r] == 0.f) continue;
          float s = score<T, DM>(kr, qs[r], p, mask, b, h, i, j);
          float pr = expf(s - ms[r]) * invs[r];
          if (DK) {
            float ds = pr * (dot_shared<DM>(vr, gs[r]) - ds_[r]);
            axpy_shared<DM>(acc, ds, qs[r]);
          } else {
            axpy_shared<DM>(acc, pr, gs[r]);
          }
        }
      }
      __syncthreads();
    }
  }
  if (!row) return;
  int width = DK ? p.d : p.dv;
  T *o = DK ? grad + p.dk_o + b * p.dk_b + hk * p.dk_h + j * p.dk_s
            : grad + p.dv_o + b * p.dv_b + hk * p.dv_h + j * p.dv_s;
#pragma unroll
  for (int c = 0; c < DM; c++)
    if (c < width) o[c] = store<T>(DK ? acc[c] * p.scale : acc[c]);
}

// The entry points, per element type and largest head size.
#define ATTENTION_KERNELS(T, NAME, DM)                                                        \
  extern "C" __global__ void attention_forward_##NAME##_##DM(                                \
      const T *q, const T *k, const T *v, const T *mask, T *out, float *stats, Shape p) {    \
    attention_forward<T, DM>(q, k, v, mask, out, stats, p);                                   \
  }                                                                                           \
  extern "C" __global__ void attention_backward_dq_##NAME##_##DM(                            \
      const T *q, const T *k, const T *v, const T *mask, const T *out, const T *dout,        \
      const float *stats, T *dq, float *delta, Shape p) {                                     \
    attention_backward_dq<T, DM>(q, k, v, mask, out, dout, stats, dq, delta, p);              \
  }                                                                                           \
  extern "C" __global__ void attention_backward_dk_##NAME##_##DM(                            \
      const T *q, const T *k, const T *v, const T *mask, const T *dout, const float *stats,  \
      const float *delta, T *dk, Shape p) {                                                   \
    attention_backward_dkv<T, DM, true>(q, k, v, mask, dout, stats, delta, dk, p);            \
  }                                                                                           \
  extern "C" __global__ void attention_backward_dv_##NAME##_##DM(                            \
      const T *q, const T *k, const T *v, const T *mask, const T *dout, const float *stats,  \
      const float *delta, T *dv, Shape p) {                                                   \
    attention_backward_dkv<T, DM, false>(q, k, v, mask, dout, stats, delta, dv, p);           \
  }

ATTENTION_KERNELS(float, f32, 64)
ATTENTION_KERNELS(float, f32, 128)
ATTENTION_KERNELS(__half, f16, 64)
ATTENTION_KERNELS(__half, f16, 128)
ATTENTION_KERNELS(bf16_t, bf16, 64)
ATTENTION_KERNELS(bf16_t, bf16, 128)
