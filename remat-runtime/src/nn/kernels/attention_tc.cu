// Fused attention for f16 and bf16 on tensor cores, forward and backward,
// in the manner of FlashAttention-2: the products (Q K^T, P V, dO V^T, dS K,
// P^T dO, dS^T Q) as WMMA 16x16x16 tiles with f32 accumulators; the softmax,
// its statistics and the masks in f32 on the SIMT lanes; no (T, S) tensor.
// The same arguments, layouts and statistics as attention.cu's kernels
// (see there), so either backward runs after either forward.
//
// A block is 4 warps, each owning 16 rows: query rows (forward, dq: 64 per
// block) or key rows (dk and dv together: 64 per block). A warp's products
// land in its own shared tiles, where two lanes per row apply the softmax;
// the f32 accumulators live in fragments, and the forward's running
// rescale goes through the warp's tile (WMMA does not say which lane holds
// which element). Probabilities and score gradients are rounded to the
// element type before their products, as FlashAttention-2 does.

#include "attention.cuh"

// WMMA for f16 and bf16 needs compute capability 8.0: built for an older
// one, this file has no kernels, and the launches fall back to
// attention.cu's (cuda.rs).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <mma.h>
#endif
using namespace nvcuda;

#define WARPS 4
#define ROWS (16 * WARPS)

// WMMA's element type for T.
template <typename T> struct Tc;
template <> struct Tc<__half> {
  typedef __half type;
};
template <> struct Tc<bf16_t> {
  typedef __nv_bfloat16 type;
};
template <typename T> using E = typename Tc<T>::type;

// Puts an element of T in a tile of WMMA's type (the same 16 bits).
template <typename T> __device__ __forceinline__ void put(E<T> *to, T x) {
  memcpy(to, &x, sizeof(T));
}

template <typename T> using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, E<T>, wmma::row_major>;
template <typename T> using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, E<T>, wmma::row_major>;
template <typename T>
using FragBt = wmma::fragment<wmma::matrix_b, 16, 16, 16, E<T>, wmma::col_major>;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;

// 16 bytes (8 elements) from `src` to `dst`, both 16-byte aligned.
__device__ __forceinline__ void copy8(void *dst, const void *src) {
#ifdef __CUDACC__
  *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
#else
  memcpy(dst, src, 16);
#endif
}

// Rows 0..rows of a tile (LD elements apart) from rows `from`.. of a (n,
// width) matrix at `src` (row stride `stride`, features contiguous), zero
// past `n` rows or `width` features; the block's threads together, eight
// elements at a time where the rows are 16-byte aligned.
template <typename T, int DM, int LD>
__device__ __forceinline__ void load_rows(E<T> (*tile)[LD], int rows, const T *src, long long stride,
                                          int from, int n, int width) {
  if ((unsigned long long)src % 16 == 0 && stride % 8 == 0 && width % 8 == 0) {
    for (int e = threadIdx.x; e < rows * (DM / 8); e += 32 * WARPS) {
      int r = e / (DM / 8), c = e % (DM / 8) * 8, i = from + r;
      if (i < n && c < width) {
        copy8(&tile[r][c], src + i * stride + c);
      } else {
        const unsigned zero[4] = {0u, 0u, 0u, 0u};
        copy8(&tile[r][c], zero);
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < rows * DM; e += 32 * WARPS) {
    int r = e / DM, c = e % DM, i = from + r;
    put<T>(&tile[r][c], (i < n && c < width) ? src[i * stride + c] : store<T>(0.f));
  }
}

// `frag` (16 x 16) into the warp's f32 tile at `tile` (ld LS).
template <int LS> __device__ __forceinline__ void spill(float *tile, const Acc &frag) {
  wmma::store_matrix_sync(tile, frag, LS, wmma::mem_row_major);
  __syncwarp();
}

// The number of keys query i sees (0 if none).
__device__ __forceinline__ int seen(const Shape &p, int i) { return i < p.t ? max(keys_for(p, i), 0) : 0; }

// Forward: out and the rows' statistics. Keys in tiles of BC.
template <typename T, int DM, int BC>
__device__ void tc_forward(const T *q, const T *k, const T *v, const T *mask, T *out, float *stats,
                           Shape p) {
  constexpr int LD = DM + 8, LS = BC + 4, LP = BC + 8;
  static_assert(2 * BC >= ROWS, "the Q tile is staged in the K and V tiles");
  __shared__ __align__(32) E<T> kv[2 * BC][LD];  // K rows, then V rows
  __shared__ __align__(32) float sw[WARPS][16][LS];
  __shared__ __align__(32) E<T> pw[WARPS][16][LP];
  __shared__ float cw[WARPS][16];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (p.h / p.hkv);
  const int i0 = blockIdx.x * ROWS, w0 = i0 + 16 * warp;
  const int row = lane / 2, half = lane % 2, i = w0 + row;

  load_rows<T, DM, LD>(kv, ROWS, q + b * p.q_b + h * p.q_h, p.q_t, i0, p.t, p.d);
  __syncthreads();
  FragA<T> qf[DM / 16];
  Acc of[DM / 16];
#pragma unroll
  for (int c = 0; c < DM / 16; c++) {
    wmma::load_matrix_sync(qf[c], &kv[16 * warp][16 * c], LD);
    wmma::fill_fragment(of[c], 0.f);
  }
  __syncthreads();

  float m = -INFINITY, l = 0.f;
  const int block_keys = seen(p, min(i0 + ROWS, p.t) - 1);
  const int warp_keys = w0 < p.t ? seen(p, min(w0 + 15, p.t - 1)) : 0;
  const int mine = seen(p, i);
  for (int j0 = 0; j0 < block_keys; j0 += BC) {
    load_rows<T, DM, LD>(kv, BC, k + b * p.k_b + hk * p.k_h, p.k_s, j0, p.s, p.d);
    load_rows<T, DM, LD>(kv + BC, BC, v + b * p.v_b + hk * p.v_h, p.v_s, j0, p.s, p.dv);
    __syncthreads();
    if (j0 < warp_keys) {
      // S = Q K^T.
#pragma unroll
      for (int n = 0; n < BC / 16; n++) {
        Acc s;
        wmma::fill_fragment(s, 0.f);
#pragma unroll
        for (int c = 0; c < DM / 16; c++) {
          FragBt<T> kf;
          wmma::load_matrix_sync(kf, &kv[16 * n][16 * c], LD);
          wmma::mma_sync(s, qf[c], kf, s);
        }
        wmma::store_matrix_sync(&sw[warp][0][16 * n], s, LS, wmma::mem_row_major);
      }
      __syncwarp();
      // The online softmax of row `row`, half of the tile's keys per lane.
      float x[BC / 2], top = -INFINITY;
#pragma unroll
      for (int c = 0; c < BC / 2; c++) {
        int col = half * (BC / 2) + c, j = j0 + col;
        float s = -INFINITY;
        if (j < mine) {
          s = sw[warp][row][col] * p.scale;
          if (p.has_mask) s += load(mask[b * p.m_b + h * p.m_h + i * p.m_t + j * p.m_s]);
        }
        x[c] = s;
        top = fmaxf(top, s);
      }
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      float mn = fmaxf(m, top);
      // exp(-inf) = 0 rescales nothing yet summed; no key seen yet: 1.
      float corr = mn == -INFINITY ? 1.f : expf(m - mn), sum = 0.f;
#pragma unroll
      for (int c = 0; c < BC / 2; c++) {
        float e = mn == -INFINITY ? 0.f : expf(x[c] - mn);
        sum += e;
        put<T>(&pw[warp][row][half * (BC / 2) + c], store<T>(e));
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      l = l * corr + sum;
      m = mn;
      if (half == 0) cw[warp][row] = corr;
      __syncwarp();
      // O *= corr, row by row, through the warp's tile.
#pragma unroll
      for (int c = 0; c < DM / 16; c++) {
        spill<LS>(&sw[warp][0][0], of[c]);
        for (int e = lane; e < 256; e += 32) sw[warp][e / 16][e % 16] *= cw[warp][e / 16];
        __syncwarp();
        wmma::load_matrix_sync(of[c], &sw[warp][0][0], LS, wmma::mem_row_major);
        __syncwarp();
      }
      // O += P V.
#pragma unroll
      for (int n = 0; n < BC / 16; n++) {
        FragA<T> pf;
        wmma::load_matrix_sync(pf, &pw[warp][0][16 * n], LP);
#pragma unroll
        for (int c = 0; c < DM / 16; c++) {
          FragB<T> vf;
          wmma::load_matrix_sync(vf, &kv[BC + 16 * n][16 * c], LD);
          wmma::mma_sync(of[c], pf, vf, of[c]);
        }
      }
    }
    __syncthreads();
  }
  float inv = l > 0.f ? 1.f / l : 0.f;
  if (half == 0) {
    cw[warp][row] = inv;
    if (i < p.t) {
      long long at = ((long long)b * p.h + h) * p.t + i;
      stats[at] = m == -INFINITY ? 0.f : m;
      stats[(long long)gridDim.z * p.h * p.t + at] = inv;
    }
  }
  __syncwarp();
#pragma unroll
  for (int c = 0; c < DM / 16; c++) {
    spill<LS>(&sw[warp][0][0], of[c]);
    for (int e = lane; e < 256; e += 32) {
      int r = e / 16, f = 16 * c + e % 16, ii = w0 + r;
      if (ii < p.t && f < p.dv)
        out[(((long long)b * p.t + ii) * p.h + h) * p.dv + f] = store<T>(sw[warp][r][e % 16] * cw[warp][r]);
    }
    __syncwarp();
  }
}

// dq, and delta = dout . out per row. Keys in tiles of BC.
template <typename T, int DM, int BC>
__device__ void tc_backward_dq(const T *q, const T *k, const T *v, const T *mask, const T *out,
                               const T *dout, const float *stats, T *dq, float *delta, Shape p) {
  constexpr int LD = DM + 8, LS = BC + 4, LP = BC + 8;
  static_assert(2 * BC >= ROWS, "the Q and dout tiles are staged in the K and V tiles");
  __shared__ __align__(32) E<T> kv[2 * BC][LD];
  __shared__ __align__(32) float sw[WARPS][16][LS];
  __shared__ __align__(32) float dpw[WARPS][16][LS];
  __shared__ __align__(32) E<T> pw[WARPS][16][LP];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (p.h / p.hkv);
  const int i0 = blockIdx.x * ROWS, w0 = i0 + 16 * warp;
  const int row = lane / 2, half = lane % 2, i = w0 + row;

  FragA<T> qf[DM / 16], gf[DM / 16];
  Acc acc[DM / 16];
  load_rows<T, DM, LD>(kv, ROWS, q + b * p.q_b + h * p.q_h, p.q_t, i0, p.t, p.d);
  __syncthreads();
#pragma unroll
  for (int c = 0; c < DM / 16; c++) wmma::load_matrix_sync(qf[c], &kv[16 * warp][16 * c], LD);
  __syncthreads();
  // dout (B, T, H, Dv): rows of head h are g_t apart.
  load_rows<T, DM, LD>(kv, ROWS, dout + b * p.g_b + h * p.g_h, p.g_t, i0, p.t, p.dv);
  __syncthreads();
#pragma unroll
  for (int c = 0; c < DM / 16; c++) {
    wmma::load_matrix_sync(gf[c], &kv[16 * warp][16 * c], LD);
    wmma::fill_fragment(acc[c], 0.f);
  }
  __syncthreads();

  // delta of row `row`: each lane half of the features.
  float di = 0.f;
  if (i < p.t)
    for (int c = half; c < p.dv; c += 2)
      di += load(dout[b * p.g_b + i * p.g_t + h * p.g_h + c]) *
            load(out[b * p.o_b + i * p.o_t + h * p.o_h + c]);
  di += __shfl_xor_sync(0xffffffffu, di, 1);
  long long at = ((long long)b * p.h + h) * p.t + i;
  float m = 0.f, inv = 0.f;
  if (i < p.t) {
    m = stats[at];
    inv = stats[(long long)gridDim.z * p.h * p.t + at];
    if (half == 0) delta[at] = di;
  }
  const int block_keys = seen(p, min(i0 + ROWS, p.t) - 1);
  const int warp_keys = w0 < p.t ? seen(p, min(w0 + 15, p.t - 1)) : 0;
  const int mine = inv != 0.f ? seen(p, i) : 0;
  for (int j0 = 0; j0 < block_keys; j0 += BC) {
    load_rows<T, DM, LD>(kv, BC, k + b * p.k_b + hk * p.k_h, p.k_s, j0, p.s, p.d);
    load_rows<T, DM, LD>(kv + BC, BC, v + b * p.v_b + hk * p.v_h, p.v_s, j0, p.s, p.dv);
    __syncthreads();
    if (j0 < warp_keys) {
      // S = Q K^T and dP = dO V^T.
#pragma unroll
      for (int n = 0; n < BC / 16; n++) {
        Acc s, dp;
        wmma::fill_fragment(s, 0.f);
        wmma::fill_fragment(dp, 0.f);
#pragma unroll
        for (int c = 0; c < DM / 16; c++) {
          FragBt<T> kf, vf;
          wmma::load_matrix_sync(kf, &kv[16 * n][16 * c], LD);
          wmma::mma_sync(s, qf[c], kf, s);
          wmma::load_matrix_sync(vf, &kv[BC + 16 * n][16 * c], LD);
          wmma::mma_sync(dp, gf[c], vf, dp);
        }
        wmma::store_matrix_sync(&sw[warp][0][16 * n], s, LS, wmma::mem_row_major);
        wmma::store_matrix_sync(&dpw[warp][0][16 * n], dp, LS, wmma::mem_row_major);
      }
      __syncwarp();
      // dS = P (dP - delta), P recomputed from the statistics.
#pragma unroll
      for (int c = 0; c < BC / 2; c++) {
        int col = half * (BC / 2) + c, j = j0 + col;
        float ds = 0.f;
        if (j < mine) {
          float s = sw[warp][row][col] * p.scale;
          if (p.has_mask) s += load(mask[b * p.m_b + h * p.m_h + i * p.m_t + j * p.m_s]);
          ds = expf(s - m) * inv * (dpw[warp][row][col] - di);
        }
        put<T>(&pw[warp][row][col], store<T>(ds));
      }
      __syncwarp();
      // dQ += dS K.
#pragma unroll
      for (int n = 0; n < BC / 16; n++) {
        FragA<T> sf;
        wmma::load_matrix_sync(sf, &pw[warp][0][16 * n], LP);
#pragma unroll
        for (int c = 0; c < DM / 16; c++) {
          FragB<T> kf;
          wmma::load_matrix_sync(kf, &kv[16 * n][16 * c], LD);
          wmma::mma_sync(acc[c], sf, kf, acc[c]);
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int c = 0; c < DM / 16; c++) {
    spill<LS>(&sw[warp][0][0], acc[c]);
    for (int e = lane; e < 256; e += 32) {
      int r = e / 16, f = 16 * c + e % 16, ii = w0 + r;
      if (ii < p.t && f < p.d)
        dq[p.dq_o + b * p.dq_b + h * p.dq_h + ii * p.dq_t + f] = store<T>(sw[warp][r][e % 16] * p.scale);
    }
    __syncwarp();
  }
}

// dk and dv of 64 key rows of key/value head hk, summed over the query
// heads that read it. Queries in tiles of BQ.
template <typename T, int DM, int BQ>
__device__ void tc_backward_dkv(const T *q, const T *k, const T *v, const T *mask, const T *dout,
                                const float *stats, const float *delta, T *dk, T *dv, Shape p) {
  constexpr int LD = DM + 8, LS = BQ + 4, LP = BQ + 8;
  static_assert(2 * BQ >= ROWS, "the K and V tiles are staged in the Q and dout tiles");
  __shared__ __align__(32) E<T> qg[2 * BQ][LD];  // Q rows, then dout rows
  __shared__ __align__(32) float sw[WARPS][16][LS];
  __shared__ __align__(32) float dpw[WARPS][16][LS];
  __shared__ __align__(32) E<T> pw[WARPS][16][LP];
  __shared__ __align__(32) E<T> dsw[WARPS][16][LP];
  __shared__ float qm[BQ], qinv[BQ], qd[BQ];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.z, hk = blockIdx.y, group = p.h / p.hkv;
  const int j0 = blockIdx.x * ROWS, w0 = j0 + 16 * warp;
  const int row = lane / 2, half = lane % 2, j = w0 + row;
  const long long bht = (long long)gridDim.z * p.h * p.t;

  FragA<T> kf[DM / 16], vf[DM / 16];
  Acc dkf[DM / 16], dvf[DM / 16];
  load_rows<T, DM, LD>(qg, ROWS, k + b * p.k_b + hk * p.k_h, p.k_s, j0, p.s, p.d);
  __syncthreads();
#pragma unroll
  for (int c = 0; c < DM / 16; c++) wmma::load_matrix_sync(kf[c], &qg[16 * warp][16 * c], LD);
  __syncthreads();
  load_rows<T, DM, LD>(qg, ROWS, v + b * p.v_b + hk * p.v_h, p.v_s, j0, p.s, p.dv);
  __syncthreads();
#pragma unroll
  for (int c = 0; c < DM / 16; c++) {
    wmma::load_matrix_sync(vf[c], &qg[16 * warp][16 * c], LD);
    wmma::fill_fragment(dkf[c], 0.f);
    wmma::fill_fragment(dvf[c], 0.f);
  }
  __syncthreads();

  // Causal: query i sees key j when j <= i + S - T; the block's first key
  // is first seen by query j0 - (S - T), the warp's by w0 - (S - T).
  const int first = p.causal ? max(j0 - (p.s - p.t), 0) / BQ * BQ : 0;
  const int warp_first = p.causal ? w0 - (p.s - p.t) : 0;
  for (int h = hk * group; h < (hk + 1) * group; h++) {
    for (int i0 = first; i0 < p.t; i0 += BQ) {
      load_rows<T, DM, LD>(qg, BQ, q + b * p.q_b + h * p.q_h, p.q_t, i0, p.t, p.d);
      load_rows<T, DM, LD>(qg + BQ, BQ, dout + b * p.g_b + h * p.g_h, p.g_t, i0, p.t, p.dv);
      for (int r = threadIdx.x; r < BQ; r += 32 * WARPS) {
        int i = i0 + r;
        long long at = ((long long)b * p.h + h) * p.t + i;
        qm[r] = i < p.t ? stats[at] : 0.f;
        qinv[r] = i < p.t ? stats[bht + at] : 0.f;
        qd[r] = i < p.t ? delta[at] : 0.f;
      }
      __syncthreads();
      if (w0 < p.s && i0 + BQ - 1 >= warp_first) {
        // S^T = K Q^T and dP^T = V dO^T.
#pragma unroll
        for (int n = 0; n < BQ / 16; n++) {
          Acc s, dp;
          wmma::fill_fragment(s, 0.f);
          wmma::fill_fragment(dp, 0.f);
#pragma unroll
          for (int c = 0; c < DM / 16; c++) {
            FragBt<T> qt, gt;
            wmma::load_matrix_sync(qt, &qg[16 * n][16 * c], LD);
            wmma::mma_sync(s, kf[c], qt, s);
            wmma::load_matrix_sync(gt, &qg[BQ + 16 * n][16 * c], LD);
            wmma::mma_sync(dp, vf[c], gt, dp);
          }
          wmma::store_matrix_sync(&sw[warp][0][16 * n], s, LS, wmma::mem_row_major);
          wmma::store_matrix_sync(&dpw[warp][0][16 * n], dp, LS, wmma::mem_row_major);
        }
        __syncwarp();
        // P^T and dS^T for key j against the tile's queries.
#pragma unroll
        for (int c = 0; c < BQ / 2; c++) {
          int col = half * (BQ / 2) + c, i = i0 + col;
          float pr = 0.f, ds = 0.f;
          if (j < p.s && i < p.t && qinv[col] != 0.f && (!p.causal || j <= i + p.s - p.t)) {
            float s = sw[warp][row][col] * p.scale;
            if (p.has_mask) s += load(mask[b * p.m_b + h * p.m_h + i * p.m_t + j * p.m_s]);
            pr = expf(s - qm[col]) * qinv[col];
            ds = pr * (dpw[warp][row][col] - qd[col]);
          }
          put<T>(&pw[warp][row][col], store<T>(pr));
          put<T>(&dsw[warp][row][col], store<T>(ds));
        }
        __syncwarp();
        // dV += P^T dO and dK += dS^T Q.
#pragma unroll
        for (int n = 0; n < BQ / 16; n++) {
          FragA<T> pf, sf;
          wmma::load_matrix_sync(pf, &pw[warp][0][16 * n], LP);
          wmma::load_matrix_sync(sf, &dsw[warp][0][16 * n], LP);
#pragma unroll
          for (int c = 0; c < DM / 16; c++) {
            FragB<T> gr, qr;
            wmma::load_matrix_sync(gr, &qg[BQ + 16 * n][16 * c], LD);
            wmma::mma_sync(dvf[c], pf, gr, dvf[c]);
            wmma::load_matrix_sync(qr, &qg[16 * n][16 * c], LD);
            wmma::mma_sync(dkf[c], sf, qr, dkf[c]);
          }
        }
      }
      __syncthreads();
    }
  }
  // sw is free: the last tile's products are read.
#pragma unroll
  for (int c = 0; c < DM / 16; c++) {
    spill<LS>(&sw[warp][0][0], dkf[c]);
    for (int e = lane; e < 256; e += 32) {
      int r = e / 16, f = 16 * c + e % 16, jj = w0 + r;
      if (jj < p.s && f < p.d)
        dk[p.dk_o + b * p.dk_b + hk * p.dk_h + jj * p.dk_s + f] = store<T>(sw[warp][r][e % 16] * p.scale);
    }
    __syncwarp();
    spill<LS>(&sw[warp][0][0], dvf[c]);
    for (int e = lane; e < 256; e += 32) {
      int r = e / 16, f = 16 * c + e % 16, jj = w0 + r;
      if (jj < p.s && f < p.dv)
        dv[p.dv_o + b * p.dv_b + hk * p.dv_h + jj * p.dv_s + f] = store<T>(sw[warp][r][e % 16]);
    }
    __syncwarp();
  }
}

// The entry points, per element type and largest head size (64: keys in
// tiles of 64 in the forward; 128: of 32; the backward's tiles: 32).
#define TC_KERNELS(T, NAME, DM, BC)                                                           \
  extern "C" __global__ void __launch_bounds__(32 * WARPS) attention_tc_forward_##NAME##_##DM( \
      const T *q, const T *k, const T *v, const T *mask, T *out, float *stats, Shape p) {     \
    tc_forward<T, DM, BC>(q, k, v, mask, out, stats, p);                                       \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(32 * WARPS)                                     \
      attention_tc_backward_dq_##NAME##_##DM(const T *q, const T *k, const T *v,               \
                                             const T *mask, const T *out, const T *dout,       \
                                             const float *stats, T *dq, float *delta,          \
                                             Shape p) {                                        \
    tc_backward_dq<T, DM, 32>(q, k, v, mask, out, dout, stats, dq, delta, p);                  \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(32 * WARPS)                                     \
      attention_tc_backward_dkv_##NAME##_##DM(const T *q, const T *k, const T *v,              \
                                              const T *mask, const T *dout,                    \
                                              const float *stats, const float *delta, T *dk,   \
                                              T *dv, Shape p) {                                \
    tc_backward_dkv<T, DM, 32>(q, k, v, mask, dout, stats, delta, dk, dv, p);                  \
  }

TC_KERNELS(__half, f16, 64, 64)
TC_KERNELS(__half, f16, 128, 32)
TC_KERNELS(bf16_t, bf16, 64, 64)
TC_KERNELS(bf16_t, bf16, 128, 32)

#endif  // compute capability 8.0
